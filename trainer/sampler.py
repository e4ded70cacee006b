"""Global-batch sampling: the same sequence of global batches for every world size.

The user sets the GLOBAL batch size. Each epoch's order is a permutation drawn from (seed, epoch)
alone; step k's global batch is the k-th slice of it; rank r takes the r-th contiguous chunk of
that batch. World size only decides who computes which samples, never which samples are used.

Unlike torch's DistributedSampler this never pads by repeating samples (evaluation counts every
sample exactly once) and never needs the tail to cover all ranks: a rank whose chunk of the
last batch is empty computes a zero-sample step and still joins the gradient all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's sample order: a permutation from (seed, epoch), independent of any rank."""
    if not shuffle:
        return np.arange(n)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(n)


def chunk_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank r's contiguous share of n items; sizes differ by at most one."""
    return (n * rank) // world_size, (n * (rank + 1)) // world_size


def rank_chunk(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank r's contiguous share of a global batch; sizes differ by at most one, may be empty."""
    start, stop = chunk_bounds(len(indices), rank, world_size)
    return indices[start:stop]


def shard_order(sizes: tuple[int, ...], window: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of sum(sizes) samples that reads shards mostly in sequence: shard k holds
    samples [sum(sizes[:k]), sum(sizes[:k+1])); the shards are visited in a shuffled order,
    `window` at a time, the samples of each window shuffled among themselves. A pure function of
    (seed, epoch), as epoch_order; window 0 (or >= the shards) is epoch_order's full shuffle."""
    n = int(sum(sizes))
    if window <= 0 or window >= len(sizes):
        return epoch_order(n, seed, epoch)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 1])))
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    visit = rng.permutation(len(sizes))
    parts = []
    for w in range(0, len(visit), window):
        members = np.concatenate([np.arange(first[k], first[k + 1]) for k in visit[w : w + window]])
        parts.append(members[rng.permutation(len(members))])
    return np.concatenate(parts)


@dataclass(frozen=True)
class EpochPlan:
    """The global batches of one training epoch."""

    n: int
    global_batch: int
    seed: int
    epoch: int
    shuffle: bool = True
    drop_last: bool = False
    groups: tuple[int, ...] | None = None
    """Samples per shard (a split's shard_sizes): the order then reads `window` shards at a
    time (shard_order) instead of the whole dataset at once."""
    window: int = 0

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError("an empty dataset has no batches")

    def __len__(self) -> int:
        full, tail = divmod(self.n, self.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def order(self) -> np.ndarray:
        if self.groups is not None and self.shuffle:
            return shard_order(self.groups, self.window, self.seed, self.epoch)
        return epoch_order(self.n, self.seed, self.epoch, self.shuffle)

    def global_batches(self, start: int = 0):
        """Yield (step_in_epoch, global indices) from `start` on."""
        order = self.order()
        for step in range(start, len(self)):
            yield step, order[step * self.global_batch : (step + 1) * self.global_batch]

    def rank_spans(self, rank: int, world_size: int, start: int = 0):
        """Yield (step_in_epoch, lo, hi, global batch size): this rank's samples are order()[lo:hi].

        A global batch is a contiguous run of the epoch order and a rank's share a contiguous run
        of that, so a device-resident order can be sliced without any per-step index copy.
        """
        for step in range(start, len(self)):
            first = step * self.global_batch
            count = min(self.global_batch, self.n - first)
            lo, hi = chunk_bounds(count, rank, world_size)
            yield step, first + lo, first + hi, count

    def rank_batches(self, rank: int, world_size: int, start: int = 0):
        """Yield (step_in_epoch, this rank's indices, global batch size) from `start` on."""
        order = self.order()
        for step, lo, hi, count in self.rank_spans(rank, world_size, start):
            yield step, order[lo:hi], count


def eval_spans(n: int, batch: int, rank: int, world_size: int, whole: bool = False):
    """Yield [lo, hi) of this rank's evaluation samples: over all ranks, each exactly once.

    Each batch is split over the ranks, or (whole=True) each rank takes a contiguous block of
    whole batches, so a batch has the same samples and shape on any world size.
    """
    if whole:
        first, stop = chunk_bounds(-(-n // batch), rank, world_size)
        for b in range(first, stop):
            yield b * batch, min((b + 1) * batch, n)
        return
    for start in range(0, n, batch):
        lo, hi = chunk_bounds(min(batch, n - start), rank, world_size)
        yield start + lo, start + hi


def eval_batches(n: int, batch: int, rank: int, world_size: int, whole: bool = False):
    """Yield this rank's indices for evaluation: over all ranks, each sample exactly once."""
    for lo, hi in eval_spans(n, batch, rank, world_size, whole):
        yield np.arange(lo, hi)
