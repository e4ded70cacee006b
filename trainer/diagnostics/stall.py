"""Stalls: which rank made no step, where, and why; `trainer diagnose`.

Each rank runs a watchdog thread. When no step completes for dist.stall_s (outside evaluation and
checkpoint saves, which collectives bound by dist.timeout_s), every rank writes the Python stacks
of all its threads, the last collective it entered and where its main thread is to
RUN_DIR/diagnostics/<restart>-step-<N>/rank-<r>.txt (the runs volume: it outlives the pod); rank 0
reads the others' files, prints one line naming the rank that stalled and where, e.g.

    rank 1 (node 0, host h) has made no step for 31 s, in mypkg/data.py:12 take (data loading);
    rank 0 waits in the backward pass (DDP's gradient all-reduce)

and every rank exits with the transient code 4, so restart policies apply. A rank stuck in C
while holding the GIL cannot run its watchdog: faulthandler's own C thread, armed a little past
the same bound, dumps its stacks to rank-<r>.faulthandler.txt, which rank 0 reads instead.
`trainer diagnose RUN_DIR` prints the summary again from the files.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from trainer import jsonfile
from trainer.diagnostics.collectives import Collectives

FOLDER = "diagnostics"
C_MARGIN_S = 2.0
"""faulthandler's C-level dump fires this long after the watchdog's bound (only if the
watchdog, a Python thread, could not run: the GIL is held by a call stuck in C)."""
C_GUARD_S = 5.0
"""A pause that begins this close to the C dump's time cancels it (and arms it again after):
the watchdog's thread, asleep until its deadline, could not cancel it while the pause held the
GIL in C. Only then: each cancel and arm starts a C thread (an evaluation every epoch made that
5 times a second, which a busy CPU pays for)."""
GATHER_S = 10.0
"""How long rank 0 waits for the other ranks' files before it writes the summary."""
AUTO_MIN_S, AUTO_STEPS = 60.0, 30
"""dist.stall_s=null: 30 times the slowest log window's mean step, and at least 60 s."""


def stall_bound(stall_s: float | None, timeout_s: float, slowest_step_s: float | None) -> float:
    """Seconds without a step that count as a stall (0: never). dist.stall_s if set; else
    AUTO_STEPS x the slowest mean step seen (at least AUTO_MIN_S), and before any step time is
    known 90% of dist.timeout_s; always below dist.timeout_s, so the stall is named before a
    collective's timeout ends the job without a word."""
    if stall_s == 0:
        return 0.0
    cap = 0.9 * timeout_s
    if stall_s is not None:
        return min(stall_s, cap)
    if slowest_step_s is None:
        return cap
    return min(max(AUTO_MIN_S, AUTO_STEPS * slowest_step_s), cap)


# --- where a thread is --------------------------------------------------------------------------

_TRAINER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""trainer/: this module lives in trainer/diagnostics/."""


def _is_library(path: str) -> bool:
    """A frame of the standard library, torch or numpy (looked up when asked: torch may be
    imported after this module), not the user's; a user's package installed in site-packages
    (the image pip-installs yours) stays the user's."""
    stdlib = os.path.dirname(os.__file__)
    if path.startswith(stdlib) and not any(d in path for d in ("site-packages", "dist-packages")):
        return True
    for name in ("torch", "numpy"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None) and path.startswith(os.path.dirname(module.__file__)):
            return True
    return False


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{_short(self.file)}:{self.line} {self.func}"


def _short(path: str) -> str:
    """A path relative to the working directory when under it (mypkg/data.py), else as is."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def frames_of(frame) -> list[Frame]:
    """A thread's frames, outermost first."""
    return [Frame(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)]


def _in_trainer(f: Frame, *names: str) -> bool:
    return f.file.startswith(_TRAINER) and (not names or os.path.basename(f.file) in names)


def activity(frames: list[Frame]) -> tuple[str, Frame | None]:
    """(what the thread is doing, the frame that says where) from its frames, outermost first.

    waiting: a collective of the trainer's (ranks.py) or the backward pass (DDP and FSDP reduce
    gradients there); else data loading, checkpoint, evaluation or compute. The frame is the
    innermost one of the user's code (not the trainer, torch or the standard library), else the
    innermost of the trainer's.
    """
    if not frames:
        return "unknown", None
    own = [f for f in frames if not (f.file.startswith((_TRAINER, "<")) or _is_library(f.file))]
    mine = [f for f in frames if _in_trainer(f)]
    where = own[-1] if own else (mine[-1] if mine else frames[-1])
    names = [f.func for f in frames]
    collective = next((f for f in reversed(mine) if _in_trainer(f, "ranks.py")), None)
    if collective is not None:
        return f"waits in {collective.func}", collective
    if "backward" in names and any(_in_trainer(f, "step.py") for f in frames):
        return "waits in the backward pass (the gradient all-reduce)", own[-1] if own else None
    kind = "compute"
    if any(_in_trainer(f, "data.py") for f in frames):
        kind = "data loading"
    elif any(_in_trainer(f) and "checkpoint" in f.file for f in frames):
        kind = "checkpoint"
    elif any(_in_trainer(f, "evaluate.py") for f in frames):
        kind = "evaluation"
    return kind, where


