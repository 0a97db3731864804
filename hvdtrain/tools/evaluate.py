"""`hvdtrain eval --checkpoint PATH`: held-out metrics of a built-in task's checkpoint, at any
world size (under horovodrun the eval set is sharded across ranks and the metrics averaged by
sample count, as during training; the figures do not depend on the number of ranks).

The task, data and model settings come from the checkpoint's own config; `--set` changes what may
differ at evaluation time (e.g. data.path, or train.batch_size for the eval batch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hvdtrain.errors import CheckpointError

# Settings a checkpoint's weights depend on: an override of these would evaluate another model.
_FIXED = ("task", "model.", "seed", "data.val_fraction", "data.synthetic_samples", "data.image_size",
          "data.num_classes", "data.mnist1d_samples", "data.max_bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a checkpoint folder (RUN/checkpoints/step_N), or a run's checkpoints folder for its latest")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change a setting of the checkpoint's config that does not shape the model, e.g. data.path")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text")


def resolve(path: str) -> Path:
    """A checkpoint folder, or the one a checkpoints folder's `latest` names."""
    p = Path(path)
    latest = p / "latest"
    if p.is_dir() and latest.is_file():
        return p / latest.read_text().strip()
    return p


def check_overrides(overrides: list[str]) -> None:
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in _FIXED):
            raise CheckpointError(f"--set {key}: the checkpoint's weights were trained with its own {key}; "
                                  "only settings that do not shape the model or its data split can change")


def read(path: str, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the checkpoint's state, its config as a dict with `overrides` applied and checked)."""
    from hvdtrain import config as config_mod
    from hvdtrain.checkpoint import load_checkpoint

    if not resolve(path).exists():
        raise CheckpointError(f"checkpoint {path} does not exist; give a step_N folder or a run's checkpoints folder")
    state = load_checkpoint(resolve(path))
    raw = state.get("config")
    if not isinstance(raw, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"checkpoint {path} holds no config or no model weights; it was not written by "
                              "hvdtrain train")
    for assignment in overrides:
        config_mod.apply_override(raw, assignment)
    raw.setdefault("checkpoint", {})["resume"] = ""  # evaluating resumes nothing
    config_mod.from_dict(config_mod.Config, raw)  # refused here, by name, before anything is built
    return state, raw


def load_weights(model: Any, weights: dict[str, Any], path: str, task: str) -> None:
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"checkpoint {path} does not hold the weights of the built-in task {task!r}'s "
                              f"model ({first}); a library run's checkpoint loads with torch.load") from None


def run(args: argparse.Namespace) -> int:
    check_overrides(list(args.overrides))
    from hvdtrain import config as config_mod
    from hvdtrain.common import num_samples
    from hvdtrain.data import loader_options
    from hvdtrain.loop import evaluate
    from hvdtrain.tasks import build_task, check_inputs
    from hvdtrain.world import World

    world = World.init()
    # Rank 0 reads the checkpoint (other hosts need not see it) and tells every rank the verdict.
    found: tuple[str, Any] = ("ok", None)
    state: dict[str, Any] = {}
    if world.is_root:
        try:
            state, raw = read(args.checkpoint, list(args.overrides))
            found = ("ok", (raw, state.get("step")))
        except CheckpointError as exc:
            found = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - config errors too: rank 0 alone must not raise
            found = ("error", str(exc))
    status, payload = world.broadcast_object(found, name="hvdtrain.eval.checkpoint")
    if status == "error":
        raise CheckpointError(payload)
    raw, step = payload
    cfg = config_mod.from_dict(config_mod.Config, raw)
    check_inputs(cfg)
    task = build_task(cfg)
    error = ""
    if world.is_root:
        try:
            load_weights(task.model, state["model"], args.checkpoint, cfg.task)
        except CheckpointError as exc:
            error = str(exc)
    error = world.broadcast_object(error, name="hvdtrain.eval.weights")
    if error:
        raise CheckpointError(error)
    task.model.to(world.device)
    world.broadcast_parameters(task.model.state_dict())
    metrics = evaluate(world, task.model, task.eval_set, task.loss_fn, cfg.train.batch_size,
                       {**loader_options(cfg.data, world.device), "persistent_workers": False})
    where, samples = str(resolve(args.checkpoint)), num_samples(task.eval_set)
    if args.json:
        world.print(json.dumps({"checkpoint": where, "step": step, "task": cfg.task, "samples": samples,
                                "ranks": world.size, **metrics}))
    else:
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        world.print(f"eval: {where} (step {step}), {cfg.task}, {samples} held-out samples on {world.size} "
                    f"rank(s): {shown}")
    return 0
