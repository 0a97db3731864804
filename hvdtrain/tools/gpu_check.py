"""The checks scripts/gpu_check.sh runs on one GPU (one rank): the CUDA paths of the toolkit that no
CPU machine can run. One JSON line per check on stdout, {"check", "status", ...numbers, "reason"},
status pass, fail or skip; exit 1 if any failed.

Without a GPU the CPU-safe checks run on CPU (the Horovod build, ZeRO with a checkpoint, the loss
scale's overflow skip, activation checkpointing's saved bytes) and every GPU check prints a skip
that says what it would have checked; where a CPU variant of a GPU check exists (the codecs over
Gloo), it runs and the skip says so.

    python -m hvdtrain.tools.gpu_check [--work DIR] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.config import CheckpointConfig, Config, LogConfig, MemoryConfig, OptimConfig, TrainConfig
from hvdtrain.world import World

ROOT = Path(__file__).resolve().parents[2]
Result = tuple[str, str, dict[str, Any]]  # status, reason, numbers


def skip(reason: str, **numbers: Any) -> Result:
    return "skip", reason, numbers


def verdict(ok: bool, why_not: str, **numbers: Any) -> Result:
    return ("pass", "", numbers) if ok else ("fail", why_not, numbers)


def no_gpu(what: str) -> Result:
    return skip(f"no CUDA GPU: {what}")


# ---------------------------------------------------------------- small models and data

def blobs(n: int = 256, dim: int = 16, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, dim, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, dim, generator=g), y)


def mlp(dim: int = 16, classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, classes))


def small_cfg(steps: int, **sections: Any) -> Config:
    return Config(train=TrainConfig(batch_size=16, epochs=50, max_steps=steps, shuffle=False),
                  optim=OptimConfig(name="sgd", lr=0.05, momentum=0.9),
                  log=LogConfig(progress=False, tensorboard=False), **sections)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """No TF32 in matmuls and convolutions, so a GPU run can be compared with the CPU reference."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on(world: World, device: str) -> World:
    return dataclasses.replace(world, device=torch.device(device))


# ---------------------------------------------------------------- checks

def horovod_build(world: World, work: Path) -> Result:
    built = World.horovod_build()
    cuda = torch.cuda.is_available()
    ok = built["gloo"] and (built["nccl"] or not cuda)
    return verdict(ok, "Horovod lacks Gloo" if not built["gloo"] else "a GPU but Horovod has no NCCL",
                   torch=torch.__version__, torch_cuda=torch.version.cuda or "", gpu=_gpu_name(), **built)


def train_matches_cpu(world: World, work: Path) -> Result:
    """1 rank, 30 steps of fit on the GPU against the same fit on CPU: the same weights (fp32)."""
    if not torch.cuda.is_available():
        return no_gpu("1-rank training on the GPU against the CPU reference")
    runs = {}
    with exact_fp32():
        for device in ("cuda", "cpu"):
            model = mlp()
            hvdtrain.fit(on(world, device), model, None, blobs(), small_cfg(30))
            runs[device] = flat(model)
    err = float((runs["cuda"] - runs["cpu"]).abs().max())
    return verdict(err < 1e-4, f"GPU and CPU weights differ by {err:.2e}", max_abs_diff=err, steps=30)


def codecs(world: World, work: Path) -> Result:
    """The reducer's codecs on this device at one rank (NCCL on CUDA tensors): none, fp16 and bf16
    against the exact value, and fp16 error feedback carrying a gradient fp16 cannot hold."""
    from hvdtrain.comm.compression import make_codec
    from hvdtrain.comm.reducer import GradReducer

    device = world.device
    g = torch.Generator().manual_seed(0)
    bucket = torch.randn(1 << 20, generator=g).to(device)
    errors = {}
    for name in ("none", "fp16", "bf16"):
        codec = make_codec(name, world)  # at one rank the collective still runs (NCCL, Gloo)
        pending = codec.launch(bucket.clone(), name=f"gpu_check.codec.{name}")
        codec.advance(pending)
        got = codec.finish(pending)
        errors[name] = float(((got - bucket).abs() / bucket.abs().clamp_min(1e-3)).max())
    # Error feedback: 1e-8 underflows fp16 (smallest subnormal ~6e-8); the residual brings it through.
    p = nn.Parameter(torch.zeros(4, device=device))
    reducer = GradReducer(world, [("p", p)], "fp16", error_feedback=True)
    total = torch.zeros(4, device=device)
    for _ in range(100):
        p.grad = torch.full((4,), 1e-8, device=device)
        reducer.synchronize()
        total += p.grad
        reducer.zero_grad()
    reducer.remove()
    carried = float(total.mean()) / 1e-6  # 100 steps of 1e-8
    ok = errors["none"] == 0 and errors["fp16"] < 2**-10 and errors["bf16"] < 2**-7 and 0.9 < carried < 1.1
    numbers = dict(rel_error=errors, error_feedback_carried=carried, device=device.type)
    if not ok:
        return "fail", f"codec errors {errors}, error feedback carried {carried:.2f} of the gradient", numbers
    if device.type != "cuda":
        return skip("no CUDA GPU: NCCL not checked (the same codecs passed on CPU over Gloo)", **numbers)
    return "pass", "", numbers


