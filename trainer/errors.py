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


class DataUnavailable(RetryableError):
    """Training data could not be read for a while (a bucket's outage outlasted the retries): a
    one-process run saves a checkpoint of the last step before it stops."""


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


def redact(uri: str) -> str:
    """The URI without user:password@ (safe to print, or to keep in a config.yaml)."""
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:  # an unclosed '[' (IPv6): no parts to redact by
        return uri.rpartition("@")[2] if "@" in uri else uri
    if "@" not in parts.netloc:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def file_kind(mode: int, other: str = "something else") -> str:
    """What a file of stat mode `mode` is, for a message: 'a directory', 'a FIFO', ... (`other`
    for a kind none of these names)."""
    import stat

    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((what for test, what in kinds if test(mode)), other)
