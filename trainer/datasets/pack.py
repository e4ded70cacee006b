"""`trainer data pack SRC -o OUT`: any dataset the trainer reads, into the shards data.name=shards
reads (trainer/datasets/shards.py has the format).

SRC is a data.name (a built-in, or `package.module:factory`) or a folder the trainer can tell:
an image folder (train/ and val/ of class folders: imagefolder), a folder of .npy fields (train/
and test/: arrays) or of token files (train.bin: tokens). The samples are what the source's
take() returns (pixels as the uint8 it stores, tokens, features). The train samples are packed
in a shuffled order (--shuffle-seed): an image folder lists one class after another, and shards
of one class each would give the shard-aware order's batches few classes. --keep-order keeps
the source's order, and then data.shards.window=0 trains to the bits of training on SRC. Shards are written whole and
renamed (a folder) or uploaded with their sha256 (a bucket); index.json last: a packing that
stops early leaves no index, and OUT must be new (nothing is written over).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile

import numpy as np
import torch

from trainer import registry, storage
from trainer.datasets import shards as fmt
from trainer.errors import UsageError, first_line, io_error

FIELD = re.compile(r"^[A-Za-z0-9_]+$")


def source_overrides(src: str) -> list[str]:
    """The data.* overrides that make SRC the dataset to pack."""
    if os.path.isdir(src):
        if os.path.isdir(os.path.join(src, "train")) and os.path.isdir(os.path.join(src, "val")):
            return ["data.name=imagefolder", f"data.root={src}"]
        if os.path.isdir(os.path.join(src, "train")) and any(
            n.endswith(".npy") for n in os.listdir(os.path.join(src, "train"))
        ):
            return ["data.name=arrays", f"data.arrays.path={src}"]
        if os.path.isfile(os.path.join(src, "train.bin")):
            return ["data.name=tokens", f"data.tokens.path={src}"]
        raise UsageError(
            f"trainer data pack: {src} is not a dataset folder the trainer can tell (train/ and "
            "val/ of class folders, train/*.npy and test/*.npy, or train.bin): give a data.name "
            "instead (digits, pkg.module:factory) with its data.* settings"
        )
    if src in registry.DATASETS or ":" in src:
        if src == "shards":
            raise UsageError("trainer data pack: SRC is already shards: nothing to pack")
        return [f"data.name={src}"]
    raise UsageError(
        f"trainer data pack: {src} is neither a folder nor a dataset name: give an image folder, "
        f"an arrays or tokens folder, or one of {', '.join(sorted(registry.DATASETS))}"
    )


def _fields(batch) -> tuple[str, list[str], list[torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return "tensor", ["x"], [batch]
    if isinstance(batch, dict):
        bad = [k for k in batch if not (isinstance(k, str) and FIELD.match(k))]
        if bad:
            raise UsageError(
                f"trainer data pack: field name {bad[0]!r} is not letters, digits and _ (it "
                "names a tar member): rename it in the dataset"
            )
        return "dict", list(batch), list(batch.values())
    if isinstance(batch, (tuple, list)):
        names = ["x", "y"] if len(batch) == 2 else [f"t{i}" for i in range(len(batch))]
        return "tuple", names, list(batch)
    raise UsageError(f"trainer data pack: a batch is a {type(batch).__name__}, not tensors")


def _npy_header(a: np.ndarray) -> bytes:
    """The .npy header np.save writes before the data of an array like `a`."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(a))
    return buf.getvalue()


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.USTAR_FORMAT)


