import pytest
import torch

from hvdtrain.data import ShardedBatchSampler, eval_loader
from hvdtrain.errors import DataError
from hvdtrain.world import World


def fake_world(rank, size):
    # Sampling needs only rank and size; no collective is issued.
    return World(rank, size, rank, size, torch.device("cpu"))


def steps(sampler):
    return list(iter(sampler))


def epoch_steps(seed, epoch, rank=1, size=2, m=4):
    """Every micro-batch a fresh sampler deals `rank` in `epoch`."""
    sampler = ShardedBatchSampler(64, fake_world(rank, size), m, seed=seed)
    sampler.set_epoch(epoch)
    return steps(sampler)


@pytest.mark.parametrize("size, m, k", [(1, 4, 1), (2, 4, 2), (3, 5, 1), (4, 2, 3)])
def test_ranks_together_draw_one_contiguous_global_batch(size, m, k):
    n_samples = 103
    samplers = [ShardedBatchSampler(n_samples, fake_world(r, size), m, k, seed=7) for r in range(size)]
    single = ShardedBatchSampler(n_samples, fake_world(0, 1), m * size, k, seed=7)
    per_rank = [steps(s) for s in samplers]
    reference = steps(single)
    assert all(len(b) == len(reference) for b in per_rank)
    for j, ref in enumerate(reference):
        union = sorted(i for r in range(size) for i in per_rank[r][j])
        assert union == sorted(ref)
    assert len(reference) // k == n_samples // (size * m * k)


def test_epochs_reshuffle_and_are_permutations():
    s = ShardedBatchSampler(64, fake_world(0, 1), 8, seed=1)
    e0 = [i for b in steps(s) for i in b]
    s.set_epoch(1)
    e1 = [i for b in steps(s) for i in b]
    assert sorted(e0) == sorted(e1) == list(range(64)) and e0 != e1


def test_resume_mid_epoch_continues_sequence():
    expected = epoch_steps(seed=3, epoch=2)
    part = ShardedBatchSampler(64, fake_world(1, 2), 4, seed=3)
    part.set_epoch(2)
    part.advance(3 * 8)
    state = part.state_dict()
    again = ShardedBatchSampler(64, fake_world(1, 2), 4, seed=0)
    again.load_state_dict(state)
    assert steps(again) == expected[3:] and len(again) == len(expected) - 3


def test_step_indices_follow_a_new_seed_and_epoch_after_drawing():
    # The permutation is kept between steps: a loaded seed or a new epoch must replace it.
    s = ShardedBatchSampler(64, fake_world(0, 2), 4, seed=0)
    s.set_epoch(2)
    assert s.step_indices() == [epoch_steps(seed=0, epoch=2, rank=0)[0]]
    s.load_state_dict({"epoch": 2, "consumed": 8, "seed": 3})  # the same epoch, another seed
    assert s.step_indices() == [epoch_steps(seed=3, epoch=2, rank=0)[1]]
    s.set_epoch(3)  # the same seed, another epoch
    assert s.step_indices() == [epoch_steps(seed=3, epoch=3, rank=0)[0]]


def test_resume_with_other_global_batch_is_refused():
    s = ShardedBatchSampler(64, fake_world(0, 1), 6)
    with pytest.raises(DataError, match="not a multiple of the current global batch 6"):
        s.load_state_dict({"epoch": 0, "consumed": 8, "seed": 0})


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one global batch of 64"):
        ShardedBatchSampler(50, fake_world(0, 2), 32)


def test_eval_shards_cover_everything_once_unpadded():
    ds = torch.utils.data.TensorDataset(torch.arange(11))
    seen = [int(x) for r in range(3) for (batch,) in eval_loader(ds, fake_world(r, 3), 2) for x in batch]
    assert sorted(seen) == list(range(11))


@pytest.mark.parametrize("new_size", [1, 2, 3, 5, 7])
def test_resize_keeps_the_global_batch_and_each_steps_samples(new_size):
    # 3 ranks x 4 x 2 = 24 per step; after 2 steps the world changes size mid-epoch.
    first = ShardedBatchSampler(100, fake_world(0, 3), 4, 2, seed=5, keep_global_batch=True)
    reference = steps(ShardedBatchSampler(100, fake_world(0, 1), 24, 1, seed=5))
    first.advance(2 * 24)
    state = first.state_dict()
    per_rank = []
    for r in range(new_size):
        s = ShardedBatchSampler(100, fake_world(r, new_size), 4, 1, seed=5, keep_global_batch=True)
        s.load_state_dict(state)
        assert s.global_batch == 24 and len(s) == (4 - 2) * s.accumulation
        per_rank.append(steps(s))
    k = len(per_rank[0]) // 2  # micro-batches per step, the same on every rank
    shares = [sum(map(len, micro[:k])) for micro in per_rank]
    assert max(shares) - min(shares) <= 1  # 24 over 5 or 7 ranks: shares differ by one at most
    assert all(len(micro) == 2 * k for micro in per_rank)
    assert all(0 < len(m) <= 4 for micro in per_rank for m in micro)  # at most train.batch_size
    for t in range(2):  # steps 2 and 3: the same samples the single process draws
        union = sorted(i for micro in per_rank for m in micro[t * k:(t + 1) * k] for i in m)
        assert union == sorted(reference[2 + t])


def test_more_ranks_than_the_global_batch_is_a_clear_error():
    s = ShardedBatchSampler(64, fake_world(0, 2), 2, keep_global_batch=True)
    with pytest.raises(DataError, match="5 ranks cannot share a global batch of 4 samples"):
        s.resize(fake_world(0, 5))
