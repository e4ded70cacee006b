"""One job per run folder.

Rank 0 holds RUN_DIR/.job.lock while a job runs: a small JSON record of who holds it (host, pid,
since when, the job's torchrun run id) with a heartbeat it rewrites every BEAT_S by an atomic
rename. A second job that would write into the folder is refused in one line naming the holder,
exit 2.

Taking the lock is an atomic create that works on the shared volumes runs live on (a PVC, NFS):
the record is written to a file of its own and hard-linked to the lock's name, which fails when
the name exists (O_EXCL's guarantee, kept on NFS, where O_EXCL itself was not always). Of two
jobs starting at once exactly one gets the lock. A lock whose holder is gone is taken over the
same way: the newcomer links the dead lock to a tombstone named after that very file (its inode
and time), which only one newcomer can create, and only that one replaces the lock (by rename).
A tombstone is removed with the lock it stood for.

A well-formed lock a job left behind never blocks the next one; the holder is gone when:

- it is the same job: a torchrun restart (--max-restarts) has the same TORCHELASTIC_RUN_ID;
- it ran on this machine (same boot, same pid namespace) and its pid is dead, or is another
  process now (its start time differs);
- it ran elsewhere (another node or container) and its heartbeat stops: the newcomer watches it
  for up to STALE_S (or takes over at once when it is older than that by this machine's clock).

Anything else where the lock belongs (a directory, a FIFO, a link, a socket, a file that cannot
be read, is not JSON or holds a record with a field missing or of the wrong type) names no
holder, so it is neither taken over nor read as no lock: one line (BadLock) naming the file and
the fix, exit 2. The lock is looked at before it is read (lstat, an open that neither blocks nor
follows a link, at most MAX_BYTES read), so nothing put there can hang the job. A job's own
record is written beside the lock, then linked or renamed into place (on storage without hard
links it is created, then written: a newcomer gives a lock under 2 s old a second to be
written). A job killed while creating it there, or a machine that crashed before its page cache
reached the disk, can leave an empty lock; the next job then stops with that line rather than
guess who held the folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from trainer import jsonfile
from trainer.errors import ConfigError, file_kind, shorten

LOCK = ".job.lock"
BEAT_S = 5.0
"""How often the holder rewrites its heartbeat."""
STALE_S = 30.0
"""A holder elsewhere whose heartbeat has not moved for this long is gone."""


def _machine() -> str:
    """This boot of this machine and this pid namespace: where a pid means the same process."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc: the host name is the best there is
        return socket.gethostname()
    return f"{boot}:{namespace}"


def _started(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Holder:
    host: str
    pid: int
    machine: str
    process_start: str | None
    since: float
    beat: float
    job: str | None
    """TORCHELASTIC_RUN_ID: the same across torchrun's restarts of one job."""
    token: str

    @classmethod
    def here(cls, environ: Mapping[str, str]) -> Holder:
        now = time.time()
        job = environ.get("TORCHELASTIC_RUN_ID")  # "none": torchrun given no --rdzv-id
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            machine=_machine(),
            process_start=_started(os.getpid()),
            since=now,
            beat=now,
            job=job if job not in (None, "", "none") else None,
            token=uuid.uuid4().hex,
        )

    def same_job(self, other: Holder) -> bool:
        return self.job is not None and self.job == other.job

    def dead_here(self) -> bool:
        """On this machine: its process is gone (or its pid is another process's now)."""
        started = _started(self.pid)
        return started is None or started != self.process_start

    def line(self, run_dir: str) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return (
            f"run_dir {run_dir} is in use by another job: rank 0 on {self.host}, pid {self.pid}, "
            f"since {since} (heartbeat {max(0.0, time.time() - self.beat):.0f} s ago): wait for "
            f"it to end or stop it, or use another run_dir (a job that died leaves its lock to "
            "the next one)"
        )


