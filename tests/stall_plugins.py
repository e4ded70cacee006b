"""Test plug-ins that stall or slow one rank: a data split whose take() hangs (in Python, or in
C while holding the GIL) after some batches, and a model or data that is slow on one rank."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time

from trainer.datasets.tabular import digits


class Stalling:
    """A split that hangs on rank `rank` from its `after`-th take() on."""

    def __init__(self, inner, after: int, rank: int, how: str):
        self.inner, self.after, self.rank, self.how = inner, after, rank, how
        self.calls = 0

    def __len__(self):
        return len(self.inner)

    def take(self, idx):
        self.calls += 1
        if self.calls > self.after and int(os.environ.get("RANK", "0")) == self.rank:
            if self.how == "c":  # libc's sleep through PyDLL: the GIL stays held, no Python runs
                ctypes.PyDLL(None).sleep(600)
            time.sleep(600)
        if self.how == "slow" and int(os.environ.get("RANK", "0")) == self.rank:
            time.sleep(0.03)
        return self.inner.take(idx)


def hanging(cfg, seed, after: int = 30, rank: int = 1, how: str = "python"):
    """sklearn's digits whose train split hangs rank `rank` after `after` batches."""
    spec = digits(cfg, seed)
    return dataclasses.replace(spec, train=Stalling(spec.train, after, rank, how))


def hanging_in_c(cfg, seed):
    return hanging(cfg, seed, how="c")


def slow_data(cfg, seed):
    """digits whose train batches take 30 ms more on rank 0."""
    return hanging(cfg, seed, after=10**9, rank=0, how="slow")


def slow_forward(in_shape, num_classes, hidden=(32,), rank: int = 1, delay: float = 0.03):
    """The MLP with a 30 ms sleep in each training forward on rank `rank`."""
    from trainer.models import mlp

    model = mlp(in_shape, num_classes, hidden=hidden)
    slow = int(os.environ.get("RANK", "0")) == rank
    model.register_forward_pre_hook(
        lambda *_: time.sleep(delay) if slow and model.training else None
    )
    return model
