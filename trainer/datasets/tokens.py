"""Flat token files, read per batch through a memory map: corpora larger than memory.

The format is nanoGPT's: train.bin and test.bin (or val.bin), each a flat array of token ids
(uint16, or uint32 for vocabularies over 65,536), plus tokens.json beside them saying the dtype
and vocabulary size (nanoGPT's meta.pkl is never read: unpickling can run code). A sample is a
window of seq_len + 1 consecutive tokens, window i starting at token i x seq_len, exactly as
data.name=text windows its bytes: a file written by `trainer data tokenize` from a folder of text
(bytes, the default tokenizer) trains to the same numbers as data.name=text on that folder.

No rank reads a file whole: each batch opens a fresh memory map, gathers its windows and drops
the map (as nanoGPT's get_batch does), so the pages read stay in the OS page cache, shared by
every rank, and out of each process's resident memory.

`trainer data tokenize SRC -o OUT` writes such a folder from a text file or a folder of them,
one file at a time (never the corpus whole): the split is data.name=text's (a per-file coin with
data.split_seed; one file, or all files on one side, by position).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import DataSpec
from trainer.errors import UsageError

META = "tokens.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SPLITS = {"train": ("train.bin",), "test": ("test.bin", "val.bin")}


class TokenFile:
    """Non-overlapping windows of seq_len + 1 tokens of a token file, gathered per batch."""

    lazy = True
    """Read from disk per batch: never moved whole to a device (data.device_resident)."""

    def __init__(
        self, path: str, dtype: str, seq_len: int, vocab_size: int, limit: int | None = None
    ):
        self.path, self.dtype, self.seq_len, self.vocab_size = path, dtype, seq_len, vocab_size
        self.stored = os.path.getsize(path) // np.dtype(dtype).itemsize
        self.tokens = min(self.stored, limit or self.stored)
        """The tokens used: the file's, or its first `limit`."""
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return max(0, (self.tokens - 1) // self.seq_len)

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next-token targets) of windows `idx`, each (len(idx), seq_len) int64."""
        idx = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx, np.int64)
        mm = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.stored,))
        windows = mm[idx[:, None] * self.seq_len + self._offsets].astype(np.int64)
        del mm  # unmapped: the pages stay in the page cache, not in this process
        if windows.size and (top := int(windows.max())) >= self.vocab_size:
            raise UsageError(
                f"data.tokens: {self.path} holds token id {top}, not below the vocabulary size "
                f"{self.vocab_size}: wrong data.tokens.dtype or vocab_size (or tokens.json)?"
            )
        t = torch.from_numpy(windows)
        return t[:, :-1], t[:, 1:]

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.take(np.arange(lo, hi, dtype=np.int64))


def read_meta(folder: str) -> dict:
    """tokens.json, checked: a mapping with a known dtype and an integer vocab_size."""
    path = os.path.join(folder, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UsageError(f"data.tokens: {path} is not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"data.tokens: {path} must hold a JSON object like {_EXAMPLE}")
    dtype, vocab = meta.get("dtype"), meta.get("vocab_size")
    if dtype not in DTYPES or isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise UsageError(
            f"data.tokens: {path} must say the dtype (uint16 or uint32) and the vocab_size (an "
            f"integer >= 2), like {_EXAMPLE}; it holds dtype={dtype!r}, vocab_size={vocab!r}"
        )
    if vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise UsageError(
            f"data.tokens: {path}: a vocab_size of {vocab} does not fit in {dtype}: use uint32"
        )
    return meta


_EXAMPLE = '{"dtype": "uint16", "vocab_size": 50257}'


def tokens(cfg: DataConfig, seed: int) -> DataSpec:
    """data.name=tokens: the token files in data.tokens.path."""
    t, folder = cfg.tokens, cfg.tokens.path
    if not os.path.isdir(folder):
        raise UsageError(
            f"data.tokens.path={folder}: no such folder: write one with `trainer data tokenize "
            f"TEXT_FOLDER -o {folder}` (or point it at nanoGPT's train.bin/val.bin folder)"
        )
    meta = read_meta(folder)
    dtype, vocab = t.dtype or meta.get("dtype"), t.vocab_size or meta.get("vocab_size")
    if dtype is None or vocab is None:
        raise UsageError(
            f"data.tokens.path={folder}: no {META} says how the ids are stored: set "
            "data.tokens.dtype=uint16 (or uint32) and data.tokens.vocab_size=N (a meta.pkl is "
            "not read: unpickling can run code)"
        )
    splits = {}
    for split, names in SPLITS.items():
        found = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
        if not found:
            raise UsageError(
                f"data.tokens.path={folder}: no {' or '.join(names)} there (token files are "
                "train.bin and test.bin, as `trainer data tokenize` writes them)"
            )
        size = os.path.getsize(found[0])
        if size % np.dtype(dtype).itemsize:
            raise UsageError(
                f"data.tokens: {found[0]} is {size} bytes, not a whole number of {dtype} ids: "
                "wrong data.tokens.dtype?"
            )
        limit = t.max_train_tokens if split == "train" else t.max_test_tokens
        splits[split] = TokenFile(found[0], dtype, t.seq_len, vocab, limit)
        if len(splits[split]) == 0:
            raise UsageError(
                f"data.tokens: {found[0]} holds {splits[split].tokens} tokens, not enough for one "
                f"window of data.tokens.seq_len={t.seq_len} + 1: use more text or a shorter seq_len"
            )
    return DataSpec(
        train=splits["train"],
        test=splits["test"],
        task="lm",
        in_shape=(t.seq_len,),
        num_classes=vocab,
        source={
            "corpus": folder,
            "tokens": meta.get("tokenizer", "unknown"),
            "dtype": dtype,
            "train_tokens": splits["train"].tokens,
            "test_tokens": splits["test"].tokens,
            "sha256": meta.get("sha256"),
        },
    )


# --- writing token files ------------------------------------------------------------------------

CHUNK = 1 << 24
"""Bytes read at a time by the byte tokenizer (16 MiB): memory stays flat for any corpus."""


def _bytes_tokenizer(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def load_tokenizer(name: str | None) -> tuple[Callable[[bytes], Iterable[int]], int, str]:
    """(encode, vocab_size, name): bytes (a vocabulary of 256) or a plug-in `pkg.module:obj`,
    a callable taking a file's bytes and returning its token ids, with a `vocab_size`."""
    if name in (None, "bytes"):
        return _bytes_tokenizer, 256, "bytes"
    from trainer import registry

    if ":" not in name:
        raise UsageError(f"--tokenizer {name}: give bytes or package.module:tokenizer")
    module, _, attr = name.partition(":")
    obj = registry.resolve("--tokenizer", name)
    vocab = getattr(obj, "vocab_size", None)
    if not callable(obj) or isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise UsageError(
            f"--tokenizer {name}: needs a callable (file bytes -> token ids) with an integer "
            f"vocab_size attribute; {module}:{attr} is a {type(obj).__name__} with vocab_size="
            f"{vocab!r}"
        )
    return obj, vocab, name


