"""NVTX ranges around the phases of a step, for Nsight Systems on CUDA; nothing on CPU."""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.cache
def _cuda() -> bool:
    # torch.cuda.is_available() costs ~7 us a call on CPU, and a step opens four ranges.
    return torch.cuda.is_available()


def nvtx_range(name: str) -> contextlib.AbstractContextManager:
    """An NVTX range for Nsight Systems on CUDA; nothing on CPU."""
    return torch.cuda.nvtx.range(name) if _cuda() else contextlib.nullcontext()
