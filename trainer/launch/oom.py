"""Whether the out-of-memory killer ended a rank of this node: the memory cgroup the launcher and its
ranks share (a container's, a Slurm step's) counts its OOM kills (cgroup v2 memory.events, v1
memory.oom_control); the count before torchrun starts against the count after it fails. Then the
node's output ends with one line naming the rank, the limit and what to do, instead of torchrun's
bare `exitcode: -9` (Kubernetes' "OOMKilled", in the trainer's words).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from trainer.launch.threads import _read, _up


@dataclass(frozen=True)
class Memory:
    """This process's memory cgroup: its OOM kills so far and the tightest limit (bytes)."""

    kills: int
    limit: int | None


def memory(
    cgroup_root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup"
) -> Memory | None:
    """The OOM kills and limit of this process's memory cgroup and its ancestors (None where no
    memory controller is to be seen). As threads.cgroup_cpu_quota, both the mount's root (a
    container's view) and /proc/self/cgroup's path are read."""
    root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = ["0::/"]
    kills, limits, seen = 0, [], False
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2
            folders, events, limit_file = _up(root, path), "memory.events", "memory.max"
        elif "memory" in controllers.split(","):  # v1
            folders, events, limit_file = (
                _up(root / "memory", path),
                "memory.oom_control",
                ("memory.limit_in_bytes"),
            )
        else:
            continue
        for folder in dict.fromkeys(folders):
            counted = _count(_read(folder / events))
            if counted is None:
                continue
            seen = True
            kills = max(kills, counted)  # a parent's count includes its children's
            if (value := _read(folder / limit_file)) and value.isdigit() and int(value) < 1 << 60:
                limits.append(int(value))
    return Memory(kills, min(limits) if limits else None) if seen else None


def _count(text: str | None) -> int | None:
    """The `oom_kill N` count of memory.events or memory.oom_control."""
    found = re.search(r"^oom_kill (\d+)$", text or "", re.M)
    return int(found[1]) if found else None


KILLED = re.compile(rb"exitcode\s*:\s*-9\b")
RANK = re.compile(rb"\brank\s*:\s*(\d+)")


def killed_rank(lines: list[bytes]) -> int | None:
    """The global rank torchrun's failure report says ended with SIGKILL (exitcode: -9)."""
    rank = None
    for raw in lines:
        if found := RANK.search(raw):
            rank = int(found[1])
        if KILLED.search(raw) and rank is not None:
            return rank
    return None


def line(before: Memory | None, after: Memory | None, rank: int | None, nproc: str) -> str | None:
    """The node's one line when its cgroup's OOM killer ended a rank, else None."""
    if before is None or after is None or after.kills <= before.kills:
        return None
    who = f"rank {rank}" if rank is not None else "a rank"
    limit = f"{after.limit / 2**30:.1f} GiB" if after.limit else "its limit"
    return (
        f"trainer: error: {who} was killed by the out-of-memory killer (this node's memory "
        f"limit: {limit} for {nproc} rank(s)): `trainer plan --world-size N` (your config and "
        "overrides) gives each rank's memory before launch; spread the model (dist.strategy="
        "fsdp, dist.mesh pp/tp), set train.activation_checkpointing=true or a smaller "
        "train.micro_batch_size, or raise the limit"
    )
