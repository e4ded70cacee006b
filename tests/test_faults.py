"""Faults and preflight: dry run, doctor, re-runs. (SIGKILLed ranks under torchrun's restarts,
killed twice, one per rank: tests/test_example.py, on the ratings example.)"""

import contextlib
import hashlib
import json
import os
import subprocess
import time

import pytest
import torch

from tests import helpers
from tests.helpers import ROOT, trainer, weights
from trainer import config, doctor

TINY = [
    *helpers.TINY,
    "train.epochs=2",
    "log.progress=none",
]


def _tree_digest(folder):
    h = hashlib.sha256()
    for root, _dirs, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                h.update(path.encode() + f.read())
    return h.hexdigest()


@pytest.mark.slow
def test_dry_run_exercises_the_tail_batch_and_a_checkpoint_round_trip_and_keeps_nothing(tmp_path):
    run_dir = tmp_path / "run"
    helpers.train_here("train", *TINY, f"run_dir={run_dir}")  # a finished run: no process start
    before = _tree_digest(run_dir)
    p = trainer(
        "train", "--dry-run", *TINY, "train.epochs=3", f"run_dir={run_dir}", nproc=2,
        torchrun=False,
    )  # fmt: skip
    # 9 samples in batches of 4: the last global batch holds 1 sample for 2 ranks.
    assert "dry run ok: last batch (step 3/3, 1 samples over 2 rank(s))" in p.stdout
    assert "checkpoint" in p.stdout and "saved, verified and loaded" in p.stdout
    assert _tree_digest(run_dir) == before  # nothing written, nothing lost


def test_a_fresh_dry_run_round_trips_a_real_checkpoint_and_leaves_no_run_behind(
    tmp_path, monkeypatch
):
    """In this process: the round trip writes bytes, verifies them and compares the weights."""
    from trainer.checkpoint import store
    from trainer.checkpoint.manager import Checkpointer
    from trainer.train import train

    verified, compared = [], []
    real_verify, real_same = store.verify, Checkpointer._holds_live_weights
    monkeypatch.setattr(store, "verify", lambda p: verified.append(p) or real_verify(p))
    monkeypatch.setattr(
        Checkpointer, "_holds_live_weights", lambda c, p: compared.append(p) or real_same(c, p)
    )
    fresh = tmp_path / "fresh"
    report = train(config.load(None, [*TINY, f"run_dir={fresh}"]), dry_run=True)
    assert report["checkpoint"]["bytes"] > 0 and verified and compared == verified
    assert not fresh.exists() or not any(fresh.rglob("*.json"))


def test_the_dry_run_shows_what_summarize_returned_for_its_eval_batch(tmp_path, capsys):
    from trainer.train import train

    report = train(config.load(None, [*TINY, f"run_dir={tmp_path / 'run'}"]), dry_run=True)
    got = report["eval_batch"]["metrics"]
    assert set(got) == {"loss", "accuracy", "count"} and got["count"] == 7  # the 7 test samples
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "dry run ok" in line]
    shown = f"eval batch 7 samples (loss {got['loss']:.4g}, accuracy {got['accuracy']:.4g}) |"
    assert shown in line, line