@dataclass(frozen=True)
class _Encoder:
    """A loaded tokenizer and the dtype its ids are stored as."""

    encode: Callable[[bytes], Iterable[int]]
    vocab: int
    name: str
    dtype: str


def write_token_files(
    src: str,
    out: str,
    *,
    tokenizer: str | None = None,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    log=print,
) -> dict:
    """Tokenize SRC (a text file or a folder of them) into OUT/train.bin, test.bin and
    tokens.json; returns tokens.json's contents. Files are read one at a time (the byte
    tokenizer in 16 MiB pieces), and written to temporary names renamed at the end."""
    encode, vocab, name = load_tokenizer(tokenizer)
    enc = _Encoder(encode, vocab, name, "uint16" if vocab <= 2**16 else "uint32")
    root, files = _source_files(src)
    sides = _split_files(files, test_fraction, split_seed)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"trainer data tokenize: cannot create {out} ({e.strerror})") from None
    paths = {s: os.path.join(out, f".{s}.bin.tmp") for s in ("train", "test")}
    counts, sha256 = _write_sides(paths, root, sides, test_fraction, enc)
    meta = {
        "dtype": enc.dtype,
        "vocab_size": vocab,
        "tokenizer": name,
        "train_tokens": counts["train"],
        "test_tokens": counts["test"],
        "files": len(files),
        "source": os.path.abspath(src),
        "test_fraction": test_fraction,
        "split_seed": split_seed,
        "sha256": sha256,
    }
    _publish(out, paths, meta)
    log(
        f"wrote {out}: {counts['train']:,} train and {counts['test']:,} test tokens ({enc.dtype}, "
        f"vocabulary {vocab}, tokenizer {name}) from {len(files)} file(s)"
    )
    return meta


