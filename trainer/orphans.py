"""Ranks die with their launcher.

torchrun starts each rank in a session of its own, so a SIGKILL to torchrun's process group (a
killed srun step, a lost login shell, `kill -9 -- -PGID`) leaves the ranks training on: writing
checkpoints, metrics and final/ into the folder a rerun is about to use. A rank that torchrun
started (TORCHELASTIC_RUN_ID in its environment) watches its parent, the torchrun agent: when the
agent is gone (the parent pid changes), the rank says so in one line and ends at once with
SIGKILL, as its launcher did. Nothing it wrote is half-done: a checkpoint lands by one rename or
not at all (the next job removes a write that never finished), metrics.jsonl is flushed a line
at a time. trainer-launch does its part itself: torchrun dies with it (PR_SET_PDEATHSIG).

Watched from a thread of its own, not the parent-death signal: that fires when the *thread* that
started the process ends, and torchrun gives no promise about which of its threads that is. The
thread sleeps in poll() on a pidfd of the parent (Linux 5.3+), which wakes it only when the parent
exits; where pidfds are missing it looks every POLL_S. (A thread that woke twice a second took the
GIL from the training loop each time: on a busy CPU that cost steps, docs/benchmarks.md.)
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Mapping

POLL_S = 0.5
"""Without a pidfd: how often a rank looks at its parent, the bound on how long it outlives its
launcher."""


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
        parent: int | None = None,
    ) -> None:
        self.parent = os.getppid() if parent is None else parent
        """The launcher's pid (tests name another process)."""
        self._named = parent is not None
        self.active = watched(environ)
        self.rank = environ.get("RANK", "0")
        self.on_gone = on_gone
        self.end = end or (lambda: os.kill(os.getpid(), signal.SIGKILL))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        """A pipe whose write end close() writes to: the pidfd's poll() returns."""

    def start(self) -> LauncherWatch:
        if self.active:
            self._wake = os.pipe()
            self._thread = threading.Thread(
                target=self._watch, name="trainer-launcher", daemon=True
            )
            self._thread.start()
        return self

    def _watch(self) -> None:
        pidfd = _pidfd(self.parent)
        if pidfd is None:
            self._poll_parent()
            return
        try:
            if pidfd < 0 or not self._alive():  # gone before the pidfd was opened
                self._gone()
                return
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.register(self._wake[0], select.POLLIN)
            while not self._stop.is_set():
                ready = {fd for fd, _ in poller.poll()}
                if pidfd in ready and not self._stop.is_set():
                    self._gone()
                    return
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    def _poll_parent(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self._alive():
                self._gone()
                return

    def _alive(self) -> bool:
        if self.parent == os.getppid():
            return True
        if self._named:  # another process than this one's parent: whether it still runs
            try:
                os.kill(self.parent, 0)
            except ProcessLookupError:
                return False
            return True
        return False

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
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._wake is not None and (self._thread is None or not self._thread.is_alive()):
            for fd in self._wake:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake = None


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (readable once it exits); -1: `pid` is gone already; None: this system
    has no pidfds (then the parent is polled)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except (AttributeError, OSError):
        return None
