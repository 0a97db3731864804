"""Typed, frozen run configuration: built from defaults, a YAML/TOML file and `--set a.b=v` overrides.

Every value is validated on construction, before any rank initialises Horovod, so a typo fails
identically and immediately on every rank instead of after minutes of work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

from hvdtrain.config_features import (  # noqa: F401 - re-exported: import sections from hvdtrain.config
    ADAPTIVE_LR_RULES,
    OOM_PHASES,
    PRECISIONS,
    AdaptiveConfig,
    ElasticConfig,
    FaultsConfig,
    MemoryConfig,
    ParallelConfig,
    _at_least,
    _choice,
    check_combinations,
    parse_milestones,
    parse_signals,
    parse_steps,
)
from hvdtrain.errors import ConfigError

TASKS = ("digits", "mnist1d", "pylm", "synthetic")
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCALING = ("linear", "sqrt", "none")
SCHEDULES = ("constant", "cosine", "step")
COMPRESSION = ("none", "fp16", "bf16", "auto")
# (layers, heads, embedding width): about 0.1M, 11M, 86M and 304M parameters at vocabulary 256.
GPT_PRESETS = {"tiny": (2, 2, 64), "small": (6, 6, 384), "medium": (12, 12, 768), "large": (24, 16, 1024)}


@dataclass(frozen=True)
class DataConfig:
    """Where data comes from and how it is split."""

    path: str = ""  # pylm: folder of .py files (default: the running interpreter's stdlib)
    max_bytes: int = 4_000_000  # pylm: cap on corpus bytes read
    val_fraction: float = 0.1  # share of samples held out for evaluation
    synthetic_samples: int = 2048  # synthetic: dataset size
    image_size: int = 32  # synthetic: image height and width
    num_classes: int = 10  # synthetic: label count
    mnist1d_samples: int = 20_000  # mnist1d: signals generated (training and held out together)
    # Loading: 0 workers loads in the training process. Workers decode and collate ahead of the
    # step (prefetch_factor micro-batches each) and live for the whole run (persistent_workers), not
    # one epoch. `worker_start`: fork (PyTorch's default on Linux; any script works) or forkserver /
    # spawn (Horovod's advice on InfiniBand hosts, whose verbs stack is not fork-safe; the script
    # then needs `if __name__ == "__main__":`, and the dataset must pickle).
    num_workers: int = 0
    prefetch_factor: int = 2
    persistent_workers: bool = True
    worker_start: str = "fork"  # fork | forkserver | spawn
    pin_memory: bool = True  # page-locked host batches on CUDA (async copies); ignored on CPU

    def __post_init__(self) -> None:
        _at_least("data", "num_workers", self.num_workers, 0)
        _at_least("data", "prefetch_factor", self.prefetch_factor, 1)
        _choice("data", "worker_start", self.worker_start, ("fork", "forkserver", "spawn"))
        _at_least("data", "max_bytes", self.max_bytes, 1024)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction!r} must be between 0 and 1 (exclusive)")
        _at_least("data", "synthetic_samples", self.synthetic_samples, 1)
        _at_least("data", "image_size", self.image_size, 8)
        _at_least("data", "num_classes", self.num_classes, 2)
        _at_least("data", "mnist1d_samples", self.mnist1d_samples, 20)


@dataclass(frozen=True)
class ModelConfig:
    """Model size. CNN/ResNet use `width`; the GPT uses layers/heads/embedding/block size."""

    preset: str = ""  # GPT size preset; sets n_layer, n_head and n_embd (see GPT_PRESETS)
    width: int = 32  # channels of the first convolution
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64  # tokens per sample
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _choice("model", "preset", self.preset, ("",) + tuple(GPT_PRESETS))
        if self.preset:
            # Frozen dataclass: the preset is resolved once here so print-config shows real sizes.
            for key, value in zip(("n_layer", "n_head", "n_embd"), GPT_PRESETS[self.preset]):
                object.__setattr__(self, key, value)
        for name in ("width", "n_layer", "n_head", "n_embd", "block_size"):
            _at_least("model", name, getattr(self, name), 1)
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout!r} must be in [0, 1)")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning rate. `lr` is tuned for one rank's batch; scaling follows `lr_scaling`."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_scaling: str = "linear"  # lr x (ranks x accumulation) [linear], its square root [sqrt], or none
    warmup_steps: int = 0  # linear warm-up from the base lr to the scaled lr
    schedule: str = "constant"  # after warm-up: constant | cosine (to 0 at the end) | step (x gamma at milestones)
    milestones: str = ""  # schedule=step: comma-separated steps, e.g. "300,600" (adaptive: steps of the starting batch)
    gamma: float = 0.1  # schedule=step: lr factor at each milestone
    clip_grad_norm: float = 0.0  # 0 disables clipping

    def __post_init__(self) -> None:
        _choice("optim", "name", self.name, OPTIMIZERS)
        _choice("optim", "lr_scaling", self.lr_scaling, LR_SCALING)
        _choice("optim", "schedule", self.schedule, SCHEDULES)
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr!r} must be > 0")
        if not 0.0 < self.gamma < 1.0:
            raise ConfigError(f"optim.gamma={self.gamma!r} must be between 0 and 1 (exclusive)")
        milestones = parse_milestones(self.milestones)
        if self.schedule == "step" and not milestones:
            raise ConfigError('optim.schedule=step needs optim.milestones, e.g. "300,600" (steps where the lr is '
                              "multiplied by optim.gamma)")
        if milestones and self.schedule != "step":
            raise ConfigError(f"optim.milestones={self.milestones!r} needs optim.schedule=step (got {self.schedule!r})")
        for name in ("momentum", "weight_decay", "warmup_steps", "clip_grad_norm"):
            _at_least("optim", name, getattr(self, name), 0)


@dataclass(frozen=True)
class TrainConfig:
    """Loop length and batch shape. Global batch = ranks x batch_size x accumulation."""

    epochs: int = 1
    max_steps: int = 0  # stop after this many optimizer steps in total; 0 = run all epochs
    batch_size: int = 32  # per rank, per micro-batch
    accumulation: int = 1  # micro-batches per optimizer step (Horovod backward_passes_per_step)
    eval_every: int = 0  # evaluate every N steps (adaptive batch: every N x starting-batch samples); 0 = each epoch end
    shuffle: bool = True
    stop_after_skips: int = 0  # stop after this many consecutive non-finite steps; 0 = keep skipping
    stall_timeout: float = 1800.0  # seconds without progress before a rank stops the job; 0 = off
    # retry: an OOM on any rank re-runs the step's samples on every rank at half the micro-batch and
    # twice the accumulation (same global batch and lr), kept for the rest of the run; stop: it ends the run
    # on every rank. Adaptive batch sizing always retries (its controller sizes micro-batches by what fits).
    on_oom: str = "retry"
    # Signals that stop training gracefully: every rank stops at the same step boundary, a
    # checkpoint is written and the process exits with code 99 (hvdtrain.stop.EXIT_STOPPED). "" = none.
    stop_signals: str = "SIGTERM,SIGUSR1"
    stop_grace: float = 120.0  # seconds after the first stop signal before the process exits regardless

    def __post_init__(self) -> None:
        _at_least("train", "epochs", self.epochs, 1)
        _choice("train", "on_oom", self.on_oom, ("retry", "stop"))
        parse_signals(self.stop_signals)
        _at_least("train", "stop_grace", self.stop_grace, 0)
        _at_least("train", "stop_after_skips", self.stop_after_skips, 0)
        _at_least("train", "stall_timeout", self.stall_timeout, 0)
        _at_least("train", "max_steps", self.max_steps, 0)
        _at_least("train", "batch_size", self.batch_size, 1)
        _at_least("train", "accumulation", self.accumulation, 1)
        _at_least("train", "eval_every", self.eval_every, 0)


@dataclass(frozen=True)
class CommConfig:
    """Gradient communication. `auto` times the first steps with none and fp16 and keeps the faster."""

    compression: str = "none"  # none | fp16 (overflow-safe) | bf16 (fp32 accumulation) | auto
    error_feedback: bool = False  # carry each rank's compression error into its next gradient
    bucket_mb: float = 25.0  # gradient bucket size; a bucket's collective starts when it is complete
    auto_steps: int = 6  # steps timed per candidate when compression=auto (after 2 warm-up steps)
    # horovod: every bucket through Horovod; mpi: fp32 buckets straight to MPI_Iallreduce (mpi4py; MPI
    # controller); gloo: to a torch.distributed Gloo group (DDP's path); both with no per-collective
    # negotiation (CPU tensors, a fixed layout; hvdtrain/comm/compression.py, Direct)
    transport: str = "horovod"

    def __post_init__(self) -> None:
        _choice("comm", "compression", self.compression, COMPRESSION)
        _choice("comm", "transport", self.transport, ("horovod", "mpi", "gloo"))
        if self.bucket_mb <= 0:
            raise ConfigError(f"comm.bucket_mb={self.bucket_mb!r} must be > 0")
        _at_least("comm", "auto_steps", self.auto_steps, 1)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: one folder per step under `dir`, written atomically, the last `keep` kept."""

    dir: str = ""  # empty: no checkpoints
    every: int = 0  # save every N steps; 0 = at the end of each epoch
    keep: int = 3
    # "": start fresh; "latest": the newest checkpoint in `dir` (it must exist); "auto": the newest
    # if there is one (for requeued jobs); anything else: the path of one checkpoint folder.
    resume: str = ""
    # A save that fails (a full disk): stop the run, or warn and train on (the last good one stays `latest`).
    on_error: str = "stop"

    def __post_init__(self) -> None:
        _at_least("checkpoint", "every", self.every, 0)
        _choice("checkpoint", "on_error", self.on_error, ("stop", "warn"))
        _at_least("checkpoint", "keep", self.keep, 1)
        if self.resume in ("latest", "auto") and not self.dir:
            raise ConfigError(f"checkpoint.resume={self.resume} needs checkpoint.dir (the folder to look in)")


@dataclass(frozen=True)
class LogConfig:
    """Rank-0 output: progress bar, JSONL metrics and TensorBoard under `dir`, MLflow."""

    dir: str = ""  # empty: no metrics files
    every: int = 10  # steps between averaged train metrics
    progress: bool = True
    tensorboard: bool = True
    mlflow: bool = False  # also an MLflow run (pip install 'hvdtrain[mlflow]'; MLFLOW_TRACKING_URI, MLFLOW_RUN_ID)
    mlflow_experiment: str = "hvdtrain"  # unless MLFLOW_EXPERIMENT_NAME / _ID say otherwise

    def __post_init__(self) -> None:
        _at_least("log", "every", self.every, 1)


@dataclass(frozen=True)
class Config:
    """A whole run. `task` picks built-in data and model; the library API ignores it."""

    task: str = "digits"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _choice("config", "task", self.task, TASKS)
        check_combinations(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _finite(path: str, value: float) -> float:
    if not math.isfinite(value):  # NaN passes every `x <= 0` check, and a run with it trains to NaN
        raise ConfigError(f"{path}={value!r} must be a finite number")
    return value


def _coerce(path: str, value: Any, typ: Any) -> Any:
    """Check a raw value against a field's declared type (bool is not an int; int widens to float)."""
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(path, float(value))
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # YAML reads `--set optim.milestones=300` as a number
    raise ConfigError(f"{path}={value!r} has type {type(value).__name__}; expected {typ.__name__}")


def from_dict(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, rejecting unknown keys and wrong types by name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    odd = [k for k in raw if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"key {odd[0]!r} in {prefix or 'the config'} is not a name; "
                          f"allowed: {', '.join(sorted(names))}")
    unknown = sorted(set(raw) - names)
    if unknown:
        where = prefix or "config"
        raise ConfigError(f"unknown key {where}.{unknown[0]}; allowed: {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else key
        typ = hints[key]
        nested = isinstance(typ, type) and dataclasses.is_dataclass(typ)
        kwargs[key] = from_dict(typ, value, path) if nested else _coerce(path, value, typ)
    return cls(**kwargs)


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last
    silently; TOML refuses it, and so do we)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(f"key {key!r} appears twice in one section (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _shipped(p: Path) -> Path:
    """`p`, or where it is missing, the example config of that name shipped in the package
    (configs/ of the checkout): `--config configs/digits.yaml` works from any folder after
    `pip install .`, and so does `--config digits.yaml`."""
    if p.exists() or p.is_absolute() or p.parent not in (Path("."), Path("configs")):
        return p
    from importlib import resources

    try:
        shipped = Path(str(resources.files("hvdtrain.configs").joinpath(p.name)))
    except ModuleNotFoundError:  # an install made before the configs shipped
        return p
    return shipped if shipped.is_file() else p


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) config file into nested dicts."""
    p = _shipped(Path(path))
    kind = "TOML" if p.suffix == ".toml" else "YAML"
    if not p.is_file():
        raise ConfigError(f"config file {p} is a folder; give a YAML or TOML file" if p.is_dir()
                          else f"config file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p} is not UTF-8 text; expected {kind}") from None
    try:
        data = tomllib.loads(text) if kind == "TOML" else yaml.load(text, Loader=_StrictLoader)  # noqa: S506
    except ConfigError as exc:
        raise ConfigError(f"config file {p}: {exc}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"config file {p} is not valid {kind}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold sections (train:, optim:, ...) at the top level, "
                          f"not a {type(data).__name__}")
    return data


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b=value` override in place; the value is parsed as a YAML scalar."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[keys[-1]] = yaml.safe_load(text) if text.strip() else ""


def build(path: str | None = None, overrides: list[str] | tuple[str, ...] = (), **top: Any) -> Config:
    """Defaults <- file <- keyword values <- overrides, validated once at the end."""
    raw: dict[str, Any] = load_file(path) if path else {}
    raw.update({k: v for k, v in top.items() if v is not None})
    for assignment in overrides:
        apply_override(raw, assignment)
    return from_dict(Config, raw)
