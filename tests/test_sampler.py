"""Global-batch sampling: world size decides who computes a sample, never which samples are used."""

import numpy as np
import pytest

from trainer.sampler import EpochPlan, epoch_order, eval_batches, rank_chunk


@pytest.mark.parametrize("n, batch", [(1438, 64), (103, 8), (9, 4), (17, 16)])
def test_same_global_batches_for_world_1_2_4(n, batch):
    plan = EpochPlan(n=n, global_batch=batch, seed=7, epoch=3)
    reference = [b for _, b in plan.global_batches()]
    for world in (1, 2, 4):
        per_rank = [list(plan.rank_batches(r, world)) for r in range(world)]
        assert all(len(p) == len(plan) for p in per_rank)  # every rank takes every step: no hang
        for step, ref in enumerate(reference):
            joined = np.concatenate([per_rank[r][step][1] for r in range(world)])
            np.testing.assert_array_equal(joined, ref)
            assert all(per_rank[r][step][2] == len(ref) for r in range(world))


def test_an_epoch_is_a_permutation_fixed_by_seed_and_epoch():
    plan = EpochPlan(n=100, global_batch=16, seed=1, epoch=0)
    seen = np.concatenate([b for _, b in plan.global_batches()])
    assert sorted(seen.tolist()) == list(range(100))
    np.testing.assert_array_equal(epoch_order(100, 1, 0), epoch_order(100, 1, 0))
    assert not np.array_equal(epoch_order(100, 1, 0), epoch_order(100, 1, 1))
    assert not np.array_equal(epoch_order(100, 1, 0), epoch_order(100, 2, 0))
    np.testing.assert_array_equal(epoch_order(5, 1, 0, shuffle=False), np.arange(5))


def test_tail_smaller_than_world_gives_empty_slices_not_a_crash():
    plan = EpochPlan(n=9, global_batch=4, seed=0, epoch=0)
    assert len(plan) == 3
    last = [list(plan.rank_batches(r, 4))[-1] for r in range(4)]
    sizes = [len(idx) for _, idx, _ in last]
    assert sum(sizes) == 1 and sizes.count(0) == 3
    assert all(count == 1 for _, _, count in last)


def test_drop_last_and_resume_from_a_step():
    assert len(EpochPlan(n=9, global_batch=4, seed=0, epoch=0, drop_last=True)) == 2
    plan = EpochPlan(n=50, global_batch=8, seed=3, epoch=2)
    full = list(plan.rank_batches(1, 2))
    resumed = list(plan.rank_batches(1, 2, start=4))
    assert [s for s, _, _ in resumed] == list(range(4, len(plan)))
    for (s1, a, _), (s2, b, _) in zip(full[4:], resumed, strict=True):
        assert s1 == s2
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "n, batch, world", [(359, 512, 2), (359, 64, 4), (3, 8, 4), (10, 3, 3), (1, 1, 2)]
)
def test_eval_counts_every_sample_exactly_once(n, batch, world):
    per_rank = [list(eval_batches(n, batch, r, world)) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # same number of batches on every rank
    seen = np.concatenate([idx for p in per_rank for idx in p])
    assert sorted(seen.tolist()) == list(range(n))


def test_rank_chunks_are_balanced():
    idx = np.arange(10)
    sizes = [len(rank_chunk(idx, r, 4)) for r in range(4)]
    assert sum(sizes) == 10 and max(sizes) - min(sizes) <= 1
