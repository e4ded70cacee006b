"""Text as byte-level tokens (a vocabulary of 256): a local file or folder, or by default the
running Python's own standard-library sources, real text that ships with every Python install.

A sample is a window of seq_len + 1 consecutive bytes: the model reads the first seq_len and
predicts each next byte. Window i starts at byte i x seq_len (its last byte, a target only, is
the next one's first input), so an epoch reads every byte once. The split is by file (a hash of each file's path with data.split_seed decides), so no test file is ever seen
in training; a single file is split by position instead (its last data.test_fraction is test).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

import numpy as np
import torch

from trainer.config import DataConfig, TextConfig
from trainer.data import DataSpec
from trainer.errors import UsageError

VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 bytes of a token stream, gathered per batch."""

    lazy = False
    mean = std = None

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self._offsets = torch.arange(seq_len + 1, device=tokens.device)

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def take(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next-byte targets) of windows `idx`, each (len(idx), seq_len) int64."""
        if isinstance(idx, np.ndarray):
            idx = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        idx = idx.to(self.tokens.device)
        windows = self.tokens[idx[:, None] * self.seq_len + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.take(torch.arange(lo, hi, device=self.tokens.device))

    def to(self, device) -> TokenWindows:
        if self.tokens.device == torch.device(device):
            return self
        return TokenWindows(self.tokens.to(device), self.seq_len)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[str]:
    """The standard library's .py files, as sorted relative paths; no tests, no site-packages,
    and nothing generated for this build (_sysconfigdata*, config-*)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-")]
        for name in files:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found, key=lambda p: p.replace(os.sep, "/"))


def folder_files(root: str) -> list[str]:
    """Every regular file under `root`, sorted; hidden files and folders (.git, .DS_Store) are
    not text you chose."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            path = os.path.join(folder, name)
            if not name.startswith(".") and os.path.isfile(path):
                found.append(os.path.relpath(path, root))
    return sorted(found, key=lambda p: p.replace(os.sep, "/"))


def is_test_file(relpath: str, test_fraction: float, split_seed: int) -> bool:
    """A stable, per-file coin: the same files are test files on every machine and run."""
    digest = hashlib.sha256(f"{split_seed}:{relpath.replace(os.sep, '/')}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def _corpus(t: TextConfig) -> tuple[str, list[str], str]:
    """(root, its files as relative paths, the corpus's name) of data.text.path, or of the
    Python standard library when it is unset."""
    if t.path is None:
        root = stdlib_root()
        return root, stdlib_files(root), "python-stdlib"
    root, corpus = os.path.abspath(t.path), t.path
    if os.path.isfile(root):
        return os.path.dirname(root), [os.path.basename(root)], corpus
    if os.path.isdir(root):
        return root, folder_files(root), corpus
    raise UsageError(
        f"data.text.path={t.path}: no such file or folder: point it at a text file or a "
        "folder of them (or leave it unset for the built-in Python standard library corpus)"
    )


def _split(cfg: DataConfig, root: str, files: list[str]) -> tuple[bytes, bytes, str]:
    """(train bytes, test bytes, the corpus's sha256): split by file, or by position for one
    file (or an unlucky coin that put every file on one side); each cut to its max bytes."""
    t = cfg.text
    digest = hashlib.sha256()
    train, test = [], []
    for rel in files:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                content = f.read()
        except OSError as e:
            raise UsageError(
                f"data.text: cannot read {os.path.join(root, rel)} ({e.strerror})"
            ) from None
        digest.update(rel.replace(os.sep, "/").encode() + b"\0" + content + b"\0")
        (test if is_test_file(rel, cfg.test_fraction, cfg.split_seed) else train).append(content)
    if len(files) == 1 or not train or not test:  # one file (or an unlucky coin): split by position
        stream = b"".join(train + test)
        cut = round(len(stream) * (1 - cfg.test_fraction))
        train, test = [stream[:cut]], [stream[cut:]]
    train_bytes, test_bytes = b"".join(train), b"".join(test)
    if t.max_train_bytes:
        train_bytes = train_bytes[: t.max_train_bytes]
    if t.max_test_bytes:
        test_bytes = test_bytes[: t.max_test_bytes]
    return train_bytes, test_bytes, digest.hexdigest()


def text(cfg: DataConfig, seed: int) -> DataSpec:
    """data.name=text: data.text.path (a file or folder), or the Python standard library."""
    t = cfg.text
    root, files, corpus = _corpus(t)
    if not files:
        raise UsageError(f"data.text.path={t.path}: the folder holds no files")
    train_bytes, test_bytes, sha256 = _split(cfg, root, files)
    for split, data in (("train", train_bytes), ("test", test_bytes)):
        if len(data) <= t.seq_len:
            raise UsageError(
                f"data.text: the {split} split has {len(data)} bytes, not enough for one window of "
                f"data.text.seq_len={t.seq_len} + 1: use more text or a shorter seq_len"
            )
    as_tokens = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return DataSpec(
        train=TokenWindows(as_tokens(train_bytes), t.seq_len),
        test=TokenWindows(as_tokens(test_bytes), t.seq_len),
        task="lm",
        in_shape=(t.seq_len,),
        num_classes=VOCAB,
        source={
            "corpus": corpus,
            "root": root,
            "files": len(files),
            "train_bytes": len(train_bytes),
            "test_bytes": len(test_bytes),
            "sha256": sha256,
        },
    )
