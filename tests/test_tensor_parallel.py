"""Tensor parallelism (dist.mesh=tp=N, trainer/parallel/tensor.py): the GPT's plan computes what
the whole model computes, a user model supplies its own plan, bad input gets one line, and real
runs track one process within TOL and resume under another layout.

The in-process tests check the plan's arithmetic with plain tensors (no process group); the two
multi-process tests (slow) run the real CLI: tp=2 on 2 ranks, and dp=2 x tp=2 (fsdp) on 4.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from tests.helpers import (
    ROOT,
    TINY_GPT,
    shared_run,
    train_here,
    train_losses,
    trainer,
    weights,
)
from tests.test_bad_input import run_in_process
from trainer.config import load, resolve_strategy
from trainer.errors import ConfigError, UsageError
from trainer.gpt import GPT
from trainer.parallel import mesh as meshes
from trainer.parallel import tensor

TOL = 1e-5
"""Largest |loss difference| allowed between a tp run and one process over 6 steps of the tiny
GPT (clipped, lr 3e-3). Measured on CPU/gloo, torch 2.14.1: tp=2 0 (its step-3 checkpoint
resumed at world 1: 0, under dp=2: 2.4e-7); dp=2 x tp=2 (fsdp) 2.4e-7 (resumed at world 1: 0);
stdlib-gpt over 8 steps: at most 9.5e-7. The row-parallel partial sums are added in another
order than one process's matrix product (~1e-7 an op), and training carries it on: ~10x margin
over the largest measured."""

GPT_ARGS = [
    *[a for a in TINY_GPT if not a.startswith(("train.epochs", "log.progress", "ckpt.every"))],
    "train.max_steps=6",
    "train.clip_grad_norm=0.5",  # clipping's norm crosses the tp shards
    "data.global_batch_size=16",
    "ckpt.every_steps=3",
    "log.progress=none",
]


# --- the plan, in one process ------------------------------------------------------------------


def test_the_gpt_plan_splits_whole_heads_and_adds_up_to_the_whole_attention():
    """Rank r's rows of the fused weight ([q_r; k_r; v_r], as FusedColwiseParallel cuts it) and
    its columns of proj: the partial outputs of the tp ranks add up to the whole attention."""
    torch.manual_seed(0)
    model = GPT(vocab=16, seq_len=8, layers=1, width=16, heads=4)
    attn, x = model.blocks[0].attn, torch.randn(2, 8, 16)
    whole = attn(x)
    tp, total = 2, torch.zeros_like(whole)
    for r in range(tp):
        qkv = nn.Linear(16, 3 * 16 // tp)
        qkv.weight.data = torch.cat([w.chunk(tp)[r] for w in attn.qkv.weight.data.chunk(3)])
        qkv.bias.data = torch.cat([b.chunk(tp)[r] for b in attn.qkv.bias.data.chunk(3)])
        proj = nn.Linear(16 // tp, 16, bias=False)
        proj.weight.data = attn.proj.weight.data.chunk(tp, dim=1)[r]
        part = type(attn).__new__(type(attn))
        nn.Module.__init__(part)
        part.heads, part.dropout, part.qkv, part.proj = attn.heads, 0.0, qkv, proj
        total += part(x)
    torch.testing.assert_close(total + attn.proj.bias, whole, rtol=0, atol=1e-6)


def test_the_gpt_plan_names_every_block_layer():
    plan = tensor.plan_of(GPT(vocab=16, seq_len=8, layers=2, width=16, heads=4), 2)
    assert sorted(plan) == [
        "blocks.*.attn.proj",
        "blocks.*.attn.qkv",
        "blocks.*.fc",
        "blocks.*.proj",
    ]


def test_tp_must_divide_the_gpt_heads():
    with pytest.raises(ConfigError, match="tp=3 does not divide .* 4 heads.*use tp in 1, 2, 4"):
        tensor.plan_of(GPT(vocab=16, seq_len=8, layers=1, width=16, heads=4), 3)


class OwnPlan(nn.Sequential):
    def tensor_parallel_plan(self, tp: int) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"0": ColwiseParallel(), "2": RowwiseParallel()}


class BadPlan(nn.Sequential):
    def tensor_parallel_plan(self, tp: int):
        return ["0"]


def test_a_user_model_supplies_its_own_plan_or_gets_one_line():
    own = OwnPlan(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert sorted(tensor.plan_of(own, 2)) == ["0", "2"]
    with pytest.raises(UsageError, match="BadPlan.tensor_parallel_plan.2. returned list"):
        tensor.plan_of(BadPlan(nn.Linear(4, 4)), 2)
    with pytest.raises(UsageError, match="Sequential has none: give it a tensor_parallel_plan"):
        tensor.plan_of(nn.Sequential(nn.Linear(4, 4)), 2)


def test_the_split_models_clip_of_plain_gradients_is_torchs():
    """trainer/parallel/clip.py's norm for a split layout, on gradients a rank holds whole."""
    from trainer.parallel.clip import clipper
    from trainer.parallel.dims import ParallelDims
    from trainer.parallel.layout import Layout
    from trainer.parallel.parts import whole

    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8) * 10
    for m in (a, b):
        m(x).sum().backward()
    got = clipper(whole(a), meshes.Mesh(ParallelDims(Layout(tp=2))))(0.5)
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    torch.testing.assert_close(got, want)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_reduces_a_norm_over_every_dimension_a_gradient_is_sharded_on():
    """FSDP over a tp shard is a _StridedShard on dp, which Placement.is_shard() does not count:
    missing its dp reduction made dp=2 x tp=2's norm 0.7% small."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = SimpleNamespace(get_group=lambda i: f"group {i}")
    fsdp_tp = SimpleNamespace(placements=(_StridedShard(0, split_factor=2), Shard(0)))
    fsdp_tp.device_mesh = mesh
    bias = SimpleNamespace(placements=(Shard(0), Replicate()), device_mesh=mesh)
    assert meshes.sharded_groups(fsdp_tp) == ("group 0", "group 1")
    assert meshes.sharded_groups(bias) == ("group 0",)
    assert meshes.sharded_groups(torch.zeros(2)) == ()


# --- the rules: one line, exit 2, before any work ----------------------------------------------


@pytest.mark.parametrize(
    "world, overrides, names",
    [
        (3, ["dist.mesh=tp=3"], "tp=3 does not divide model.gpt.heads=4"),
        (2, ["dist.mesh=tp=2", "model.dropout=0.1"], "set model.dropout=0"),
        (4, ["dist.mesh=dp=2,tp=2", "dist.strategy=ddp"], "set dist.strategy=fsdp"),
        (2, ["dist.mesh=tp=2", "optim.lora_targets=blocks.*.fc"], "leave optim.lora_targets"),
    ],
    ids=["heads", "dropout", "ddp", "lora"],
)
def test_bad_tensor_parallel_configs_get_one_line_and_exit_2(world, overrides, names):
    o = run_in_process(
        ["config", "check", "--config", "stdlib-gpt", f"--world-size={world}", *overrides]
    )
    lines = [line for line in o.stderr.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1 and "Traceback" not in o.stderr, o.stderr
    assert names in lines[0]


def test_auto_picks_fsdp_for_the_dp_dimension_of_a_tp_mesh():
    cfg = load("stdlib-gpt", ["dist.mesh=dp=2,tp=2"])
    assert resolve_strategy(cfg, 4) == "fsdp"
    assert resolve_strategy(load("stdlib-gpt", ["dist.mesh=tp=2"]), 2) == "none"


def test_docs_quote_the_tolerance_the_tests_allow():
    docs = (ROOT / "docs" / "training.md").read_text()
    section = docs[docs.index("#### Tensor parallelism") :]
    assert f"allow {TOL:.0e}".replace("e-0", "e-") in section


# --- real runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process reference both runs compare with (made once, shared)."""

    def make(run_dir) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            train_here("train", *GPT_ARGS, f"run_dir={run_dir}")

    return shared_run(tmp_path_factory, "tensor-parallel:world1", make)


