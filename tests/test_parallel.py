"""Model parallelism (trainer/parallel/): the mesh's rules, the pipeline's split of a model, and
pipeline runs against one process: the same bits for GPipe, 1F1B and interleaved 1F1B, with
gradient clipping and the GPT's tied embedding/head, and checkpoints that resume under another
layout (pp -> world 1, world 1 -> pp)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from tests.helpers import ranks, shared_run, train_here, weights
from trainer.config import check_world_size, load, resolve_strategy
from trainer.errors import ConfigError, UsageError
from trainer.gpt import GPT
from trainer.parallel import layout, mesh, pipeline
from trainer.parallel import split as splits
from trainer.parallel.dims import ParallelDims, describe

TINY = [
    "model.gpt.layers=4",
    "model.gpt.width=32",
    "model.gpt.heads=2",
    "data.text.seq_len=32",
    "data.text.max_train_bytes=40000",
    "data.text.max_test_bytes=4096",
    "train.max_steps=4",
    "train.micro_batch_size=8",
    "train.eval_every_steps=4",
    "log.every_steps=1",
    "log.progress=none",
    "ckpt.every_steps=2",
    "ckpt.async_save=false",
    "log.tensorboard=false",
    "optim.decay=no_bias_norm",
]
PRESET = ["--config", "stdlib-gpt"]
INVARIANT = ["repro.world_invariant=true", "train.micro_batch_size=null", "data.eval_batch_size=32"]


# --- the mesh ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,world,expected",
    [
        (None, 4, layout.Layout(dp=4)),
        ("pp=2", 4, layout.Layout(dp=2, pp=2)),
        ("dp=2,pp=2", 4, layout.Layout(dp=2, pp=2)),
        ("tp=2, dp=1", 2, layout.Layout(tp=2)),
        ("dp=2,tp=2", 4, layout.Layout(dp=2, tp=2)),
    ],
)
def test_mesh_parses(text, world, expected):
    assert layout.parse(text, world) == expected


@pytest.mark.parametrize(
    "text,world,says",
    [
        ("pp=3", 4, "does not divide the 4 ranks"),
        ("dp=2,pp=2", 2, "dp x pp x tp = 4, but 2 rank(s)"),
        ("xx=2", 2, "is not a dimension"),
        ("pp=0", 2, "is not a dimension"),
        ("pp=2,pp=2", 2, "given twice"),
    ],
)
def test_bad_mesh_is_one_line(text, world, says):
    with pytest.raises(ConfigError, match="dist.mesh") as e:
        layout.parse(text, world)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_coordinates_are_dp_major_tp_innermost():
    lay = layout.Layout(dp=2, pp=2, tp=2)
    seen = [mesh.coordinates(r, lay) for r in range(8)]
    assert seen[:3] == [(0, 0, 0), (0, 0, 1), (0, 1, 0)] and seen[7] == (1, 1, 1)
    assert all(mesh.rank_of(lay, *seen[r]) == r for r in range(8))


def _cfg(*overrides):
    return load("stdlib-gpt", list(overrides))


@pytest.mark.parametrize(
    "overrides,world,says",
    [
        (["dist.mesh=pp=2", "train.micro_batch_size=32"], 2, "at least one per stage"),
        (["dist.mesh=pp=2", "train.micro_batch_size=5"], 2, "equal micro-batches of 5"),
        (["dist.mesh=pp=2", "dist.strategy=dp"], 2, "single-process nn.DataParallel"),
        (["dist.mesh=tp=2", "repro.world_invariant=true"], 2, "drop tp"),
        (["dist.mesh=pp=2", *INVARIANT, "model.dropout=0.1"], 2, "set model.dropout=0"),
        (["dist.mesh=pp=2", *INVARIANT, "repro.shards=1"], 2, "set repro.shards to 2 or more"),
        (["dist.mesh=pp=2", *INVARIANT, "data.global_batch_size=36"], 2, "a multiple of 8"),
        (["dist.mesh=pp=2", "repro.world_invariant=true", "train.micro_batch_size=8"], 2, "unset"),
        (["dist.mesh=tp=2", "train.compile=true"], 2, "train.compile"),
        (["dist.mesh=pp=2", *INVARIANT, "train.compile=true"], 2, "set train.compile=false"),
        (["dist.mesh=dp=2,tp=2", "dist.strategy=ddp"], 4, "DDP cannot all-reduce"),
        (["dist.mesh=pp=2", "data.global_batch_size=31"], 4, "does not split over 2 ranks"),
    ],
)
def test_what_cannot_compose_is_one_line(overrides, world, says):
    cfg = _cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        resolve_strategy(cfg, world)
        check_world_size(cfg, world)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_pure_data_parallelism_is_unchanged():
    """No mesh: the batch splits over every rank and strategy auto is ddp, as before meshes."""
    cfg = _cfg("data.global_batch_size=30")
    with pytest.raises(ConfigError, match="does not split over 4 ranks"):
        check_world_size(cfg, 4)
    assert resolve_strategy(_cfg(), 4) == "ddp"
    assert resolve_strategy(_cfg("dist.mesh=pp=2"), 2) == "none"  # dp=1 under the pipeline
    assert mesh.Mesh(ParallelDims(layout.Layout(dp=4)), rank=3, dp_rank=3).contributes


# --- the split -----------------------------------------------------------------------------------


def test_gpt_splits_into_stages_with_whole_model_names():
    torch.manual_seed(0)
    model = GPT(256, 16, 4, 32, 2)
    split = splits.plan(model, 2)
    assert split.stages == [["0", "1"], ["2", "3"]]
    assert split.before == ["tok", "pos", "drop"] and split.after == ["ln_f", "head"]
    whole = model.state_dict()
    pieces = [splits.piece(model, split, [s]).state_dict() for s in range(2)]
    assert set(pieces[0]) | set(pieces[1]) == set(whole)
    assert all(torch.equal(p[k], whole[k]) for p in pieces for k in p)
    assert "head.weight" in pieces[1] and "tok.weight" not in pieces[1]
    # The stages run in turn give the whole model's output.
    x = torch.randint(0, 256, (2, 16))
    stages = [splits.piece(model, split, [s]) for s in range(2)]
    assert torch.equal(stages[1](stages[0](x)), model(x))
    (tied,) = splits.tied_weights(model, split)
    assert tied.names == {0: "tok.weight", 1: "head.weight"} and tied.canonical == "tok.weight"


def test_a_model_that_cannot_be_split_is_one_line():
    with pytest.raises(ConfigError, match="cannot split the model's 4 layers"):
        splits.plan(GPT(256, 16, 4, 32, 2), 3)
    with pytest.raises(UsageError, match="pipeline_layers"):
        splits.plan(nn.Sequential(nn.Linear(2, 2)), 2)

    class Rooted(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

        def pipeline_layers(self):
            return "layers"

    with pytest.raises(UsageError, match="parameters on its root"):
        splits.plan(Rooted(), 2)


def _stepped(cfg, model):
    """The optimizer optim.build makes for `model` after one step (some state to move)."""
    from trainer import optim

    opt = optim.build(cfg.optim, model)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    opt.step()
    return opt


def _stage(model, stage: int, cfg):
    """Stage `stage` of a pp=2 layout of `model`, laid out here without a process group."""
    from trainer.parallel.apply import parallelize
    from trainer.ranks import World

    on = mesh.Mesh(describe(cfg, 2), rank=stage, pp_rank=stage)
    return parallelize(model, on, World(), cfg.train)


@pytest.mark.parametrize("saved", ["by name", "by index (main at 3a8a994)"])
def test_a_whole_optimizer_state_loads_into_a_stage_by_name(saved):
    """A world-1 checkpoint's optimizer state (here two groups from optim.decay=no_bias_norm,
    and frozen parameters left out) loads into the last stage of a pp=2 layout through DCP's
    state-dict API: each parameter its own state (the tied head's from tok.weight) and each
    group its own settings. An index-keyed state (whole checkpoints before names) is read by the
    numbering of the optimizer that wrote it, to the same result."""
    from trainer import namedstate, optim, params
    from trainer.parallel.parts import whole

    cfg = _cfg(
        "dist.mesh=pp=2", "optim.decay=no_bias_norm", "optim.weight_decay=0.1",
        "optim.freeze=pos.weight",
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(256, 16, 4, 32, 2)
    params.freeze(model, cfg.optim.freeze)
    opt = _stepped(cfg, model)
    order = params.numbering(cfg.optim, model.named_parameters())
    state = namedstate.whole(whole(model), opt)
    if saved != "by name":
        state = {**state, "optimizer": opt.state_dict()}
    parts = _stage(model, 1, cfg)
    mine = optim.build(cfg.optim, parts.view, whole=order)
    namedstate.load_whole(
        parts, mine, state, sharded=True, index_keyed=saved != "by name", numbering=order
    )
    assert [g["weight_decay"] for g in mine.param_groups] == [0.1, 0.0]
    for name, p in parts.view.named_parameters():
        if not p.requires_grad:
            continue
        ours, theirs = mine.state[p], opt.state[p]  # the same Parameter objects
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name
        g = next(g for g in mine.param_groups if any(q is p for q in g["params"]))
        assert g["weight_decay"] == (0.0 if p.dim() < 2 else 0.1), name


def test_a_stage_checks_optim_groups_against_the_whole_model():
    """A group whose parameters all sit on another stage is no error on this one; a pattern
    that matches nothing in the whole model still is."""
    from trainer import params

    model = GPT(256, 16, 4, 32, 2)
    view = splits.piece(model, splits.plan(model, 2), [0])
    whole = params.numbering(_cfg().optim, model.named_parameters())
    late = _cfg("optim.groups.late.params=blocks.3.*", "optim.groups.late.lr_mult=0.1").optim
    groups = params.param_groups(late, view.named_parameters(), whole)
    assert [g["group"] for g in groups] == ["default"]
    with pytest.raises(UsageError, match="optim.groups.late"):
        params.param_groups(late, view.named_parameters())
    typo = _cfg("optim.groups.late.params=block.3.*").optim
    with pytest.raises(UsageError, match="match no trainable parameter"):
        params.param_groups(typo, view.named_parameters(), whole)


def test_an_index_keyed_optimizer_state_is_named_as_its_optimizer_numbers_it():
    """A whole checkpoint written before names: index i is the optimizer's i-th parameter group
    after group (params.numbering), not the model's i-th parameter."""
    from trainer import namedstate, params

    cfg = _cfg("optim.decay=no_bias_norm", "optim.freeze=pos.weight")
    torch.manual_seed(0)
    model = GPT(256, 16, 4, 32, 2)
    params.freeze(model, cfg.optim.freeze)
    opt = _stepped(cfg, model)
    order = params.numbering(cfg.optim, model.named_parameters())
    keyed = namedstate.by_name(opt.state_dict(), order)
    by_name = dict(model.named_parameters())
    assert "pos.weight" not in keyed["state"]
    for name, state in keyed["state"].items():
        assert torch.equal(state["exp_avg"], opt.state[by_name[name]]["exp_avg"]), name


# --- runs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The world-1 reference: the same micro-batches, one thread (as each rank has)."""
    return shared_run(
        tmp_path_factory,
        "parallel:world1",
        lambda d: train_here("train", *TINY, f"run_dir={d}", config_file="stdlib-gpt"),
    )


def _losses(run_dir):
    from tests.helpers import train_losses

    return train_losses(run_dir)


def _resume_at_step_2(src, dst):
    """A copy of run `src` as if it had been stopped after its step-2 checkpoint."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("step-000000004", "final"))
    (dst / "summary.json").unlink(missing_ok=True)
    return dst


@pytest.mark.slow
def test_pipeline_gives_one_process_bits_and_resumes_under_another_layout(one_process, tmp_path):
    """Interleaved 1F1B (4 stages on 2 ranks) with clipping and the tied embedding/head: the
    same losses and final weights as one process, bit for bit; its step-2 checkpoint resumes at
    world 1 to the same bits; the world-1 run's step-2 checkpoint resumes under pp=2 GPipe."""
    pp = tmp_path / "pp"
    mesh_args = ["dist.mesh=pp=2", "dist.pp_schedule=interleaved-1f1b"]
    out = ranks("train", *PRESET, *TINY, *mesh_args, f"run_dir={pp}", nproc=2).stdout
    assert "pipeline: 4 stages of 1 layer(s) (interleaved-1f1b)" in out
    assert _losses(pp) == _losses(one_process) and len(_losses(pp)) == 4
    reference = weights(one_process)
    assert all(torch.equal(weights(pp)[k], reference[k]) for k in reference)

    from trainer.cli import main

    exported = tmp_path / "export"  # plain whole weights from the pp run's sharded checkpoint
    assert main(["export", str(pp / "checkpoints" / "step-000000002"), "-o", str(exported)]) == 0
    from safetensors.torch import load_file

    whole = load_file(str(one_process / "checkpoints" / "step-000000002" / "model.safetensors"))
    assert all(
        torch.equal(load_file(str(exported / "model.safetensors"))[k], whole[k]) for k in whole
    )

    back = _resume_at_step_2(pp, tmp_path / "back")  # pp=2 -> world 1
    train_here("train", *TINY, f"run_dir={back}", config_file="stdlib-gpt")
    assert all(torch.equal(weights(back)[k], reference[k]) for k in reference)

    forth = _resume_at_step_2(one_process, tmp_path / "forth")  # world 1 -> pp=2 gpipe
    out = ranks(
        "train",
        *PRESET,
        *TINY,
        "dist.mesh=pp=2",
        "dist.pp_schedule=gpipe",
        f"run_dir={forth}",
        nproc=2,
    ).stdout
    assert "resum" in out.lower()
    assert all(torch.equal(weights(forth)[k], reference[k]) for k in reference)


@pytest.mark.mesh
@pytest.mark.slow
def test_a_frozen_tied_embedding_trains_under_a_pipeline_as_in_one_process(tmp_path):
    """optim.freeze='tok.*' freezes the GPT's embedding and so its tied head: under pp=2 the two
    stages' copies have no gradient to exchange (it raised "cannot register a hook on a tensor
    that doesn't require gradient"); the run equals one process's bit for bit."""
    frozen = [*TINY, "optim.freeze='tok.*'"]
    one = tmp_path / "one"
    train_here("train", *frozen, f"run_dir={one}", config_file="stdlib-gpt")
    pp = tmp_path / "pp"
    ranks("train", *PRESET, *frozen, "dist.mesh=pp=2", f"run_dir={pp}", nproc=2)
    assert _losses(pp) == _losses(one)
    got, want = weights(pp), weights(one)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_pipeline_under_data_parallelism_at_world_4_tracks_one_process(
    strategy, one_process, tmp_path
):
    """dp=2 x pp=2 (each stage's gradients averaged over its dp pair; under fsdp the tied
    embedding/head is whole on each rank and averaged by the pipeline): the curve tracks one
    process within rounding. No train.micro_batch_size: each rank's 16 samples are cut into one
    micro-batch per stage (8, as the reference's)."""
    run = tmp_path / "dppp"
    args = [*PRESET, *TINY, "dist.mesh=dp=2,pp=2", f"dist.strategy={strategy}"]
    ranks("train", *args, "train.micro_batch_size=null", f"run_dir={run}", nproc=4, timeout=300)
    _within(run, one_process)


@pytest.fixture(scope="module")
def invariant_one(tmp_path_factory):
    """The world-1 reference of repro.world_invariant (8 shards of 4 samples a step)."""
    return shared_run(
        tmp_path_factory,
        "parallel:invariant-world1",
        lambda d: train_here("train", *TINY, *INVARIANT, f"run_dir={d}", config_file="stdlib-gpt"),
    )


def _same_bits(run, reference_run) -> None:
    assert _losses(run) == _losses(reference_run) and len(_losses(run)) == 4
    reference = weights(reference_run)
    assert all(torch.equal(weights(run)[k], reference[k]) for k in reference)
    summary = [json.loads((r / "summary.json").read_text()) for r in (run, reference_run)]
    assert summary[0]["eval"] == summary[1]["eval"]


@pytest.mark.slow
def test_world_invariant_pipeline_gives_world_1_bits_and_resumes_there(invariant_one, tmp_path):
    """repro.world_invariant under pp=2: each shard is a micro-batch, its gradients kept per
    micro-batch and added in the fixed tree; losses, test metrics and weights are the world-1
    run's, bit for bit, and its step-2 checkpoint resumes at world 1 to the same bits."""
    run = tmp_path / "pp"
    ranks("train", *PRESET, *TINY, *INVARIANT, "dist.mesh=pp=2", f"run_dir={run}", nproc=2)
    _same_bits(run, invariant_one)
    back = _resume_at_step_2(run, tmp_path / "back")
    train_here("train", *TINY, *INVARIANT, f"run_dir={back}", config_file="stdlib-gpt")
    _same_bits(back, invariant_one)


@pytest.mark.mesh
@pytest.mark.slow
def test_world_invariant_data_and_pipeline_parallel_gives_world_1_bits(invariant_one, tmp_path):
    """dp=2 x pp=2 under repro.world_invariant: each replica's 4 shards in its subtree, the two
    subtree sums all-gathered over dp and added in the same tree: the world-1 run's bits."""
    run = tmp_path / "dppp"
    args = [*PRESET, *TINY, *INVARIANT, "dist.mesh=dp=2,pp=2"]
    ranks("train", *args, f"run_dir={run}", nproc=4, timeout=300)
    _same_bits(run, invariant_one)


def _within(run, reference_run, tol=1e-5) -> None:
    mine, ref = _losses(run), _losses(reference_run)
    assert mine.keys() == ref.keys()
    assert max(abs(mine[k] - ref[k]) for k in ref) < tol
    reference = weights(reference_run)
    assert max((weights(run)[k] - reference[k]).abs().max().item() for k in reference) < tol


@pytest.mark.mesh
@pytest.mark.slow
def test_pipeline_of_tensor_parallel_stages_tracks_one_process_and_resumes(one_process, tmp_path):
    """pp=2 x tp=2: each stage's layers split over its tp pair (the tied embedding/head
    replicated, its copies added by the pipeline); tracks one process within tp's rounding, and
    its step-2 checkpoint resumes at world 1 to the same tolerance. Its dry run first."""
    dry = ranks("train", *PRESET, *TINY, "dist.mesh=pp=2,tp=2", "--dry-run", nproc=4).stdout
    assert "samples over 1 data-parallel replica(s) of 4 ranks) loss" in dry
    run = tmp_path / "pptp"
    out = ranks("train", *PRESET, *TINY, "dist.mesh=pp=2,tp=2", f"run_dir={run}", nproc=4).stdout
    assert "(gloo, tp+pp)" in out
    _within(run, one_process)
    back = _resume_at_step_2(run, tmp_path / "back")
    train_here("train", *TINY, f"run_dir={back}", config_file="stdlib-gpt")
    _within(back, one_process)


@pytest.mark.mesh
@pytest.mark.slow
def test_compiled_pipeline_stages_track_one_process(one_process, tmp_path):
    """train.compile=true under pp=2: each stage compiled on its own (inductor fuses other kernels
    than eager), tracking the eager one-process run within 1e-5 (a minute or two of compiling)."""
    run = tmp_path / "compiled"
    args = [*PRESET, *TINY, "dist.mesh=pp=2", "train.compile=true"]
    ranks("train", *args, f"run_dir={run}", nproc=2, timeout=600)
    _within(run, one_process)


def test_a_tail_batch_a_pipeline_cannot_split_is_refused_before_work():
    cfg = _cfg("dist.mesh=pp=2", "train.micro_batch_size=8")
    m = mesh.Mesh(describe(cfg, 2))
    with pytest.raises(ConfigError, match="epoch's last batch holds 7 of the 103"):
        pipeline.check_tail(103, cfg, m, reached=True)
    pipeline.check_tail(103, cfg, m, reached=False)  # the run stops before the tail
    pipeline.check_tail(96 + 16, cfg, m, reached=True)  # a tail of two equal micro-batches


class DocsNet(nn.Module):
    """docs/extending.md's "Pipeline stages" example, as written there."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8))
        self.head = nn.Linear(64, 10)

    def pipeline_layers(self) -> str:
        return "layers"

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            x = layer(x)
        return x if self.head is None else self.head(x)


def test_a_user_model_declares_its_stages_as_the_docs_say():
    model = DocsNet()
    split = splits.plan(model, 4)
    assert split.before == ["embed"] and split.after == ["head"]
    stages = [splits.piece(model, split, [s]) for s in range(4)]
    x = torch.randn(3, 16)
    y = x
    for stage in stages:
        y = stage(y)
    assert torch.equal(y, model(x))
    names = [set(s.state_dict()) for s in stages]
    assert set().union(*names) == set(model.state_dict()) and not names[1] & names[2]


def test_a_key_added_since_a_save_at_its_default_is_no_conflict():
    """A checkpoint from before dist.mesh (or any newer key) resumes; a changed value does not."""
    from trainer.checkpoint.resume import config_conflicts
    from trainer.config import to_dict

    now = to_dict(_cfg())
    saved = to_dict(_cfg())
    del saved["optim"]["name"]
    assert config_conflicts(saved, now) == []
    assert config_conflicts(saved, to_dict(_cfg("optim.name=sgd")))


@pytest.mark.slow
def test_fsdp_stages_resume_a_whole_checkpoint_to_one_process_bits(one_process, tmp_path):
    """pp=2 with each stage sharded by FSDP2: the world-1 run's step-2 checkpoint (its optimizer
    state numbered over two groups, optim.decay=no_bias_norm) resumes under it, and steps 3-4,
    with clipping and the embedding/head tied across stages (left whole by FSDP), end on the
    world-1 run's bits."""
    run = _resume_at_step_2(one_process, tmp_path / "fsdp")
    mesh_args = ["dist.mesh=pp=2", "dist.strategy=fsdp"]
    out = ranks("train", *PRESET, *TINY, *mesh_args, f"run_dir={run}", nproc=2).stdout
    assert "resum" in out.lower() and "fsdp+pp" in out
    assert _losses(run) == _losses(one_process)
    reference = weights(one_process)
    assert all(torch.equal(weights(run)[k], reference[k]) for k in reference)
