"""The user-facing commands: `make run-local` wiring and the console's two modes."""

import io
import json
import os
import shlex
import shutil
import signal
import subprocess

import pytest

from tests.helpers import BIN, ROOT, TINY, checkpoints, env, wait_for
from trainer.metrics import RunLogger


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.slow
def test_make_run_local_trains_with_two_ranks_and_names_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "run-local",
            f"RUN_DIR={run_dir}",
            "ARGS=train.max_steps=30 log.progress=plain",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"run dir: {run_dir}" in p.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["device"] == "cpu"  # pinned, so a GPU host does not turn this into NCCL


@pytest.mark.parametrize(
    "args, fragment",
    [
        ("optim.lrr=1", "did you mean 'optim.lr'"),
        (
            "data.global_batch_size=3",
            "data.global_batch_size=3 does not split over 2 ranks: use a multiple of 2",
        ),
    ],
)
def test_make_run_local_rejects_a_bad_config_before_launching(tmp_path, args, fragment):
    p = subprocess.run(
        ["make", "--no-print-directory", "run-local", f"RUN_DIR={tmp_path}", f"ARGS={args}"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert fragment in p.stderr and "torchrun" not in p.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _run_local_command(run_dir, args: str) -> list[str]:
    """The command `make run-local` trains with (its recipe's last, as `make -n` prints it), as
    an argv to start here: what a stop does to it, not to make (which exits 2 on any failure)."""
    p = subprocess.run(
        ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "run-local",
         f"RUN_DIR={run_dir}", f"ARGS={args}", f"BIN={BIN}"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    argv = shlex.split(p.stdout.replace("\\\n", " ").strip().splitlines()[-1])
    return ["env", *argv] if "=" in argv[0] else argv  # VAR=value ... as a shell reads it


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_stopping_make_run_local_ends_with_its_one_line_and_no_torchrun_traceback(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "model.name=tests.helpers:slow_mlp", "model.kwargs.delay=0.2", "train.epochs=50"]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            _run_local_command(run_dir, " ".join(args)),
            cwd=ROOT, env=env(), stdout=o, stderr=e, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: checkpoints(run_dir), 120, "the first checkpoint", proc)
        os.killpg(proc.pid, signal.SIGTERM)  # its process group, as a terminal's Ctrl-C
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("trainer: stopped by SIGTERM at step ")
    assert text.count("stopped by SIGTERM") == 1 and code == 3, text[-3000:]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_console_is_a_bar_on_a_tty_and_plain_lines_otherwise(tmp_path):
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        log = RunLogger(main=True, progress="auto", total_steps=4, stream=stream)
        log.open(str(tmp_path))
        for step in (1, 2, 3, 4):
            log.tick(step)
            log.record(
                {
                    "kind": "train",
                    "step": step,
                    "epoch": 0,
                    "loss": 1.0 / step,
                    "lr": 0.1,
                    "samples_per_s": 10.0,
                }
            )
        log.close()
    assert "\r[" in tty.getvalue() and "4/4" in tty.getvalue()
    plain = pipe.getvalue().splitlines()  # the run dir, a line after step 1, one per record
    assert "\r" not in pipe.getvalue() and len(plain) == 6
    assert plain[0] == f"run dir: {tmp_path} (metrics.jsonl as it trains)"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["loss"] == 0.25


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_progress_lines_say_where_how_fast_how_long_and_how_much_longer(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("trainer.metrics.time.monotonic", clock)
    out = io.StringIO()
    log = RunLogger(main=True, progress="plain", total_steps=100, epochs=4, stream=out)
    log.open(str(tmp_path))
    for step in range(1, 12):  # 1 s a step; the first (warm-up) is not timed
        log.tick(step, epoch=1)
        clock.now += 1.0
    record = {"kind": "train", "step": 11, "epoch": 1, "loss": 0.5, "lr": 0.001}
    log.record({**record, "samples_per_s": 1234.5, "data_wait_pct": 1.25, "mfu": 0.125})
    lines = out.getvalue().splitlines()
    assert lines[1] == "step 1/100 (1%) | epoch 1/4 | 0:00 elapsed"  # at once, after step 1
    assert lines[2] == (
        "step 11/100 (11%) | epoch 1/4 | loss 0.5 | lr 0.001 | 1,234 samples/s | data wait 1.2% "
        "| MFU 12.5% | 0:11 elapsed, ETA 1:38"  # 89 steps left at 10 steps in 11 s: 97.9 s
    )
    clock.now += RunLogger.HEARTBEAT_S  # a slow step: a line anyway, before the next record
    log.tick(12, epoch=1)
    assert out.getvalue().splitlines()[-1].startswith("step 12/100 (12%) | epoch 1/4 | 0:41 ")
    log.record({"kind": "eval", "step": 25, "epoch": 1, "eval.loss": 0.25, "eval.count": 359})
    assert out.getvalue().splitlines()[-1] == (
        "eval at step 25/100 (25%) | epoch 1/4 | loss 0.25 | 359 samples"  # no raw keys
    )
    log.record({"kind": "checkpoint", "step": 25, "reason": "every_epochs", "seconds": 0.1})
    log.close()
    assert len(out.getvalue().splitlines()) == 5  # a checkpoint record is not a console line
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "metrics.jsonl").open()]
    assert kinds == ["train", "eval", "checkpoint"]


def test_a_run_prints_its_folder_first_quiet_checkpoints_and_one_epoch_numbering(tmp_path, capsys):
    from tests.helpers import TINY, train_here

    train_here(
        "train", *TINY, "train.epochs=3", "log.every_steps=3", "log.progress=plain",
        f"run_dir={tmp_path}",
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0] == f"run dir: {tmp_path} (metrics.jsonl, tb/ as it trains)"
    assert "checkpoint" not in stdout  # 3 saves, in metrics.jsonl only
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    saves = [r["step"] for r in records if r["kind"] == "checkpoint"]
    assert saves == [3, 6, 9]  # the end of each epoch (3 steps each); the last one is final
    by_step = {}
    for r in records:
        if r["kind"] in ("train", "eval"):
            by_step.setdefault(r["step"], set()).add(r["epoch"])
    assert all(len(epochs) == 1 for epochs in by_step.values()), by_step
    assert by_step[3] == {1} and by_step[9] == {3}  # 1-based, the epoch the step belongs to


def test_non_main_ranks_write_and_print_nothing(tmp_path):
    out = io.StringIO()
    log = RunLogger(main=False, progress="plain", total_steps=1, stream=out)
    log.open(str(tmp_path))
    log.record({"kind": "train", "step": 1, "loss": 1.0})
    log.info("hello")
    log.close()
    assert out.getvalue() == "" and list(tmp_path.iterdir()) == []


def test_the_commands_constant_names_every_subcommand_of_the_parser():
    """trainer-launch decides train-under-torchrun vs run-once from cli.COMMANDS."""
    import argparse

    from trainer import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == cli.COMMANDS
