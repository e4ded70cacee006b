"""What a dataset is (DataSpec), and the per-rank batch streams the loop consumes.

A dataset factory takes (DataConfig, seed) and returns a DataSpec; the built-in factories live in
trainer/datasets/. `build` adds how batches are delivered (device, augmentation, workers).
A split's `take(idx)` returns a batch: an (inputs, targets) tuple for the built-in datasets, or
any tensor, tuple, list or dict of tensors (trainer/batch.py) that the run's Task understands.

Two ways a batch reaches the model, both giving identical tensors:
- host: a DataLoader whose batch sampler is this rank's slices of the global batches (so the
  global-batch semantics are the sampler's), optional worker processes that gather/decode and
  augment, pinned memory, then one copy per batch to the device;
- device-resident (data.device_resident): the whole in-memory dataset lives on the device and
  batches are sliced, gathered and augmented there; only the epoch's permutation is copied, once.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from trainer import batch as batches
from trainer import registry, sampler
from trainer.config import DataConfig
from trainer.datasets.augment import crop_flip
from trainer.errors import TrainerError, UsageError, first_line


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
    """pixels_to_float on the inputs of (inputs, targets) batches of a split that keeps image
    statistics (ArrayDataset, FolderDataset), its statistics copied to the device once; other
    batches pass unchanged."""
    if not hasattr(data, "mean"):
        return lambda b: b
    mean, std = _moved(data.mean, device), _moved(data.std, device)
    return lambda b: (pixels_to_float(b[0], mean, std), *b[1:]) if isinstance(b, tuple) else b


class Split(Protocol):
    """What the batch streams need of a split: ArrayDataset, a lazy FolderDataset, or yours.

    Only __len__ and take are required; `span` defaults to take(range), `lazy` to False, and
    `to(device)` is needed only for data.device_resident.
    """

    lazy: bool
    """Decodes files per sample (cannot live on the device)."""
    mean: torch.Tensor | None
    std: torch.Tensor | None

    def __len__(self) -> int: ...

    def take(self, idx) -> batches.Batch:
        """The batch of samples `idx` (an int64 numpy array or tensor, possibly empty): for the
        built-ins (stored inputs: uint8 pixels, floats or tokens, targets); for yours, any
        tensor, tuple or dict of tensors with len(idx) rows each."""
        ...

    def span(self, lo: int, hi: int) -> batches.Batch:
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


@dataclass(frozen=True)
class DataSpec:
    """What the rest of the job needs to know about a dataset."""

    train: Split
    """An ArrayDataset, a lazy split such as trainer.datasets.folder.FolderDataset, or any
    object with __len__ and take(idx) (the Split protocol)."""
    test: Split
    task: str | None = None
    """The dataset's own task, which task.name=auto trains: classification | regression | lm
    (next-token prediction: targets are token sequences) | `package.module:obj` | None (the
    config's task.name must say)."""
    in_shape: tuple[int, ...] = ()
    """One sample's input shape, e.g. (1, 8, 8), offered to model factories."""
    num_classes: int = 0
    """Classes (classification), target width (regression) or vocabulary size (lm)."""
    target_scale: float = 1.0
    """Regression: the std the targets were divided by; eval reports MSE and MAE in the
    target's own units (times this, squared for MSE)."""
    source: dict = field(default_factory=dict)
    """Where the data came from (e.g. a corpus and its sha256), recorded in run.json."""
    loader: LoaderOptions = field(default_factory=LoaderOptions)
    _loaders: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """DataLoaders kept across epochs, so persistent workers persist."""

    def __post_init__(self) -> None:
        if self.task is not None and not isinstance(self.task, str):
            raise UsageError(
                f"DataSpec.task must be a task name (e.g. 'classification', 'pkg.mod:MyTask') or "
                f"None, got {type(self.task).__name__}"
            )
        for name in ("train", "test"):
            split = getattr(self, name)
            if not (hasattr(split, "__len__") and callable(getattr(split, "take", None))):
                raise UsageError(
                    f"DataSpec.{name} is a {type(split).__name__}, which lacks __len__ or "
                    "take(idx): give an object with both (the Split protocol, docs/extending.md)"
                )
        for name in ("train", "test"):
            split = getattr(self, name)
            try:
                len(split)
            except (TypeError, ValueError, OverflowError) as e:
                raise UsageError(
                    f"DataSpec.{name}: len() of {type(split).__name__} failed ({first_line(e)}): "
                    "__len__ must return the number of samples, an int >= 0"
                ) from None
        if len(self.train) == 0 or len(self.test) == 0:
            raise UsageError("the dataset has an empty train or test split: check data.* settings")


def build(cfg: DataConfig, seed: int, device: str = "cpu", source=None) -> DataSpec:
    """The dataset `data.name` (or `source`, trainer.fit's: a DataSpec, or a factory called as
    data.name's are, with (DataConfig, seed)), delivering batches to `device` as data.* asks."""
    if isinstance(source, DataSpec):
        spec = source
    else:
        make = source if source is not None else registry.factory("data.name", cfg.name)
        if not callable(make):
            raise UsageError(
                f"trainer.fit: data is a {type(make).__name__}: give a trainer.DataSpec or a "
                "factory (DataConfig, seed) -> DataSpec"
            )
        try:
            inspect.signature(make).bind(cfg, seed)
        except TypeError:
            raise UsageError(
                f"data.name: factory '{cfg.name}' must take two arguments (DataConfig, seed), as "
                "a data factory is called (docs/extending.md#data)"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin): the call says
        spec = make(cfg, seed)
    if not isinstance(spec, DataSpec):
        raise UsageError(
            f"data.name: factory '{cfg.name}' returned {type(spec).__name__}, not a "
            "trainer.DataSpec: return DataSpec(train=..., test=..., task=...) (docs/extending.md)"
        )
    if cfg.augment and len(tuple(spec.in_shape)) != 3:
        raise UsageError(
            f"data.augment=true crops and flips images, but {cfg.name} samples have shape "
            f"{tuple(spec.in_shape)}: set data.augment=false"
        )
    train, test = spec.train, spec.test
    if cfg.device_resident:
        if getattr(train, "lazy", False) or getattr(test, "lazy", False):
            raise UsageError(
                f"data.device_resident=true needs an in-memory dataset, but {cfg.name} decodes "
                "files per sample: set data.device_resident=false (and data.num_workers to decode "
                "in parallel)"
            )
        if not all(callable(getattr(split, "to", None)) for split in (train, test)):
            raise UsageError(
                f"data.device_resident=true moves the dataset to the device with its splits' "
                f"to(device), which {type(train).__name__} lacks: add one, or set "
                "data.device_resident=false"
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
) -> Iterator[tuple[int, batches.Batch, int]]:
    """Yield (step_in_epoch, batch, global_batch_size) for this rank, from step `start` on.

    The batch is on spec.loader.device; (x, y) inputs are float, normalised and (with
    data.augment) augmented. A rank whose share of a tail batch is empty still gets a step: a
    batch of 0 samples (x of shape (0, *in_shape)).
    """
    opts = spec.loader
    if opts.device_resident:
        yield from _resident_batches(spec, plan, rank, world_size, start)
        return
    to_float = _float_converter(spec.train, opts.device)
    steps = list(plan.rank_batches(rank, world_size, start))
    keys = [(plan.seed, plan.epoch, idx) for _, idx, _ in steps]
    prefetch = getattr(spec.train, "prefetch", None)  # data.name=shards: shards ahead, fetched
    ahead = None
    log = SampleLog.from_env(plan.epoch)
    try:
        for i, ((step, idx, count), batch) in enumerate(
            zip(steps, _fetched(spec, "train", rank, world_size, keys), strict=True)
        ):
            if i == 0 and callable(prefetch):  # once the loader's workers are up
                ahead = prefetch([idx for _, idx, _ in steps])
            if ahead is not None:
                ahead.advance(i)
            if log is not None:
                log.write(step, idx)
            yield step, to_float(_to_device(batch, opts)), count
    finally:
        if ahead is not None:
            ahead.stop()


SAMPLE_LOG_ENV = "TRAINER_SAMPLE_LOG"


class SampleLog:
    """TRAINER_SAMPLE_LOG=FOLDER: each process appends {"epoch", "step", "ids"} (the training
    samples of each of its steps, as it starts them) to FOLDER/samples-rank<RANK>.jsonl: which
    samples a run trained on, to compare runs, world sizes and resumes."""

    def __init__(self, path: str, epoch: int):
        self.path, self.epoch = path, epoch

    @classmethod
    def from_env(cls, epoch: int) -> SampleLog | None:
        import os

        folder = os.environ.get(SAMPLE_LOG_ENV)
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"samples-rank{os.environ.get('RANK', '0')}.jsonl"), epoch)

    def write(self, step: int, idx) -> None:
        import json

        ids = [int(i) for i in np.asarray(idx).reshape(-1)]
        with open(self.path, "a") as f:
            f.write(json.dumps({"epoch": self.epoch, "step": step, "ids": ids}) + "\n")


