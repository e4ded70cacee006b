"""A batch: a tensor, or a tuple, list or dict of them (nested), samples along dim 0.

The built-in datasets give `(x, y)` tuples; a plug-in dataset may give a dict such as
`{"user": ..., "item": ..., "rating": ...}`. Everything that moves, cuts or splits a batch (the
device copy, micro-steps, world-invariant shards, a rank's empty slice) goes through these few
functions, so every batch shape gets the same treatment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Batch = Any
"""torch.Tensor | tuple | list | dict of them, nested; every tensor has the samples on dim 0."""


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> Batch:
    """`batch` with fn applied to each tensor (other leaves kept as they are)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def tensors(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensors, in a fixed order (dicts in insertion order)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, (tuple, list)) or isinstance(batch, dict):
        return [t for v in values for t in tensors(v)]
    return []


def size(batch: Batch) -> int:
    """Samples in the batch: the first dimension of its tensors, which must agree."""
    sizes = {len(t) if t.dim() else None for t in tensors(batch)}
    if len(sizes) != 1 or None in sizes:
        found = ", ".join(str(tuple(t.shape)) for t in tensors(batch)) or "no tensors"
        raise ValueError(
            f"a batch's tensors must share their first (sample) dimension; got shapes {found}"
        )
    return sizes.pop()


def to_device(batch: Batch, device: str | torch.device, non_blocking: bool = False) -> Batch:
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def cut(batch: Batch, lo: int, hi: int) -> Batch:
    """Samples lo..hi-1 of every tensor (views). A flat tuple of tensors, the built-in (x, y),
    is sliced directly: map_tensors' walk was 8 Python calls a cut, on every step's batch."""
    if type(batch) is tuple and all([type(t) is torch.Tensor for t in batch]):
        return tuple([t[lo:hi] for t in batch])
    return map_tensors(lambda t: t[lo:hi], batch)


ALIGN = 64
"""Bytes a float tensor a model computes on starts at (the CPU allocator's alignment): the CPU's
matmuls (MKL) take another path for an input at another offset, with other bits (measured: a
Linear's output and weight gradient on 3 rows of 5 or 7 features differed in 38 of 280 offsets),
so views that must give the same bits wherever they sit start on it (data.py, aligned())."""


def aligned(batch: Batch) -> Batch:
    """The batch with each floating-point tensor that does not start on ALIGN bytes copied to one
    that does (the allocator's; views that do are kept). repro.world_invariant's shard and
    micro-batch cuts are views at row offsets that depend on the world size (a shard is at
    offset 0 of one rank's slice and mid-batch in one process): aligned, every cut runs the same
    kernels on any world."""

    def fix(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.data_ptr() % ALIGN:
            return t.clone(memory_format=torch.contiguous_format)
        return t

    if type(batch) is tuple and all([type(t) is torch.Tensor for t in batch]):
        return tuple([fix(t) for t in batch])
    return map_tensors(fix, batch)


def split(batch: Batch, micro: int) -> list[Batch]:
    """Consecutive pieces of at most `micro` samples (one piece for a batch that fits)."""
    if not micro:  # no micro-steps: nothing to count (data.py checks a pass's first batch)
        return [batch]
    n = size(batch)
    if n <= micro:
        return [batch]
    return [cut(batch, lo, min(lo + micro, n)) for lo in range(0, n, micro)]
