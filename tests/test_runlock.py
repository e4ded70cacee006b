"""One job per run folder (trainer/runlock.py): who may take a lock another job left.

The real processes (torchrun SIGKILLed, a second job refused, the rerun) are in
tests/test_faults.py; these are the rules, with holders written by hand."""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import pytest

from trainer import runlock
from trainer.errors import ConfigError
from trainer.runlock import LOCK, Holder, RunLock


def _leave(run_dir, holder: Holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK).write_text(json.dumps(asdict(holder)))


def _holder(**changes) -> Holder:
    return replace(Holder.here({}), **changes)


def test_a_live_job_on_this_machine_is_refused_naming_it(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        live = _holder(pid=sleeper.pid, process_start=runlock._started(sleeper.pid))
        _leave(tmp_path / "run", live)
        with pytest.raises(ConfigError) as e:
            RunLock(tmp_path / "run", {}).acquire()
        text = str(e.value)
        assert f"is in use by another job: rank 0 on {live.host}, pid {sleeper.pid}, since" in text
        assert "\n" not in text and "use another run_dir" in text
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_holder_a_reused_pid_and_the_same_job_are_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cases = [
        _holder(pid=dead.pid, process_start="1"),  # gone
        _holder(pid=os.getppid(), process_start="1"),  # alive, but another process than its
        _holder(pid=os.getppid(), process_start=runlock._started(os.getppid()), job="rdzv-1"),
    ]
    for old in cases:
        _leave(run_dir, old)
        lock = RunLock(run_dir, {"TORCHELASTIC_RUN_ID": "rdzv-1"}).acquire()
        assert lock is not None
        assert json.loads((run_dir / LOCK).read_text())["token"] == lock.me.token
        lock.release()
        assert not (run_dir / LOCK).exists()


def test_a_holder_elsewhere_is_gone_once_its_heartbeat_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "STALE_S", 0.6)
    monkeypatch.setattr(runlock, "BEAT_S", 0.1)
    run_dir = tmp_path / "run"
    started = time.monotonic()  # before its beat: a beat STALE_S old by the clock is gone
    silent = _holder(machine="another-node", beat=time.time())
    _leave(run_dir, silent)
    lock = RunLock(run_dir, {}).acquire()  # watched for STALE_S, never beat: taken over
    assert lock is not None and time.monotonic() - started >= 0.6
    lock.release()
    beating = _holder(machine="another-node", beat=time.time())
    _leave(run_dir, beating)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            beating.beat = time.time()
            _leave(run_dir, beating)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(ConfigError, match="is in use by another job: rank 0 on"):
            RunLock(run_dir, {}).acquire()
    finally:
        stop.set()
        thread.join()
    old = _holder(machine="another-node", beat=time.time() - 10)  # stale by this clock too
    _leave(run_dir, old)
    started = time.monotonic()
    RunLock(run_dir, {}).acquire().release()
    assert time.monotonic() - started < 0.5


def test_the_holder_beats_and_a_failed_start_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "BEAT_S", 0.05)
    run_dir = tmp_path / "a" / "run"
    lock = RunLock(run_dir, {}).acquire()
    first = json.loads((run_dir / LOCK).read_text())["beat"]
    time.sleep(0.3)
    assert json.loads((run_dir / LOCK).read_text())["beat"] > first
    lock.release()
    assert not (tmp_path / "a").exists()  # the folders it made, empty again, are gone
    (tmp_path / "file").write_text("x")
    assert RunLock(tmp_path / "file" / "run", {}).acquire() is None  # cannot be written: no lock


def _slow_storage(seed: int) -> None:
    """This process's renames and links take 0-80 ms, as on a busy NFS server."""
    import random

    rng = random.Random(seed)
    for name in ("replace", "link"):
        fast = getattr(os, name)

        def slow(*args, _fast=fast, **kwargs):
            time.sleep(rng.uniform(0, 0.08))
            return _fast(*args, **kwargs)

        setattr(os, name, slow)


