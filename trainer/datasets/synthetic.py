"""Synthetic classification data of any shape: for benchmarks and tests, no files needed.

Each class has a random uint8 prototype; a sample is the mean of its class's prototype and
uniform noise, so a model can learn it (losses fall, as with real data) while generation stays
a few uint8 ops: 60,000 CIFAR-shaped samples take about a second on one core. The data comes
from data.split_seed, so changing the run seed changes the model and the order, not the data.
"""

from __future__ import annotations

import math
import os

import torch

from trainer.config import DataConfig, SyntheticConfig
from trainer.data import ArrayDataset, DataSpec
from trainer.errors import UsageError


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable; all physical memory where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_bytes(sc: SyntheticConfig) -> int:
    """Memory `synthetic` holds at its peak in one process: a split's noise, its halving and the
    samples while it is drawn (3 copies), the train split while the test split is drawn, and
    the class prototypes."""
    n, m = sc.size, sc.test_size
    return math.prod(sc.shape) * (max(3 * n, n + 3 * m) + sc.num_classes)


def _check_fits_in_memory(sc: SyntheticConfig) -> None:
    """Refuse a shape x size that cannot be generated, before allocating any of it: every rank
    on this node generates its own copy."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    need, have = peak_bytes(sc) * ranks, available_memory()
    if need > have:
        per = f" x {ranks} ranks on this node" if ranks > 1 else ""
        raise UsageError(
            f"data.synthetic: {sc.size} + {sc.test_size} samples of shape {list(sc.shape)} need "
            f"about {need / 2**30:.1f} GiB of memory to generate{per}, more than the "
            f"{have / 2**30:.1f} GiB available: lower data.synthetic.size, test_size or shape"
        )


def synthetic(cfg: DataConfig, seed: int) -> DataSpec:
    """data.synthetic.{shape, num_classes, size, test_size}: uint8 samples, normalised per batch."""
    sc = cfg.synthetic
    shape = tuple(sc.shape)
    _check_fits_in_memory(sc)
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
