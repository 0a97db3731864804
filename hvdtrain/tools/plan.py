"""`hvdtrain plan`: per-rank memory and communication time of a model under ZeRO, before running it.

Memory follows the ZeRO paper's accounting for Ψ parameters on N ranks: parameters P, gradients G
and optimizer state K bytes per parameter (P = G = 4 in fp32, 2 in fp16/bf16 mixed precision,
where K also holds a 4-byte fp32 master copy; K = 8 for Adam/AdamW moments, 4 for SGD momentum):
stage 0 (P+G+K)Ψ, stage 1 (P+G)Ψ + KΨ/N, stage 2 PΨ + (G+K)Ψ/N, stage 3 (P+G+K)Ψ/N plus the
gathered buckets in flight: the root unit and the 1 + `memory.zero3_prefetch` largest units, P bytes
per parameter. hvdtrain's own autocast keeps fp32 weights, so its runs are the fp32 rows; the
fp16/bf16 rows are the paper's mixed-precision layout.

Time uses the ring model with latency α and bandwidth β per link: allreduce of B bytes
2(N-1)α + 2(N-1)/N·B/β, reduce-scatter and allgather (N-1)α + (N-1)/N·B/β, α paid per bucket.
hvdtrain's stage 1 allreduces gradients and allgathers parameters; stage 2 reduce-scatters instead;
stage 3 reduce-scatters gradients and allgathers every unit twice (forward and backward), α paid per unit.
`--measure` runs real steps (under horovodrun: every rank) and prints the measured figures beside.
With `--set parallel.pipeline_stages=S` the record also holds each pipeline stage's memory (its
share of the layers, replicated on ranks / S replicas; see `pipeline_plan`).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from hvdtrain.config import OPTIMIZERS, TASKS
from hvdtrain.errors import ConfigError

PRECISIONS = ("fp32", "fp16", "bf16")
STAGES = (0, 1, 2, 3)


def state_bytes(optimizer: str, precision: str, momentum: bool = True) -> int:
    """K: optimizer-state bytes per parameter (moments, plus the fp32 master copy when mixed)."""
    moments = 8 if optimizer in ("adam", "adamw") else (4 if momentum else 0)
    return moments + (0 if precision == "fp32" else 4)


def memory(params: int, ranks: int, stage: int, optimizer: str, precision: str, momentum: bool = True,
           in_flight: int = 0) -> dict:
    """Predicted bytes per rank by category (the ZeRO paper's formulas); `in_flight`: stage 3's
    parameters gathered at once at most (see `zero3_in_flight`)."""
    _check(params, ranks, stage, optimizer, precision)
    p = g = 4 if precision == "fp32" else 2
    k = state_bytes(optimizer, precision, momentum)
    shard = {0: (1, 1, 1), 1: (1, 1, ranks), 2: (1, ranks, ranks), 3: (ranks, ranks, ranks)}[stage]
    out = {"params": p * params / shard[0], "grads": g * params / shard[1], "optimizer": k * params / shard[2]}
    if stage == 3:
        out["params"] += p * in_flight
    out["total"] = sum(out.values())
    return out


def ring_seconds(kind: str, nbytes: float, ranks: int, bandwidth: float, latency: float, buckets: int = 1) -> float:
    """Ring-model time of one collective over `nbytes` in `buckets` pieces; bandwidth in bytes/s."""
    if ranks == 1:
        return 0.0
    steps = {"allreduce": 2, "reducescatter": 1, "allgather": 1}[kind] * (ranks - 1)
    return steps * latency * buckets + steps / ranks * nbytes / bandwidth


def comm(params: int, ranks: int, stage: int, precision: str, compression: str, bandwidth: float,
         latency: float, bucket_bytes: float, units: int = 0) -> dict:
    """Predicted seconds per optimizer step for each collective hvdtrain issues at `stage` (stage 3:
    `units` buckets, each gathered twice)."""
    grad_wire = 2 if precision != "fp32" or compression in ("fp16", "bf16") else 4
    param_wire = 4 if precision == "fp32" else 2
    buckets = units if stage == 3 and units else max(1, math.ceil(params * 4 / bucket_bytes))
    grads = "reducescatter" if stage >= 2 else "allreduce"
    out = {grads: ring_seconds(grads, grad_wire * params, ranks, bandwidth, latency, buckets)}
    if stage:
        gathers = 2 if stage == 3 else 1
        out["allgather"] = gathers * ring_seconds("allgather", param_wire * params, ranks, bandwidth, latency, buckets)
    out["total"] = sum(out.values())
    return out


def _check(params: int, ranks: int, stage: int, optimizer: str, precision: str) -> None:
    if params < 1:
        raise ConfigError(f"--params={params} must be >= 1")
    if ranks < 1:
        raise ConfigError(f"--world-size={ranks} must be >= 1")
    if stage not in STAGES:
        raise ConfigError(f"--zero-stage={stage!r} is not allowed; choose one of 0, 1, 2, 3")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer={optimizer!r} is not allowed; choose one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision={precision!r} is not allowed; choose one of {', '.join(PRECISIONS)}")


def _meta_model(cfg: Any) -> Any:
    """The config's built-in model, built without memory."""
    import torch

    from hvdtrain.tasks.models import GPT, DigitsCNN, ResNet

    with torch.device("meta"):
        if cfg.task == "pylm":
            return GPT(cfg.model)
        if cfg.task == "digits":
            return DigitsCNN(cfg.model.width)
        return ResNet(cfg.model.width, cfg.data.num_classes)


def count_model_params(cfg: Any) -> int:
    """Parameters of the config's built-in model (tied weights once)."""
    from hvdtrain.tasks.models import count_parameters

    return count_parameters(_meta_model(cfg))


def zero3_in_flight(cfg: Any, ranks: int) -> tuple[int, int]:
    """ZeRO-3 on the config's built-in model: (parameters gathered at once at most, number of units).
    The root unit stays gathered through a micro-batch; besides it, the unit in use and the
    `memory.zero3_prefetch` units gathered ahead, at most the largest ones."""
    from hvdtrain.comm.zero3 import sharding_units, unit_buckets

    model = _meta_model(cfg)
    buckets, modules = unit_buckets(model, sharding_units(model, cfg.memory.zero3_units), ranks)
    sizes = [b["numel"] for b in buckets]
    root = sizes.pop() if modules[-1] is model else 0
    return root + sum(sorted(sizes, reverse=True)[:1 + cfg.memory.zero3_prefetch]), len(buckets)


def pipeline_plan(cfg: Any, ranks: int, optimizer: str, precision: str) -> dict:
    """Per-stage memory of the config's built-in model cut into `parallel.pipeline_stages` S stages
    (the cut training would make; balance=time is planned as params, which needs no timing): each
    stage's parameters with their gradients and optimizer state, replicated on its D = ranks / S
    replicas, and how many micro-batches' activations the schedule keeps alive on it (1F1B:
    min(S - s, m); GPipe: m, for m = train.accumulation)."""
    from hvdtrain.parallel.layout import Layout
    from hvdtrain.parallel.partition import boundaries, pipeline_layers

    pc, m = cfg.parallel, cfg.train.accumulation
    layout = Layout.of(pc.pipeline_stages, ranks)
    layers = pipeline_layers(_meta_model(cfg))
    bounds = boundaries(layers, layout.stages, "params" if pc.balance == "time" else pc.balance)
    stages = []
    for s in range(layout.stages):
        params = {id(p): p.numel() for layer in layers[bounds[s]:bounds[s + 1]] for p in layer.parameters()}
        n = sum(params.values())
        stages.append({"stage": s, "layers": bounds[s + 1] - bounds[s], "params": n,
                       "memory": memory(n, layout.replicas, 0, optimizer, precision, cfg.optim.momentum > 0),
                       "live_micro_batches": m if pc.schedule == "gpipe" else min(layout.stages - s, m)})
    return {"stages": layout.stages, "replicas": layout.replicas, "schedule": pc.schedule, "per_stage": stages,
            "bubble": (layout.stages - 1) / (m + layout.stages - 1)}


def largest_layers(cfg: Any, budget: float, ranks: int, stage: int, optimizer: str, precision: str) -> dict:
    """The deepest pylm model (model.n_layer, other sizes fixed) whose predicted per-rank model
    state fits in `budget` bytes."""
    import dataclasses

    def params(layers: int) -> int:
        model = dataclasses.replace(cfg.model, preset="", n_layer=layers)
        return count_model_params(dataclasses.replace(cfg, model=model))

    # Every block has the same size, so the count is linear in depth: two builds give the line.
    base, per_layer = params(1), params(2) - params(1)
    in_flight = zero3_in_flight(cfg, ranks)[0] if stage == 3 else 0  # the same at every depth > prefetch
    best: dict = {"n_layer": 0, "params": 0}
    for layers in range(1, 100_000):
        n = base + (layers - 1) * per_layer
        if memory(n, ranks, stage, optimizer, precision, in_flight=in_flight)["total"] > budget:
            break
        best = {"n_layer": layers, "params": n}
    return best


def _list(text: str, allowed: tuple, what: str, cast: Any = str) -> list:
    try:
        items = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        items = [text]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ConfigError(f"--{what}={text!r} is not allowed; choose from {', '.join(map(str, allowed))}")
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", help=f"built-in task whose model is planned: {', '.join(TASKS)}")
    p.add_argument("--config", help="YAML or TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--params", type=int, default=0, help="plan for this many parameters instead of a model")
    p.add_argument("--world-size", type=int, default=0, help="ranks (default: the launcher's, else 1)")
    p.add_argument("--precision", default="fp32", help="comma list of fp32, fp16, bf16")
    p.add_argument("--optimizer", default="", help="comma list of sgd, adam, adamw (default: optim.name)")
    p.add_argument("--zero-stage", default="", help="comma list of 0, 1, 2, 3 (default: memory.zero_stage)")
    p.add_argument("--bandwidth", type=float, default=10.0, help="link bandwidth in Gbit/s")
    p.add_argument("--latency", type=float, default=50.0, help="per-message latency in microseconds")
    p.add_argument("--measure-link", action="store_true", help="fit latency and bandwidth to a quick allreduce")
    p.add_argument("--measure", action="store_true", help="run real steps and print measured beside predicted")
    p.add_argument("--steps", type=int, default=3, help="steps run by --measure")
    p.add_argument("--budget-gb", type=float, default=0.0,
                   help="pylm: print the deepest model whose per-rank model state fits this many GiB")


def run(args: argparse.Namespace) -> int:
    from hvdtrain import config as config_mod

    cfg = config_mod.build(args.config, list(args.overrides), task=args.task)
    precisions = _list(args.precision, PRECISIONS, "precision")
    optimizers = _list(args.optimizer or cfg.optim.name, OPTIMIZERS, "optimizer")
    stages = _list(args.zero_stage or str(cfg.memory.zero_stage), STAGES, "zero-stage", int)
    _check_flags(args, cfg, precisions)
    world = None
    if args.measure or args.measure_link:
        from hvdtrain.world import World

        world = World.init()
    ranks = world.size if world else (args.world_size or _launcher_size())
    params = args.params or count_model_params(cfg)
    link = {"bandwidth_gbit_s": args.bandwidth, "latency_us": args.latency, "source": "flags"}
    if args.measure_link:
        link = measure_link(world)
    for precision in precisions:
        for optimizer in optimizers:
            for stage in stages:
                record = predict(cfg, params, ranks, stage, optimizer, precision, link, bool(args.params))
                if args.budget_gb:
                    record["budget_gb"] = args.budget_gb
                    record["largest"] = largest_layers(cfg, args.budget_gb * 2**30, ranks, stage, optimizer, precision)
                if world is not None and args.measure:
                    _add_measured(record, world, cfg, stage, optimizer, args.steps)
                if world is None or world.is_root:
                    print(json.dumps(record), flush=True)
    return 0


def _check_flags(args: argparse.Namespace, cfg: Any, precisions: list[str]) -> None:
    if args.bandwidth <= 0 or args.latency < 0:
        raise ConfigError("--bandwidth must be > 0 and --latency >= 0")
    if args.measure and (args.params or precisions != ["fp32"]):
        raise ConfigError("--measure runs a built-in task in fp32: drop --params and use --precision fp32")
    if args.measure and cfg.parallel.pipeline_stages > 1:
        raise ConfigError("--measure runs data-parallel steps; measure pipeline stages with hvdtrain bench pipeline")
    if args.budget_gb and cfg.task != "pylm":
        raise ConfigError("--budget-gb searches pylm depths; use --task pylm")


def _add_measured(record: dict[str, Any], world: Any, cfg: Any, stage: int, optimizer: str, steps: int) -> None:
    """Real steps beside the prediction. All ranks call."""
    from hvdtrain.tools.plan_measure import measure

    record["measured"] = measure(world, cfg, stage, optimizer, steps)
    record["measured_over_predicted"] = {k: record["measured"][k] / record["memory"][k]
                                         for k in record["memory"] if record["memory"][k]}


def predict(cfg: Any, params: int, ranks: int, stage: int, optimizer: str, precision: str, link: dict,
            given_params: bool = False) -> dict:
    bandwidth = link["bandwidth_gbit_s"] * 1e9 / 8
    # Stage 3's gathered buckets depend on the model's units: known for a built-in model, not for --params.
    in_flight, units = zero3_in_flight(cfg, ranks) if stage == 3 and not given_params else (0, 0)
    mem = memory(params, ranks, stage, optimizer, precision, cfg.optim.momentum > 0, in_flight)
    record = {"plan": "zero", "params": params, "world_size": ranks, "zero_stage": stage, "optimizer": optimizer,
              "precision": precision, "memory": mem,
              "comm_s": comm(params, ranks, stage, precision, cfg.comm.compression, bandwidth,
                             link["latency_us"] * 1e-6, cfg.comm.bucket_mb * 2**20, units), "link": link}
    if stage == 3:
        record["in_flight_params"] = in_flight if not given_params else None  # None: no model to take units from
    if cfg.parallel.pipeline_stages > 1 and not given_params:
        record["pipeline"] = pipeline_plan(cfg, ranks, optimizer, precision)
    return record


def measure_link(world: Any) -> dict:
    """Latency and bandwidth fitted to the ring model from a 4 KiB and a 16 MiB allreduce."""
    from hvdtrain.bench.allreduce import allreduce

    if world.size == 1:
        raise ConfigError("--measure-link needs at least two ranks (run under horovodrun)")
    small, large = (r["time_s"] for r in allreduce(world, [4096, 16 * 2**20], ["fp32"], iters=5, quiet=True))
    n = world.size
    latency = small / (2 * (n - 1))
    bandwidth = 2 * (n - 1) / n * 16 * 2**20 / max(large - small, 1e-9)
    return {"bandwidth_gbit_s": bandwidth * 8 / 1e9, "latency_us": latency * 1e6, "source": "measured"}


def _launcher_size() -> int:
    import os

    for key in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if key in os.environ:
            return int(os.environ[key])
    return 1
