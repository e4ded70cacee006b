"""repro.world_invariant: the same bits on 1, 2, 4 and 8 ranks, and on 1, 2 and 3 for 6 shards
(trainer/invariant.py).

The multi-process tests run the real torchrun at each world size (8 ranks on 2 cores is slow
but fine for a few steps) and compare per-step losses, eval metrics and final weights with ==.
"""

import hashlib
import json

import pytest
import torch

from tests.helpers import TINY_GPT, read_jsonl, shared_run, train_here, trainer, weights
from trainer import config, invariant, sampler
from trainer.checkpoint.digest import file_digest
from trainer.errors import ConfigError

MLP = [
    "model.hidden=[32]",
    "model.dropout=0.1",  # dropout masks are drawn per shard, not per rank
    "data.global_batch_size=64",
    "train.epochs=1",
    "train.max_steps=6",
    "log.every_steps=1",
    "log.progress=plain",
    "log.tensorboard=false",
]
LENET = [*MLP, "model.name=lenet", "model.dropout=0.0", "optim.name=sgd", "optim.lr=0.05"]
GPT = [*TINY_GPT, "model.dropout=0.1", "data.global_batch_size=16", "train.max_steps=6"]
# Checkpoints (which must not move a bit) to resume from on another world size.
GPT_SAVING = [*GPT, "ckpt.every_steps=3", "ckpt.keep_last=10"]
# Micro-steps inside each shard, and a clip that binds: the norm is over the summed gradient.
ON = ["repro.world_invariant=true", "train.micro_batch_size=3", "train.clip_grad_norm=0.5"]


def bn_mlp(num_classes, in_shape):
    """An MLP with BatchNorm: each shard normalises with its own statistics (ghost batch norm)."""
    from torch import nn

    width = in_shape[0] * in_shape[1] * in_shape[2]
    return nn.Sequential(
        nn.Flatten(), nn.Linear(width, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)
    )


def offset_probe(num_classes, in_shape, log):
    """An MLP that appends each input's start address modulo batch.ALIGN to `log` (one file a
    process): where the world-invariant step's shard and micro-batch cuts start."""
    import os

    from torch import nn

    from trainer.batch import ALIGN

    class Probe(nn.Module):
        def forward(self, x):
            with open(f"{log}.{os.getpid()}", "a") as f:
                f.write(f"{x.data_ptr() % ALIGN}\n")
            return x

    return nn.Sequential(Probe(), nn.Linear(in_shape[0], 37), nn.ReLU(), nn.Linear(37, num_classes))


# --- the pieces --------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_subtree_sums_combined_in_the_tree_are_the_full_tree_bit_for_bit(world):
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1000, generator=g) * 10 ** float(i % 5) for i in range(8)]
    full = invariant.tree_sum(leaves)
    per_rank = 8 // world
    partials = [invariant.tree_sum(leaves[r * per_rank : (r + 1) * per_rank]) for r in range(world)]
    assert torch.equal(invariant.tree_sum(partials), full)
    # The order matters at all (else the test above would prove nothing): a running sum differs.
    running = leaves[0].clone()
    for t in leaves[1:]:
        running = running + t
    assert not torch.equal(running, full)


def _canonical(leaves: list) -> torch.Tensor:
    """The tree over any count, written from its definition: the maximal aligned blocks of the
    binary decomposition (largest first), each a pairwise tree, folded right to left."""

    def pairwise(block):
        if len(block) == 1:
            return block[0]
        half = len(block) // 2
        return pairwise(block[:half]) + pairwise(block[half:])

    blocks, at = [], 0
    for bit in reversed(range(len(leaves).bit_length())):
        if len(leaves) >> bit & 1:
            blocks.append(pairwise(leaves[at : at + 2**bit]))
            at += 2**bit
    acc = blocks[-1]
    for left in reversed(blocks[:-1]):
        acc = left + acc
    return acc


