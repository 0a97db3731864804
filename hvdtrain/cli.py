"""`hvdtrain` command line: train built-in tasks and print the resolved config.

Launch under horovodrun for several ranks (`horovodrun -np 2 hvdtrain train --task digits`); without
a launcher it runs as a world of size 1. Every input error is one line on stderr and exit code 2,
raised before Horovod starts so no rank is left waiting for another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hvdtrain import config as config_mod
from hvdtrain import launch
from hvdtrain.config import TASKS, Config
from hvdtrain.errors import HvdtrainError

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvdtrain", description="Data-parallel PyTorch training on Horovod.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("train", "train a built-in task"), ("print-config", "print the resolved config as YAML")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--task", help=f"built-in task: {', '.join(TASKS)}")
        s.add_argument("--config", help="YAML or TOML config file")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one value, e.g. --set train.epochs=5 (repeatable)")
        s.add_argument("--out", help="run folder: sets log.dir and checkpoint.dir to OUT and OUT/checkpoints")
        s.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                       help="continue from the latest checkpoint (or from PATH); 'auto' resumes only if one exists")
    launch.add_arguments(sub.add_parser("launch", help="run horovodrun across hosts (Slurm, hostfile) after preflight"))
    return p


def resolve(args: argparse.Namespace) -> Config:
    """Build the validated config from defaults, file, flags and overrides (flags before --set)."""
    flags = []
    if args.out:
        flags += [f"log.dir={args.out}", f"checkpoint.dir={Path(args.out) / 'checkpoints'}"]
    if args.resume:
        flags.append(f"checkpoint.resume={args.resume}")
    return config_mod.build(args.config, flags + list(args.overrides), task=args.task)


def train(cfg: Config) -> int:
    from hvdtrain.tasks import build_task, check_inputs

    check_inputs(cfg)
    from hvdtrain.trainer import fit
    from hvdtrain.world import World

    world = World.init()
    task = build_task(cfg)
    result = fit(world, task.model, None, task.train_set, cfg, eval_set=task.eval_set, loss_fn=task.loss_fn)
    shown = " ".join(f"{k} {v:.4f}" for k, v in result.eval.items())
    world.print(f"done: step {result.step}, eval {shown}")
    if result.checkpoint:
        world.print(f"checkpoint: {result.checkpoint}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "launch":
            return launch.main(args)
        cfg = resolve(args)
        if args.command == "print-config":
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        return train(cfg)
    except HvdtrainError as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
