"""`hvdtrain bench adaptive`: its input checks and its summary (one process)."""


import pytest
from helpers import blobs, mlp

from hvdtrain.config import Config
from hvdtrain.errors import ConfigError
from hvdtrain.tasks import classification_loss


def test_bench_rejects_unknown_task_before_starting(capsys):
    from hvdtrain.tools.cli import main

    assert main(["bench", "adaptive", "--tasks", "nope"]) == 2
    assert "--tasks 'nope' is not allowed; choose from pylm, digits" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--lrs", "pylm=fast"]) == 2
    assert "--lrs 'pylm=fast': expected TASK=VALUE,..., e.g. pylm=0.001/0.003" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--targets", "mnist=0.1"]) == 2
    assert "--targets names ['mnist']; choose from pylm, digits" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--batches", "pylm=16/8"]) == 2
    assert "--batches pylm=16/8: expected distinct global batches, smallest first" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--batches", "pylm=8/x"]) == 2
    assert "--batches 'pylm=8/x': expected TASK=VALUE" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--best-lrs", "pylm=8:0.002/32"]) == 2
    assert "--best-lrs 'pylm=8:0.002/32': expected TASK=VALUE" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--best-lrs", "pylm=32:0.003/8:0.002"]) == 2
    assert "--best-lrs pylm=32/8: expected distinct global batches, smallest first" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--best-lrs", "pylm=8:0.002", "--lrs", "pylm=0.1"]) == 2
    assert "--best-lrs pylm=... replaces the grid and the batches" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--set", "optim.nope=1"]) == 2
    assert "unknown key optim.nope; allowed: clip_grad_norm" in capsys.readouterr().err


def test_bench_refuses_a_held_out_set_smaller_than_the_ranks(world, monkeypatch):
    import types

    from hvdtrain import tasks
    from hvdtrain.bench import adaptive as bench_adaptive

    task = types.SimpleNamespace(model=mlp(seed=1), train_set=blobs(n=32), eval_set=blobs(n=0),
                                 loss_fn=classification_loss)
    monkeypatch.setattr(tasks, "build_task", lambda cfg: task)
    with pytest.raises(ConfigError, match=f"digits: 0 held-out samples for {world.size} ranks"):
        bench_adaptive.one_run(world, Config(), "digits", 0, 4, 0.1, None, {"target": 0.1}, 1.0, 256)


def test_bench_summary_pairs_seeds_and_reports_samples_to_target():
    import json
    import types

    from hvdtrain.bench.adaptive import summary

    def run(seed, mode, batch, time_s, evals, lr=0.1, reached=True):
        return {"seed": seed, "mode": mode, "variant": "default" if mode == "adaptive" else "", "start_batch": batch,
                "lr": lr, "reached": reached, "time_s": time_s, "evals": evals, "samples": evals * 64}

    world = types.SimpleNamespace(size=2)
    # B=64 is best by median (3.0 s); per seed adaptive takes 1.5x, 1.0x and 0.5x of it.
    runs = [run(0, "fixed", 8, 9.0, 9), run(0, "fixed", 8, 1.0, 9, lr=0.5), run(0, "fixed", 64, 2.0, 20),
            run(0, "adaptive", 8, 3.0, 15),
            run(1, "fixed", 8, 8.0, 8), run(1, "fixed", 64, 4.0, 40), run(1, "adaptive", 8, 4.0, 12),
            run(2, "fixed", 8, 7.0, 7), run(2, "fixed", 64, 1.0, 10), run(2, "adaptive", 8, 0.5, 11),
            run(3, "fixed", 8, 7.0, 7), run(3, "fixed", 64, 9.0, 90, reached=False), run(3, "adaptive", 8, 1.0, 9)]
    out = summary(world, "digits", {"batches": [4, 32], "target": 0.1}, runs,
                   {4: (9.0, 0.1), 32: (2.0, 0.1)}, ["default"], 20.0)
    assert out["median_time_s"] == {"adaptive_default": 2.0, "fixed_8": 7.5, "fixed_64": 3.0}
    assert out["adaptive_vs_best_fixed_each_seed"] == {"default": [1.5, 1.0, 0.5]}
    assert out["adaptive_vs_start_batch_below"] == {"default": None}
    assert out["adaptive_vs_best_fixed"] == {"default": 2.0 / 3.0}
    # Seed 3's fixed run missed the target: it has no ratio, and the batch no median sample count.
    assert out["adaptive_vs_best_fixed_per_seed"] == {"default": 1.0}
    assert out["median_samples"] == {"adaptive_default": 736, "fixed_8": 480, "fixed_64": None}
    # A start batch that misses the target on most seeds has no median time, so no ratio.
    missed = [dict(r, reached=False) if r["start_batch"] == 8 and r["mode"] == "fixed" else r for r in runs]
    out = summary(world, "digits", {"batches": [4, 32], "target": 0.1}, missed,
                   {4: (9.0, 0.1), 32: (2.0, 0.1)}, ["default"], 20.0)
    assert out["median_time_s"]["fixed_8"] is None and out["adaptive_vs_start_batch"] == {"default": None}
    # It took longer than the 20 s budget, so adaptive's 2.0 s is under 0.1x of it.
    assert out["adaptive_vs_start_batch_below"] == {"default": 0.1}
    # An adaptive run that missed gives no ratio either: JSON would print Infinity.
    lost = [dict(r, reached=False) if r["mode"] == "adaptive" else r for r in runs]
    out = summary(world, "digits", {"batches": [4, 32], "target": 0.1}, lost,
                   {4: (9.0, 0.1), 32: (2.0, 0.1)}, ["default"], 20.0)
    assert out["adaptive_vs_best_fixed"] == {"default": None} and out["adaptive_vs_start_batch"] == {"default": None}
    assert out["adaptive_vs_best_fixed_each_seed"] == {"default": [None, None, None]}
    assert "Infinity" not in json.dumps(out)
