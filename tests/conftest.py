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
