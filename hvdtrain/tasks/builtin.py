"""Built-in tasks: data embedded or generated locally (nothing is downloaded), a model and a loss.

A loss function takes (model, batch) and returns (mean loss, sums) where `sums` maps metric names
to per-batch sums (e.g. correct predictions); the trainer reports each as sum / samples over ranks.
"""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from hvdtrain.config import Config
from hvdtrain.errors import DataError
from hvdtrain.step import LossFn, classification_loss
from hvdtrain.tasks.models import GPT, DigitsCNN, ResNet, SignalCNN


def lm_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-byte cross-entropy on (inputs, targets) blocks."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), {}


@dataclass
class Task:
    model: nn.Module
    train_set: Dataset
    eval_set: Dataset
    loss_fn: LossFn


def _split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed train/eval split, the same on every rank (depends only on the seed)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def digits(cfg: Config) -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    tr, va = _split(len(y), cfg.data.val_fraction, cfg.seed)
    model = DigitsCNN(cfg.model.width)
    return Task(model, TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va]), classification_loss)


@functools.lru_cache(maxsize=2)
def mnist1d_signals(samples: int, held_out: float) -> tuple[torch.Tensor, ...]:
    """MNIST-1D (Greydanus 2020): ten 1-D digit templates, padded, scaled, shifted, sheared and noised
    into 40-point signals, generated here by the `mnist1d` package (its download path is not used).

    The data does not depend on the run's seed: every seed of a benchmark sees the same task. The
    generator reseeds the global `random` and NumPy states; they are restored so the caller's stay
    untouched. Cached because generating 20k signals takes seconds and the benchmark rebuilds tasks.
    """
    import numpy as np
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.train_split = samples, 1.0 - held_out
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        d = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32).unsqueeze(1)  # noqa: E731 - (N, 1, 40)
    return as_x(d["x"]), torch.tensor(d["y"]), as_x(d["x_test"]), torch.tensor(d["y_test"])


def mnist1d(cfg: Config) -> Task:
    x, y, xv, yv = mnist1d_signals(cfg.data.mnist1d_samples, cfg.data.val_fraction)
    if len(yv) == 0 or len(y) == 0:
        raise DataError(f"data.mnist1d_samples={cfg.data.mnist1d_samples} leaves an empty training or held-out "
                        f"set at data.val_fraction={cfg.data.val_fraction}; raise data.mnist1d_samples")
    model = SignalCNN(cfg.model.width, length=x.shape[-1])
    return Task(model, TensorDataset(x, y), TensorDataset(xv, yv), classification_loss)


class ByteBlocks(Dataset):
    """Non-overlapping blocks of a byte corpus: sample i is (bytes[i*T : i*T+T], the next bytes)."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block: i * self.block + self.block + 1].long()
        return chunk[:-1], chunk[1:]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_corpus(path: str, max_bytes: int) -> torch.Tensor:
    """The bytes of .py files under `path` (default: this interpreter's stdlib), in sorted order."""
    root = Path(path) if path else stdlib_dir()
    if not root.is_dir():
        raise DataError(f"data.path {root} does not exist or is not a folder; point it at a folder of .py files")
    chunks, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        b = f.read_bytes()
        chunks.append(b[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 2048:
        raise DataError(f"data.path {root} holds only {total} bytes of .py source; pylm needs at least 2048")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def pylm(cfg: Config) -> Task:
    data = python_corpus(cfg.data.path, cfg.data.max_bytes)
    # Split by position (the tail is held out) so eval text never overlaps training blocks.
    cut = int(len(data) * (1 - cfg.data.val_fraction))
    train = ByteBlocks(data[:cut], cfg.model.block_size)
    val = ByteBlocks(data[cut:], cfg.model.block_size)
    if len(val) == 0:
        raise DataError(f"the held-out corpus is shorter than one block ({cfg.model.block_size}); raise data.max_bytes")
    return Task(GPT(cfg.model), train, val, lm_loss)


def synthetic(cfg: Config) -> Task:
    g = torch.Generator().manual_seed(cfg.seed)
    n, s = cfg.data.synthetic_samples, cfg.data.image_size
    x = torch.randn(n, 3, s, s, generator=g)
    y = torch.randint(0, cfg.data.num_classes, (n,), generator=g)
    tr, va = _split(n, cfg.data.val_fraction, cfg.seed)
    model = ResNet(cfg.model.width, cfg.data.num_classes)
    return Task(model, TensorDataset(x[tr], y[tr]), TensorDataset(x[va], y[va]), classification_loss)


BUILDERS: dict[str, Callable[[Config], Task]] = {"digits": digits, "mnist1d": mnist1d, "pylm": pylm,
                                                  "synthetic": synthetic}


def check_inputs(cfg: Config) -> None:
    """Fail before any rank starts work on inputs a task would only discover later."""
    if cfg.task == "pylm" and cfg.data.path and not os.path.isdir(cfg.data.path):
        raise DataError(f"data.path {cfg.data.path} does not exist or is not a folder; "
                        "point it at a folder of .py files")


def build_task(cfg: Config) -> Task:
    """Model weights depend on the seed only, so every rank builds the same model."""
    torch.manual_seed(cfg.seed)
    return BUILDERS[cfg.task](cfg)
