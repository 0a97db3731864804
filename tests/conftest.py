import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def world():
    """The one World of this test process (size 1 unless the suite runs under horovodrun)."""
    from hvdtrain.world import World

    return World.init(threads=1 if "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ else None)


@pytest.fixture(scope="session")
def digits_baseline(world):
    """Eval accuracy of the plain (fp32, uncompressed) digits run, shared by the tests that compare
    a variant against it."""
    from helpers import train_digits

    return train_digits(world).eval["accuracy"]
