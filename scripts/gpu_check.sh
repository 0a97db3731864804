#!/usr/bin/env bash
# Acceptance check for a host (or the docker/Dockerfile.gpu image) with NVIDIA GPUs; under 5 minutes.
# Prints one JSON line per check on stdout:
#   {"check": NAME, "status": "pass"|"fail"|"skip", ...numbers, "reason": WHY}
# and exits 1 if any check failed (0 otherwise; skips do not fail). Without a GPU it runs the
# CPU-safe parts (Horovod build, digits and pylm steps on CPU, allreduce bandwidth over Gloo/MPI) and
# prints a skip line with the reason for each GPU check. Progress and launcher output go to stderr.
# Knobs (environment):
#   GPU_CHECK_NP          ranks (default: the number of GPUs; 2 without GPUs)
#   GPU_CHECK_TIMEOUT     seconds allowed for each horovodrun launch (default 150)
#   GPU_CHECK_CONTROLLER  gloo or mpi (default: horovodrun's own choice)
#   HVDTRAIN_PYTHON       interpreter with hvdtrain and Horovod (default: <checkout>/.venv, else python3)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${HVDTRAIN_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=$(command -v python3 || command -v python); fi
fi
"$PY" -c 'import horovod.torch, hvdtrain' 2>/dev/null \
  || { echo "gpu_check: FAILED: $PY cannot import horovod.torch and hvdtrain. Run scripts/install.sh (HVDTRAIN_CUDA=cuXXX on GPU hosts) or set HVDTRAIN_PYTHON." >&2; exit 2; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/gpu_check.py" <<'PYEOF'
"""Launcher side (`main`) and the in-Horovod checks (`worker`, run under horovodrun)."""
import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

MiB = 1 << 20


def emit(check, status, reason="", **numbers):
    print(json.dumps({"check": check, "status": status, **numbers, "reason": reason}), flush=True)


# ---------------------------------------------------------------- worker (every rank)

def worker(out_path):
    import horovod.torch as hvd
    import torch

    from hvdtrain.world import World

    world = World.init()  # the toolkit's own pinning is what gpu_pinning checks
    cuda = torch.cuda.is_available()
    lines = []

    def record(check, status, reason="", **numbers):
        lines.append({"check": check, "status": status, **numbers, "reason": reason})

    record("horovod_build", "pass" if hvd.mpi_built() or hvd.gloo_built() else "fail",
           "" if hvd.mpi_built() or hvd.gloo_built() else "neither MPI nor Gloo built",
           ranks=world.size, mpi=bool(hvd.mpi_built()), gloo=bool(hvd.gloo_built()),
           nccl=bool(hvd.nccl_built()), torch=torch.__version__)

    # NCCL ops: built in, and a real allreduce on device tensors gives the exact sum.
    if not cuda:
        record("nccl_ops", "skip", f"no CUDA GPU (this Horovod has NCCL: {bool(hvd.nccl_built())})")
    elif not hvd.nccl_built():
        record("nccl_ops", "fail", "Horovod built without NCCL: rebuild with HVDTRAIN_CUDA=cuXXX scripts/install.sh")
    else:
        x = torch.full((1024,), float(world.rank + 1), device=world.device)
        got = hvd.allreduce(x, op=hvd.Sum, name="gpu_check.nccl").double().mean().item()
        want = world.size * (world.size + 1) / 2
        record("nccl_ops", "pass" if got == want else "fail", "" if got == want else f"sum {got} != {want}",
               sum=got, expected=want)

    # Pinning: each rank on the GPU of its local rank, no two ranks of a host on one GPU (horovod#287).
    host = os.uname().nodename
    if cuda:
        dev = torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", dev))
        seen = hvd.allgather_object((host, world.local_rank, dev, uuid), name="gpu_check.pin")
        wrong = [s for s in seen if s[1] != s[2]]
        shared = len({(h, u) for h, _, _, u in seen}) != len(seen)
        ok = not wrong and not shared
        record("gpu_pinning", "pass" if ok else "fail",
               "" if ok else f"ranks on the wrong or a shared GPU: {seen}",
               ranks=len(seen), devices=[s[2] for s in seen])
    else:
        record("gpu_pinning", "skip", "no CUDA GPU")

    # OOM: a real allocator OOM under a memory cap, caught, and the device usable afterwards.
    probe = importlib.util.find_spec("hvdtrain.batch_size") is not None
    note = ("plain torch OOM check: hvdtrain.batch_size exists but gpu_check does not drive its probe yet" if probe
            else "plain torch OOM check: hvdtrain has no adaptive-batch probe yet")
    if cuda:
        total = torch.cuda.get_device_properties(world.device).total_memory
        cap = 1 << 30
        torch.cuda.set_per_process_memory_fraction(cap / total, world.device)
        caught = False
        try:
            big = torch.empty(2 * cap, dtype=torch.uint8, device=world.device)
            del big
        except torch.cuda.OutOfMemoryError:
            caught = True
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, world.device)
        after = torch.ones(MiB, device=world.device).sum().item() == MiB
        ok = caught and after
        record("oom", "pass" if ok else "fail",
               note if ok else f"OOM caught: {caught}, device usable after: {after}; " + note,
               cap_mib=cap // MiB, asked_mib=2 * cap // MiB, probe="plain-torch")
    else:
        record("oom", "skip", "no CUDA GPU (set_per_process_memory_fraction is CUDA only); " + note)

    # fp16 compression: hvdtrain's codec (Sum of pre-divided fp16) against the fp32 average. Over
    # NCCL on GPUs; without one the same code runs over Gloo/MPI on CPU, so an API or numeric break
    # still fails here, but NCCL itself is reported as not checked.
    comp = config_field("compression")
    if comp is None or importlib.util.find_spec("hvdtrain.comm.compression") is None:
        record("fp16_compression", "skip", "not built yet (hvdtrain has no compression option)")
    else:
        try:
            from hvdtrain.comm.compression import make_codec
            g = torch.Generator(device="cpu").manual_seed(world.rank)
            bucket = torch.randn(4 * MiB, generator=g).to(world.device)
            exact = hvd.allreduce(bucket, op=hvd.Average, name="gpu_check.fp32")
            codec = make_codec("fp16", world)
            pending = codec.launch(bucket.clone(), name="gpu_check.fp16")
            codec.advance(pending)
            got = codec.finish(pending)
            err = ((got - exact).abs().max() / exact.abs().max()).item()
            ok = err < 1e-2 and math.isfinite(err)
            numbers = dict(max_rel_error=err, mib=16, device=world.device.type, via=comp)
            if not ok:
                record("fp16_compression", "fail", f"relative error {err:.2e} >= 1e-2", **numbers)
            elif cuda:
                record("fp16_compression", "pass", "", **numbers)
            else:
                record("fp16_compression", "skip", "no CUDA GPU: NCCL not checked (the codec passed over "
                       "Gloo/MPI on CPU)", **numbers)
        except Exception as e:  # an API change in hvdtrain.comm.compression is a failure to look at
            record("fp16_compression", "fail", f"{type(e).__name__}: {e}")

    # allreduce bus bandwidth for 64 MiB (nccl-tests' definition: busbw = algbw * 2(n-1)/n).
    n = world.size
    if n < 2:
        record("allreduce_busbw", "skip", "one rank: busbw = algbw*2(n-1)/n is 0; needs 2+ GPUs (or GPU_CHECK_NP)")
    else:
        x = torch.ones(64 * MiB // 4, device=world.device)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        times = []
        for i in range(15):
            sync()
            t0 = time.perf_counter()
            y = hvd.allreduce(x, op=hvd.Sum, name=f"gpu_check.bw.{i}")
            sync()
            if i >= 3:  # warm-up: NCCL communicator set-up and the first fusion-buffer allocation
                times.append(time.perf_counter() - t0)
        correct = bool((y == n).all().item())
        t = max(hvd.allgather_object(statistics.median(times), name="gpu_check.bw.t"))  # slowest rank
        algbw = 64 * MiB / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        record("allreduce_busbw", "pass" if correct else "fail", "" if correct else "wrong allreduce result",
               device=world.device.type, ranks=n, mib=64, time_ms=round(t * 1e3, 3),
               algbw_gbps=round(algbw, 3), busbw_gbps=round(busbw, 3))

    if world.rank == 0:
        with open(out_path, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


# ---------------------------------------------------------------- launcher

def config_field(name):
    """'section.name' if hvdtrain's Config has such an option, else None."""
    from hvdtrain.config import Config

    cfg = Config()
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section) and name in {g.name for g in dataclasses.fields(section)}:
            return f"{f.name}.{name}"
    return None


def launch(np_, args, timeout):
    bindir = os.path.dirname(sys.executable)
    cmd = [os.path.join(bindir, "horovodrun"), "-np", str(np_)]
    if os.environ.get("GPU_CHECK_CONTROLLER"):
        cmd.append("--" + os.environ["GPU_CHECK_CONTROLLER"])
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out
    sys.stderr.write(out[-3000:])
    return proc.returncode, out


def tail(out, n=300):
    return " ".join(out[-n:].split())


def train(check, np_, timeout, work, cli_args, min_accuracy=None, **extra):
    out_dir = os.path.join(work, check)
    t0 = time.perf_counter()
    rc, out = launch(np_, [os.path.join(os.path.dirname(sys.executable), "hvdtrain"), "train", "--out", out_dir,
                           "--set", "log.progress=false", *cli_args], timeout)
    secs = round(time.perf_counter() - t0, 1)
    m = re.search(r"done: step (\d+), eval loss ([0-9.eE+-]+|nan|inf)(?: accuracy ([\d.]+))?", out)
    if rc is None:
        return emit(check, "fail", f"timed out after {timeout} s: {tail(out)}", seconds=secs, **extra)
    if rc != 0 or not m:
        return emit(check, "fail", f"exit {rc}: {tail(out)}", seconds=secs, **extra)
    loss = float(m.group(2))
    numbers = {"steps": int(m.group(1)), "eval_loss": loss, "seconds": secs, **extra}
    if m.group(3) is not None:
        numbers["accuracy"] = float(m.group(3))
    if not math.isfinite(loss):
        return emit(check, "fail", "eval loss is not finite", **numbers)
    if min_accuracy is not None and numbers.get("accuracy", 0.0) < min_accuracy:
        return emit(check, "fail", f"accuracy below {min_accuracy}", min_accuracy=min_accuracy, **numbers)
    emit(check, "pass", "" if min_accuracy is None else f"accuracy >= {min_accuracy}", **numbers)


def main(work):
    import torch

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    np_ = int(os.environ.get("GPU_CHECK_NP") or (gpus if gpus else 2))
    timeout = float(os.environ.get("GPU_CHECK_TIMEOUT", "150"))
    device = "cuda" if cuda else "cpu"
    emit("environment", "pass", "" if cuda else "no CUDA GPU: GPU checks are skipped, CPU-safe parts run on CPU",
         gpus=gpus, ranks=np_, torch=torch.__version__, cuda=torch.version.cuda or "")

    out_path = os.path.join(work, "worker.jsonl")
    rc, out = launch(np_, [sys.executable, __file__, "worker", out_path], timeout)
    if rc == 0 and os.path.exists(out_path):
        with open(out_path) as f:
            for line in f:
                print(line.strip(), flush=True)
    else:
        emit("worker", "fail", ("timed out" if rc is None else f"exit {rc}") + f": {tail(out)}")

    # digits: the README's bar (>= 95% in 6 epochs at 2 ranks) under CUDA, so at most 2 ranks (more
    # ranks mean fewer, larger steps on 1797 images); on CPU a 2-epoch smoke run with a lower bar.
    epochs, bar = (6, 0.95) if cuda else (2, 0.85)
    digits_np = min(np_, 2)
    train("train_digits", digits_np, timeout, work, ["--config", os.path.join(ROOT, "configs/digits.yaml"),
          "--set", f"train.epochs={epochs}"], min_accuracy=bar, device=device, epochs=epochs, ranks=digits_np)
    pylm = ["--task", "pylm", "--set", "train.max_steps=5", "--set", "data.max_bytes=200000",
            "--set", "model.block_size=32"]
    train("train_pylm", np_, timeout, work, pylm, device=device, ranks=np_)

    precision = config_field("precision")
    for dtype in ("fp16", "bf16"):
        check = f"autocast_{dtype}"
        if precision is None:
            emit(check, "skip", "not built yet: hvdtrain has no precision option; digits and pylm ran in fp32")
        elif not cuda:
            emit(check, "skip", f"no CUDA GPU (hvdtrain has {precision})")
        else:
            train(check, np_, timeout, work, [*pylm, "--set", f"{precision}={dtype}"], device=device, ranks=np_)


if __name__ == "__main__":
    ROOT = os.environ["GPU_CHECK_ROOT"]
    if sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        try:
            main(sys.argv[2])
        except Exception as e:  # a bug in this script is one failed check, not a bare traceback
            emit("gpu_check", "fail", f"internal error: {type(e).__name__}: {e}")
PYEOF

cd "$ROOT"
GPU_CHECK_ROOT=$ROOT "$PY" "$WORK/gpu_check.py" main "$WORK" | tee "$WORK/results.jsonl"
if grep -q '"status": "fail"' "$WORK/results.jsonl"; then
  echo "gpu_check: FAILED: $(grep -c '"status": "fail"' "$WORK/results.jsonl") check(s) failed (lines above)." >&2
  exit 1
fi
