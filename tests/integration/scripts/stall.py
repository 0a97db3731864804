"""Rank 1 hangs in its loss function at the 3rd step; the watchdog must end the job."""
import sys
import time

from helpers import blobs, mlp, small_config  # noqa: E402  (tests/ is on sys.path via PYTHONPATH)

import hvdtrain
from hvdtrain.tasks import classification_loss

timeout = float(sys.argv[1])
world = hvdtrain.World.init()
calls = [0]


def loss_fn(model, batch):
    calls[0] += 1
    if world.rank == 1 and calls[0] == 3:
        time.sleep(3600)
    return classification_loss(model, batch)


cfg = small_config(epochs=5, accumulation=1)
cfg = hvdtrain.Config(**{**cfg.__dict__, "train": hvdtrain.TrainConfig(
    **{**cfg.train.__dict__, "stall_timeout": timeout})})
hvdtrain.fit(world, mlp(), None, blobs(), cfg, loss_fn=loss_fn)
print("finished without stalling", flush=True)
