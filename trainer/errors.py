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


class TrainerError(Exception):
    """An error the user can act on: printed as one line with its exit code, no traceback."""

    exit_code = ExitCode.ERROR


class UsageError(TrainerError):
    """Input the user must fix. Printed as one line, exit code 2, no traceback."""

    exit_code = ExitCode.USAGE


class EnvError(UsageError):
    """A bad launch environment. Rank-specific, so every rank reports it (config errors: rank 0)."""


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
