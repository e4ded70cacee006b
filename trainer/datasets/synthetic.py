"""Synthetic classification data of any shape: for benchmarks and tests, no files needed.

Each class has a random uint8 prototype; a sample is the mean of its class's prototype and
uniform noise, so a model can learn it (losses fall, as with real data) while generation stays
a few uint8 ops: 60,000 CIFAR-shaped samples take about a second on one core. The data comes
from data.split_seed, so changing the run seed changes the model and the order, not the data.
"""

from __future__ import annotations

import torch

from trainer.config import DataConfig
from trainer.data import ArrayDataset, DataSpec


def synthetic(cfg: DataConfig, seed: int) -> DataSpec:
    """data.synthetic.{shape, num_classes, size, test_size}: uint8 samples, normalised per batch."""
    sc = cfg.synthetic
    shape = tuple(sc.shape)
    g = torch.Generator().manual_seed(cfg.split_seed)
    # Halves of uint8 values sum to at most 254: the mean stays in uint8, no wider copy.
    halves = torch.randint(0, 256, (sc.num_classes, *shape), generator=g, dtype=torch.uint8) >> 1

    def draw(n: int) -> ArrayDataset:
        y = torch.randint(0, sc.num_classes, (n,), generator=g)
        noise = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
        x = halves[y].add_(noise >> 1)
        # Uniform pixels average 0.5 with std 0.29; the mean of two has std 0.2.
        stats = {"mean": (0.5,), "std": (0.2,)} if cfg.normalize else {}
        return ArrayDataset(x, y, **stats)

    return DataSpec(
        train=draw(sc.size),
        test=draw(sc.test_size),
        task="classification",
        in_shape=shape,
        num_classes=sc.num_classes,
    )
