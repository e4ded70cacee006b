"""Off the training thread: a bounded queue of records and one thread that hands them to a
tracking sink (MLflow, W&B), retrying while the sink is down. Nothing here raises into training.

The training thread only calls `put` (a non-blocking queue put, once per log window or
evaluation) and, at the end, `close` (which waits at most `flush_s` for what is queued). A sink
that is down at the start, goes away mid-run or answers slowly costs the training thread
nothing: the records wait in the queue and are sent when it answers again. What could not be
sent by the end is said in one warning line (it stays in metrics.jsonl).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable

from trainer import jsonfile

BATCH = 200
"""Records handed to a sink in one call (a log-batch request)."""
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
"""Waits between tries while a sink is down (the last one repeats)."""


class Sink:
    """What a tracking service does with a run: connect (create or continue the tracked run),
    send records in order, and finish (artifacts as (name, path) pairs, the run's end state). Each may raise any
    Exception: the sender retries `connect` and `send`, and reports what failed."""

    name = "tracking"
    where = ""
    """Where it sends to, safe to print (no credentials)."""

    def connect(self) -> None:
        raise NotImplementedError

    def send(self, records: list[dict]) -> None:
        raise NotImplementedError

    def finish(self, status: str, files: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The files, then the end state; returns the files it refused: (name, why)."""
        raise NotImplementedError


class Sender:
    """One sink's thread and bounded queue."""

    def __init__(self, sink: Sink, *, size: int, warn: Callable[[str], None]):
        self.sink = sink
        self.warn = warn
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._dropped: list[int] = []  # steps of records the full queue refused
        self._pending: list[dict] = []
        self._end: tuple[str, list] | None = None
        self._closing = threading.Event()
        self._connected = False
        self._finished = False
        self._abandoned = False
        self.refused: list[tuple[str, str]] = []
        """Files the sink would not take at the end: (name, why)."""
        self.error: str | None = None
        """The last error from the sink (its first line), None after a success."""
        self._thread = threading.Thread(target=self._run, name=f"{sink.name}-sender", daemon=True)

    def start(self) -> Sender:
        self._thread.start()
        return self

    def put(self, record: dict) -> None:
        """Queue a record; never blocks (a full queue drops it and says so at the end)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped.append(record.get("step", 0))

    def close(self, status: str, files: list[tuple[str, str]], flush_s: float) -> bool:
        """Send what is queued, then the files and the end state, waiting at most flush_s
        seconds; one warning line for what was not sent. True: everything was sent."""
        self._end = (status, files)
        self._closing.set()
        self._thread.join(flush_s)
        self._abandoned = True  # a sink still down: the thread stops at its next try
        unsent = self._unsent_steps()
        if self._finished and not unsent:
            if self.refused:
                self.warn(
                    f"warning: {self.sink.name} at {self.sink.where} refused {_grouped(self.refused)}"
                )
            return not self.refused
        self.warn(self._warning(unsent, flush_s))
        return False

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        tries = 0
        while not (self._finished or self._abandoned):
            self._take()
            try:
                self._step()
                tries, self.error = 0, None
            except Exception as e:  # any failure of the sink: wait, then try again
                self.error = _first_line(e)
                if getattr(e, "permanent", False):  # refused: trying again cannot help
                    self._refused(e)
                    continue
                time.sleep(BACKOFF_S[min(tries, len(BACKOFF_S) - 1)])
                tries += 1

    def _take(self) -> None:
        """Move queued records to the pending list; wait a little for one if there is none."""
        if not self._pending and not self._closing.is_set():
            try:
                self._pending.append(self._queue.get(timeout=0.2))
            except queue.Empty:
                return
        while len(self._pending) < BATCH:
            try:
                self._pending.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _step(self) -> None:
        if not self._connected:
            self.sink.connect()
            self._connected = True
        if self._pending:
            batch = self._pending[:BATCH]
            self.sink.send(batch)
            del self._pending[: len(batch)]
        elif self._closing.is_set() and self._queue.empty() and self._end is not None:
            status, files = self._end
            self.refused = self.sink.finish(status, files() if callable(files) else files)
            self._finished = True

    def _refused(self, e: Exception) -> None:
        """The sink refused a batch: drop it; or the run (connecting) or its end: give up."""
        if not (self._connected and self._pending):
            self._abandoned = True
        else:
            self._dropped.extend(r.get("step", 0) for r in self._pending[:BATCH])
            del self._pending[:BATCH]

    def _unsent_steps(self) -> list[int]:
        steps = [r.get("step", 0) for r in self._pending] + list(self._dropped)
        while True:
            try:
                steps.append(self._queue.get_nowait().get("step", 0))
            except queue.Empty:
                return steps

    def _warning(self, unsent: list[int], flush_s: float) -> str:
        what = "the run's end state and artifacts"
        if unsent:
            span = (
                f"steps {min(unsent)}-{max(unsent)}"
                if len(set(unsent)) > 1
                else f"step {unsent[0]}"
            )
            what = f"{len(unsent)} records ({span}) and {what}"
        why = f": {self.error}" if self.error else f" within {flush_s:g} s"
        if self._dropped:
            why += f" ({len(self._dropped)} refused or dropped by the full queue)"
        return (
            f"warning: {self.sink.name} at {self.sink.where}: {what} could not be sent{why}; "
            "metrics.jsonl holds every record (training was not affected)"
        )


def already_sent(sent: list | None, record: dict) -> bool:
    """Whether a record is at or before `sent` ([step, the kinds sent at that step]): what an
    earlier attempt of a resumed run sent (the resume recomputes those steps)."""
    if not sent or record.get("kind") not in ("train", "eval"):
        return False
    step, kinds = sent
    return record["step"] < step or (record["step"] == step and record["kind"] in kinds)


def sent_after(sent: list | None, records: list[dict]) -> list:
    """`sent` moved past `records` (in order): their last step and the kinds sent at it."""
    step = records[-1]["step"]
    kinds = [r["kind"] for r in records if r["step"] == step]
    if sent and sent[0] == step:  # the step's earlier records went in an earlier batch
        kinds = sorted({*sent[1], *kinds})
    return [step, sorted(set(kinds))]


NOT_METRICS = ("kind", "step", "epoch", "time")


def metrics_of(record: dict) -> dict[str, float]:
    """A record's metrics as metrics.jsonl names them (loss, lr, eval.accuracy, ...): finite
    numbers only (no flags, lists or NaN)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in NOT_METRICS
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def read_state(path: str) -> dict:
    """A sink's state file (its run id, what it has sent): {} where there is none yet."""
    state = jsonfile.read_json(path)
    return state if isinstance(state, dict) else {}


def write_state(path: str, state: dict) -> None:
    """A sink's state file, atomically (a reader, or a kill, never leaves half a file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    jsonfile.write_json(path, state)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:200]


def _grouped(refused: list[tuple[str, str]]) -> str:
    """'a, b and c (why)': each cause once, after the files it refused (a server whose
    artifacts are not proxied refuses every file for the same reason)."""
    by_why: dict[str, list[str]] = {}
    for name, why in refused:
        by_why.setdefault(why, []).append(name)
    parts = []
    for why, names in by_why.items():
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        parts.append(f"{listed} ({why if len(why) <= 300 else why[:297] + '...'})")
    return "; ".join(parts)
