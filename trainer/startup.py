"""The garbage collector during a process's startup: off while torch and the run are set up,
then one collection, the survivors frozen, and the collector back on for training.

Importing torch (and torch._dynamo, which every optimizer imports) makes ~300,000 objects; the
cyclic collector runs hundreds of times during that and scans the whole growing heap in each
full collection: 0.8 s of a 5 s import here, and ~1.6 s (25%) of a one-step `trainer train` on
2 cores (measured side by side, median of 6). None of those collections finds garbage worth
having. After setup, `gc.freeze()` moves what setup built (modules, the config, the model)
out of the collector's sight, so the full collections during training scan only what training
allocates, and forked data-loader workers do not touch (and so copy) those pages.

Only the process's own entry point (`trainer ...`, `python -m trainer ...`: cli.main() without
argv) does this; a library call (tests, a user's script) leaves the collector as it found it.
`train` settles just before the first step, `eval` and `export` once torch is imported, the
other commands (short) before they run. The setup time and the number of collections that ran during it are recorded in
run.json (`startup`).
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
    """Setup is done: collect its garbage once, freeze the survivors, collector back on. A no-op
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
    """{"seconds": from the command's start to the end of setup, "gc_collections": automatic
    collections during it (0: the collector was off)}, or None for a library call."""
    return _report
