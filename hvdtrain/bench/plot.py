"""Charts and a markdown summary for `hvdtrain bench train --plot DIR`."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _way(r: dict[str, Any]) -> str:
    return "ddp" if r["mode"] == "ddp" else f"{r['mode']}/{r['controller']}"


def step_chart(path: Path, results: list[dict[str, Any]]) -> None:
    """Median step time per way, one panel per task, bars grouped by np, min-max whiskers."""
    plt = _pyplot()
    tasks = sorted({r["task"] for r in results})
    ways = sorted({_way(r) for r in results})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.8 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        nps = sorted({r["np"] for r in results if r["task"] == task})
        width = 0.8 / len(ways)
        for i, way in enumerate(ways):
            rows = {r["np"]: r for r in results if r["task"] == task and _way(r) == way}
            xs = [j + i * width for j, n in enumerate(nps) if n in rows]
            med = [rows[n]["step_s"] * 1e3 for n in nps if n in rows]
            err = [[(rows[n]["step_s"] - rows[n]["step_min_s"]) * 1e3 for n in nps if n in rows],
                   [(rows[n]["step_max_s"] - rows[n]["step_s"]) * 1e3 for n in nps if n in rows]]
            ax.bar(xs, med, width, yerr=err, capsize=2, label=way)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(nps))], [f"np={n}" for n in nps])
        ax.set(title=task, ylabel="median step (ms)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scaling_chart(path: Path, scaling: list[dict[str, Any]]) -> None:
    """Samples/s vs np per way (solid) with the ring model's prediction (dashed)."""
    plt = _pyplot()
    tasks = sorted({r["task"] for r in scaling})
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4.8 * max(1, len(tasks)), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for way in sorted({_way(r) for r in scaling if r["task"] == task}):
            rows = sorted((r for r in scaling if r["task"] == task and _way(r) == way), key=lambda r: r["np"])
            line = ax.plot([r["np"] for r in rows], [r["samples_per_s"] for r in rows], marker="o", label=way)
            if all("ring_samples_per_s" in r for r in rows):
                ax.plot([r["np"] for r in rows], [r["ring_samples_per_s"] for r in rows], linestyle="--",
                        color=line[0].get_color(), alpha=0.6)
        ax.set(title=f"{task} (dashed: ring model)", xlabel="ranks", ylabel="samples/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v: Any, digits: int = 3) -> str:
    return "" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(results: list[dict[str, Any]], scaling: list[dict[str, Any]], args: dict[str, Any]) -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    lines = ["# hvdtrain bench train", "",
             f"{os.cpu_count()} CPU cores, {platform.python_version()}, load average at the end "
             f"{', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}; one thread per rank; "
             f"{args['steps']} timed steps after {args['warmup']} warm-up, {args['repeats']} launches per way; "
             f"overrides {args['overrides'] or 'none'}, environment {args['env'] or 'defaults'}.", "",
             "![step times](step_times.png)", "", "![scaling](scaling.png)", "",
             "| task | np | way | params | median step ms | min-max ms | samples/s | CPU ms per rank-step "
             "| vs horovod (paired) | vs ddp (paired) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        vs = [f"{_fmt(r.get(f'vs_{k}'))} ({_fmt(r.get(f'vs_{k}_paired'))})" if f"vs_{k}" in r else ""
              for k in ("horovod", "ddp")]
        lines.append(f"| {r['task']} | {r['np']} | {_way(r)} | {r['params']} | {r['step_s'] * 1e3:.2f} | "
                     f"{r['step_min_s'] * 1e3:.2f}-{r['step_max_s'] * 1e3:.2f} | {r['samples_per_s']:.1f} | "
                     f"{r['cpu_per_rank_step_s'] * 1e3:.2f} | {vs[0]} | {vs[1]} |")
    lines += ["", "| task | way | np | samples/s | efficiency | ring-model samples/s | ring-model efficiency |",
              "|---|---|---|---|---|---|---|"]
    for r in scaling:
        lines.append(f"| {r['task']} | {_way(r)} | {r['np']} | {r['samples_per_s']:.1f} | {r['efficiency']:.2f} | "
                     f"{_fmt(r.get('ring_samples_per_s'), 1)} | {_fmt(r.get('ring_efficiency'), 2)} |")
    return "\n".join(lines) + "\n"


def write(out: Path, results: list[dict[str, Any]], scaling: list[dict[str, Any]], args: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    step_chart(out / "step_times.png", results)
    scaling_chart(out / "scaling.png", scaling)
    (out / "summary.md").write_text(markdown(results, scaling, args))
    with open(out / "results.jsonl", "w") as f:
        for r in results + scaling:
            f.write(json.dumps(r) + "\n")
