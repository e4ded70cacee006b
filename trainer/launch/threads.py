"""CPU threads per rank: the CPUs this container may use, shared by the ranks of this node.

torch sizes its intra-op thread pool from the CPUs it may be scheduled on, not from a container's
CPU quota, and torchrun sets OMP_NUM_THREADS=1 only when it starts more than one process. So two
one-process containers on a 2-core host ran 2 threads each, and spent their time preempting each
other at every gloo collective (compose's two-node profile: 226 samples/s; 3,352 with one thread
each). trainer-launch gives each rank floor(CPUs / local ranks) threads, at least 1, where CPUs is
the smaller of the affinity mask and the cgroup quota (v2 cpu.max, v1 cpu.cfs_quota_us), and
leaves an OMP_NUM_THREADS the user set alone (once it is checked to be a number >= 1: a bad one
is a one-line usage error here, not a warning from every rank's OpenMP runtime).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from trainer.envvars import env_int


def threads_per_rank(env: Mapping[str, str], cpus: int, local_ranks: int) -> int | None:
    """OMP_NUM_THREADS for each of `local_ranks` processes sharing `cpus`; None if already set."""
    if user_threads(env) is not None:
        return None
    return max(1, cpus // max(1, local_ranks))


def user_threads(env: Mapping[str, str]) -> int | None:
    """The OMP_NUM_THREADS the user set (None: unset or empty); not a number >= 1: UsageError."""
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    return env_int(
        "OMP_NUM_THREADS", raw, lo=1, what="threads per process (unset: CPUs / local ranks)"
    )


def available_cpus(
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_cgroup: str | Path = "/proc/self/cgroup",
    affinity: int | None = None,
) -> int:
    """CPUs this process may use: its affinity mask, lowered by a cgroup CPU quota (at least 1)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        affinity = affinity or os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        affinity = min(affinity, math.floor(quota))
    return max(1, affinity)


def cgroup_cpu_quota(
    cgroup_root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup"
) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors; None if none.

    A container usually sees its own cgroup at the mount's root (cgroup namespace, or Docker's
    bind mount on v1) while /proc/self/cgroup may still name the host's path: both are read.
    """
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = ["0::/"]
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: 0::/path
            quotas += [q for d in _up(root, path) if (q := _v2_quota(d / "cpu.max"))]
        elif "cpu" in controllers.split(","):  # cgroup v1: N:cpu,cpuacct:/path
            mount = next(
                (root / m for m in (controllers, "cpu", "cpu,cpuacct") if (root / m).is_dir()), None
            )
            if mount is not None:
                quotas += [q for d in _up(mount, path) if (q := _v1_quota(d))]
    return min(quotas) if quotas else None


def _up(mount: Path, path: str) -> list[Path]:
    """mount/path and each of its parents up to the mount itself."""
    parts = [p for p in path.strip().strip("/").split("/") if p and p != ".."]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(cpu_max: Path) -> float | None:
    """cpu.max is 'QUOTA PERIOD' in microseconds, or 'max PERIOD' for no limit."""
    fields = (_read(cpu_max) or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(folder: Path) -> float | None:
    """cpu.cfs_quota_us (-1: no limit) over cpu.cfs_period_us."""
    try:
        quota = int(_read(folder / "cpu.cfs_quota_us") or "-1")
        period = int(_read(folder / "cpu.cfs_period_us") or "0")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None
