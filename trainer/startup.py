"""The garbage collector while a process imports: off until torch, torch._dynamo and the trainer
are imported, then one collection, the survivors frozen, and the collector back on.

Importing torch and torch._dynamo (which every optimizer imports) makes ~300,000 objects; the
cyclic collector runs ~750 times during that and scans the whole growing heap in each full
collection: 0.85 s of a 5.2 s import here. None of those collections finds garbage worth having.
`gc.freeze()` then moves the imported modules out of the collector's sight, so the full
collections during training scan only what the run allocates, and forked data-loader workers
do not touch (and so copy) those pages.

Only the process's own entry point (`trainer ...`, `python -m trainer ...`: cli.entry) does
this, and only while it imports: `train` settles once its imports are done (before the
rendezvous, the data and the model), `eval` and `export` likewise, the other commands (short)
before they run. cli.main, which tests and scripts call, leaves the collector as it found it.
The seconds until the collector came back on and the number of collections that ran before
are recorded in run.json (`startup`).
"""

from __future__ import annotations

import gc
import time

_began: float | None = None
_collections = 0
_report: dict | None = None


def _total_collections() -> int:
    return sum(s["collections"] for s in gc.get_stats())


def begin() -> None:
    """The process's entry point starts: the collector off until settle() (if it was on)."""
    global _began, _collections, _report
    _report = None
    if not gc.isenabled():  # someone else manages it: leave it alone
        return
    _began, _collections = time.perf_counter(), _total_collections()
    gc.disable()


def settle() -> None:
    """The imports are done: collect once, freeze the survivors, collector back on. A no-op
    unless begin() turned the collector off."""
    global _began, _report
    if _began is None:
        return
    _report = {
        "seconds": round(time.perf_counter() - _began, 3),
        "gc_collections": _total_collections() - _collections,
    }
    _began = None
    gc.collect()
    gc.freeze()
    gc.enable()


def end() -> None:
    """The entry point returns: the collector back on if setup never finished (no freeze)."""
    global _began, _report
    _report = None
    if _began is not None:
        _began = None
        gc.enable()


def report() -> dict | None:
    """{"seconds": from the command's start to the end of its imports, "gc_collections":
    automatic collections during them (0: the collector was off)}, or None for a library call."""
    return _report
