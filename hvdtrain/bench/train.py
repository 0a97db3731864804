"""`hvdtrain bench train`: the same training run three ways, side by side, in one invocation.

For each task and rank count it launches, round after round (so slow drifts in machine load hit
every way alike): hvdtrain and the hand-written `hvd.DistributedOptimizer` loop under
`horovodrun --gloo` / `--mpi`, and DDP under `torchrun` (`python -m torch.distributed.run`). Each
launch is `hvdtrain.bench.loops`; its JSON line is the slowest rank's median step after warm-up.
Printed, one JSON line each: every launch (`train-run`), the median and spread over rounds with
ratios (`train`), and samples/s, scaling efficiency and the ring model's prediction vs np
(`train-scaling`). `--plot DIR` adds PNG charts and summary.md (hvdtrain.bench.plot).
Run it without a launcher: it launches the ranks itself. `--hosts a:1,b:1` runs across hosts over ssh
(horovodrun -H; one torchrun per host for DDP), e.g. inside `scripts/testbed.sh run` on the namespace hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from hvdtrain.bench.launching import VARIANTS, controller, horovodrun, launch, variant_env
from hvdtrain.errors import ConfigError

MODES = ("hvdtrain", "horovod", "ddp")
# mpi-direct, gloo-direct: hvdtrain with comm.transport=mpi|gloo (fp32 buckets straight to MPI, or to a
# torch.distributed Gloo group, no Horovod negotiation); the variants (hvdtrain.bench.launching.VARIANTS)
# switch one of our Horovod patches back to upstream.
CONTROLLERS = ("gloo", "mpi", "mpi-direct", "gloo-direct") + tuple(
    f"{c}-{v}" for v in VARIANTS for c in ("gloo", "mpi"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", default="synthetic,digits,pylm", help="built-in tasks, comma-separated")
    p.add_argument("--np", default="1,2", help="rank counts, comma-separated")
    p.add_argument("--controllers", default="gloo,mpi",
                   help="Horovod controllers for hvdtrain and horovod; mpi-direct, gloo-direct: hvdtrain with "
                        "comm.transport=mpi|gloo; "
                        "gloo|mpi-cycling: Horovod's upstream background loop; -yielding: its upstream "
                        "synchronize; -upstream: both")
    p.add_argument("--modes", default="hvdtrain,horovod,ddp", help="which ways to run")
    p.add_argument("--steps", type=int, default=20, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per launch")
    p.add_argument("--repeats", type=int, default=3, help="launches per way (rounds)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every task, e.g. model.preset=small (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for every launch, e.g. HOROVOD_CYCLE_TIME=5 (repeatable)")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts and summary.md to DIR")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--hosts", metavar="H1:S1,H2:S2",
                   help="run across these hosts (ssh), filled in order up to each --np; DDP starts one "
                        "torchrun per host (equal slots per host), as its users do")
    p.add_argument("--master-port", type=int, default=29531, help="DDP rendezvous port on the first host")


def _list(text: str, allowed: tuple[str, ...] | None, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if allowed is not None and t not in allowed]
    if bad or not items:
        raise ConfigError(f"{flag} {text!r} is not allowed; choose from {', '.join(allowed or ())}")
    return items


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    from hvdtrain import config as config_mod
    from hvdtrain.config import TASKS

    plan: dict[str, Any] = {"tasks": _list(args.tasks, TASKS, "--tasks"), "modes": _list(args.modes, MODES, "--modes"),
                            "controllers": _list(args.controllers, CONTROLLERS, "--controllers")}
    try:
        plan["np"] = sorted({int(n) for n in _list(args.np, None, "--np")})
    except ValueError:
        raise ConfigError(f"--np {args.np!r}: use rank counts like 1,2") from None
    if min(plan["np"]) < 1 or args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        raise ConfigError("--np, --steps and --repeats must be >= 1, --warmup >= 0")
    for t in plan["tasks"]:
        config_mod.build(None, list(args.overrides), task=t)  # fail on a bad --set before any launch
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    for kv in args.env:
        if "=" not in kv:
            raise ConfigError(f"--env {kv!r} must look like KEY=VALUE")
        env[kv.split("=", 1)[0]] = kv.split("=", 1)[1]
    plan["env"] = env
    plan["hosts"] = _host_lists(args.hosts, plan["np"], "ddp" in plan["modes"]) if args.hosts else {}
    return plan


def _host_lists(text: str, nps: list[int], ddp: bool) -> dict[int, list[Any]]:
    """For each np, the hosts that run it (filled in order) with the slots used on each."""
    from hvdtrain.tools.hosts import Host, LaunchError, parse_hosts

    try:
        hosts = parse_hosts(text)
    except LaunchError as e:
        raise ConfigError(f"--hosts: {e}") from None
    out = {}
    for np in nps:
        if np > sum(h.slots for h in hosts):
            raise ConfigError(f"--np {np} needs more slots than --hosts {text!r} has")
        used, left = [], np
        for h in hosts:
            if left:
                used.append(Host(h.name, min(h.slots, left)))
                left -= used[-1].slots
        if ddp and len({h.slots for h in used}) > 1:
            raise ConfigError(f"--np {np} over --hosts {text!r} gives unequal ranks per host "
                              f"({', '.join(f'{h.name}:{h.slots}' for h in used)}); torchrun needs equal ones")
        out[np] = used
    return out


def _command(mode: str, ctrl: str, np: int, task: str, args: argparse.Namespace,
             plan: dict[str, Any]) -> list[list[str]]:
    worker = ["-m", "hvdtrain.bench.loops", "--mode", mode, "--task", task, "--steps", str(args.steps),
              "--warmup", str(args.warmup)] + [a for kv in args.overrides for a in ("--set", kv)]
    if ctrl.endswith("-direct"):
        worker += ["--set", f"comm.transport={controller(ctrl)}"]
    hosts = plan["hosts"].get(np)
    if mode == "ddp" and hosts:
        return _ddp_over_ssh(hosts, worker, args, plan["env"])
    if mode == "ddp":  # as DDP users launch it
        return [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={np}", *worker]]
    return [horovodrun(controller(ctrl), np, plan["hosts"].get(np)) + worker]


def _ddp_over_ssh(hosts: list[Any], worker: list[str], args: argparse.Namespace,
                  env: dict[str, str]) -> list[list[str]]:
    """Multi-node DDP the way its users start it: one torchrun per host, node ranks in host order,
    the first host as the static rendezvous; ssh carries no environment, so it is spelled out."""
    keep = {k: v for k, v in env.items() if k in ("OMP_NUM_THREADS", "PYTHONPATH") or
            any(kv.startswith(f"{k}=") for kv in args.env)}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(keep.items()))
    cmds = []
    for i, h in enumerate(hosts):
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--node_rank={i}",
                    f"--nproc_per_node={h.slots}", f"--master_addr={hosts[0].name}",
                    f"--master_port={args.master_port}", *worker]
        remote = f"cd {shlex.quote(os.getcwd())} && exec env {exports} {shlex.join(torchrun)}"
        cmds.append(["ssh", "-o", "BatchMode=yes", h.name, remote])
    return cmds


def _ways(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """(mode, controller) pairs; DDP does not use a Horovod controller and runs once per round."""
    return [(m, c) for m in plan["modes"] if m != "ddp" for c in plan["controllers"]
            if not (m == "horovod" and c.endswith("-direct"))] + \
        [("ddp", "torch") for m in plan["modes"] if m == "ddp"]


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r["step_s"] for r in runs]
    first = runs[0]
    return {"bench": "train", "task": first["task"], "np": first["np"], "mode": first["mode"],
            "controller": first["controller"], "backend": first["backend"], "params": first["params"],
            "global_batch": first["global_batch"], "step_s": statistics.median(steps), "step_min_s": min(steps),
            "step_max_s": max(steps), "repeats": len(steps), "steps_per_repeat": first["steps"],
            "samples_per_s": first["global_batch"] / statistics.median(steps),
            "last_loss": statistics.median(r["last_loss"] for r in runs), "hosts": first.get("hosts"),
            "cpu_per_rank_step_s": statistics.median(statistics.fmean(r["rank_cpu_s"]) for r in runs)}


def _ratios(rec: dict[str, Any], by_key: dict[tuple, dict[str, Any]], rounds: dict[tuple, list]) -> None:
    """Ratio of medians to the hand-written Horovod loop (same controller) and to DDP, plus the
    median of per-round ratios (each pair launched back to back, so it cancels slow load drift)."""
    key = (rec["task"], rec["np"])
    refs = {"horovod": (rec["mode"] != "horovod" and rec["mode"] != "ddp", "horovod", controller(rec["controller"])),
            "ddp": (rec["mode"] != "ddp", "ddp", "torch")}
    for name, (wanted, mode, ctrl) in refs.items():
        ref = by_key.get((*key, mode, ctrl))
        if not wanted or ref is None:
            continue
        rec[f"vs_{name}"] = rec["step_s"] / ref["step_s"]
        mine, theirs = rounds[(*key, rec["mode"], rec["controller"])], rounds[(*key, mode, ctrl)]
        paired = [a / b for a, b in zip(mine, theirs)]
        rec[f"vs_{name}_paired"] = statistics.median(paired)
        rec[f"vs_{name}_paired_range"] = [min(paired), max(paired)]


def _ring_probe(task: str, np: int, ctrl: str, params: int, plan: dict[str, Any],
                args: argparse.Namespace) -> dict[str, float]:
    """Latency alpha (s per message) and bandwidth beta (bytes/s) from two timed allreduces at np."""
    size = params * 4
    cmd = horovodrun(ctrl, np, plan["hosts"].get(np)) + [
        "-m", "hvdtrain.tools.cli", "bench", "allreduce", "--sizes", f"4,{size}", "--modes", "fp32", "--iters", "10"]
    recs = {r["bytes"]: r["time_s"] for r in launch([cmd], plan["env"], args.timeout, "allreduce")}
    hops = 2 * (np - 1)
    alpha = recs[4] / hops
    beta = hops / np * size / max(recs[size] - hops * alpha, 1e-9)
    return {"alpha_s": alpha, "beta_bytes_s": beta, "probe_np": np, "probe_bytes": size, "probe_time_s": recs[size]}


def ring_step(t1: float, np: int, params: int, link: dict[str, float]) -> float:
    """Step time the ring model predicts at np: the 1-rank step plus a ring allreduce of the
    gradient, 2(np-1) latencies + 2(np-1)/np x bytes / bandwidth, with no overlap (an upper bound)."""
    hops = 2 * (np - 1)
    return t1 + hops * link["alpha_s"] + hops / np * params * 4 / link["beta_bytes_s"]


def scaling_records(task: str, results: list[dict[str, Any]],
                    links: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    out = []
    for mode, ctrl in sorted({(r["mode"], r["controller"]) for r in results if r["task"] == task}):
        rows = {r["np"]: r for r in results if (r["task"], r["mode"], r["controller"]) == (task, mode, ctrl)}
        if 1 not in rows:
            continue
        base = rows[1]
        link = links.get(ctrl if ctrl != "torch" else "gloo") or next(iter(links.values()), None)
        for np, r in sorted(rows.items()):
            rec = {"bench": "train-scaling", "task": task, "mode": mode, "controller": ctrl, "np": np,
                   "samples_per_s": r["samples_per_s"], "efficiency": r["samples_per_s"] / (np * base["samples_per_s"])}
            if link is not None:
                pred = ring_step(base["step_s"], np, r["params"], link)
                rec.update(ring_samples_per_s=r["global_batch"] / pred, ring_efficiency=base["step_s"] / pred,
                           ring_alpha_s=link["alpha_s"], ring_beta_gbit_s=link["beta_bytes_s"] * 8 / 1e9)
            out.append(rec)
    return out


def _emit(rec: dict[str, Any]) -> None:
    print(json.dumps(rec), flush=True)


def _run_task(task: str, plan: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for np in plan["np"]:
        runs: dict[tuple, list[dict[str, Any]]] = {}
        for rnd in range(args.repeats):
            for mode, ctrl in _ways(plan):
                env = {**plan["env"], **variant_env(ctrl)}
                rec = launch(_command(mode, ctrl, np, task, args, plan), env, args.timeout, "train-run")[0]
                rec.update(controller=ctrl, round=rnd)
                if plan["hosts"]:
                    rec["hosts"] = ",".join(f"{h.name}:{h.slots}" for h in plan["hosts"][np])
                _emit(rec)
                runs.setdefault((task, np, mode, ctrl), []).append(rec)
        summary = {k: _summarise(v) for k, v in runs.items()}
        rounds = {k: [r["step_s"] for r in v] for k, v in runs.items()}
        for rec in summary.values():
            _ratios(rec, summary, rounds)
            _emit(rec)
            results.append(rec)
    return results


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    results: list[dict[str, Any]] = []
    scaling: list[dict[str, Any]] = []
    for task in plan["tasks"]:
        task_results = _run_task(task, plan, args)
        results += task_results
        links = {}
        if max(plan["np"]) > 1 and 1 in plan["np"]:  # the model needs a 1-rank step to predict from
            for ctrl in {controller(c) for c in plan["controllers"]}:
                links[ctrl] = _ring_probe(task, max(plan["np"]), ctrl, task_results[0]["params"], plan, args)
            for ctrl in plan["controllers"]:  # the variants share their controller's link
                links[ctrl] = links[controller(ctrl)]
        for rec in scaling_records(task, task_results, links):
            _emit(rec)
            scaling.append(rec)
    if args.plot:
        from hvdtrain.bench.plot import write

        write(Path(args.plot), results, scaling, vars(args))
    return 0
