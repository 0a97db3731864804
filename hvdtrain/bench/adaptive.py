"""`hvdtrain bench adaptive`: training time to a target held-out loss, adaptive batch sizing against
fixed batches from small to large, each fixed batch with its own best lr from a small grid.

Run under horovodrun; rank 0 prints one JSON line per run and one summary line per task. The lr grid
is searched on the first seed only (the best lr per batch is then reused for the other seeds); the
adaptive run starts from the smallest batch (the "user's" batch) with that batch's best lr.

Time is wall-clock from the first training-mode forward (so the adaptive run's memory probe counts)
to the evaluation that first reaches the target, minus the time spent evaluating. After each
evaluation every rank allreduces the held-out loss (a named collective at the same point on all
ranks) and all stop together once it is at or below the target, or the time budget is spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from hvdtrain.common import num_samples

# Per task: (per-rank micro-batches of the fixed runs, smallest first; lr grid; target eval loss; overrides).
TASKS: dict[str, dict[str, Any]] = {
    # Adam on this GPT sits near the edge of stability at constant lr: on 5 December B=16 needed 55
    # evaluations to loss 1.6 at lr 0.003 and 115 at 0.0037, so the grid is fine around 0.003.
    "pylm": {"batches": [4, 8, 16, 64], "lrs": [2e-3, 2.5e-3, 3e-3, 3.7e-3], "target": 1.6,
             "set": ["model.preset=tiny", "data.max_bytes=1000000", "data.val_fraction=0.05", "optim.name=adam"]},
    "digits": {"batches": [4, 16, 64], "lrs": [0.02, 0.05, 0.1], "target": 0.15,
               "set": ["optim.name=sgd", "optim.momentum=0.9", "model.width=16"]},
    # Seed 0 on 5 December (target 0.15): best lr 0.004 at B=8, 0.008 at B=16-64, 0.016 at B=128.
    "mnist1d": {"batches": [4, 16, 64], "lrs": [4e-3, 8e-3, 1.6e-2], "target": 0.15,
                "set": ["optim.name=adam"]},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", default="pylm,digits", help=f"comma-separated: {', '.join(TASKS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (the lr grid uses the first)")
    p.add_argument("--budget-s", type=float, default=20.0, help="training seconds per run before giving up")
    p.add_argument("--eval-samples", type=int, default=256, help="training samples between evaluations")
    p.add_argument("--targets", default="", metavar="TASK=LOSS,...", help="override target held-out losses")
    p.add_argument("--lrs", default="", metavar="TASK=LR/LR...,...",
                   help="override a task's lr grid, e.g. pylm=0.003 (one lr: no grid, the same lr for every batch)")
    p.add_argument("--batches", default="", metavar="TASK=B/B...,...",
                   help="override a task's fixed global batches, smallest first (the smallest is the adaptive "
                        "run's start, the largest its cap), e.g. pylm=8/16/32/64/128")
    p.add_argument("--best-lrs", default="", metavar="TASK=B:LR/B:LR...,...",
                   help="each fixed global batch with the lr an earlier grid found best for it, e.g. "
                        "pylm=8:0.002/32:0.003: no grid is searched, and every seed runs every batch")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run of every task, e.g. optim.clip_grad_norm=1.0 (repeatable)")
    p.add_argument("--adaptive", dest="variants", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="an adaptive variant, e.g. goodput:norm_test=0 (repeatable; default: one with defaults)")


class Stop(Exception):
    pass


class Watch:
    """loss_fn wrapper: clocks training (the ranks' mean), excludes evaluation, and stops all ranks
    together at the target or once the budget is spent."""

    def __init__(self, world: Any, loss_fn: Any, target: float, budget: float) -> None:
        self.world, self.loss_fn, self.target, self.budget = world, loss_fn, target, budget
        self.start: float | None = None
        self.eval_started: float | None = None
        self.eval_seconds, self.sums, self.evals = 0.0, [0.0, 0.0], 0
        self.result: dict[str, Any] = {}
        self.sizes: list[int] = []

    def __call__(self, model: Any, batch: Any) -> Any:
        now = time.perf_counter()
        if model.training:
            self.start = self.start or now
            if not self.sizes or self.sizes[-1] != len(batch[1]):
                self.sizes.append(len(batch[1]))  # this rank's micro-batch sizes, in the order used
            if self.eval_started is not None:
                self._after_eval()
        elif self.eval_started is None:
            self.eval_started = now
        loss, sums = self.loss_fn(model, batch)
        if not model.training:
            n = len(batch[1])
            self.sums[0] += float(loss) * n
            self.sums[1] += n
        return loss, sums

    def _after_eval(self) -> None:
        import torch

        # Stopping gates every later collective, so it must rest on reduced numbers only: each
        # rank's own clock crosses the budget at a different eval, and a rank that stops alone
        # leaves its peers waiting in their next allreduce (a 2-rank digits bench hung so).
        assert self.eval_started is not None and self.start is not None  # set by __call__
        train_s = self.eval_started - self.start - self.eval_seconds
        local = torch.tensor([*self.sums, train_s / self.world.size], dtype=torch.float64)
        total = self.world.allreduce(local, name="bench.adaptive.eval")
        loss, train_s = float(total[0] / total[1]), float(total[2])
        self.eval_seconds += time.perf_counter() - self.eval_started
        self.eval_started, self.sums, self.evals = None, [0.0, 0.0], self.evals + 1
        if loss <= self.target or train_s > self.budget:
            self.result = {"reached": loss <= self.target, "time_s": train_s, "eval_loss": loss, "evals": self.evals}
            raise Stop


def one_run(world: Any, base: Any, task_name: str, seed: int, m: int, lr: float, adaptive: dict | None,
         spec: dict, budget: float, eval_samples: int, variant: str = "") -> dict[str, Any]:
    from hvdtrain.config import AdaptiveConfig
    from hvdtrain.loop import fit
    from hvdtrain.tasks import build_task

    batch = world.size * m
    # Every run evaluates once per `eval_samples` training samples: with adaptive batch sizing
    # eval_every counts steps of the starting batch B0 in samples, whatever the batch has grown to.
    cfg = dataclasses.replace(
        base, seed=seed,
        train=dataclasses.replace(base.train, batch_size=m, accumulation=1, epochs=1000,
                                  eval_every=max(1, eval_samples // batch)),
        optim=dataclasses.replace(base.optim, lr=lr, lr_scaling="none"),
        adaptive=AdaptiveConfig(enabled=True, **adaptive) if adaptive else base.adaptive)
    task = build_task(cfg)
    if num_samples(task.eval_set) < world.size:
        # A rank with an empty evaluation shard never calls loss_fn in eval mode, so it would never
        # join the watch's allreduce: refuse (identically on every rank) rather than hang.
        from hvdtrain.errors import ConfigError

        raise ConfigError(f"{task_name}: {num_samples(task.eval_set)} held-out samples for {world.size} ranks; "
                          "every rank needs at least one")
    watch = Watch(world, task.loss_fn, spec["target"], budget)
    result: Any = None
    try:
        result = fit(world, task.model, None, task.train_set, cfg, eval_set=task.eval_set, loss_fn=watch)
    except Stop:
        pass
    out = {"bench": "adaptive", "task": task_name, "np": world.size, "seed": seed,
           "mode": "adaptive" if adaptive else "fixed", "variant": variant, "start_batch": batch, "lr": lr,
           "target": spec["target"], "micro_batches": watch.sizes,
           **(watch.result or {"reached": False, "time_s": None, "note": f"data ran out at step {result.step}"})}
    if "evals" in out:
        # Training samples seen by the last evaluation (an adaptive run's may lie up to one batch
        # later): time over samples splits a gap into fixed costs and per-sample ones.
        out["samples"] = out["evals"] * cfg.train.eval_every * batch
    world.print(json.dumps(out))
    return out


def _variants(texts: list[str]) -> dict[str, dict[str, Any]]:
    """`name:key=value,...` -> {name: AdaptiveConfig overrides}; values parsed as YAML scalars."""
    import yaml

    from hvdtrain.errors import ConfigError

    out = {}
    for text in texts or ["default:"]:
        name, _, settings = text.partition(":")
        pairs = [kv.split("=", 1) for kv in settings.split(",") if kv]
        if not name or any(len(kv) != 2 for kv in pairs):
            raise ConfigError(f"--adaptive {text!r}: expected NAME:KEY=VALUE,..., e.g. goodput:norm_test=0")
        out[name] = {k.strip(): yaml.safe_load(v) for k, v in pairs}
    return out


def _task(world: Any, name: str, seeds: int, budget: float, eval_samples: int, target: float | None,
          variants: dict[str, dict[str, Any]], lrs: list[float] | None = None,
          batches: list[int] | None = None, overrides: list[str] | None = None,
          best_lrs: dict[int, float] | None = None) -> None:
    from hvdtrain import config as config_mod

    spec: dict[str, Any] = dict(TASKS[name], target=target or TASKS[name]["target"], lrs=lrs or TASKS[name]["lrs"])
    if batches or best_lrs:
        spec["batches"] = [b // world.size for b in batches or best_lrs or []]
    base = config_mod.build(None, spec["set"] + list(overrides or []) + ["log.progress=false", "log.tensorboard=false"],
                             task=name)
    # With best lrs given, the first seed runs like the others: (time, lr) with no time measured.
    best = {b // world.size: (float("nan"), lr) for b, lr in (best_lrs or {}).items()}
    runs: list[dict] = []
    for m in spec["batches"] if not best else []:  # lr grid on the first seed
        for lr in spec["lrs"]:
            r = one_run(world, base, name, 0, m, lr, None, spec, budget, eval_samples)
            runs.append(r)
            t = r["time_s"] if r["reached"] else float("inf")
            if m not in best or t < best[m][0]:
                best[m] = (t, lr)
    small = spec["batches"][0]
    adaptive = {"max_batch": world.size * spec["batches"][-1], "warmup_steps": 10, "decide_every": 10,
                "smoothing": 0.99}
    for seed in range(seeds):
        if seed or best_lrs:
            runs += [one_run(world, base, name, seed, m, best[m][1], None, spec, budget, eval_samples)
                     for m in spec["batches"]]
        for variant, settings in variants.items():
            r = one_run(world, base, name, seed, small, best[small][1], {**adaptive, **settings}, spec, budget,
                        eval_samples, variant)
            runs.append(r)
    world.print(json.dumps(summary(world, name, spec, runs, best, list(variants), budget)))


def summary(world: Any, name: str, spec: dict, runs: list[dict], best: dict, variants: list[str],
             budget: float) -> dict[str, Any]:
    def sel(mode: str, m: int | None = None, variant: str = "") -> list[dict]:
        return [r for r in runs if r["mode"] == mode and (m is None or r["start_batch"] == world.size * m)
                and (mode == "adaptive" or r["lr"] == best[m][1]) and r["variant"] == variant]

    def time_of(r: dict) -> float:
        return r["time_s"] if r["reached"] else float("inf")

    def samples(rs: list[dict]) -> int | None:  # only where every run reached the target
        return int(statistics.median(r["samples"] for r in rs)) if rs and all(r["reached"] for r in rs) else None

    fixed = {world.size * m: statistics.median(map(time_of, sel("fixed", m))) for m in spec["batches"]}
    finite = lambda t: t if t != float("inf") else None  # noqa: E731 - JSON has no infinity
    # A missed target, adaptive's or the reference's, gives no ratio (t / inf read as 0.0x).
    over = lambda t, ref: t / ref if max(t, ref) != float("inf") else None  # noqa: E731
    adaptive = {v: statistics.median(map(time_of, sel("adaptive", variant=v))) for v in variants}
    best_fixed = min(fixed.values())
    start = fixed[world.size * spec["batches"][0]]
    # Per seed against the batch best by median: the same seed gives both runs the same initial
    # weights and data order, which takes most seed-to-seed spread out of the ratio (not all: an
    # adaptive run's batch schedule also follows its measured step times).
    best_m = min(spec["batches"], key=lambda m: fixed[world.size * m])
    by_seed = {r["seed"]: r["time_s"] for r in sel("fixed", best_m) if r["reached"]}
    paired = {v: [time_of(r) / by_seed[r["seed"]] for r in sel("adaptive", variant=v) if r["seed"] in by_seed]
              for v in variants}
    # A start batch that missed on most seeds took longer than the budget: the ratio is below this.
    bound = {v: t / budget if start == float("inf") and t != float("inf") else None for v, t in adaptive.items()}
    return {"bench": "adaptive-summary", "task": name, "np": world.size, "target": spec["target"],
            "median_time_s": {**{f"adaptive_{v}": finite(t) for v, t in adaptive.items()},
                              **{f"fixed_{b}": finite(t) for b, t in fixed.items()}},
            "median_samples": {**{f"adaptive_{v}": samples(sel("adaptive", variant=v)) for v in variants},
                               **{f"fixed_{world.size * m}": samples(sel("fixed", m)) for m in spec["batches"]}},
            "best_lr": {world.size * m: lr for m, (_, lr) in best.items()},
            "adaptive_vs_best_fixed": {v: over(t, best_fixed) for v, t in adaptive.items()},
            "adaptive_vs_best_fixed_per_seed": {v: finite(statistics.median(p)) if p else None
                                                for v, p in paired.items()},
            "adaptive_vs_best_fixed_each_seed": {v: [finite(round(x, 3)) for x in p] for v, p in paired.items()},
            "adaptive_vs_start_batch": {v: over(t, start) for v, t in adaptive.items()},
            "adaptive_vs_start_batch_below": bound}


def run(args: argparse.Namespace) -> int:
    from hvdtrain.errors import ConfigError
    from hvdtrain.world import World

    names = [t for t in args.tasks.split(",") if t]
    bad = [t for t in names if t not in TASKS]
    if bad or args.seeds < 1:
        raise ConfigError(f"--tasks {bad[0]!r} is not allowed; choose from {', '.join(TASKS)}" if bad
                          else "--seeds must be >= 1")
    targets = _per_task("--targets", args.targets, "pylm=1.6", float)
    lrs = _per_task("--lrs", args.lrs, "pylm=0.001/0.003", lambda v: [float(x) for x in v.split("/")])
    batches = _per_task("--batches", args.batches, "pylm=8/16/32", lambda v: [int(x) for x in v.split("/")])
    best_lrs = _per_task("--best-lrs", args.best_lrs, "pylm=8:0.002/32:0.003",
                         lambda v: {int(b): float(lr) for b, lr in (x.split(":") for x in v.split("/"))})
    both = sorted(set(best_lrs) & (set(lrs) | set(batches)))
    if both:
        raise ConfigError(f"--best-lrs {both[0]}=... replaces the grid and the batches; drop --lrs/--batches "
                          f"{both[0]}=...")
    variants = _variants(args.variants)
    world = World.init()
    given = [("--batches", k, v) for k, v in batches.items()] + [("--best-lrs", k, [*v]) for k, v in best_lrs.items()]
    for flag, name, sizes in given:  # the same check on every rank, before any of them trains
        if sizes != sorted(set(sizes)) or any(b <= 0 or b % world.size for b in sizes):
            raise ConfigError(f"{flag} {name}={'/'.join(map(str, sizes))}: expected distinct global batches, "
                              f"smallest first, each a positive multiple of the {world.size} ranks")
    for name in names:
        _task(world, name, args.seeds, args.budget_s, args.eval_samples, targets.get(name), variants,
              lrs.get(name), batches.get(name), args.overrides, best_lrs.get(name))
    return 0


def _per_task(flag: str, text: str, example: str, parse: Any) -> dict[str, Any]:
    """`TASK=VALUE,...` -> {task: parse(VALUE)}, or a ConfigError naming the flag."""
    from hvdtrain.errors import ConfigError

    try:
        out = {k: parse(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv)}
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected TASK=VALUE,..., e.g. {example}") from None
    if set(out) - set(TASKS):
        raise ConfigError(f"{flag} names {sorted(set(out) - set(TASKS))}; choose from {', '.join(TASKS)}")
    return out
