"""Pipeline stages (parallel.pipeline_stages=2) against plain single-process PyTorch, at S=2 x D
replicas for any even world size. Needs Horovod's MPI controller and a world made with
World.init(groups=True): tests/integration/test_pipeline_runs.py runs this file so, at 2 and 4 ranks.
Under Gloo only the refusal runs."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import blobs, flat_params, lm_loss, shared_tmpdir, small_config, text, tiny_gpt
from torch import nn

import hvdtrain
from hvdtrain.config import CheckpointConfig, CommConfig, MemoryConfig, OptimConfig, ParallelConfig
from hvdtrain.errors import ConfigError
from hvdtrain.parallel.layout import Layout

STEPS = 4


@pytest.fixture
def pipe_world(world):
    if world.controller != "mpi" or not world.groups or world.size % 2:
        pytest.skip("pipeline runs need the MPI controller, World.init(groups=True) and an even world size")
    return world


def deep_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def config(world, optim="sgd", clip=0.0, accumulation=2, schedule="1f1b", balance="params", steps=STEPS, **extra):
    cfg = small_config(epochs=1, max_steps=steps, accumulation=accumulation, on_oom="stop")
    lr = {"sgd": 0.05, "adam": 1e-2}[optim]
    return dataclasses.replace(cfg, optim=OptimConfig(name=optim, lr=lr, momentum=0.9, lr_scaling="none",
                                                      clip_grad_norm=clip),
                               parallel=ParallelConfig(pipeline_stages=2, schedule=schedule, balance=balance), **extra)


def reference(model, data, cfg, replicas, loss_fn):
    """Plain PyTorch on one process: each step's global batch (replicas x accumulation x batch) at once."""
    oc = cfg.optim
    opt = torch.optim.SGD(model.parameters(), lr=oc.lr, momentum=oc.momentum) if oc.name == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=oc.lr)
    batch = replicas * cfg.train.accumulation * cfg.train.batch_size
    losses = []
    for step in range(cfg.train.max_steps):
        x, y = data[step * batch:(step + 1) * batch]
        loss, _ = loss_fn(model, (x, y))
        opt.zero_grad()
        loss.backward()
        if oc.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), oc.clip_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses


def classify(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(1) == y).sum()}


@pytest.mark.parametrize("optim, clip, accumulation, schedule, balance", [
    ("sgd", 0.0, 1, "1f1b", "params"), ("sgd", 0.0, 4, "1f1b", "time"), ("adam", 0.5, 4, "1f1b", "params"),
    ("sgd", 0.0, 4, "gpipe", "5,2")])
