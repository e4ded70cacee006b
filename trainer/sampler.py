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


def rank_chunk(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank r's contiguous share of a global batch; sizes differ by at most one, may be empty."""
    n = len(indices)
    start = (n * rank) // world
    stop = (n * (rank + 1)) // world
    return indices[start:stop]


@dataclass(frozen=True)
class EpochPlan:
    """The global batches of one training epoch."""

    n: int
    global_batch: int
    seed: int
    epoch: int
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise ValueError("an empty dataset has no batches")

    def __len__(self) -> int:
        full, tail = divmod(self.n, self.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def order(self) -> np.ndarray:
        return epoch_order(self.n, self.seed, self.epoch, self.shuffle)

    def global_batches(self, start: int = 0):
        """Yield (step_in_epoch, global indices) from `start` on."""
        order = self.order()
        for step in range(start, len(self)):
            yield step, order[step * self.global_batch : (step + 1) * self.global_batch]

    def rank_batches(self, rank: int, world: int, start: int = 0):
        """Yield (step_in_epoch, this rank's indices, global batch size) from `start` on."""
        for step, batch in self.global_batches(start):
            yield step, rank_chunk(batch, rank, world), len(batch)


def eval_batches(n: int, batch: int, rank: int, world: int):
    """Yield this rank's indices for evaluation: over all ranks, each sample exactly once."""
    for start in range(0, n, batch):
        yield rank_chunk(np.arange(start, min(start + batch, n)), rank, world)
