"""The planner's formulas against hand-computed values, and its input errors."""

import dataclasses

import pytest
import torch

from hvdtrain.config import Config, MemoryConfig, ModelConfig, build
from hvdtrain.errors import ConfigError
from hvdtrain.tasks.models import GPT, count_parameters
from hvdtrain.tools import plan
from hvdtrain.tools.cli import main


def test_paper_example_7_5b_adam_mixed_precision_64_ranks():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, K=12, N=64 -> 120, 31.4, 16.6 GB per device.
    psi = 7_500_000_000
    totals = [plan.memory(psi, 64, s, "adam", "fp16")["total"] for s in (0, 1, 2)]
    assert totals == [120e9, 30e9 + 12 * psi / 64, 15e9 + 14 * psi / 64]
    assert round(totals[1] / 1e9, 1) == 31.4 and round(totals[2] / 1e9, 1) == 16.6


def test_fp32_adam_and_sgd_by_category():
    psi, n = 1000, 4
    assert plan.memory(psi, n, 0, "adamw", "fp32") == {"params": 4000, "grads": 4000, "optimizer": 8000,
                                                         "total": 16000}
    assert plan.memory(psi, n, 1, "adam", "fp32") == {"params": 4000, "grads": 4000, "optimizer": 2000,
                                                        "total": 10000}
    assert plan.memory(psi, n, 2, "adam", "fp32") == {"params": 4000, "grads": 1000, "optimizer": 2000,
                                                        "total": 7000}
    assert plan.memory(psi, n, 0, "sgd", "fp32")["optimizer"] == 4000  # momentum buffer
    assert plan.memory(psi, n, 0, "sgd", "fp32", momentum=False)["optimizer"] == 0
    assert plan.memory(psi, n, 2, "sgd", "bf16")["optimizer"] == 8 * psi / n  # fp32 master + momentum


def test_ring_model_times():
    gb = 1e9
    # 1 GB allreduce on 4 ranks at 10 Gbit/s (1.25e9 B/s): 2*3/4 * 1e9 / 1.25e9 = 1.2 s.
    assert plan.ring_seconds("allreduce", gb, 4, 1.25e9, 0.0) == pytest.approx(1.2)
    assert plan.ring_seconds("reducescatter", gb, 4, 1.25e9, 0.0) == pytest.approx(0.6)
    # Latency: 2(N-1) messages per bucket for allreduce.
    assert plan.ring_seconds("allreduce", 0, 4, 1.25e9, 1e-4, buckets=2) == pytest.approx(12e-4)
    assert plan.ring_seconds("allgather", gb, 1, 1.0, 1.0) == 0.0
    c = plan.comm(250_000_000, 4, 2, "fp32", "none", 1.25e9, 0.0, 2**40)
    assert c["reducescatter"] == pytest.approx(0.6) and c["allgather"] == pytest.approx(0.6)
    c = plan.comm(250_000_000, 4, 1, "fp32", "fp16", 1.25e9, 0.0, 2**40)
    assert c["allreduce"] == pytest.approx(0.6) and c["total"] == pytest.approx(1.2)  # fp16 gradients


def test_zero3_shards_everything_and_adds_the_gathered_units():
    psi, n = 1000, 4
    assert plan.memory(psi, n, 3, "adam", "fp32", in_flight=300) == {"params": 1000 + 1200, "grads": 1000,
                                                                     "optimizer": 2000, "total": 5200}
    # Two allgathers per step (forward and backward) and one reduce-scatter: 1.5x stage 2's data.
    c2 = plan.comm(250_000_000, 4, 2, "fp32", "none", 1.25e9, 0.0, 2**40)
    c3 = plan.comm(250_000_000, 4, 3, "fp32", "none", 1.25e9, 0.0, 2**40, units=10)
    assert c3["total"] == pytest.approx(1.5 * c2["total"])


