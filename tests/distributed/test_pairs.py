"""Pairs of features that docs/memory.md's table says work together, outside ZeRO (whose pairs are
in test_zero3.py): each run against the same run without the second feature."""

import dataclasses
import math

import pytest
import torch
from helpers import flat_params, lm_loss, small_config, text, tiny_gpt
from test_adaptive import Indexed, adaptive_records, growing_config, recording_loss

import hvdtrain
from hvdtrain.config import MemoryConfig

FEATURES = {
    "fp16 autocast": {"memory": {"precision": "fp16"}},
    "bf16 autocast": {"memory": {"precision": "bf16"}},
    "fp16 compression": {"comm": {"compression": "fp16"}},
    "bf16 compression": {"comm": {"compression": "bf16"}},
    "fp16 compression + error feedback": {"comm": {"compression": "fp16", "error_feedback": True}},
    "bf16 autocast + fp16 compression + error feedback": {"memory": {"precision": "bf16"},
                                                           "comm": {"compression": "fp16", "error_feedback": True}},
    "fp16 autocast + bf16 compression": {"memory": {"precision": "fp16"}, "comm": {"compression": "bf16"}},
    "fp16 autocast + fp16 compression + error feedback": {"memory": {"precision": "fp16"},
                                                           "comm": {"compression": "fp16", "error_feedback": True}},
}


def with_feature(cfg, feature, **memory):
    parts = FEATURES.get(feature, {})
    mem = dataclasses.replace(cfg.memory, **{**parts.get("memory", {}), **memory})
    comm = dataclasses.replace(cfg.comm, **parts.get("comm", {}))
    return dataclasses.replace(cfg, memory=mem, comm=comm)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_activation_checkpointing_changes_nothing_beside(world, feature):
    # The recomputation runs the same ops under the same autocast and RNG state, so checkpointing
    # leaves every other feature's numbers as they were (accumulation of 2 in both runs).
    runs = {}
    for checkpointing in (False, True):
        model = tiny_gpt()
        cfg = with_feature(small_config(epochs=1, batch_size=4, accumulation=2), feature,
                           activation_checkpointing=checkpointing)
        result = hvdtrain.fit(world, model, None, text(), cfg, loss_fn=lm_loss)
        runs[checkpointing] = (flat_params(model), result.skipped)
    assert runs[True][1] == runs[False][1] == 0  # and the features train together: no step skipped
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(runs[True][0]).all() and not torch.equal(runs[True][0], flat_params(tiny_gpt()))


def test_adaptive_with_activation_checkpointing_takes_the_same_schedule(world):
    data = Indexed(160 * world.size)
    runs = {}
    for checkpointing in (False, True):
        cfg = growing_config(max_micro_batch=0)
        cfg = dataclasses.replace(cfg, memory=MemoryConfig(activation_checkpointing=checkpointing))
        model = _blocks_mlp()
        result = hvdtrain.fit(world, model, None, data, cfg, loss_fn=recording_loss([]))
        runs[checkpointing] = ([(r["step"], r["m"], r["k"], r["B"]) for r in adaptive_records(result.history)],
                               flat_params(model))
    assert runs[True][0] == runs[False][0] and runs[False][0][-1][3] > runs[False][0][0][3]
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("feature, rel", [("bf16 autocast", 0.1), ("fp16 compression", 0.05),
                                          ("bf16 compression", 0.1), ("fp16 compression + error feedback", 0.05)])
def test_adaptive_measures_the_same_noise_beside(world, feature, rel):
    # The statistics read fp32 gradients (local) and the averaged gradient as it arrives (through
    # the codec, or from bf16 activations): |ḡ|² at the first decision stays within `rel` of the
    # plain run's, and the batch grows alike.
    data = Indexed(160 * world.size)
    runs = {}
    for name in ("plain", feature):
        cfg = growing_config(max_micro_batch=0)
        cfg = with_feature(cfg, name) if name != "plain" else cfg
        result = hvdtrain.fit(world, _blocks_mlp(), None, data, cfg, loss_fn=recording_loss([]))
        runs[name] = adaptive_records(result.history)
    first = {name: next(r["g2"] for r in records if r["g2"] and math.isfinite(r["g2"]))
             for name, records in runs.items()}
    assert first[feature] == pytest.approx(first["plain"], rel=rel)
    assert [r["B"] for r in runs[feature]] == [r["B"] for r in runs["plain"]]


def _blocks_mlp(seed=3):
    """The tests' MLP with its layers in a `blocks` ModuleList (what memory.activation_checkpointing wraps)."""
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh()),
                                               torch.nn.Linear(32, 3)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return Net()

