"""examples/ratings, the user project the tests did not write into trainer/: its own CSV files,
a two-input model, a custom loss and metrics through the Task contract, trained by
`trainer train --config` (registry names) and by its own train.py (trainer.fit)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import BIN, ROOT, checkpoints, children, env, train_here, wait_for, weights

EXAMPLE = ROOT / "examples" / "ratings"
# A short run: 2 epochs of 94 steps (48,000 ratings in global batches of 512), a checkpoint every
# 20 steps, the same bits on any world size dividing repro.shards.
SHORT = [
    "train.epochs=2",
    "ckpt.every_steps=20",
    "ckpt.keep_last=20",
    "repro.world_invariant=true",
    "log.progress=plain",
]


@pytest.fixture(scope="module")
def ratings_data(tmp_path_factory):
    """The example's CSVs, written by its own prepare step (as `make example` does)."""
    root = tmp_path_factory.mktemp("ratings-data")
    subprocess.run(
        [sys.executable, "-m", "ratings.prepare", str(root)],
        env=env(PYTHONPATH=f"{EXAMPLE}{os.pathsep}{ROOT}"),
        check=True,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="module")
def one_process(ratings_data, tmp_path_factory):
    """`trainer train --config examples/ratings/ratings.yaml` in this process, world 1."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        run_dir = tmp_path_factory.mktemp("ratings-w1") / "run"
        train_here(
            "train",
            *SHORT,
            f"data.root={ratings_data}",
            f"run_dir={run_dir}",
            config_file=str(EXAMPLE / "ratings.yaml"),
        )
    finally:
        sys.path.remove(str(EXAMPLE))
    return run_dir


def test_the_example_learns_with_its_own_loss_and_metrics(one_process):
    summary = json.loads((one_process / "summary.json").read_text())
    ev = summary["eval"]
    assert set(ev) == {"loss", "mae", "rmse", "within_half_star", "count"}
    assert ev["count"] == 12000 and summary["steps"] == 188
    # Ratings of 1-5 stars: predicting the mean (3.2) gives an RMSE of about 1.0.
    assert ev["rmse"] < 0.8 and ev["mae"] < 0.65 and ev["within_half_star"] > 0.45
    run = json.loads((one_process / "run.json").read_text())
    assert run["data"]["users"] == 600 and run["data"]["items"] == 400


@pytest.mark.long  # two SIGKILLs and restarts under torchrun: make test-long
def test_its_script_on_two_ranks_killed_twice_and_restarted_ends_bitwise_equal_to_one_process(
    one_process, ratings_data, tmp_path
):
    """train.py (trainer.fit) under the real torchrun on 2 ranks: rank 1 SIGKILLed after the
    first checkpoint, then rank 0 of the group torchrun restarted, after that group's first
    checkpoint. Each restarted group resumes from the newest checkpoint, and the run ends with
    the weights and metrics of `trainer train --config` in one process, to the bit. No run_dir:
    each restarted group finds the folder rank 0 chose the first time (by torchrun's run id)."""
    folders = lambda: list((tmp_path / "runs" / "ratings").glob("*"))  # noqa: E731
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.2",
        str(EXAMPLE / "train.py"),
        *SHORT,
        f"data.root={ratings_data}",
    ]
    proc = subprocess.Popen(
        cmd, env=env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        seen = None
        for kill in range(2):  # rank 1, then rank 0 of the restarted group
            newest = wait_for(
                lambda seen=seen: (
                    folders() and (c := checkpoints(folders()[0])) and c[-1] != seen and c[-1]
                ),
                120,
                f"a new checkpoint before kill {kill + 1}",
                proc,
            )
            seen = newest
            workers = children(proc.pid)
            assert len(workers) == 2, workers
            os.kill(max(workers) if kill == 0 else min(workers), signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    (run_dir,) = folders()  # one folder for both attempts
    summary = json.loads((run_dir / "summary.json").read_text())
    reference = json.loads((one_process / "summary.json").read_text())
    assert summary["restart_count"] == 2 and out.count("resumed from") == 2
    assert summary["world_size"] == 2 and summary["steps"] == reference["steps"]
    assert summary["eval"] == reference["eval"]
    w, ref = weights(run_dir), weights(one_process)
    assert w.keys() == ref.keys() and all(torch.equal(w[k], ref[k]) for k in ref)
    # trainer.fit recorded importable names: the config is that of `trainer train --config`.
    assert summary["config"]["model"]["name"] == "ratings.model:build"
    assert summary["config"]["task"]["name"] == "ratings.task:RatingTask"
