"""Small helpers the loop, the checkpoints, the memory probe and the benchmarks share: moving a batch
to a device, its length, the process's random-number state, what counts as out of memory and how a
step's shape shrinks after one. A leaf: it imports nothing from hvdtrain but its errors."""

from __future__ import annotations

import gc
import random
from typing import Any

import numpy as np
import torch
from torch import nn

_OOM_TEXT = ("out of memory", "can't allocate memory", "not enough memory")


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` (a tensor, or lists, tuples and dicts of them) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def batch_len(batch: Any) -> int:
    """Samples in `batch`: the length of its first tensor."""
    while isinstance(batch, (list, tuple, dict)):
        batch = batch[0] if not isinstance(batch, dict) else next(iter(batch.values()))
    return len(batch)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's torch, NumPy, Python and CUDA random states, as tensors and plain values
    (loadable with `torch.load(weights_only=True)`)."""
    np_state: Any = np.random.get_state()  # (name, keys, pos, has_gauss, cached_gaussian)
    return {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_oom(exc: BaseException) -> bool:
    """A CUDA OOM (torch.OutOfMemoryError) or a CPU allocator failure."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def free_after_oom(model: nn.Module, device: torch.device) -> None:
    """Drop gradients (the reducer sends zeros for a missing .grad) and cached blocks."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def num_samples(dataset: Any) -> int:
    """len(dataset): the loop takes map-style datasets (torch's Dataset type does not declare __len__)."""
    return len(dataset)


def largest_divisor(n: int, at_most: float) -> int:
    """The largest divisor of n that is at most `at_most` (1 at least)."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(at_most, 1))


def shrink_after_oom(m: int, k: int, shrink: float) -> tuple[int, int]:
    """(m', k') after an OOM at micro-batch m: the largest divisor of m·k at most `shrink`·m, and k
    raised to keep m·k, so the global batch, the lr and the step's samples stay the same."""
    if m == 1:
        from hvdtrain.errors import TrainingStopped

        raise TrainingStopped("out of memory with a micro-batch of 1 sample on some rank; use a smaller model "
                              "or more memory")
    smaller = largest_divisor(m * k, min(m * shrink, m - 1))
    return smaller, m * k // smaller
