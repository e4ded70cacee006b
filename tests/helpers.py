"""Test helpers: tiny plug-in datasets/models, and runners for the real CLI and torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tiny(cfg, seed):
    """9 training samples: with global batch 4 the last batch holds 1 sample (< 2 or 4 ranks)."""
    import torch

    from trainer.data import ArrayDataset, DataSpec

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(9 + 7, 1, 4, 4, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    return DataSpec(
        train=ArrayDataset(x[:9], y[:9]),
        test=ArrayDataset(x[9:], y[9:]),
        task="classification",
        in_shape=(1, 4, 4),
        num_classes=3,
    )


def tiny_model(num_classes, in_shape, width=8):
    """A plug-in model factory: asks for num_classes and in_shape by name."""
    from torch import nn

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_shape[0] * in_shape[1] * in_shape[2], width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict[str, str]:
    """A clean environment: no torchrun variables leak in from the test runner."""
    e = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT",
        )
    }
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["OMP_NUM_THREADS"] = "1"
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    e.update(extra)
    return e


def trainer(*args, nproc: int | None = None, timeout: float = 180, extra_env=None, check=True):
    """Run `python -m trainer ...`, or under the real torchrun with nproc processes."""
    if nproc is None:
        cmd = [sys.executable, "-m", "trainer", *args]
    else:
        cmd = [
            str(BIN / "torchrun"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "trainer",
            *args,
        ]
    proc = subprocess.run(
        cmd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_losses(run_dir) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in read_jsonl(Path(run_dir) / "metrics.jsonl")
        if r["kind"] == "train"
    }


def weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))
