""".npy arrays read per batch through memory maps: tabular or image data larger than memory.

data.arrays.path holds train/ and test/, each with one <field>.npy per field, all of the same
length (the samples). Fields x and y give (x, y) batches, which the built-in tasks and models
read; other field names give dict batches {field: tensor} for your own task (docs/extending.md).
Files are opened with allow_pickle=False (an object array is refused: unpickling runs code), and
every batch maps them afresh, so no rank holds a file whole.

Stored dtypes: floats are read as float32 (the models' dtype), uint8 stays uint8 (x as uint8
pixels is scaled to [0, 1] as the image datasets are), bool stays bool, other integers become
int64 (class labels, ids).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import DataSpec
from trainer.errors import UsageError, first_line


class NpyField:
    """One .npy file: its header read once, its rows gathered per batch from a fresh map."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(6)
            if magic != b"\x93NUMPY":
                raise UsageError(
                    f"data.arrays: {path} is not a .npy file (no NumPy header): write it with "
                    "np.save"
                )
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)  # reads the header only
        except ValueError as e:
            if "allow_pickle" not in str(e) and "Python objects" not in str(e):
                why = "truncated?" if "greater than file size" in str(e) else first_line(e)
                raise UsageError(
                    f"data.arrays: {path} is not a readable .npy file ({why}): write it again "
                    "with np.save"
                ) from None
            mapped = None
        except OSError as e:
            raise UsageError(f"data.arrays: {path} is not a readable .npy file ({e})") from None
        if mapped is None or mapped.dtype.hasobject:
            raise UsageError(
                f"data.arrays: {path} holds Python objects, which only unpickling can read (and "
                "that can run code): save numbers (np.save of a numeric array)"
            )
        if not mapped.shape:
            raise UsageError(f"data.arrays: {path} holds a single value, not one row per sample")
        self.shape, self.dtype, self.offset = mapped.shape, mapped.dtype, mapped.offset
        self.order = "F" if mapped.flags.f_contiguous and mapped.ndim > 1 else "C"
        del mapped

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        mm = np.memmap(
            self.path, self.dtype, "r", offset=self.offset, shape=self.shape, order=self.order
        )
        got = np.ascontiguousarray(mm[idx])
        del mm  # unmapped: the pages stay in the page cache, not in this process
        if got.dtype.kind == "f":
            got = got.astype(np.float32, copy=False)
        elif got.dtype.kind in "iu" and got.dtype != np.uint8:
            got = got.astype(np.int64)
        return torch.from_numpy(got)


class NpyArrays:
    """A split: the fields of one folder, (x, y) tuples or dicts of tensors per batch."""

    lazy = True
    """Read from disk per batch: never moved whole to a device (data.device_resident)."""

    def __init__(self, folder: str):
        names = sorted(n[:-4] for n in os.listdir(folder) if n.endswith(".npy"))
        if not names:
            raise UsageError(
                f"data.arrays: {folder} holds no .npy files: put one <field>.npy per field there "
                "(e.g. x.npy and y.npy)"
            )
        self.fields = {n: NpyField(os.path.join(folder, f"{n}.npy")) for n in names}
        lengths = {n: len(f) for n, f in self.fields.items()}
        if len(set(lengths.values())) != 1:
            raise UsageError(
                f"data.arrays: the fields in {folder} differ in length ({lengths}): every field "
                "needs one row per sample"
            )
        self.pairs = set(names) == {"x", "y"}
        if self.pairs:  # image-style (x, y): uint8 pixels become floats in [0, 1]
            self.mean = self.std = None

    def __len__(self) -> int:
        return len(next(iter(self.fields.values())))

    def take(self, idx):
        idx = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx, np.int64)
        rows = {n: f.rows(idx) for n, f in self.fields.items()}
        return (rows["x"], rows["y"]) if self.pairs else rows


def arrays(cfg: DataConfig, seed: int) -> DataSpec:
    """data.name=arrays: data.arrays.path/train/*.npy and test/*.npy."""
    root = cfg.arrays.path
    for split in ("train", "test"):
        if not os.path.isdir(os.path.join(root, split)):
            raise UsageError(
                f"data.arrays.path={root}: no {split}/ folder there: put train/ and test/ in it, "
                "each holding one <field>.npy per field (e.g. x.npy and y.npy)"
            )
    train, test = NpyArrays(os.path.join(root, "train")), NpyArrays(os.path.join(root, "test"))
    if set(train.fields) != set(test.fields):
        raise UsageError(
            f"data.arrays: train/ has fields {sorted(train.fields)} but test/ has "
            f"{sorted(test.fields)}: give both splits the same .npy files"
        )
    task, in_shape, classes = cfg.arrays.task, (), 0
    if train.pairs:
        x, y = train.fields["x"], train.fields["y"]
        in_shape = x.shape[1:]
        task = task or ("classification" if y.dtype.kind in "iub" else "regression")
        if task == "classification":
            classes = 1 + max(_top_label(s.fields["y"]) for s in (train, test))
        else:
            classes = int(np.prod(y.shape[1:])) if len(y.shape) > 1 else 1
    elif task:
        raise UsageError(
            f"data.arrays.task={task} trains the fields x and y, but {root} holds "
            f"{sorted(train.fields)}: name the files x.npy and y.npy, or leave data.arrays.task "
            "unset and set task.name to your task"
        )
    return DataSpec(
        train=train,
        test=test,
        task=task,
        in_shape=tuple(in_shape),
        num_classes=classes,
        source={"arrays": os.path.abspath(root), "fields": sorted(train.fields)},
    )


def _top_label(field: NpyField) -> int:
    """The largest class label, read in pieces (labels are one number per sample)."""
    top, step = -1, 1 << 20
    for lo in range(0, len(field), step):
        part = field.rows(np.arange(lo, min(lo + step, len(field))))
        if part.dtype.is_floating_point:
            raise UsageError(f"data.arrays: {field.path}: class labels must be integers")
        if (part < 0).any():
            raise UsageError(f"data.arrays: {field.path} holds a negative class label")
        top = max(top, int(part.max()))
    return top
