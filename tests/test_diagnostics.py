"""When a job hangs or crawls (trainer/diagnostics/): a stalled rank is named with its stack
within the bound, on the console and in RUN_DIR/diagnostics/, and the job exits 4; a slow rank is
named within a few log windows; a balanced run names nobody."""

import json
import os
import random
import time

import pytest
import torch

from tests import netns
from tests.helpers import ROOT, read_jsonl, thread_wakeups, trainer
from trainer import cli, config, diagnostics
from trainer.diagnostics import Frame, Stragglers, activity, stall_bound
from trainer.errors import UsageError

TRAINER = str(ROOT / "trainer")
PLUGIN = str(ROOT / "tests" / "stall_plugins.py")
TORCH = os.path.dirname(torch.__file__)
STDLIB = os.path.dirname(os.__file__)

# --- the rules ---------------------------------------------------------------------------------


def test_the_stall_bound():
    assert stall_bound(5, 300, None) == 5 and stall_bound(0, 300, 0.1) == 0
    assert stall_bound(None, 300, None) == 270  # no step time yet: 90% of dist.timeout_s
    assert stall_bound(None, 300, 0.01) == 60  # 30 steps of 10 ms: at least a minute
    assert stall_bound(None, 300, 5.0) == 150  # 30 steps of 5 s
    assert stall_bound(None, 300, 60.0) == 270  # below dist.timeout_s, always
    with pytest.raises(UsageError, match="dist.stall_s=300 must be below dist.timeout_s=300"):
        config.load(None, ["dist.stall_s=300"])


def _watchdog(tmp_path, stall_s: float, fired: list):
    from trainer.diagnostics.stall import Watchdog, Where

    where = Where(rank=0, node=0, host="h", world_size=1, restart=0, run_dir=str(tmp_path))
    return Watchdog(where, stall_s, 300.0, exit=lambda code: fired.append((time.monotonic(), code)))


def test_the_watchdog_sleeps_until_a_stall_could_be_seen_and_fires_on_time(tmp_path, capsys):
    """It woke every 0.5 s (and at every evaluation's end) and took the GIL from the training
    loop each time (a busy CPU's steps paid for it: docs/benchmarks.md). Now it sleeps until the
    bound could first have passed; it still fires one bound after the last step, and never
    during a pause."""
    fired: list = []
    dog = _watchdog(tmp_path, 1.5, fired).start()
    try:
        time.sleep(0.1)
        before = thread_wakeups(dog._thread)
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # steps every 10 ms: nothing for the watchdog to look at
            dog.beat(dog.step + 1)
            time.sleep(0.01)
            if dog.step % 5 == 0:
                with dog.paused():  # an evaluation every 5 steps (an epoch of a small set)
                    time.sleep(0.002)
        assert thread_wakeups(dog._thread) - before <= 1, "the watchdog woke while steps were made"
        with dog.paused():  # an evaluation longer than the bound: no stall
            time.sleep(2.0)
        assert not fired
        resumed = time.monotonic()
        dog._thread.join(timeout=10)
        assert fired and fired[0][1] == 4, fired
        assert 1.5 <= fired[0][0] - resumed < 2.5, fired[0][0] - resumed
    finally:
        dog.close()
    assert "rank 0 (node 0, host h) has made no step for 2 s" in capsys.readouterr().err


def test_the_first_step_time_brings_the_watchdogs_deadline_closer(tmp_path, monkeypatch, capsys):
    """With dist.stall_s unset the bound is 90% of dist.timeout_s until a step time is known,
    then AUTO_STEPS steps (at least AUTO_MIN_S): the sleeping thread must wake to the nearer
    deadline, not name the stall at the first bound."""
    from trainer.diagnostics import stall

    monkeypatch.setattr(stall, "AUTO_MIN_S", 1.0)
    fired: list = []
    dog = _watchdog(tmp_path, None, fired)
    dog.timeout_s = 30.0  # 27 s before any step time is known
    dog.start()
    try:
        time.sleep(0.2)
        dog.beat(1)
        dog.observe(0.001)  # the first log window: a 1 ms step, the bound becomes 1 s
        last = time.monotonic()
        dog._thread.join(timeout=10)
        assert fired and fired[0][0] - last < 3.0, fired
    finally:
        dog.close()
    capsys.readouterr()


def test_a_pause_holding_the_gil_leaves_no_c_dump(tmp_path):
    """faulthandler's C dump (for a rank stuck in C holding the GIL) is cancelled when a pause
    begins, on the training thread: the watchdog's thread, asleep until its deadline, could not
    cancel it while an evaluation or a save held the GIL in C past the bound."""
    import ctypes

    fired: list = []
    dog = _watchdog(tmp_path, 0.5, fired).start()
    try:
        dog.beat(1)
        with dog.paused():
            ctypes.PyDLL(None).sleep(3)  # in C, the GIL held, 3 s > the bound + C_MARGIN_S
        dumps = list((tmp_path / "diagnostics").glob("*.faulthandler.txt"))
        assert dumps and all(p.stat().st_size == 0 for p in dumps), [
            p.read_text()[:300] for p in dumps
        ]
        assert not fired
    finally:
        dog.close()


