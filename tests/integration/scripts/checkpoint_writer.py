"""Writes checkpoints of a ~16 MB state in a loop until killed (one process, world size 1)."""
import sys

import torch

import hvdtrain
from hvdtrain.checkpoint import Checkpointer
from hvdtrain.config import CheckpointConfig

world = hvdtrain.World.init()
ckpt = Checkpointer(CheckpointConfig(dir=sys.argv[1], keep=2), world)
step = 0
while True:
    step += 1
    weights = torch.full((4_000_000,), float(step))
    ckpt.save(step, {"step": step, "model": {"w": weights}}, {"task": "digits"})
    print(f"saved {step}", flush=True)
