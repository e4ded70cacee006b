"""MNIST, Fashion-MNIST and CIFAR-10 through torchvision, from the folder data.root.

torchvision parses the files; the decoded uint8 images are kept in memory (60,000 x 28 x 28 is
47 MB, 50,000 x 3 x 32 x 32 is 154 MB) and turned into normalised floats one batch at a time.
Nothing is downloaded unless data.download=true.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import struct
from dataclasses import dataclass
from typing import ClassVar
from urllib.error import URLError

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import ArrayDataset, DataSpec
from trainer.errors import RetryableError, UsageError, first_line

MOUNT_HINT = (
    "docker compose: put them under ./data (or DATA_DIR=...), mounted read-only at /workspace/data "
    "(the default data.root=data); Kubernetes: mount a PVC or hostPath volume at data.root"
)


@dataclass(frozen=True)
class _Source:
    name: str
    """Human name, as the files' publisher spells it."""
    folder: str
    """Sub-folder of data.root that torchvision reads."""
    files: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    how: str
    """What the user should put in `folder`."""


_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_IDX_HOW = "the 4 IDX files, decompressed (gunzip the .gz files of the release)"

# The usual normalisation constants: each training set's per-channel pixel mean and std.
MNIST = _Source("MNIST", os.path.join("MNIST", "raw"), _IDX_FILES, (0.1307,), (0.3081,), _IDX_HOW)
FASHION_MNIST = _Source(
    "Fashion-MNIST",
    os.path.join("FashionMNIST", "raw"),
    _IDX_FILES,
    (0.2860,),
    (0.3530,),
    _IDX_HOW,
)
CIFAR10 = _Source(
    "CIFAR-10",
    "cifar-10-batches-py",
    (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"),
    (0.4914, 0.4822, 0.4465),
    (0.2470, 0.2435, 0.2616),
    "the 7 files of cifar-10-python.tar.gz (tar xzf it in data.root)",
)


def missing_files(root: str, source: _Source) -> list[str]:
    folder = os.path.join(root, source.folder)
    return [f for f in source.files if not os.path.isfile(os.path.join(folder, f))]


def _missing_message(cfg: DataConfig, source: _Source, missing: list[str]) -> str:
    folder = os.path.join(cfg.root, source.folder)
    gz = [f for f in missing if os.path.isfile(os.path.join(folder, f + ".gz"))]
    if gz and len(gz) == len(missing):
        return (
            f"data.name={cfg.name}: {folder} holds {', '.join(f + '.gz' for f in gz)} but "
            f"torchvision reads them decompressed: run `gunzip -k {folder}/*.gz` (or mount a "
            "writable data.root with data.download=true, which extracts them)"
        )
    return (
        f"data.name={cfg.name}: {source.name} not found: {folder}/ lacks {', '.join(missing)}. "
        f"Put {source.how} in {folder}/, point data.root at the folder that holds "
        f"{source.folder.split(os.sep)[0]}/, or set data.download=true where the network "
        f"allows. {MOUNT_HINT}"
    )


def _make(factory, cfg: DataConfig, source: _Source):
    """Build the (train, test) torchvision datasets; one-line errors for what the user can fix."""
    if cfg.download:
        _download(factory, cfg, source)
    missing = missing_files(cfg.root, source)
    if missing:
        raise UsageError(_missing_message(cfg, source, missing))
    if source.files == _IDX_FILES:
        _check_idx_files(cfg, source)
    try:
        return factory(cfg.root, True), factory(cfg.root, False)
    except RuntimeError as e:
        if "corrupted" not in str(e):  # e.g. a truncated IDX file fails torch's reshape
            raise UsageError(_unreadable(cfg, source, e)) from None
        raise UsageError(  # torchvision's md5 check (CIFAR-10)
            f"data.name={cfg.name}: files in {os.path.join(cfg.root, source.folder)} do not "
            "match torchvision's published checksums (a partial download or another "
            "release?): replace them, or set data.verify_checksums=false to use this copy"
        ) from None
    except (AssertionError, ValueError, TypeError, EOFError, OSError, KeyError) as e:
        raise UsageError(_unreadable(cfg, source, e)) from None


NUM_CLASSES = 10
"""MNIST, Fashion-MNIST and CIFAR-10 all have 10 classes, labelled 0..9."""


def _bad_file(cfg: DataConfig, source: _Source, path: str, problem: str) -> UsageError:
    return UsageError(
        f"data.name={cfg.name}: cannot read {path}: {problem}: replace the files with {source.how}"
    )


def _check_idx_files(cfg: DataConfig, source: _Source) -> None:
    """Each IDX file's header against its size, label values, and image and label counts.

    torchvision's reader asserts (a bare AssertionError, no file named), and labels >= 10 or
    counts that differ would otherwise surface mid-training as an IndexError in the loss.
    """
    folder = os.path.join(cfg.root, source.folder)
    for images_name, labels_name in zip(_IDX_FILES[::2], _IDX_FILES[1::2], strict=True):
        n_images = _idx_dims(cfg, source, os.path.join(folder, images_name), ndim=3)[0]
        labels_path = os.path.join(folder, labels_name)
        (n_labels,) = _idx_dims(cfg, source, labels_path, ndim=1)
        if n_labels != n_images:
            raise _bad_file(
                cfg,
                source,
                labels_path,
                f"{n_labels} labels for the {n_images} images of {images_name}",
            )
        with open(labels_path, "rb") as f:
            f.seek(8)
            labels = np.frombuffer(f.read(), dtype=np.uint8)
        if len(labels) and labels.max() >= NUM_CLASSES:
            i = int(np.argmax(labels >= NUM_CLASSES))
            raise _bad_file(
                cfg,
                source,
                labels_path,
                f"label {labels[i]} (sample {i}) is not a class 0..{NUM_CLASSES - 1}",
            )


def _idx_dims(cfg: DataConfig, source: _Source, path: str, ndim: int) -> tuple[int, ...]:
    """The dimensions in an uint8 IDX file's header, checked against the file's size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(4 + 4 * ndim)
    except OSError as e:
        raise _bad_file(cfg, source, path, e.strerror or type(e).__name__) from None
    if len(header) < 4 or header[:3] != b"\0\0\x08" or header[3] != ndim:
        raise _bad_file(
            cfg,
            source,
            path,
            f"not an IDX file of uint8 with {ndim} dimension(s) (header {header[:4].hex() or 'empty'}, "
            f"expected 000008{ndim:02x})",
        )
    if len(header) < 4 + 4 * ndim:
        raise _bad_file(cfg, source, path, "the header is cut short")
    dims = struct.unpack(f">{ndim}I", header[4:])
    expected = len(header) + math.prod(dims)
    if size != expected:
        raise _bad_file(
            cfg,
            source,
            path,
            f"its header says {' x '.join(map(str, dims))} bytes of data, so {expected} bytes in "
            f"all, but the file has {size} (truncated or not this format)",
        )
    return dims


def _unreadable(cfg: DataConfig, source: _Source, e: BaseException) -> str:
    return (
        f"data.name={cfg.name}: cannot read {os.path.join(cfg.root, source.folder)} "
        f"({type(e).__name__}: {first_line(e)}): replace the files with {source.how}"
    )


def _download(factory, cfg: DataConfig, source: _Source) -> None:
    """torchvision's download into data.root; under DDP rank 0 fetches while the others wait."""
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    try:
        if not group or dist.get_rank() == 0:
            if missing_files(cfg.root, source):
                _check_writable(cfg, source)
            try:
                os.makedirs(cfg.root, exist_ok=True)
                factory(cfg.root, True, download=True)
                factory(cfg.root, False, download=True)
            except (URLError, RuntimeError, OSError, gzip.BadGzipFile) as e:
                raise RetryableError(
                    f"data.download=true: could not download {source.name} into {cfg.root} "
                    f"({first_line(e)}): check the network and that data.root is writable, or put "
                    f"{source.how} in {os.path.join(cfg.root, source.folder)}/ yourself"
                ) from None
    finally:
        if group:
            dist.barrier()  # the others read only after rank 0 is done (or has failed)


def _check_writable(cfg: DataConfig, source: _Source) -> None:
    """A download needs to write into data.root: a read-only or unusable root is the user's to
    fix (exit 2), not a transient failure to retry."""
    import tempfile

    folder = os.path.join(cfg.root, source.folder)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(
            f"data.download=true: cannot write into data.root={cfg.root} ({e.strerror or e}: "
            f"{e.filename or folder}): set data.root to a writable folder, or put {source.how} "
            f"in {folder}/ and set data.download=false. {MOUNT_HINT}"
        ) from None


def _norm(source: _Source, cfg: DataConfig) -> dict:
    """ArrayDataset's mean/std: the dataset's standard normalisation, or none (pixels in [0, 1])."""
    return {"mean": source.mean, "std": source.std} if cfg.normalize else {}


def _mnist_like(cfg: DataConfig, cls_name: str, source: _Source) -> DataSpec:
    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    train, test = _make(lambda root, tr, **kw: cls(root, train=tr, **kw), cfg, source)
    splits = []
    for ds in (train, test):
        x = ds.data.unsqueeze(1).contiguous()  # (N, 1, 28, 28) uint8
        splits.append(ArrayDataset(x, ds.targets.long(), **_norm(source, cfg)))
    return DataSpec(
        train=splits[0],
        test=splits[1],
        task="classification",
        in_shape=tuple(splits[0].x.shape[1:]),
        num_classes=10,
    )


def mnist(cfg: DataConfig, seed: int) -> DataSpec:
    """MNIST handwritten digits: 60,000 + 10,000 grey 28x28 images, data.root/MNIST/raw/."""
    return _mnist_like(cfg, "MNIST", MNIST)


def fashion_mnist(cfg: DataConfig, seed: int) -> DataSpec:
    """Fashion-MNIST (Zalando): 60,000 + 10,000 grey 28x28 clothing images, data.root/FashionMNIST/raw/."""
    return _mnist_like(cfg, "FashionMNIST", FASHION_MNIST)


def _numpy_private(module: str, name: str):
    """numpy's own pickling helper (numpy._core since numpy 2, numpy.core before)."""
    import importlib

    try:
        return getattr(importlib.import_module(f"numpy._core.{module}"), name)
    except ImportError:
        return getattr(importlib.import_module(f"numpy.core.{module}"), name)


def _np_reconstruct(subtype, shape, dtype):
    """numpy's ndarray.__reduce__ target, for an empty ndarray only (its state brings the data)."""
    _reconstruct = _numpy_private("multiarray", "_reconstruct")
    if subtype is not np.ndarray or tuple(shape) != (0,):
        raise pickle.UnpicklingError("an array other than numpy's own empty-then-filled form")
    return _reconstruct(subtype, shape, dtype)


def _np_frombuffer(buf, dtype, shape, order):
    """numpy's protocol-5 array reduce: the bytes as an array (never an object array)."""
    if np.dtype(dtype).hasobject:
        raise pickle.UnpicklingError("an object array")
    return _numpy_private("numeric", "_frombuffer")(buf, dtype, shape, order)


def _latin1_encode(text, encoding="utf-8", errors="strict"):
    """_codecs.encode as Python 3 pickles bytes at protocol 2: latin-1 only."""
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


_CIFAR_GLOBALS = {
    **{
        (m, "_reconstruct"): _np_reconstruct
        for m in ("numpy.core.multiarray", "numpy._core.multiarray")
    },
    **{(m, "_frombuffer"): _np_frombuffer for m in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}
"""What a CIFAR batch pickle may name: numpy arrays of plain data and Python 3's protocol-2
bytes. Dicts, lists, strings and numbers need no global. Anything else would run code."""


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return _CIFAR_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which has no place in a CIFAR batch (a pickle that "
                "would run code?)"
            ) from None


def _str_keys(entry: dict) -> dict:
    """Python 2 pickles give str keys read as latin-1; bytes keys (b'data') are accepted too."""
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}


def read_cifar_batch(path: str, cfg: DataConfig) -> tuple[np.ndarray, list[int]]:
    """(N x 3072 uint8 pixels, N labels 0..9) of a CIFAR-10 batch file, running no code from it."""

    def bad(problem: str) -> UsageError:
        return _bad_file(cfg, CIFAR10, path, problem)

    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
    except MemoryError:
        raise bad("it asks for more memory than there is") from None
    except Exception as e:  # anything a damaged or crafted pickle can make the unpickler raise
        raise bad(f"not a CIFAR batch pickle ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(entry, dict):
        raise bad(f"it holds a {type(entry).__name__}, not a CIFAR batch's dict")
    entry = _str_keys(entry)
    x = entry.get("data")
    labels = entry.get("labels", entry.get("fine_labels"))
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
        shape = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise bad(f"'data' is {shape}, not N x 3072 uint8 pixels")
    if not isinstance(labels, list) or not all(type(v) is int for v in labels):
        raise bad("'labels' is not a list of integers")
    if len(labels) != len(x):
        raise bad(f"{len(labels)} labels for {len(x)} images")
    wrong = [v for v in labels if not 0 <= v < NUM_CLASSES]
    if wrong:
        raise bad(f"label {wrong[0]} is not a class 0..{NUM_CLASSES - 1}")
    return x, labels


def _cifar_class(verify: bool, cfg: DataConfig):
    from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10
    from torchvision.datasets.vision import VisionDataset

    class SafeCIFAR10(TorchvisionCIFAR10):
        """torchvision's CIFAR-10 (its download and md5 checks), reading the batch pickles with
        `read_cifar_batch`, which runs no code from them: torchvision's pickle.load would run
        whatever a crafted file asks (the md5s are the only guard, and they can be off)."""

        if not verify:  # an md5 of None means 'the file exists'
            train_list: ClassVar = [[name, None] for name, _ in TorchvisionCIFAR10.train_list]
            test_list: ClassVar = [[name, None] for name, _ in TorchvisionCIFAR10.test_list]
            meta: ClassVar = {**TorchvisionCIFAR10.meta, "md5": None}

        def __init__(self, root, train: bool = True, download: bool = False) -> None:
            VisionDataset.__init__(self, root)
            self.train = train
            if download:
                self.download()
            if not self._check_integrity():
                raise RuntimeError("Dataset not found or corrupted.")
            files = self.train_list if train else self.test_list
            folder = os.path.join(self.root, self.base_folder)
            batches = [read_cifar_batch(os.path.join(folder, name), cfg) for name, _ in files]
            self.data = np.vstack([x for x, _ in batches]).reshape(-1, 3, 32, 32)
            self.data = self.data.transpose((0, 2, 3, 1))  # HWC, as torchvision keeps it
            self.targets = [v for _, labels in batches for v in labels]
            self.classes = list(range(NUM_CLASSES))  # batches.meta (names only) is not read

    return SafeCIFAR10


def cifar10(cfg: DataConfig, seed: int) -> DataSpec:
    """CIFAR-10: 50,000 + 10,000 colour 32x32 images in 10 classes, data.root/cifar-10-batches-py/."""
    cls = _cifar_class(cfg.verify_checksums, cfg)
    train, test = _make(lambda root, tr, **kw: cls(root, train=tr, **kw), cfg, CIFAR10)
    splits = []
    for ds in (train, test):
        # torchvision keeps (N, H, W, C) numpy for PIL; the models want (N, C, H, W).
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        y = torch.as_tensor(ds.targets, dtype=torch.int64)
        splits.append(ArrayDataset(x, y, **_norm(CIFAR10, cfg)))
    return DataSpec(
        train=splits[0],
        test=splits[1],
        task="classification",
        in_shape=(3, 32, 32),
        num_classes=10,
    )