@pytest.mark.parametrize(
    "frames, kind, where",
    [
        (  # a data plug-in sleeping in take()
            [("cli.py", "main"), ("loop.py", "fit"), ("data.py", "train_batches"),
             (PLUGIN, "take"), (f"{STDLIB}/threading.py", "wait")],
            "data loading",
            "take",
        ),
        (  # an all-reduce of the trainer's
            [("loop.py", "fit"), ("loop.py", "window_mean"), ("ranks.py", "all_reduce_sum")],
            "waits in all_reduce_sum",
            "all_reduce_sum",
        ),
        (  # DDP reduces gradients in the backward pass
            [("loop.py", "fit"), ("step.py", "_backward"), (f"{TORCH}/_tensor.py", "backward")],
            "waits in the backward pass (the gradient all-reduce)",
            None,
        ),
        (  # the user's model, slow or stuck in its forward
            [("loop.py", "fit"), ("step.py", "_backward"), ("/home/u/mypkg/model.py", "forward")],
            "compute",
            "forward",
        ),
    ],
)  # fmt: skip
def test_where_a_thread_is(frames, kind, where):
    full = [Frame(f if f.startswith("/") else f"{TRAINER}/{f}", 1, fn) for f, fn in frames]
    got, at = activity(full)
    assert got == kind and (at.func if at else None) == where


def test_stragglers_need_several_slow_windows_in_a_row_and_are_named_once():
    rng = random.Random(0)
    jitter = lambda: rng.uniform(0.6, 1.6)  # noqa: E731  (a noisy 2-core machine's spread)
    s = Stragglers(4)
    for _ in range(300):  # balanced: each rank's forward 10 ms x jitter, waits 1 ms x jitter
        out = s.window([0.01 * jitter() for _ in range(4)], [0.001 * jitter()] * 4, 1, 0.02)
        assert out == []
    slow = Stragglers(4)
    named = []
    for w in range(10):  # rank 2's forward 3x; rank 3 waits 8 ms a step for its data
        named += [
            (w, n.rank, n.kind)
            for n in slow.window([0.01, 0.01, 0.03, 0.01], [0, 0, 0, 0.008], 1, 0.035)
        ]
    assert named == [(4, 2, "compute"), (4, 3, "data")]  # the 5th window in a row
    rows = slow.table([(0, "a"), (0, "a"), (1, "b"), (1, "b")])
    assert rows[2]["straggler"] == ["compute"] and rows[2]["host"] == "b"
    assert rows[2]["forward_ms_per_step"] == pytest.approx(30.0)


