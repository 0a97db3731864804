"""The ring model and scaling_records efficiency of `hvdtrain bench train` (pure arithmetic, one process)."""

import math

from hvdtrain.bench.train import ring_step, scaling_records


def test_ring_model_adds_latency_and_bandwidth_terms_of_a_ring_allreduce():
    link = {"alpha_s": 1e-4, "beta_bytes_s": 1e9}
    assert ring_step(0.05, 1, 10**6, link) == 0.05  # one rank: nothing to exchange
    for n in (2, 4, 8):
        expected = 0.05 + 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * 4e6 / 1e9
        assert math.isclose(ring_step(0.05, n, 10**6, link), expected)


def test_scaling_efficiency_is_throughput_over_n_times_one_rank():
    rows = [{"task": "t", "mode": "ddp", "controller": "torch", "np": n, "params": 1000, "global_batch": 32 * n,
             "step_s": s, "samples_per_s": 32 * n / s} for n, s in ((1, 0.1), (2, 0.125))]
    link = {"alpha_s": 0.0, "beta_bytes_s": 4000 * 2 / 2 / 0.025}  # ring time at np=2 is exactly 25 ms
    one, two = scaling_records("t", rows, {"gloo": link})
    assert one["efficiency"] == 1.0 and math.isclose(two["efficiency"], 0.1 / 0.125)
    assert math.isclose(two["ring_efficiency"], 0.1 / 0.125) and math.isclose(two["ring_samples_per_s"], 64 / 0.125)
