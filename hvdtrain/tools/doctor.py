"""`hvdtrain doctor`: what this host gives a GPU job, and the problems that break NCCL jobs before
they start. `hvdtrain launch` runs the same checks on every host through its preflight.

Facts, gathered without importing torch or Horovod (a probe must be fast and must not itself load a
broken driver into the process that asks):
- driver: the NVIDIA kernel module's version (/proc/driver/nvidia/version, else nvidia-smi) and the
  highest CUDA version the user-space driver supports (cuDriverGetVersion);
- CUDA runtime: the CUDA version torch was built for (torch/version.py), and NCCL's (libnccl's
  ncclGetVersion, from torch's nvidia-nccl wheel or the library path);
- GPUs: /dev/nvidia<N> devices (or nvidia-smi's count), against the slots this host is given;
- libcuda: which libcuda.so.1 the loader picks, loaded in a child process, and whether it is the
  toolkit's stub (cuInit answers CUDA_ERROR_STUB_LIBRARY, or it sits in a `stubs` folder): a stub
  left on LD_LIBRARY_PATH after a build makes every CUDA call fail at run time (horovod#3831);
- /dev/shm: its size; Docker's default of 64 MiB breaks NCCL's shared-memory setup and Open MPI's
  shared-memory transport ("docker run --shm-size=1g" or "--ipc=host").
"""

from __future__ import annotations

import argparse
import ctypes.util
import glob
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

SHM_MIN = 512 * 2**20  # below this, NCCL's and Open MPI's shared-memory buffers do not fit a node's ranks
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_NO_DEVICE = 100

# Run in a child: loads the libcuda.so.1 the dynamic loader picks and reports where it came from
# and what cuInit / cuDriverGetVersion say.
_LIBCUDA_PROBE = r"""
import ctypes, json
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print(json.dumps({"found": False, "error": str(e)})); raise SystemExit
path = next((l.split()[-1] for l in open("/proc/self/maps") if "libcuda.so" in l and "/" in l), None)
v = ctypes.c_int(0)
init = lib.cuInit(0)
got = lib.cuDriverGetVersion(ctypes.byref(v)) if hasattr(lib, "cuDriverGetVersion") else -1
print(json.dumps({"found": True, "path": path, "init": init, "driver_cuda": v.value if got == 0 else None}))
"""


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def kernel_driver() -> str | None:
    """The NVIDIA kernel module's version, or None without one."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        return smi.splitlines()[0].strip() if smi and smi.strip() else None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return m.group(1) if m else text.split()[0]


def gpu_count() -> int:
    devices = [d for d in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", d)]
    if devices:
        return len(devices)
    smi = _run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"])
    return len([line for line in (smi or "").splitlines() if line.strip()])


def libcuda() -> dict[str, Any]:
    """The libcuda.so.1 this environment loads: {"found", "path", "init", "driver_cuda", "stub"}."""
    out = _run([sys.executable, "-c", _LIBCUDA_PROBE])
    facts: dict[str, Any]
    try:
        facts = json.loads(out.strip().splitlines()[-1]) if out else {"found": False, "error": "probe failed"}
    except (ValueError, IndexError):
        facts = {"found": False, "error": "probe printed no facts"}
    if facts.get("found"):
        in_stubs = "/stubs/" in str(facts.get("path") or "")
        facts["stub"] = facts.get("init") == CUDA_ERROR_STUB_LIBRARY or in_stubs
    else:
        facts["stub"] = False
    # A stub in a library-path folder is a trap even where a real driver is found first today.
    found: list[str] = [p for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d
                        for p in glob.glob(os.path.join(d, "libcuda.so*"))
                        if "/stubs" in os.path.realpath(p) or "/stubs" in d]
    facts["stubs_on_path"] = sorted(found)
    return facts


def torch_cuda() -> str | None:
    """The CUDA version the installed torch was built for, read from torch/version.py (no import)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^cuda(?:\s*:\s*[^=]+)?\s*=\s*['\"]([\d.]+)['\"]", text, re.M)
    return m.group(1) if m else None


