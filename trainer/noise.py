"""What torch's C++ side (c10d) prints around an answer the trainer already gives in one line.

While a rank joins the process group, c10d logs each retry of its TCP store client from C++,
straight to file descriptor 2: an IPv6 lookup warning per attempt when the host has no IPv6
address (most Kubernetes services), and for a peer that is not up yet or never comes, a retry
warning carrying the C++ exception's 50-frame backtrace. A rank that cannot reach MASTER_ADDR
printed ~50 such lines before the one line that says what to do; a rank that reaches it after a
few retries printed them before training. Python cannot catch C++'s writes, so `quiet_c10d`
routes fd 2 through a pipe for the rendezvous and drops exactly the lines `C10dNoise` knows;
everything else passes through, in order, as it comes. trainer-launch's stderr filter drops the
same lines from torchrun's own rendezvous.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

_C10D = re.compile(
    rb"^\[[WE]\d{4} [\d:.]+ (?:socket|TCPStore)\.cpp:\d+\] \[c10d\] (?:"
    rb"The IPv6 network addresses of \(.*\) cannot be retrieved"
    rb"|The client socket has (?:timed out after|failed to connect to)"
    rb"|TCP client failed to connect/validate to host"
    rb"|The hostname of the client socket cannot be retrieved"
    rb")"
)
"""c10d's TCP store client retrying: the lines known to say nothing the final error does not."""
_BACKTRACE = re.compile(rb"^Exception raised from \S+ at \S+ \(most recent call first\):")
_FRAME = re.compile(rb"^(?:frame #\d+: |<omitting python frames>)")


class CppLogLines:
    """Line by line: is this line one that `header` matches, or the C++ backtrace right after
    such a line (its continuation), through the blank line that ends it? A backtrace anywhere
    else is not."""

    def __init__(self, header: re.Pattern) -> None:
        self.header = header
        self._after_header = False
        self._in_frames = False

    def known(self, raw: bytes) -> bool:
        if self._in_frames:
            if _FRAME.match(raw):
                return True
            self._in_frames = False
            if not raw.strip():
                return True  # the blank line that closes the backtrace
        if self.header.match(raw):
            self._after_header = True
            return True
        if self._after_header and _BACKTRACE.match(raw):
            self._in_frames = True
            return True
        self._after_header = False
        return False


class C10dNoise(CppLogLines):
    """Line by line: is this line c10d's rendezvous retry noise (with its C++ backtrace)?"""

    def __init__(self) -> None:
        super().__init__(_C10D)


@contextlib.contextmanager
def quiet_c10d():
    """For the block, everything written to fd 2 (C++ and Python alike) passes through a
    thread that drops C10dNoise's lines and writes the rest to the real stderr as it comes."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable fd 2 (a closed or odd stderr)
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end, real), daemon=True)
    pump.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the pump reads to the end, stops
        pump.join(timeout=10)
        os.close(real)


def _pump(read_end: int, real: int) -> None:
    noise = C10dNoise()
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not noise.known(line + b"\n"):
                    _write_all(real, line + b"\n")
        if pending and not noise.known(pending):
            _write_all(real, pending)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
