"""Steps per second with the data loaded in the training process against loader workers, on a
dataset whose samples cost CPU to produce (each is decoded from bytes and augmented, as an image
pipeline would), beside a model step. One JSON line per setting; the settings alternate over
`--rounds` so drift hits them alike.

    python benchmarks/loader_workers.py [--workers 0,1,2] [--decode-ms 0.5] [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import hvdtrain
from hvdtrain import Config, LogConfig, TrainConfig


class Decoded(Dataset):
    """Samples made on request: `decode_ms` of CPU work each (a stand-in for JPEG decode and
    augmentation), then a 3x32x32 tensor and a label."""

    def __init__(self, n: int, decode_ms: float) -> None:
        self.n, self.decode_s = n, decode_ms / 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        end = time.perf_counter() + self.decode_s
        g = torch.Generator().manual_seed(i)
        x = torch.rand(3, 32, 32, generator=g)
        while time.perf_counter() < end:
            x = x.flip(-1)  # busy, like a decoder
        return x, i % 10


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(256, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--decode-ms", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    world = hvdtrain.World.init()
    data = Decoded(args.batch * args.steps * world.size, args.decode_ms)
    counts = [int(w) for w in args.workers.split(",")]
    base = Config(train=TrainConfig(epochs=1, batch_size=args.batch), log=LogConfig(progress=False, tensorboard=False))
    per: dict[int, list[float]] = {w: [] for w in counts}
    for r in range(args.rounds):
        for w in counts if r % 2 == 0 else counts[::-1]:
            cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, num_workers=w))
            m = model()
            started = time.perf_counter()
            result = hvdtrain.fit(world, m, torch.optim.SGD(m.parameters(), lr=0.01), data, cfg)
            per[w].append(result.step / (time.perf_counter() - started))
    for w, rates in per.items():
        world.print(json.dumps({"bench": "loader_workers", "num_workers": w, "ranks": world.size,
                                "decode_ms": args.decode_ms, "batch": args.batch,
                                "steps_per_s": round(statistics.median(rates), 2),
                                "spread": [round(min(rates), 2), round(max(rates), 2)], "rounds": args.rounds}))


if __name__ == "__main__":
    main()