def test_a_tree_over_any_count_folds_its_aligned_blocks_right_to_left():
    t = [torch.tensor([float(i)]) for i in range(7)]
    with pytest.raises(ValueError):
        invariant.tree_sum([])
    assert invariant.tree_sum(t[:1]) is t[0]
    assert torch.equal(invariant.tree_sum(t[:3]), (t[0] + t[1]) + t[2])
    six = ((t[0] + t[1]) + (t[2] + t[3])) + (t[4] + t[5])
    assert torch.equal(invariant.tree_sum(t[:6]), six)
    seven = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + t[6])
    assert torch.equal(invariant.tree_sum(t), seven)
    # A rank's blocks: [3, 6) of 6 ends with [3, 4) and [4, 6); [2, 4) with one block.
    assert invariant.piece_levels(3, 6) == [0, 1] and invariant.piece_levels(2, 4) == [1]
    assert invariant.piece_levels(0, 12) == [3, 2] and invariant.piece_levels(6, 12) == [1, 2]
    with pytest.raises(ValueError, match="cannot start at position 1"):
        invariant.ListTree(start=1).add([torch.ones(1)], level=1)


def test_any_ranks_pieces_fed_with_their_levels_are_the_leaves_tree_bit_for_bit():
    """Every K in 1..24 and every W dividing it: each rank's ListTree over its block from its
    first shard, then all ranks' pieces in rank order, with their levels, in one tree from 0:
    the same bits as the K leaves fed one by one, and as the tree's definition (_canonical)."""
    g = torch.Generator().manual_seed(0)
    for k in range(1, 25):
        leaves = [torch.randn(257, generator=g) * 10 ** float(i % 5) for i in range(k)]
        whole = invariant.ListTree()
        for t in leaves:
            whole.add([t.clone()])
        reference = whole.result()[0]
        assert torch.equal(reference, _canonical(leaves)), k
        for world in (w for w in range(1, k + 1) if k % w == 0):
            tree = invariant.ListTree()
            for rank in range(world):
                block = invariant.rank_shards(rank, world, k)
                local = invariant.ListTree(start=block.start)
                for i in block:
                    local.add([leaves[i].clone()])
                pieces = local.pieces()
                assert [lv for lv, _ in pieces] == invariant.piece_levels(block.start, block.stop)
                for level, items in pieces:
                    tree.add(items, level)
            assert torch.equal(tree.result()[0], reference), (k, world)
    # The order matters at all (else the test would prove nothing): a running sum differs.
    running = leaves[0].clone()
    for t in leaves[1:]:
        running = running + t
    assert not torch.equal(running, reference)


@pytest.mark.parametrize("count", [0, 1, 5, 7, 8, 9, 63, 64, 100])
@pytest.mark.parametrize(
    "shards, world", [(8, 1), (8, 2), (8, 4), (8, 8), (6, 2), (6, 3), (6, 6), (12, 4)]
)
def test_a_ranks_slice_is_exactly_its_block_of_shards(count, shards, world):
    for rank in range(world):
        lo, hi = sampler.chunk_bounds(count, rank, world)
        block = invariant.rank_shards(rank, world, shards)
        assert sampler.chunk_bounds(count, block[0], shards)[0] == lo
        assert sampler.chunk_bounds(count, block[-1], shards)[1] == hi


def test_whole_eval_batches_cover_the_test_split_once_with_the_same_batches():
    for world in (1, 2, 4, 8):
        spans = [s for r in range(world) for s in sampler.eval_spans(359, 64, r, world, True)]
        assert spans == [(b, min(b + 64, 359)) for b in range(0, 359, 64)]


# --- what it refuses ---------------------------------------------------------------------------


TRAIN = ["train"]
CHECK = ["config", "check", "--world-size=2"]


