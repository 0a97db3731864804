"""`hvdtrain` command line: train built-in tasks and print the resolved config.

Launch under horovodrun for several ranks (`horovodrun -np 2 hvdtrain train --task digits`); without
a launcher it runs as a world of size 1. Every input error is one line on stderr and exit code 2,
raised before Horovod starts so no rank is left waiting for another.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hvdtrain import config as config_mod
from hvdtrain.config import TASKS, Config
from hvdtrain.console import whole_lines
from hvdtrain.errors import ConfigError, HvdtrainError
from hvdtrain.tools import launch

EXIT_USAGE = 2
EXIT_FAILED = 1

# Subcommands that live in their own module: each module has `add_arguments(parser)` and
# `run(args) -> int`, and imports torch/Horovod only inside `run`, so `--help` and input errors stay fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hvdtrain.tools.plan", "per-rank memory and communication time under ZeRO; --measure runs real steps"),
    "report": ("hvdtrain.tools.report", "PNG plots and a summary of a training run's metrics log"),
    "doctor": ("hvdtrain.tools.doctor", "this host's GPU driver, CUDA, NCCL, libcuda and /dev/shm, and their problems"),
    "eval": ("hvdtrain.tools.evaluate", "held-out metrics of a built-in task's checkpoint (any number of ranks)"),
    "export": ("hvdtrain.tools.export", "a checkpoint's weights as a plain PyTorch state_dict file"),
    "build-horovod": ("hvdtrain.tools.build_horovod", "build Horovod for this environment's torch and install it"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "train": ("hvdtrain.bench.train", "the same training run with hvdtrain, hand-written Horovod and DDP"),
    "memory": ("hvdtrain.bench.memory", "step time and memory per precision / activation-checkpointing variant"),
    "adaptive": ("hvdtrain.bench.adaptive", "time to a target held-out loss: adaptive vs fixed batches"),
    "pipeline": ("hvdtrain.bench.pipeline", "pipeline stages vs data parallelism: step time, bubble, memory"),
    "idle": ("hvdtrain.bench.idle", "idle CPU per rank, small-allreduce latency: Horovod's loop asleep, cycling; DDP"),
}


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


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
        s.add_argument("--elastic", action="store_true",
                       help="survive workers leaving and joining (elastic.enabled=true; docs/fault-tolerance.md)")
    launch.add_arguments(sub.add_parser("launch", help="run horovodrun across hosts (Slurm, hostfile) after preflight"))
    _bench_parser(sub)
    for name, (module, text) in COMMANDS.items():
        _module(module).add_arguments(sub.add_parser(name, help=text))
    return p


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks (run under horovodrun); one JSON line per result")
    kinds = b.add_subparsers(dest="bench", required=True)
    a = kinds.add_parser("allreduce", help="allreduce time, algbw and busbw per size and mode")
    a.add_argument("--sizes", default="", help="comma-separated sizes of fp32 data, e.g. 1K,64M (default 1K..256M)")
    a.add_argument("--modes", default="fp32,fp16,bf16,hvd-fp16", help="fp32, fp16 (safe), bf16, hvd-fp16 (Horovod's)")
    a.add_argument("--iters", type=int, default=0, help="timed repeats per size (default: by size, 3..50)")
    c = kinds.add_parser("compression", help="training step time per gradient codec, same weights and data")
    c.add_argument("--task", default="synthetic", help=f"built-in task: {', '.join(TASKS)}")
    c.add_argument("--config", help="YAML or TOML config file")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--steps", type=int, default=20, help="timed steps per mode (after 3 warm-up steps)")
    c.add_argument("--modes", default="none,fp16,bf16", help="codecs to compare")
    for name, (module, text) in BENCHES.items():
        _module(module).add_arguments(kinds.add_parser(name, help=text))


def bench(args: argparse.Namespace) -> int:
    if args.bench in BENCHES:
        return _module(BENCHES[args.bench][0]).run(args)
    from hvdtrain.bench import allreduce as bench_mod
    from hvdtrain.bench.allreduce import MODES, parse_size
    from hvdtrain.comm.compression import CODECS
    from hvdtrain.world import World

    modes = [m for m in args.modes.split(",") if m]
    allowed = MODES if args.bench == "allreduce" else CODECS
    bad = [m for m in modes if m not in allowed]
    if bad:
        raise ConfigError(f"--modes {bad[0]!r} is not allowed; choose from {', '.join(allowed)}")
    if args.bench == "allreduce":
        try:
            sizes = [parse_size(s) for s in args.sizes.split(",") if s] or bench_mod.default_sizes()
        except ValueError:
            raise ConfigError(f"--sizes {args.sizes!r}: use sizes like 1K,64M,256M") from None
        bench_mod.allreduce(World.init(), sizes, modes, iters=args.iters)
        return 0
    cfg = config_mod.build(args.config, list(args.overrides), task=args.task)
    bench_mod.compression(World.init(), cfg, args.steps, modes)
    return 0


def resolve(args: argparse.Namespace) -> Config:
    """Build the validated config from defaults, file, flags and overrides (flags before --set)."""
    flags = []
    if args.out:
        flags += [f"log.dir={args.out}", f"checkpoint.dir={Path(args.out) / 'checkpoints'}"]
    if args.resume:
        flags.append(f"checkpoint.resume={args.resume}")
    if args.elastic:
        flags.append("elastic.enabled=true")
    return config_mod.build(args.config, flags + list(args.overrides), task=args.task)


def train(cfg: Config) -> int:
    from hvdtrain.outputs import check_outputs
    from hvdtrain.tasks import build_task, check_inputs

    check_inputs(cfg)
    check_outputs(cfg)  # before Horovod starts: a bad --out ends the job with one line, nothing made
    from hvdtrain.loop import fit
    from hvdtrain.world import World

    world = World.init(groups=cfg.parallel.pipeline_stages > 1)  # a pipeline's stages are process sets
    task = build_task(cfg)
    result = fit(world, task.model, None, task.train_set, cfg, eval_set=task.eval_set, loss_fn=task.loss_fn)
    if cfg.elastic.enabled:
        world = World.init()  # the last world's ranks: the first world's rank 0 may be gone
    if result.stopped:
        from hvdtrain.stop import EXIT_STOPPED

        world.print(f"stopped: step {result.step}, checkpoint {result.checkpoint} (exit {EXIT_STOPPED}: requeue "
                    "and resume with --resume auto)")
        return EXIT_STOPPED
    if result.mlflow_run_id and cfg.log.dir:
        _report_to_mlflow(Path(cfg.log.dir), result.mlflow_run_id)
    shown = " ".join(f"{k} {v:.4f}" for k, v in result.eval.items())
    world.print(f"done: step {result.step}, eval {shown}")
    if result.checkpoint:
        world.print(f"checkpoint: {result.checkpoint}")
    return 0


def _report_to_mlflow(run_dir: Path, run_id: str) -> None:
    """Rank 0 (the one with a run id): the run's report, as artifacts of its MLflow run."""
    import mlflow

    from hvdtrain.tools import report

    out = run_dir / "report"
    records = report.load(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = report.plots(out, report.series(records))
    report.summary(out, run_dir, records, report.run_config(run_dir, records), written, skipped)
    mlflow.MlflowClient().log_artifacts(run_id, str(out), artifact_path="report")


def main(argv: list[str] | None = None) -> int:
    whole_lines()  # before the first line: a usage error under mpirun too
    args = _parser().parse_args(argv)
    try:
        if args.command == "launch":
            return launch.main(args)
        if args.command == "bench":
            return bench(args)
        if args.command in COMMANDS:
            return _module(COMMANDS[args.command][0]).run(args)
        cfg = resolve(args)
        if args.command == "print-config":
            import yaml

            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        return train(cfg)
    except HvdtrainError as exc:
        print(f"hvdtrain: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception as exc:
        from hvdtrain.world import lost_peer  # loaded already if Horovod ran

        if not lost_peer(exc):
            raise
        from hvdtrain.outputs import launch_rank

        print(f"hvdtrain: rank {launch_rank(os.environ)}: error: another rank exited or lost its connection, so "
              "this rank cannot go on (the launcher's output names the rank that exited first, or the host that "
              "went down); fix its cause and rerun with --resume auto to continue from the last checkpoint",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
