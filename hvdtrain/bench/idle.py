"""What a rank costs when it has nothing to do, and what one small allreduce takes: Horovod's
background loop as built (it sleeps while every worker is idle, scripts/horovod-idle-sleep.patch)
against the upstream loop (`HOROVOD_IDLE_SLEEP_MS=0`, one coordination round every 1 ms cycle) on
each controller, and DDP (torch.distributed, no background loop) beside them.

`hvdtrain bench idle` runs without a launcher: it launches every way itself, round after round (so
a change in machine load hits every way alike). Each rank of a launch, after a 1 s settle:
- idle: the CPU seconds its process (every thread) used in `--seconds` of sleep;
- back to back: the median time of `--iters` allreduces of one fp32 value;
- after a pause: the median time of 30 such allreduces, each after 20 ms with nothing queued (the
  first collective of a step after compute, which a sleeping loop must wake for).
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

from hvdtrain.bench.train import _horovodrun, _launch
from hvdtrain.errors import ConfigError

CONTROLLERS = ("gloo", "mpi")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--controllers", default="gloo,mpi", help="Horovod controllers: gloo, mpi")
    p.add_argument("--idle-sleep", default="100,0",
                   help="values of HOROVOD_IDLE_SLEEP_MS to compare (0: Horovod's upstream loop; default 100,0)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="leave DDP out")
    p.add_argument("--seconds", type=float, default=5.0, help="idle time measured per launch")
    p.add_argument("--iters", type=int, default=200, help="back-to-back allreduces timed per launch")
    p.add_argument("--rounds", type=int, default=3, help="launches of each way, interleaved")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    p.add_argument("--worker", choices=("horovod", "ddp"), help=argparse.SUPPRESS)


def _measure(allreduce: Any, gather: Any, rank: int, args: argparse.Namespace) -> None:
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
    mine = {"rank": rank, "idle_cpu_s": round(idle_cpu, 4), "idle_wall_s": round(idle_wall, 3),
            "back_to_back_ms": round(1000 * statistics.median(times), 4),
            "after_pause_ms": round(1000 * statistics.median(paused), 4)}
    every = gather(mine)
    if rank == 0:
        print(json.dumps({"bench": "idle-run", "ranks": every}), flush=True)


def _worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    if args.worker == "ddp":
        import torch.distributed as dist

        from hvdtrain.bench.loops import close_ddp, ddp_world

        world, gather, _ = ddp_world()
        _measure(lambda t: dist.all_reduce(t), gather, world.rank, args)
        close_ddp()
        return 0
    from hvdtrain.world import World

    world = World.init(threads=1)
    _measure(lambda t: world.allreduce(t, name="bench.idle", op="sum"),
             lambda obj: world.allgather_object(obj, name="bench.idle.gather"), world.rank, args)
    world.shutdown()
    return 0


def _ways(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(controller, HOROVOD_IDLE_SLEEP_MS) pairs, and ("ddp", "") last."""
    ctrls = [c for c in args.controllers.split(",") if c]
    bad = [c for c in ctrls if c not in CONTROLLERS]
    if bad:
        raise ConfigError(f"--controllers {bad[0]!r} is not allowed; choose from {', '.join(CONTROLLERS)}")
    sleeps = [s for s in args.idle_sleep.split(",") if s]
    for s in sleeps:
        try:
            if float(s) < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--idle-sleep {s!r} is not allowed; give milliseconds >= 0 (0: upstream loop)") from None
    if args.np < 2:
        raise ConfigError(f"--np {args.np} is not allowed; an allreduce needs at least 2 ranks")
    return [(c, s) for c in ctrls for s in sleeps] + ([("ddp", "")] if args.ddp else [])


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    ways = _ways(args)
    worker = ["-m", "hvdtrain.bench.idle", "--seconds", str(args.seconds), "--iters", str(args.iters)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plan: dict[str, Any] = {"hosts": {}}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for ctrl, sleep in ways:
            if ctrl == "ddp":
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.np}",
                       *worker, "--worker", "ddp"]
                way_env = env
            else:
                cmd = _horovodrun(ctrl, args.np, plan) + [*worker, "--worker", "horovod"]
                way_env = {**env, "HOROVOD_IDLE_SLEEP_MS": sleep}
            rec = _launch([cmd], way_env, args.timeout, "idle-run")[0]
            rec.update(way=ctrl if ctrl == "ddp" else f"{ctrl}/idle-sleep={sleep}", np=args.np)
            runs[(ctrl, sleep)].append(rec)
            print(json.dumps(rec), flush=True)
    for recs in runs.values():
        cpu = [statistics.mean(r["idle_cpu_s"] / r["idle_wall_s"] for r in rec["ranks"]) for rec in recs]
        b2b = [max(r["back_to_back_ms"] for r in rec["ranks"]) for rec in recs]
        pause = [max(r["after_pause_ms"] for r in rec["ranks"]) for rec in recs]
        print(json.dumps({"bench": "idle", "way": recs[0]["way"], "np": args.np, "launches": len(recs),
                           "idle_core_share": round(statistics.median(cpu), 4),
                           "idle_core_share_range": [round(min(cpu), 4), round(max(cpu), 4)],
                           "back_to_back_ms": round(statistics.median(b2b), 4),
                           "after_pause_ms": round(statistics.median(pause), 4)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.idle")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
