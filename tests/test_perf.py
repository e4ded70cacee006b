"""Throughput accounting: FLOPs per sample, peaks, MFU, data wait, and what a run reports."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests import helpers
from tests.helpers import read_jsonl, trainer
from trainer import loop, perf
from trainer.tasks import Classification, LanguageModel, Regression


def _images(n=2, shape=(1, 8, 8)):
    return torch.zeros(n, *shape), torch.zeros(n, dtype=torch.long)


def test_a_linear_layers_flops_are_forward_plus_weight_gradient():
    # forward 2*in*out per sample; backward: the weight gradient (2*in*out), no input gradient
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10, bias=False))
    assert perf.flops_per_sample(model, Classification(), _images(), "cpu") == 4 * 64 * 10


def test_the_gpts_flops_are_about_6n_per_token_plus_attention():
    from trainer.gpt import GPT

    layers, width, seq = 2, 64, 32
    model = GPT(vocab=256, seq_len=seq, layers=layers, width=width, heads=2)
    tokens = torch.zeros(2, seq, dtype=torch.long)
    counted = perf.flops_per_sample(model, LanguageModel(seq), (tokens, tokens), "cpu")
    # 6N per token over the matmul weights (the tied head counts, the embedding lookup does not)
    # plus causal attention's QK^T and AV, forward and backward: 12 * layers * width * seq.
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2)
    expected = seq * (6 * n + 12 * layers * width * seq)
    assert counted == pytest.approx(expected, rel=0.15)


def test_counting_leaves_the_model_and_the_rng_untouched():
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    perf.flops_per_sample(model, Classification(), _images(2, (1, 4, 4)), "cpu")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_model_that_cannot_be_counted_reports_no_flops():
    class Picky(nn.Module):
        def forward(self, x):
            raise RuntimeError("needs a real batch")

    batch = (torch.zeros(2, 3), torch.zeros(2))
    assert perf.flops_per_sample(Picky(), Regression(), batch, "cpu") is None


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
        ("NVIDIA H200", "fp16", 989e12),
        ("NVIDIA A100-SXM4-40GB", "bf16", 312e12),
        ("NVIDIA A10G", "bf16", 70e12),
        ("Some Future GPU", "bf16", None),
        (None, "bf16", None),
    ],
)
def test_peaks_by_device_name(name, precision, peak):
    assert perf.peak_flops(name, precision) == peak


def test_mfu_is_model_flops_over_all_ranks_peaks():
    assert perf.mfu(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
    assert perf.mfu(1000.0, None, 1e12, 1) is None and perf.mfu(1000.0, 1e9, None, 1) is None


def test_a_log_window_reports_tokens_data_wait_and_mfu():
    run = SimpleNamespace(
        task=LanguageModel(seq_len=64),
        flops_per_sample=1e9,
        peak_flops=1e12,
        world=SimpleNamespace(size=2),
    )
    out = loop.throughput(run, samples=500, elapsed=2.0, waited=0.5)
    assert out == {
        "samples_per_s": 250.0,
        "tokens_per_s": 250.0 * 64,
        "data_wait_pct": 25.0,
        "mfu": pytest.approx(250.0 * 1e9 / 2e12),
    }


def test_the_clock_counts_only_the_time_spent_waiting_for_batches():
    def slow_batches():
        for i in range(3):
            time.sleep(0.05)
            yield i

    clock = loop.TrainClock()
    for _ in clock.timed(slow_batches()):
        time.sleep(0.02)  # the "step": not waiting
    elapsed, waited = clock.lap()
    assert 0.14 <= waited < 0.2 and elapsed >= waited + 0.05
    assert clock.lap()[1] == 0.0  # a new window


def test_a_run_reports_its_throughput_in_metrics_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    p = trainer("train", *helpers.TINY, "train.epochs=2", "log.every_steps=1", f"run_dir={run_dir}")
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert all(0.0 <= r["data_wait_pct"] <= 100.0 and r["samples_per_s"] > 0 for r in train)
    assert "mfu" not in train[0]  # a CPU has no peak in the table
    summary = json.loads((run_dir / "summary.json").read_text())
    # No peak, no MFU: the FLOPs are not counted either (a forward/backward at every start).
    assert summary["flops_per_sample"] is None
    assert summary["mfu"] is None and summary["peak_flops"] is None
    assert 0.0 <= summary["data_wait_pct"] <= 100.0
    assert "samples/s" in p.stdout and "MFU" not in p.stdout


def test_where_the_peak_is_known_a_run_counts_its_flops_and_reports_mfu(tmp_path, monkeypatch):
    """A GPU in the table, as far as the run can tell: the FLOPs are counted and MFU logged."""
    monkeypatch.setattr(perf, "peak_flops", lambda device, precision: 1e9)
    run_dir = tmp_path / "run"
    summary = helpers.train_here(
        "train", *helpers.TINY, "train.epochs=1", "log.every_steps=1", "log.progress=none",
        f"run_dir={run_dir}",
    )  # fmt: skip
    assert summary["flops_per_sample"] == 4 * 16 * 8 + 6 * 8 * 3  # the tiny model, counted
    assert summary["peak_flops"] == 1e9 and summary["mfu"] > 0
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train and all(r["mfu"] > 0 for r in train)
