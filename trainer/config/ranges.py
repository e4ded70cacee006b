"""The one table of numeric ranges (and of strings that must not be empty, and of strings that
are paths) for the schema's fields. It imports nothing of the schema: schema.py checks its
fields against these tables (check_fields) and builds the hints on them (range_hint, example)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SEED = 2**63 - 1
"""Seeds go to torch.manual_seed and numpy's SeedSequence: non-negative 64-bit integers."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field (or each item of a numeric list) accepts; NaN never is."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            return False  # no range here includes NaN or an infinity
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.lo == 1 and isinstance(self.lo, int):
            low = "> 0"  # a count
        else:
            low = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        return f"{low} and {'<' if self.hi_open else '<='} {_num(self.hi)}"


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 2**16:
        if x & (x - 1) == 0:
            return f"2**{x.bit_length() - 1}"
        if x & (x + 1) == 0:
            return f"2**{x.bit_length()}-1"
        return str(x) if x < 10**9 else f"{x:.0e}"
    return f"{x:g}" if isinstance(x, float) else str(x)


_STEPS = 10**12
_BATCH = 2**24
RANGES: dict[str, Range] = {
    # The one table of numeric ranges: every int/float field of the schema (and of its lists)
    # has an entry, checked in __post_init__ by check_fields; tests/test_bad_input.py walks it.
    "seed": Range(0, MAX_SEED),
    "data.synthetic.shape": Range(1, 2**16),
    "data.synthetic.num_classes": Range(2, 10**6),
    "data.synthetic.size": Range(1, 10**9),
    "data.synthetic.test_size": Range(1, 10**9),
    "data.text.seq_len": Range(1, 2**20),
    "data.text.max_train_bytes": Range(1, 2**50),
    "data.text.max_test_bytes": Range(1, 2**50),
    "data.tokens.seq_len": Range(1, 2**20),
    "data.tokens.vocab_size": Range(2, 2**32),
    "data.tokens.max_train_tokens": Range(2, 2**50),
    "data.tokens.max_test_tokens": Range(2, 2**50),
    "data.global_batch_size": Range(1, _BATCH),
    "data.eval_batch_size": Range(1, _BATCH),
    "data.test_fraction": Range(0.0, 1.0, lo_open=True, hi_open=True),
    "data.split_seed": Range(0, MAX_SEED),
    "data.crop_padding": Range(0, 1024),
    "data.image_size": Range(1, 8192),
    "data.num_workers": Range(0, 1024),
    "data.shards.window": Range(0, 2**20),
    "data.shards.cache_gb": Range(0.0, 2.0**20, lo_open=True),
    "model.gpt.layers": Range(1, 1024),
    "model.gpt.width": Range(1, 2**16),
    "model.gpt.heads": Range(1, 1024),
    "model.hidden": Range(1, 2**20),
    "model.dropout": Range(0.0, 1.0, hi_open=True),
    "model.num_classes": Range(1, 10**7),
    "model.in_channels": Range(1, 2**16),
    "optim.lr": Range(0.0, 10.0, lo_open=True),
    "optim.weight_decay": Range(0.0, 10.0),
    "optim.momentum": Range(0.0, 1.0, hi_open=True),
    "optim.betas": Range(0.0, 1.0, hi_open=True),
    "optim.lora_rank": Range(1, 4096),
    "optim.lora_alpha": Range(0.0, 1e6, lo_open=True),
    "sched.warmup_steps": Range(0, _STEPS),
    "sched.step_size_epochs": Range(1, 10**6),
    "sched.gamma": Range(0.0, 1.0, lo_open=True),
    "sched.min_lr_ratio": Range(0.0, 1.0),
    "sched.pct_start": Range(0.0, 1.0, lo_open=True, hi_open=True),
    "train.epochs": Range(1, 10**6),
    "train.max_steps": Range(1, _STEPS),
    "train.eval_every_steps": Range(0, _STEPS),
    "train.eval_every_epochs": Range(1, 10**6),
    "train.fp16_init_scale": Range(1.0, 1e38),  # below float32's max
    "train.micro_batch_size": Range(1, _BATCH),
    "train.clip_grad_norm": Range(0.0, 1e6, lo_open=True),
    "dist.timeout_s": Range(1, 7 * 24 * 3600),
    "log.every_steps": Range(1, _STEPS),
    "log.mlflow.flush_s": Range(0.0, 24 * 3600.0),
    "log.wandb.flush_s": Range(0.0, 24 * 3600.0),
    "ckpt.every_steps": Range(0, _STEPS),
    "ckpt.every_minutes": Range(0.0, 7 * 24 * 60.0),
    "ckpt.every_epochs": Range(0, 10**6),
    "ckpt.keep_last": Range(1, 10**6),
    "repro.shards": Range(1, 2**16),
    "dist.stall_s": Range(0.0, 7 * 24 * 3600.0),
}