def _source_files(src: str) -> tuple[str, list[str]]:
    """(root, the files under it to tokenize, relative to it) of a text file or a folder."""
    from trainer.datasets.text import folder_files

    if os.path.isfile(src):
        root, files = os.path.dirname(os.path.abspath(src)), [os.path.basename(src)]
    elif os.path.isdir(src):
        root, files = os.path.abspath(src), folder_files(src)
    else:
        raise UsageError(f"trainer data tokenize: {src}: no such file or folder")
    if not files:
        raise UsageError(f"trainer data tokenize: {src}: the folder holds no files")
    return root, files


def _split_files(files: list[str], test_fraction: float, split_seed: int) -> dict[str, list[str]]:
    """{"train": files, "test": files} by data.name=text's per-file coin."""
    from trainer.datasets.text import is_test_file

    sides: dict[str, list[str]] = {"train": [], "test": []}
    for rel in files:
        sides["test" if is_test_file(rel, test_fraction, split_seed) else "train"].append(rel)
    return sides


def _write_sides(
    paths: dict[str, str],
    root: str,
    sides: dict[str, list[str]],
    test_fraction: float,
    enc: _Encoder,
) -> tuple[dict[str, int], str]:
    """Tokenize the files, in data.name=text's stream order, into paths["train"] and
    paths["test"]: each file to its side, or, for one file (or every file on one side), the
    stream's last test_fraction to test. Returns the tokens written per side and the sha256."""
    order = sides["train"] + sides["test"]  # data.name=text's stream order
    by_position = len(order) == 1 or not sides["train"] or not sides["test"]
    digest = hashlib.sha256()
    counts = {"train": 0, "test": 0}
    with open(paths["train"], "wb") as train_f, open(paths["test"], "wb") as test_f:
        sinks = {"train": train_f, "test": test_f}
        cut = None
        if by_position:  # one stream, its last test_fraction is test (data.name=text's rule)
            total = _count_tokens(root, order, enc.encode, enc.name)
            cut = round(total * (1 - test_fraction))
        seen = 0
        for rel in order:
            digest.update(rel.replace(os.sep, "/").encode() + b"\0")
            side = "test" if rel in sides["test"] else "train"
            for ids in _file_tokens(os.path.join(root, rel), enc.encode, enc.name):
                digest.update(ids.tobytes())
                if len(ids) and int(ids.max()) >= enc.vocab:
                    raise UsageError(
                        f"--tokenizer {enc.name}: gave an id >= its vocab_size {enc.vocab}"
                    )
                ids = ids.astype(enc.dtype)
                for to, piece in _pieces(ids, side, cut, seen):
                    sinks[to].write(piece.tobytes())
                    counts[to] += len(piece)
                seen += len(ids)
            digest.update(b"\0")
    return counts, digest.hexdigest()


def _pieces(ids: np.ndarray, side: str, cut: int | None, seen: int):
    """(side, ids) for the non-empty parts of a file's next `ids`: all on the file's own side,
    or (with the stream cut at token `cut`, `seen` tokens in) split between train and test."""
    if cut is None:
        parts = ((side, ids),)
    else:
        head = max(0, min(len(ids), cut - seen))
        parts = (("train", ids[:head]), ("test", ids[head:]))
    return [(s, piece) for s, piece in parts if len(piece)]


def _publish(out: str, paths: dict[str, str], meta: dict) -> None:
    """Rename the finished token files to their names, then write tokens.json beside them."""
    for side in ("train", "test"):
        os.replace(paths[side], os.path.join(out, f"{side}.bin"))
    with open(os.path.join(out, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def _file_tokens(path: str, encode, name: str):
    """A file's token ids as arrays: 16 MiB pieces for bytes, the whole file for a plug-in."""
    try:
        with open(path, "rb") as f:
            if name == "bytes":
                while piece := f.read(CHUNK):
                    yield _bytes_tokenizer(piece)
                return
            data = f.read()
    except OSError as e:
        raise UsageError(f"trainer data tokenize: cannot read {path} ({e.strerror})") from None
    ids = np.asarray(encode(data))
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise UsageError(
            f"--tokenizer {name}: returned {ids.dtype} of shape {ids.shape} for {path}; it must "
            "return a flat sequence of integer token ids"
        )
    if ids.size and ids.min() < 0:
        raise UsageError(f"--tokenizer {name}: returned a negative token id for {path}")
    yield ids.astype(np.int64)


def _count_tokens(root: str, files: list[str], encode, name: str) -> int:
    if name == "bytes":
        return sum(os.path.getsize(os.path.join(root, rel)) for rel in files)
    paths = (os.path.join(root, rel) for rel in files)
    return sum(len(ids) for path in paths for ids in _file_tokens(path, encode, name))
