"""MNIST, Fashion-MNIST and CIFAR-10 through torchvision, from the folder data.root.

torchvision parses the files; the decoded uint8 images are kept in memory (60,000 x 28 x 28 is
47 MB, 50,000 x 3 x 32 x 32 is 154 MB) and turned into normalised floats one batch at a time.
Nothing is downloaded unless data.download=true.
"""

from __future__ import annotations

import gzip
import os
import pickle
from dataclasses import dataclass
from typing import ClassVar
from urllib.error import URLError

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
    except (
        AssertionError,
        ValueError,
        TypeError,
        EOFError,
        OSError,
        KeyError,
        pickle.PickleError,
    ) as e:
        raise UsageError(_unreadable(cfg, source, e)) from None


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


def _cifar_class(verify: bool):
    from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10

    if verify:
        return TorchvisionCIFAR10

    class UncheckedCIFAR10(TorchvisionCIFAR10):
        """torchvision's reader with the md5 checks off: an md5 of None means 'the file exists'."""

        train_list: ClassVar = [[name, None] for name, _ in TorchvisionCIFAR10.train_list]
        test_list: ClassVar = [[name, None] for name, _ in TorchvisionCIFAR10.test_list]
        meta: ClassVar = {**TorchvisionCIFAR10.meta, "md5": None}

    return UncheckedCIFAR10


def cifar10(cfg: DataConfig, seed: int) -> DataSpec:
    """CIFAR-10: 50,000 + 10,000 colour 32x32 images in 10 classes, data.root/cifar-10-batches-py/."""
    cls = _cifar_class(cfg.verify_checksums)
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
