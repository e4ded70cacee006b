"""Exceptions the user can act on, and the process exit codes (a contract with k8s podFailurePolicy)."""

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    """An unexpected error (a bug): the traceback is kept."""
    USAGE = 2
    """Bad config, environment, data or checkpoint. Retrying cannot help: fix the input."""
    PREEMPTED = 3
    """Stopped by SIGTERM/SIGINT after saving a checkpoint; rerunning the same command resumes."""
    RETRYABLE = 4
    """A transient failure (peer lost, collective timed out, I/O error); a retry may succeed."""


STATUS_DIR_ENV = "TRAINER_STATUS_DIR"
"""A node-local folder where each rank leaves its exit code (trainer-launch sets it).

torchrun itself exits 1 whenever a worker fails, which would hide the difference between a
config error (2), a preemption (3) and a transient failure (4) from Kubernetes' podFailurePolicy.
trainer-launch reads these files after torchrun exits and exits with the most significant code.
"""

# Which code a node reports when its ranks disagree: the root cause wins. A 3 (preempted) only
# counts if the node itself was signalled: otherwise it is torchrun tearing the group down after
# another rank failed, and reporting it would let Kubernetes retry a crash loop forever.
SEVERITY = (ExitCode.USAGE, ExitCode.ERROR, ExitCode.RETRYABLE, ExitCode.PREEMPTED)


def record_exit(code: int, environ=None) -> None:
    """Leave this rank's exit code in $TRAINER_STATUS_DIR/attempt-<restart>.rank-<RANK>.exit."""
    if code != ExitCode.OK:
        _record("exit", f"{int(code)}\n", environ)


def record_message(line: str, environ=None) -> None:
    """Leave the one line this rank printed for its error next to its exit code (.msg), so the
    launcher can end the node's output with it, once, after torchrun's own report."""
    _record("msg", line.rstrip("\n") + "\n", environ)


def _record(kind: str, text: str, environ=None) -> None:
    import os

    environ = os.environ if environ is None else environ
    folder = environ.get(STATUS_DIR_ENV)
    if not folder:
        return
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    name = f"attempt-{attempt}.rank-{environ.get('RANK', '0')}.{kind}"
    try:
        with open(
            os.path.join(folder, name), "w", encoding="utf-8", errors="backslashreplace"
        ) as f:
            f.write(text)
    except OSError:
        pass  # the status file is a courtesy to the launcher; never mask the real exit


def _rank_codes(folder: str) -> dict[tuple[int, int], int]:
    """{(attempt, rank): exit code} from the *.exit files the ranks left in `folder`."""
    import os
    import re

    codes: dict[tuple[int, int], int] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return codes
    for name in names:
        m = re.match(r"^attempt-(\d+)\.rank-(\d+)\.exit$", name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                codes[(int(m.group(1)), int(m.group(2)))] = int(f.read().strip())
        except (OSError, ValueError):
            continue
    return codes


def node_message(folder: str, code: int) -> str | None:
    """The line the lowest rank of the LAST attempt that exited with `code` left, if any."""
    import os

    found: dict[tuple[int, int], str] = {}
    for (attempt, rank), rank_code in _rank_codes(folder).items():
        if rank_code != code:
            continue
        path = os.path.join(folder, f"attempt-{attempt}.rank-{rank}.msg")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                line = f.read().strip()
        except OSError:
            continue
        if line:
            found[(attempt, rank)] = line
    if not found:
        return None
    last = max(a for a, _ in found)
    return found[min(k for k in found if k[0] == last)]


def node_exit_code(folder: str, fallback: int, signalled: bool = False) -> int:
    """The most significant code the ranks of the LAST attempt left in `folder`, else `fallback`."""
    by_attempt: dict[int, set[int]] = {}
    for (attempt, _), code in _rank_codes(folder).items():
        by_attempt.setdefault(attempt, set()).add(code)
    codes = by_attempt[max(by_attempt)] if by_attempt else set()
    if not signalled:
        codes.discard(ExitCode.PREEMPTED)
    for code in SEVERITY:
        if code in codes:
            return int(code)
    return fallback


def report(e: "TrainerError", prog: str = "trainer") -> int:
    """Print a TrainerError as its one line (rank 0 alone for errors that are the same on every
    rank), leave it for the launcher, and return its exit code."""
    import os
    import sys

    rank = os.environ.get("RANK", "0")
    if rank in ("", "0") or e.every_rank:
        named = rank in ("", "0") or str(e).startswith(f"rank {rank}")
        line = f"{prog}: error: {'' if named else f'[rank {rank}] '}{e}"
        print(line, file=sys.stderr, flush=True)
        record_message(line)
    else:  # rank 0 says it: an early exit here would let torchrun stop rank 0 before it does
        import time

        time.sleep(RANK0_GRACE_S)
    return int(e.exit_code)


RANK0_GRACE_S = 2.0
"""How long the other ranks stay after an error that rank 0 alone reports (the same mistake,
found at the same point of every rank's start)."""


class TrainerError(Exception):
    """An error the user can act on: printed as one line with its exit code, no traceback."""

    exit_code = ExitCode.ERROR
    every_rank = True
    """Whether every rank prints it (rank-specific), or rank 0 alone (the same on all ranks)."""


class UsageError(TrainerError):
    """Input the user must fix. Printed as one line, exit code 2, no traceback."""

    exit_code = ExitCode.USAGE


class ConfigError(UsageError):
    """A config mistake: the same on every rank, so rank 0 alone reports it."""

    every_rank = False


class EnvError(UsageError):
    """A bad launch environment (rank-specific: every rank reports it)."""


class Preempted(TrainerError):
    """Stopped by a signal at a step boundary, after saving a checkpoint."""

    exit_code = ExitCode.PREEMPTED
    every_rank = False


class RetryableError(TrainerError):
    """A failure a restart may cure (e.g. a checkpoint write hit a full disk)."""

    exit_code = ExitCode.RETRYABLE


def did_you_mean(value: str, choices) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_choice(key: str, value: str, choices) -> None:
    """Raise UsageError naming the key, the valid choices and the closest one."""
    if value not in choices:
        raise UsageError(
            f"{key}: '{value}' is not a valid choice{did_you_mean(value, choices)}; "
            f"choose one of: {', '.join(map(str, choices))}"
        )


def shorten(text: str, limit: int = 60) -> str:
    """`text`, or its start and its length when longer than `limit`: a value in a one-line
    error must not be the whole line (a 100,000-character name, a 5,000-digit number)."""
    return text if len(text) <= limit else f"{text[:40]}... ({len(text):,} characters)"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_permanent_io(e: BaseException) -> bool:
    """Whether an OSError is the path's fault, so a retry cannot help: no permission, read-only
    file system, a parent that is a file, a path that cannot be created (under /proc, /sys).

    Anything else (ENOSPC, EDQUOT, EIO, ESTALE, a timeout) may clear up: transient.
    """
    import errno

    return isinstance(e, OSError) and e.errno in {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENOENT,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EINVAL,
        errno.EOPNOTSUPP,
    }


def io_error(e: OSError, what: str, fix: str) -> TrainerError:
    """One line for an OSError writing `what`: a UsageError (exit 2) naming `fix` when the path is
    at fault, else a RetryableError (exit 4)."""
    reason = e.strerror or first_line(e)
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    if is_permanent_io(e):
        return UsageError(f"{what}: {reason}{where}: {fix}")
    return RetryableError(f"{what}: {reason}{where}; a retry may succeed once that clears")
