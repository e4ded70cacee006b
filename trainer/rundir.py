"""Where a run writes: `run_dir` when the config pins it, else a new folder per run.

    trainer train                       # runs/<name>/<YYYYmmdd-HHMMSS>, a new folder each time
    trainer train --resume              # the newest folder of runs/<name>/, its config, resumed
    trainer train --resume RUN_DIR      # that run, its config, resumed
    trainer train run_dir=PATH          # pinned: resumes PATH's checkpoints on its own (auto)

Launchers that restart a job pin it, so a restart resumes: make run-local and TorchX give
run_dir; trainer-launch (compose, Kubernetes, JobSet, Kubeflow) marks its ranks with
STABLE_ENV, which makes the default runs/<name>; a torchrun worker-group restart
(--max-restarts) finds the folder of its first attempt by TORCHELASTIC_RUN_ID in run.json.
Rank 0 decides and every rank gets the same answer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import time

from trainer.errors import UsageError

STABLE_ENV = "TRAINER_STABLE_RUN_DIR"
"""Set by trainer-launch for its ranks: without run_dir, use runs/<name> (a restarted pod resumes)."""
RUNS = "runs"


def runs_of(name: str) -> str:
    return os.path.join(RUNS, name)


def resolve(name: str, run_dir: str | None, *, claim: bool, environ=os.environ) -> str:
    """The run directory for this rank-0 process to use (no collective: the caller broadcasts).

    `claim`: create a new folder at once, so two runs started in the same second differ."""
    if run_dir:
        return run_dir
    if environ.get(STABLE_ENV):
        return runs_of(name)
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    restarted = environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if run_id and restarted and (earlier := _attempt_of(name, run_id)):
        return earlier
    return new_folder(name, claim=claim)


def new_folder(name: str, *, claim: bool, now: float | None = None) -> str:
    """runs/<name>/<YYYYmmdd-HHMMSS>, with -2, -3 ... when that exists already."""
    base = os.path.join(runs_of(name), time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))
    path, n = base, 2
    while True:
        if not claim:
            if not os.path.exists(path):
                return path
        else:
            try:
                os.makedirs(path)
                return path
            except FileExistsError:
                pass
            except OSError:  # unwritable: the checkpointer's check says so in one line
                return path
        path, n = f"{base}-{n}", n + 1


def runs(name: str) -> list[str]:
    """The run folders of runs/<name>/ (is_run: an export holds a config.yaml too), oldest
    first."""
    root = runs_of(name)
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, e) for e in entries if is_run(os.path.join(root, e))]


RUN_MARKS = ("run.json", "metrics.jsonl", "summary.json", ".job.lock")
"""Beside config.yaml, what only `trainer train` writes in a run folder (an export, a Hugging
Face download or a project folder may hold a config.yaml, checkpoints/ or final/ too)."""


def is_run(folder: str) -> bool:
    """Whether `folder` is a run folder: config.yaml and one of RUN_MARKS."""
    has = lambda name: os.path.lexists(os.path.join(folder, name))  # noqa: E731
    return os.path.isfile(os.path.join(folder, "config.yaml")) and any(map(has, RUN_MARKS))


def newest(name: str) -> str:
    """`--resume`: the newest run of `name`, or a one-line error."""
    found = runs(name)
    if not found:
        raise UsageError(
            f"--resume: no earlier run of '{name}' in {runs_of(name)}/: train without --resume, "
            "or name the run folder (--resume RUN_DIR)"
        )
    return found[-1]


def _attempt_of(name: str, run_id: str) -> str | None:
    """The newest folder of runs/<name>/ whose run.json has this torchrun run id."""
    for folder in reversed(runs(name)):
        try:
            with open(os.path.join(folder, "run.json"), encoding="utf-8") as f:
                if json.load(f).get("torchelastic_run_id") == run_id:
                    return folder
        except (OSError, ValueError):
            continue
    return None


def probe_nearest(folder: str) -> OSError | None:
    """Whether `folder` could be made and written, touching nothing a run would use: a file
    created and removed in its nearest existing ancestor (which must be a directory). Probes
    may run at once on one folder (every node's launcher, on a shared filesystem): each makes
    only its own uniquely named file, where probe_folder's rmdir of the folders it made failed
    another's mkstemp (EEXIST, ENOENT). The OSError a run writing there would meet, or None."""
    at = os.path.abspath(folder)
    while not os.path.lexists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    try:
        if not os.path.isdir(at):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", at)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=at)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e
    return None


def probe_folder(folder: str) -> OSError | None:
    """Create `folder` (with its parents) and a file in it, then remove what this made, leaving
    nothing behind: the OSError a run writing there would meet, or None (one prober at a time:
    rank 0's checkpointer; launchers use probe_nearest)."""
    created = []  # the folders made here, removed again (deepest first)
    at = folder
    while not os.path.lexists(at) and os.path.dirname(at) != at:
        created.append(at)
        at = os.path.dirname(at)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e
    finally:
        for at in created:
            with contextlib.suppress(OSError):
                os.rmdir(at)
    return None
