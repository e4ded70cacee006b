"""data.name=examples.finetune.data:digits_classes: sklearn's digits, only the classes named in
data.kwargs.classes (relabelled 0..n-1), on the built-in split (data.split_seed); with
data.kwargs.per_class=N only the first N training images of each class (few labels)."""

from __future__ import annotations

import torch

from trainer.data import ArrayDataset, DataSpec
from trainer.datasets.tabular import digits


def digits_classes(cfg, seed: int) -> DataSpec:
    full = digits(cfg, seed)
    classes = [int(c) for c in cfg.kwargs.get("classes", range(10))]
    lookup = torch.full((10,), -1, dtype=torch.int64)
    lookup[classes] = torch.arange(len(classes))

    per_class = cfg.kwargs.get("per_class")

    def keep(ds: ArrayDataset, limit=None) -> ArrayDataset:
        x, y = ds.x, ds.y
        mask = lookup[y] >= 0
        if limit:
            mask &= torch.stack([(y[: i + 1] == y[i]).sum() <= limit for i in range(len(y))])
        return ArrayDataset(x[mask], lookup[y[mask]])

    return DataSpec(
        train=keep(full.train, per_class),
        test=keep(full.test),
        task="classification",
        in_shape=full.in_shape,
        num_classes=len(classes),
    )
