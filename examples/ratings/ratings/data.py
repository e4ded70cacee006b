"""The data plug-in: a factory (DataConfig, seed) -> trainer.DataSpec, reading the CSV files.

A split is any object with __len__ and take(indices) -> a batch. Here a batch is a dict of
tensors, one row per index: {"user": int64, "item": int64, "rating": float32}. The trainer
slices global batches over the ranks, moves them to the device and hands them to the task.
"""

import os

import numpy as np
import torch

from trainer import DataSpec, UsageError


class Ratings:
    """One split, in memory: (user, item, rating) rows."""

    def __init__(self, table: np.ndarray):
        self.user = torch.from_numpy(table[:, 0].astype(np.int64))
        self.item = torch.from_numpy(table[:, 1].astype(np.int64))
        self.rating = torch.from_numpy(table[:, 2].astype(np.float32))

    def __len__(self) -> int:
        return len(self.rating)

    def take(self, idx) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return {"user": self.user[idx], "item": self.item[idx], "rating": self.rating[idx]}


def read_csv(path: str) -> np.ndarray:
    if not os.path.isfile(path):  # a mistake the user fixes: one line, exit 2 (trainer.UsageError)
        raise UsageError(
            f"ratings: no {path}: write the example's data first with `python -m ratings.prepare "
            f"{os.path.dirname(os.path.dirname(path)) or '.'}` (or set data.root)"
        )
    return np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2)


def load(cfg, seed: int) -> DataSpec:
    """data.name=ratings.data:load: <data.root>/ratings/{train,test}.csv."""
    folder = os.path.join(cfg.root, "ratings")
    train, test = (read_csv(os.path.join(folder, f"{s}.csv")) for s in ("train", "test"))
    both = np.concatenate([train, test])
    return DataSpec(
        train=Ratings(train),
        test=Ratings(test),
        task="ratings.task:RatingTask",  # what task.name=auto trains on this data
        source={
            "ratings": os.path.abspath(folder),
            "users": int(both[:, 0].max()) + 1,
            "items": int(both[:, 1].max()) + 1,
        },
    )
