"""Memory toolkit in one process: config errors, activation checkpointing against plain models,
the loss scaler, and the activation meter against hand-counted bytes."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain import checkpoint_modules
from hvdtrain.activations import Checkpointed, checkpoint_blocks
from hvdtrain.config import ModelConfig, build
from hvdtrain.errors import ConfigError
from hvdtrain.precision import LossScaler, Precision
from hvdtrain.profile.memory import ActivationMeter
from hvdtrain.tasks.models import GPT, DigitsCNN, ResNet


@pytest.mark.parametrize("override, message", [
    ("memory.precision=fp8", "memory.precision='fp8' is not allowed; choose one of fp32, bf16, fp16"),
    ("memory.trace_steps=7-5", "memory.trace_steps='7-5' needs 1 <= first <= last"),
    ("memory.trace_steps=abc", "memory.trace_steps='abc' must look like 5-7"),
    ("memory.loss_scale=0", "memory.loss_scale=0.0 must be > 0"),
    ("memory.scale_growth_interval=0", "memory.scale_growth_interval=0 must be >= 1"),
    ("memory.activation_checkpointing=1", "memory.activation_checkpointing=1 has type int; expected bool"),
])
def test_bad_memory_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build(None, [override])


def test_trace_needs_a_log_dir():
    with pytest.raises(ConfigError, match="memory.trace_steps needs log.dir"):
        build(None, ["memory.trace_steps=2-3"])
    assert build(None, ["memory.trace_steps=4-4", "log.dir=/tmp/x"]).memory.trace_steps == "4-4"


def grads_after_backward(model, x, loss_of=lambda out: out.float().pow(2).mean()):
    torch.manual_seed(123)  # the same dropout masks in both runs
    model.zero_grad(set_to_none=True)
    loss_of(model(x)).backward()
    return [p.grad.clone() for p in model.parameters()]


def gpt():
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, dropout=0.1))


@pytest.mark.parametrize("build_model, x", [
    (gpt, torch.randint(0, 256, (4, 16))),
    (lambda: torch.manual_seed(0) and DigitsCNN(8), torch.randn(6, 1, 8, 8)),
    (lambda: torch.manual_seed(0) and ResNet(8), torch.randn(4, 3, 16, 16)),
])
def test_checkpointed_blocks_give_the_plain_gradients_and_state(build_model, x):
    plain = build_model()
    wrapped = copy.deepcopy(plain)
    assert checkpoint_blocks(wrapped) == len(plain.blocks)
    assert all(isinstance(b, Checkpointed) for b in wrapped.blocks)
    expected, got = grads_after_backward(plain, x), grads_after_backward(wrapped, x)
    assert len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))
    # Same keys and values (BatchNorm running stats took one update, not two).
    a, b = plain.state_dict(), wrapped.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    checkpoint_blocks(wrapped)  # idempotent
    assert not any(isinstance(b.module, Checkpointed) for b in wrapped.blocks)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("match, wrapped", [((nn.GELU,), 3), (("encoder.*",), 3), (("encoder.1", nn.Linear), 4)])
def test_user_helper_by_type_or_name_keeps_gradients(match, wrapped):
    torch.manual_seed(0)
    plain, x = Net(), torch.randn(5, 16)
    model = copy.deepcopy(plain)
    assert checkpoint_modules(model, *match) == wrapped
    assert all(torch.equal(a, b) for a, b in zip(grads_after_backward(plain, x), grads_after_backward(model, x)))
    model.load_state_dict(plain.state_dict())  # plain checkpoints load into the wrapped model


def test_user_helper_errors_when_nothing_matches():
    with pytest.raises(ConfigError, match="no submodule matches Conv2d, 'decoder.*'"):
        checkpoint_modules(Net(), nn.Conv2d, "decoder.*")
    with pytest.raises(ConfigError, match="needs a model with a `blocks` nn.ModuleList"):
        checkpoint_blocks(Net())


def test_loss_scaler_backs_off_grows_and_round_trips():
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    assert [s.update(v) for v in (True, False, True, True, True)] == [1.0, 0.5, 1.0, 1.0, 2.0]
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(True)
    again = LossScaler()
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == {"scale": 1024.0, "good_steps": 1}


def test_fp16_step_unscales_exactly_and_skips_non_finite():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    amp = Precision("fp16", "cpu", LossScaler(init_scale=256.0))
    x = torch.randn(3, 4)
    amp.backward(model(x).pow(2).mean())
    ref(x).pow(2).mean().backward()
    assert torch.equal(model.weight.grad, ref.weight.grad * 256)
    amp.step(opt, list(model.parameters()), True, 0.0)
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    before = [p.clone() for p in model.parameters()]
    amp.step(opt, list(model.parameters()), False, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert amp.report() == {"loss_scale": 128.0}


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_on_cpu_runs_matmuls_in_low_precision(mode, dtype):
    amp = Precision(mode, "cpu")
    with amp.forward():
        y = nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == dtype
    with Precision("fp32", "cpu").forward():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


def test_activation_meter_counts_saved_bytes_exactly():
    b, d, h = 5, 12, 32
    model = nn.Sequential(nn.Linear(d, h, bias=False), nn.ReLU())
    x = torch.randn(b, d)
    meter = ActivationMeter(model)
    with meter.measure():
        model(x).sum().backward()
    # Linear keeps its input (the weight is a parameter, not counted); ReLU keeps its output.
    assert meter.peak == (b * d + b * h) * 4
    wrapped = nn.Sequential(Checkpointed(model))
    meter = ActivationMeter(wrapped)
    with meter.measure():
        wrapped(x).sum().backward()
    assert meter.peak == b * d * 4  # only the block's input is held until backward


def test_activation_meter_keeps_the_largest_micro_batch():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh())
    meter = ActivationMeter(model)
    with meter.measure():
        for rows in (3, 7, 2):
            F.mse_loss(model(torch.randn(rows, 8)), torch.zeros(rows, 8)).backward()
    # Linear's input, Tanh's output, and the target mse_loss keeps: 3 x rows x 8 floats each time.
    assert meter.peak == 3 * 7 * 8 * 4


@pytest.mark.parametrize("argv, message", [
    (["--variants", "fp64"], "--variants 'fp64' is not allowed; a precision (fp32, bf16, fp16) and optional"),
    (["--variants", "fp32+z2+pf0"], "--variants 'fp32+z2+pf0' is not allowed"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_bench_memory_rejects_bad_flags(argv, message, capsys):
    from hvdtrain.tools import cli

    assert cli.main(["bench", "memory", *argv]) == 2
    assert message in capsys.readouterr().err
