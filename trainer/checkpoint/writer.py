"""The background writer: one checkpoint write in flight, on a thread of rank 0's own.

Rank 0 hands it a job (write the files, checksum, manifest, rename; under fsdp, after every
rank's shards have landed); the checkpointer asks at the next save, stop or end how it went and
tells every rank. The other ranks of a sharded save only keep their own shards' write here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

Outcome = tuple[float, str | None, bool]
"""(seconds the write took, what went wrong or None, whether retrying is moot)."""


class BackgroundWriter:
    """At most one checkpoint write in flight. `step` is the step of that write, None when none
    is (every rank knows it); rank 0 runs the job, the others may hold their shards' write."""

    def __init__(self) -> None:
        self.step: int | None = None
        self._future: Future | None = None
        self._shards: Future | None = None
        self._executor: ThreadPoolExecutor | None = None

    def start(self, job: Callable[[], Outcome] | None, shards: Future | None = None) -> None:
        """Rank 0: run `job` (it returns an Outcome, never raises) on the thread. Another rank of
        a sharded save: keep its own shards' write. The caller sets `step` on every rank."""
        self._shards = shards
        if job is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._future = self._executor.submit(job)

    def finish(self) -> tuple[int | None, Outcome | None, float]:
        """(the step in flight or None, rank 0's outcome (None elsewhere), seconds waited): the
        write in flight has landed, and nothing is in flight any more."""
        step, self.step = self.step, None
        self.own_shards_written()
        if self._future is None:
            return step, None, 0.0
        started = time.perf_counter()
        outcome = self._future.result()
        self._future = None
        return step, outcome, time.perf_counter() - started

    def own_shards_written(self) -> None:
        """A rank other than 0 waits for its shards' background write: one DCP write in flight
        per rank. How it went is rank 0's to say (DCP gathers every rank's result there)."""
        shards, self._shards = self._shards, None
        if shards is not None:
            with contextlib.suppress(Exception):
                shards.result()

    def close(self) -> None:
        """Let a write in flight finish (this rank alone: no collective) and stop the thread."""
        self.own_shards_written()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def timed(job: Callable[[], None], failure: Callable[[BaseException], tuple[str, bool]]):
    """`job` as a writer job: its Outcome, with `failure` saying what a raised error means."""

    def run() -> Outcome:
        started = time.perf_counter()
        try:
            job()
            return time.perf_counter() - started, None, False
        except Exception as e:
            return time.perf_counter() - started, *failure(e)

    return run
