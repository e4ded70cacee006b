"""c10d's rendezvous retry noise: known line by line, dropped from fd 2 while a rank joins."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, env
from trainer.noise import C10dNoise

FRAMES = [
    b"Exception raised from throwTimeoutError at /__w/pytorch/pytorch/torch/csrc/distributed/"
    b"c10d/socket.cpp:1030 (most recent call first):\n",
    b"frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char>) + 0x9d "
    b"(0x7fdcb095e60d in /venv/lib/python3.11/site-packages/torch/lib/libc10.so)\n",
    b"<omitting python frames>\n",
    b"frame #48: _start + 0x21 (0x55d590762081 in /venv/bin/python)\n",
    b"\n",
]
"""The backtrace c10d appends to a retry warning (50 frames in the real thing)."""

NOISE = [
    b"[W1125 07:05:53.980069663 socket.cpp:764] [c10d] The IPv6 network addresses of "
    b"(no-such-host.invalid, 29555) cannot be retrieved (gai error: -2 - Name or service not "
    b"known).\n",
    b"[E1125 07:06:00.614703365 socket.cpp:1028] [c10d] The client socket has timed out after "
    b"10000ms while trying to connect to (no-such-host.invalid, 29555).\n",
    b"[W1125 07:06:00.623018884 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate "
    b"to host no-such-host.invalid:29555 - retrying (try=0, timeout=10000ms, delay=8108ms): The "
    b"client socket has timed out after 10000ms while trying to connect to "
    b"(no-such-host.invalid, 29555).\n",
    *FRAMES,
    b"[E1125 07:07:40.363437661 TCPStore.cpp:328] [c10d] TCP client failed to connect/validate "
    b"to host 127.0.0.1:29555 - timed out (try=1, timeout=5000ms): The client socket has timed "
    b"out after 5000ms while trying to connect to (127.0.0.1, 29555).\n",
    *FRAMES,
    b"[W1125 09:03:34.576187693 socket.cpp:207] [c10d] The hostname of the client socket cannot "
    b"be retrieved. err=-3\n",  # a container without reverse DNS (test-image's compose run)
]
"""Lines captured from a rank that could not reach MASTER_ADDR (torch 2.14.1)."""

KEPT = [
    b"[W1125 07:06:00.1 ProcessGroupGloo.cpp:12] [c10d] something we have not seen before\n",
    b"epoch 1 step 3 loss 0.5\n",
    *FRAMES,  # a backtrace that does not follow a known line: kept
    b"trainer: error: [rank 1] could not form the process group at h:1 ...\n",
]


def test_only_the_known_lines_and_their_backtraces_are_noise():
    noise = C10dNoise()
    mixed = [NOISE[0], KEPT[0], *NOISE[1:], KEPT[1], *KEPT[2:]]
    kept = [line for line in mixed if not noise.known(line)]
    assert kept == KEPT


SCRIPT = """
import os, sys
from trainer.noise import quiet_c10d
noise, kept = eval(sys.argv[1]), eval(sys.argv[2])
with quiet_c10d():
    os.write(2, noise[0])          # as C++ writes: straight to fd 2
    print("from python", file=sys.stderr, flush=True)
    os.write(2, b"".join(noise[1:]))
    os.write(2, kept[1])
os.write(2, noise[0])              # after the block: passes untouched
print("done", file=sys.stderr)
"""


def test_quiet_c10d_drops_the_noise_written_to_fd_2_and_passes_the_rest_in_order():
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, repr(NOISE), repr(KEPT)],
        capture_output=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr.decode().splitlines() == [
        "from python",
        KEPT[1].decode().strip(),
        NOISE[0].decode().strip(),
        "done",
    ]
