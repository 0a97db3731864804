"""`comm.compression=auto` against `none` and `fp16`: real training runs across namespace hosts.

Each repeat trains the same configuration once per codec (the order rotates between repeats, so a
slow phase of the machine does not always hit the same codec) and reports the throughput after
auto's trial: samples/s over the train records whose step is past the trial (2 x (1 + auto_steps)
steps) plus `--skip` more. One JSON line per run, then one summary line per repeat with auto
against the faster of none and fp16.

Run as root: scripts/testbed.sh must be able to create namespaces.
    python benchmarks/auto_compression.py [--hosts 2] [--rate none] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import multihost  # same folder: the testbed and horovodrun helpers

MODES = ("none", "fp16", "auto")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", default="none", help="tc link rate, or 'none' for an unshaped link")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="train.max_steps of each run")
    p.add_argument("--auto-steps", type=int, default=4, help="comm.auto_steps (timed steps per candidate)")
    p.add_argument("--skip", type=int, default=2, help="steps after the trial left out of the figure")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="also append every JSON line to this file")
    return p.parse_args(argv)


def base_overrides(args: argparse.Namespace) -> list[str]:
    # pylm small (10.8M parameters): ~43 MB of fp32 gradients per step, enough that the codec matters.
    # A small per-rank batch keeps steps short; the lower LR keeps it from diverging at that batch.
    return ["model.preset=small", "train.batch_size=4", "optim.lr=0.005", "data.max_bytes=2000000",
            "data.val_fraction=0.01", f"train.max_steps={args.steps}", "log.every=2", "log.progress=false",
            "log.tensorboard=false", f"comm.auto_steps={args.auto_steps}", *args.overrides]


def one_run(args: argparse.Namespace, mode: str, out_dir: str) -> dict:
    sets = [x for s in [*base_overrides(args), f"comm.compression={mode}"] for x in ("--set", s)]
    t0 = time.perf_counter()
    multihost.horovodrun(args.hosts, "gloo", ["train", "--task", "pylm", *sets, "--out", out_dir])
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in Path(out_dir, "metrics.jsonl").read_text().splitlines() if x.strip()]
    first = 2 * (1 + args.auto_steps) + args.skip
    rates = [r["samples_per_s"] for r in recs if r.get("kind") == "train" and r["step"] > first]
    if not rates:
        raise RuntimeError(f"{mode}: no train records after step {first} in {out_dir}/metrics.jsonl")
    # Equal samples per record, so the pooled rate is the harmonic mean of the intervals' rates.
    pooled = len(rates) / sum(1 / r for r in rates)
    chose = [r for r in recs if r.get("kind") == "event" and r.get("event") == "compression"]
    return {"bench": "auto-compression", "mode": mode, "samples_per_s": round(pooled, 3),
            "intervals": [round(r, 2) for r in rates], "wall_s": round(wall, 1),
            "auto": chose[-1] if chose else None, "load1": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HVD_TESTBED_PREFIX", "hva")  # never the prefix of someone else's testbed
    out = Path(args.out) if args.out else None
    multihost.testbed("up", str(args.hosts), *([] if args.rate == "none" else [args.rate]))
    try:
        multihost.emit({"bench": "goodput", "hosts": args.hosts, "link": args.rate,
                        "goodput_mbit_s": multihost.goodput(3)}, out)
        for rep in range(args.repeats):
            order = MODES[rep % 3:] + MODES[:rep % 3]
            got = {}
            for mode in order:
                with tempfile.TemporaryDirectory(prefix=f"auto-{mode}-") as d:
                    got[mode] = one_run(args, mode, d)
                multihost.emit({**got[mode], "repeat": rep, "order": list(order)}, out)
            best = max(got["none"]["samples_per_s"], got["fp16"]["samples_per_s"])
            multihost.emit({"bench": "auto-summary", "repeat": rep, "auto_vs_best": round(
                got["auto"]["samples_per_s"] / best, 4), "faster_fixed": max(("none", "fp16"),
                key=lambda m: got[m]["samples_per_s"])}, out)
    finally:
        multihost.testbed("down", check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
