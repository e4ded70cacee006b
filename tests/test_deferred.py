"""Deferred construction (trainer/deferred.py): a model built on the meta device gets, tensor by
tensor, exactly the initial values a one-process build gives it, and a laid-out part (a
pipeline stage, FSDP's shards) gets storage for its own tensors only."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from trainer import deferred
from trainer.config import ModelConfig
from trainer.errors import UsageError
from trainer.gpt import GPT
from trainer.models import build


class _Inits(nn.Module):
    """What user models do at construction: torch.nn.init's functions that skip meta tensors
    (orthogonal_, trunc_normal_), views written in place, constants and derived buffers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)
        self.emb = nn.Embedding(10, 16, padding_idx=0)
        self.rnn = nn.LSTM(16, 8)
        nn.init.orthogonal_(self.a.weight)
        nn.init.trunc_normal_(self.b.weight, std=0.02)
        with torch.no_grad():
            self.b.weight[:2].mul_(0.5)  # a view of a parameter, written in place
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))  # a constant
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


MODELS = {
    "gpt": lambda: GPT(256, 32, 4, 32, 4),
    "resnet18": lambda: build(ModelConfig(name="resnet18"), (3, 32, 32), 10),
    "vgg11": lambda: build(ModelConfig(name="vgg11"), (3, 32, 32), 10),
    "mlp": lambda: build(ModelConfig(name="mlp"), (1, 8, 8), 10),
    "inits": _Inits,
}


def _all(model: nn.Module) -> dict:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_deferred_model_gets_one_process_initial_values_bit_for_bit(name):
    """Every parameter and buffer equal to the whole build's, the tied ones still one object,
    and the generator where a whole build leaves it (what is drawn after the model, the same)."""
    torch.manual_seed(0)
    whole = MODELS[name]()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    model, later = deferred.build(MODELS[name])
    assert torch.equal(torch.get_rng_state(), after)
    assert all(t.is_meta for t in model.parameters())
    later.materialize(model, "cpu")
    want, got = _all(whole), _all(model)
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert len(list(model.parameters())) == len(list(whole.parameters()))  # ties kept


def test_a_stage_gets_storage_for_its_own_tensors_only():
    """A pipeline stage of a deferred GPT: its blocks (and the embeddings on the first, the
    head on the last) are real with one process's values; every other tensor of the model stays
    on the meta device, holding no memory."""
    from trainer.parallel import split

    torch.manual_seed(0)
    whole = GPT(256, 32, 4, 32, 4)
    torch.manual_seed(0)
    model, later = deferred.build(GPT, 256, 32, 4, 32, 4)
    last = split.piece(model, split.plan(model, 2), [1])
    later.materialize(last, "cpu")
    real = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert real == set(dict(last.named_parameters(remove_duplicate=False)))
    assert "tok.weight" not in real and "head.weight" in real and "blocks.3.fc.weight" in real
    for n, p in last.named_parameters():
        assert torch.equal(p, whole.get_parameter(n)), n