MAX_BYTES = 64 * 1024
"""A holder's record is a few hundred bytes: a lock file bigger than this is not one (and no
more than this is ever read of it)."""
FRESH_S = 2.0
"""A lock that is not a record yet may be one being written (an O_EXCL create on storage without
hard links is empty until its record lands): one this young is watched a moment, not refused."""
LATEST = 1e11
"""A recorded time (seconds since 1970) past this (the year 5138) is no clock's."""
PID_MAX = 1 << 22
"""Linux's largest pid (PID_MAX_LIMIT): a recorded pid outside 1..PID_MAX is no process's."""


class BadLock(ConfigError):
    """RUN_DIR/.job.lock is not a job's record (a directory, a FIFO, a link, unreadable, not
    JSON, a field of the wrong type): one line naming the file and the fix. Never read as no
    lock (an unlocked run) nor as a dead holder's (a takeover): who holds the folder is unknown.

    `ident`: the file's (inode, mtime) when it is a regular file (its content is what is wrong,
    and it may still be being written), else None."""

    def __init__(self, path: str, problem: str, ident: tuple[int, int] | None = None):
        super().__init__(
            f"{path}: the run folder's job lock {problem}: remove it if no job uses this "
            "folder, or use another run_dir"
        )
        self.ident = ident


def _not_regular(mode: int) -> str:
    return f"is not a regular file but {file_kind(mode)}"


def _read(path: str) -> tuple[Holder | None, tuple[int, int] | None]:
    """(the holder recorded at `path`, the file's identity: inode and modification time);
    (None, None) when there is no lock. Looked at before it is read (lstat, then an open that
    neither blocks nor follows a link, and at most MAX_BYTES read): anything but a regular file
    holding a well-formed record raises BadLock, so a FIFO cannot hang the job, and a lock
    nobody can read is neither ignored nor taken over."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        raise BadLock(path, f"cannot be looked at ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise BadLock(path, _not_regular(info.st_mode))
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link put there since the lstat
            raise BadLock(path, _not_regular(stat.S_IFLNK)) from None
        raise BadLock(path, f"cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)  # what was opened, whatever the name pointed at before
        if not stat.S_ISREG(info.st_mode):
            raise BadLock(path, _not_regular(info.st_mode))
        ident = (info.st_ino, info.st_mtime_ns)
        if info.st_size > MAX_BYTES:
            raise BadLock(path, f"is {info.st_size:,} bytes, not a job's record", ident)
        data = b""
        while len(data) <= MAX_BYTES and (block := os.read(fd, MAX_BYTES + 1 - len(data))):
            data += block
    except OSError as e:
        raise BadLock(path, f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:  # it grew since the fstat
        raise BadLock(path, f"is over {MAX_BYTES:,} bytes, not a job's record", ident)
    try:
        return _holder(data), ident
    except ValueError as e:
        raise BadLock(path, f"is not a job's record ({e})", ident) from None


_TEXT = (str,)
_FIELDS = {
    "host": _TEXT,
    "pid": (int,),
    "machine": _TEXT,
    "process_start": (str, type(None)),
    "since": (int, float),
    "beat": (int, float),
    "job": (str, type(None)),
    "token": _TEXT,
}


def _holder(data: bytes) -> Holder:
    """The Holder a lock file's bytes record, or ValueError saying what is wrong with them."""
    if not data.strip():
        raise ValueError("empty")
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    if missing := [name for name in _FIELDS if name not in record]:
        raise ValueError(f"no '{missing[0]}' field")
    for name, types in _FIELDS.items():
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else f"{shown[:30]}..."
            want = {"pid": "a whole number", "since": "a number", "beat": "a number"}
            raise ValueError(f"'{name}' is {shown}, not {want.get(name, 'a string')}")
    if not 0 < record["pid"] <= PID_MAX:
        raise ValueError(f"'pid' is {shorten(str(record['pid']))}, no process's")
    for name in ("since", "beat"):  # seconds since 1970: a time a clock can show
        if not 0 <= record[name] < LATEST:  # NaN and infinities too
            raise ValueError(f"'{name}' is {shorten(str(record[name]))}, not a time")
    return Holder(**{name: record[name] for name in _FIELDS})