def nccl_version() -> str | None:
    """NCCL's version from the library torch loads (its nvidia-nccl wheel), else the library path."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += glob.glob(os.path.join(root, "nccl", "lib", "libnccl.so*"))
    candidates.append(ctypes.util.find_library("nccl") or "libnccl.so.2")
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(v)) == 0:
            code = v.value  # e.g. 22809 = 2.28.9 (major * 10000 + minor * 100 + patch since 2.9)
            return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 10000 else str(code)
    return None


def shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def facts() -> dict[str, Any]:
    """Everything the checks need, as JSON-able values (what `hvdtrain launch` collects per host)."""
    drv = libcuda()
    return {"hostname": socket.gethostname(), "kernel_driver": kernel_driver(), "gpus": gpu_count(),
            "libcuda": drv, "torch_cuda": torch_cuda(), "nccl": nccl_version(), "shm_bytes": shm_bytes()}


def _cuda_tuple(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def problems(f: dict[str, Any], slots: int | None = None) -> list[str]:
    """One line per problem in `f` (from `facts`), each naming the fix."""
    return _library_problems(f) + _gpu_problems(f, slots)


def _library_problems(f: dict[str, Any]) -> list[str]:
    """A stub libcuda and a small /dev/shm: problems on any host, with or without GPUs."""
    out = []
    drv = f.get("libcuda") or {}
    if drv.get("stub"):
        out.append(f"a stub libcuda.so.1 is what loads ({drv.get('path')}): every CUDA call fails at run time; "
                   "take the CUDA toolkit's stubs folder off LD_LIBRARY_PATH (it is for linking only)")
    for path in drv.get("stubs_on_path", []):
        if path != drv.get("path"):
            out.append(f"LD_LIBRARY_PATH holds a stub libcuda ({path}); remove that folder from it")
    shm = f.get("shm_bytes")
    if shm is not None and shm < SHM_MIN:
        out.append(f"/dev/shm is {shm / 2**20:.0f} MiB; NCCL and Open MPI's shared-memory transport need more: "
                   "run containers with --shm-size=1g (or --ipc=host)")
    return out


def _gpu_problems(f: dict[str, Any], slots: int | None) -> list[str]:
    """GPUs against slots, torch and the driver."""
    gpus, want, drv = int(f.get("gpus") or 0), f.get("torch_cuda"), f.get("libcuda") or {}
    if not gpus:
        return []
    out = []
    if slots and slots > gpus:
        out.append(f"{slots} slots but {gpus} GPU(s): ranks would share a GPU; give this host at most {gpus} slots")
    if not want:
        out.append(f"{gpus} GPU(s) but torch is a CPU build: install a CUDA build (HVDTRAIN_CUDA=cu130 "
                   "./scripts/install.sh)")
    if not drv.get("found"):
        out.append(f"{gpus} GPU device(s) but no libcuda.so.1 loads; containers need the NVIDIA runtime "
                   "(docker run --gpus all, apptainer exec --nv)")
    elif not drv.get("stub") and drv.get("init") not in (0, None):
        out.append(f"the CUDA driver does not start (cuInit error {drv.get('init')}); check nvidia-smi")
    elif want and drv.get("driver_cuda") and _cuda_of(drv["driver_cuda"]) < _cuda_tuple(want):
        have = _cuda_of(drv["driver_cuda"])
        out.append(f"the driver supports CUDA {have[0]}.{have[1]}, torch needs {want}: update the NVIDIA driver "
                   "(or install a torch built for an older CUDA)")
    return out


def _cuda_of(code: int) -> tuple[int, int]:
    """cuDriverGetVersion's 13000 -> (13, 0)."""
    return code // 1000, code % 1000 // 10


def describe(f: dict[str, Any]) -> list[str]:
    """One line per fact, for people."""
    drv = f.get("libcuda") or {}
    cuda = drv.get("driver_cuda")
    shm = f.get("shm_bytes")
    supports = " (supports CUDA {}.{})".format(*_cuda_of(cuda)) if cuda and not drv.get("stub") else ""
    return [f"driver: {f.get('kernel_driver') or 'none'}{supports}",
            f"libcuda.so.1: {drv.get('path') or 'not found'}" + (" (a stub)" if drv.get("stub") else ""),
            f"GPUs: {f.get('gpus', 0)}",
            f"torch built for CUDA: {f.get('torch_cuda') or 'no (CPU build)'}",
            f"NCCL: {f.get('nccl') or 'not found'}",
            f"/dev/shm: {shm / 2**20:.0f} MiB" if shm is not None else "/dev/shm: missing"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=int, help="ranks this host will run (checked against its GPUs)")
    p.add_argument("--json", action="store_true", help="print the facts and problems as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Exit 0 when nothing is wrong, 1 when something is (each problem one line naming the host)."""
    f = facts()
    found = problems(f, args.slots)
    host = f["hostname"]
    if args.json:
        print(json.dumps({**f, "problems": found}), flush=True)
    else:
        for line in describe(f):
            print(f"{host}: {line}", flush=True)
        for line in found:
            print(f"hvdtrain: doctor: host {host}: {line}", file=sys.stderr, flush=True)
    return 1 if found else 0
