"""SIGTERM/SIGINT: stop at the next step boundary, on every rank together, after a checkpoint.

Kubernetes (terminationGracePeriodSeconds) and torchrun (--shutdown-timeout) send SIGTERM and
wait before SIGKILL; that window is what the final checkpoint has to fit in. A second signal
exits at once. Signals arriving within `debounce_s` of the first count as the same request:
Ctrl-C reaches each worker twice, from the terminal and forwarded by torchrun.
"""

from __future__ import annotations

import os
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager that turns the first SIGTERM/SIGINT into a stop request."""

    def __init__(self, debounce_s: float = 1.0):
        self.debounce_s = debounce_s
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
        elif now - self._first_at > self.debounce_s:
            # A deliberate second signal: die at once, by the signal, as the user asked.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"

    def agreed(self, group=None) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
