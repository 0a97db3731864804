"""Config sections of the memory toolkit, adaptive batch sizing and elastic training, and the
validators every section uses. Kept apart from config.py so each file stays readable; import them
from hvdtrain.config as before (it re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hvdtrain.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
ADAPTIVE_LR_RULES = ("adascale", "linear", "sqrt", "none")
ADAPTIVE_POLICIES = ("goodput", "decay_to_batch")
OOM_PHASES = ("forward", "backward")


def _choice(section: str, name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _at_least(section: str, name: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{section}.{name}={value!r} must be >= {low}")


def parse_milestones(text: str) -> tuple[int, ...]:
    """`"300,600"` -> (300, 600): positive, strictly increasing; ConfigError names optim.milestones."""
    try:
        steps = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        steps = (0,)
    if any(s <= 0 for s in steps) or list(steps) != sorted(set(steps)):
        raise ConfigError(f"optim.milestones={text!r} must be increasing positive steps, e.g. \"300,600\"")
    return steps


STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")


def parse_signals(text: str) -> tuple[str, ...]:
    """`"SIGTERM,SIGUSR1"` -> ("SIGTERM", "SIGUSR1"); ConfigError names train.stop_signals."""
    names = tuple(t.strip().upper() for t in text.split(",") if t.strip())
    names = tuple(n if n.startswith("SIG") else "SIG" + n for n in names)
    bad = [n for n in names if n not in STOP_SIGNALS]
    if bad:
        raise ConfigError(f"train.stop_signals={text!r}: {bad[0]} is not allowed; "
                          f"choose from {', '.join(STOP_SIGNALS)}")
    return names


def parse_steps(text: str) -> tuple[int, int]:
    """`"5-7"` or `"5"` -> first and last step (1-based, inclusive); ConfigError names memory.trace_steps."""
    first, _, last = text.partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise ConfigError(f"memory.trace_steps={text!r} must look like 5-7 (first-last step) or 5") from None
    if not 1 <= a <= b:
        raise ConfigError(f"memory.trace_steps={text!r} needs 1 <= first <= last")
    return a, b


@dataclass(frozen=True)
class MemoryConfig:
    """Memory toolkit: mixed precision, activation checkpointing, ZeRO sharding, the memory profiler."""

    precision: str = "fp32"  # fp32 | bf16 (autocast, no scaler) | fp16 (autocast and a dynamic loss scale)
    activation_checkpointing: bool = False  # recompute each block of the model's `blocks` in backward
    profile: bool = False  # per-step memory figures in the metrics log and a table at the end
    trace_steps: str = ""  # e.g. "5-7": a torch.profiler trace of those steps, written under log.dir
    loss_scale: float = 65536.0  # fp16: initial loss scale
    scale_growth_interval: int = 2000  # fp16: steps without overflow before the scale doubles
    zero_stage: int = 0  # 0: replicated; 1: optimizer state sharded; 2: + gradients; 3: + parameters
    # ZeRO-3's sharding units: "" = each top-level child (a ModuleList's entries); else a comma list of
    # class names or qualified-name patterns (e.g. "Block" or "blocks.*"), outermost matches taken
    zero3_units: str = ""
    zero3_prefetch: int = 1  # ZeRO-3: units whose allgather is launched ahead of use (0: gather on use)

    def __post_init__(self) -> None:
        _choice("memory", "precision", self.precision, PRECISIONS)
        _choice("memory", "zero_stage", self.zero_stage, (0, 1, 2, 3))
        _at_least("memory", "zero3_prefetch", self.zero3_prefetch, 0)
        if self.trace_steps:
            parse_steps(self.trace_steps)
        if self.loss_scale <= 0:
            raise ConfigError(f"memory.loss_scale={self.loss_scale!r} must be > 0")
        _at_least("memory", "scale_growth_interval", self.scale_growth_interval, 1)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Adaptive batch sizing (docs/adaptive.md): one controller picks micro-batch m and accumulation k
    (global batch B = ranks x m x k) to maximise goodput, and scales the lr by `lr_rule`."""

    enabled: bool = False
    max_batch: int = 0  # B_max, global samples per step; 0 = 16 x the starting global batch
    max_micro_batch: int = 0  # cap on m per rank; 0 = what the memory probe finds (or B_max / ranks)
    decide_every: int = 50  # optimizer steps between batch decisions
    warmup_steps: int = 100  # steps before the first decision (the estimators need data)
    smoothing: float = 0.999  # per starting-batch worth of samples; horizon = B0 / (1 - smoothing) samples
    # goodput: B from the noise scale and measured step times; decay_to_batch (Smith et al. 2018): each
    # lr decay of optim.schedule=step becomes B x 1/gamma instead (up to max_batch), lr factor B / B0.
    policy: str = "goodput"
    lr_rule: str = "adascale"  # adascale (gain r; sqrt(r) for adam/adamw) | linear | sqrt | none (B / B0)
    hysteresis: float = 0.05  # switch only if the predicted goodput gain exceeds this fraction
    max_growth: float = 2.0  # largest factor the batch may grow (or shrink) per decision
    norm_test: float = 1.0  # theta of the norm test floor B >= noise scale / theta^2; 0 = no floor
    precondition: bool = True  # adam/adamw: measure the noise scale on preconditioned gradients
    # adam/adamw: on a batch change, scale exp_avg_sq by the expected change of E[g²], (1 + φ/B')/(1 + φ/B)
    rescale_adam: bool = True
    probe: bool = True  # memory probe before step 1 (cap on m, preferred m)
    memory_budget_mb: float = 0.0  # CPU probe budget; 0 = memory_fraction x available RAM
    memory_fraction: float = 0.8  # share of available (CPU) or total (GPU) memory the probe may plan for
    probe_margin: float = 0.1  # predicted largest m is scaled down by this before it is verified
    oom_shrink: float = 0.9  # after an OOM, m becomes the largest divisor of m x k that is <= this x m

    def __post_init__(self) -> None:
        _choice("adaptive", "lr_rule", self.lr_rule, ADAPTIVE_LR_RULES)
        _choice("adaptive", "policy", self.policy, ADAPTIVE_POLICIES)
        for name in ("max_batch", "max_micro_batch", "warmup_steps", "norm_test", "memory_budget_mb"):
            _at_least("adaptive", name, getattr(self, name), 0)
        _at_least("adaptive", "decide_every", self.decide_every, 1)
        _at_least("adaptive", "max_growth", self.max_growth, 1.0)
        _at_least("adaptive", "hysteresis", self.hysteresis, 0.0)
        for name in ("smoothing", "memory_fraction", "probe_margin", "oom_shrink"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"adaptive.{name}={getattr(self, name)!r} must be between 0 and 1 (exclusive)")