def _fresh(path: str) -> bool:
    """Whether the file at `path` was modified within FRESH_S (by this machine's clock; a time
    ahead of it, another machine's clock, counts as fresh)."""
    try:
        return time.time() - os.lstat(path).st_mtime < FRESH_S
    except OSError:
        return False


def _write(path: str, holder: Holder) -> None:
    """The holder's record over the lock, atomically (its heartbeat)."""
    jsonfile.write_json(path, asdict(holder), tag=holder.token)


class NoHardLinks(OSError):
    """The run folder's storage makes no hard links (some FUSE, SMB and object-store mounts)."""


_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def _link(src: str, dst: str, private: bool) -> bool:
    """Hard-link `src` as `dst`; False when `dst` exists (or has gone). Over NFS a link whose
    reply was lost raises though it was made: where `src` is this job's own file (`private`),
    its link count says whether it was; elsewhere that is not knowable, and counts as lost."""
    try:
        os.link(src, dst)
        return True
    except (FileExistsError, FileNotFoundError):
        return False
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOENT):
            return False
        if e.errno in _NO_LINKS:
            raise NoHardLinks(e.errno, f"no hard links on this storage: {e}") from None
        if not private:
            return False
        with contextlib.suppress(OSError):
            if os.stat(src).st_nlink == 2:
                return True
        raise


