"""The adaptive benchmark's stop rule under horovodrun at any world size (and plainly, as size 1)."""

import time
import types

from helpers import blobs, mlp, small_config

import hvdtrain
from hvdtrain.bench import adaptive as bench_adaptive
from hvdtrain.tasks import classification_loss


def test_budget_stop_is_agreed_when_rank_clocks_disagree(world, monkeypatch):
    # Rank r's clock runs (1 + r) times as fast: on its own clock each rank would spend the budget
    # at a different evaluation, and the first to stop alone would leave the others in an allreduce.
    real = time.perf_counter
    fast = types.SimpleNamespace(perf_counter=lambda: real() * (1 + world.rank))
    monkeypatch.setattr(bench_adaptive, "time", fast)
    watch = bench_adaptive.Watch(world, classification_loss, target=-1.0, budget=0.2)
    cfg = small_config(epochs=10**4, batch_size=4, accumulation=1, eval_every=2)
    try:
        hvdtrain.fit(world, mlp(seed=1), None, blobs(n=64), cfg, eval_set=blobs(n=16, seed=1), loss_fn=watch)
    except bench_adaptive.Stop:
        pass
    assert watch.result and not watch.result["reached"]
    assert watch.result["time_s"] > 0.2
    every = world.allgather_object(watch.result, name="t.bench.watch")
    assert all(r == every[0] for r in every), every  # same evaluation, same loss, same time on all
