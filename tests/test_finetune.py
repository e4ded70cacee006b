"""Fine-tuning (docs/finetuning.md): ckpt.init_* (sources, renames, exclusions, strict and the
non-strict table, the DataParallel-on-cuda:1 file), optim.freeze / groups / decay, and the
optimizer plug-in with an exact resume. In-process and small: a unit call where one proves it."""

from __future__ import annotations

import io
import json
import pickletools
import zipfile

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from tests import helpers
from trainer import config, optim, params
from trainer.checkpoint.init import load_init
from trainer.checkpoint.weights import load_weights_into
from trainer.errors import UsageError
from trainer.models import mlp

TINY = [*helpers.TINY, "log.progress=none", "log.tensorboard=false", "train.epochs=1"]


def _ckpt(*overrides):
    return config.load(None, list(overrides)).ckpt


def _net(classes=10, seed=0):
    torch.manual_seed(seed)
    return mlp((1, 8, 8), classes, hidden=[16])


# --- 1. sources, renames, exclusions, strict --------------------------------------------------


def test_a_new_head_loads_the_backbone_and_prints_one_table(tmp_path):
    src = _net(10, seed=1)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    model = _net(5, seed=2)
    fresh_head = model[3].weight.detach().clone()
    # strict refuses, naming the key and both shapes
    with pytest.raises(UsageError, match=r"3.weight has shape \(10, 16\) there, \(5, 16\) here"):
        load_init(model, _ckpt(f"ckpt.init_weights={tmp_path / 'w.pt'}"))
    # strict with the head excluded: the backbone loads, the head stays fresh
    report = load_init(
        model, _ckpt(f"ckpt.init_weights={tmp_path / 'w.pt'}", "ckpt.init_exclude=3.*")
    )
    assert torch.equal(model[1].weight, src[1].weight) and torch.equal(model[3].weight, fresh_head)
    assert report.excluded == ["3.bias", "3.weight"] and report.missing == ["3.weight", "3.bias"]
    # non-strict: the same load without naming the head; the table names every kind
    model = _net(5, seed=2)
    ckpt = _ckpt(f"ckpt.init_weights={tmp_path / 'w.pt'}", "ckpt.init_strict=false")
    table = load_init(model, ckpt).table()
    assert torch.equal(model[1].weight, src[1].weight) and torch.equal(model[3].weight, fresh_head)
    lines = table.splitlines()
    assert lines[1].split()[:2] == ["loaded", "2"]
    assert lines[2].split()[:3] == ["missing", "(fresh)", "2"]
    assert "3.weight (10, 16) there, (5, 16) here" in table


def test_sharded_safetensors_with_an_index_and_renames(tmp_path):
    src = _net(seed=1)
    state = {f"encoder.{k}": v for k, v in src.state_dict().items()}
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in keys[2:]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for source in (tmp_path, index):  # the folder, or the index itself
        model = _net(seed=2)
        with pytest.raises(UsageError, match="no tensor matches the model.*ckpt.init_rename"):
            load_init(model, _ckpt(f"ckpt.init_weights={source}"))
        load_init(model, _ckpt(f"ckpt.init_weights={source}", r"ckpt.init_rename={^encoder\.: ''}"))
        for k, v in src.state_dict().items():
            assert torch.equal(model.state_dict()[k], v)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UsageError, match="names the shard .*00002.safetensors, which is not there"):
        load_init(
            _net(), _ckpt(f"ckpt.init_weights={tmp_path}", r"ckpt.init_rename={^encoder\.: ''}")
        )


