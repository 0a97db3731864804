"""Launcher-dependent defaults World.init sets before hvd.init()."""

from hvdtrain.world import mpi_defaults


def test_open_mpi_ranks_yield_when_idle_unless_the_user_chose():
    env = {"OMPI_COMM_WORLD_RANK": "0"}
    mpi_defaults(env)
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    mine = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_MCA_mpi_yield_when_idle": "0"}
    mpi_defaults(mine)
    assert mine["OMPI_MCA_mpi_yield_when_idle"] == "0"


def test_gloo_and_single_process_runs_are_left_alone():
    for env in ({}, {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}):
        mpi_defaults(env)
        assert "OMPI_MCA_mpi_yield_when_idle" not in env
