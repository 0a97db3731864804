"""`hvdtrain report RUN_DIR`: PNG plots and a one-page summary (summary.md, summary.html) of a run.

Reads RUN_DIR/metrics.jsonl (written by rank 0, see hvdtrain.metrics) and plots whichever fields
the run logged: loss and accuracy (train and eval), throughput, learning rate and the wait for the
gradient collectives per step (every run), batch size and gradient noise scale (adaptive runs),
memory (memory.profile). A plot whose fields the run did not log is skipped and listed as such.
The config comes from RUN_DIR/config.yaml or config.json if present, else from
the run's `start` event (the trainer logs the resolved config there).
"""

from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path
from typing import Any

from hvdtrain.errors import ConfigError

# (file stem, title, y label, the (record kind, field) pairs it plots, scale) in page order. Record
# kinds: train and eval (every run), adaptive (adaptive batch sizing), memory (memory.profile).
PLOTS: list[tuple[str, str, str, Any, float]] = [
    ("loss", "Loss", "loss", lambda kind, k: kind in ("train", "eval") and (k == "loss" or k.endswith("_loss")), 1),
    ("accuracy", "Accuracy", "fraction", lambda kind, k: kind in ("train", "eval") and "accuracy" in k, 1),
    ("throughput", "Throughput", "samples/s", lambda kind, k: kind == "train" and k == "samples_per_s", 1),
    ("lr", "Learning rate", "lr", lambda kind, k: kind == "train" and k == "lr", 1),
    ("batch_size", "Batch size", "samples", lambda kind, k: kind == "adaptive" and k in ("B", "m"), 1),
    ("gns", "Gradient noise scale", "B_noise (samples)", lambda kind, k: kind == "adaptive" and k == "gns", 1),
    ("memory", "Memory", "MiB", lambda kind, k: kind == "memory" and k in ("params", "grads", "optimizer",
                                                                         "activations", "peak", "rss"), 2**-20),
    ("comm", "Communication wait per step", "ms", lambda kind, k: kind == "train" and k == "comm_wait_ms", 1),
]
_KINDS = ("train", "eval", "adaptive", "memory")
_NOT_SERIES = {"step", "time", "epoch"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder with metrics.jsonl (train --out / log.dir)")
    p.add_argument("--out", help="where to write plots and summary (default: RUN_DIR/report)")


def load(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass the folder given to `hvdtrain train --out` (log.dir)")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{n} is not a JSON line") from None
    if not records:
        raise ConfigError(f"{path} is empty: the run logged nothing yet")
    return records


def run_config(run_dir: Path, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    for name in ("config.yaml", "config.yml", "config.json"):
        if (run_dir / name).is_file():
            import yaml

            return yaml.safe_load((run_dir / name).read_text())  # JSON is YAML too
    starts = [r for r in records if r.get("event") == "start" and isinstance(r.get("config"), dict)]
    return starts[-1]["config"] if starts else None


def series(records: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[list[int], list[float]]]:
    """(kind, field) -> (steps, values) for every finite numeric field of the records of `_KINDS`."""
    out: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for r in records:
        if r.get("kind") not in _KINDS:
            continue
        for key, value in r.items():
            if key in _NOT_SERIES or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):  # a noise scale before its first estimate is NaN
                continue
            steps, values = out.setdefault((r["kind"], key), ([], []))
            steps.append(r["step"])
            values.append(float(value))
    return out


def _plot(path: Path, title: str, ylabel: str, lines: dict[tuple[str, str], tuple[list[int], list[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for (kind, key), (steps, values) in sorted(lines.items()):
        style: dict[str, Any] = {"marker": "o", "linestyle": "--"} if kind == "eval" or len(steps) == 1 else {}
        ax.plot(steps, values, label=f"{kind} {key}", **style)
    ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
    every = [v for _, values in lines.values() for v in values]
    if min(every) > 0 and max(every) > 1000 * min(every):  # memory: KiB of parameters beside GiB of RSS
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plots(out: Path, data: dict[tuple[str, str], tuple[list[int], list[float]]]) -> tuple[list[str], list[str]]:
    """Write one PNG per plot that has data; (written file names, skipped plot titles)."""
    written, skipped = [], []
    for stem, title, ylabel, belongs, scale in PLOTS:
        lines = {k: (steps, [v * scale for v in values]) for k, (steps, values) in data.items() if belongs(*k)}
        if not lines:
            skipped.append(title)
            continue
        _plot(out / f"{stem}.png", title, ylabel, lines)
        written.append(f"{stem}.png")
    return written, skipped


def _facts(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    start = next((r for r in records if r.get("event") == "start"), {})
    end = [r for r in records if r.get("event") == "end"]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    facts = [("ranks", start.get("world_size")), ("global batch", start.get("global_batch")),
             ("planned steps", start.get("steps")), ("last step", records[-1].get("step")),
             ("wall time (s)", round(records[-1]["time"] - records[0]["time"], 1) if "time" in records[0] else None),
             ("skipped steps", end[-1].get("skipped") if end else None)]
    if train:
        facts += [(f"final train {k}", f"{v:.4g}") for k, v in train[-1].items() if k in ("loss", "accuracy")]
    if evals:
        facts += [(f"final eval {k}", f"{v:.4g}") for k, v in evals[-1].items()
                  if k not in _NOT_SERIES | {"kind"} and isinstance(v, float)]
    return [(k, str(v)) for k, v in facts if v is not None]


def summary(out: Path, run_dir: Path, records: list[dict[str, Any]], config: dict[str, Any] | None,
            written: list[str], skipped: list[str]) -> None:
    import yaml

    facts = _facts(records)
    cfg_text = yaml.safe_dump(config, sort_keys=False) if config else "(no config found in the run folder)\n"
    task = (config or {}).get("task", "?")
    md = [f"# Run report: {run_dir.resolve().name} (task {task})", "", "| | |", "|---|---|"]
    md += [f"| {k} | {v} |" for k, v in facts] + ["", "## Plots", ""]
    md += [f"![{w}]({w})" for w in written]
    md += ["", "Skipped (the run logged no such field): " + (", ".join(skipped) or "none"), "",
           "## Config", "", "```yaml", cfg_text.rstrip(), "```", ""]
    (out / "summary.md").write_text("\n".join(md))
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    imgs = "".join(f'<img src="{w}" alt="{w}" style="max-width:48%">' for w in written)
    gaps = html.escape(", ".join(skipped) or "none")
    page = (f"<!doctype html><meta charset=utf-8><title>Run report: {html.escape(run_dir.name)}</title>"
            f"<h1>Run report: {html.escape(run_dir.resolve().name)} (task {html.escape(str(task))})</h1>"
            f"<table>{rows}</table><h2>Plots</h2>{imgs}<p>Skipped (not logged): {gaps}"
            f"</p><h2>Config</h2><pre>{html.escape(cfg_text)}</pre>")
    (out / "summary.html").write_text(page)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    records = load(run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = plots(out, series(records))
    summary(out, run_dir, records, run_config(run_dir, records), written, skipped)
    print(f"report: {out / 'summary.md'} ({len(written)} plots; skipped: {', '.join(skipped) or 'none'})")
    return 0