NONEMPTY = frozenset(
    {"name", "run_dir", "data.name", "data.root", "data.text.path", "model.name", "ckpt.dir"}
    | {"ckpt.resume", "ckpt.init_weights", "data.tokens.path", "data.arrays.path", "task.name"}
    | {"data.shards.path", "data.shards.cache_dir"}
    | {"log.mlflow.uri", "log.mlflow.experiment", "log.mlflow.run_name"}
    | {"log.wandb.project", "log.wandb.entity"}
)
"""String fields that must not be empty (null, where allowed, is the way to say "none")."""

PATHS = frozenset(
    {"name", "run_dir", "data.root", "data.text.path", "ckpt.dir", "ckpt.resume"}
    | {"ckpt.init_weights", "data.tokens.path", "data.arrays.path", "data.shards.path"}
    | {"data.shards.cache_dir"}
)
"""String fields that become file or folder paths (name: runs go to runs/<name>/):
checked against what every Linux file system refuses, so `config check` says what `train` would."""
BUCKET_PATHS = frozenset({"ckpt.dir", "ckpt.resume", "ckpt.init_weights", "data.shards.path"})
"""The PATHS that may also be an s3:// URL (storage.py); a URL in any other is refused."""

SAMPLES = {
    "optim.freeze": "optim.freeze='tok.*,blocks.0.*'",
    "optim.lora_targets": "optim.lora_targets='blocks.*.attn.qkv'",
    "optim.lora_also_train": "optim.lora_also_train='fc3.*'",
    "ckpt.init_exclude": "ckpt.init_exclude='fc.*'",
    "ckpt.init_rename": "ckpt.init_rename='{^encoder\\.: backbone.}'",
    "optim.groups": "optim.groups.head='{params: [fc.*], lr_mult: 10}'",
    "optim.kwargs": "optim.kwargs.scale=0.5",
    "model.kwargs": "model.kwargs.depth=2",
    "data.kwargs": "data.kwargs.min_length=3",
    "task.kwargs": "task.kwargs.smoothing=0.1",
    "log.mlflow.tags": "log.mlflow.tags.team=vision",
    "log.wandb.tags": "log.wandb.tags.team=vision",
}
"""key=value to show in an error for the keys whose default shows nothing to copy (an empty
string or mapping): a value each takes, as typed in a shell."""

NAME_MAX = 255
"""Bytes in one file or folder name (ext4, xfs, overlayfs, NFS)."""
PATH_MAX = 4095
"""Bytes in a whole path, less its terminating NUL."""


def path_problem(value: str) -> str | None:
    """Why `value` cannot be a path on Linux, or None: a NUL byte, a name over NAME_MAX bytes,
    or a path over PATH_MAX bytes."""
    raw = value.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        return "holds a NUL byte, which no path can: remove it"
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        return (
            f"has a name of {len(longest):,} bytes ({_shown(longest)}); a file or folder name "
            f"holds at most {NAME_MAX}: shorten it"
        )
    if len(raw) > PATH_MAX:
        return f"is {len(raw):,} bytes long; a path holds at most {PATH_MAX}: shorten it"
    return None


def _shown(raw: bytes) -> str:
    text = raw.decode("utf-8", "backslashreplace")
    return f"'{text[:20]}...'" if len(text) > 20 else f"'{text}'"
