"""Datasets (built by registry name) and the per-rank batch streams the loop consumes.

A dataset factory takes (DataConfig, seed) and returns a DataSpec; nothing is downloaded here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from trainer import registry, sampler
from trainer.config import DataConfig
from trainer.errors import UsageError


class ArrayDataset(torch.utils.data.Dataset):
    """An in-memory (inputs, targets) pair, indexed a whole batch at a time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and targets ({len(y)}) differ in length")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def take(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        return self.x[t], self.y[t]


@dataclass(frozen=True)
class DataSpec:
    """What the rest of the job needs to know about a dataset."""

    train: ArrayDataset
    test: ArrayDataset
    task: str
    """classification | regression"""
    in_shape: tuple[int, ...]
    """One sample's input shape, e.g. (1, 8, 8)."""
    num_classes: int
    """Classes (classification) or target width (regression)."""

    def __post_init__(self) -> None:
        if self.task not in ("classification", "regression"):
            raise ValueError(f"task must be classification or regression, got {self.task!r}")
        if len(self.train) == 0 or len(self.test) == 0:
            raise UsageError("the dataset has an empty train or test split: check data.* settings")


def build(cfg: DataConfig, seed: int) -> DataSpec:
    spec = registry.resolve("data.name", cfg.name)(cfg, seed)
    if not isinstance(spec, DataSpec):
        raise UsageError(
            f"data.name: factory '{cfg.name}' returned {type(spec).__name__}, not trainer.data.DataSpec"
        )
    return spec


def _split(
    n: int, labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """A stratified train/test split, fixed by `seed`: each class keeps its share in both."""
    rng = np.random.Generator(np.random.PCG64(seed))
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = round(len(idx) * test_fraction)
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _standardize(x: np.ndarray, train_idx: np.ndarray) -> np.ndarray:
    """Per-feature zero mean, unit variance, with statistics from the train split only."""
    mean = x[train_idx].mean(axis=0)
    std = x[train_idx].std(axis=0)
    return (x - mean) / np.where(std > 0, std, 1.0)


def digits(cfg: DataConfig, seed: int) -> DataSpec:
    """sklearn's handwritten digits: 1,797 real 8x8 grey images, 10 classes, shipped with sklearn."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    y_np = y.astype(np.int64)
    tr, te = _split(len(y_np), y_np, cfg.test_fraction, cfg.split_seed)
    x = _standardize(x, tr).astype(np.float32).reshape(-1, 1, 8, 8)
    x = torch.from_numpy(x)
    y = torch.from_numpy(y_np)
    return DataSpec(
        train=ArrayDataset(x[tr], y[tr]),
        test=ArrayDataset(x[te], y[te]),
        task="classification",
        in_shape=(1, 8, 8),
        num_classes=10,
    )


def train_batches(
    spec: DataSpec, plan: sampler.EpochPlan, rank: int, world: int, start: int = 0
) -> Iterator:
    """Yield (step_in_epoch, x, y, global_batch_size) for this rank, from step `start` on."""
    for step, idx, global_count in plan.rank_batches(rank, world, start):
        x, y = spec.train.take(idx)
        yield step, x, y, global_count


def eval_batches(spec: DataSpec, batch: int, rank: int, world: int) -> Iterator:
    """Yield (x, y) for this rank over the test split; over all ranks, each sample exactly once."""
    for idx in sampler.eval_batches(len(spec.test), batch, rank, world):
        yield spec.test.take(idx)