def _to_cuda1(path) -> None:
    """Rewrite a torch.save'd zip so that every storage says it was saved on cuda:1.

    torch.save records each storage's device as a string in data.pkl's persistent ids
    ('storage', type, key, 'cpu', numel); a file saved from cuda:1 carries 'cuda:1' there and the
    same raw bytes. Without a GPU we cannot make one by saving, so the pickle's 'cpu' strings are
    replaced opcode by opcode (protocol 2: no frames; the memo is indexed, not positional)."""
    with zipfile.ZipFile(path) as z:
        records = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in records if n.endswith("data.pkl"))
    data, out, ops = records[name], io.BytesIO(), list(pickletools.genops(records[name]))
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        if op.name in ("BINUNICODE", "SHORT_BINUNICODE") and arg == "cpu":
            text = b"cuda:1"
            out.write(b"X" + len(text).to_bytes(4, "little") + text)  # BINUNICODE
        else:
            out.write(data[pos:end])
    records[name] = out.getvalue()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, b in records.items():
            z.writestr(n, b)


def test_a_dataparallel_state_dict_saved_on_cuda1_loads_on_cpu_and_fine_tunes(tmp_path):
    torch.manual_seed(0)
    wrapped = nn.DataParallel(helpers.tiny_model(3, (1, 4, 4)))  # on CPU: a plain wrapper
    state = wrapped.state_dict()
    assert all(k.startswith("module.") for k in state)
    path = tmp_path / "dp-cuda1.pt"
    torch.save(state, path)
    _to_cuda1(path)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError, match="CUDA"):  # the file does claim a GPU
            torch.load(path, weights_only=True)
    run = tmp_path / "ft"
    helpers.train_here(
        "train", *TINY, f"run_dir={run}", f"ckpt.init_weights={path}", "optim.freeze=1.*"
    )
    after = helpers.weights(run)
    for k in ("1.weight", "1.bias"):  # frozen: the loaded weights come out as they went in
        assert torch.equal(after[k], state[f"module.{k}"])
    assert not torch.equal(after["3.weight"], state["module.3.weight"])  # and it fine-tuned


# --- 2. what trains ----------------------------------------------------------------------------


def _optim(*overrides):
    return config.load(None, ["optim.weight_decay=0.1", *overrides]).optim


def test_param_groups_lr_mult_decay_and_their_mistakes():
    model = _net()
    groups = params.param_groups(
        _optim("optim.groups.head={params: [3.*], lr_mult: 10}", "optim.decay=no_bias_norm"),
        model.named_parameters(),
    )
    got = [(g["group"], g["lr"], g["weight_decay"], len(g["params"])) for g in groups]
    assert got == [
        ("default", 1e-3, 0.1, 1),
        ("default", 1e-3, 0.0, 1),
        ("head", 1e-2, 0.1, 1),
        ("head", 1e-2, 0.0, 1),
    ]
    # the default keeps the presets' numbers: one group of every parameter, as before
    plain = params.param_groups(_optim(), model.named_parameters())
    assert [id(p) for p in plain] == [id(p) for p in model.parameters()]
    with pytest.raises(UsageError, match="3.weight is in both a and b: groups may not overlap"):
        params.param_groups(
            _optim("optim.groups.a={params: [3.*]}", "optim.groups.b={params: ['*.weight']}"),
            model.named_parameters(),
        )
    with pytest.raises(
        UsageError, match=r"optim.groups.x: params \['head.\*'\] match no trainable"
    ):
        params.param_groups(_optim("optim.groups.x={params: [head.*]}"), model.named_parameters())
    with pytest.raises(UsageError, match="optim.freeze: 'backbone.*' matches no parameter"):
        params.freeze(model, ["backbone.*"])
    with pytest.raises(UsageError, match="optim.groups.x.lr: unknown"):
        config.load(None, ["optim.groups.x={params: [a], lr: 1}"])


def test_frozen_tensors_are_bitwise_unchanged_and_left_out_of_the_optimizer(tmp_path):
    torch.manual_seed(3)
    before = helpers.tiny_model(3, (1, 4, 4)).state_dict()
    save_file(before, tmp_path / "w.safetensors")
    run = tmp_path / "b"
    init = f"ckpt.init_weights={tmp_path / 'w.safetensors'}"
    freeze = ["optim.freeze=1.*", "optim.weight_decay=0.5"]
    helpers.train_here("train", *TINY, f"run_dir={run}", init, *freeze)
    after = helpers.weights(run)
    assert torch.equal(after["1.weight"], before["1.weight"]) and torch.equal(
        after["1.bias"], before["1.bias"]
    )
    assert not torch.equal(after["3.weight"], before["3.weight"])
    opt = torch.load(_newest(run) / "optimizer.pt", weights_only=True)
    assert sum(len(g["params"]) for g in opt["param_groups"]) == 2  # 3.weight, 3.bias only


