"""The harness of the new wing's bad-input tables (tests/test_bad_*wing*.py, issue 55).

Each area (meshes and plans, starting weights, renames, freeze and groups, LoRA, export,
tracking, the run lock, Slurm variables) keeps a table of `WingCase`s. `check(cases, good)` runs
every case through the real CLI in this process (trainer.cli.main or trainer.launch.main, the
console scripts' own code paths), and asserts for each:

- exit code 2 (or, for a case marked `runs`, exit 0, with the reason in the table);
- no traceback, a last line that is our one `...: error:` line naming what the case names;
- a good run's files (`good_run`: a tiny finished run with checkpoints and final/) unchanged:
  every file's bytes, size and mtime, and no file added or removed;
- where the case has `timeout`, it ends within it (a hang is a failure, not a stuck suite).

A failure lists every case that broke, per area, so a table reads as one report.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.test_bad_input import Case, Outcome, problems, run_in_process

__all__ = ["GOOD_ARGS", "WingCase", "check", "good_run", "snapshot"]

GOOD_ARGS = (
    "data.name=tests.helpers:tiny",
    "model.name=tests.helpers:tiny_model",
    "data.global_batch_size=4",
    "train.epochs=2",
    "ckpt.every_epochs=1",
    "ckpt.keep_last=10",
    "log.tensorboard=false",
    "log.progress=plain",
)
"""The good run every table checks is left alone: two epochs of the tiny MLP, a checkpoint at each
epoch's end, final/ and summary.json."""


@dataclass(frozen=True)
class WingCase:
    area: str
    argv: tuple[str, ...]
    names: str
    """What the one error line must mention (the key, file, variable or plug-in)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment for this case (e.g. SLURM_* for trainer-launch)."""
    launch: bool = False
    """Run trainer.launch.main (trainer-launch) rather than trainer.cli.main."""
    runs: str = ""
    """Not a refusal: the input is valid; this says why. The case must exit 0."""
    timeout: float = 120.0

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        tool = "trainer-launch" if self.launch else "trainer"
        return f"{env + ' ' if env else ''}{tool} {' '.join(self.argv)}"[:400]


def _run(case: WingCase) -> Outcome:
    from trainer import cli, launch

    saved = {k: os.environ.get(k) for k, _ in case.env}
    os.environ.update(dict(case.env))
    try:
        return run_in_process(case.argv, main=launch.main if case.launch else cli.main)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_bounded(case: WingCase) -> Outcome | None:
    """The outcome, or None if it did not end within case.timeout (the thread is left behind: a
    daemon, so the session still ends; the failure names the hang)."""
    box: list[Outcome] = []
    saved = {k: os.environ.get(k) for k, _ in case.env}
    t = threading.Thread(target=lambda: box.append(_run(case)), daemon=True)
    t.start()
    t.join(case.timeout)
    if not box:  # the hung case keeps running: its environment must not leak into the next
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return box[0] if box else None


def snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """relative path -> (sha256, size, mtime_ns) of every file under folder."""
    out = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            p = Path(root, name)
            st = p.lstat()
            out[str(p.relative_to(folder))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                st.st_size,
                st.st_mtime_ns,
            )
    return out


def _changed(before: dict, after: dict) -> list[str]:
    out = [f"removed {k}" for k in before.keys() - after.keys()]
    out += [f"added {k}" for k in after.keys() - before.keys()]
    out += [f"changed {k}" for k in before.keys() & after.keys() if before[k] != after[k]]
    return sorted(out)


def good_run(tmp_path_factory) -> Path:
    """The folder of a finished tiny run (shared by every table of the session)."""
    from tests.helpers import shared_run, train_here

    def make(folder: Path) -> None:
        train_here("train", *GOOD_ARGS, f"run_dir={folder / 'run'}")

    run = shared_run(tmp_path_factory, "badwing good run", make) / "run"
    assert (run / "final").is_dir() and (run / "checkpoints").is_dir(), sorted(os.listdir(run))
    return run


def check(cases: list[WingCase], good: Path, before: Callable[[WingCase], None] | None = None):
    """Run every case; one assertion listing every case that failed (see the module's doc)."""
    assert len(set(cases)) == len(cases), "duplicate cases"
    failures = []
    for case in cases:
        if before is not None:
            before(case)
        ahead = snapshot(good)
        o = _run_bounded(case)
        if o is None:
            failures.append(f"[{case.area}] {case}: no end within {case.timeout:.0f} s (a hang)")
            continue
        if case.runs:
            found = [] if o.code == 0 else [f"exit {o.code} (should run: {case.runs})"]
            if "Traceback" in o.stdout + o.stderr:
                found.append("traceback")
        else:
            found = problems(Case(case.area, case.argv, case.names), o)
        found += _changed(ahead, snapshot(good))
        if found:
            tail = o.stderr.strip().splitlines()[-1:] if o.stderr.strip() else []
            failures.append(f"[{case.area}] {case}: {'; '.join(found)} | {tail}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    return len(cases)