TAKE_BYTES = 16 << 20
"""A device-resident ArrayDataset's rows for consecutive steps are gathered in one take of up to
this many bytes, pixels counted as float (at most TAKE_STEPS steps), each step's batch a view."""
TAKE_STEPS = 64


def _resident_batches(
    spec: DataSpec, plan: sampler.EpochPlan, rank: int, world_size: int, start: int
) -> Iterator[tuple[int, batches.Batch, int]]:
    """train_batches of a device-resident split: the epoch order copied to the device once,
    each step's batch its rows of the split. Several steps' rows come from one take where the
    split is an ArrayDataset (steps_per_take): one gather where each step made a slice and a
    gather of every tensor, which on a small model's step cost more than the gathering itself
    (the same rows, the same bits). Without augmentation a take is converted to float at once
    (pixels_to_float is elementwise: the same bits as each step's own conversion)."""
    opts, split = spec.loader, spec.train
    pad = opts.crop_padding if opts.augment else None
    to_float = _float_converter(split, opts.device)
    order = torch.from_numpy(plan.order()).to(opts.device)  # one copy per epoch
    spans = list(plan.rank_spans(rank, world_size, start))
    per = steps_per_take(split, spans)
    first = True
    for g in range(0, len(spans), per):
        group = spans[g : g + per]
        lo, hi = group[0][1], group[-1][2]
        whole = hi - lo == sum(b - a for _, a, b, _ in group)  # one run of the order (world 1)
        idx = order[lo:hi] if whole else torch.cat([order[a:b] for _, a, b, _ in group])
        rows = split.take(idx)
        if first:  # the contract, once per pass: not a cost on every step
            first = _checked(split, "train", idx, rows, opts.device) is None
        if pad is None:  # one conversion a take (elementwise: the same bits as per step)
            yield from _views(to_float(rows), group)
            continue
        for step, (mine, batch), count in _views((idx, rows), group):
            batch = (crop_flip(batch[0], mine, plan.seed, plan.epoch, pad), *batch[1:])
            yield step, to_float(batch), count