def _newest(run):
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def test_ddp_needs_the_freeze_before_it_wraps_the_model():
    """run.build freezes (lora.prepare) before the strategy wraps: DDP then leaves the frozen
    parameters out of its reducer. Frozen after wrapping, DDP waits for their gradients and the
    second step fails (a one-process gloo group shows it: the reducer is the same)."""
    import torch.distributed as dist

    def three_steps(freeze_first: bool) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        if freeze_first:
            params.freeze(model, "0.*")
        ddp = nn.parallel.DistributedDataParallel(model)
        if not freeze_first:
            params.freeze(model, "0.*")
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        for _ in range(3):
            ddp(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        three_steps(freeze_first=True)
        with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
            three_steps(freeze_first=False)
    finally:
        dist.destroy_process_group()


# --- the optimizer plug-in, resumed exactly ---------------------------------------------------


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023), the plug-in of the tests: sign of an interpolated momentum."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def lion(params, lr, betas, weight_decay, scale: float = 1.0):
    return Lion(params, lr=lr * scale, betas=betas, weight_decay=weight_decay)


def test_an_optimizer_plugin_trains_and_resumes_exactly(tmp_path, capsys):
    args = [
        *TINY,
        "optim.name=tests.test_finetune:lion",
        "optim.kwargs.scale=0.5",
        "train.epochs=2",
    ]
    helpers.train_here("train", *args, f"run_dir={tmp_path / 'whole'}")
    helpers.train_here("train", *args, f"run_dir={tmp_path / 'cut'}", "train.max_steps=4")
    state = torch.load(_newest(tmp_path / "cut") / "optimizer.pt", weights_only=True)
    assert state["param_groups"][0]["initial_lr"] == pytest.approx(5e-4) and state["state"]
    capsys.readouterr()
    helpers.train_here("train", *args, f"run_dir={tmp_path / 'cut'}")
    assert "(step 4," in capsys.readouterr().out.split("resumed from", 1)[1]
    whole, cut = helpers.weights(tmp_path / "whole"), helpers.weights(tmp_path / "cut")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    with pytest.raises(UsageError, match="returned a dict, not a torch.optim.Optimizer"):
        optim.build_optimizer(_optim("optim.name=builtins:dict"), [])


# --- 3. LoRA through PEFT -----------------------------------------------------------------------


