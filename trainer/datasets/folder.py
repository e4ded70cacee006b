"""Image folders: data.root/train/<class>/*.png|jpg and data.root/val/<class>/..., decoded lazily.

Classes are the train folder's sub-folder names, sorted (torchvision's ImageFolder convention),
so class indices do not depend on the file system's listing order. Each image is decoded when a
batch asks for it (in DataLoader workers with data.num_workers > 0), converted to RGB, resized
on its shorter side and centre-cropped to data.image_size, and kept as uint8 until the batch is
on the device.
"""

from __future__ import annotations

import io
import os
import re
import warnings

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import DataSpec
from trainer.datasets.vision import MOUNT_HINT
from trainer.errors import UsageError, first_line

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class FolderDataset(torch.utils.data.Dataset):
    """Image files and their class indices; `take` decodes a batch of them."""

    lazy = True

    def __init__(
        self,
        files: list[str],
        labels: list[int],
        size: int,
        mean: tuple[float, ...] | None,
        std: tuple[float, ...] | None,
    ):
        self.files, self.labels, self.size = files, labels, size
        self.y = torch.tensor(labels, dtype=torch.int64)
        self.mean = None if mean is None else torch.tensor(mean)
        self.std = None if std is None else torch.tensor(std)

    def __len__(self) -> int:
        return len(self.files)

    decoder = "auto"
    """"auto": JPEGs through torchvision.io.decode_jpeg and a tensor resize (1.5x PIL's rate
    at 224 px from 500 x 375 here: docs/benchmarks.md), PIL's draft mode for a JPEG at least
    twice the size asked for, PIL for every other format; "pil": PIL for all (bench/loader.py)."""

    def decode(self, i: int) -> torch.Tensor:
        """One image as uint8 (3, size, size)."""
        from PIL import Image

        path = self.files[i]
        try:
            with warnings.catch_warnings():
                # PIL only warns between MAX_IMAGE_PIXELS and twice that; both are refused here.
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with open(path, "rb") as f:
                    data = f.read()
                with Image.open(io.BytesIO(data)) as img:  # the header only: size, format
                    return self._decoded(img, data)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise UsageError(
                f"data.name=imagefolder: {path} is too large to decode safely ({first_line(e)}): "
                "remove it or shrink it (a decompression bomb, or a photo far larger than "
                "data.image_size needs)"
            ) from None
        except Exception as e:  # a damaged file makes PIL raise OSError, SyntaxError, ValueError...
            # PIL names the in-memory buffer it was given (`<_io.BytesIO object at 0x...>`)
            cause = re.sub(r"<_io\.BytesIO object at 0x[0-9a-f]+>", "it", first_line(e))
            raise UsageError(
                f"data.name=imagefolder: cannot decode {path} ({type(e).__name__}: "
                f"{cause}): remove or replace the file"
            ) from None

    def _decoded(self, img, data: bytes) -> torch.Tensor:
        """Centre crop to a square and resize to size x size (ImageOps.fit), as uint8 CHW."""
        from PIL import Image, ImageOps

        jpeg = img.format == "JPEG" and self.decoder == "auto"
        if jpeg and min(img.size) < 2 * self.size:
            try:
                return self._torchvision(data)
            except RuntimeError:  # a JPEG libjpeg-turbo's torchvision build refuses: PIL's turn
                pass
        elif jpeg:  # the decoder scales by 1/2, 1/4 or 1/8 while decoding: less to decode
            img.draft("RGB", (self.size, self.size))
        img = ImageOps.fit(img.convert("RGB"), (self.size, self.size), Image.Resampling.BILINEAR)
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)

    def _torchvision(self, data: bytes) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as tf

        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        x = decode_jpeg(raw, mode=ImageReadMode.RGB)
        side = min(x.shape[-2:])
        x = tf.center_crop(x, [side, side])
        return tf.resize(x, [self.size, self.size], antialias=True).contiguous()

    def __getitem__(self, i: int):
        return self.decode(i), self.y[i]

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:  # an empty rank share still has the batch's shape
            return torch.empty((0, 3, self.size, self.size), dtype=torch.uint8), self.y[:0]
        x = torch.stack([self.decode(int(i)) for i in idx])
        return x, self.y[torch.from_numpy(idx)]


def scan(
    split_dir: str, classes: list[str] | None = None
) -> tuple[list[str], list[str], list[int]]:
    """(classes, files, labels) of one split; with `classes` given, sub-folders must be among them."""
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if classes is None:
        classes = found
    else:
        extra = [c for c in found if c not in classes]
        if extra:
            raise UsageError(
                f"data.name=imagefolder: {split_dir} has classes {', '.join(extra)} that "
                f"{os.path.join(os.path.dirname(split_dir), 'train')} lacks: the val classes must "
                "be train classes (same folder names)"
            )
    files, labels = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(split_dir, name)
        if not os.path.isdir(folder):
            continue
        for root, _, names in sorted(os.walk(folder, followlinks=True)):
            for f in sorted(names):
                if f.lower().endswith(EXTENSIONS):
                    files.append(os.path.join(root, f))
                    labels.append(label)
    return classes, files, labels


def imagefolder(cfg: DataConfig, seed: int) -> DataSpec:
    """Your own images: data.root/train/<class>/*.png|jpg and data.root/val/<class>/*."""
    layout = (
        f"put images in {cfg.root}/train/<class>/*.png|jpg and {cfg.root}/val/<class>/*.png|jpg "
        f"(one sub-folder per class, the same names in both). {MOUNT_HINT}"
    )
    train_dir, val_dir = os.path.join(cfg.root, "train"), os.path.join(cfg.root, "val")
    absent = [d for d in (train_dir, val_dir) if not os.path.isdir(d)]
    if absent:
        raise UsageError(f"data.name=imagefolder: {' and '.join(absent)} not found: {layout}")
    classes, train_files, train_labels = scan(train_dir)
    if len(classes) < 2 or not train_files:
        raise UsageError(
            f"data.name=imagefolder: {train_dir} needs at least 2 class sub-folders with "
            f"images ({', '.join(EXTENSIONS)}), found {len(classes)} classes and "
            f"{len(train_files)} images: {layout}"
        )
    _, val_files, val_labels = scan(val_dir, classes)
    if not val_files:
        raise UsageError(f"data.name=imagefolder: no images under {val_dir}: {layout}")
    stats = (IMAGENET_MEAN, IMAGENET_STD) if cfg.normalize else (None, None)
    size = cfg.image_size
    return DataSpec(
        train=FolderDataset(train_files, train_labels, size, *stats),
        test=FolderDataset(val_files, val_labels, size, *stats),
        task="classification",
        in_shape=(3, size, size),
        num_classes=len(classes),
    )
