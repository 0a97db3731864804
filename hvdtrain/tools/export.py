"""`hvdtrain export --checkpoint PATH --out FILE`: a checkpoint's trained weights as a plain PyTorch
file, for use without hvdtrain: `torch.load(FILE, weights_only=True)` gives {"state_dict": the
model's state_dict, "config": the run's resolved config, "step": N, "task": name}. No optimizer,
sampler or per-rank state: a resume needs the checkpoint itself. One process; no Horovod.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from hvdtrain.errors import CheckpointError, ConfigError

DTYPES = ("fp32", "bf16", "fp16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint folder (RUN/checkpoints/step_N), or a run's checkpoints folder for its latest")
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write (replaced whole if it exists)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32",
                   help="floating-point weights in this type (default fp32, as trained); integer buffers stay")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name, e.g. {out / 'model.pt'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    import torch

    from hvdtrain.tasks import build_task
    from hvdtrain.tools.evaluate import load_weights, read, resolve

    state, raw = read(args.checkpoint, [])
    from hvdtrain import config as config_mod

    cfg = config_mod.from_dict(config_mod.Config, raw)
    # Loaded into the task's model first: what is exported is known to load there.
    model = build_task(cfg).model
    load_weights(model, state["model"], args.checkpoint, cfg.task)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    payload = {"state_dict": weights, "config": raw, "step": state.get("step"), "task": cfg.task}
    # Written beside the target and renamed over it: a full disk or a kill leaves no half file.
    fd, temp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, out)
    except OSError as exc:
        Path(temp).unlink(missing_ok=True)
        raise CheckpointError(f"could not write {out} ({exc.strerror or exc}); nothing was written") from None
    size = out.stat().st_size
    print(f"exported {resolve(args.checkpoint)} (step {state.get('step')}, {cfg.task}, {len(weights)} tensors, "
          f"{args.dtype}) to {out}, {size / 2**20:.2f} MiB")
    return 0
