"""`hvdtrain doctor`'s verdicts on a host's facts (pure functions, one process)."""

from hvdtrain.tools.doctor import SHM_MIN, problems

REAL = {"found": True, "path": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "init": 0, "driver_cuda": 13000,
        "stub": False, "stubs_on_path": []}


def host(**kw):
    return {"hostname": "n1", "kernel_driver": "580.95", "gpus": 8, "libcuda": REAL, "torch_cuda": "13.0",
            "nccl": "2.28.9", "shm_bytes": 8 * 2**30, **kw}


def test_a_healthy_gpu_host_has_no_problems():
    assert problems(host(), slots=8) == []
    assert problems(host(gpus=0, libcuda={"found": False, "stub": False, "stubs_on_path": []}, torch_cuda=None)) == []


def test_more_slots_than_gpus_is_refused():
    (line,) = problems(host(gpus=2), slots=4)
    assert line.startswith("4 slots but 2 GPU(s)") and "at most 2 slots" in line


def test_a_driver_older_than_torchs_cuda_names_both_versions():
    (line,) = problems(host(libcuda={**REAL, "driver_cuda": 12040}), slots=8)
    assert "the driver supports CUDA 12.4, torch needs 13.0" in line


def test_a_stub_libcuda_and_a_small_dev_shm_are_problems_even_without_gpus():
    stub = {"found": True, "path": "/usr/local/cuda/lib64/stubs/libcuda.so.1", "init": 34, "driver_cuda": 13000,
            "stub": True, "stubs_on_path": ["/usr/local/cuda/lib64/stubs/libcuda.so.1"]}
    lines = problems(host(gpus=0, torch_cuda=None, libcuda=stub, shm_bytes=64 * 2**20))
    assert len(lines) == 2
    assert "a stub libcuda.so.1 is what loads (/usr/local/cuda/lib64/stubs/libcuda.so.1)" in lines[0]
    assert "/dev/shm is 64 MiB" in lines[1] and "--shm-size=1g" in lines[1]
    assert problems(host(shm_bytes=SHM_MIN)) == []


def test_gpus_with_a_cpu_torch_or_no_driver_library():
    assert "torch is a CPU build" in problems(host(torch_cuda=None), slots=8)[0]
    (line,) = problems(host(libcuda={"found": False, "stub": False, "stubs_on_path": []}), slots=8)
    assert "no libcuda.so.1 loads" in line and "--gpus all" in line
