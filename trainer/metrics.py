"""What a run reports: console (rank 0 only), metrics.jsonl, summary.json, library versions."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from importlib import metadata

_PACKAGES = ("trainer", "torch", "torchvision", "numpy", "omegaconf", "scikit-learn", "safetensors")
_DISTRIBUTION = {"trainer": "repro-trainer"}
"""Our distribution's name (PyPI's `trainer` is another project); the package is `trainer`."""


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(_DISTRIBUTION.get(name, name))
        except metadata.PackageNotFoundError:
            continue
    try:
        import torch

        out["cuda"] = torch.version.cuda or "none"
    except ImportError:
        pass
    return out


def write_json(path: str, obj) -> None:
    """Write JSON atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def memory_line(memory: list[dict]) -> str:
    """One console line for the ranks' memory reports (the largest rank's)."""
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    r = max(memory, key=lambda m: m["total_bytes"])
    line = (
        f"per rank: params {mib(r['param_bytes'])} + grads {mib(r['grad_bytes'])} + optimizer "
        f"{mib(r['optimizer_bytes'])} = {mib(r['total_bytes'])}"
    )
    if "peak_gpu_bytes" in r:
        line += f" | peak GPU memory {mib(max(m['peak_gpu_bytes'] for m in memory))}"
    return line


def _fmt(record: dict) -> str:
    parts = []
    for k, v in record.items():
        if k in ("kind", "time"):
            continue
        if isinstance(v, float):
            v = f"{v:.4g}" if k != "samples_per_s" else f"{v:,.0f}"
        parts.append(f"{k} {v}")
    return " | ".join(parts)


def _truncate_after(path: str, step: int) -> None:
    """Drop records past `step`: a resumed run recomputes them, so history stays one line per step."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue  # a line cut short by a kill
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _tensorboard(folder: str, resume_step: int | None, note):
    """A SummaryWriter, or None (with a note) when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        note(
            "note: tensorboard is not installed, so no event files (pip install 'repro-trainer[tensorboard]')"
        )
        return None
    # purge_step hides events a killed attempt wrote past the checkpoint we resumed from.
    return SummaryWriter(folder, purge_step=resume_step + 1 if resume_step is not None else None)


class RunLogger:
    """Rank 0 prints, and once `open` names the run directory writes metrics.jsonl (and TensorBoard
    events); on the other ranks every method does nothing.

    Console: a single self-updating progress line on a TTY, plain periodic lines otherwise
    (pod logs, CI), or nothing but `info` lines (log.progress=none; the JSONL is still written).
    """

    def __init__(self, *, main: bool, progress: str, total_steps: int, stream=None):
        self.stream = stream or sys.stdout
        self.enabled = main
        if progress == "auto":
            progress = "bar" if self.stream.isatty() else "plain"
        self.progress = progress if main else "none"
        self.total = total_steps
        self._jsonl = None
        self._tb = None
        self.write_error: OSError | None = None
        """The first OSError writing metrics.jsonl (full disk, I/O error): recorded, not raised,
        so the loop can agree on it across ranks (it rides the log window's all-reduce) and save
        before stopping (loop._stop_for_metrics)."""
        self._last_draw = 0.0
        self._bar_open = False

    def open(self, run_dir: str, *, resume_step: int | None = None, tensorboard: bool = False):
        """Start writing run_dir/metrics.jsonl (truncated past `resume_step`, else new) and tb/."""
        if not self.enabled:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None:
            _truncate_after(path, resume_step)
        mode = "a" if resume_step is not None else "w"
        self._jsonl = open(path, mode, encoding="utf-8")  # noqa: SIM115 (closed by close())
        if tensorboard:
            self._tb = _tensorboard(os.path.join(run_dir, "tb"), resume_step, self.info)

    def record(self, record: dict) -> None:
        """One metrics.jsonl line; also shown on the console."""
        if not self.enabled:
            return
        record = {**record, "time": time.time()}
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
            except OSError as e:
                self._abandon_jsonl(e)
        if self._tb is not None:
            for key, value in record.items():
                if key in ("kind", "step", "epoch", "time", "eval.count") or not isinstance(
                    value, (int, float)
                ):
                    continue
                tag = key.replace(".", "/", 1) if key.startswith("eval.") else f"train/{key}"
                self._tb.add_scalar(tag, value, record["step"])
        if self.progress == "plain":
            self._print(_fmt(record))
        elif self.progress == "bar":
            if record.get("kind") == "eval":
                self._print(_fmt(record))
            else:
                self._last = record
                self._draw(record["step"], force=True)

    def tick(self, step: int) -> None:
        """Called every step: redraws the bar at most 10 times a second."""
        if self.progress == "bar":
            self._draw(step)

    def _draw(self, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 24
        done = int(width * step / max(1, self.total))
        tail = _fmt(getattr(self, "_last", {}))
        self.stream.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {tail}"[:160].ljust(80)
        )
        self.stream.flush()
        self._bar_open = True

    def info(self, text: str) -> None:
        if self.enabled:
            self._print(text)

    def _print(self, text: str) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        print(text, file=self.stream, flush=True)

    def _abandon_jsonl(self, e: OSError) -> None:
        """Stop writing metrics.jsonl after an error; a resume truncates any half-written line."""
        if self.write_error is None:
            self.write_error = e
        jsonl, self._jsonl = self._jsonl, None
        with contextlib.suppress(OSError):
            jsonl.close()  # may fail again flushing what is left in its buffer

    def close(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except OSError as e:
                self.write_error = self.write_error or e
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