def amp(world: World, work: Path) -> Result:
    """bf16 autocast trains; fp16 with the loss scale skips an overflowing step (weights untouched,
    scale halved) and then steps. On CPU autocast runs too; the check passes there."""
    from hvdtrain.comm.reducer import GradReducer
    from hvdtrain.metrics import MetricSums
    from hvdtrain.precision import LossScaler, Precision
    from hvdtrain.step import Outcome, classification_loss, train_step

    device, data = world.device, blobs()
    batches = [(data.tensors[0][i:i + 32], data.tensors[1][i:i + 32]) for i in range(0, 256, 32)] * 4

    def steps(mode: str, scale: float) -> tuple[list[Outcome], float, nn.Module, Precision]:
        model = mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reducer = GradReducer(world, model.named_parameters())
        precision = Precision(mode, device, LossScaler(scale, growth_interval=1000))
        outcomes = [train_step(model, opt, reducer, [b], classification_loss, MetricSums(), 0.0, device,
                               precision=precision) for b in batches]
        reducer.remove()
        with torch.no_grad():
            loss = float(classification_loss(model, (data.tensors[0].to(device), data.tensors[1].to(device)))[0])
        return outcomes, loss, model, precision

    _, bf16_loss, _, _ = steps("bf16", 1.0)
    # At a loss scale of 2^30 the fp16 gradients overflow: each such step is skipped on weights and
    # optimizer state and halves the scale, until the gradients fit and steps are taken.
    start = flat(mlp().to(device))
    outcomes, fp16_loss, model, precision = steps("fp16", 2.0**30)
    assert precision.scaler is not None
    skipped = outcomes.count(Outcome.SKIPPED)
    moved = bool((flat(model) - start).abs().max() > 0)
    ok = math.isfinite(bf16_loss) and bf16_loss < 1.2 and skipped >= 1 and outcomes[-1] is Outcome.STEPPED \
        and moved and precision.scaler.scale == 2.0**30 * 0.5**skipped
    return verdict(ok, f"bf16 loss {bf16_loss:.3f}, fp16 outcomes {[o.value for o in outcomes]}, "
                   f"scale {precision.scaler.scale}", bf16_loss=bf16_loss, fp16_loss=fp16_loss,
                   fp16_skipped=skipped, final_scale=precision.scaler.scale, device=device.type)


