import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test gets the environment it started with back: a variable one test sets (a malloc
    policy, OMP_NUM_THREADS, a launcher's rank) must not change how a later test behaves."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def world():
    """The one World of this test process (size 1 unless the suite runs under horovodrun); Horovod
    is shut down when the session ends, so no background thread outlives the tests."""
    from hvdtrain.world import World

    # HVDTRAIN_TEST_GROUPS=1 (tests/integration/test_pipeline_runs.py): process sets, for pipeline stages.
    w = World.init(threads=1 if "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ else None,
                   groups=os.environ.get("HVDTRAIN_TEST_GROUPS") == "1")
    yield w
    World.shutdown()


@pytest.fixture(scope="session")
def digits_baseline(world):
    """Eval accuracy of the plain (fp32, uncompressed) digits run, shared by the tests that compare
    a variant against it."""
    from helpers import train_digits

    return train_digits(world).eval["accuracy"]
