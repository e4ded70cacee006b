"""When a job hangs or crawls: which rank, where, and why.

    stall.py        the stall watchdog: per-rank stack files in RUN_DIR/diagnostics/ (faulthandler
                    for a rank stuck in C), where a thread is, the one line naming who stalled
                    where, exit 4; reading the files back for `trainer diagnose`
    collectives.py  the last collective this rank entered (trainer/ranks.py counts them)
    nccl.py         NCCL's flight recorder settings, dumping into RUN_DIR/diagnostics/nccl/
    stragglers.py   straggler accounting: per-rank forward time and data wait, the slow rank named

The names other modules use are re-exported here (`from trainer.diagnostics import Watchdog`).
Only the standard library is imported (numpy and torch when used). A test that replaces a name
patches the module that uses it (trainer.diagnostics.stall.GATHER_S), not this package.
"""

from trainer.diagnostics.collectives import Collectives
from trainer.diagnostics.nccl import flight_recorder_env
from trainer.diagnostics.stall import (
    Frame,
    Watchdog,
    Where,
    activity,
    describe,
    diagnose,
    frames_of,
    from_faulthandler,
    is_waiting,
    newest,
    read_rank_files,
    stall_bound,
    summarize,
)
from trainer.diagnostics.stragglers import ForwardTimer, Straggler, Stragglers, straggler_line

__all__ = [
    "Collectives",
    "ForwardTimer",
    "Frame",
    "Straggler",
    "Stragglers",
    "Watchdog",
    "Where",
    "activity",
    "describe",
    "diagnose",
    "flight_recorder_env",
    "frames_of",
    "from_faulthandler",
    "is_waiting",
    "newest",
    "read_rank_files",
    "stall_bound",
    "straggler_line",
    "summarize",
]
