"""Multi-host benchmark matrix on the namespace testbed (scripts/testbed.sh); one JSON line per result.

For each host count and link rate: bring the testbed up, measure TCP goodput in the same run (iperf3,
host 0 -> host 1), time a 64 MiB allreduce per codec (`hvdtrain bench allreduce`) and training steps
(`hvdtrain bench compression`) at 1..N ranks. Each bus bandwidth is also given as a fraction of the
goodput just measured, so a result says how close the collective came to what TCP itself achieves
on that link. The testbed is always torn down (also on Ctrl-C), by scripts/bench_multihost.sh's trap
and here in `finally`.

Run as root: scripts/bench_multihost.sh [--hosts 2,3] [--rates 200mbit,1gbit] [--out FILE] ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hvdtrain.bench.launching import records

ROOT = Path(__file__).resolve().parent.parent
TESTBED = str(ROOT / "scripts" / "testbed.sh")
BIN = Path(sys.executable).parent  # absolute paths: `testbed.sh run` puts its ssh wrapper first on PATH
# Open MPI's own allreduce choice at 3 ranks was ~2.7x slower than ring on a shaped link (testbed.md).
# hvdtrain launch forces ring at every rank count, so the benchmark does too (users get what it measures).
MPI_RING = "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2,3", help="host counts (one rank per host)")
    p.add_argument("--rates", default="200mbit,1gbit", help="tc link rates; 'none' = unshaped")
    p.add_argument("--controllers", default="gloo", help="gloo and/or mpi")
    p.add_argument("--size", default="64M", help="allreduce size (fp32 bytes)")
    p.add_argument("--modes", default="fp32,fp16,bf16,hvd-fp16")
    p.add_argument("--iters", type=int, default=5, help="timed allreduce repeats (after 2 warm-up)")
    p.add_argument("--goodput-seconds", type=int, default=3)
    p.add_argument("--task", default="synthetic", help="training task for the throughput runs ('' = skip)")
    p.add_argument("--train-modes", default="none,fp16", help="codecs for the throughput runs")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per codec")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="also append every JSON line to this file")
    p.add_argument("--summarize", metavar="FILE", help="print Markdown tables of a results file; run nothing")
    return p.parse_args(argv)


def testbed(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([TESTBED, *args], capture_output=True, text=True, check=check)


def horovodrun(np_: int, controller: str, cmd: list[str]) -> list[dict]:
    """Run `cmd` on np_ hosts (one rank each) from host 0; returns its JSON records."""
    hosts = ",".join(f"{os.environ['HVD_TESTBED_PREFIX']}-n{i}:1" for i in range(np_))
    extra = ["--mpi-args=" + MPI_RING] if controller == "mpi" else []
    # Every testbed "host" shares this machine's cores, but each rank is alone on its host, so
    # World.init would give each rank all cores: np ranks x all cores oversubscribe and compute
    # times balloon (measured 2.4-3.4 s per step at 2 ranks against 0.35-1.1 s at 1). Split them.
    threads = f"OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // np_)}"
    full = [str(BIN / "horovodrun"), "--disable-cache", "-np", str(np_), "-H", hosts, f"--{controller}", *extra,
            "/usr/bin/env", threads, str(BIN / "hvdtrain"), *cmd]
    res = testbed("run", *full, check=False)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-15:])
        raise RuntimeError(f"horovodrun failed ({res.returncode}): {' '.join(cmd)}\n{tail}")
    return records(res.stdout)


def goodput(seconds: int) -> float:
    line = testbed("goodput", "0", "1", str(seconds)).stdout.strip().splitlines()[-1]
    return float(json.loads(line)["goodput_mbit_s"])


def bench_allreduce(args: argparse.Namespace, n: int, ctl: str, good: float, tag: dict) -> list[dict]:
    out = []
    cmd = ["bench", "allreduce", "--sizes", args.size, "--modes", args.modes, "--iters", str(args.iters)]
    for r in horovodrun(n, ctl, cmd):
        busbw_mbit = r["busbw_gbit_s"] * 1000
        out.append({**tag, **r, "goodput_mbit_s": good, "busbw_mbit_s": round(busbw_mbit, 1),
                    "busbw_of_goodput": round(busbw_mbit / good, 4)})
    return out


def bench_training(args: argparse.Namespace, n: int, ctl: str, tag: dict) -> list[dict]:
    """Step time and samples/s at 1..n ranks; scaling efficiency against the 1-rank rate per codec."""
    out, single = [], {}
    sets = [x for s in args.overrides for x in ("--set", s)]
    for np_ in range(1, n + 1):
        cmd = ["bench", "compression", "--task", args.task, "--steps", str(args.steps), "--modes", args.train_modes]
        for r in horovodrun(np_, ctl, cmd + sets):
            rec = {**tag, **r, "np": np_}
            if r["bench"] == "compression":
                if np_ == 1:
                    single[r["mode"]] = r["samples_per_s"]
                base = single.get(r["mode"])
                rec["scaling_efficiency"] = round(r["samples_per_s"] / (np_ * base), 4) if base else None
            out.append(rec)
    return out


def emit(rec: dict, out: Path | None) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with out.open("a") as f:
            f.write(line + "\n")


def run_matrix(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else None
    for n in [int(x) for x in args.hosts.split(",")]:
        for rate in args.rates.split(","):
            rate = "" if rate == "none" else rate
            testbed("up", str(n), *([rate] if rate else []))
            good = goodput(args.goodput_seconds)
            load = os.getloadavg()[0]
            emit({"bench": "goodput", "hosts": n, "link": rate or "unlimited", "goodput_mbit_s": good,
                  "load1": round(load, 2), "time": time.strftime("%H:%M:%S")}, out)
            for ctl in args.controllers.split(","):
                tag = {"hosts": n, "link": rate or "unlimited", "controller": ctl}
                for rec in bench_allreduce(args, n, ctl, good, tag):
                    emit(rec, out)
                if args.task:
                    for rec in bench_training(args, n, ctl, tag):
                        emit(rec, out)
    return 0


def summarize(path: str) -> None:
    """Markdown tables (allreduce, training) of a results file, as docs/compression.md shows them."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    print("| hosts | link | ctl | goodput Mbit/s | mode | time s | busbw Mbit/s | of goodput | vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in (r for r in recs if r["bench"] == "allreduce"):
        print(f"| {r['hosts']} | {r['link']} | {r['controller']} | {r['goodput_mbit_s']} | {r['mode']} | "
              f"{r['time_s']:.3f} | {r['busbw_mbit_s']} | {r['busbw_of_goodput']:.1%} | {r['speedup_vs_fp32']:.2f}x |")
    _training_table([r for r in recs if r["bench"] == "compression"])