def test_the_flight_recorder_is_on_for_gpu_jobs_unless_set():
    env = diagnostics.flight_recorder_env("runs/x", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "runs/x/diagnostics/nccl/trace-rank-"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env  # the user's choice stands


def test_diagnose_without_diagnostics_is_one_line(tmp_path, capsys):
    assert cli.main(["diagnose", str(tmp_path)]) == 2
    assert "holds no diagnostics/" in capsys.readouterr().err


# --- a stalled rank ----------------------------------------------------------------------------

HANG = [
    "model.hidden=[32]",
    "dist.stall_s=3",
    "dist.timeout_s=120",  # without the watchdog, the job would end only after this
    "log.every_steps=5",
    "log.progress=plain",
    "log.tensorboard=false",
]


@pytest.mark.parametrize(
    "plugin, blocked",
    [  # hung in Python: the two-node test below, where namespaces can be made (root)
        pytest.param("hanging", False, marks=pytest.mark.skipif(
            not netns.unavailable(), reason="the two-node test hangs rank 1 in Python")
        ),
        ("hanging_in_c", True),
    ],
)  # fmt: skip
def test_a_stalled_rank_is_named_with_its_stack_and_the_job_exits_4(tmp_path, plugin, blocked):
    """Rank 1's data plug-in hangs after 30 batches: in Python, or in C holding the GIL (its
    watchdog cannot run; faulthandler's C thread dumps it). Every rank writes its file, rank 0
    names rank 1 and its frame, and the job exits 4 long before dist.timeout_s."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    p = trainer(
        "train", f"data.name=tests.stall_plugins:{plugin}", *HANG, f"run_dir={run_dir}",
        nproc=2, torchrun=False, check=False, timeout=100,
    )  # fmt: skip
    took = time.monotonic() - started
    assert p.returncode == 4, p.stderr[-3000:]
    assert took < 60, took
    lines = [line for line in p.stderr.splitlines() if "trainer: error: rank 1 " in line]
    assert lines, p.stderr[-3000:]
    line = lines[0]
    assert "tests/stall_plugins.py" in line and "take" in line and "data loading" in line
    assert "rank 0 waits in the backward pass" in line and "trainer diagnose" in line
    assert ("blocked outside Python" in line) == blocked
    folder = run_dir / "diagnostics" / "restart0-step-30"
    rank0 = json.loads((folder / "rank-0.txt").read_text().splitlines()[0])
    assert rank0["step"] == 30 and rank0["last_collective"].startswith("all_reduce #")
    assert "--- thread MainThread ---" in (folder / "rank-0.txt").read_text()
    if blocked:  # rank 1's own words are faulthandler's
        dump = (run_dir / "diagnostics" / ".restart0-rank-1.faulthandler.txt").read_text()
        assert "stall_plugins.py" in dump and "in take" in dump
    else:
        rank1 = (folder / "rank-1.txt").read_text()
        assert json.loads(rank1.splitlines()[0])["activity"] == "data loading"
        assert "time.sleep(600)" in rank1
    out = diagnostics.diagnose(str(run_dir))
    assert "rank 1" in out and "stall_plugins.py" in out and str(folder) in out


# --- slow and balanced ranks ---------------------------------------------------------------------


def test_slow_ranks_are_named_within_a_few_log_windows(tmp_path):
    """Rank 1's forward sleeps 30 ms, rank 0's data 30 ms: each is named after 5 windows."""
    run_dir = tmp_path / "run"
    p = trainer(
        "train", "model.name=tests.stall_plugins:slow_forward", "data.name=tests.stall_plugins:slow_data",
        "train.max_steps=16", "log.every_steps=2", "log.progress=plain", "log.tensorboard=false",
        f"run_dir={run_dir}", nproc=2, torchrun=False,
    )  # fmt: skip
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "straggler"]
    assert {(r["rank"], r["slow"]) for r in records} == {(1, "compute"), (0, "data")}
    assert all(r["step"] <= 10 and r["host"] and r["node"] == 0 for r in records), records
    assert "straggler: rank 1 (node 0, host" in p.stdout and "its forward pass" in p.stdout
    table = json.loads((run_dir / "summary.json").read_text())["ranks"]
    assert table[1]["forward_ms_per_step"] > 25 > table[0]["forward_ms_per_step"]
    assert table[0]["data_wait_ms_per_step"] > 25 > table[1]["data_wait_ms_per_step"]
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert all(len(r["rank_forward_ms"]) == 2 for r in train)
    # trainer report draws the per-rank panel and tables it
    from trainer.report import write_report

    paths = write_report([str(run_dir)], str(tmp_path / "report"), note=lambda _: None)
    assert any(p.endswith("ranks.png") for p in paths)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| 1 | 0 |" in md and "| compute |" in md and "| data |" in md


def test_a_balanced_run_names_no_straggler(reference_runs):
    """The session's reference run on 2 ranks (a record every step: 69 windows), made while the
    suite's other worker runs jobs of its own: quiet. (The note reports repeated runs.)"""
    run_dir = reference_runs(2)
    kinds = [r["kind"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert kinds.count("train") == 69 and "straggler" not in kinds
    table = json.loads((run_dir / "summary.json").read_text())["ranks"]
    assert [row["straggler"] for row in table] == [[], []]
    assert all(row["forward_ms_per_step"] > 0 for row in table)


# --- across two nodes, through trainer-launch ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.long  # 25 s: make test-long (make test stays in its 12 minutes)
@pytest.mark.netns
def test_a_hang_on_the_second_node_is_named_through_trainer_launch(tmp_path):
    """Two network-namespace "nodes" run the compose two-node services' trainer-launch; rank 1
    (node 1) hangs: node 0 names it, with its host, and both nodes exit 4."""
    if reason := netns.unavailable():
        pytest.skip(reason)
    from tests.test_compose import _run_two_nodes

    args = " ".join(["data.name=tests.stall_plugins:hanging", *HANG[:-1]])
    with netns.Network(2, hosts={"node0": 0, "node1": 1}) as net:
        out = _run_two_nodes(tmp_path, net, args, codes=(4, 4))
    named = [line for line in out[0].splitlines() if "error: rank 1 (node 1, host" in line]
    assert named and "stall_plugins.py" in named[-1] and "data loading" in named[-1], out[0][-3000:]
    run_dir = tmp_path / "runs" / "two-node" / "digits-mlp"
    assert sorted(p.name for p in (run_dir / "diagnostics").glob("*/rank-*.txt")) == [
        "rank-0.txt",
        "rank-1.txt",
    ]