def test_pipeline_matches_single_process_training(pipe_world, optim, clip, accumulation, schedule, balance):
    data = blobs(n=192)
    cfg = config(pipe_world, optim, clip, accumulation, schedule, balance)
    replicas = pipe_world.size // 2
    ref_model = deep_mlp()
    ref_losses = reference(ref_model, data, cfg, replicas, classify)
    model = deep_mlp()
    result = hvdtrain.fit(pipe_world, model, None, data, cfg, eval_set=data, loss_fn=classify)
    losses = [h["loss"] for h in result.history if "loss" in h and "eval" not in str(h.get("kind", ""))][:STEPS]
    assert result.step == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # This rank's stage ends with the reference's weights; the other stages' are freed here.
    kept = [(i, m) for i, m in enumerate(model) if any(p.numel() for p in m.parameters())]
    assert kept and len(kept) < len(model)
    for i, layer in kept:
        torch.testing.assert_close(flat_params(layer), flat_params(ref_model[i]), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ref_eval = F.cross_entropy(ref_model(data.tensors[0]), data.tensors[1]).item()
    assert result.eval["loss"] == pytest.approx(ref_eval, rel=1e-5)


@pytest.mark.parametrize("precision, compression, error_feedback, tol", [
    ("bf16", "none", False, 2e-2), ("fp16", "none", False, 2e-3), ("fp32", "fp16", True, 1e-3),
    ("fp32", "bf16", False, 1e-2)])
def test_pipeline_autocast_and_compression_track_fp32(pipe_world, precision, compression, error_feedback, tol):
    # fp16: the last stage scales the loss, every stage unscales with the same scale; the codecs
    # compress each stage's gradients among its replicas (at D=1 there is nothing to send).
    data = blobs(n=192)
    base = config(pipe_world, "sgd", 0.5, 2)
    ref_losses = reference(deep_mlp(), data, base, pipe_world.size // 2, classify)
    cfg = dataclasses.replace(base, memory=MemoryConfig(precision=precision),
                              comm=CommConfig(compression=compression, error_feedback=error_feedback))
    result = hvdtrain.fit(pipe_world, deep_mlp(), None, data, cfg, loss_fn=classify)
    losses = [h["loss"] for h in result.history if "loss" in h][:STEPS]
    assert result.skipped == 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)


def test_a_non_finite_gradient_on_one_stage_skips_the_step_on_every_rank(pipe_world):
    # Only the first stage's gradient turns NaN (at its second step); the last stage's stays finite,
    # yet every rank of both stages must skip that step, and only that one.
    data = blobs(n=192)
    model = deep_mlp()
    calls = []

    def poison(grad):
        calls.append(1)
        return grad * float("nan") if len(calls) == 2 else grad

    model[0].weight.register_hook(poison)
    cfg = config(pipe_world, "sgd", 0.0, 1, balance="1,6")
    result = hvdtrain.fit(pipe_world, model, None, data, cfg, loss_fn=classify)
    assert result.step == STEPS and result.skipped == 1
    skipped = pipe_world.allgather_object(result.skipped, name="test.pipe.skipped")
    assert skipped == [1] * pipe_world.size


@pytest.mark.parametrize("schedule, checkpointing", [("1f1b", False), ("gpipe", False), ("1f1b", True)])
def test_pipeline_gpt_with_tied_embedding_matches_single_process(pipe_world, schedule, checkpointing):
    # The first stage embeds with the weight the last stage projects with: their gradients are summed.
    # SGD: Adam turns the rounding noise of near-zero gradients (attention's key bias) into full-size
    # steps, and micro-batches sum in another order than the reference's one batch.
    data = text(n=128)
    cfg = config(pipe_world, "sgd", 1.0, 2, schedule, memory=MemoryConfig(activation_checkpointing=checkpointing))
    ref_model = tiny_gpt()
    ref_losses = reference(ref_model, data, cfg, pipe_world.size // 2, lm_loss)
    model = tiny_gpt()
    result = hvdtrain.fit(pipe_world, model, None, data, cfg, loss_fn=lm_loss)
    losses = [h["loss"] for h in result.history if "loss" in h][:STEPS]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    trained = {n.replace(".module.", "."): p for n, p in model.named_parameters(remove_duplicate=False) if p.numel()}
    ref = dict(ref_model.named_parameters(remove_duplicate=False))
    assert "tok.weight" in trained or "head.weight" in trained  # every stage holds the tied weight
    for name, p in trained.items():
        torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-6, msg=name)
    initial = dict(tiny_gpt().named_parameters(remove_duplicate=False))
    assert any(not torch.equal(p, initial[name]) for name, p in trained.items())  # it trained


def test_pipeline_checkpoint_resumes_to_the_uninterrupted_run(pipe_world):
    data = blobs(n=192)
    whole = deep_mlp()
    hvdtrain.fit(pipe_world, whole, None, data, config(pipe_world, "adam", steps=6), loss_fn=classify)
    folder = shared_tmpdir(pipe_world)
    ckpt = CheckpointConfig(dir=folder, every=3)
    hvdtrain.fit(pipe_world, deep_mlp(), None, data, config(pipe_world, "adam", steps=3, checkpoint=ckpt),
                 loss_fn=classify)
    resumed = deep_mlp(seed=1)  # other initial weights: everything must come from the checkpoint
    result = hvdtrain.fit(pipe_world, resumed, None, data,
                          config(pipe_world, "adam", steps=6, checkpoint=dataclasses.replace(ckpt, resume="latest")),
                          loss_fn=classify)
    assert result.step == 6 and result.checkpoint and "step_00000006" in result.checkpoint
    mine = [(a, b) for a, b in zip(resumed, whole) if any(p.numel() for p in a.parameters())]
    assert mine
    for a, b in mine:
        torch.testing.assert_close(flat_params(a), flat_params(b), rtol=1e-6, atol=1e-7)


def test_pipeline_layout_puts_a_replicas_stages_on_neighbouring_ranks(pipe_world):
    layout = Layout.of(2, pipe_world.size)
    assert layout.stage_ranks(0) == list(range(0, pipe_world.size, 2))
    assert [layout.stage(r) for r in range(4)] == [0, 1, 0, 1]


def test_pipeline_stages_are_refused_under_gloo(world):
    if world.controller != "gloo":
        pytest.skip("the refusal is Gloo's")
    with pytest.raises(ConfigError, match="needs Horovod's MPI controller"):
        hvdtrain.fit(world, deep_mlp(), None, blobs(n=64), config(world), loss_fn=classify)
