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

# Which code a node reports when its ranks disagree: the most actionable one wins.
SEVERITY = (ExitCode.USAGE, ExitCode.PREEMPTED, ExitCode.RETRYABLE, ExitCode.ERROR)


def record_exit(code: int, environ=None) -> None:
    """Leave this rank's exit code in $TRAINER_STATUS_DIR/rank-<RANK>.exit (if set)."""
    import os

    environ = os.environ if environ is None else environ
    folder = environ.get(STATUS_DIR_ENV)
    if not folder or code == ExitCode.OK:
        return
    try:
        with open(os.path.join(folder, f"rank-{environ.get('RANK', '0')}.exit"), "w") as f:
            f.write(f"{int(code)}\n")
    except OSError:
        pass  # the status file is a courtesy to the launcher; never mask the real exit


def node_exit_code(folder: str, fallback: int) -> int:
    """The most significant code the ranks left in `folder`, else `fallback` (torchrun's)."""
    import os

    codes = set()
    try:
        names = os.listdir(folder)
    except OSError:
        return fallback
    for name in names:
        if name.endswith(".exit"):
            try:
                with open(os.path.join(folder, name)) as f:
                    codes.add(int(f.read().strip()))
            except (OSError, ValueError):
                continue
    for code in SEVERITY:
        if code in codes:
            return int(code)
    return fallback


class TrainerError(Exception):
    """An error the user can act on: printed as one line with its exit code, no traceback."""

    exit_code = ExitCode.ERROR
    every_rank = True
    """Whether every rank prints it (rank-specific), or rank 0 alone (the same on all ranks)."""


class UsageError(TrainerError):
    """Input the user must fix. Printed as one line, exit code 2, no traceback."""

    exit_code = ExitCode.USAGE
    every_rank = False


class EnvError(UsageError):
    """A bad launch environment. Rank-specific, so every rank reports it (config errors: rank 0)."""

    every_rank = True


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
