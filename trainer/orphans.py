"""Ranks die with their launcher.

torchrun starts each rank in a session of its own, so a SIGKILL to torchrun's process group (a
killed srun step, a lost login shell, `kill -9 -- -PGID`) leaves the ranks training on: writing
checkpoints, metrics and final/ into the folder a rerun is about to use. A rank that torchrun
started (TORCHELASTIC_RUN_ID in its environment) watches its parent, the torchrun agent: when the
agent is gone (the parent pid changes), the rank says so in one line and ends at once with
SIGKILL, as its launcher did. Nothing it wrote is half-done: a checkpoint lands by one rename or
not at all (the next job removes a write that never finished), metrics.jsonl is flushed a line
at a time. trainer-launch does its part itself: torchrun dies with it (PR_SET_PDEATHSIG).

Polled from a thread of its own, not the parent-death signal: that fires when the *thread* that
started the process ends, and torchrun gives no promise about which of its threads that is.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping

POLL_S = 0.5
"""How often a rank looks at its parent: the bound on how long it outlives its launcher."""


def watched(environ: Mapping[str, str]) -> bool:
    """Whether this process is a rank that torchrun started (its parent is the agent)."""
    return bool(environ.get("TORCHELASTIC_RUN_ID"))


class LauncherWatch:
    """Ends this rank when the process that launched it is gone. `on_gone` runs first (rank 0
    gives up the run folder's lock there); `end` is how the process ends (SIGKILL to itself)."""

    def __init__(
        self,
        environ: Mapping[str, str] = os.environ,
        on_gone: Callable[[], None] | None = None,
        end: Callable[[], None] | None = None,
    ) -> None:
        self.parent = os.getppid()
        self.active = watched(environ)
        self.rank = environ.get("RANK", "0")
        self.on_gone = on_gone
        self.end = end or (lambda: os.kill(os.getpid(), signal.SIGKILL))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LauncherWatch:
        if self.active:
            self._thread = threading.Thread(
                target=self._watch, name="trainer-launcher", daemon=True
            )
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if os.getppid() != self.parent:
                self._gone()
                return

    def _gone(self) -> None:
        print(
            f"trainer: rank {self.rank}: its launcher (torchrun, pid {self.parent}) is gone: "
            "stopping now; rerunning the same command resumes from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        try:
            if self.on_gone is not None:
                self.on_gone()
        finally:
            self.end()

    def __enter__(self) -> LauncherWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
