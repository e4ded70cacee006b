"""Test plug-ins for the Task contract: dict batches, a loss whose term count varies per batch
(masked targets), and a model that returns its own loss (the Hugging Face convention)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from trainer import DataSpec, Task


class Fields:
    """A split of named tensors: take(idx) -> {name: rows}."""

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def take(self, idx):
        idx = torch.as_tensor(idx, dtype=torch.long)
        return {k: v[idx] for k, v in self.tensors.items()}


def masked(cfg, seed, n: int = 40, test: int = 13):
    """x (4 features) -> y (3 targets), each target present or not (mask): 0 to 3 loss terms
    per sample. Global batch 8 of 40 samples: 5 steps an epoch."""
    g = torch.Generator().manual_seed(77)
    x = torch.randn(n + test, 4, generator=g)
    y = x @ torch.randn(4, 3, generator=g) + 0.1 * torch.randn(n + test, 3, generator=g)
    mask = torch.rand(n + test, 3, generator=g) < 0.5
    split = lambda lo, hi: Fields(x=x[lo:hi], y=y[lo:hi], mask=mask[lo:hi])  # noqa: E731
    return DataSpec(train=split(0, n), test=split(n, n + test), task="tests.plugins:MaskedMSE")


def linear(in_features: int = 4, out_features: int = 3):
    return nn.Linear(in_features, out_features)


class MaskedMSE(Task):
    """Squared error over the targets the mask keeps: a term per kept target, counted per batch."""

    name = "masked_mse"
    terms_per_sample = None

    def forward(self, model, batch):
        return model(batch["x"])

    def loss(self, pred, batch):
        return ((pred - batch["y"]) ** 2 * batch["mask"]).sum()

    def count(self, batch):
        return int(batch["mask"].sum())

    def metrics(self, pred, batch):
        return {"loss": (self.loss(pred, batch), self.count(batch))}


def hf_tiny(cfg, seed):
    """tests.helpers:tiny as dict batches {"input": x, "labels": y}."""
    from tests.helpers import tiny

    spec = tiny(cfg, seed)
    split = lambda s: Fields(input=s.x, labels=s.y)  # noqa: E731
    return DataSpec(
        train=split(spec.train),
        test=split(spec.test),
        task="model_loss",
        in_shape=spec.in_shape,
        num_classes=spec.num_classes,
    )


class HFStyle(nn.Module):
    """A classifier that computes its own loss from `labels`, as Hugging Face models do: the MEAN
    cross-entropy over the labels that are not -100."""

    def __init__(self, in_features: int = 16, classes: int = 3, as_dict: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, 8), nn.ReLU())
        self.head = nn.Linear(8, classes)
        self.as_dict = as_dict

    def forward(self, input, labels=None):
        logits = self.head(self.net(input))
        loss = None if labels is None else F.cross_entropy(logits, labels, ignore_index=-100)
        return (
            {"loss": loss, "logits": logits}
            if self.as_dict
            else SimpleNamespace(loss=loss, logits=logits)
        )


def hf_style(in_shape, num_classes, as_dict: bool = False):
    width = 1
    for d in in_shape:
        width *= d
    return HFStyle(width, num_classes, as_dict)


class SummedCrossEntropy(Task):
    """The exact form of what HFStyle computes: a SUM over the labels that are not -100 and
    their count."""

    terms_per_sample = None

    def forward(self, model, batch):
        out = model(batch["input"])
        return out["logits"] if isinstance(out, dict) else out.logits

    def loss(self, logits, batch):
        return F.cross_entropy(logits, batch["labels"], ignore_index=-100, reduction="sum")

    def count(self, batch):
        return int((batch["labels"] != -100).sum())