def is_waiting(kind: str) -> bool:
    return kind.startswith("waits in")


# --- the watchdog --------------------------------------------------------------------------------


@dataclass
class Where:
    """Who this rank is, for the files and the line."""

    rank: int
    node: int
    host: str
    world_size: int
    restart: int
    run_dir: str


@dataclass
class Watchdog:
    """Names a stall: see the module docstring. `beat(step)` after every step (two stores);
    `paused()` around evaluation and saves; `observe(mean_step_s)` at each log window."""

    where: Where
    stall_s: float | None
    timeout_s: float
    log: object = None
    exit: object = os._exit
    """What ends the process after a stall (tests replace it)."""
    step: int = 0
    at: float = field(default_factory=time.monotonic)
    slowest_step_s: float | None = None
    pause_depth: int = 0
    fired: bool = False
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    """Set when the bound came back from 0 while the thread waited for it (a pause ended while it
    was idle) or on close: a pause that ends before the thread's deadline leaves it asleep (an
    evaluation every epoch woke it 5 times a second)."""
    _idle: bool = False
    _c_file: object = None
    _c_at: float | None = None
    """When the armed C dump fires (time.monotonic()); None: not armed."""

    def beat(self, step: int) -> None:
        self.step, self.at = step, time.monotonic()

    def observe(self, mean_step_s: float) -> None:
        if self.slowest_step_s is None or mean_step_s > self.slowest_step_s:
            before = self.bound
            self.slowest_step_s = mean_step_s
            if self.bound < before:  # the first step time: 90% of dist.timeout_s becomes the
                self._wake.set()  # auto bound (a minute): the thread's deadline moves closer

    @property
    def bound(self) -> float:
        if self.pause_depth:  # evaluation, a save: their collectives are bounded by timeout_s
            return 0.0
        return stall_bound(self.stall_s, self.timeout_s, self.slowest_step_s)

    @contextlib.contextmanager
    def paused(self):
        """No stall while the body runs (evaluation, a save). A C dump due within C_GUARD_S is
        cancelled here and armed again after, on this thread: the watchdog's thread sleeps
        through short pauses and could not cancel it in time if the body held the GIL in C."""
        self.pause_depth += 1
        c_at = self._c_at
        if self.pause_depth == 1 and c_at is not None and c_at - time.monotonic() < C_GUARD_S:
            self._cancel_c_dump()
        try:
            yield
        finally:
            self.pause_depth -= 1
            self.at = time.monotonic()
            if not self.pause_depth:
                if self._c_at is None and self._c_file is not None and self._thread is not None:
                    self._arm_c_dump(self.bound + C_MARGIN_S)  # this pause (or a long one) ended it
                if self._idle:  # else its deadline (from an earlier `at`) is still a safe one
                    self._wake.set()

    def start(self) -> Watchdog:
        if stall_bound(self.stall_s, self.timeout_s, None) == 0:
            return self
        self.at = time.monotonic()
        self._arm_c_dump(self.bound + C_MARGIN_S)  # now: the first tick may come too late
        self._thread = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
        self._thread.start()
        return self

    def wait_if_firing(self) -> None:
        """On the main thread, when a collective failed: if the watchdog is naming a stall
        (another rank's exit closed the connection), let it finish; it ends the process."""
        if self.fired and self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._c_file is not None:
            faulthandler.cancel_dump_traceback_later()
            path = self._c_file.name
            self._c_file.close()
            with contextlib.suppress(OSError):
                if os.path.getsize(path) == 0:
                    os.remove(path)  # nothing was dumped: leave no empty file

    def _watch(self) -> None:
        """Wakes when a stall could first be seen, not on a tick: `at` only moves on and the
        bound only grows (but for pauses, which wake it when they end, and the first step time,
        which shrinks it from 90% of dist.timeout_s and wakes it), so nothing can stall before
        `at + bound`. A thread that woke every 0.5 s took the GIL from the training loop
        each time, which cost a busy CPU's steps (docs/benchmarks.md, "A busy CPU")."""
        while not self._stop.is_set():
            self._idle = True  # before the bound is read: a pause ending after it wakes us
            bound = self.bound
            if not bound:  # paused (evaluation, a save) or never: until that changes
                if self._c_file is not None:
                    self._cancel_c_dump()
                self._wake.wait()
                self._wake.clear()
                continue
            self._idle = False
            quiet = time.monotonic() - self.at
            if quiet >= bound:
                self.fire(quiet, bound)
                return
            self._arm_c_dump(bound - quiet + C_MARGIN_S)
            if self._wake.wait(bound - quiet):
                self._wake.clear()

    def _arm_c_dump(self, seconds: float) -> None:
        """faulthandler's C thread dumps every thread's stack in `seconds`, unless re-armed:
        a last word from a rank whose Python threads cannot run."""
        try:
            if self._c_file is None:
                folder = os.path.join(self.where.run_dir, FOLDER)
                os.makedirs(folder, exist_ok=True)
                name = f".restart{self.where.restart}-rank-{self.where.rank}.faulthandler.txt"
                self._c_file = open(os.path.join(folder, name), "w")  # noqa: SIM115
            faulthandler.dump_traceback_later(seconds, file=self._c_file)
            self._c_at = time.monotonic() + seconds
        except (OSError, ValueError):
            pass  # diagnostics never stop a run

    def _cancel_c_dump(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._c_at = None

    def fire(self, quiet: float, bound: float) -> None:
        """The stall: this rank's file, rank 0's summary line, exit 4 (the transient code)."""
        from trainer.errors import ExitCode
        from trainer.exitstatus import record_exit, record_message

        self.fired = True
        faulthandler.cancel_dump_traceback_later()
        if self._c_file is not None:  # this rank's Python ran: its file below says more
            self._c_file.close()
            with contextlib.suppress(OSError):
                os.remove(self._c_file.name)
            self._c_file = None
        folder = self.dump(f"no step for {quiet:.0f} s (dist.stall_s bound {bound:.0f} s)", quiet)
        if self.where.rank == 0 and folder:
            line = summarize(folder, wait_s=GATHER_S)
        else:
            line = (
                f"rank {self.where.rank}: no step for {quiet:.0f} s; stacks in "
                f"{folder or 'nowhere (run_dir not writable)'}"
            )
            if folder:  # rank 0 reads this rank's file: stay (connected) until it has
                deadline = time.monotonic() + GATHER_S + 2
                summary = os.path.join(folder, "summary.txt")
                while not os.path.exists(summary) and time.monotonic() < deadline:
                    time.sleep(0.2)
        text = f"trainer: error: {line} (exit 4: a restart may clear it; `trainer diagnose "
        text += f"{self.where.run_dir}` says it again)"
        print(text, file=sys.stderr, flush=True)
        record_message(text)
        record_exit(ExitCode.RETRYABLE)
        sys.stdout.flush()
        self.exit(int(ExitCode.RETRYABLE))

    def dump(self, why: str, quiet: float | None = None) -> str | None:
        """Write this rank's stacks and facts; the folder (None if it cannot be written)."""
        main = threading.main_thread()
        frames = sys._current_frames()
        kind, at = activity(frames_of(frames[main.ident])) if main.ident in frames else ("?", None)
        w = self.where
        header = {
            "rank": w.rank,
            "node": w.node,
            "host": w.host,
            "pid": os.getpid(),
            "world_size": w.world_size,
            "restart": w.restart,
            "step": self.step,
            "quiet_s": round(quiet if quiet is not None else time.monotonic() - self.at, 1),
            "why": why,
            "activity": kind,
            "where": str(at) if at else None,
            "last_collective": Collectives.last(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = []
        for ident, frame in frames.items():
            stacks.append(f"\n--- thread {names.get(ident, ident)} ---\n")
            stacks.append("".join(traceback.format_stack(frame)))
        folder = os.path.join(w.run_dir, FOLDER, f"restart{w.restart}-step-{self.step}")
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank-{w.rank}.txt")
            jsonfile.write_text(path, json.dumps(header) + "\n" + "".join(stacks))
        except OSError:
            return None
        return folder


# --- reading the files back -----------------------------------------------------------------------


def read_rank_files(folder: str) -> dict[int, dict]:
    """{rank: header} from rank-<r>.txt (the first line: JSON), plus ranks known only from a
    faulthandler dump beside the folder (activity 'blocked outside Python')."""
    found: dict[int, dict] = {}
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"rank-(\d+)\.txt", name)
        if not m:
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                header = json.loads(f.readline())
        except (OSError, ValueError):
            continue
        if isinstance(header, dict):
            found[int(m.group(1))] = header
    restart = re.match(r"restart(\d+)-", os.path.basename(folder))
    parent = os.path.dirname(folder)
    for name in sorted(os.listdir(parent)):
        m = re.fullmatch(r"\.restart(\d+)-rank-(\d+)\.faulthandler\.txt", name)
        if not m or (restart and m.group(1) != restart.group(1)) or int(m.group(2)) in found:
            continue
        with contextlib.suppress(OSError):
            with open(os.path.join(parent, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                found[int(m.group(2))] = from_faulthandler(text)
    return found


_FH_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)


def from_faulthandler(text: str) -> dict:
    """A header from faulthandler's dump: the main thread's innermost frame of the user's code
    (its frames are listed innermost first, the main thread's block is the last)."""
    blocks = re.split(r"\n(?=Thread 0x|Current thread 0x)", text.strip())
    main = blocks[-1] if blocks else text
    frames = [Frame(m.group(1), int(m.group(2)), m.group(3)) for m in _FH_FRAME.finditer(main)]
    kind, at = activity(list(reversed(frames)))
    if not is_waiting(kind):
        kind = f"blocked outside Python in {kind}"
    return {"activity": kind, "where": str(at) if at else None, "faulthandler": True}


def describe(rank: int, h: dict) -> str:
    where = f", in {h['where']}" if h.get("where") else ""
    if is_waiting(h.get("activity", "")):
        return f"rank {rank} {h['activity']}{where} (last collective {h.get('last_collective')})"
    who = f"rank {rank}"
    if "node" in h:
        who += f" (node {h['node']}, host {h.get('host')})"
    quiet = f" has made no step for {h['quiet_s']:.0f} s" if "quiet_s" in h else " stalled"
    return f"{who}{quiet}{where} ({h.get('activity')})"


def summarize(folder: str, wait_s: float = 0.0, world_size: int | None = None) -> str:
    """One line naming who stalled where, from the rank files in `folder` (waiting up to wait_s
    for every rank's); also written to folder/summary.txt."""
    deadline = time.monotonic() + wait_s
    ranks = read_rank_files(folder)
    size = world_size or max((h.get("world_size", 1) for h in ranks.values()), default=1)
    while len(ranks) < size and time.monotonic() < deadline:
        time.sleep(0.2)
        ranks = read_rank_files(folder)
    stalled = [r for r, h in sorted(ranks.items()) if not is_waiting(h.get("activity", ""))]
    waiting = [r for r in sorted(ranks) if r not in stalled]
    if stalled:
        parts = [describe(r, ranks[r]) for r in stalled] + [describe(r, ranks[r]) for r in waiting]
    else:  # everyone waits: in different collectives, or in the same one for a rank gone quiet
        parts = [describe(r, ranks[r]) for r in waiting]
        collectives = {ranks[r].get("last_collective") for r in waiting}
        if len(collectives) > 1:
            parts.insert(0, "the ranks wait in different collectives")
    missing = sorted(set(range(size)) - set(ranks))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        parts.append(
            f"no file from rank(s) {shown} within {wait_s:.0f} s (another node whose run_dir is "
            "not shared, or a rank that died)"
        )
    line = "; ".join(parts) if parts else "no rank wrote a diagnostics file"
    with (
        contextlib.suppress(OSError),
        open(os.path.join(folder, "summary.txt"), "w", encoding="utf-8") as f,
    ):
        f.write(line + "\n")
    return line


def newest(run_dir: str) -> str | None:
    """The newest diagnostics folder of a run directory (by its files' times)."""
    root = os.path.join(run_dir, FOLDER)
    try:
        names = [n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))]
    except OSError:
        return None
    if not names:
        return None
    return max((os.path.join(root, n) for n in names), key=os.path.getmtime)


def diagnose(run_dir: str) -> str:
    """`trainer diagnose RUN_DIR`: the summary and each rank's innermost frames, from the files."""
    from trainer.errors import UsageError

    folder = newest(run_dir)
    if folder is None:
        raise UsageError(
            f"trainer diagnose: {run_dir} holds no diagnostics/ (none is written unless a rank "
            "stalled or a collective failed): give the run folder of the job that hung"
        )
    lines = [f"{folder}:", summarize(folder)]
    for rank, h in sorted(read_rank_files(folder).items()):
        path = os.path.join(folder, f"rank-{rank}.txt")
        at = f" at {h['where']}" if h.get("where") else ""
        lines.append(f"  rank {rank}: {h.get('activity')}{at}  ({path})")
    return "\n".join(lines)
