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
    full = ShardedBatchSampler(64, fake_world(1, 2), 4, seed=3)
    full.set_epoch(2)
    expected = steps(full)
    part = ShardedBatchSampler(64, fake_world(1, 2), 4, seed=3)
    part.set_epoch(2)
    part.advance(3 * 8)
    state = part.state_dict()
    again = ShardedBatchSampler(64, fake_world(1, 2), 4, seed=0)
    again.load_state_dict(state)
    assert steps(again) == expected[3:] and len(again) == len(expected) - 3


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
