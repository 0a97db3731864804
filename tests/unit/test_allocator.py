"""glibc malloc pinning: when it applies, and that it stops the per-step re-faulting of large buffers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvdtrain.allocator import glibc, why_not_pinned

_FAULTS = """
import json, resource, statistics, sys
import torch
from hvdtrain.allocator import pin_malloc
pinned = pin_malloc({}) if sys.argv[1] == "pin" else False
def step():  # a 40 MiB activation-sized buffer, filled and freed, as a CPU step does
    t = torch.ones(10 << 20)
    return float(t[-1])
for _ in range(3):
    step()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"pinned": pinned, "faults": statistics.median(faults)}))
"""


def _faults_per_step(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("env", "reason"), [
    ({"HVDTRAIN_MALLOC": "system"}, "HVDTRAIN_MALLOC=system"),
    ({"MALLOC_MMAP_THRESHOLD_": "1000000"}, "glibc's thresholds are set in the environment"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "glibc's thresholds are set in the environment"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "another allocator is preloaded"),
])
def test_the_users_choice_of_allocator_is_left_alone(env: dict, reason: str) -> None:
    assert why_not_pinned(env) == reason


@pytest.mark.skipif(glibc() is None, reason="glibc only")
def test_pinning_stops_large_buffers_being_faulted_in_every_step() -> None:
    assert why_not_pinned({}) is None
    system, pinned = _faults_per_step("system"), _faults_per_step("pin")
    assert pinned["pinned"] is True and system["pinned"] is False
    # glibc maps a 40 MiB block afresh each time (10,240 pages, fewer with transparent huge pages);
    # pinned, the block is reused from the heap (the median step faults nothing; now and then a
    # step still re-faults it, so the median, not the mean).
    assert system["faults"] > 10 * max(pinned["faults"], 1.0), (system, pinned)