@pytest.mark.parametrize(
    "command, overrides, says",
    [
        (TRAIN, ["dist.strategy=fsdp"], "works with dist.strategy=ddp or none, not fsdp"),
        (TRAIN, ["dist.strategy=dp"], "not dp"),
        (TRAIN, ["model.sync_bn=true"], "set model.sync_bn=false"),
        (CHECK, ["dist.strategy=fsdp"], "not fsdp"),
        (CHECK, ["model.sync_bn=true"], "set model.sync_bn=false"),
        (CHECK, ["dist.device=cuda"], "add repro.deterministic=true"),
    ],
    ids=["train-fsdp", "train-dp", "train-sync_bn", "check-fsdp", "check-sync_bn", "check-cuda"],
)
def test_what_cannot_hold_is_refused_in_one_line(command, overrides, says, capsys):
    """By `trainer train` before any work, and by `trainer config check` with the same rules."""
    from trainer import cli

    code = cli.main([*command, "repro.world_invariant=true", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_cuda_needs_deterministic_kernels():
    from trainer.parallel.dims import describe

    cfg = config.load(None, ["repro.world_invariant=true"])
    with pytest.raises(ConfigError, match="add repro.deterministic=true"):
        describe(cfg, 1, on_cuda=True)
    cfg.repro.deterministic = True
    dims = describe(cfg, 1, on_cuda=True)
    assert dims.name == "none" and dims.shards == 8 and dims.wraps == "none"


def test_batchnorm_shards_of_one_sample_are_refused_before_training(tmp_path):
    p = trainer(
        "train",
        *MLP,
        "repro.world_invariant=true",
        "model.name=tests.test_world_invariant:bn_mlp",
        "data.global_batch_size=8",
        f"run_dir={tmp_path / 'run'}",
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "raise data.global_batch_size to at least 16" in p.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("shards", [0, -8, 2**16 + 1])
def test_shards_must_be_a_positive_count(shards):
    with pytest.raises(ConfigError, match=r"repro.shards: must be > 0 and <= 2\*\*16"):
        config.load(None, [f"repro.shards={shards}"])
    assert [config.load(None, [f"repro.shards={k}"]).repro.shards for k in (3, 6)] == [3, 6]


def test_config_check_names_the_world_sizes_that_fit(capsys):
    from trainer import cli

    def check(world, *args):
        code = cli.main(["config", "check", f"--world-size={world}", "repro.world_invariant=true",
                         "data.global_batch_size=48", *args])  # fmt: skip
        return code, capsys.readouterr().err.strip()

    code, err = check(3)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "run on 1, 2, 4, 8 ranks" in err and "repro.shards=24" in err
    code, err = check(4, "repro.shards=6")
    assert code == 2 and "run on 1, 2, 3, 6 ranks" in err and "repro.shards=12" in err, err
    assert check(4)[0] == 0
    assert check(3, "repro.shards=6")[0] == 0 and check(4, "repro.shards=12")[0] == 0


# --- the same bits on 1, 2, 4 and 8 ranks ------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(world, *args) -> _run's record of that run, made once per session (helpers.shared_run:
    by the first worker that asks)."""
    cache = {}

    def get(world: int, *args: str) -> dict:
        key = (world, args)
        if key not in cache:
            folder = shared_run(
                tmp_path_factory,
                f"world-invariant {world} {args!r}",
                lambda f: _train(f, world, *args),
            )
            cache[key] = _record(folder / f"w{world}")
        return cache[key]

    return get


def _train(tmp_path, world, *args) -> None:
    """World 1 in this process (one thread, as each rank has); more ranks started directly with
    torchrun's variables (helpers.ranks: the launcher is not what these tests are about)."""
    run_dir = tmp_path / f"w{world}"
    if world == 1:
        train_here("train", *args, f"run_dir={run_dir}")
    else:
        trainer("train", *args, f"run_dir={run_dir}", nproc=world, torchrun=False)


def _run(tmp_path, world, *args) -> dict:
    _train(tmp_path, world, *args)
    return _record(tmp_path / f"w{world}")


def _record(run_dir) -> dict:
    records = read_jsonl(run_dir / "metrics.jsonl")
    return {
        "train": [(r["step"], r["loss"]) for r in records if r["kind"] == "train"],
        "eval": [
            {k: v for k, v in r.items() if k.startswith("eval.")}
            for r in records
            if r["kind"] == "eval"
        ],
        "weights": weights(run_dir),
        "digest": json.loads((run_dir / "summary.json").read_text())["weights_sha256"],
        "run_dir": run_dir,
    }


def _assert_identical(got: dict, ref: dict) -> None:
    assert got["train"] == ref["train"]
    assert got["eval"] == ref["eval"] and ref["eval"]
    assert got["weights"].keys() == ref["weights"].keys()
    for name, t in ref["weights"].items():
        assert torch.equal(got["weights"][name], t), name
    # summary.json's digest of the tensors alone agrees; the files differ (their config metadata)
    assert got["digest"] == ref["digest"] == file_digest(ref["run_dir"] / "final/model.safetensors")
    assert _sha256(got["run_dir"]) != _sha256(ref["run_dir"])


def _sha256(run_dir) -> str:
    return hashlib.sha256((run_dir / "final" / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, worlds",
    [
        pytest.param(MLP, (2, 8), id="mlp", marks=pytest.mark.long),  # 41 s: make test-long
        pytest.param(LENET, (2,), id="lenet"),
        pytest.param(GPT_SAVING, (2,), id="gpt"),
    ],
)
def test_worlds_1_2_and_8_train_the_same_bits(runs, args, worlds):
    """The MLP on 2 and 8 ranks: a rank owns 4 or 1 of the 8 shards, so the tree is combined
    across ranks from the first level to the last (world 4, 2 shards a rank, runs in the GPT's
    resume test below). What a model adds (convolutions,
    attention, per-shard dropout) runs inside each shard, the same on any world: LeNet and the
    GPT on 2 ranks against one process. (World 8 for them too cost 90 s of suite time and tested
    the MLP's tree again; the MLP on 4 as well, 15 s.)"""
    ref = runs(1, *args, *ON)
    assert len(ref["train"]) == 6
    for world in worlds:
        _assert_identical(runs(world, *args, *ON), ref)


@pytest.mark.slow
@pytest.mark.long  # 36 s: make test-long (make test stays in its 12 minutes)
def test_six_shards_train_the_same_bits_on_1_2_and_3_ranks(tmp_path):
    """repro.shards=6, not a power of two: on 2 ranks each block ([0,3), [3,6)) is two aligned
    subtrees, sent as two pieces; on 3 ranks one pair each. Micro-steps and a binding clip (ON);
    3 steps, so later steps start from weights the tree made."""
    args = [*MLP, *ON, "repro.shards=6", "data.global_batch_size=48", "train.max_steps=3"]
    ref = _run(tmp_path, 1, *args)
    assert len(ref["train"]) == 3
    for world in (2, 3):
        _assert_identical(_run(tmp_path, world, *args), ref)


@pytest.mark.slow
def test_without_the_mode_world_sizes_differ_in_the_last_bits(reference_runs):
    """What the mode buys: plain DDP at world 2 is close to world 1, but not the same bits (the
    session's reference runs, 69 steps of the MLP, which test_distributed compares too)."""
    w1, w2 = weights(reference_runs(1)), weights(reference_runs(2))
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    digests = [
        json.loads((reference_runs(world) / "summary.json").read_text())["weights_sha256"]
        for world in (1, 2)
    ]
    assert digests[0] != digests[1] and None not in digests
    assert all(torch.allclose(w1[k], w2[k], rtol=0, atol=1e-5) for k in w1)


@pytest.mark.slow
def test_batchnorm_statistics_and_bf16_autocast_hold_too(tmp_path):
    args = [
        *MLP,
        *ON,
        "model.name=tests.test_world_invariant:bn_mlp",
        "train.precision=bf16",
    ]
    ref = _run(tmp_path, 1, *args)
    assert any(k.endswith("running_var") for k in ref["weights"])
    _assert_identical(_run(tmp_path, 2, *args), ref)  # 4 shards per rank, and across ranks


@pytest.mark.slow
def test_saved_on_2_ranks_resumed_on_4_ends_at_the_one_process_weights(runs, tmp_path):
    args = [*GPT_SAVING, *ON]  # the runs of test_worlds_1_2_and_8_train_the_same_bits[gpt]
    ref = runs(1, *args)
    saved = runs(2, *args)["run_dir"] / "checkpoints" / "step-000000003"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["world_size"] == 2
    resumed = _run(tmp_path / "resumed", 4, *args, f"ckpt.resume={saved}")
    assert [s for s, _ in resumed["train"]] == [4, 5, 6]
    assert resumed["train"] == ref["train"][3:]
    for name, t in ref["weights"].items():
        assert torch.equal(resumed["weights"][name], t), name


def test_off_by_default():
    cfg = config.load(None, [])
    assert cfg.repro.world_invariant is False and cfg.repro.shards == 8


# --- the threads a process gets, and the kernels that made the bits -----------------------------

DEFAULT_MLP = [  # digits-mlp's own width: its matmuls split over threads (MLP's [32] do not)
    "train.max_steps=10",
    "log.every_steps=1",
    "log.progress=plain",
    "log.tensorboard=false",
    "repro.world_invariant=true",
]


@pytest.mark.slow
def test_world_1_with_its_default_threads_equals_world_2_under_torchrun(runs, tmp_path):
    """What a user tries first: `trainer train repro.world_invariant=true` (this machine's 2
    default threads) against torchrun's 2 ranks (1 thread each). Different from step 7 before
    the trainer pinned one thread under the mode."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT, env

    run_dir = tmp_path / "w1"
    default_threads = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}
    argv = [sys.executable, "-m", "trainer", "train", *DEFAULT_MLP, f"run_dir={run_dir}"]
    p = subprocess.run(argv, env=default_threads, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["kernels"]["threads"] == 1 and (os.cpu_count() or 1) > 1
    two = runs(2, *DEFAULT_MLP)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records if r["kind"] == "train"] == two["train"]
    got = weights(run_dir)
    assert all(torch.equal(got[k], t) for k, t in two["weights"].items())


def test_an_in_process_run_gives_its_threads_back(tmp_path):
    from tests.helpers import TINY
    from trainer.train import train

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train(config.load(None, [*TINY, *ON, "log.progress=none", f"run_dir={tmp_path}"]))
        assert torch.get_num_threads() == 2  # pinned to 1 for the run only
    finally:
        torch.set_num_threads(before)
    assert json.loads((tmp_path / "run.json").read_text())["kernels"]["threads"] == 1


def test_a_resume_on_other_kernels_is_refused_in_one_line(tmp_path, capsys):
    from tests.helpers import TINY
    from trainer import cli
    from trainer.checkpoint import store

    args = [*TINY, *ON, "log.progress=none", "train.epochs=1", f"run_dir={tmp_path}"]
    train_here("train", *args)
    ckpt = tmp_path / "checkpoints" / "step-000000003"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kernels"]["device"] == "cpu" and meta["kernels"]["threads"] == 1
    meta["kernels"]["cpu_capability"] = "SOME-OTHER-ISA"  # as if saved on another machine
    (ckpt / "meta.json").write_text(json.dumps(meta))
    store.write_manifest(str(ckpt))
    code = cli.main(["train", *args[:-2], "train.epochs=2", f"run_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "cannot resume" in err[0] and "cpu_capability 'SOME-OTHER-ISA' ->" in err[0]
    code = cli.main(["train", *args[:-2], "train.epochs=2", "repro.world_invariant=false",
                     f"run_dir={tmp_path}"])  # fmt: skip
    assert code == 0, capsys.readouterr().err  # without the promise, it resumes


# --- shards grouped into one backward pass ------------------------------------------------------


class _Gated(torch.nn.Module):
    """A linear layer, a dropout, and a parameter only shards whose first label is even use (a
    gradient missing from some shards must enter the tree as zeros, -0.0 included)."""

    def __init__(self, hidden_only=False):
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(64, 10), torch.nn.Dropout(0.2)
        self.gate = torch.nn.Parameter(torch.full((10,), -0.0))
        self.outside = [self.fc.weight] if hidden_only else None  # reached past the module

    def forward(self, x):
        x = x.flatten(1)
        out = self.drop(self.fc(x))
        if self.outside is not None:
            out = out + x @ self.outside[0].t() * 0.5
        return out + self.gate if bool(x[0, 0] > 0) else out


def _steps(micro: int, grouped: bool, model_kwargs=None, world: int = 1) -> dict:
    """Weights after 3 world-invariant steps of _Gated on the digits (rank 0 of `world`)."""
    from trainer import data, optim, tasks
    from trainer.invariant import ShardedGradients
    from trainer.parallel.parts import whole
    from trainer.step import TrainStep, make_scaler

    cfg = config.load(None, [f"train.micro_batch_size={micro or 'null'}", "optim.name=sgd"])
    spec = data.build(cfg.data, 0, "cpu")
    torch.manual_seed(0)
    model = _Gated(**(model_kwargs or {}))
    opt = optim.build_optimizer(cfg.optim, model.parameters())
    shards = ShardedGradients(model, rank=0, world_size=world, shards=8, grouped=grouped)
    step = TrainStep(
        cfg=cfg.train, parts=whole(model), optimizer=opt, task=tasks.build(cfg.task, spec),
        scheduler=optim.build_scheduler(cfg.sched, opt, 10, 10), scaler=make_scaler(cfg.train, "cpu"),
        shards=shards,
    )  # fmt: skip
    backwards = []
    original = torch.autograd.backward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            torch.autograd, "backward", lambda *a, **k: backwards.append(1) or original(*a, **k)
        )
        for i, n in enumerate((64, 64, 5)):  # the last: 3 of the 8 shards empty
            count = n * world  # rank 0's share of a global batch of n * world samples
            step(spec.train.take(torch.arange(i * 64, i * 64 + n)), count, i)
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "backwards": len(backwards), "grouped": step.shards.grouped}  # fmt: skip


def test_a_shards_gradient_does_not_depend_on_how_many_shards_its_backward_pass_holds():
    """Groups of 8, 4, 2 and 1 shards per backward pass (micro_batch_size 0, 32, 16, 8: whole
    shards of 8 samples), and the shard-by-shard loop: the same bits (dropout, a parameter
    some shards do not use, empty shards)."""
    loop = _steps(0, grouped=False)
    assert loop["backwards"] == 8 + 8 + 5  # one per non-empty shard
    # Autograd calls: groups of up to `micro` samples (the last step's shards hold 1 sample).
    for micro, calls in ((0, 1 + 1 + 1), (32, 2 + 2 + 1), (16, 4 + 4 + 1), (8, 8 + 8 + 1)):
        got = _steps(micro, grouped=True)
        assert got["grouped"] and got["backwards"] == calls, (micro, got["backwards"])
        for name, t in loop["state"].items():
            assert torch.equal(got["state"][name], t), (micro, name)


def test_a_model_reaching_its_parameters_past_its_modules_falls_back_to_the_same_bits():
    loop = _steps(0, grouped=False, model_kwargs={"hidden_only": True})
    with pytest.warns(UserWarning, match="each shard runs its own backward pass"):
        got = _steps(0, grouped=True, model_kwargs={"hidden_only": True})
    assert not got["grouped"]
    for name, t in loop["state"].items():
        assert torch.equal(got["state"][name], t), name


def test_a_cpu_runs_shard_gradients_keep_freed_memory():
    """K shard gradients allocated together and freed together went back to the OS after every
    step and were page-faulted in again (1,124 minor faults, 5 ms of system time a step on the
    digits MLP, docs/benchmarks.md): a CPU run's ShardedGradients asks glibc to keep freed memory,
    and glibc takes both settings. (The fault counts themselves depend on the heap's history, so
    the bench, not this test, measures them.)"""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt only")
    asked = []  # process-wide, so checked through a stand-in
    with pytest.MonkeyPatch.context() as m:
        m.setattr(invariant, "keep_freed_memory", lambda: asked.append(1) or True)
        invariant.ShardedGradients(torch.nn.Linear(2, 2), rank=0, world_size=1, shards=8)
    assert asked
    assert invariant.keep_freed_memory()


# --- ShardedGradients on any world size dividing the shards ----------------------------------


def _rank_step(world: int, rank: int, grouped: bool, gathered: dict) -> dict:
    """One step of ShardedGradients with 6 shards of 5 samples as rank `rank` of `world` in this
    process: the all-gather returns `gathered` (every rank's vector, once each rank has run) or,
    while they are being collected, this rank's own vector W times; records it in `gathered`."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 8, generator=g), torch.randint(0, 3, (30,), generator=g)
    shards = invariant.ShardedGradients(model, rank=rank, world_size=world, shards=6,
                                        grouped=grouped)  # fmt: skip

    def loss_of(piece):
        loss = torch.nn.functional.cross_entropy(model(piece[0]), piece[1], reduction="sum")
        return loss / 30, loss.detach().float()

    seed = lambda k: invariant.seed_shard(0, 0, k, "cpu")  # noqa: E731
    mine = [(k, (x[5 * k : 5 * k + 5], y[5 * k : 5 * k + 5])) for k in shards.shards_here()]
    if grouped:
        assert shards.run_grouped(mine, 2, loss_of, seed)
    else:
        shards.begin(fold=True)
        for k, piece in mine:
            shards.start_shard()
            seed(k)
            root, local = loss_of(piece)
            root.backward()
            shards.end_shard(local)

    def all_gather(flat, world_size):
        gathered.setdefault(rank, flat.clone())
        if len(gathered) < world_size:
            return [flat.clone() for _ in range(world_size)]
        return [gathered[r].clone() for r in range(world_size)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(invariant, "all_gather", all_gather)
        losses = shards.combine()
    return {"grads": [p.grad for p in model.parameters()], "buffers": list(model.buffers()),
            "losses": losses, "fold": shards._fold}  # fmt: skip


@pytest.mark.parametrize("grouped", [False, True], ids=["shard-loop", "grouped"])
def test_six_shards_give_every_rank_of_worlds_1_2_3_and_6_the_one_process_sums(grouped):
    """Rank blocks [0,6); [0,3),[3,6) (not aligned subtrees: 2 pieces each); [0,2),[2,4),[4,6);
    one shard each. Gradients, BatchNorm buffers and shard losses: the same bits on every rank as
    in one process. The shard loop folds pairs into autograd only where a rank's block is pairs
    (worlds 1 and 3)."""
    ref = _rank_step(1, 0, False, {})
    assert ref["fold"]
    for world in (1, 2, 3, 6):
        gathered: dict = {}
        for _ in range(2):  # collect every rank's vector, then combine with them
            got = [_rank_step(world, rank, grouped, gathered) for rank in range(world)]
        for rank, run in enumerate(got):
            assert run["fold"] == (not grouped and world in (1, 3)), (world, rank)
            assert torch.equal(run["losses"], ref["losses"]), (world, rank)
            for a, b in zip(run["grads"] + run["buffers"], ref["grads"] + ref["buffers"],
                            strict=True):  # fmt: skip
                assert torch.equal(a, b), (world, rank)


# --- cuts at any row size ----------------------------------------------------------------------


def test_an_aligned_cut_computes_what_a_fresh_copy_does_at_any_row_size_and_offset():
    """The property world_invariant rests on where rows are not a multiple of 64 bytes: a cut
    (a view at a row offset) through batch.aligned starts on ALIGN bytes and gives a Linear's
    output and weight gradient bit for bit as a fresh copy of its rows does, for row sizes
    from 1 to 33 floats, 1 and 3 rows, and every offset in 16 rows (every start modulo 64 such a
    row reaches). (Unaligned, 3 rows of 5 or 7 features differed on this machine's MKL at some
    offsets: batch.ALIGN.)"""
    from trainer import batch as batches

    torch.manual_seed(0)
    checked = 0
    for width in (1, 3, 5, 7, 9, 13, 17, 31, 33):
        lin = torch.nn.Linear(width, 37)
        x, y = torch.randn(24, width), torch.arange(24)
        for rows in (1, 3):
            for lo in range(16):
                got_x, got_y = batches.aligned(batches.cut((x, y), lo, lo + rows))
                assert (
                    got_x.data_ptr() % batches.ALIGN == 0 and got_y.data_ptr() == y[lo:].data_ptr()
                )
                fresh = x[lo : lo + rows].clone()
                outs = [lin(t) for t in (got_x, fresh)]
                grads = [torch.autograd.grad(o.square().sum(), lin.weight)[0] for o in outs]
                assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
                checked += 1
    assert checked == 9 * 2 * 16


@pytest.mark.slow
def test_rows_of_20_bytes_train_the_same_bits_on_1_and_2_ranks_with_every_cut_aligned(tmp_path):
    """5 features a sample (20-byte rows), shards of 6 and micro-batches of 3: one process cuts
    shards and micro-batches at offsets of 60, 120, ... bytes, rank 1 of 2 at others (its
    slice starts 480 bytes in, 32 past a multiple of 64). Every cut the model sees starts on
    ALIGN bytes on both (the probe's log), and the bits agree."""
    log = tmp_path / "offsets"
    args = [
        "data.name=synthetic", "data.synthetic.shape=[5]", "data.synthetic.size=240",
        "data.synthetic.test_size=24", "model.name=tests.test_world_invariant:offset_probe",
        f"model.kwargs.log={log}", "data.global_batch_size=48", "train.epochs=1",
        "train.max_steps=3", "log.every_steps=1", *ON,
    ]  # fmt: skip
    ref = _run(tmp_path, 1, *args)
    _assert_identical(_run(tmp_path, 2, *args), ref)
    offsets = [line for f in tmp_path.glob("offsets.*") for line in f.read_text().split()]
    assert len(offsets) > 50 and set(offsets) == {"0"}, sorted(set(offsets))