def test_dry_run_fails_fast_on_a_non_finite_loss(tmp_path):
    p = trainer(
        "train",
        "--dry-run",
        *TINY,
        "model.name=tests.helpers:nan_model",
        f"run_dir={tmp_path}",
        check=False,
    )
    assert p.returncode == 2
    assert "dry run: the loss on the last batch is nan" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_doctor_reports_and_fails_on_a_broken_env(capsys, monkeypatch):
    p = trainer("doctor", check=False)  # the installed command once, end to end
    assert p.returncode == 0, p.stdout
    for name in (
        "GPUs",
        "gloo",
        "/dev/shm",
        "ulimit memlock",
        "torchrun env",
        "config",
        "data",
        "run_dir",
    ):
        assert name in p.stdout
    # The failures in this process (cli.main, what the command runs), in helpers.env()'s clean
    # environment: no process start and torch import each.
    from trainer import cli
    from trainer.ranks import TORCHRUN_VARS

    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code = cli.main(["doctor", "data.name=nope"])
    assert code == 2 and "FAIL  config" in capsys.readouterr().out
    for name, value in {"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["doctor"])
    out = capsys.readouterr().out
    assert code == 2 and "FAIL  torchrun env" in out and "RANK=5 must be < WORLD_SIZE=2" in out


def test_doctor_warns_about_a_small_dev_shm(monkeypatch):
    small = os.statvfs_result((4096, 4096, 16384, 16384, 16384, 0, 0, 0, 0, 255))  # 64 MiB
    monkeypatch.setattr(doctor.os, "statvfs", lambda _p: small)
    level, _, detail = doctor.check_shm()
    assert level == "warn" and "0.06 GiB" in detail and "shm_size" in detail


@pytest.mark.slow
def test_from_reruns_a_run_exactly_and_records_where_it_ran(tmp_path):
    run_dir = tmp_path / "run"
    # a fresh interpreter (not the warm server's fork): its run.json records its own start-up
    trainer("train", *TINY, "model.dropout=0.0", f"run_dir={run_dir}", warm=False)
    trainer("train", "--from", str(run_dir))
    a, b = weights(run_dir), weights(run_dir / "rerun")
    assert all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["world_size"] == 1 and record["seed"] == 0 and len(record["hostnames"]) == 1
    assert record["versions"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:  # a git checkout (CI clones one): the record names its commit
        assert record["git"]["commit"] == head.stdout.strip()
        assert isinstance(record["git"]["dirty"], bool)
    else:
        assert record["git"] is None
    assert record["argv"][-1] == f"run_dir={run_dir}"
    # The process's own entry point set up with the collector off (trainer/startup.py): no
    # automatic collection ran between the command's start and the first step.
    assert record["startup"]["gc_collections"] == 0 and record["startup"]["seconds"] > 0


def test_an_image_names_its_commit_without_git(monkeypatch):
    from trainer import repro

    monkeypatch.setenv("TRAINER_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("PATH", "/nonexistent")  # no git binary, as in the image
    assert repro.git_commit() == {"commit": "0123abc", "dirty": None}
    monkeypatch.delenv("TRAINER_GIT_COMMIT")
    assert repro.git_commit() is None


def test_repro_deterministic_turns_on_deterministic_algorithms(tmp_path, monkeypatch):
    """On during the run (seen from the model factory), and off again after it: nothing global
    outlives a run in the caller's process (trainer.fit, tests)."""
    import torch

    import trainer as api
    from tests.helpers import tiny, tiny_model

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = {}

    def probe(num_classes, in_shape):
        seen["on"] = torch.are_deterministic_algorithms_enabled()
        seen["cudnn"] = torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        return tiny_model(num_classes, in_shape)

    before = torch.are_deterministic_algorithms_enabled()
    overrides = [*TINY[2:], f"run_dir={tmp_path}", "repro.deterministic=true", "dist.device=cpu"]
    api.fit(None, overrides, model=probe, data=tiny, exit_on_error=False)
    assert seen == {"on": True, "cudnn": True, "cublas": ":4096:8"}
    assert torch.are_deterministic_algorithms_enabled() == before


def test_a_rank_sees_its_launcher_end_without_polling_for_it():
    """The watch sleeps on a pidfd of the launcher: no wake-up while it runs (a thread that
    looked twice a second took the GIL from a busy CPU's steps), and the end noticed at once."""
    import threading

    from trainer.orphans import LauncherWatch

    launcher = subprocess.Popen(["sleep", "60"])
    gone = threading.Event()
    watch = LauncherWatch({"TORCHELASTIC_RUN_ID": "x"}, end=gone.set, parent=launcher.pid)
    watch.start()
    try:
        time.sleep(0.2)
        before = helpers.thread_wakeups(watch._thread)
        time.sleep(1.5)
        assert helpers.thread_wakeups(watch._thread) == before and not gone.is_set()
        launcher.kill()
        t = time.monotonic()
        assert gone.wait(5) and time.monotonic() - t < 0.5
    finally:
        launcher.kill()
        launcher.wait()
        watch.close()
    idle = LauncherWatch({"TORCHELASTIC_RUN_ID": "x"}, end=gone.set, parent=os.getpid()).start()
    idle.close()  # close() ends the thread at once, whatever it waits on
    assert not idle._thread.is_alive()


@pytest.mark.slow
@pytest.mark.long  # 31 s: make test-long (make test stays in its 12 minutes)
def test_ranks_die_with_torchrun_and_a_run_folder_holds_one_job(tmp_path):
    """SIGKILL to torchrun's process group (a killed srun step, a lost shell): torchrun starts
    each rank in a session of its own, and the ranks used to train on. Now they end within a
    second. While they ran, a second job into the same folder is refused in one line naming the
    holder (exit 2); the lock the killed job leaves never blocks the rerun, which resumes."""
    import signal

    run_dir = tmp_path / "run"
    # A checkpoint every 2 steps: the first one a second in. Then half a second a step, for
    # minutes if it came to that (it is killed once the second job was refused): the second
    # job's start, however slow on a loaded machine, finds this one running.
    args = [
        "train", *helpers.REFERENCE, "model.kwargs.delay=0.5", "ckpt.every_steps=2",
        "train.epochs=20", f"run_dir={run_dir}",
    ]  # fmt: skip
    cmd = helpers.trainer_argv(*args, nproc=2)
    first = subprocess.Popen(
        cmd, env=helpers.env(), cwd=ROOT, start_new_session=True, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        helpers.wait_for(lambda: helpers.checkpoints(run_dir), 180, "a checkpoint", first)
        workers = helpers.children(first.pid)
        assert len(workers) == 2, workers
        second = trainer(*args, check=False)  # one process: its own exit code, no torchrun
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
        assert f"run_dir {run_dir} is in use by another job: rank 0 on " in lines[0]
        assert f"pid {max(workers)}" in lines[0] or f"pid {min(workers)}" in lines[0]
        assert "since" in lines[0]
        os.killpg(first.pid, signal.SIGKILL)  # torchrun; its ranks are in sessions of their own
        helpers.wait_for(lambda: not any(helpers.alive(w) for w in workers), 10, "the ranks to end")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        out = first.communicate(timeout=30)[0]
    assert "its launcher (torchrun, pid" in out and "is gone" in out, out[-3000:]
    # At once: the dead job's lock does not block it (a short end: train.max_steps may change).
    step = int(helpers.checkpoints(run_dir)[-1].removeprefix("step-"))
    rerun = trainer(*args, f"train.max_steps={step + 1}", nproc=2, torchrun=False)
    assert f"step-{step:09d} (step {step}" in rerun.stdout, rerun.stdout[-2000:]
    assert not (run_dir / ".job.lock").exists()
