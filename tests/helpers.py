"""Shared test helpers: a tiny classification problem, plain-PyTorch references, rank-shared tmp dirs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hvdtrain.config import Config, LogConfig, OptimConfig, TrainConfig


def blobs(n: int = 192, dim: int = 12, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


def mlp(seed: int = 0, dim: int = 12, classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, classes))


def tiny_gpt(seed: int = 0) -> nn.Module:
    """A 3-block GPT with tied embeddings (16 tokens, width 16)."""
    from hvdtrain.config import ModelConfig
    from hvdtrain.tasks.models import GPT

    torch.manual_seed(seed)
    return GPT(ModelConfig(block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.0))


def text(n: int = 64, seed: int = 0) -> TensorDataset:
    """n random byte sequences of 17 tokens, as (16 inputs, 16 next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (n, 17), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, dict]:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)), {}


def small_config(**train) -> Config:
    base = {"epochs": 2, "batch_size": 4, "accumulation": 2, "shuffle": False}
    base.update(train)
    return Config(train=TrainConfig(**base), optim=OptimConfig(name="sgd", lr=0.05, momentum=0.9),
                  log=LogConfig(every=1, progress=False, tensorboard=False))


def shared_tmpdir(world) -> str:
    """A folder made by rank 0 and named to every rank (all ranks run on one host in tests)."""
    path = tempfile.mkdtemp(prefix="hvdtrain-test-") if world.is_root else None
    return world.broadcast_object(path, name="test.tmpdir")


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `path` (made here) with mount `options`; pytest.skip where mounting needs
    root this process lacks. Unmounted on exit."""
    import pytest

    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_digits(world, *overrides: str):
    """The digits demo config with `overrides`; 15 cosine epochs converge (~99%), and a 30% hold-out
    (539 images) makes one image 0.19 points, so a 0.5-point criterion measures the change being
    tested rather than one sample."""
    import hvdtrain
    from hvdtrain.config import build
    from hvdtrain.tasks import build_task

    cfg = build("configs/digits.yaml", ["train.epochs=15", "data.val_fraction=0.3", "log.progress=false",
                                        "log.tensorboard=false", *overrides])
    task = build_task(cfg)
    return hvdtrain.fit(world, task.model, None, task.train_set, cfg, task.eval_set, task.loss_fn)


class Crash(Exception):
    """Raised by `crashing_fit`'s loss: a stand-in for a job killed mid-run."""


def crashing_fit(world, data, cfg: Config, seed: int, crash_at: int | None = None):
    """fit() on a fresh mlp(seed); every rank raises Crash at the same micro-batch `crash_at`
    (before any collective of that step). Returns (model, FitResult)."""
    import hvdtrain
    from hvdtrain.tasks import classification_loss

    model, calls = mlp(seed=seed), [0]

    def loss_fn(m, batch):
        calls[0] += 1
        if calls[0] == crash_at:
            raise Crash
        return classification_loss(m, batch)

    return model, hvdtrain.fit(world, model, None, data, cfg, loss_fn=loss_fn)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def mpijob() -> dict:
    """examples/mpijob.yaml, parsed."""
    import yaml

    return yaml.safe_load((EXAMPLES / "mpijob.yaml").read_text())


def sbatch_lines(name: str) -> list[str]:
    """examples/NAME's lines, continuation lines joined."""
    return (EXAMPLES / name).read_text().replace("\\\n", " ").splitlines()