def test_fsdp_shards_get_their_slice_of_one_process_values():
    """FSDP2 on a meta model (a one-rank mesh): the shards, filled, are the whole build's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        whole = GPT(256, 32, 2, 32, 4)
        torch.manual_seed(0)
        model, later = deferred.build(GPT, 256, 32, 2, 32, 4)
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        later.materialize(model, "cpu")
        for n, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), whole.get_parameter(n)), n
        x = torch.randint(0, 256, (2, 32))
        assert torch.equal(model(x), whole(x))
    finally:
        dist.destroy_process_group()


def test_a_factory_that_reads_tensor_values_is_one_line():
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            self.n = int(self.w.abs().sum().item() > 0)  # a value, not a shape

    with pytest.raises(deferred.CannotDefer, match="cannot be built without storage") as e:
        deferred.build(Reads)
    assert "\n" not in str(e.value) and isinstance(e.value, UsageError)


def test_runs_that_split_the_model_build_it_deferred(tmp_path):
    """run.json says how the model was built: deferred under fsdp, whole at world 1 (a run of
    tests/test_layouts.py's size, in this process)."""
    from tests.helpers import train_here

    args = ["model.gpt.layers=2", "model.gpt.width=16", "model.gpt.heads=2", "train.max_steps=1"]
    args += ["data.text.seq_len=16", "data.text.max_train_bytes=4000", "log.progress=none"]
    args += ["data.text.max_test_bytes=1024", "log.tensorboard=false"]
    for strategy, built in (("none", "whole"), ("fsdp", "deferred")):
        run = tmp_path / strategy
        train_here("train", *args, f"dist.strategy={strategy}", f"run_dir={run}",
                   config_file="stdlib-gpt")  # fmt: skip
        record = json.loads((run / "run.json").read_text())
        assert record["model_build"] == built, (strategy, record["model_build"])
        assert 0 < record["build_s"] < 60  # data, model and layout, optimizer: seconds
    assert os.path.exists(tmp_path / "fsdp" / "final" / "model.safetensors")


def test_trainer_plan_lays_each_rank_out_without_storage():
    """`trainer plan` at pp=2: a row per rank, the stages' parameters adding up to the whole
    model's (the tied head counted on both, as each stage holds a copy); a world size the mesh
    does not fit is one line, exit 2."""
    import subprocess
    import sys

    from tests.helpers import ROOT, env

    cmd = [sys.executable, "-m", "trainer", "plan", "--config", "stdlib-gpt", "--json"]
    p = subprocess.run([*cmd, "--world-size=2", "dist.mesh=pp=2"], capture_output=True,
                       text=True, env=env(), cwd=ROOT, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    plans = json.loads(p.stdout)
    assert [r["rank"] for r in plans] == [0, 1]
    with torch.device("meta"):
        whole = GPT(256, 64, 2, 128, 4)
    total = sum(t.numel() * 4 for t in whole.parameters()) + whole.tok.weight.numel() * 4
    assert sum(r["param_bytes"] for r in plans) == total
    assert all(r["peak_bytes"] > r["fixed_bytes"] + r["param_bytes"] for r in plans)
    # optim.fused=true: the same state (planned unfused: no fused kernel runs on meta tensors)
    fused = subprocess.run([*cmd, "--world-size=2", "dist.mesh=pp=2", "optim.fused=true"],
                           capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)  # fmt: skip
    assert fused.returncode == 0, fused.stderr[-2000:]
    optimizer = [r["optimizer_bytes"] for r in plans]
    assert [r["optimizer_bytes"] for r in json.loads(fused.stdout)] == optimizer
    for b, r in zip(optimizer, plans, strict=True):  # AdamW's two moments and its step counters
        assert 2 * r["param_bytes"] < b < 2 * r["param_bytes"] + 4096
    bad = subprocess.run([*cmd, "--world-size=3", "dist.mesh=pp=2"], capture_output=True,
                         text=True, env=env(), cwd=ROOT, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


def test_a_model_handed_over_built_under_a_split_layout_says_a_factory_avoids_the_copy(
    tmp_path, capsys
):
    """trainer.fit(model=<a module>) under fsdp: trained as it is (whole on every rank), and
    one note line says to hand it the factory instead."""
    import trainer

    args = ["model.gpt.layers=2", "model.gpt.width=16", "model.gpt.heads=2", "train.max_steps=1"]
    args += ["data.text.seq_len=16", "data.text.max_train_bytes=4000", "log.progress=none"]
    args += ["data.text.max_test_bytes=1024", "log.tensorboard=false", "dist.strategy=fsdp"]
    torch.manual_seed(0)
    built = GPT(256, 16, 2, 16, 2)
    trainer.fit("stdlib-gpt", [*args, f"run_dir={tmp_path / 'run'}"], model=built)
    out = capsys.readouterr().out
    assert "note: trainer.fit was handed a model already built" in out, out
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["model_build"] == "whole"


def _reads_values(in_shape, num_classes, **kwargs):
    """A factory whose model reads a value while it builds (a norm, here)."""
    from trainer.gpt import gpt

    model = gpt(in_shape, num_classes, layers=2, width=16, heads=2)
    model.scale = float(model.tok.weight.norm())  # a value: needs storage
    return model


def test_a_model_that_cannot_be_deferred_is_built_whole_and_says_so(tmp_path, capsys):
    """Under fsdp a factory reading values trains anyway, built whole on every rank, with the
    initial weights a plain build gives (the generators restored), and one note line."""
    import trainer
    from tests.helpers import train_losses

    args = ["model.gpt.layers=2", "model.gpt.width=16", "model.gpt.heads=2", "train.max_steps=2"]
    args += ["data.text.seq_len=16", "data.text.max_train_bytes=4000", "log.progress=none"]
    args += ["data.text.max_test_bytes=1024", "log.tensorboard=false", "log.every_steps=1"]
    trainer.fit("stdlib-gpt", [*args, f"run_dir={tmp_path / 'one'}"], model=_reads_values)
    trainer.fit(
        "stdlib-gpt", [*args, "dist.strategy=fsdp", f"run_dir={tmp_path / 'fsdp'}"],
        model=_reads_values,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "note: the model cannot be built without storage" in out, out
    assert json.loads((tmp_path / "fsdp" / "run.json").read_text())["model_build"] == "whole"
    one, fsdp = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert one[1] == fsdp[1]  # the same initial weights: the same first loss
