"""Issue 55, area B: bad starting weights (ckpt.init_*) and LoRA, through the real CLI.

Generated from small tables (shard indexes x bad forms, config.json x bad forms, dtypes x
parameters, architectures, sizes that disagree, renames that merge or match nothing, patterns
that match nothing, LoRA, pickles), each run through `trainer train --dry-run` (which loads
the starting weights, LoRA's beneath its adapters, before its step), and `trainer eval` /
`trainer export`, which read the same files. Each refusal is one line naming the cause, exit
2, and the good run's files stay as they were (tests/badwing.py); a valid input runs (`runs`
says why). The GPT-2 folders are made here from our GPT (trainer.hf.to_gpt2): no
`transformers`, nothing downloaded.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests import helpers
from tests.badwing import WingCase, check, good_run
from tests.test_bad_input import run_in_process
from trainer import hf
from trainer.errors import UsageError
from trainer.gpt import gpt
from trainer.namedstate import dtype_problem

TINY = (
    "data.name=tests.helpers:tiny",
    "model.name=tests.helpers:tiny_model",
    "data.global_batch_size=4",
    "log.progress=none",
    "log.tensorboard=false",
)
SEQ, WIDTH, LAYERS, HEADS, VOCAB = 32, 32, 2, 2, 256
GPT = (
    "model.name=gpt",
    "data.name=text",
    f"model.gpt.layers={LAYERS}",
    f"model.gpt.width={WIDTH}",
    f"model.gpt.heads={HEADS}",
    f"data.text.seq_len={SEQ}",
    "data.text.max_train_bytes=3000",
    "data.text.max_test_bytes=1000",
    "data.global_batch_size=8",
    "log.progress=none",
    "log.tensorboard=false",
)
LORA = ("optim.lora_targets=1", "optim.lora_rank=2")  # the tiny model's first Linear
HUGE = hf.MAX_JSON_BYTES + 1


class Evil:
    """A pickle that would make a folder if it ran (it never does: weights_only refuses it)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


# --- the files every case reads ------------------------------------------------------------------


def _tiny_state(classes=3, width=8, seed=0) -> dict:
    torch.manual_seed(seed)
    return helpers.tiny_model(classes, (1, 4, 4), width=width).state_dict()