def memory_probe(world: World, work: Path) -> Result:
    """The memory probe against a real CUDA OOM under set_per_process_memory_fraction: the cap it
    finds runs, twice the cap does not; then training at the chosen micro-batch runs without OOM."""
    if not torch.cuda.is_available():
        return no_gpu("the memory probe against a real CUDA OOM (the injected OOM is tested on CPU)")
    from hvdtrain.adaptive.probe import Prober, probe
    from hvdtrain.config import AdaptiveConfig, FaultsConfig, ModelConfig
    from hvdtrain.faults import FaultInjector
    from hvdtrain.tasks.models import GPT

    total = torch.cuda.get_device_properties(world.device).total_memory
    budget = 3 * 2**30
    torch.cuda.set_per_process_memory_fraction(budget / total, world.device)
    try:
        model = GPT(ModelConfig(n_layer=4, n_head=8, n_embd=512, block_size=512)).to(world.device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        data = TensorDataset(torch.randint(0, 256, (4096, 512)), torch.randint(0, 256, (4096, 512)))

        def lm(m: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            x, y = batch
            logits = m(x)
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), {}

        # The probe plans for memory_fraction of the card: here 95% of the cap just set.
        cfg = AdaptiveConfig(memory_fraction=0.95 * budget / total)
        prober = Prober(model, optimizer, data, lm, world.device, FaultInjector(FaultsConfig(), world.rank), world)
        t0 = time.perf_counter()
        found = probe(world, cfg, prober, 8, 4096)
        seconds = time.perf_counter() - t0
        over = prober.step(2 * found.cap)  # real OOM expected: None
        ran = [prober.step(found.cap, update=True) for _ in range(3)]
        torch.cuda.synchronize()
        ok = found.cap >= 1 and over is None and all(r is not None for r in ran)
        return verdict(ok, f"cap {found.cap}: twice the cap ran: {over is not None}, steps at the cap: {ran}",
                       cap=found.cap, preferred=found.preferred, budget_gib=budget / 2**30,
                       probe_s=round(seconds, 2), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, world.device)
        torch.cuda.empty_cache()


def zero_checkpoint(world: World, work: Path) -> Result:
    """ZeRO 1-3 on this device (stage 3 frees and re-allocates CUDA storages per unit): the same
    weights as unsharded training, and a sharded checkpoint resumed to the same weights as an
    uninterrupted run."""
    with exact_fp32():
        ref = mlp()
        hvdtrain.fit(world, ref, None, blobs(), small_cfg(12))
        diffs = {}
        for stage in (1, 2, 3):
            model = mlp()
            hvdtrain.fit(world, model, None, blobs(), small_cfg(12, memory=MemoryConfig(zero_stage=stage)))
            diffs[stage] = float((flat(model) - flat(ref)).abs().max())
        folder = work / "zero-ckpt"
        first = mlp()
        hvdtrain.fit(world, first, None, blobs(),
                     small_cfg(6, memory=MemoryConfig(zero_stage=2), checkpoint=CheckpointConfig(dir=str(folder))))
        resumed = mlp()
        hvdtrain.fit(world, resumed, None, blobs(), small_cfg(12, memory=MemoryConfig(zero_stage=2),
                     checkpoint=CheckpointConfig(dir=str(folder), resume="latest")))
        resume_diff = float((flat(resumed) - flat(ref)).abs().max())
    ok = max(diffs.values()) < 1e-5 and resume_diff < 1e-5
    return verdict(ok, f"ZeRO against unsharded: {diffs}; resumed: {resume_diff:.2e}",
                   max_abs_diff={str(k): v for k, v in diffs.items()}, resumed_diff=resume_diff,
                   device=world.device.type)


def activation_checkpointing(world: World, work: Path) -> Result:
    """A GPT's forward and backward hold less with activation checkpointing: the CUDA allocator's
    peak on a GPU, the bytes autograd saves on CPU."""
    from hvdtrain.activations import checkpoint_blocks
    from hvdtrain.config import ModelConfig
    from hvdtrain.profile.memory import ActivationMeter
    from hvdtrain.tasks.models import GPT

    device = world.device
    x = torch.randint(0, 256, (8, 256), device=device)
    held = {}
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = GPT(ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256)).to(device)
        if wrapped:
            checkpoint_blocks(model)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model(x).float().logsumexp(-1).mean().backward()
            torch.cuda.synchronize()
            held[wrapped] = torch.cuda.max_memory_allocated() - base
        else:
            meter = ActivationMeter(model)
            with meter.measure():
                model(x).float().logsumexp(-1).mean().backward()
            meter.remove()
            held[wrapped] = meter.peak
    ratio = held[True] / held[False]
    return verdict(ratio < 0.7, f"with checkpointing {ratio:.2f} of the memory without",
                   plain_mib=round(held[False] / 2**20, 1), checkpointed_mib=round(held[True] / 2**20, 1),
                   ratio=round(ratio, 3), measured="cuda peak" if device.type == "cuda" else "saved tensors")


def memory_profiler(world: World, work: Path) -> Result:
    """memory.profile on CUDA: its figures against the allocator's own (parameter bytes exactly; the
    step's peak between the model state and torch.cuda.max_memory_allocated)."""
    if not torch.cuda.is_available():
        return no_gpu("the memory profiler's CUDA figures against torch.cuda.max_memory_allocated")
    model = mlp()
    torch.cuda.reset_peak_memory_stats()
    result = hvdtrain.fit(world, model, None, blobs(),
                          small_cfg(5, memory=MemoryConfig(profile=True), log=LogConfig(every=1, progress=False,
                                                                                         tensorboard=False)))
    rows = [r for r in result.history if r["kind"] == "memory"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    top = torch.cuda.max_memory_allocated()
    last = rows[-1] if rows else {}
    ok = bool(rows) and last.get("params") == params and params <= last.get("peak", 0) <= top
    return verdict(ok, f"profiler rows {last}, parameter bytes {params}, allocator peak {top}",
                   params=params, profiler_peak=last.get("peak"), allocator_peak=top, rows=len(rows))


def nvtx(world: World, work: Path) -> Result:
    """The step's NVTX ranges (forward, backward, allreduce wait, optimizer step) as an NVTX tool
    sees them, recorded by scripts/nvtx_recorder.c injected the way Nsight Systems attaches."""
    if not torch.cuda.is_available():
        return no_gpu("NVTX ranges of a training step (hvdtrain pushes them on CUDA only)")
    lib, log = work / "nvtx_recorder.so", work / "nvtx.log"
    built = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(ROOT / "scripts" / "nvtx_recorder.c")],
                           capture_output=True, text=True)
    if built.returncode != 0:
        return "fail", f"could not build the NVTX recorder: {built.stderr.strip()[-300:]}", {}
    code = ("import hvdtrain, torch\nfrom hvdtrain.tools.gpu_check import blobs, mlp, small_cfg\n"
            "w = hvdtrain.World.init()\nhvdtrain.fit(w, mlp(), None, blobs(), small_cfg(3))\n")
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(lib), HVDTRAIN_NVTX_LOG=str(log))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    names = [line[5:] for line in log.read_text().splitlines() if line.startswith("push ")] if log.exists() else []
    want = {"forward", "backward", "allreduce wait", "optimizer step"}
    ok = out.returncode == 0 and want <= set(names)
    return verdict(ok, f"ranges seen: {sorted(set(names))}; exit {out.returncode} {out.stderr.strip()[-300:]}",
                   ranges=sorted(set(names)), pushes=len(names))


