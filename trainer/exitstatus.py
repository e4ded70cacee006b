"""Each rank's exit status, left for trainer-launch: its exit code and the one line it printed.

torchrun exits 1 whenever a worker fails; the ranks leave their own codes (and error lines) in
$TRAINER_STATUS_DIR, and trainer-launch reads them after torchrun exits (`node_exit_code`,
`node_message`). `report` prints a TrainerError as its one line and leaves it there.
"""

import os
import re
import sys
import time

from trainer.errors import ExitCode, Preempted, TrainerError

__all__ = [
    "RANK0_GRACE_S",
    "SEVERITY",
    "STATUS_DIR_ENV",
    "node_exit_code",
    "node_message",
    "record_exit",
    "record_message",
    "report",
]

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


def report(e: TrainerError, prog: str = "trainer") -> int:
    """Print a TrainerError as its one line (rank 0 alone for errors that are the same on every
    rank), leave it for the launcher, and return its exit code. A stop by a signal (Preempted,
    exit 3) is normal operation, not an error: `trainer: stopped by SIGTERM at step N; ...`."""
    rank = os.environ.get("RANK", "0")
    if rank in ("", "0") or e.every_rank:
        named = rank in ("", "0") or str(e).startswith(f"rank {rank}")
        kind = "" if isinstance(e, Preempted) else "error: "
        line = f"{prog}: {kind}{'' if named else f'[rank {rank}] '}{e}"
        # One write with its newline: print() writes the line and the "\n" apart, and two
        # ranks' lines on a shared terminal ran together ("...model.name=gpt trainer: error: ...").
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        record_message(line)
    else:  # rank 0 says it: an early exit here would let torchrun stop rank 0 before it does
        if isinstance(e, Preempted):  # but every node's launcher ends with the stop's line
            record_message(f"{prog}: {e}")
        time.sleep(RANK0_GRACE_S)
    return int(e.exit_code)


RANK0_GRACE_S = 2.0
"""How long the other ranks stay after an error that rank 0 alone reports (the same mistake,
found at the same point of every rank's start)."""