class _ShardWriter:
    """Writes one split's shards into `folder`, each renamed into place whole; returns infos."""

    def __init__(self, folder: str, split: str, per_shard: int, names: list[str]):
        self.folder, self.split, self.per_shard, self.names = folder, split, per_shard, names
        self.done: list[fmt.ShardInfo] = []
        self._f = None
        self._count = 0

    def _open(self) -> None:
        self.name = f"{self.split}-{len(self.done):05d}.tar"
        self.path = os.path.join(self.folder, f".{self.name}.partial")
        self._f = open(self.path, "wb")  # noqa: SIM115 (open across add() calls; close() ends it)
        self._hash = hashlib.sha256()
        self._count = 0

    def _write(self, data: bytes) -> None:
        self._hash.update(data)
        self._f.write(data)

    def add(self, key: int, members: list[tuple[bytes, np.ndarray]]) -> None:
        if self._f is None:
            self._open()
        for name, (header, row) in zip(self.names, members, strict=True):
            data = row.tobytes()
            size = len(header) + len(data)
            self._write(_tar_header(f"{key:010d}.{name}.npy", size))
            self._write(header)
            self._write(data)
            self._write(b"\0" * (-size % fmt.BLOCK))
        self._count += 1
        if self._count == self.per_shard:
            self.close()

    def close(self) -> fmt.ShardInfo | None:
        if self._f is None:
            return None
        self._write(b"\0" * (2 * fmt.BLOCK))
        self._f.close()
        self._f = None
        size = os.path.getsize(self.path)
        final = os.path.join(self.folder, self.name)
        os.rename(self.path, final)
        info = fmt.ShardInfo(self.name, self._count, size, self._hash.hexdigest())
        self.done.append(info)
        self.on_shard(final, info)
        return info

    def on_shard(self, path: str, info: fmt.ShardInfo) -> None:
        """Called with each finished shard (the bucket packer uploads it here)."""


SHUFFLE_TAG = 0x5A4D
"""Mixed into the packing permutation's seed, so it is not an epoch order of the same seed."""


def packing_order(n: int, shuffle_seed: int | None) -> np.ndarray:
    """The source's train samples in the order they are packed: shuffled from `shuffle_seed`
    (so each shard holds a mix of the set, not one class of an image folder), or as they are."""
    if shuffle_seed is None:
        return np.arange(n, dtype=np.int64)
    seq = np.random.SeedSequence([shuffle_seed, SHUFFLE_TAG])
    return np.random.Generator(np.random.PCG64(seq)).permutation(n).astype(np.int64)