def _contender(run_dir, start, done, results, seed, slow=True) -> None:
    """One job's rank 0 starting at the same moment as the others on slow storage: it takes the
    lock or is refused; a winner holds it until every contender has tried."""
    if slow:
        _slow_storage(seed)
    start.wait()
    try:
        lock = RunLock(run_dir, {}).acquire()
        results.put("won" if lock is not None else "no folder")
    except ConfigError:
        lock = None
        results.put("refused")
    done.wait()
    if lock is not None:
        lock.release()


def _race(ctx, contender, run_dir, seed: int) -> list[str]:
    """Four contenders for `run_dir` started at once: their outcomes, sorted."""
    start, done, results = ctx.Barrier(4), ctx.Barrier(4), ctx.Queue()
    jobs = [
        ctx.Process(target=contender, args=(run_dir, start, done, results, seed + i))
        for i in range(4)
    ]
    for j in jobs:
        j.start()
    outcomes = sorted(results.get(timeout=30) for _ in jobs)
    for j in jobs:
        j.join(timeout=30)
    return outcomes


@pytest.mark.parametrize("left_behind", [False, True], ids=["empty folder", "a dead job's lock"])
def test_of_jobs_racing_for_a_folder_exactly_one_wins_every_time(tmp_path, left_behind):
    """Four jobs start at once on one folder (empty, or holding a dead job's lock) on storage
    whose renames and links are slow, 20 times: one wins each time, the others are refused in
    one line (the lock is an atomic create: a hard link, and a takeover goes through a
    tombstone only one newcomer can make). The write, rename, wait 50 ms and look again that
    this replaced let two jobs win here."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for round_ in range(20):
        run_dir = tmp_path / f"run{round_}"
        if left_behind:
            _leave(run_dir, _holder(pid=dead.pid, process_start="1"))
        outcomes = _race(ctx, _contender, run_dir, 4 * round_)
        assert outcomes == ["refused", "refused", "refused", "won"], (round_, outcomes)
        left = sorted(os.listdir(run_dir)) if run_dir.exists() else []
        assert left == [], (round_, left)  # no lock, tombstone or temporary file left


def test_a_lock_that_is_not_a_file_is_one_line_not_a_hang(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / LOCK)
    with pytest.raises(ConfigError, match="is not a regular file.*remove it"):
        RunLock(run_dir, {}).acquire()


def _no_hard_links(seed: int) -> None:
    """Storage that refuses hard links (some FUSE, SMB and object-store mounts)."""
    import errno

    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    os.link = refuse


def _contender_without_links(run_dir, start, done, results, seed) -> None:
    _no_hard_links(seed)
    _contender(run_dir, start, done, results, seed, slow=False)


def test_storage_without_hard_links_gets_an_exclusive_create_and_a_rename_takeover(tmp_path):
    """Where links are refused the lock is an O_EXCL create (four racing jobs, 10 times: one
    wins), and a dead job's lock is taken over by renaming it away."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for round_ in range(10):
        outcomes = _race(ctx, _contender_without_links, tmp_path / f"run{round_}", 0)
        assert outcomes == ["refused", "refused", "refused", "won"], (round_, outcomes)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "dead"
    _leave(run_dir, _holder(pid=dead.pid, process_start="1"))
    original = os.link
    _no_hard_links(0)
    try:
        lock = RunLock(run_dir, {}).acquire()
        assert json.loads((run_dir / LOCK).read_text())["token"] == lock.me.token
        lock.release()
    finally:
        os.link = original
    assert os.listdir(run_dir) == []


def test_torchruns_run_id_none_is_no_job_to_share_a_lock_with():
    """torchrun sets TORCHELASTIC_RUN_ID=none where it has no --rdzv-id: two such jobs are not
    one job's restarts."""
    assert Holder.here({"TORCHELASTIC_RUN_ID": "none"}).job is None
    assert Holder.here({"TORCHELASTIC_RUN_ID": "abc"}).job == "abc"


def test_the_next_holder_sweeps_tombstones_a_killed_job_left(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / f"{LOCK}.gone-12-34").write_text("{}")  # a job killed after its takeover
    lock = RunLock(run_dir, {}).acquire()
    assert sorted(os.listdir(run_dir)) == [LOCK]
    lock.release()
    assert os.listdir(run_dir) == []
