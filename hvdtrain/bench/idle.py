"""What a rank costs when it has nothing to do, and what one small allreduce takes: Horovod as built
(its background loop sleeps while every worker is idle, scripts/horovod-idle-sleep.patch, and
`synchronize` sleeps until its collective is done, scripts/horovod-wait-handle.patch) against the
same build with either or both switched back to upstream (the controller variants of
`hvdtrain.bench.launching`: gloo-upstream is Horovod's own behaviour), and DDP (torch.distributed,
no background loop) beside them.

`hvdtrain bench idle` runs without a launcher: it launches every way itself, round after round (so
a change in machine load hits every way alike). Each rank of a launch, after a 1 s settle:
- idle: the CPU seconds its process (every thread) used in `--seconds` of sleep;
- back to back: the median time of `--iters` allreduces of one fp32 value;
- after a pause: the median time of 30 such allreduces, each after 20 ms with nothing queued (the
  first collective of a step after compute, which a sleeping loop must wake for);
- waiting for a late peer: the CPU seconds its process used, per second of waiting, in 3 allreduces
  that the last rank joins 0.5 s late (a rank whose peer is still computing; the last rank's own
  figure is left out).
One JSON line per launch (`idle-run`, every rank's figures) and per way (`idle`, medians over
launches: CPU per rank as the mean over ranks, latencies from the slowest rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from hvdtrain.bench.launching import VARIANTS, controller, horovodrun, launch, variant_env
from hvdtrain.errors import ConfigError

CONTROLLERS = ("gloo", "mpi") + tuple(f"{c}-{v}" for v in VARIANTS for c in ("gloo", "mpi"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--controllers", default="gloo,gloo-upstream,mpi,mpi-upstream",
                   help="Horovod controllers as built (gloo, mpi) and variants: -cycling (the upstream background "
                        "loop), -yielding (the upstream synchronize), -upstream (both)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="leave DDP out")
    p.add_argument("--seconds", type=float, default=5.0, help="idle time measured per launch")
    p.add_argument("--iters", type=int, default=200, help="back-to-back allreduces timed per launch")
    p.add_argument("--rounds", type=int, default=3, help="launches of each way, interleaved")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    p.add_argument("--worker", choices=("horovod", "ddp"), help=argparse.SUPPRESS)


def _measure(allreduce: Any, gather: Any, rank: int, size: int, args: argparse.Namespace) -> None:
    one = torch.ones(1)
    allreduce(one)  # the first collective sets up the path (and Horovod's response cache entry)
    time.sleep(1.0)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(args.seconds)
    idle_cpu, idle_wall = time.process_time() - cpu, time.perf_counter() - wall
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        allreduce(one)
        times.append(time.perf_counter() - start)
    paused = []
    for _ in range(30):
        time.sleep(0.02)
        start = time.perf_counter()
        allreduce(one)
        paused.append(time.perf_counter() - start)
    waiting = []
    for _ in range(3):
        allreduce(one)  # start together
        if rank == size - 1:
            time.sleep(0.5)
        cpu, wall = time.process_time(), time.perf_counter()
        allreduce(one)
        waiting.append((time.process_time() - cpu) / (time.perf_counter() - wall))
    mine = {"rank": rank, "idle_cpu_s": round(idle_cpu, 4), "idle_wall_s": round(idle_wall, 3),
            "back_to_back_ms": round(1000 * statistics.median(times), 4),
            "after_pause_ms": round(1000 * statistics.median(paused), 4),
            "late_peer_core_share": None if rank == size - 1 else round(statistics.median(waiting), 4)}
    every = gather(mine)
    if rank == 0:
        print(json.dumps({"bench": "idle-run", "ranks": every}), flush=True)


def _worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    if args.worker == "ddp":
        import torch.distributed as dist

        from hvdtrain.bench.loops import close_ddp, ddp_world

        world, gather, _ = ddp_world()
        _measure(lambda t: dist.all_reduce(t), gather, world.rank, world.size, args)
        close_ddp()
        return 0
    from hvdtrain.world import World

    world = World.init(threads=1)
    _measure(lambda t: world.allreduce(t, name="bench.idle", op="sum"),
             lambda obj: world.allgather_object(obj, name="bench.idle.gather"), world.rank, world.size, args)
    world.shutdown()
    return 0


def _ways(args: argparse.Namespace) -> list[str]:
    """The controllers (and variants) to launch, and "ddp" last."""
    ctrls = [c for c in args.controllers.split(",") if c]
    bad = [c for c in ctrls if c not in CONTROLLERS]
    if bad:
        raise ConfigError(f"--controllers {bad[0]!r} is not allowed; choose from {', '.join(CONTROLLERS)}")
    if args.np < 2:
        raise ConfigError(f"--np {args.np} is not allowed; an allreduce needs at least 2 ranks")
    return ctrls + (["ddp"] if args.ddp else [])


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    ways = _ways(args)
    worker = ["-m", "hvdtrain.bench.idle", "--seconds", str(args.seconds), "--iters", str(args.iters)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for way in ways:
            if way == "ddp":
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.np}",
                       *worker, "--worker", "ddp"]
            else:
                cmd = horovodrun(controller(way), args.np) + [*worker, "--worker", "horovod"]
            rec = launch([cmd], {**env, **variant_env(way)}, args.timeout, "idle-run")[0]
            rec.update(way=way, np=args.np)
            runs[way].append(rec)
            print(json.dumps(rec), flush=True)
    for recs in runs.values():
        cpu = [statistics.mean(r["idle_cpu_s"] / r["idle_wall_s"] for r in rec["ranks"]) for rec in recs]
        b2b = [max(r["back_to_back_ms"] for r in rec["ranks"]) for rec in recs]
        pause = [max(r["after_pause_ms"] for r in rec["ranks"]) for rec in recs]
        late = [statistics.mean(x for r in rec["ranks"] if (x := r["late_peer_core_share"]) is not None)
                for rec in recs]
        print(json.dumps({"bench": "idle", "way": recs[0]["way"], "np": args.np, "launches": len(recs),
                           "idle_core_share": round(statistics.median(cpu), 4),
                           "idle_core_share_range": [round(min(cpu), 4), round(max(cpu), 4)],
                           "back_to_back_ms": round(statistics.median(b2b), 4),
                           "after_pause_ms": round(statistics.median(pause), 4),
                           "late_peer_core_share": round(statistics.median(late), 4)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.idle")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