def pylm_medium_bf16(world: World, work: Path) -> Result:
    """Step time and achieved TFLOP/s of pylm-medium (86M parameters) in bf16, batch 8 x 512 tokens:
    6 x parameters x tokens per step (forward and backward of the dense layers) plus attention."""
    if not torch.cuda.is_available():
        return no_gpu("pylm-medium step time and TFLOP/s in bf16")
    from hvdtrain.comm.reducer import GradReducer
    from hvdtrain.config import ModelConfig
    from hvdtrain.metrics import MetricSums
    from hvdtrain.precision import Precision
    from hvdtrain.step import train_step
    from hvdtrain.tasks.builtin import lm_loss
    from hvdtrain.tasks.models import GPT, count_parameters

    mc = ModelConfig(preset="medium", block_size=512)
    torch.manual_seed(0)
    model = GPT(mc).to(world.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reducer = GradReducer(world, model.named_parameters())
    precision, sums = Precision("bf16", world.device), MetricSums()
    batch, tokens = 8, 512
    x = torch.randint(0, 256, (batch, tokens), device=world.device)
    times = []
    for i in range(25):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(model, opt, reducer, [(x, x)], lm_loss, sums, 0.0, world.device, precision=precision)
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    reducer.remove()
    step = sorted(times)[len(times) // 2]
    n = count_parameters(model)
    layers, width = mc.n_layer, mc.n_embd
    flops = 6 * n * batch * tokens + 12 * layers * width * tokens * batch * tokens  # + attention scores
    tflops = flops / step / 1e12
    return verdict(math.isfinite(tflops) and tflops > 0, "no step time", params=n, batch=batch, tokens=tokens,
                   step_ms=round(step * 1e3, 2), tflops=round(tflops, 1), gpu=_gpu_name())


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


CHECKS: dict[str, Callable[[World, Path], Result]] = {
    "horovod_build": horovod_build, "train_matches_cpu": train_matches_cpu, "codecs": codecs, "amp": amp,
    "memory_probe": memory_probe, "zero_checkpoint": zero_checkpoint,
    "activation_checkpointing": activation_checkpointing, "memory_profiler": memory_profiler, "nvtx": nvtx,
    "pylm_medium_bf16": pylm_medium_bf16,
}
GPU_CHECKS = {"train_matches_cpu", "codecs", "memory_probe", "memory_profiler", "nvtx", "pylm_medium_bf16"}


def emit(check: str, status: str, reason: str, **numbers: Any) -> None:
    print(json.dumps({"check": check, "status": status, **numbers, "reason": reason}), file=_STDOUT, flush=True)


_STDOUT = sys.stdout  # the JSON lines; what the checks themselves print goes to stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.tools.gpu_check")
    p.add_argument("--work", help="folder for checkpoints and logs (default: a temporary one)")
    p.add_argument("--only", default="", help=f"comma-separated checks (default all: {', '.join(CHECKS)})")
    args = p.parse_args(argv)
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        print(f"gpu_check: unknown check {unknown[0]!r}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    world = World.init()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in only:
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    status, reason, numbers = CHECKS[name](world, work)
            except Exception as exc:  # noqa: BLE001 - a broken check is one failed line, not a traceback
                status, reason, numbers = "fail", f"{type(exc).__name__}: {exc}", {}
            failed += status == "fail"
            emit(name, status, reason, **numbers, seconds=round(time.perf_counter() - t0, 2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
