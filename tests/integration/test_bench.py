"""`hvdtrain bench` under horovodrun: one well-formed JSON line per result, printed by rank 0 only."""

from launch import BIN, horovodrun, run

from hvdtrain.bench.launching import records

CLI = str(BIN / "hvdtrain")


def test_bench_allreduce_reports_each_size_and_mode():
    res = horovodrun([CLI, "bench", "allreduce", "--sizes", "4K,256K", "--iters", "3"], controller="gloo")
    recs = records(res.stdout)
    assert [(r["bytes"], r["mode"]) for r in recs] == [
        (b, m) for b in (4096, 262144) for m in ("fp32", "fp16", "bf16", "hvd-fp16")]
    for r in recs:
        assert r["np"] == 2 and r["repeats"] == 3 and r["time_min_s"] <= r["time_s"] <= r["time_max_s"]
        assert r["wire_bytes"] == r["bytes"] // (1 if r["mode"] == "fp32" else 2)
        # nccl-tests' definition: busbw = algbw * 2(n-1)/n, which is algbw itself at n = 2.
        assert abs(r["busbw_gbit_s"] - r["algbw_gbit_s"]) < 1e-12
        assert abs(r["algbw_gbit_s"] - r["wire_bytes"] * 8 / r["time_s"] / 1e9) < 1e-9
    assert all(r["speedup_vs_fp32"] == 1.0 for r in recs if r["mode"] == "fp32")


def test_bench_compression_compares_codecs_on_the_same_steps():
    res = horovodrun([CLI, "bench", "compression", "--task", "digits", "--steps", "3"], controller="mpi")
    recs = records(res.stdout)
    steps = [r for r in recs if r["bench"] == "compression"]
    assert [r["mode"] for r in steps] == ["compute-only", "none", "fp16", "bf16"]
    assert all(r["params"] == steps[0]["params"] > 0 and r["repeats"] == 3 for r in steps)
    bound = [r for r in recs if r["bench"] == "compression-bound"]
    assert len(bound) == 1 and bound[0]["bound_speedup"] > 0
    assert abs(bound[0]["measured_speedup"] - steps[1]["step_s"] / steps[2]["step_s"]) < 1e-9


def test_bench_rejects_unknown_mode():
    res = run([CLI, "bench", "allreduce", "--modes", "fp8"], check=False)
    assert res.returncode == 2
    assert res.stdout.strip().splitlines()[-1] == (
        "hvdtrain: error: --modes 'fp8' is not allowed; choose from fp32, fp16, bf16, hvd-fp16, fp32-direct")


def test_bench_idle_measures_each_way_on_every_rank():
    # Launched without a launcher, like bench train: Horovod as built and its upstream behaviour (the
    # same build, switched back by environment) on one controller, and DDP, one round each.
    res = run([CLI, "bench", "idle", "--controllers", "gloo,gloo-upstream", "--rounds", "1",
               "--seconds", "0.5", "--iters", "20"], timeout=240)
    recs = records(res.stdout)
    runs = [r for r in recs if r["bench"] == "idle-run"]
    assert [r["way"] for r in runs] == ["gloo", "gloo-upstream", "ddp"]
    for r in runs:
        assert sorted(x["rank"] for x in r["ranks"]) == [0, 1]
        # The wall time of the idle sleep is at least what was asked, and no rank used more CPU in
        # it than its threads could (its compute thread plus Horovod's or Gloo's own).
        assert all(x["idle_wall_s"] >= 0.5 and 0 <= x["idle_cpu_s"] < 4 * x["idle_wall_s"] for x in r["ranks"])
        assert all(x["back_to_back_ms"] > 0 and x["after_pause_ms"] > 0 for x in r["ranks"])
        # The last rank is the late one; the other waited for it.
        assert [x["late_peer_core_share"] is None for x in sorted(r["ranks"], key=lambda x: x["rank"])] == [False, True]
    summary = {r["way"]: r for r in recs if r["bench"] == "idle"}
    assert set(summary) == {r["way"] for r in runs} and all(s["launches"] == 1 for s in summary.values())
    # Upstream, the waiting rank's synchronize yields in a loop: about a core while it waits.
    assert summary["gloo-upstream"]["late_peer_core_share"] > 0.5
    assert summary["gloo"]["late_peer_core_share"] < 0.2
    bad = run([CLI, "bench", "idle", "--controllers", "gloo-fast"], check=False)
    assert bad.returncode == 2 and bad.stdout.strip().splitlines()[-1].startswith(
        "hvdtrain: error: --controllers 'gloo-fast' is not allowed; choose from gloo, mpi, gloo-cycling, ")
