"""Tiny fake copies of the on-disk dataset formats, so the real torchvision readers run in CI.

Each image holds a class-dependent pattern plus noise, so a model can learn from it and a
training test can watch the loss fall.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

IDX_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def images(
    n: int, shape: tuple[int, ...], classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images of `shape` each, int labels): a bright band whose row is the class."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % classes)  # balanced: every class present
    x = rng.integers(0, 60, (n, *shape)).astype(np.uint8)
    h = shape[-2]
    for i, c in enumerate(y):
        row = (c * h) // classes
        x[i, ..., row : row + max(1, h // classes), :] = 200 + rng.integers(0, 55)
    return x, y


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX (SN3 'Pascal Vincent') file of uint8: magic 0x08 type + ndim, big-endian dims."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def mnist_folder(
    root: Path, folder: str = "FashionMNIST", n_train: int = 64, n_test: int = 32, gz: bool = False
) -> Path:
    """root/<folder>/raw/ with the 4 IDX files torchvision's MNIST/FashionMNIST read."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for train, n, seed in ((True, n_train, 1), (False, n_test, 2)):
        x, y = images(n, (28, 28), 10, seed)
        img_name, lbl_name = IDX_FILES[train]
        write_idx(raw / img_name, x)
        write_idx(raw / lbl_name, y.astype(np.uint8))
        if gz:
            for name in (img_name, lbl_name):
                data = (raw / name).read_bytes()
                (raw / f"{name}.gz").write_bytes(gzip.compress(data))
                (raw / name).unlink()
    return root


def cifar_folder(root: Path, per_batch: int = 16, n_test: int = 32) -> Path:
    """root/cifar-10-batches-py/ with 5 train pickles, test_batch and batches.meta."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, n: int, seed: int) -> None:
        x, y = images(n, (3, 32, 32), 10, seed)
        # CIFAR's layout: each row is 1024 red, then 1024 green, then 1024 blue values.
        entry = {"data": x.reshape(n, 3072), "labels": [int(v) for v in y]}
        (folder / name).write_bytes(pickle.dumps(entry))

    for i in range(1, 6):
        dump(f"data_batch_{i}", per_batch, 10 + i)
    dump("test_batch", n_test, 20)
    names = [
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))
    return root


def image_folder(
    root: Path, classes=("cat", "dog", "owl"), per_class: int = 6, size=(20, 24), ext: str = "png"
) -> Path:
    """root/train/<class>/*.png and root/val/<class>/*.png, images of size (w, h)."""
    from PIL import Image

    for split, n, seed in (("train", per_class, 3), ("val", max(1, per_class // 2), 4)):
        x, y = images(n * len(classes), (3, size[1], size[0]), len(classes), seed)
        order = np.argsort(y, kind="stable")
        for k, i in enumerate(order):
            d = root / split / classes[y[i]]
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(x[i].transpose(1, 2, 0)).save(d / f"img{k:03d}.{ext}")
    return root
