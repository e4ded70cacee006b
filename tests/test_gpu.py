"""GPU paths (skipped without CUDA): AMP, compile, channels_last, GPU->CPU checkpoints, determinism."""

import functools
import json

import pytest
import torch

from tests import helpers
from tests.helpers import weights

pytestmark = pytest.mark.gpu

trainer = functools.partial(helpers.trainer, gpu=True)  # helpers hide GPUs from CPU tests

LENET = ["--config", "digits-lenet", "train.epochs=10", "log.progress=plain", "dist.device=cuda"]


def test_bf16_compiled_channels_last_lenet_trains_on_the_gpu(tmp_path):
    trainer(
        "train",
        *LENET,
        "train.precision=bf16",
        "train.compile=true",
        "train.channels_last=true",
        f"run_dir={tmp_path}",
        timeout=600,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cuda:0" and summary["precision"] == "bf16"
    assert summary["eval"]["accuracy"] >= 0.93, summary["eval"]
    assert not any("_orig_mod" in k for k in weights(tmp_path))


def test_a_gpu_checkpoint_evaluates_and_resumes_on_the_cpu(tmp_path):
    trainer("train", *LENET, f"run_dir={tmp_path}")
    gpu = json.loads((tmp_path / "summary.json").read_text())["eval"]
    p = trainer("eval", str(tmp_path), "dist.device=cpu")
    cpu = json.loads(p.stdout.strip().splitlines()[-1])
    assert (
        cpu["count"] == gpu["count"] and abs(cpu["accuracy"] - gpu["accuracy"]) <= 2 / cpu["count"]
    )
    p = trainer("train", *LENET[:-1], "dist.device=cpu", "train.epochs=11", f"run_dir={tmp_path}")
    assert "resumed from" in p.stdout and "world 1 x cpu" in p.stdout


def test_fp16_with_grad_scaler_trains(tmp_path):
    trainer("train", *LENET, "train.precision=fp16", f"run_dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval"]["accuracy"] >= 0.9 and summary["skipped_steps"] == [
        summary["skipped_steps"][0]
    ]


def test_deterministic_gpu_runs_are_bitwise_equal(tmp_path):
    for name in ("a", "b"):
        trainer(
            "train",
            *LENET,
            "train.epochs=2",
            "repro.deterministic=true",
            f"run_dir={tmp_path / name}",
        )
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dry_run_reports_peak_gpu_memory(tmp_path):
    p = trainer("train", "--dry-run", *LENET, f"run_dir={tmp_path}")
    assert "dry run ok" in p.stdout and "peak GPU memory" in p.stdout
