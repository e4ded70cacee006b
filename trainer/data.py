"""What a dataset is (DataSpec), and the per-rank batch streams the loop consumes.

A dataset factory takes (DataConfig, seed) and returns a DataSpec; the built-in factories live in
trainer/datasets/. `build` adds how batches are delivered (device, augmentation, workers).

Two ways a batch reaches the model, both giving identical tensors:
- host: a DataLoader whose batch sampler is this rank's slices of the global batches (so the
  global-batch semantics are the sampler's), optional worker processes that gather/decode and
  augment, pinned memory, then one copy per batch to the device;
- device-resident (data.device_resident): the whole in-memory dataset lives on the device and
  batches are sliced, gathered and augmented there; only the epoch's permutation is copied, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from trainer import registry, sampler
from trainer.config import DataConfig
from trainer.datasets.augment import crop_flip
from trainer.errors import UsageError


def pixels_to_float(
    x: torch.Tensor, mean: torch.Tensor | None, std: torch.Tensor | None
) -> torch.Tensor:
    """uint8 pixels -> float in [0, 1], then (x - mean) / std per channel; float x passes through."""
    if x.dtype == torch.uint8:
        x = x.float().div_(255.0)
    if mean is not None:
        shape = (1, -1, *([1] * (x.dim() - 2)))  # (1, C, 1, 1): broadcast over the channel dim
        x = (x - mean.to(x.device).view(shape)) / std.to(x.device).view(shape)
    return x


def _stats(values: Sequence[float] | None) -> torch.Tensor | None:
    return None if values is None else torch.tensor(list(values), dtype=torch.float32)


def _moved(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _float_converter(data: Split, device: str):
    """pixels_to_float for one pass over `data`, its statistics copied to the device once."""
    mean, std = _moved(data.mean, device), _moved(data.std, device)
    return lambda x: pixels_to_float(x, mean, std)


class Split(Protocol):
    """What the batch streams need of a split: ArrayDataset, or a lazy FolderDataset."""

    lazy: bool
    """Decodes files per sample (cannot live on the device)."""
    mean: torch.Tensor | None
    std: torch.Tensor | None

    def __len__(self) -> int: ...

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored inputs (uint8 pixels, floats or tokens) and targets of samples `idx`."""
        ...

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples lo..hi-1 (views where the storage allows)."""
        ...


class ArrayDataset(torch.utils.data.Dataset):
    """In-memory (inputs, targets), indexed a whole batch at a time.

    Float inputs are used as they are. uint8 inputs are pixels, kept compact (a quarter of
    float32) and converted per batch, on the device, by `pixels_to_float`; `mean`/`std` (per
    channel, or one value for all) then standardise them.
    """

    lazy = False
    """Lazy datasets decode files per sample; in-memory ones can live on the device."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ):
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and targets ({len(y)}) differ in length")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.x, self.y = x, y
        self.mean, self.std = _stats(mean), _stats(std)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def take(self, idx: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored (not yet float) inputs and the targets of samples `idx`."""
        if isinstance(idx, np.ndarray):
            idx = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        return self.x[idx], self.y[idx]

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[lo:hi], self.y[lo:hi]  # views: nothing is copied

    def to(self, device: str | torch.device) -> ArrayDataset:
        """A copy on `device` (the same object when already there)."""
        if self.x.device == torch.device(device):
            return self
        moved = ArrayDataset(self.x.to(device), self.y.to(device))
        moved.mean, moved.std = _moved(self.mean, device), _moved(self.std, device)
        return moved


@dataclass(frozen=True)
class LoaderOptions:
    """How batches are delivered: set by `build` from data.* and the run's device."""

    device: str = "cpu"
    """Where train_batches/eval_batches put their tensors."""
    augment: bool = False
    crop_padding: int = 4
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    device_resident: bool = False


TASKS = ("classification", "regression", "lm")


@dataclass(frozen=True)
class DataSpec:
    """What the rest of the job needs to know about a dataset."""

    train: Split
    """An ArrayDataset, or a lazy split such as trainer.datasets.folder.FolderDataset."""
    test: Split
    task: str
    """classification | regression | lm (next-token prediction: targets are token sequences)"""
    in_shape: tuple[int, ...]
    """One sample's input shape, e.g. (1, 8, 8)."""
    num_classes: int
    """Classes (classification) or target width (regression)."""
    target_scale: float = 1.0
    """Regression: the std the targets were divided by; eval reports MSE and MAE in the
    target's own units (times this, squared for MSE)."""
    source: dict = field(default_factory=dict)
    """Where the data came from (e.g. a corpus and its sha256), recorded in run.json."""
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    _loaders: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """DataLoaders kept across epochs, so persistent workers persist."""

    @property
    def tokens_per_sample(self) -> int:
        """Loss terms per sample: the sequence length for lm, else 1."""
        return self.in_shape[0] if self.task == "lm" else 1

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if len(self.train) == 0 or len(self.test) == 0:
            raise UsageError("the dataset has an empty train or test split: check data.* settings")


def build(cfg: DataConfig, seed: int, device: str = "cpu") -> DataSpec:
    """The dataset `data.name`, delivering batches to `device` as data.* asks."""
    spec = registry.factory("data.name", cfg.name)(cfg, seed)
    if not isinstance(spec, DataSpec):
        raise UsageError(
            f"data.name: factory '{cfg.name}' returned {type(spec).__name__}, not trainer.data.DataSpec"
        )
    if cfg.augment and len(spec.in_shape) != 3:
        raise UsageError(
            f"data.augment=true crops and flips images, but {cfg.name} samples have shape "
            f"{tuple(spec.in_shape)}: set data.augment=false"
        )
    train, test = spec.train, spec.test
    if cfg.device_resident:
        if train.lazy or test.lazy:
            raise UsageError(
                f"data.device_resident=true needs an in-memory dataset, but {cfg.name} decodes "
                "files per sample: set data.device_resident=false (and data.num_workers to decode "
                "in parallel)"
            )
        train, test = train.to(device), test.to(device)  # once, for the whole run
    options = LoaderOptions(
        device=device,
        augment=cfg.augment,
        crop_padding=cfg.crop_padding,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and torch.device(device).type == "cuda",
        persistent_workers=cfg.persistent_workers,
        device_resident=cfg.device_resident,
    )
    return dataclasses.replace(spec, train=train, test=test, loader=options)


def train_batches(
    spec: DataSpec, plan: sampler.EpochPlan, rank: int, world_size: int, start: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """Yield (step_in_epoch, x, y, global_batch_size) for this rank, from step `start` on.

    x is float, normalised and (with data.augment) augmented, on spec.loader.device. A rank whose
    share of a tail batch is empty still gets a step: x of shape (0, *in_shape).
    """
    opts = spec.loader
    pad = opts.crop_padding if opts.augment else None
    to_float = _float_converter(spec.train, opts.device)
    if opts.device_resident:
        order = torch.from_numpy(plan.order()).to(opts.device)  # one copy per epoch
        for step, lo, hi, count in plan.rank_spans(rank, world_size, start):
            idx = order[lo:hi]
            x, y = spec.train.take(idx)
            if pad is not None:
                x = crop_flip(x, idx, plan.seed, plan.epoch, pad)
            yield step, to_float(x), y, count
        return
    steps = list(plan.rank_batches(rank, world_size, start))
    keys = [(plan.seed, plan.epoch, idx) for _, idx, _ in steps]
    for (step, _, count), (x, y) in zip(
        steps, _fetched(spec, "train", rank, world_size, keys), strict=True
    ):
        x, y = _to_device(x, y, opts)
        yield step, to_float(x), y, count


def eval_batches(
    spec: DataSpec, batch: int, rank: int, world_size: int, *, whole: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) for this rank over the test split; over all ranks, each sample exactly once
    (whole=True: whole batches per rank, see sampler.eval_spans)."""
    opts = spec.loader
    to_float = _float_converter(spec.test, opts.device)
    n = len(spec.test)
    if opts.device_resident:
        for lo, hi in sampler.eval_spans(n, batch, rank, world_size, whole):
            x, y = spec.test.span(lo, hi)
            yield to_float(x), y
        return
    keys = [(0, None, idx) for idx in sampler.eval_batches(n, batch, rank, world_size, whole)]
    for x, y in _fetched(spec, "test", rank, world_size, keys):
        x, y = _to_device(x, y, opts)
        yield to_float(x), y


def _fetched(spec: DataSpec, split: str, rank: int, world_size: int, keys: list):
    """The host batches for `keys`, fetched in this process or by a DataLoader.

    Without workers or pinning a DataLoader adds only overhead (about 80 us a batch here), so
    the batches are fetched directly; both ways run the same _BatchReader, so the tensors are equal.
    """
    opts = spec.loader
    if opts.num_workers == 0 and not opts.pin_memory:
        reader = _BatchReader(spec.train if split == "train" else spec.test, _pad(opts, split))
        yield from (reader.__getitems__(k) for k in keys)
        return
    loader = _loader(spec, split, rank, world_size)
    loader.batch_sampler.keys = keys
    try:
        yield from loader
    except UsageError as e:
        # DataLoader folds a worker's traceback into the message; the user needs our last line.
        last = str(e).strip().splitlines()[-1]
        raise UsageError(last.split("UsageError: ", 1)[-1]) from None


def _pad(opts: LoaderOptions, split: str) -> int | None:
    return opts.crop_padding if opts.augment and split == "train" else None


def _to_device(x: torch.Tensor, y: torch.Tensor, opts: LoaderOptions):
    # Pinned host memory lets the copy overlap with compute; uint8 pixels cross as uint8.
    return (
        x.to(opts.device, non_blocking=opts.pin_memory),
        y.to(opts.device, non_blocking=opts.pin_memory),
    )


class _PassKeys:
    """The DataLoader's batch sampler: this pass's (seed, epoch, indices), set before each pass.

    The keys are read in the main process when a pass starts, so one DataLoader (and its
    persistent workers) serves every epoch.
    """

    def __init__(self) -> None:
        self.keys: list = []

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class _BatchReader(torch.utils.data.Dataset):
    """Runs in the loader (a worker or the main process): gather or decode, then augment."""

    def __init__(self, data: Split, pad: int | None):
        self.data, self.pad = data, pad

    def __len__(self) -> int:
        return len(self.data)

    def __getitems__(self, key):
        seed, epoch, idx = key
        x, y = self.data.take(idx)
        if self.pad is not None and epoch is not None:
            x = crop_flip(
                x, torch.from_numpy(np.asarray(idx, dtype=np.int64)), seed, epoch, self.pad
            )
        return x, y


def _whole_batch(batch):
    return batch  # _BatchReader already returns the batch as tensors


def _loader(spec: DataSpec, split: str, rank: int, world_size: int) -> torch.utils.data.DataLoader:
    key = (split, rank, world_size)
    if key not in spec._loaders:
        opts = spec.loader
        data = spec.train if split == "train" else spec.test
        spec._loaders[key] = torch.utils.data.DataLoader(
            _BatchReader(data, _pad(opts, split)),
            batch_sampler=_PassKeys(),
            collate_fn=_whole_batch,
            num_workers=opts.num_workers,
            pin_memory=opts.pin_memory,
            persistent_workers=opts.persistent_workers,
        )
    return spec._loaders[key]