def _create_exclusive(path: str, holder: Holder) -> bool:
    """The lock made with O_EXCL (storage without hard links); False when it exists. A reader
    may see it empty for the moment between the create and the write: it waits (_take)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(holder), f)
    return True


class RunLock:
    """Rank 0's hold on a run folder: `acquire`, then `release` at the end."""

    def __init__(self, run_dir: str, environ: Mapping[str, str] = os.environ):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK)
        self.me = Holder.here(environ)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created: list[str] = []
        """The folders acquire made (deepest first): removed again if the job leaves them empty."""
        self._tombs: list[str] = []
        """The tombstone of the dead lock this job took over: removed with this job's lock."""
        self._hardlinks = True
        """False once the storage refused a hard link: O_EXCL creates, rename takeovers."""

    def acquire(self) -> RunLock | None:
        """Hold the folder, or raise ConfigError naming the live job that holds it. None (and no
        lock) where the folder cannot be written: nothing can be corrupted there, and the
        checks that follow say what is wrong with it."""
        try:
            self._created = _missing_folders(self.run_dir)
            os.makedirs(self.run_dir, exist_ok=True)
            return self._take()
        except OSError:
            self._remove_created()
            return None

    def _take(self) -> RunLock:
        beat: tuple[float, float] | None = None  # (a foreign holder's beat, seen since)
        taking: tuple[tuple, float] | None = None  # (a dead lock another newcomer takes, since)
        unreadable: tuple[tuple, float] | None = None  # (a lock that is not a record, since)
        while True:
            if self._create():
                return self._beating()
            try:
                holder, ident = _read(self.path)
            except BadLock as e:  # a new lock still being written (no hard links) waits a moment
                now = time.monotonic()
                if e.ident is None or not _fresh(self.path):
                    raise
                if unreadable is None or unreadable[0] != e.ident:
                    unreadable = (e.ident, now)
                if now - unreadable[1] >= 1.0:
                    raise
                time.sleep(0.05)
                continue
            if ident is None:  # gone between the create and the read: try again
                time.sleep(0.01)
                continue
            now = time.monotonic()
            if self._gone(holder):
                if self._replace(ident):
                    return self._beating()
                # Another newcomer is taking it over: it wins, or died doing so (its tombstone
                # stands STALE_S while the dead lock stays as it was: removed, try again).
                if taking is None or taking[0] != ident:
                    taking = (ident, now)
                elif now - taking[1] >= STALE_S:
                    with contextlib.suppress(OSError):
                        os.remove(self._tomb(ident))
                time.sleep(0.01)
                continue
            if holder.machine == self.me.machine:  # alive here
                raise ConfigError(holder.line(self.run_dir))
            if beat is None or beat[0] != holder.beat:
                if beat is not None:  # its heartbeat moved: alive
                    raise ConfigError(holder.line(self.run_dir))
                beat = (holder.beat, now)
            elif now - beat[1] >= STALE_S:  # silent for STALE_S: gone
                if self._replace(ident):
                    return self._beating()
                continue
            time.sleep(min(1.0, BEAT_S / 5))

    def _create(self) -> bool:
        """The lock made with this job's record, if no lock exists (atomic: a hard link; an
        O_EXCL create where the storage makes no hard links)."""
        if not self._hardlinks:
            return _create_exclusive(self.path, self.me)
        mine = f"{self.path}.{self.me.token}.new"
        jsonfile.write_json(mine, asdict(self.me), tag=self.me.token)
        try:
            return _link(mine, self.path, private=True)
        except NoHardLinks:
            self._hardlinks = False
            return _create_exclusive(self.path, self.me)
        finally:
            with contextlib.suppress(OSError):
                os.remove(mine)

    def _tomb(self, ident: tuple[int, int]) -> str:
        return f"{self.path}.gone-{ident[0]}-{ident[1]}"

    def _replace(self, ident: tuple[int, int]) -> bool:
        """Take over the lock file `ident` (its holder is gone): only the newcomer that links it
        to its tombstone does, and only if the lock is still that file."""
        tomb = self._tomb(ident)
        try:
            if self._hardlinks and not _link(self.path, tomb, private=False):
                return False
        except NoHardLinks:
            self._hardlinks = False
        if not self._hardlinks:  # rename the dead lock away (a rename keeps the file's inode)
            try:
                os.rename(self.path, tomb)
            except FileNotFoundError:
                return False
        info = os.stat(tomb)
        if (info.st_ino, info.st_mtime_ns) != ident:  # the lock changed meanwhile: not ours
            if not self._hardlinks:
                os.rename(tomb, self.path)  # put back what was moved away
            else:
                os.remove(tomb)
            return False
        self._tombs.append(tomb)
        try:
            if self._hardlinks:
                _write(self.path, self.me)
                return True
            return self._create()
        except BaseException:
            self._tombs.remove(tomb)
            with contextlib.suppress(OSError):
                os.remove(tomb)  # others may take the dead lock over again
            raise

    def _sweep(self) -> None:
        """Once this job holds the lock: the tombstones of locks taken over before (a job
        killed after a takeover leaves its own) and temporary files a killed job left."""
        folder, name = os.path.split(self.path)
        now = time.time()
        for entry in os.listdir(folder):
            path = os.path.join(folder, entry)
            if not entry.startswith(name + ".") or path in self._tombs:
                continue
            with contextlib.suppress(OSError):
                tomb = entry.startswith(name + ".gone-")
                if tomb or now - os.stat(path).st_mtime > 600:  # .new/.tmp: a killed writer's
                    os.remove(path)

    def _gone(self, holder: Holder) -> bool:
        if holder.same_job(self.me):
            return True
        if holder.machine == self.me.machine:
            return holder.dead_here()
        return time.time() - holder.beat > STALE_S

    def _beating(self) -> RunLock:
        self._sweep()
        self._thread = threading.Thread(target=self._beat, name="trainer-runlock", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            holder = None
            with contextlib.suppress(ConfigError):
                holder = _read(self.path)[0]
            if holder is not None and holder.token != self.me.token:
                return  # taken over (this job was given up for dead): nothing more to say
            self.me.beat = time.time()
            with contextlib.suppress(OSError):  # a full disk costs a beat, not the run
                _write(self.path, self.me)

    def release(self) -> None:
        """Stop beating and remove the lock if it is still this job's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(ConfigError):
            holder = _read(self.path)[0]
            if holder is not None and holder.token == self.me.token:
                with contextlib.suppress(OSError):
                    os.remove(self.path)
        for tomb in self._tombs:
            with contextlib.suppress(OSError):
                os.remove(tomb)
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self._created:  # a run that failed before writing anything leaves none
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _missing_folders(path: str) -> list[str]:
    """The folders makedirs(path) would create, deepest first."""
    missing = []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing
