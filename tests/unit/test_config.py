import dataclasses

import pytest

from hvdtrain import config as C
from hvdtrain.errors import ConfigError


def test_defaults_are_valid_and_frozen():
    cfg = C.Config()
    assert cfg.task == "digits" and cfg.train.batch_size == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.batch_size = 4  # type: ignore[misc]


@pytest.mark.parametrize("override, message", [
    ("task=imagenet", "config.task='imagenet' is not allowed; choose one of digits, mnist1d, pylm, synthetic"),
    ("optim.name=lamb", "optim.name='lamb' is not allowed; choose one of sgd, adam, adamw"),
    ("optim.lr_scaling=cubic", "optim.lr_scaling='cubic' is not allowed; choose one of linear, sqrt, none"),
    ("train.batch_size=0", "train.batch_size=0 must be >= 1"),
    ("train.batch_size=abc", "train.batch_size='abc' has type str; expected int"),
    ("train.epochs=1.5", "train.epochs=1.5 has type float; expected int"),
    ("train.shuffle=3", "train.shuffle=3 has type int; expected bool"),
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    ("train.bogus=1", "unknown key train.bogus; allowed:"),
    ("model.n_embd=65", "model.n_embd=65 must be divisible by model.n_head=2"),
    ("model.preset=huge", "model.preset='huge' is not allowed"),
    ("data.val_fraction=1.5", "data.val_fraction=1.5 must be between 0 and 1"),
    ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
    ("data.prefetch_factor=0", "data.prefetch_factor=0 must be >= 1"),
    ("data.worker_start=thread", "data.worker_start='thread' is not allowed; choose one of fork, forkserver, spawn"),
    ("checkpoint.resume=latest", "checkpoint.resume=latest needs checkpoint.dir"),
    ("train=3", "train must be a mapping, got int"),
    ("nonsense", "override 'nonsense' must look like section.key=value"),
])
def test_bad_values_name_field_and_allowed(override, message):
    with pytest.raises(ConfigError) as info:
        C.build(None, [override])
    assert message in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["optim.schedule=step"], "optim.schedule=step needs optim.milestones"),
    (["optim.milestones=300,600"], "optim.milestones='300,600' needs optim.schedule=step (got 'constant')"),
    (["optim.schedule=step", "optim.milestones=600,300"], "optim.milestones='600,300' must be increasing positive"),
    (["optim.schedule=step", "optim.milestones=a"], "optim.milestones='a' must be increasing positive"),
    (["optim.gamma=1"], "optim.gamma=1.0 must be between 0 and 1"),
    (["adaptive.policy=smith"], "adaptive.policy='smith' is not allowed; choose one of goodput, decay_to_batch"),
    (["adaptive.enabled=true", "adaptive.policy=decay_to_batch"],
     "adaptive.policy=decay_to_batch needs optim.schedule=step with optim.milestones"),
    (["adaptive.enabled=true", "adaptive.policy=decay_to_batch", "adaptive.lr_rule=sqrt", "optim.schedule=step",
      "optim.milestones=10"], "adaptive.lr_rule adascale or linear (got schedule='step', lr_rule='sqrt')"),
    (["adaptive.enabled=true", "data.num_workers=2"],
     "data.num_workers=2 cannot be combined with adaptive.enabled=true (the batch shape changes between steps)"),
    (["comm.transport=tcp"], "comm.transport='tcp' is not allowed; choose one of horovod, mpi, gloo"),
    (["comm.transport=gloo", "memory.zero_stage=2"],
     "comm.transport=gloo cannot be combined with memory.zero_stage (its bucket layout changes or lives in "
     "process sets); use comm.transport=horovod"),
    (["comm.transport=mpi", "adaptive.enabled=true"], "comm.transport=mpi cannot be combined with adaptive.enabled"),
])
def test_schedule_and_policy_combinations_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        C.build(None, overrides)
    assert message in str(info.value)


def test_int_widens_to_float_and_yaml_scalars_parse():
    cfg = C.build(None, ["optim.lr=1", "train.shuffle=false", "checkpoint.dir=/tmp/x"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.shuffle is False and cfg.checkpoint.dir == "/tmp/x"


def test_yaml_and_toml_files_then_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("task: pylm\ntrain:\n  epochs: 3\n  batch_size: 8\n")
    t = tmp_path / "c.toml"
    t.write_text('task = "synthetic"\n[optim]\nname = "adamw"\nlr = 0.001\n')
    a = C.build(str(y), ["train.epochs=4"])
    assert (a.task, a.train.epochs, a.train.batch_size) == ("pylm", 4, 8)
    b = C.build(str(t))
    assert (b.task, b.optim.name, b.optim.lr) == ("synthetic", "adamw", 0.001)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        C.build(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        C.build(str(bad))
    badt = tmp_path / "bad.toml"
    badt.write_text("train = = 1\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        C.build(str(badt))


def test_preset_resolves_sizes():
    cfg = C.build(None, ["task=pylm", "model.preset=small"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (6, 6, 384)


def test_round_trip_through_dict():
    cfg = C.build(None, ["task=pylm", "optim.name=adam", "train.accumulation=2"])
    assert C.from_dict(C.Config, cfg.to_dict()) == cfg