def pack(
    data_cfg, seed: int, out: str, *, shard_mb: float = 64.0, shuffle_seed: int | None = 0,
    say=print,
) -> dict:  # fmt: skip
    """Write the dataset `data_cfg` names as shards to `out` (a new folder or s3:// prefix),
    its train samples in packing_order(shuffle_seed) (None: the source's order); returns the
    index written."""
    if not shard_mb > 0:
        raise UsageError(f"--shard-mb {shard_mb}: must be > 0, e.g. 64")
    bucket = storage.is_url(out)
    if bucket:
        out = out.rstrip("/")
        storage.check_path("trainer data pack -o", out)
        with storage.explained(f"trainer data pack: {out} cannot be listed"):
            if storage.listing(out):
                raise UsageError(
                    f"trainer data pack: {out} holds objects already: pack into a new prefix "
                    "(nothing is written over)"
                )
    elif os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(
            f"trainer data pack: {out} exists and is not an empty folder: pack into a new folder "
            "(nothing is written over)"
        )
    spec = registry.factory("data.name", data_cfg.name)(data_cfg, seed)
    work = tempfile.mkdtemp(prefix="trainer-pack-") if bucket else out
    try:
        if not bucket:
            os.makedirs(out, exist_ok=True)
        index = _pack_splits(spec, work, out, shard_mb, shuffle_seed, say)
        blob = (json.dumps(index, indent=1) + "\n").encode()
        if bucket:
            with storage.explained(f"trainer data pack: writing {out}/{fmt.INDEX}"):
                storage.put_bytes(storage.join(out, fmt.INDEX), blob, only_new=True)
        else:
            part = os.path.join(out, f".{fmt.INDEX}.partial")
            with open(part, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.rename(part, os.path.join(out, fmt.INDEX))
    except OSError as e:
        raise io_error(
            e, f"trainer data pack: writing {out}", "free space or pick another OUT"
        ) from None
    finally:
        if bucket:
            shutil.rmtree(work, ignore_errors=True)
    return index


def _pack_splits(spec, work: str, out: str, shard_mb: float, shuffle_seed, say) -> dict:
    splits, fields, kind = {}, None, None
    for split_name in fmt.SPLITS:
        split = getattr(spec, split_name)
        kind_, names, tensors = _fields(split.take(np.arange(min(len(split), 1), dtype=np.int64)))
        arrays = [_numpy(t, names[i]) for i, t in enumerate(tensors)]
        these = [
            fmt.Field(nm, str(a.dtype), tuple(a.shape[1:]), len(_npy_header(a[0])))
            for nm, a in zip(names, arrays, strict=True)
        ]
        if fields is None:
            fields, kind = these, kind_
        elif these != fields or kind_ != kind:
            raise UsageError(
                "trainer data pack: the train and test splits' samples differ in fields, dtype "
                "or shape: make both splits return the same"
            )
        writer = _ShardWriter(work, split_name, 1, names)
        if storage.is_url(out):
            writer.on_shard = _uploader(out)
        order = packing_order(len(split), shuffle_seed if split_name == "train" else None)
        _write_split(split, order, fields, [_npy_header(a[0]) for a in arrays], writer, shard_mb)
        splits[split_name] = [vars(s) for s in writer.done]
        total = sum(s.bytes for s in writer.done)
        say(f"{split_name}: {len(split)} samples in {len(writer.done)} shards, "
            f"{total / 2**20:.1f} MiB")  # fmt: skip
    stats = None
    if hasattr(spec.train, "mean"):
        stats = [
            None if t is None else [float(v) for v in t.reshape(-1)]
            for t in (spec.train.mean, spec.train.std)
        ]
    return {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "kind": kind,
        "fields": [vars(f) | {"shape": list(f.shape)} for f in fields],
        "spec": {
            "task": spec.task,
            "in_shape": list(spec.in_shape),
            "num_classes": spec.num_classes,
            "target_scale": spec.target_scale,
            "stats": stats,
            "source": _plain(spec.source),
            "train_order": "source" if shuffle_seed is None else f"shuffled, seed {shuffle_seed}",
        },
        "splits": splits,
    }


def _write_split(split, order, fields, headers, writer: _ShardWriter, shard_mb: float) -> None:
    """The samples of `split` in `order`, read a chunk at a time, into `writer`'s shards of
    `shard_mb` each."""
    stride = fmt.Layout(tuple(fields), "tuple", {}, {}).stride
    writer.per_shard = max(1, int(shard_mb * 2**20) // stride)
    chunk = max(1, min(writer.per_shard, (16 << 20) // stride))
    n = len(order)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        _, names, got = _fields(split.take(order[lo:hi]))
        got = [_numpy(t, names[i]) for i, t in enumerate(got)]
        for a, f in zip(got, fields, strict=True):
            if str(a.dtype) != f.dtype or tuple(a.shape[1:]) != f.shape or len(a) != hi - lo:
                raise UsageError(
                    f"trainer data pack: field {f.name} of samples {lo}..{hi - 1} is "
                    f"{a.dtype} {tuple(a.shape[1:])}, not {f.dtype} {f.shape} as sample 0's: "
                    "every sample of a field needs one dtype and shape (pad or crop them in "
                    "the dataset)"
                )
        for j in range(hi - lo):
            writer.add(lo + j, [(h, a[j]) for h, a in zip(headers, got, strict=True)])
    writer.close()


def _numpy(t, name: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"trainer data pack: field {name} is a {type(t).__name__}, not a tensor")
    try:
        return np.ascontiguousarray(t.detach().cpu().numpy())
    except (TypeError, RuntimeError) as e:
        raise UsageError(
            f"trainer data pack: field {name} ({t.dtype}) has no numpy form ({first_line(e)}): "
            "store it as float32 or an integer type"
        ) from None


def _plain(value):
    """`value` as JSON holds it (a DataSpec.source may hold paths and numbers)."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return {}


def _uploader(out: str):
    def upload(path: str, info: fmt.ShardInfo) -> None:
        url = storage.join(out, info.name)
        with storage.explained(f"trainer data pack: uploading {url}"):
            storage.put_file(path, url, info.sha256)
        with contextlib.suppress(OSError):
            os.remove(path)

    return upload