def _training_table(recs: list[dict]) -> None:
    """One row per launch: each codec's step, samples/s and scaling efficiency, and the compute-only
    step beside it. All testbed hosts share one machine's cores, so `compute / step` (how much of the
    step is the model itself) says more here than scaling efficiency against one rank."""
    print("\n| hosts | link | ctl | np | compute-only s | mode | step s | samples/s | scaling eff. | compute / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    compute = {(r["hosts"], r["link"], r.get("controller"), r["np"]): r["step_s"]
               for r in recs if r["mode"] == "compute-only"}
    for r in (r for r in recs if r["mode"] != "compute-only"):
        c = compute.get((r["hosts"], r["link"], r.get("controller"), r["np"]))
        eff, share = r.get("scaling_efficiency"), None if c is None else c / r["step_s"]
        print(f"| {r['hosts']} | {r['link']} | {r.get('controller', '')} | {r['np']} | "
              f"{'' if c is None else f'{c:.3f}'} | {r['mode']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | "
              f"{'' if eff is None else f'{eff:.0%}'} | {'' if share is None else f'{share:.0%}'} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return 0
    os.environ.setdefault("HVD_TESTBED_PREFIX", "hvb")
    try:
        return run_matrix(args)
    finally:
        testbed("down", check=False)


if __name__ == "__main__":
    sys.exit(main())