def test_lora_trains_only_adapters_checkpoints_them_and_merges(tmp_path, capsys):
    pytest.importorskip("peft")
    from trainer.cli import main

    torch.manual_seed(3)
    base = helpers.tiny_model(3, (1, 4, 4))
    save_file(base.state_dict(), tmp_path / "base.safetensors")
    lora = [f"ckpt.init_weights={tmp_path / 'base.safetensors'}", "optim.lora_targets=1"]
    lora += ["optim.lora_also_train=3.*", "optim.lora_rank=2", "optim.lr=0.05"]
    run = tmp_path / "lora"
    capsys.readouterr()
    helpers.train_here("train", *TINY, f"run_dir={run}", *lora, "train.max_steps=2")
    out = capsys.readouterr().out  # the base's load table, as a full or frozen run prints it
    assert "(the base beneath LoRA's adapters)" in out and "loaded                4" in out, out
    helpers.train_here("train", *TINY, f"run_dir={run}", *lora)  # resumes: the base reloads
    saved = helpers.weights(run)
    assert sorted(saved) == [
        "1.lora_A.default.weight",
        "1.lora_B.default.weight",
        "3.bias",
        "3.weight",
    ]
    assert not torch.equal(saved["1.lora_B.default.weight"], torch.zeros(8, 2))  # B starts at 0
    assert main(["export", str(run), "-o", str(tmp_path / "merged"), "--merge"]) == 0
    merged = helpers.tiny_model(3, (1, 4, 4))
    merged.load_state_dict(load_file(tmp_path / "merged" / "model.safetensors"))  # plain names
    merged_cfg = yaml.safe_load((tmp_path / "merged" / "config.yaml").read_text())
    assert merged_cfg["optim"]["lora_targets"] == "" and merged_cfg["optim"]["lr"] == 0.05
    delta = saved["1.lora_B.default.weight"] @ saved["1.lora_A.default.weight"] * (16.0 / 2)
    assert torch.allclose(merged[1].weight, base[1].weight + delta, atol=1e-6)
    assert torch.equal(merged[3].weight, saved["3.weight"])
    with pytest.raises(UsageError, match=r"holds LoRA adapters .*--merge -o OUT"):  # eval, init
        load_weights_into(helpers.tiny_model(3, (1, 4, 4)), str(run))
    # a straight 3-step run ends where the cut-and-resumed one did
    helpers.train_here("train", *TINY, f"run_dir={tmp_path / 'whole'}", *lora)
    whole = helpers.weights(tmp_path / "whole")
    assert all(torch.equal(whole[k], saved[k]) for k in saved)
    with pytest.raises(UsageError, match="optim.lora_targets: 'attn.*' matches no Linear"):
        helpers.train_here(
            "train", *TINY, f"run_dir={tmp_path / 'bad'}", "optim.lora_targets=attn.*"
        )


# --- 6. every bad input: one line, exit 2 ---------------------------------------------------------


class Evil:
    def __reduce__(self):
        return (print, ("this pickle ran code",))


def test_every_bad_fine_tuning_input_is_one_line_and_exit_2(tmp_path):
    from tests.test_bad_input import Case, problems, run_in_process

    torch.manual_seed(0)
    good = helpers.tiny_model(3, (1, 4, 4)).state_dict()
    save_file(good, tmp_path / "good.safetensors")
    save_file({"x.weight": torch.ones(2)}, tmp_path / "other.safetensors")
    save_file(
        {**good, "1.weight": torch.full_like(good["1.weight"], float("nan"))},
        tmp_path / "nan.safetensors",
    )
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    torch.save({"1.weight": Evil()}, tmp_path / "evil.pt")
    wide = helpers.tiny_model(3, (1, 4, 4), width=16).state_dict()
    torch.save(wide, tmp_path / "wide.pt")
    init = f"ckpt.init_weights={tmp_path}/"
    cases = {
        "missing source": (f"{init}nope.pt", "nope.pt: no such weights file"),
        "corrupt source": (f"{init}corrupt.safetensors", "not a readable safetensors file"),
        "no key matches": (f"{init}other.safetensors", "no tensor matches the model"),
        "strict shape": (f"{init}wide.pt", "1.weight has shape (16, 16) there, (8, 16) here"),
        "freeze nothing": ("optim.freeze=conv.*", "optim.freeze: 'conv.*' matches no parameter"),
        "freeze all": (
            "optim.freeze='*'",
            "every parameter is frozen: nothing would train; narrow",
        ),
        "groups overlap": ("optim.groups.a={params: ['1.*']}", "in both a and b"),
        "lora targets": ("optim.lora_targets=attn", "optim.lora_targets: 'attn' matches no"),
        "nan weights": (f"{init}nan.safetensors", "NaN/inf values (1.weight)"),
        "code pickle": (f"{init}evil.pt", "refused to load"),
        "bad rename": ("ckpt.init_rename={'(': x}", "ckpt.init_rename: '(' is not a regex"),
    }
    failures = []
    for label, (arg, names) in cases.items():
        extra = ["optim.groups.b={params: ['*.weight']}"] if label == "groups overlap" else []
        argv = ("train", *TINY, f"run_dir={tmp_path / 'run'}", arg, *extra)
        found = problems(Case("finetune", argv, names), run_in_process(argv))
        failures += [f"{label}: {p}" for p in found]
    assert not failures, "\n".join(failures)