def test_zero3_in_flight_is_the_root_and_the_largest_units():
    cfg = Config(task="pylm", model=ModelConfig(n_layer=4, n_head=2, n_embd=48, block_size=32))
    model = GPT(cfg.model)
    block = count_parameters(model.blocks[0])
    root = model.tok.weight.numel()  # tied to the output layer: two units claim it
    n = 2
    pad = lambda k: -(-k // n) * n  # noqa: E731
    assert plan.zero3_in_flight(cfg, n) == (pad(root) + 2 * pad(block), 4 + 2 + 1)  # blocks, pos, ln_f, root
    prefetch2 = dataclasses.replace(cfg, memory=MemoryConfig(zero3_prefetch=2))
    assert plan.zero3_in_flight(prefetch2, n)[0] == pad(root) + 3 * pad(block)


def test_model_parameter_count_matches_the_built_model():
    cfg = Config(task="pylm", model=ModelConfig(n_layer=3, n_head=2, n_embd=48))
    torch.manual_seed(0)
    assert plan.count_model_params(cfg) == count_parameters(GPT(cfg.model))


def test_largest_depth_fits_and_one_more_does_not():
    cfg = Config(task="pylm", model=ModelConfig(preset="small"))
    budget = 2**29
    best = plan.largest_layers(cfg, budget, 2, 2, "adam", "fp32")
    per_layer = 12 * 384 * 384 + 13 * 384  # attention, MLP, two layer norms
    assert plan.memory(best["params"], 2, 2, "adam", "fp32")["total"] <= budget
    assert plan.memory(best["params"] + per_layer, 2, 2, "adam", "fp32")["total"] > budget
    assert plan.largest_layers(cfg, budget, 2, 0, "adam", "fp32")["n_layer"] < best["n_layer"]


@pytest.mark.parametrize("call", [
    lambda: plan.memory(10, 2, 4, "adam", "fp32"),
    lambda: plan.memory(10, 2, 0, "lamb", "fp32"),
    lambda: plan.memory(10, 2, 0, "adam", "fp8"),
    lambda: plan.memory(0, 2, 0, "adam", "fp32"),
    lambda: plan.memory(10, 0, 0, "adam", "fp32"),
])
def test_bad_inputs_raise_config_error(call):
    with pytest.raises(ConfigError):
        call()


@pytest.mark.parametrize("argv, message", [
    (["--params", "10", "--zero-stage", "4"], "--zero-stage='4' is not allowed"),
    (["--params", "10", "--precision", "fp8"], "--precision='fp8' is not allowed"),
    (["--params", "10", "--bandwidth", "0"], "--bandwidth must be > 0"),
    (["--params", "10", "--measure"], "--measure runs a built-in task in fp32"),
    (["--task", "digits", "--budget-gb", "1"], "--budget-gb searches pylm depths"),
])
def test_cli_input_errors_are_one_line_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_memory_config_allows_stages_0_to_3_only():
    assert build(overrides=["memory.zero_stage=2"]).memory == MemoryConfig(zero_stage=2)
    with pytest.raises(ConfigError, match=r"memory.zero_stage=4 is not allowed; choose one of 0, 1, 2, 3"):
        MemoryConfig(zero_stage=4)
    # Stage 3 refuses error feedback in one line naming the setting; it takes adaptive batch sizing.
    assert build(overrides=["memory.zero_stage=3"]).train.on_oom == "retry"
    with pytest.raises(ConfigError, match=r"comm.error_feedback cannot be combined with memory.zero_stage=3"):
        build(overrides=["memory.zero_stage=3", "comm.error_feedback=true"])
    assert build(overrides=["memory.zero_stage=3", "adaptive.enabled=true"]).adaptive.enabled
    assert build(overrides=["memory.zero_stage=2", "adaptive.enabled=true", "memory.precision=fp16"])
    with pytest.raises(ConfigError, match=r"memory.zero_stage=2 cannot be combined with elastic.enabled=true"):
        build(overrides=["memory.zero_stage=2", "elastic.enabled=true"])
    with pytest.raises(ConfigError, match=r"memory.zero3_prefetch=-1 must be >= 0"):
        MemoryConfig(zero3_prefetch=-1)
    assert dataclasses.asdict(Config())["memory"]["zero_stage"] == 0


def test_plan_splits_pylm_memory_over_pipeline_stages():
    from hvdtrain.config import Config, from_dict
    from hvdtrain.tools.plan import count_model_params, memory, pipeline_plan

    cfg = from_dict(Config, {"task": "pylm", "model": {"preset": "small"},
                             "train": {"on_oom": "stop", "accumulation": 4}, "parallel": {"pipeline_stages": 2}})
    planned = pipeline_plan(cfg, 4, "adam", "fp32")
    assert (planned["stages"], planned["replicas"], planned["bubble"]) == (2, 2, 0.2)
    stages = planned["per_stage"]
    # The tied embedding sits on both ends; everything else on exactly one stage.
    tied = 256 * cfg.model.n_embd
    assert sum(s["params"] for s in stages) == count_model_params(cfg) + tied
    whole = memory(count_model_params(cfg), 2, 0, "adam", "fp32")["total"]
    assert all(s["memory"]["total"] < 0.6 * whole for s in stages)
    assert [s["live_micro_batches"] for s in stages] == [2, 1]