def _close(got: dict, ref: dict) -> float:
    """The largest |loss difference| over got's steps, checked against TOL."""
    worst = max(abs(got[s] - ref[s]) for s in got)
    assert worst <= TOL, (worst, got, ref)
    print(f"max |loss difference| over steps {sorted(got)}: {worst:.2e}")  # pytest -s shows it
    return worst


def _resumed_from_step_3(saved, run_dir, nproc: int | None, *extra) -> dict:
    """saved's step-3 checkpoint resumed on nproc ranks (None: one, in this process)."""
    argv = ["train", *GPT_ARGS, f"run_dir={run_dir}", *extra]
    argv.append(f"ckpt.resume={saved / 'checkpoints' / 'step-000000003'}")
    if nproc is None:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            train_here(*argv)
        stdout = out.getvalue()
    else:
        stdout = trainer(*argv, nproc=nproc, torchrun=False).stdout
    assert "resumed from" in stdout, stdout
    got = train_losses(run_dir)
    assert sorted(got) == [4, 5, 6]
    return got


@pytest.mark.slow
def test_tp2_tracks_one_process_and_its_checkpoint_resumes_at_world_1_and_dp2(
    one_process, tmp_path
):
    ref, tp = one_process, tmp_path / "tp"
    out = trainer("train", *GPT_ARGS, f"run_dir={tp}", "dist.mesh=tp=2", nproc=2, torchrun=False)
    assert "tensor parallel: each layer split over 2 ranks" in out.stdout
    want = train_losses(ref)
    assert sorted(train_losses(tp)) == list(range(1, 7))
    _close(train_losses(tp), want)
    a, b = weights(tp), weights(ref)  # the final weights, gathered whole from the shards
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= TOL
    _close(_resumed_from_step_3(tp, tmp_path / "to-one", None), want)
    got = _resumed_from_step_3(tp, tmp_path / "to-dp2", 2, "dist.strategy=ddp")
    _close(got, want)


@pytest.mark.mesh
@pytest.mark.slow
def test_dp2_tp2_under_fsdp_tracks_one_process_and_resumes_at_world_1(one_process, tmp_path):
    ref, run = one_process, tmp_path / "dp2tp2"
    out = trainer(
        "train", *GPT_ARGS, f"run_dir={run}", "dist.mesh=dp=2,tp=2", nproc=4, torchrun=False
    )
    assert "gloo, fsdp+tp" in out.stdout
    want = train_losses(ref)
    _close(train_losses(run), want)
    _close(_resumed_from_step_3(run, tmp_path / "to-one", None), want)
