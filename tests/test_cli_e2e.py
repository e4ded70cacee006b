"""The user-facing commands: `make run-local` wiring and the console's two modes."""

import io
import json
import shutil
import subprocess

import pytest

from tests.helpers import ROOT, env
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
    assert "\r" not in pipe.getvalue() and pipe.getvalue().count("\n") == 4
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["loss"] == 0.25


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
