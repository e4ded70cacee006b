"""Plug-in datasets for trainer-launch's tests: the tiny dataset, and ones that fail on purpose."""

from __future__ import annotations

import os

from tests.helpers import tiny
from trainer.errors import RetryableError, UsageError

__all__ = ["fail_first_attempt", "fail_retryable", "fail_usage", "tiny"]


def fail_usage(cfg, seed):
    """Every rank: a bad-input error (exit 2), as a missing dataset folder would be."""
    raise UsageError("dataset fails on purpose (usage)")


def fail_retryable(cfg, seed):
    """Every rank: a transient failure (exit 4), as a flaky file system would be."""
    raise RetryableError("dataset fails on purpose (retryable)")


def fail_first_attempt(cfg, seed):
    """Rank 1 fails in torchrun's first attempt only; a restart then trains normally."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
        raise RetryableError("rank 1 fails on purpose (attempt 0)")
    return tiny(cfg, seed)
