"""Stragglers: which rank is slow, and whether at its forward pass or waiting for its data.

Every log window, each rank's forward time and data wait ride the window's loss all-reduce (2
numbers a rank). A rank slower than the others' median by a margin for several windows in a row is
named once: a console warning, a `straggler` record in metrics.jsonl; the per-rank table goes to
summary.json and `trainer report` draws it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SLOW_RATIO = 1.5
"""A rank's forward time this many times the others' median..."""
SLOW_SHARE = 0.2
"""...and slower by this share of the step (so a fast model's jitter is not a straggler)."""
SLOW_WINDOWS = 5
"""For this many log windows in a row (a process the OS set aside for a window is not one)."""


@dataclass
class Straggler:
    rank: int
    kind: str
    """compute | data"""
    mine_ms: float
    others_ms: float
    step_ms: float


@dataclass
class Stragglers:
    """Per-rank forward time and data wait per step, window by window; names a rank once it is
    slow for SLOW_WINDOWS windows in a row. Pure: the numbers come in, warnings go out."""

    world_size: int
    named: set = field(default_factory=set)
    steps: int = 0

    def __post_init__(self) -> None:
        import numpy as np

        w = self.world_size
        self.totals = {"compute": np.zeros(w), "data": np.zeros(w)}
        self.streak = {"compute": np.zeros(w, dtype=np.int64), "data": np.zeros(w, dtype=np.int64)}

    def window(self, compute: list[float], wait: list[float], steps: int, elapsed: float):
        """One window's per-rank seconds of forward and of data wait over `steps` steps that
        took `elapsed` s; the stragglers named for the first time."""
        import numpy as np

        if not steps:
            return []
        self.steps += steps
        step = elapsed / steps
        new = []
        for kind, values in (("compute", compute), ("data", wait)):
            seconds = np.asarray(values, dtype=np.float64)
            self.totals[kind] += seconds
            if self.world_size < 2:
                continue
            per_step = seconds / steps
            med = _others_median(per_step)
            slow = per_step - med > SLOW_SHARE * step
            if kind == "compute":
                slow &= per_step > SLOW_RATIO * med
            streak = self.streak[kind]
            streak[:] = np.where(slow, streak + 1, 0)
            for r in np.flatnonzero(streak >= SLOW_WINDOWS):
                if (int(r), kind) not in self.named:
                    self.named.add((int(r), kind))
                    new.append(Straggler(int(r), kind, 1e3 * per_step[r], 1e3 * med[r], 1e3 * step))
        return new

    def table(self, hosts: list | None = None) -> list[dict]:
        """summary.json's per-rank rows: mean forward and data-wait milliseconds per step."""
        n = max(self.steps, 1)
        rows = []
        for r in range(self.world_size):
            row = {
                "rank": r,
                "forward_ms_per_step": 1e3 * float(self.totals["compute"][r]) / n,
                "data_wait_ms_per_step": 1e3 * float(self.totals["data"][r]) / n,
                "straggler": sorted(k for rr, k in self.named if rr == r),
            }
            if hosts and r < len(hosts) and hosts[r]:
                row["node"], row["host"] = hosts[r]
            rows.append(row)
        return rows


def _others_median(values):
    """For each rank, the median of the other ranks' values (of all of them from 8 ranks on,
    where one rank barely moves it)."""
    import numpy as np

    n = len(values)
    if n >= 8:
        return np.full(n, float(np.median(values)))
    plain = values.tolist()
    out = []
    for r in range(n):  # a few ranks: plain Python beats numpy's per-call cost
        rest = sorted(plain[:r] + plain[r + 1 :])
        mid = len(rest) // 2
        out.append(rest[mid] if len(rest) % 2 else (rest[mid - 1] + rest[mid]) / 2)
    return np.array(out)


def straggler_line(s: Straggler, hosts: list | None) -> str:
    where = ""
    if hosts and s.rank < len(hosts) and hosts[s.rank]:
        node, host = hosts[s.rank]
        where = f" (node {node}, host {host})"
    what = "its forward pass" if s.kind == "compute" else "waiting for its data"
    return (
        f"straggler: rank {s.rank}{where} has been slow for {SLOW_WINDOWS} log windows: "
        f"{what} takes {s.mine_ms:.1f} ms a step against the others' median {s.others_ms:.1f} "
        f"ms (a step takes {s.step_ms:.1f} ms; every rank waits for it)"
    )


class ForwardTimer:
    """Seconds of forward passes since the last take(): perf_counter on a CPU; CUDA events on a
    GPU, whose kernels run after the Python call returns (read at a log window, long done)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.total = 0.0
        self.pairs: list = []
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            import torch

            self.pairs.append([torch.cuda.Event(enable_timing=True), None])
            self.pairs[-1][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            import torch

            self.pairs[-1][1] = torch.cuda.Event(enable_timing=True)
            self.pairs[-1][1].record()
        else:
            self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        total, self.total = self.total, 0.0
        if self.pairs:
            self.pairs[-1][1].synchronize()
            total += sum(a.elapsed_time(b) for a, b in self.pairs if b is not None) / 1e3
            self.pairs = []
        return total
