"""Ranks in memory cgroups of their own (cgroup v1's memory controller, root): each rank of a
job started with torchrun's variables (as tests/helpers.py's `ranks` does) joins a child cgroup
of /sys/fs/cgroup/memory before it execs, with a limit or none; afterwards, each rank's peak
charged memory (memory.max_usage_in_bytes) and whether the OOM killer ended it. The cgroups
are removed again. No swap here, so a rank over its limit is killed, never swapped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT, env, free_port

MEMORY = Path("/sys/fs/cgroup/memory")


def available() -> str | None:
    """Why the cgroups cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "memory cgroups need root"
    if not (MEMORY / "cgroup.procs").exists():
        return "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    return None


@dataclass
class Rank:
    code: int
    peak: int
    """Bytes: the most its cgroup was ever charged (memory.max_usage_in_bytes)."""
    oom_killed: bool
    stdout: str
    stderr: str


def _join(path: Path) -> None:
    """In the child, before exec: into its cgroup."""
    (path / "cgroup.procs").write_text(str(os.getpid()))


@contextlib.contextmanager
def cgroups(n: int, limit: int | None):
    """n fresh memory cgroups (limit in bytes, or none), removed afterwards."""
    made = []
    try:
        for _ in range(n):
            path = MEMORY / f"trainer-test-{uuid.uuid4().hex[:8]}"
            path.mkdir()
            made.append(path)
            if limit is not None:
                (path / "memory.limit_in_bytes").write_text(str(limit))
        yield made
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()


def run(
    args: list[str], nproc: int, limit: int | None, timeout: float = 600, argv0=None
) -> list[Rank]:
    """`python -m trainer ARGS` (or `argv0 ARGS`) on nproc ranks (torchrun's variables set here,
    one thread each), each in a cgroup of its own with `limit`. Every rank runs to its end (no
    rank stops the others: a killed rank's peers fail on their own once it is gone)."""
    port = free_port()
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
    common |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [*(argv0 or [sys.executable, "-m", "trainer"]), *args]
    with cgroups(nproc, limit) as paths:
        procs = [
            subprocess.Popen(
                cmd,
                env=env(**common, RANK=str(r), LOCAL_RANK=str(r)),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=lambda p=path: _join(p),
            )
            for r, path in enumerate(paths)
        ]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        return [
            Rank(p.returncode, int((path / "memory.max_usage_in_bytes").read_text()),
                 _oom_killed(path), out, err)
            for p, path, (out, err) in zip(procs, paths, outs, strict=True)
        ]  # fmt: skip


def _oom_killed(path: Path) -> bool:
    """Whether the OOM killer ended a process of this cgroup (memory.oom_control's count)."""
    for line in (path / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value) > 0
    return False
