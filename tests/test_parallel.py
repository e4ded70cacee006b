"""Model parallelism (trainer/parallel/): the mesh's rules, the pipeline's split of a model, and
pipeline runs against one process: the same bits for GPipe, 1F1B and interleaved 1F1B, with
gradient clipping and the GPT's tied embedding/head, and checkpoints that resume under another
layout (pp -> world 1, world 1 -> pp)."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from tests.helpers import ranks, shared_run, train_here, weights
from trainer.config import check_world_size, load, resolve_strategy
from trainer.errors import ConfigError, UsageError
from trainer.gpt import GPT
from trainer.parallel import layout, mesh, pipeline

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
]
PRESET = ["--config", "stdlib-gpt"]


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
        (["dist.mesh=pp=2", "repro.world_invariant=true"], 2, "repro.world_invariant"),
        (["dist.mesh=pp=2", "train.compile=true"], 2, "train.compile"),
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
    assert mesh.Mesh(layout.Layout(dp=4), rank=3, dp_rank=3).contributes


# --- the split -----------------------------------------------------------------------------------


def test_gpt_splits_into_stages_with_whole_model_names():
    torch.manual_seed(0)
    model = GPT(256, 16, 4, 32, 2)
    split = pipeline.plan(model, 2)
    assert split.stages == [["0", "1"], ["2", "3"]]
    assert split.before == ["tok", "pos", "drop"] and split.after == ["ln_f", "head"]
    whole = model.state_dict()
    pieces = [pipeline.piece(model, split, [s]).state_dict() for s in range(2)]
    assert set(pieces[0]) | set(pieces[1]) == set(whole)
    assert all(torch.equal(p[k], whole[k]) for p in pieces for k in p)
    assert "head.weight" in pieces[1] and "tok.weight" not in pieces[1]
    # The stages run in turn give the whole model's output.
    x = torch.randint(0, 256, (2, 16))
    stages = [pipeline.piece(model, split, [s]) for s in range(2)]
    assert torch.equal(stages[1](stages[0](x)), model(x))
    (tied,) = pipeline.tied_weights(model, split)
    assert tied.names == {0: "tok.weight", 1: "head.weight"} and tied.canonical == "tok.weight"


def test_a_model_that_cannot_be_split_is_one_line():
    with pytest.raises(ConfigError, match="cannot split the model's 4 layers"):
        pipeline.plan(GPT(256, 16, 4, 32, 2), 3)
    with pytest.raises(UsageError, match="pipeline_layers"):
        pipeline.plan(nn.Sequential(nn.Linear(2, 2)), 2)

    class Rooted(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

        def pipeline_layers(self):
            return "layers"

    with pytest.raises(UsageError, match="parameters on its root"):
        pipeline.plan(Rooted(), 2)


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


@pytest.mark.world4
@pytest.mark.slow
def test_pipeline_under_ddp_at_world_4_tracks_one_process(one_process, tmp_path):
    """dp=2 x pp=2 (DDP averages each stage's gradients over its dp pair): the curve tracks one
    process within rounding. No train.micro_batch_size: each rank's 16 samples are cut into one
    micro-batch per stage (8, as the reference's)."""
    run = tmp_path / "dppp"
    args = [*PRESET, *TINY, "dist.mesh=dp=2,pp=2", "train.micro_batch_size=null"]
    ranks("train", *args, f"run_dir={run}", nproc=4, timeout=300)
    mine, ref = _losses(run), _losses(one_process)
    assert mine.keys() == ref.keys()
    assert max(abs(mine[k] - ref[k]) for k in ref) < 1e-5
    reference = weights(one_process)
    assert max((weights(run)[k] - reference[k]).abs().max().item() for k in reference) < 1e-5


def test_a_tail_batch_a_pipeline_cannot_split_is_refused_before_work():
    cfg = _cfg("dist.mesh=pp=2", "train.micro_batch_size=8")
    m = mesh.Mesh(layout.Layout(pp=2))
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
    split = pipeline.plan(model, 4)
    assert split.before == ["embed"] and split.after == ["head"]
    stages = [pipeline.piece(model, split, [s]) for s in range(4)]
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


USER = [
    "data.name=synthetic", "data.synthetic.shape=[16]", "data.synthetic.num_classes=10",
    "data.synthetic.size=256", "data.synthetic.test_size=64", "model.name=tests.test_parallel:DocsNet",
    "data.global_batch_size=32", "train.micro_batch_size=8", "train.max_steps=3",
    "log.every_steps=1", "log.progress=none", "log.tensorboard=false",
]  # fmt: skip


@pytest.mark.slow
def test_a_user_model_in_fsdp_pipeline_stages_gives_one_process_bits(tmp_path):
    """The docs' own model split by its pipeline_layers(), each stage sharded by FSDP2 over a
    one-rank dp dimension: one process's weights, bit for bit."""
    train_here("train", *USER, f"run_dir={tmp_path / 'one'}")
    ranks(
        "train",
        *USER,
        "dist.mesh=pp=2",
        "dist.strategy=fsdp",
        f"run_dir={tmp_path / 'pp'}",
        nproc=2,
    )
    one, pp = weights(tmp_path / "one"), weights(tmp_path / "pp")
    assert one.keys() == pp.keys() and all(torch.equal(one[k], pp[k]) for k in one)
