"""SIGTERM/SIGINT: stop at a step boundary, on every rank together, after a checkpoint.

The ranks agree without a blocking collective per step (StopVote): the flag each rank posts at
a voting boundary (step k) is all-reduced in the background during step k+1 and read at its end.
Votes are posted every `every` steps, about every PERIOD_S seconds of training (the ranks agree on
the cadence at each log step): a signal that lands in step k stops every rank after step
k + every at the latest, within PERIOD_S plus one step. A blocking vote every step cost 14% of a
small DDP step here (py-spy), a background one every step still 20% (A/B, 2 ranks on 2 cores).

Kubernetes (terminationGracePeriodSeconds) and torchrun (--shutdown-timeout) send SIGTERM and
wait before SIGKILL; that window is what the final checkpoint has to fit in. A second signal
exits at once. Signals arriving within `debounce_s` of the first count as the same request:
Ctrl-C reaches each worker twice, from the terminal and forwarded by torchrun.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PERIOD_S = 0.2
"""Seconds of training between stop votes (StopVote.cadence)."""
MAX_EVERY = 1000
DATA_UNAVAILABLE = 1 << 10
"""The vote's code (above every signal number) for 'a rank's data cannot be read': the ranks stop
together after a checkpoint, with exit 4 (loop._stop_if_asked)."""
NEVER = 2**62
"""A vote's step for 'no signal seen' (StopSignal._flag)."""


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

    def request_data_stop(self, why: str) -> None:
        """Ask the ranks to stop (a checkpoint, then exit 4) because this rank's data cannot be
        read (a bucket's outage outlasted the retries of the shards it fetches ahead)."""
        if self.signum is None:
            self.signum, self.why = DATA_UNAVAILABLE, why

    why: str = ""
    """This rank's reason for a data stop (request_data_stop)."""

    @property
    def data_stop(self) -> bool:
        return (self.signum or self.agreed_signum) == DATA_UNAVAILABLE

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum == DATA_UNAVAILABLE:  # a signal as well: a signal's stop (exit 3)
            self.signum, self._first_at = signum, now
            return
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
        """The signal that stopped the run: this rank's, or the one the ranks agreed on."""
        signum = self.signum or self.agreed_signum
        if signum == DATA_UNAVAILABLE:
            return "data unavailable"
        return signal.Signals(signum).name if signum else "none"

    agreed_signum: int | None = None
    """Set when a vote says stop: the largest signal number any rank received."""
    noticed_step: int | None = None
    """The step boundary at which this rank first saw its signal (StopVote.poll), and after a
    vote says stop, the earliest such step over the ranks: the signal landed in that step."""

    def _flag(self, step: int | None = None):
        """This rank's vote at step boundary `step`: [signal number or 0, minus the step it
        noticed the signal at (or minus NEVER)]; a MAX over the ranks gives the largest signal
        and the earliest step. One read of the signal for both (it may land at any moment)."""
        import torch

        signum = self.signum or 0
        if signum and self.noticed_step is None and step is not None:
            self.noticed_step = step
        noticed = NEVER if self.noticed_step is None else self.noticed_step
        return torch.tensor([signum, -noticed], dtype=torch.int64)

    def agreed(self, group=None) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        flag = self._flag()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return self._outcome(flag)

    def _outcome(self, flag) -> bool:
        signum, minus_noticed = (int(v) for v in flag.tolist())
        if signum:
            self.agreed_signum = signum
            if -minus_noticed != NEVER:
                self.noticed_step = -minus_noticed
        return bool(signum)


class StopVote:
    """The ranks' stop agreement, one background all-reduce (MAX) in flight at a time.

    Every rank calls `poll(step)` at every step boundary with the same step and the same `every`;
    it returns the outcome of the vote posted at the previous boundary, if one was (the same on
    every rank, so all stop at the same step), and posts a vote once `every` steps have passed
    since the last one. (Not `step % every == 0`: with a cadence that changes at each log step,
    multiples of it can be skipped, and a run stopped 12 steps after its signal at a cadence of
    at most 10.)
    `finish()` waits for the vote in flight, so none is pending at teardown.
    """

    def __init__(self, stop: StopSignal, group):
        self.stop, self.group = stop, group
        self.every = 1
        """Steps between votes: 1 until the ranks agree on a cadence (set it on every rank at
        the same step boundary, before its poll)."""
        self._pending = None
        self._last = 0
        """The step boundary of the last vote posted (the same on every rank)."""

    @staticmethod
    def cadence(seconds_per_step: float) -> int:
        """The steps between votes this rank proposes: about PERIOD_S seconds' worth."""
        if not seconds_per_step > 0:
            return MAX_EVERY
        return max(1, min(MAX_EVERY, math.ceil(PERIOD_S / seconds_per_step)))

    def poll(self, step: int) -> bool:
        requested = self.stop.requested
        if requested and self.stop.noticed_step is None:
            self.stop.noticed_step = step
        if self.group is None:  # one process (ranks.stop_group() exists only for several)
            return requested
        import torch.distributed as dist

        agreed = self.finish()
        if not agreed and step - self._last >= self.every:
            self._last = step
            flag = self.stop._flag(step)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._pending = (work, flag)
        return agreed

    def finish(self) -> bool:
        """Wait for the vote in flight (if any); whether it said stop."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return self.stop._outcome(flag)
