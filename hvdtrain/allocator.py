"""glibc malloc policy for CPU training: reuse freed buffers instead of mapping and faulting them afresh.

A CPU training step allocates and frees the same large tensors every step (activations, the
logits and their gradient). glibc serves blocks above its mmap threshold (dynamic, 128 KiB up to
32 MiB) with a fresh mmap and gives heap memory back to the kernel once more than its trim
threshold is free at the top, so each step faults those pages in again and the kernel zeroes
them: on pylm at one rank, 60-680 minor faults a step in six runs, and its time swings with where
the allocator happens to stand. With a 64 MiB mmap threshold and a 128 MiB trim threshold the blocks
stay in the heap and are reused (0-6 faults a step). The price: up to 128 MiB of freed memory per
arena stays resident, as PyTorch's CUDA caching allocator keeps freed device memory.

Set from `World.init` on CPU-only processes (GPU steps allocate in CUDA's own caching allocator),
unless `HVDTRAIN_MALLOC=system`, the user already chose glibc's thresholds (`MALLOC_*_THRESHOLD_`,
`GLIBC_TUNABLES`), or another allocator is preloaded. `mallopt` works at any time, unlike the
environment variables, which glibc reads only at process start.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping

MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@functools.cache  # the memory profiler trims every step
def glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
    except (OSError, AttributeError):
        return None
    return libc


def why_not_pinned(env: Mapping[str, str]) -> str | None:
    """The reason to leave malloc as it is, or None to pin it."""
    if env.get("HVDTRAIN_MALLOC", "pinned") == "system":
        return "HVDTRAIN_MALLOC=system"
    if "MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env or "malloc" in env.get("GLIBC_TUNABLES", ""):
        return "glibc's thresholds are set in the environment"
    if any(name in env.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return "another allocator is preloaded"
    if glibc() is None:
        return "the C library is not glibc"
    return None


def pin_malloc(env: Mapping[str, str]) -> bool:
    """Pin glibc's thresholds unless `why_not_pinned(env)`; True if they were set."""
    if why_not_pinned(env) is not None:
        return False
    libc = glibc()
    assert libc is not None
    # Older glibc caps the mmap threshold at 32 MiB (mallopt returns 0 above it).
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) or libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    return bool(mmap_ok) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def malloc_trim() -> None:
    """Give freed heap memory back to the kernel, so the resident set shows only live memory
    (before a peak-RSS measurement). A no-op where libc is not glibc."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
