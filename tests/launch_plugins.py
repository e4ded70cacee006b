"""Plug-ins for trainer-launch's tests: the tiny dataset, ones that fail on purpose, a paced model."""

from __future__ import annotations

import os
import time

from tests.helpers import slow_mlp, tiny
from trainer.errors import RetryableError, UsageError

__all__ = [
    "fail_first_attempt", "fail_on_node_0", "fail_retryable", "fail_usage", "paced_mlp", "tiny",
]  # fmt: skip


def fail_usage(cfg, seed):
    """Every rank: a bad-input error (exit 2), as a missing dataset folder would be."""
    raise UsageError("dataset fails on purpose (usage)")


def fail_retryable(cfg, seed):
    """Every rank: a transient failure (exit 4), as a flaky file system would be."""
    raise RetryableError("dataset fails on purpose (retryable)")


def fail_on_node_0(cfg, seed):
    """Node 0 (NODE_RANK, the rendezvous host): bad input (exit 2) at once; the other nodes'
    ranks are still preparing their data (8 s), outside any collective, when node 0 and the
    rendezvous it hosts are gone."""
    if os.environ.get("NODE_RANK") == "0":
        raise UsageError("dataset fails on purpose (node 0)")
    time.sleep(8)
    return tiny(cfg, seed)


def fail_first_attempt(cfg, seed):
    """Rank 1 fails in torchrun's first attempt only; a restart then trains normally."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
        raise RetryableError("rank 1 fails on purpose (attempt 0)")
    return tiny(cfg, seed)


def paced_mlp(in_shape, num_classes, hidden=(32,), dropout=0.0):
    """slow_mlp with its sleep from $TEST_STEP_DELAY (seconds, default 0), not from the config:
    a run paced for a test resumes unpaced with the same config (tests/test_elastic.py)."""
    delay = float(os.environ.get("TEST_STEP_DELAY", "0"))
    return slow_mlp(in_shape, num_classes, hidden=hidden, dropout=dropout, delay=delay)