@dataclass(frozen=True)
class FaultsConfig:
    """Testing switches (hvdtrain/faults.py): faults injected on purpose, to see what the toolkit does."""

    oom_above: int = 0  # a real torch.OutOfMemoryError on micro-batches larger than this; 0 = off
    oom_rank: int = -1  # only on this rank (-1 = every rank)
    oom_step: int = 0  # only from this optimizer step on (0-based; the memory probe counts as step 0)
    oom_in: str = "backward"  # forward | backward (mid-backward, after some buckets may have left)

    def __post_init__(self) -> None:
        _choice("faults", "oom_in", self.oom_in, OOM_PHASES)
        for name in ("oom_above", "oom_step"):
            _at_least("faults", name, getattr(self, name), 0)
        _at_least("faults", "oom_rank", self.oom_rank, -1)


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic training under `horovodrun --min-np/--max-np --host-discovery-script` (docs/fault-tolerance.md)."""

    enabled: bool = False  # survive workers leaving and joining; keeps the global batch of the first world
    commit_every: int = 10  # steps between in-memory commits; a failure rolls back to the last one
    trace_samples: bool = False  # rank 0 writes each step's sample indices per rank to log.dir/samples.jsonl

    def __post_init__(self) -> None:
        _at_least("elastic", "commit_every", self.commit_every, 1)


@dataclass(frozen=True)
class ParallelConfig:
    """Pipeline model parallelism (docs/pipeline.md): N ranks = S stages of the model's layers x D
    replicas; MPI controller only."""

    pipeline_stages: int = 1  # S; 1 = data parallel only
    schedule: str = "1f1b"  # 1f1b (at most S micro-batches' activations alive per stage) | gpipe (all m)
    # cut by parameter count, by forward+backward time per layer (measured on rank 0 on the first
    # micro-batch before training), or "3,5": layers per stage
    balance: str = "params"

    def __post_init__(self) -> None:
        _at_least("parallel", "pipeline_stages", self.pipeline_stages, 1)
        _choice("parallel", "schedule", self.schedule, ("1f1b", "gpipe"))
        if self.balance not in ("params", "time"):
            counts = [t.strip() for t in self.balance.split(",")]
            if len(counts) != self.pipeline_stages or not all(t.isdigit() and int(t) > 0 for t in counts):
                raise ConfigError(f"parallel.balance={self.balance!r} is not allowed; choose params, time, or "
                                  f"{self.pipeline_stages} positive layer counts, one per stage (e.g. "
                                  f"\"{','.join(['2'] * self.pipeline_stages)}\")")


# Features a pipeline run does not have yet, each with the reason (checked when pipeline_stages > 1).
_NOT_WITH_PIPELINE = (
    ("elastic.enabled", lambda c: c.elastic.enabled, "a new world would need a new cut of the model"),
    ("adaptive.enabled", lambda c: c.adaptive.enabled, "its probe and batch changes assume one model per rank"),
    ("memory.zero_stage", lambda c: c.memory.zero_stage, "ZeRO shards a stage's parameters among its replicas, "
     "and tied parameters across the first and last stage are summed outside the shards"),
    ("train.on_oom=retry", lambda c: c.train.on_oom == "retry", "a stage out of memory mid-schedule cannot send its "
     "neighbours what they wait for; set train.on_oom=stop"),
    ("comm.compression=auto", lambda c: c.comm.compression == "auto", "pick fp16, bf16 or none"),
)


def check_combinations(c: Any) -> None:
    """Settings that are valid alone but not together, refused before any rank starts."""
    per_rank = c.train.batch_size * c.train.accumulation
    if c.adaptive.enabled and c.adaptive.max_batch and c.adaptive.max_batch < per_rank:
        raise ConfigError(f"adaptive.max_batch={c.adaptive.max_batch} is below the starting global batch "
                          f"(ranks x train.batch_size x train.accumulation >= {per_rank}); raise it or set 0")
    if c.adaptive.enabled and c.adaptive.policy == "decay_to_batch" and (
            c.optim.schedule != "step" or c.adaptive.lr_rule in ("sqrt", "none")):
        # The policy turns the schedule's decays into batch growth at lr factor B / B0 (the linear rule).
        raise ConfigError("adaptive.policy=decay_to_batch needs optim.schedule=step with optim.milestones, and "
                          f"adaptive.lr_rule adascale or linear (got schedule={c.optim.schedule!r}, "
                          f"lr_rule={c.adaptive.lr_rule!r})")
    if c.elastic.enabled and c.memory.zero_stage:
        # ZeRO shards are laid out for one world size; an elastic reset would need a live re-shard.
        raise ConfigError(f"memory.zero_stage={c.memory.zero_stage} cannot be combined with "
                          "elastic.enabled=true; use zero_stage 0 for elastic runs")
    if c.adaptive.enabled and c.data.num_workers:
        # Its micro-batch can change at any step, so nothing can be loaded ahead in another process.
        raise ConfigError(f"data.num_workers={c.data.num_workers} cannot be combined with adaptive.enabled=true "
                          "(the batch shape changes between steps); use data.num_workers=0")
    if c.memory.zero_stage == 3 and c.comm.error_feedback:
        # Each micro-batch reduce-scatters on its own: there is no one residual per step to carry.
        raise ConfigError("comm.error_feedback cannot be combined with memory.zero_stage=3; turn it off")
    if c.memory.trace_steps and not c.log.dir:
        raise ConfigError("memory.trace_steps needs log.dir (the trace is written there)")
    _check_pipeline(c)
    _check_transport(c)


def _check_transport(c: Any) -> None:
    # The direct path relies on the same buckets, launched in the same order, every step.
    changes = [("memory.zero_stage", c.memory.zero_stage), ("adaptive.enabled", c.adaptive.enabled),
               ("elastic.enabled", c.elastic.enabled), ("parallel.pipeline_stages", c.parallel.pipeline_stages > 1)]
    used = [name for name, on in changes if on]
    if c.comm.transport != "horovod" and used:
        raise ConfigError(f"comm.transport={c.comm.transport} cannot be combined with {used[0]} (its bucket layout "
                          "changes or lives in process sets); use comm.transport=horovod")


def _check_pipeline(c: Any) -> None:
    if c.parallel.pipeline_stages == 1:
        return
    for name, used, why in _NOT_WITH_PIPELINE:
        if used(c):
            raise ConfigError(f"{name} cannot be combined with parallel.pipeline_stages="
                              f"{c.parallel.pipeline_stages} yet: {why}")
