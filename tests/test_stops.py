"""Stops in the layouts that had been tried by hand only (issue 56 item 23): a SIGTERM to one rank
of a two-stage pipeline, and a SIGKILL of a LoRA fine-tuning run. Each run, resumed by the same
command, ends on the uninterrupted run's weights and losses, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from tests.helpers import (
    TINY,
    TINY_GPT,
    checkpoints,
    children,
    ranks,
    read_jsonl,
    spawn,
    train_here,
    train_losses,
    trainer,
    wait_for,
    weights,
)


def slow_blocks_gpt(in_shape, num_classes, layers=2, width=32, heads=2, delay=0.0):
    """The built-in GPT with a sleep before each block's training forward: under pp each stage
    runs only its own blocks (a hook on the whole model would never run there)."""
    from trainer.gpt import gpt

    model = gpt(in_shape, num_classes, layers=layers, width=width, heads=heads, dropout=0.0)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, _: time.sleep(delay) if m.training else None)
    return model


PP = [
    *TINY_GPT,
    "model.name=tests.test_stops:slow_blocks_gpt",
    "dist.mesh=pp=2",
    "data.global_batch_size=8",
    "train.max_steps=14",
    "ckpt.every_epochs=0",
    "ckpt.every_steps=100",
]


def _rank_of(pid: int) -> int:
    """A worker's RANK, from its environment (pids need not follow the ranks)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


def _same(run, reference) -> None:
    assert train_losses(run) == train_losses(reference)
    got, want = weights(run), weights(reference)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.mesh
@pytest.mark.slow
def test_sigterm_to_one_pipeline_rank_saves_both_stages_and_resumes_to_the_same_bits(tmp_path):
    """pp=2 on 2 ranks: SIGTERM to rank 1 only (the last stage): the ranks agree on a step, both
    stages save it, both exit 3; the same command resumes and ends where an uninterrupted run
    does. The sleep only slows the forward: its delay is the one config difference."""
    reference = tmp_path / "reference"
    ranks("train", *PP, "model.kwargs.delay=0", f"run_dir={reference}", nproc=2)
    run, status = tmp_path / "run", tmp_path / "status"
    status.mkdir()
    args = ("train", *PP, "model.kwargs.delay=0.05", f"run_dir={run}")
    proc = spawn(*args, nproc=2, extra_env={"TRAINER_STATUS_DIR": str(status)})
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.exists(), 120, "step 1", proc)
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    wait_for(lambda: len(read_jsonl(metrics)) >= 3, 120, "3 steps", proc)
    (last_stage,) = [pid for pid in workers if _rank_of(pid) == 1]
    os.kill(last_stage, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert "stopped by SIGTERM" in out, out[-3000:]  # (a bare torchrun adds its own report)
    assert {f.read_text().strip() for f in status.glob("*.exit")} == {"3"}, out[-3000:]
    (newest,) = checkpoints(run)
    meta = json.loads((run / "checkpoints" / newest / "meta.json").read_text())
    assert meta["reason"] == "signal SIGTERM" and 3 <= meta["loop"]["step"] < 14, meta
    out = trainer(*args, nproc=2, torchrun=False).stdout
    assert "resumed from" in out, out[-2000:]
    _same(run, reference)


@pytest.mark.long
def test_a_lora_run_killed_mid_epoch_resumes_to_the_uninterrupted_bits(tmp_path):
    """LoRA on a saved base (the adapters and a head train): SIGKILL after a periodic
    checkpoint, the same command again reloads the base, restores the adapters and the
    optimizer, and ends on the weights and losses of a run never killed."""
    pytest.importorskip("peft")
    from safetensors.torch import save_file

    from tests.helpers import tiny_model

    torch.manual_seed(3)
    save_file(tiny_model(3, (1, 4, 4)).state_dict(), tmp_path / "base.safetensors")
    lora = [
        *TINY,
        "model.name=tests.helpers:slow_mlp",
        "model.hidden=[8]",
        f"ckpt.init_weights={tmp_path / 'base.safetensors'}",
        "optim.lora_targets=1",
        "optim.lora_also_train=3.*",
        "optim.lora_rank=2",
        "optim.lr=0.05",
        "train.epochs=20",
        "ckpt.every_epochs=0",
        "ckpt.every_steps=5",
        "log.every_steps=1",
        "log.tensorboard=false",
    ]
    reference = tmp_path / "reference"
    train_here("train", *lora, "model.kwargs.delay=0", f"run_dir={reference}")
    run = tmp_path / "run"
    args = ("train", *lora, "model.kwargs.delay=0.05", f"run_dir={run}")
    proc = spawn(*args)
    wait_for(lambda: len(checkpoints(run)) >= 2, 120, "two checkpoints", proc)
    proc.kill()
    proc.wait(timeout=30)
    done = max(r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train")
    assert 10 <= done < 60 and not (run / "final").exists(), done
    out = trainer(*args).stdout
    assert "resumed from" in out, out[-2000:]
    _same(run, reference)
