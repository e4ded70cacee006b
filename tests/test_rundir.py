"""Run folders: a new one per `trainer train`, `--resume` to continue, launchers that pin theirs
(trainer.rundir)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import TINY
from trainer import cli, launch, rundir

QUICK = [*TINY, "name=tiny", "train.epochs=2", "log.progress=plain", "log.tensorboard=false"]


@pytest.fixture
def here(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", rundir.STABLE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["train", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_each_run_gets_a_new_folder_named_first_and_rerunning_trains_again(here, capsys):
    code, out, err = train(capsys, *QUICK)
    assert code == 0, err
    (first,) = rundir.runs("tiny")  # runs/tiny/<date-time>
    assert out.splitlines()[0] == f"run dir: {here / first} (metrics.jsonl as it trains)"
    code, out, err = train(capsys, *QUICK)
    assert code == 0 and "already complete" not in out  # it trained, in a folder of its own
    assert len(rundir.runs("tiny")) == 2 and "resumed" not in out


def test_resume_continues_the_newest_run_with_its_config_and_says_what_the_change_does(
    here, capsys
):
    train(capsys, *QUICK, "optim.lr=0.05")  # a value --resume must take from config.yaml
    train(capsys, *QUICK, "optim.lr=0.05")
    export = here / "runs" / "tiny" / "zz-export"  # sorts last; config.yaml as an export has
    export.mkdir()
    (export / "config.yaml").write_text("name: tiny\n")
    (export / "model.safetensors").write_bytes(b"")
    older, newest = rundir.runs("tiny")  # not the export: it is no run
    code, out, err = train(capsys, "--resume", "name=tiny", "train.epochs=3")
    assert code == 0, err
    assert f"resumed from {here / newest}/checkpoints/step-000000006" in out
    assert "resume changes train.epochs 2 -> 3:" in out
    run = json.loads((here / newest / "run.json").read_text())
    assert run["resumes"] == [{"step": 6, "changes": {"train.epochs": [2, 3]}}]
    assert run["startup"] is None  # an in-process call leaves this process's collector alone
    records = [json.loads(line) for line in (here / newest / "metrics.jsonl").open()]
    assert {"kind": "resume", "step": 6, "changes": {"train.epochs": [2, 3]}}.items() <= (
        next(r for r in records if r["kind"] == "resume").items()
    )
    assert len(rundir.runs("tiny")) == 2  # no third folder
    code, out, err = train(capsys, "--resume", str(older))  # a named run, finished: says so
    assert code == 0 and "already complete" in out


def test_resume_without_an_earlier_run_and_of_a_non_run_folder_are_one_line_errors(here, capsys):
    code, _, err = train(capsys, "--resume", *QUICK)
    assert code == 2 and err.strip().endswith(
        "--resume: no earlier run of 'tiny' in runs/tiny/: train without --resume, or name the "
        "run folder (--resume RUN_DIR)"
    )
    code, _, err = train(capsys, "--resume", str(here))
    assert code == 2 and "no config.yaml there" in err


def test_config_of_a_run_folder_reruns_it_into_a_new_folder(here, capsys):
    train(capsys, *QUICK)
    (first,) = rundir.runs("tiny")
    code, out, err = train(capsys, "--config", first)
    assert code == 0 and "already complete" not in out, err
    assert len(rundir.runs("tiny")) == 2


def test_a_pinned_run_dir_resumes_on_its_own(here, capsys):
    train(capsys, *QUICK, "run_dir=mine")
    code, out, _ = train(capsys, *QUICK, "run_dir=mine")
    assert code == 0 and "already complete" in out and rundir.runs("tiny") == []


def test_launchers_and_restarts_keep_one_folder(here, monkeypatch):
    assert rundir.resolve("n", None, claim=False, environ={rundir.STABLE_ENV: "1"}) == "runs/n"
    first = rundir.resolve("n", None, claim=True, environ={"TORCHELASTIC_RUN_ID": "abc"})
    os.makedirs(first, exist_ok=True)
    with open(os.path.join(first, "config.yaml"), "w") as f:
        f.write("name: n\n")
    with open(os.path.join(first, "run.json"), "w") as f:
        json.dump({"torchelastic_run_id": "abc"}, f)
    again = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert rundir.resolve("n", None, claim=True, environ=again) == first  # a worker restart
    other = {"TORCHELASTIC_RUN_ID": "xyz", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert rundir.resolve("n", None, claim=True, environ=other) != first
    # Two runs in the same second: the second claims -2.
    a = rundir.new_folder("m", claim=True, now=1e9)
    assert rundir.new_folder("m", claim=True, now=1e9) == a + "-2"


def test_trainer_launch_marks_its_ranks(here):
    """compose and Kubernetes start the ranks through trainer-launch: the mark makes runs/<name>."""
    script = f"import os, sys; sys.exit(0 if os.environ.get({rundir.STABLE_ENV!r}) else 9)"
    plan = launch.Plan(
        argv=(sys.executable, "-c", script), env={}, unset=(), child=True, summary=""
    )
    assert launch.run_child(plan, launch.Forwarder()) == 0


def test_a_dry_run_leaves_no_folder_behind(here, capsys):
    (here / "runs").mkdir()
    (here / "runs" / "keep").write_text("")
    code, out, err = train(capsys, "--dry-run", *QUICK)
    assert code == 0 and "dry run ok" in out, err
    assert sorted(p.name for p in here.rglob("*")) == ["keep", "runs"]


def test_a_stop_says_how_to_resume_a_folder_the_trainer_picked():
    """Leaving run_dir out, the same command would start a new folder: the stop line names it."""
    from types import SimpleNamespace

    from trainer.run import Run

    picked = SimpleNamespace(folder_chosen=True, cfg=SimpleNamespace(run_dir="runs/x/20261125"))
    assert Run.to_resume.fget(picked) == (
        "to resume, rerun with run_dir=runs/x/20261125 (trainer train: --resume runs/x/20261125)"
    )
    pinned = SimpleNamespace(folder_chosen=False, cfg=SimpleNamespace(run_dir="runs/mine"))
    assert Run.to_resume.fget(pinned) == "rerun the same command to resume"