def _views(rows: batches.Batch, group: list) -> Iterator[tuple[int, batches.Batch, int]]:
    """Each step of `group` (rank spans) with its consecutive rows of `rows` (views; a take of
    one step is its batch)."""
    if len(group) == 1:
        step, _, _, count = group[0]
        yield step, rows, count
        return
    at = 0
    for step, a, b, count in group:
        yield step, batches.cut(rows, at, at + b - a), count
        at += b - a


ALIGN = batches.ALIGN
"""Bytes a step's float tensors start on (batch.ALIGN): a view into a take is used only where
every step's rows start on it; elsewhere each step has its own take."""


def steps_per_take(split: Split, spans: list) -> int:
    """How many consecutive steps' rows one take gathers: 1 (a split's take may depend on the
    whole batch it is asked for, padding to its longest sample, say), but for an ArrayDataset,
    whose take gathers rows, as many as TAKE_BYTES of them hold as float (at most TAKE_STEPS),
    where a row of each of its float tensors is a multiple of ALIGN bytes."""
    if type(split) is not ArrayDataset or not spans or len(split) == 0:
        return 1
    one = _float_converter(split, str(split.x.device))((split.x[:1], split.y[:1]))
    rows = [t[0].numel() * t.element_size() for t in one]  # as a step sees them
    if any(r % ALIGN for r, t in zip(rows, one, strict=True) if t.is_floating_point()):
        return 1
    widest = max(b - a for _, a, b, _ in spans)
    return max(1, min(TAKE_STEPS, TAKE_BYTES // max(1, sum(rows) * widest)))


def eval_batches(
    spec: DataSpec, batch: int, rank: int, world_size: int, *, whole: bool = False
) -> Iterator[batches.Batch]:
    """Yield this rank's batches of the test split; over all ranks, each sample exactly once
    (whole=True: whole batches per rank, see sampler.eval_spans)."""
    opts = spec.loader
    to_float = _float_converter(spec.test, opts.device)
    n = len(spec.test)
    if opts.device_resident:
        for i, (lo, hi) in enumerate(sampler.eval_spans(n, batch, rank, world_size, whole)):
            got = _span(spec.test, lo, hi)
            if i == 0:
                _checked(spec.test, "test", range(lo, hi), got, opts.device)
            yield to_float(got)
        return
    keys = [(0, None, idx) for idx in sampler.eval_batches(n, batch, rank, world_size, whole)]
    for got in _fetched(spec, "test", rank, world_size, keys):
        yield to_float(_to_device(got, opts))


def _span(split: Split, lo: int, hi: int) -> batches.Batch:
    span = getattr(split, "span", None)
    return span(lo, hi) if callable(span) else split.take(np.arange(lo, hi, dtype=np.int64))


def _checked(
    split: Split, name: str, idx, batch: batches.Batch, device: str | None = None
) -> batches.Batch:
    """`batch` if it is what take(idx) promises: tensors (tuple, list or dict of them) with
    len(idx) samples each (on `device`, for a device-resident split); else a one-line
    UsageError naming the split's class."""
    who = f"{type(split).__name__}.take ({name} split)"
    leaves = batches.tensors(batch)
    if not leaves or len(leaves) != _leaf_count(batch):
        raise UsageError(
            f"{who} returned {_described(batch)}: return a tensor, or a tuple or dict of torch "
            "tensors (torch.from_numpy for arrays)"
        )
    try:
        n = batches.size(batch)
    except ValueError as e:
        raise UsageError(f"{who}: {e}") from None
    if n != len(idx):
        raise UsageError(f"{who} returned {n} samples for {len(idx)} indices: one row per index")
    kind = None if device is None else torch.device(device).type
    wrong = [t.device for t in leaves if kind is not None and t.device.type != kind]
    if wrong:
        raise UsageError(
            f"{who} returned tensors on {wrong[0]}, but data.device_resident=true put the split "
            f"on {device}: its to(device) must move every tensor take() reads from"
        )
    return batch


def _leaf_count(batch) -> int:
    if isinstance(batch, dict):
        return sum(_leaf_count(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return sum(_leaf_count(v) for v in batch)
    return 1


def _described(batch) -> str:
    if isinstance(batch, (dict, tuple, list)):
        kinds = {type(t).__name__ for t in (batch.values() if isinstance(batch, dict) else batch)}
        return f"a {type(batch).__name__} of {', '.join(sorted(kinds)) or 'nothing'}"
    return f"a {type(batch).__name__}"


def _fetched(spec: DataSpec, split: str, rank: int, world_size: int, keys: list):
    """The host batches for `keys`, fetched in this process or by a DataLoader.

    Without workers or pinning a DataLoader adds only overhead (about 80 us a batch here), so
    the batches are fetched directly; both ways run the same _BatchReader, so the tensors are equal.
    """
    opts = spec.loader
    if opts.num_workers == 0 and not opts.pin_memory:
        data = spec.train if split == "train" else spec.test
        reader = _BatchReader(data, _pad(opts, split), split)
        yield from (reader.__getitems__(k) for k in keys)
        return
    loader = _loader(spec, split, rank, world_size)
    loader.batch_sampler.keys = keys
    try:
        yield from loader
    except TrainerError as e:
        # DataLoader folds a worker's traceback into the message; the user needs our last line
        # (and the exit code of its kind: a bucket outage in a worker is still a retry's).
        last = str(e).strip().splitlines()[-1]
        raise type(e)(last.split(f"{type(e).__name__}: ", 1)[-1]) from None


def _pad(opts: LoaderOptions, split: str) -> int | None:
    return opts.crop_padding if opts.augment and split == "train" else None


def _to_device(batch: batches.Batch, opts: LoaderOptions) -> batches.Batch:
    # Pinned host memory lets the copy overlap with compute; uint8 pixels cross as uint8.
    return batches.to_device(batch, opts.device, non_blocking=opts.pin_memory)


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

    def __init__(self, data: Split, pad: int | None, name: str):
        self.data, self.pad, self.name = data, pad, name
        self.checked = False

    def __len__(self) -> int:
        return len(self.data)

    def __getitems__(self, key):
        seed, epoch, idx = key
        batch = self.data.take(idx)
        if not self.checked:  # the contract, once per process: not a cost on every step
            _checked(self.data, self.name, idx, batch)
            self.checked = True
        if self.pad is not None and epoch is not None:
            index = torch.from_numpy(np.asarray(idx, dtype=np.int64))
            batch = (crop_flip(batch[0], index, seed, epoch, self.pad), *batch[1:])
        return batch


def _whole_batch(batch):
    return batch  # _BatchReader already returns the batch as tensors


def _loader(spec: DataSpec, split: str, rank: int, world_size: int) -> torch.utils.data.DataLoader:
    key = (split, rank, world_size)
    if key not in spec._loaders:
        opts = spec.loader
        data = spec.train if split == "train" else spec.test
        spec._loaders[key] = torch.utils.data.DataLoader(
            _BatchReader(data, _pad(opts, split), split),
            batch_sampler=_PassKeys(),
            collate_fn=_whole_batch,
            num_workers=opts.num_workers,
            pin_memory=opts.pin_memory,
            persistent_workers=opts.persistent_workers,
        )
    return spec._loaders[key]
