"""The direct paths, comm.transport=mpi (fp32 buckets straight to MPI_Iallreduce) and gloo (to a
torch.distributed Gloo group), against Horovod's path and plain single-process PyTorch, at any world
size; mpi under Gloo, the refusal."""

import dataclasses

import pytest
import torch
from helpers import blobs, flat_params, mlp, small_config
from test_training import plain_pytorch_reference
from torch import nn

import hvdtrain
from hvdtrain.config import CommConfig
from hvdtrain.errors import ConfigError, EnvironmentProblem


def cfg_with(transport, bucket_mb=25.0, compression="none"):
    cfg = small_config()
    return dataclasses.replace(cfg, comm=CommConfig(transport=transport, bucket_mb=bucket_mb, compression=compression))


@pytest.fixture(params=["mpi", "gloo"])
def transport(request, world):
    """A direct path this world can run: MPI's needs the MPI controller; Gloo's runs under either."""
    if request.param == "mpi" and world.controller != "mpi":
        pytest.skip("the MPI path needs Horovod's MPI controller")
    return request.param


def test_direct_path_matches_horovod_and_single_process(world, transport):
    data = blobs()
    runs = {}
    for way in ("horovod", transport):
        model = mlp(seed=0)
        # Tiny buckets: several collectives a step, launched while backward runs.
        hvdtrain.fit(world, model, None, data, cfg_with(way, bucket_mb=0.0005))
        runs[way] = flat_params(model)
    torch.testing.assert_close(runs[transport], runs["horovod"], rtol=1e-6, atol=1e-7)
    reference = plain_pytorch_reference(world.size, small_config(), data)
    torch.testing.assert_close(runs[transport], flat_params(reference), rtol=1e-5, atol=1e-6)


class Backwards(nn.Module):
    """Uses its layers in the reverse of their registration order, so backward completes the
    buckets (built in reverse registration order) last-first: the reducer must hold them back."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.out, self.mid, self.inp = nn.Linear(32, 3), nn.Linear(32, 32), nn.Linear(12, 32)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def test_direct_path_launches_buckets_in_index_order_whatever_backward_does(world, transport):
    data = blobs()
    runs = {}
    for way in ("horovod", transport):
        model = Backwards()
        hvdtrain.fit(world, model, None, data, cfg_with(way, bucket_mb=0.0001))
        runs[way] = flat_params(model)
    torch.testing.assert_close(runs[transport], runs["horovod"], rtol=1e-6, atol=1e-7)


def test_direct_path_keeps_fp16_compression_on_horovod(world, transport):
    model = mlp(seed=0)
    result = hvdtrain.fit(world, model, None, blobs(), cfg_with(transport, compression="fp16"))
    assert result.step > 0 and torch.isfinite(flat_params(model)).all()


def test_direct_path_is_refused_under_gloo(world):
    if world.controller != "gloo" or world.size == 1:
        pytest.skip("the refusal is Gloo's, with peers")
    with pytest.raises(ConfigError, match="comm.transport=mpi needs Horovod's MPI controller"):
        hvdtrain.fit(world, mlp(seed=0), None, blobs(), cfg_with("mpi"))


def test_gloo_path_that_fails_to_set_up_on_one_rank_fails_on_every_rank(world, monkeypatch):
    # Each setup step is agreed, so the others raise too instead of waiting for that rank's store key.
    if world.size == 1:
        pytest.skip("the direct path runs only with peers")
    bad = world.size - 1
    if world.rank == bad:
        monkeypatch.setenv("HOROVOD_GLOO_IFACE", "nosuchif0")
    with pytest.raises(EnvironmentProblem) as info:
        hvdtrain.fit(world, mlp(seed=0), None, blobs(), cfg_with("gloo"))
    assert str(info.value).startswith(f"comm.transport=gloo could not set up its Gloo group (rank {bad}: "
                                      "HOROVOD_GLOO_IFACE=nosuchif0 has no IPv4 address on "), info.value
    assert str(info.value).endswith("); use comm.transport=horovod")
    world.barrier()  # every rank is past the setup's collectives