# --- 6. the guarantees hold: a fine-tuned run is the same bits on 1 and 2 ranks ------------------


@pytest.mark.slow
def test_a_fine_tuned_run_is_world_invariant_on_1_and_2_ranks(tmp_path):
    """Weights loaded from a file, a frozen layer, a head group at 10x lr, no decay on biases:
    world 1 and world 2 (gloo) under repro.world_invariant train the same bits."""
    torch.manual_seed(3)
    start = helpers.tiny_model(3, (1, 4, 4))
    save_file(start.state_dict(), tmp_path / "w.safetensors")
    args = [
        *TINY, "train.epochs=2", "repro.world_invariant=true", "repro.shards=2",
        "data.global_batch_size=4", f"ckpt.init_weights={tmp_path / 'w.safetensors'}",
        "optim.freeze=1.*", "optim.groups.head={params: '3.*', lr_mult: 10}",
        "optim.decay=no_bias_norm", "optim.weight_decay=0.1", "data.drop_last=true",
    ]  # fmt: skip
    helpers.train_here("train", *args, f"run_dir={tmp_path / 'one'}")
    helpers.trainer("train", *args, f"run_dir={tmp_path / 'two'}", nproc=2, torchrun=False)
    one, two = helpers.weights(tmp_path / "one"), helpers.weights(tmp_path / "two")
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert torch.equal(two["1.weight"], start[1].weight) and not torch.equal(
        two["3.weight"], start[3].weight
    )


def test_the_examples_data_keeps_the_named_classes_relabelled():
    from examples.finetune.data import digits_classes

    cfg = config.load(None, ["data.kwargs.classes=[5,6,7,8,9]", "data.kwargs.per_class=3"]).data
    spec = digits_classes(cfg, 0)
    assert spec.num_classes == 5 and sorted(spec.train.y.tolist()) == [
        0,
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        2,
        3,
        3,
        3,
        4,
        4,
        4,
    ]
    assert set(spec.test.y.tolist()) == {0, 1, 2, 3, 4} and len(spec.test) == 179


def test_a_lora_run_resumes_only_on_the_same_base_weights():
    from trainer.checkpoint.resume import config_conflicts
    from trainer.config import load, to_dict

    lora = ["optim.lora_targets=qkv", "ckpt.init_weights=a.safetensors"]
    saved = to_dict(load("stdlib-gpt", [*lora]))
    assert config_conflicts(saved, to_dict(load("stdlib-gpt", [*lora, "ckpt.every_steps=5"]))) == []
    moved = to_dict(
        load("stdlib-gpt", ["optim.lora_targets=qkv", "ckpt.init_weights=b.safetensors"])
    )
    assert config_conflicts(saved, moved) == [
        "ckpt.init_weights: 'a.safetensors' -> 'b.safetensors'"
    ]


def test_trainer_eval_of_a_fine_tuned_run_evaluates_its_trained_weights(tmp_path, capsys):
    """A run started from other weights with a new head (ckpt.init_exclude) keeps those keys in
    its config.yaml: `trainer eval RUN` must load the run's own trained head, not start from
    the source again with the head fresh."""
    import json

    from trainer.cli import main

    torch.manual_seed(3)
    save_file(helpers.tiny_model(3, (1, 4, 4)).state_dict(), tmp_path / "base.safetensors")
    run = tmp_path / "run"
    args = [f"ckpt.init_weights={tmp_path / 'base.safetensors'}", "ckpt.init_exclude=3.*"]
    summary = helpers.train_here("train", *TINY, f"run_dir={run}", *args, "train.max_steps=3")
    capsys.readouterr()
    assert main(["eval", str(run), *TINY]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["loss"] == pytest.approx(summary["eval"]["loss"], rel=1e-6)
