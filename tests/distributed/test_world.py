"""World's collectives as a rank sees them, at any world size."""

import time

import torch


def test_a_rank_waiting_for_a_late_peer_sleeps(world):
    # Upstream Horovod's synchronize polls the handle and yields in a loop, so the waiting thread
    # burns a core for as long as a peer is late; hvdtrain's build (scripts/horovod-wait-handle.patch)
    # sleeps until the collective's callback marks the handle done. HOROVOD_WAIT_YIELD=1 brings the
    # loop back, and this fails: the thread's CPU time is then about the wall time.
    late = world.size - 1
    world.barrier()
    if world.rank == late:
        time.sleep(1.0)
    handle = world.allreduce_async(torch.ones(4), name="test.late_peer")
    wall, cpu = time.perf_counter(), time.thread_time()
    total = world.wait(handle)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    torch.testing.assert_close(total, torch.full((4,), float(world.size)))
    if world.rank != late:
        assert wall > 0.5, wall  # it did wait for the late rank
        assert cpu < 0.2 * wall, f"the waiting thread used {cpu:.3f} s of CPU in {wall:.3f} s"
