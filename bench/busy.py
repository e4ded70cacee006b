"""Background loads for the busy suite: one process of someone else's, competing for the CPU while
a row runs (`python bench/bench.py --suite busy`).

    spin     one process spinning all the time: a core's worth of another job
    bursty   one process that spins 5 ms and sleeps 5 ms by turns: half a core that comes and goes,
             as a loader worker's or another job's data pipeline does

The trainer's background threads and its collectives are what such a load finds: a thread that
wakes to look at a clock must take the GIL from the training loop, and on a contended core it may
hold it while it waits for the CPU; a collective read right after it was posted waits for the other
rank's thread to be scheduled. The bare loop has neither.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

SPIN = "while True:\n    pass\n"
BURSTY = (
    "import time\n"
    "while True:\n"
    "    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < 0.005:\n"
    "        pass\n"
    "    time.sleep(0.005)\n"
)
LOADS = {"spin": SPIN, "bursty": BURSTY}


@contextlib.contextmanager
def running(kind: str | None):
    """The load `kind` (a key of LOADS; None: nothing) runs for the body's duration."""
    if kind is None:
        yield None
        return
    if kind not in LOADS:
        raise ValueError(f"unknown background load {kind!r}: one of {sorted(LOADS)}")
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADS[kind]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
