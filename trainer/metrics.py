"""What a run reports: console (rank 0 only), metrics.jsonl, summary.json, library versions."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from importlib import metadata

from trainer import jsonfile

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
    """Write JSON atomically (jsonfile.py): a reader never sees half a file."""
    jsonfile.write_json(path, obj, indent=2, sort_keys=True)


def memory_line(memory: list[dict]) -> str:
    """One console line for the ranks' memory reports (the largest rank's)."""
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    r = max(memory, key=lambda m: m["total_bytes"])
    line = (
        f"per rank: params {mib(r['param_bytes'])} + grads {mib(r['grad_bytes'])} + optimizer "
        f"{mib(r['optimizer_bytes'])} = {mib(r['total_bytes'])}"
    )
    if "peak_rss_bytes" in r:
        line += f" | peak RSS {mib(max(m['peak_rss_bytes'] for m in memory))}"
    if "peak_gpu_bytes" in r:
        line += f" | peak GPU memory {mib(max(m['peak_gpu_bytes'] for m in memory))}"
    return line


def clock(seconds: float) -> str:
    """0:07, 12:34, 1:02:03."""
    seconds = max(0, int(seconds + 0.5))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


_LABEL = {
    "loss": "loss {:.4g}",
    "lr": "lr {:.3g}",
    "samples_per_s": "{:,.0f} samples/s",
    "tokens_per_s": "{:,.0f} tokens/s",
    "data_wait_pct": "data wait {:.1f}%",
}
"""Console labels for train record keys (metrics.jsonl keeps the raw keys)."""


def _metrics_text(record: dict, prefix: str = "") -> list[str]:
    parts = []
    for key, value in record.items():
        if not key.startswith(prefix) or key in ("kind", "step", "epoch", "time"):
            continue
        name = key[len(prefix) :]
        if name == "count" or isinstance(value, list):
            continue  # said once, at the end of the line; per-rank lists stay in the file
        if name == "mfu" and isinstance(value, float):
            parts.append(f"MFU {100 * value:.1f}%")
        elif name in _LABEL and isinstance(value, (int, float)):
            parts.append(_LABEL[name].format(value))
        elif isinstance(value, float):
            parts.append(f"{name.replace('_', ' ')} {value:.4g}")
        else:
            parts.append(f"{name.replace('_', ' ')} {value}")
    return parts


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
    jsonfile.write_text(path, "".join(kept))


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
    Each line says where the run is (step/total, epoch/epochs), how fast it goes, how long it has
    run and how long it still needs (ETA, from this attempt's steps per second). The first line
    comes after the first step, and in plain mode a line at least every HEARTBEAT_S seconds.
    Routine checkpoints are JSONL records only (`"kind": "checkpoint"`); labels on the console
    are words (`42 samples/s`, `data wait 1.7%`), the JSONL keeps the raw keys.
    """

    HEARTBEAT_S = 30.0

    def __init__(
        self, *, main: bool, progress: str, total_steps: int, epochs: int = 0, stream=None
    ):
        self.stream = stream or sys.stdout
        self.enabled = main
        if progress == "auto":
            progress = "bar" if self.stream.isatty() else "plain"
        self.progress = progress if main else "none"
        self.total = total_steps
        self.epochs = epochs
        self._jsonl = None
        self._tb = None
        self.sinks: list = []
        """Also handed every record (tracking.tracked adds rank 0's tracker: MLflow, W&B)."""
        self.write_error: OSError | None = None
        """The first OSError writing metrics.jsonl (full disk, I/O error): recorded, not raised,
        so the loop can agree on it across ranks (it rides the log window's all-reduce) and save
        before stopping (guards.stop_for_metrics)."""
        self._last_draw = 0.0
        self._bar_open = False
        self._start: float | None = None  # this attempt's first tick, and the step before it
        self._start_step = 0
        self._step = 0
        self._epoch = 0
        self._last_line = 0.0
        self._first_shown = False
        self._last: dict = {}

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
        live = "metrics.jsonl" + (", tb/" if self._tb is not None else "")
        self.info(f"run dir: {os.path.abspath(run_dir)} ({live} as it trains)")

    def record(self, record: dict, *, console: bool = True) -> None:
        """One metrics.jsonl line; also shown on the console (train and eval records)."""
        if not self.enabled:
            return
        record = {**record, "time": time.time()}
        if self._jsonl is not None:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
            except OSError as e:
                self._abandon_jsonl(e)
        for sink in self.sinks:
            sink.record(record)
        kind = record.get("kind")
        if self._tb is not None and kind in ("train", "eval"):
            for key, value in record.items():
                if key in ("kind", "step", "epoch", "time", "eval.count") or not isinstance(
                    value, (int, float)
                ):
                    continue
                tag = key.replace(".", "/", 1) if key.startswith("eval.") else f"train/{key}"
                self._tb.add_scalar(tag, value, record["step"])
        if not console or kind not in ("train", "eval"):
            return
        self._epoch = record.get("epoch", self._epoch)
        if kind == "eval" and self.progress in ("plain", "bar"):
            self._print(self._eval_line(record))
        elif self.progress == "plain":
            self._print(self._train_line(record["step"], record))
        elif self.progress == "bar":
            self._last = record
            self._draw(record["step"], force=True)

    def tick(self, step: int, epoch: int | None = None) -> None:
        """Called every step (epoch: the 1-based epoch this step belongs to): redraws the bar at
        most 10 times a second; in plain mode, a line after the first step and a heartbeat."""
        now = time.monotonic()
        if self._start is None:
            self._start, self._start_step = now, step  # the first step (warm-up) not timed
        self._step = step
        if epoch is not None:
            self._epoch = epoch
        if self.progress == "bar":
            self._draw(step)
        elif self.progress == "plain" and (
            not self._first_shown or now - self._last_line >= self.HEARTBEAT_S
        ):
            self._first_shown = True
            self._print(self._train_line(step, {}))

    # --- what a line says ----------------------------------------------------------------------

    def _where(self, step: int) -> str:
        pct = 100 * step / max(1, self.total)
        where = f"step {step:,}/{self.total:,} ({pct:.0f}%)"
        if self.epochs and self._epoch:
            where += f" | epoch {self._epoch}/{self.epochs}"
        return where

    def _timing(self, step: int) -> str:
        if self._start is None:
            return ""
        elapsed = time.monotonic() - self._start
        done = step - self._start_step
        text = f"{clock(elapsed)} elapsed"
        if done > 0 and elapsed > 0 and step < self.total:
            text += f", ETA {clock((self.total - step) * elapsed / done)}"
        return text

    def _train_line(self, step: int, record: dict) -> str:
        parts = [self._where(step), *_metrics_text(record)]
        if timing := self._timing(step):
            parts.append(timing)
        return " | ".join(parts)

    def _eval_line(self, record: dict) -> str:
        parts = [f"eval at {self._where(record['step'])}", *_metrics_text(record, "eval.")]
        if "eval.count" in record:
            parts.append(f"{record['eval.count']:,} samples")
        return " | ".join(parts)

    def _draw(self, step: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 24
        done = int(width * step / max(1, self.total))
        tail = " | ".join(_metrics_text({k: v for k, v in self._last.items() if k != "lr"}))
        timing = self._timing(step)
        line = f"\r[{'#' * done}{'.' * (width - done)}] {self._where(step)}"
        line += "".join(f" | {part}" for part in (tail, timing) if part)
        self.stream.write(line[:200].ljust(80))
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
        self._last_line = time.monotonic()

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