def _gpt2(folder: Path, *, seq=SEQ, config=None, edit=None, weights=True) -> Path:
    """A Hugging Face GPT-2 folder (config.json + model.safetensors) of our tiny GPT's weights;
    `config`: keys to change in its config.json (None: remove the key; a str: the whole file's
    text instead), `edit`: a function changing the GPT-2 state dict before it is saved."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    ours = gpt((seq,), VOCAB, layers=LAYERS, width=WIDTH, heads=HEADS).state_dict()
    state = hf.to_gpt2(ours)
    if edit is not None:
        state = edit(state)
    if weights:
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    text = hf.gpt2_config(ours, HEADS)
    if isinstance(config, (str, bytes)):
        data = config.encode() if isinstance(config, str) else config
        (folder / "config.json").write_bytes(data)
        return folder
    for k, v in (config or {}).items():
        text.pop(k) if v is None else text.__setitem__(k, v)
    (folder / "config.json").write_text(json.dumps(text))
    return folder


def _huge(path: Path) -> None:
    with open(path, "wb") as f:  # sparse: 16 MiB of nothing, made at once
        f.truncate(HUGE)


INDEX_FORMS = {
    # label: (the index's text: a function of the shard's keys, what the error line names)
    "shard name a number": (lambda ks: {"weight_map": {k: 5 for k in ks}}, "is 5, not a shard"),
    "shard name null": (lambda ks: {"weight_map": {k: None for k in ks}}, "is None, not a shard"),
    "shard name a list": (lambda ks: {"weight_map": {k: ["a.safetensors"] for k in ks}}, "is ["),
    "shard name an object": (lambda ks: {"weight_map": {k: {"f": 1} for k in ks}}, "is {'f': 1}"),
    "shard name empty": (lambda ks: {"weight_map": {k: "" for k in ks}}, "is '', not a shard"),
    "shard outside": (
        lambda ks: {"weight_map": {k: "../a.safetensors" for k in ks}},
        "outside the index's folder",
    ),
    "shard outside by sub/..": (
        lambda ks: {"weight_map": {k: "sub/../../a.safetensors" for k in ks}},
        "outside the index's folder",
    ),
    "shard absolute": (
        lambda ks: {"weight_map": {k: "/etc/hostname" for k in ks}},
        "outside the index's folder",
    ),
    "shard with NUL": (
        lambda ks: {"weight_map": {k: "a\0.safetensors" for k in ks}},
        "not a shard",
    ),
    "shard missing": (
        lambda ks: {"weight_map": {k: "gone.safetensors" for k in ks}},
        "gone.safetensors, which is not there",
    ),
    "index a list": (lambda ks: [{"weight_map": {}}], "a JSON array, not an object"),
    "index a string": (lambda ks: "weight_map", "a JSON string, not an object"),
    "index null": (lambda ks: None, "a JSON null, not an object"),
    "no weight_map": (lambda ks: {"metadata": {}}, "no weight_map"),
    "weight_map a list": (lambda ks: {"weight_map": ["a.safetensors"]}, "its weight_map is ["),
    "weight_map empty": (lambda ks: {"weight_map": {}}, "its weight_map is {}"),
    "not JSON": (lambda ks: b"{weight_map: a.safetensors", "not valid JSON"),
    "not UTF-8": (lambda ks: b'{"weight_map": {"1.weight": "\xff\xfe"}}', "not UTF-8"),
    "nested deep": (lambda ks: b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    "huge": (None, "more than a shard index holds"),
}

CONFIG_FORMS = {
    # label: (config.json: changed keys, or the whole text; what the error line names)
    "a list": ("[1, 2]", "a JSON array, not an object"),
    "a string": ('"gpt2"', "a JSON string, not an object"),
    "a number": ("12", "a JSON number, not an object"),
    "not JSON": ('{"model_type": gpt2}', "not valid JSON"),
    "not UTF-8": (b'{"model_type": "gpt\xe92"}', "not UTF-8"),
    "nested deep": ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    "huge": (None, "more than a config.json holds"),
    "n_layer a string": ({"n_layer": "2"}, "n_layer is '2', not a positive whole number"),
    "n_embd a float": ({"n_embd": 32.0}, "n_embd is 32.0, not a positive whole number"),
    "n_head a bool": ({"n_head": True}, "n_head is True, not a positive whole number"),
    "n_head zero": ({"n_head": 0}, "n_head is 0, not a positive whole number"),
    "n_positions negative": ({"n_positions": -1}, "n_positions is -1"),
    "vocab_size null": ('{"model_type": "gpt2", "vocab_size": null}', "vocab_size is None"),
    "n_inner not 4x": ({"n_inner": 100}, "n_inner=100"),
    "another activation": ({"activation_function": "relu"}, "activation_function='relu'"),
}

ARCHITECTURES = {
    # label: (config.json changes, what the error line names)
    "bert": ({"model_type": "bert"}, "model_type is 'bert', not 'gpt2'"),
    "llama": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "'llama'"),
    "model_type a number": ({"model_type": 2}, "model_type is 2, not 'gpt2'"),
    "BertModel, no model_type": (
        {"model_type": None, "architectures": ["BertModel"]},
        "architectures is ['BertModel']",
    ),
    "BertModel under gpt2": ({"architectures": ["BertModel"]}, "architectures is ['BertModel']"),
    "architectures a string": ({"architectures": "GPT2LMHeadModel"}, "architectures is"),
}

SIZES = {
    # label: (config.json changes, command-line changes, what the error line names)
    "n_head=1 in the folder": ({"n_head": 1}, (), "n_head=1, but model.gpt.heads=2"),
    "model.gpt.heads=1": ({}, ("model.gpt.heads=1",), "n_head=2, but model.gpt.heads=1"),
    "model.gpt.heads=4": ({}, ("model.gpt.heads=4",), "n_head=2, but model.gpt.heads=4"),
    "n_layer=3 in the folder": ({"n_layer": 3}, (), "n_layer=3, but model.gpt.layers=2"),
    "model.gpt.layers=1": ({}, ("model.gpt.layers=1",), "n_layer=2, but model.gpt.layers=1"),
    "n_embd=64 in the folder": ({"n_embd": 64}, (), "n_embd=64, but model.gpt.width=32"),
    "seq_len over n_positions": ({}, ("data.text.seq_len=64",), "n_positions=32"),
    "n_positions=16 in the folder": ({"n_positions": 16}, (), "set data.text.seq_len to at most"),
    # no model_type nor architectures: the sizes are compared all the same (a TypeError once)
    "n_positions text, no model_type": (
        {"model_type": None, "architectures": None, "n_positions": "64"},
        (),
        "n_positions is '64', not a positive whole number",
    ),
}

BAD_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
BAD_DTYPES += [torch.complex64]
CAST_DTYPES = [torch.float16, torch.bfloat16, torch.float64]


def _index_folder(root: Path, label: str, form, keys: list[str], shard: dict) -> Path:
    folder = root / "index" / label.replace(" ", "-").replace("/", "-")
    folder.mkdir(parents=True)
    save_file(shard, folder / "a.safetensors")
    index = folder / "model.safetensors.index.json"
    if form is None:
        _huge(index)
        return folder
    data = form(keys)
    index.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-init")
    (root / "out").mkdir()  # where the exports would go
    os.mkfifo(root / "fifo.pt")
    good = {k: v.contiguous() for k, v in _tiny_state().items()}
    keys = list(good)
    save_file(good, root / "good.safetensors")
    save_file(
        {k: v for k, v in good.items() if not k.startswith("3.")}, root / "no-head.safetensors"
    )
    save_file({f"encoder.{k}": v for k, v in good.items()}, root / "encoder.safetensors")
    save_file(_tiny_state(classes=5, width=16), root / "wide.safetensors")
    for i, dtype in enumerate(BAD_DTYPES + CAST_DTYPES):
        key = keys[i % len(keys)]  # dtypes x parameters: each bad dtype in another tensor
        save_file({**good, key: good[key].to(dtype)}, root / f"{_dname(dtype)}.safetensors")
    for label, (form, _) in INDEX_FORMS.items():
        _index_folder(root, label, form, keys, good)
    for label, (config, _) in CONFIG_FORMS.items():
        folder = _gpt2(root / "config" / label.replace(" ", "-"), config=config)
        if config is None:
            _huge(folder / "config.json")
    for label, (config, _) in ARCHITECTURES.items():
        _gpt2(root / "arch" / label.replace(" ", "-").replace(",", ""), config=config)
    for label, (config, _, _) in SIZES.items():
        _gpt2(root / "sizes" / label.replace(" ", "-").replace("=", ""), config=config)
    _gpt2(root / "gpt2")
    _gpt2(root / "gpt2-no-config", config={})
    (root / "gpt2-no-config" / "config.json").unlink()
    _gpt2(root / "gpt2-arch-only", config={"model_type": None})
    _gpt2(root / "gpt2-64-positions", seq=64, config={})

    def cut(state):
        state["transformer.h.1.mlp.c_fc.bias"] = state["transformer.h.1.mlp.c_fc.bias"][:4]
        return state

    def ints(state):
        w = state["transformer.h.0.attn.c_attn.weight"]
        return {**state, "transformer.h.0.attn.c_attn.weight": w.to(torch.int64)}

    def twice(state):
        return {**state, "wte.weight": state["transformer.wte.weight"].clone()}

    def vocab(state):  # a tokenizer's 300 ids where the data has VOCAB
        wte = state["transformer.wte.weight"]
        return {**state, "transformer.wte.weight": torch.cat([wte, wte[: 300 - len(wte)]])}

    _gpt2(root / "gpt2-cut", edit=cut)
    _gpt2(root / "gpt2-vocab", edit=vocab)
    _gpt2(root / "gpt2-ints", edit=ints)
    _gpt2(root / "gpt2-twice", edit=twice)
    # pickles that would run code if loaded (a folder made), and files that are no state dict
    marker = root / "pickle-ran"
    torch.save({"1.weight": Evil(marker)}, root / "evil.pt")
    import pickle

    (root / "evil-protocol4.bin").write_bytes(pickle.dumps({"1.weight": Evil(marker)}, 4))
    (root / "evil-folder").mkdir()
    torch.save({"1.weight": Evil(marker)}, root / "evil-folder" / "pytorch_model.bin")
    torch.save({1: torch.ones(2)}, root / "int-keys.pt")
    torch.save([torch.ones(2)], root / "a-list.pt")
    torch.save({**good, "module.1.weight": good["1.weight"]}, root / "prefix-twice.pt")
    return root


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the tables as cases --------------------------------------------------------------------------


def _cases(root: Path, good: Path) -> list[WingCase]:
    run = f"run_dir={root / 'run'}"
    tiny = ("train", "--dry-run", *TINY, run)
    gpt2 = ("train", "--dry-run", *GPT, run)
    outs = iter(range(10_000))
    cases: list[WingCase] = []

    def init(path) -> str:
        return f"ckpt.init_weights={path}"

    def export(src) -> tuple:  # each to a folder of its own, which must not appear
        return ("export", str(src), "-o", str(root / "out" / f"x{next(outs)}"))

    def evaluate(src) -> tuple:
        return ("eval", str(src), *TINY)

    def add(area: str, argv, names: str, runs: str = "") -> None:
        cases.append(WingCase(area, tuple(argv), names, runs=runs))

    # what is no file: a FIFO (a read would block) and a device (no end)
    for label, path in (("a FIFO", root / "fifo.pt"), ("a character device", Path("/dev/zero"))):
        add(f"source: {label}", [*tiny, init(path)], f"not a regular file ({label})")

    # shard indexes x bad forms: the folder through train, the index itself through export
    for label, (_, names) in INDEX_FORMS.items():
        folder = root / "index" / label.replace(" ", "-").replace("/", "-")
        add(f"index: {label}", [*tiny, init(folder)], names)
        add(f"index: {label}", export(folder / "model.safetensors.index.json"), names)
    for label in ("shard name a number", "shard outside", "index a list", "not UTF-8"):
        folder = root / "index" / label.replace(" ", "-")
        add(f"index: {label}", evaluate(folder), INDEX_FORMS[label][1])
        add(f"index: {label}", [*tiny, *LORA, init(folder)], INDEX_FORMS[label][1])

    # config.json x bad forms: train (the conversion reads it), export and eval (reading the
    # folder checks it)
    for label, (_, names) in CONFIG_FORMS.items():
        folder = root / "config" / label.replace(" ", "-")
        add(f"config.json: {label}", [*gpt2, init(folder)], names)
        add(f"config.json: {label}", export(folder), names)
    add("config.json: a list", ("eval", str(root / "config" / "a-list"), *GPT), "a JSON array")

    # other architectures, by model_type or architectures, converted on auto or by name
    for label, (_, names) in ARCHITECTURES.items():
        folder = root / "arch" / label.replace(" ", "-").replace(",", "")
        add(f"architecture: {label}", [*gpt2, init(folder)], names)
        add(f"architecture: {label}", [*gpt2, init(folder), "ckpt.init_convert=hf_gpt2"], names)
    why = "a GPT-2 named by its architectures alone (no model_type) converts"
    add("architecture", [*gpt2, init(root / "gpt2-arch-only")], "", runs=why)
    why = "a GPT-2 folder without config.json converts (its tensors' shapes are checked)"
    add("architecture", [*gpt2, init(root / "gpt2-no-config")], "", runs=why)

    # sizes that disagree with the model: the folder's or the command line's
    for label, (_, argv, names) in SIZES.items():
        folder = root / "sizes" / label.replace(" ", "-").replace("=", "")
        add(f"sizes: {label}", [*gpt2, init(folder), *argv], names)
    why = "data.text.seq_len may be at most n_positions: the first 32 of 64 positions load"
    add("sizes", [*gpt2, init(root / "gpt2-64-positions")], "", runs=why)
    why = "a sequence length under the folder's n_positions takes the first positions"
    add("sizes", [*gpt2, init(root / "gpt2"), "data.text.seq_len=16"], "", runs=why)

    # dtypes x parameters: integers, booleans, complex into float parameters are refused
    # naming the key and both dtypes; floats cast
    keys = list(_tiny_state())
    for i, dtype in enumerate(BAD_DTYPES):
        src, names = (
            root / f"{_dname(dtype)}.safetensors",
            f"is {_dname(dtype)} there, float32 here",
        )
        add(f"dtype: {_dname(dtype)}", [*tiny, init(src)], f"{keys[i % 4]} {names}")
        add(f"dtype: {_dname(dtype)}", evaluate(src), names)
    for dtype in BAD_DTYPES[:2]:
        src = root / f"{_dname(dtype)}.safetensors"
        add(f"dtype: {_dname(dtype)}", [*tiny, *LORA, init(src)], "float32 here")
        names = f"is {_dname(dtype)} there"  # refused in a non-strict load too
        add(f"dtype: {_dname(dtype)}", [*tiny, init(src), "ckpt.init_strict=false"], names)
    for dtype in CAST_DTYPES:
        src, why = root / f"{_dname(dtype)}.safetensors", f"{_dname(dtype)} into float32 is a cast"
        add(f"dtype: {_dname(dtype)}", [*tiny, init(src)], "", runs=why)
    add("dtype", evaluate(root / "float16.safetensors"), "", runs="eval casts fp16 weights too")
    why = "export copies a file of any dtype; only loading it into float parameters refuses"
    add("dtype", export(root / "int64.safetensors"), "", runs=why)
    names = "blocks.0.attn.qkv.weight (the file's transformer.h.0.attn.c_attn.weight) is int64"
    add("dtype: converted", [*gpt2, init(root / "gpt2-ints")], names)

    # names that match, shapes that do not: the real cause, under the user's key too
    names = "blocks.1.fc.bias (the file's transformer.h.1.mlp.c_fc.bias) has shape (4,) there"
    add("shape: converted", [*gpt2, init(root / "gpt2-cut")], names)
    names = "the vocabulary (300 tokens there, 256 here) is the data's, not a model.gpt.* setting"
    add("shape: vocabulary", [*gpt2, init(root / "gpt2-vocab")], names)
    names = "every name that matches differs in shape (1.weight has shape (16, 16) there"
    add(
        "shape: every one",
        [*tiny, init(root / "wide.safetensors"), "ckpt.init_strict=false"],
        names,
    )
    add("shape", [*tiny, init(root / "wide.safetensors")], "1.weight has shape (16, 16) there")
    names = "transformer.wte.weight and wte.weight both become tok.weight"
    add("converted twice", [*gpt2, init(root / "gpt2-twice")], names)

    # renames: merging two keys, or matching nothing
    rename = "ckpt.init_rename="
    for src in (root / "good.safetensors", good):
        for rule, names in {
            r"{'^\d+\.': 'x.'}": "renames both 1.bias and 3.bias to x.bias",
            r"{'bias$': weight}": "renames both 1.bias and 1.weight to 1.weight",
            r"{'^3\.': '1.'}": "renames both 1.bias and 3.bias to 1.bias",
            r"{'.*': w}": "renames both",
            r"{'^encoder\.': ''}": r"'^encoder\.': '' matches no key",
            r"{'^1\.': 'a.', '^1\.w': b}": r"'^1\.w': 'b' matches no key",
        }.items():
            add(f"rename {rule}", [*tiny, init(src), rename + rule], names)
    add(
        "rename",
        [*tiny, *LORA, init(root / "good.safetensors"), rename + "{'^3': '1'}"],
        "renames both 1.bias",
    )
    names = "blocks.0.attn.qkv.bias (the file's transformer.h.0.attn.c_attn.bias) and blocks.1"
    add(
        "rename converted",
        [*gpt2, init(root / "gpt2"), rename + r"{'^blocks\.1\.': blocks.0.}"],
        names,
    )
    names = "matches no key of"  # the rules see the converted names
    add(
        "rename converted",
        [*gpt2, init(root / "gpt2"), rename + r"{'^transformer\.h\.': b.}"],
        names,
    )
    why = "a rename that strips a prefix every key has"
    add(
        "rename",
        [*tiny, init(root / "encoder.safetensors"), rename + r"{'^encoder\.': ''}"],
        "",
        runs=why,
    )

    # ckpt.init_exclude and optim.lora_also_train patterns that match nothing
    for src in (root / "good.safetensors", good):
        for value, names in {
            "conv.*": "ckpt.init_exclude: 'conv.*' matches no key",
            "3.*,zzz": "ckpt.init_exclude: 'zzz' matches no key",
        }.items():
            add(f"exclude {value}", [*tiny, init(src), f"ckpt.init_exclude={value}"], names)
    names = "ckpt.init_exclude: 'transformer.h.0.*' matches no key"  # after conversion: ours
    add(
        "exclude converted",
        [*gpt2, init(root / "gpt2"), "ckpt.init_exclude=transformer.h.0.*"],
        names,
    )
    add("exclude", [*tiny, init(good), "ckpt.init_exclude=fc", "ckpt.init_strict=false"], "'fc'")
    why = "a new head: the pattern matches the model's tensors the file lacks"
    add(
        "exclude",
        [*tiny, init(root / "no-head.safetensors"), "ckpt.init_exclude=3.*"],
        "",
        runs=why,
    )
    why = "a new head: the file's 3.* is left out, the model's keeps its fresh values"
    add("exclude", [*tiny, init(good), "ckpt.init_exclude=3.*"], "", runs=why)
    also = "optim.lora_also_train="
    for value, names in {
        "head.*": "optim.lora_also_train: 'head.*' matches no parameter",
        "3.*,zzz": "optim.lora_also_train: 'zzz' matches no parameter",
        "lora_*": "optim.lora_also_train: 'lora_*' matches no parameter",
    }.items():
        add(f"lora_also_train {value}", [*tiny, *LORA, init(good), also + value], names)
        add(f"lora_also_train {value}", [*tiny, *LORA, also + value], names)
    names = "optim.lora_also_train: 'lm_head.*'"
    lora_gpt = ("optim.lora_targets=blocks.*.attn.qkv", "optim.lora_also_train=lm_head.*")
    add("lora_also_train", [*gpt2, init(root / "gpt2"), *lora_gpt], names)
    names = "ckpt.init_exclude: 'fc.*' matches no key"
    add("lora exclude", [*tiny, *LORA, init(good), "ckpt.init_exclude=fc.*"], names)
    why = "LoRA on the tiny model's first layer, its head trained in full"
    add("lora", [*tiny, *LORA, init(good), also + "3.*"], "", runs=why)

    # pickles that would run code, and files that hold no state dict
    for name, names in {
        "evil.pt": "(it names os.makedirs)",
        "evil-protocol4.bin": "it holds pickled objects other than tensors",
        "evil-folder": "pytorch_model.bin: refused to load",
        "int-keys.pt": "does not hold a state_dict of tensors",
        "a-list.pt": "does not hold a state_dict of tensors",
        "prefix-twice.pt": "holds both 1.weight and module.1.weight",
    }.items():
        add(f"pickle: {name}", [*tiny, init(root / name)], names)
        add(f"pickle: {name}", evaluate(root / name), names)
        add(f"pickle: {name}", export(root / name), names)
    return cases


def test_bad_starting_weights_are_one_line_and_exit_2(files, tmp_path_factory):
    """Every case of the tables: one line naming the cause, exit 2, nothing written; the good
    run and every file the cases read unchanged; no pickle ran."""
    good = good_run(tmp_path_factory)
    cases = _cases(files, good)
    assert len(cases) >= 150, len(cases)
    n = check(cases, good)
    assert n == len(cases)
    assert not (files / "pickle-ran").exists()  # no pickle ran
    assert not (files / "run").exists()  # the dry runs left nothing
    made = sorted(os.listdir(files / "out"))
    runs = [c for c in cases if c.runs and c.argv[0] == "export"]
    assert len(made) == len(runs), made  # only the valid exports wrote


def test_a_refused_pickle_is_our_one_line_without_torch_warning_or_advice(files):
    """torch's 'Detected pickle protocol 4' warning and its advice to load with
    weights_only=False (which would run the file's code) never reach the user."""
    for name in ("evil.pt", "evil-protocol4.bin"):
        argv = ("train", "--dry-run", *TINY, f"ckpt.init_weights={files / name}")
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # shown every time, as in a fresh process
            o = run_in_process(argv)
        lines = [line for line in o.stderr.splitlines() if line.strip()]
        assert o.code == 2 and len(lines) == 1, o.stderr
        assert "weights_only=False" not in o.stderr and "Re-running" not in o.stderr, o.stderr
        assert "pickle protocol" not in o.stderr
    assert not (files / "pickle-ran").exists()


def test_lora_under_a_pipeline_is_refused_before_any_rank_starts():
    """LoRA freezes the GPT's tied embedding, which the pipeline's gradient exchange of the
    tied weight needs to train: refused by `config check --world-size=2`, in one line."""
    argv = (
        "config", "check", "--world-size=2", *GPT[:-2], "data.drop_last=true",
        "dist.mesh=pp=2", "optim.lora_targets=blocks.*.attn.qkv",
    )  # fmt: skip
    o = run_in_process(argv)
    lines = [line for line in o.stderr.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1 and "optim.lora_targets" in lines[0], o.stderr


# --- the pure checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("there", "here", "refused"),
    [
        (torch.float16, torch.float32, False),
        (torch.bfloat16, torch.float32, False),
        (torch.float64, torch.float16, False),
        (torch.int32, torch.int64, False),
        (torch.int64, torch.float32, True),
        (torch.bool, torch.float32, True),
        (torch.uint8, torch.bfloat16, True),
        (torch.complex64, torch.float32, True),
        (torch.float32, torch.int64, True),  # a float into a counter (num_batches_tracked)
        (torch.bool, torch.int64, True),
    ],
)
def test_only_floats_cast_to_floats(there, here, refused):
    problem = dtype_problem("k", there, here)
    assert bool(problem) == refused
    if refused:
        assert problem.startswith(f"k is {_dname(there)} there, {_dname(here)} here")


def test_the_sizes_of_a_gpt2_config_against_the_model():
    ours = {
        "n_layer": ("model.gpt.layers", 2),
        "n_embd": ("model.gpt.width", 32),
        "n_head": ("model.gpt.heads", 2),
        "n_positions": ("data.text.seq_len", 32),
    }
    fits = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 1024}
    hf.check_sizes("c.json", fits, ours)  # more positions than the model reads: fine
    hf.check_sizes("c.json", {}, ours)  # nothing said: nothing to check
    hf.check_sizes("c.json", {**fits, "n_head": 1}, {**ours, "n_head": ("model.gpt.heads", None)})
    for key, value, names in [
        ("n_head", 1, "n_head=1, but model.gpt.heads=2"),
        ("n_layer", 12, "n_layer=12, but model.gpt.layers=2"),
        ("n_embd", 768, "n_embd=768, but model.gpt.width=32"),
        ("n_positions", 16, "n_positions=16, but the model reads sequences of 32"),
    ]:
        with pytest.raises(UsageError, match=names):
            hf.check_sizes("c.json", {**fits, key: value}, ours)
