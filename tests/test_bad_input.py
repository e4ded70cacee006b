"""Generated bad-input cases through the real CLIs: every one must end in exit 2 and one line.

The cases come from tables: every field of the config schema times the bad values of its type
(NaN, inf, negative, zero, huge, wrong type, empty), unknown and misspelt keys, malformed
override syntax, bad --config files, `config check --world-size` and strategy mismatches, and a
few mistakes only a build (train --dry-run) can see. Most run in-process through
trainer.cli.main (the same code path as the console script: main() catches TrainerError and
argparse's SystemExit itself); a sample runs as real subprocesses to prove in-process ==
subprocess. Each case asserts: exit code 2, no "Traceback" anywhere, and stderr's last
non-empty line is a `trainer...: error:` line naming the offending key or argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import subprocess
import sys
import typing
from dataclasses import dataclass

import pytest

from tests.helpers import BIN, ROOT, TINY, env
from trainer import cli, config
from trainer.config import RANGES, Config
from trainer.errors import UsageError

# --- the tables --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    category: str
    argv: tuple[str, ...]
    names: str
    """What the error line must mention (the offending key, file or argument)."""


def schema_fields():
    """(dotted key, type) for every leaf field of the schema (config.walk, the one walker)."""
    return [(f.key, f.type) for f in config.walk() if not f.section]


def _base(t):
    """int | None -> (int, True); list[int] -> (list, int)."""
    args = typing.get_args(t)
    if type(None) in args:
        return _base(next(a for a in args if a is not type(None)))[0], True
    if typing.get_origin(t) is list:
        return (list, args[0]), False
    if typing.get_origin(t) is dict:
        return dict, False
    return t, False


def _outside(key: str, item_type) -> list[str]:
    """Values just outside the key's range, and far outside it."""
    r = RANGES[key]
    out = []
    if r.lo_open:
        out.append(str(r.lo))
    elif r.lo > 0:
        out.append(str(r.lo - 1 if item_type is int else r.lo / 2))
    if item_type is int:
        out.append(str(int(r.hi) + 1))
    elif not r.hi_open:
        out.append(repr(float(r.hi) * 1.5))
    else:
        out.append(str(r.hi))
    return out


NUMBER_BAD = ["nan", "inf", "-1", "abc", "[1]", "1e400"]
INT_ONLY_BAD = ["1.5", "true"]
BOOL_BAD = ["maybe", "2", "[true]", "{a:1}", "''"]
STR_BAD = ["[a]", "{a:1}"]
EMPTY_OK = set()  # string fields where "" is meaningful (none today)


def field_cases() -> list[Case]:
    cases = []
    for key, t in schema_fields():
        (base, optional), cat = _base(t), "field"
        bad: list[str] = []
        if base in (int, float):
            bad = [*NUMBER_BAD, *(INT_ONLY_BAD if base is int else []), *_outside(key, base)]
        elif base is bool:
            bad = list(BOOL_BAD)
        elif base is str:
            bad = [*STR_BAD, "''"] if key in config.NONEMPTY or _is_choice(key) else list(STR_BAD)
            if _is_choice(key):
                bad += ["bogus", "NONE"]
        elif isinstance(base, tuple):  # a list field
            item = base[1]
            bad = ["5", "abc", "[abc]", "[nan]", "[-1]", "[inf]", "{a:1}"]
            bad += [f"[{v}]" for v in _outside(key, item)]
        elif base is dict:
            bad = ["5", "[1]"]
        if not optional and base is not dict:
            bad.append("")  # `key=` means null
        seen = set()
        for value in bad:
            if value in seen:
                continue
            seen.add(value)
            cases.append(Case(cat, ("config", "check", f"{key}={value}"), key))
    return cases


def _is_choice(key: str) -> bool:
    try:
        config.load(None, [f"{key}=zzz-not-a-choice"])
    except UsageError as e:
        return "choose one of" in str(e) or "did you mean" in str(e) or "package." in str(e)
    return False


def key_cases() -> list[Case]:
    cases = []
    top = {f.name for f in dataclasses.fields(Config)}
    for key, _ in schema_fields():
        cases.append(Case("unknown key", ("config", "check", f"{key}x=1"), f"{key}x"))
        leaf = key.rpartition(".")[2]
        if (
            "." in key
            and leaf not in top
            and Case("misplaced key", ("config", "check", f"{leaf}=1"), leaf) not in cases
        ):
            cases.append(Case("misplaced key", ("config", "check", f"{leaf}=1"), leaf))
    for section in sorted(top - {"name", "run_dir", "seed"}):
        for value in ("5", "[1]", "abc"):
            cases.append(
                Case("section as value", ("config", "check", f"{section}={value}"), section)
            )
    return cases


SYNTAX = [
    (".lr=1", ".lr"),
    ("optim..lr=1", "optim..lr"),
    ("optim.lr.=1", "optim.lr."),
    ("optim lr=1", "optim lr"),
    ("optim.lr", "optim.lr"),
    ("=1", "=1"),
    ("==", "=="),
    ("optim.lr=[1", "optim.lr"),
    ("optim.lr={", "optim.lr"),
    ("model.hidden=[1,", "model.hidden"),
    ("optim.lr=1e", "optim.lr"),
    ("optim.lr.x=1", "optim.lr"),
    ("optim.name.x=1", "optim.name"),
    ("optim.lr=\udcff", "optim.lr"),
    ("opt\udcffim.lr=1", "opt\\xffim.lr"),
    ("data.root=\udce9t\udce9", "data.root"),
    ("1optim.lr=1", "1optim.lr"),
    ("optim.*=1", "optim.*"),
    ("optim.lr=1=2", "optim.lr"),
    ("-lr=1", "-lr=1"),
    ("--lr=1", "--lr=1"),
    # a value's YAML mistake: where in the value, the parser's problem, the fix
    ("model.hidden=[1,,2]", "at character 4: did not find expected node content: remove that ','"),
    ("optim.betas=[0.9, 0.99", "at the end: did not find expected ',' or ']': close the '['"),
    ("name={a: 1, a: 2}", "found duplicate key 'a': remove one of the two 'a:' entries"),
]


def syntax_cases() -> list[Case]:
    cases = [Case("override syntax", ("config", "check", arg), names) for arg, names in SYNTAX]
    cases += [
        Case("override syntax", ("train", "--dry-run", arg), names)
        for arg, names in SYNTAX
        if not arg.startswith("-")
    ]
    return cases


COMBOS = [
    (["data.persistent_workers=true"], "data.persistent_workers"),
    (["data.device_resident=true", "data.num_workers=2"], "data.device_resident"),
    (["model.name=gpt", "model.gpt.width=100", "model.gpt.heads=3"], "model.gpt.width"),
    (["optim.betas=[0.9]"], "optim.betas"),
    (["optim.betas=[0.9,0.99,0.999]"], "optim.betas"),
    (["data.synthetic.shape=[]"], "data.synthetic.shape"),
    (["dist.strategy=fsdp", "model.sync_bn=true"], "model.sync_bn"),
    (["dist.strategy=fsdp", "fsdp.cpu_offload=true", "dist.device=cpu"], "fsdp.cpu_offload"),
]


LONG = [
    ("name=" + "x" * 100_000, "folder name"),  # `config check` said ok; `train` refused
    ("name=a/" + "b" * 256, "at most 255"),
    ("data.root=/" + "r" * 300, "data.root"),
    ("ckpt.dir=" + "/d" * 2100, "ckpt.dir"),
    ("ckpt.init_weights=/" + "w" * 256, "ckpt.init_weights"),
    ("seed=" + "9" * 5000, "4,300 digits"),
    ("optim.lr=[" + "9" * 500, "optim.lr"),
    # a key or value of 100,000 characters: shortened in the line (it was echoed whole)
    ("a" * 100_000 + "=1", "unknown key 'aaaa"),
    ("optim." + "a" * 100_000 + "=1", "(100,006 characters)"),
    ("seed=" + "x" * 100_000, "(100,000 characters)"),
    ("optim.name=" + "x" * 100_000, "(100,000 characters)"),
    ("data.name=" + "x" * 100_000, "(100,000 characters)"),
    ("train.compile=" + "x" * 100_000, "(100,000 characters)"),
    # a list past OmegaConf's 10,000 values: the limit, and what to do
    ("model.hidden=[" + ",".join(["1"] * 20_000) + "]", "past the 10,000 values one override"),
]
"""Values past what a path or Python's int() takes: the same rule in `config check` and `train`."""


def config_check_cases() -> list[Case]:
    cases = [Case("cross-field", ("config", "check", *o), names) for o, names in COMBOS]
    for n in ("0", "-4", "-1"):
        cases.append(Case("world size", ("config", "check", f"--world-size={n}"), "--world-size"))
    for n in ("abc", "1.5", ""):
        cases.append(Case("world size", ("config", "check", f"--world-size={n}"), "--world-size"))
    cases += [
        Case("world size", ("config", "check", "--world-size=3"), "data.global_batch_size"),
        Case(
            "world size", ("config", "check", "--world-size=2", "dist.strategy=dp"), "dist.strategy"
        ),
        Case(
            "world size",
            ("config", "check", "--world-size=4", "dist.strategy=none"),
            "dist.strategy",
        ),
        *[Case("long value", ("config", "check", arg), names) for arg, names in LONG],
        *[Case("long value", ("train", "--dry-run", arg), names) for arg, names in LONG],
        Case("cli", ("config", "bogus"), "action"),
        Case("cli", ("config", "explain", "optim.lrr"), "optim.lrr"),
        Case("cli", ("config", "explain", "optimizer"), "optimizer"),
        Case("cli", ("bogus",), "bogus"),
        Case("cli", ("config", "check", "--bogus"), "--bogus"),
        Case("cli", ("train", "--from", "/nonexistent-run"), "--from"),
    ]
    return cases


def yaml_files(folder) -> dict[str, tuple[bytes | None, str]]:
    """name -> (content, or None for a folder; what the error must mention)."""
    return {
        "number.yaml": (b"5\n", "number.yaml"),
        "float.yaml": (b"1.5\n", "float.yaml"),
        "list.yaml": (b"- a\n- b\n", "list.yaml"),
        "string.yaml": (b"hello\n", "string.yaml"),
        "bool.yaml": (b"true\n", "bool.yaml"),
        "latin1.yaml": ("name: café\n".encode("latin-1"), "latin1.yaml"),
        "binary.yaml": (bytes(range(256)) * 4, "binary.yaml"),
        "utf16.yaml": ("name: x\n".encode("utf-16"), "utf16.yaml"),
        "empty.yaml": (b"", "empty.yaml"),
        "blank.yaml": (b"\n  \n", "blank.yaml"),
        "comments.yaml": (b"# nothing\n", "comments.yaml"),
        "broken.yaml": (
            b"optim: [unclosed\n",
            "broken.yaml:2:1: not valid YAML: did not find expected ',' or ']': close the '[' at 1:8",
        ),
        "tabs.yaml": (b"optim:\n\tlr: 1\n", "tabs.yaml:2:1: not valid YAML: found character"),
        # YAML mistakes: the line says where (line:column), the parser's problem, and the fix
        "duplicate.yaml": (
            b"optim:\n  lr: 0.1\n  lr: 0.2\n",
            "duplicate.yaml:3:3: not valid YAML: found duplicate key 'lr': remove one of the two "
            "'lr:' lines (2 and 3)",
        ),
        "unclosed-brace.yaml": (b"optim: {lr: 0.1\n", "unclosed-brace.yaml:2:1: not valid"),
        "missing-comma.yaml": (
            b"optim: {lr: 0.1 momentum: 0.9}\n",
            "missing-comma.yaml:1:25: not valid YAML: did not find expected ',' or '}': put a ','",
        ),
        "bad-indent.yaml": (
            b"optim:\n    lr: 1\n  momentum: 0.9\n",
            "bad-indent.yaml:3:3: not valid YAML: did not find expected key: indent",
        ),
        "no-colon.yaml": (b"optim:\n  lr 0.1\n  momentum: 0.9\n", "line 2 ('lr 0.1') has no ':'"),
        "unclosed-quote.yaml": (b'name: "abc\n', "close the quote opened at 1:7"),
        "long-duplicate.yaml": (b"k" * 1000 + b": 1\n" + b"k" * 1000 + b": 2\n", "(1,000 chara"),
        "section.yaml": (b"optim: 5\n", "optim"),
        "section-list.yaml": (b"data: [1, 2]\n", "data"),
        "typo.yaml": (b"optim:\n  lrr: 0.1\n", "optim.lrr"),
        "nan.yaml": (b"optim:\n  lr: .nan\n", "optim.lr"),
        "inf.yaml": (b"optim:\n  lr: .inf\n", "optim.lr"),
        "negative.yaml": (b"seed: -1\n", "seed"),
        "type.yaml": (b"train:\n  epochs: many\n", "train.epochs"),
        "preset-number.yaml": (b"preset: 5\n", "preset"),
        "preset-missing.yaml": (b"preset: digits-mpl\n", "digits-mpl"),
        "preset-self.yaml": (b"preset: PLACEHOLDER\n", "preset"),
        # Nested past the YAML parser's recursion (block and flow style), and past OmegaConf's.
        "deep-block.yaml": (b"".join(b"  " * i + b"k:\n" for i in range(1000)), "too deeply"),
        "deep-flow.yaml": (b"a: " + b"{b: " * 1000 + b"1" + b"}" * 1000, "too deeply"),
        "deep-omegaconf.yaml": (b"optim: " + b"[" * 300 + b"]" * 300, "too deeply"),
        "not-a-run-dir": (None, "not-a-run-dir"),
        **PATHOLOGICAL_YAML,
    }


def _laughs(key: bytes = b"a0") -> bytes:
    """A "billion laughs": 10 levels of 9 aliases each, 9**10 values once expanded."""
    lines = [key + b': &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(b"a%d: &a%d [" % (i, i) + b", ".join([b"*a%d" % (i - 1)] * 9) + b"]")
    return b"\n".join(lines) + b"\n"


PATHOLOGICAL_YAML = {
    # size: refused before parsing (a 15 MB file took 95 s and 1.5 GB to refuse after it)
    "big.yaml": (b"name: " + b"x" * (1 << 20) + b"\n", "1.0 MB"),
    "many-keys.yaml": (b"".join(b"k%d: %d\n" % (i, i) for i in range(6000)), "10,000 keys"),
    "long-list.yaml": (b"optim:\n  betas: [" + b",".join([b"0.9"] * 12000) + b"]\n", "10,000"),
    "long-name.yaml": (b"name: " + b"x" * 100_000 + b"\n", "folder name"),
    "long-root.yaml": (b"data:\n  root: /" + b"r" * 300 + b"\n", "data.root"),
    "long-path.yaml": (b"run_dir: " + b"/d" * 2100 + b"\n", "run_dir"),
    "nul-name.yaml": (b'name: "a\\0b"\n', "NUL"),
    "huge-int.yaml": (b"seed: " + b"9" * 5000 + b"\n", "4,300 digits"),
    "huge-hex.yaml": (b"seed: 0x" + b"f" * 5000 + b"\n", "seed"),
    # aliases: expanded past any config's size, or into themselves
    "alias-bomb.yaml": (_laughs(), "alias"),
    "alias-bomb-in-a-key.yaml": (_laughs(b"x0") + b"optim:\n  betas: *a9\n", "alias"),
    "alias-recursive.yaml": (b"optim: &a\n  lr: 0.1\n  self: *a\n", "alias"),
    "alias-recursive-list.yaml": (b"x: &a [*a]\n", "alias"),
    "python-tag.yaml": (b'name: !!python/object/apply:os.system ["true"]\n', "python-tag"),
}
"""Pathological YAML: size, length, digits and alias bombs (depth is above)."""


def yaml_cases(folder) -> list[Case]:
    cases = []
    for name, (content, names) in yaml_files(folder).items():
        path = os.path.join(folder, name)
        if content is None:
            os.makedirs(path, exist_ok=True)
        else:
            with open(path, "wb") as f:
                f.write(content.replace(b"PLACEHOLDER", path.encode()))
        cases.append(Case("yaml file", ("config", "check", "--config", path), names))
        cases.append(Case("yaml file", ("train", "--dry-run", "-c", path), names))
    missing = os.path.join(folder, "missing.yaml")
    cases.append(Case("yaml file", ("config", "check", "--config", missing), "missing.yaml"))
    cases.append(Case("yaml file", ("config", "show", "--config", "digits-mpl"), "digits-mpl"))
    return cases


def build_cases(folder) -> list[Case]:
    """Mistakes only a build sees (the dataset's facts): train --dry-run on tiny settings."""
    run = f"run_dir={folder}/run"
    return [
        Case(
            "build", ("train", "--dry-run", *TINY, run, "model.num_classes=2"), "model.num_classes"
        ),
        Case(
            "build", ("train", "--dry-run", *TINY, run, "model.num_classes=1"), "model.num_classes"
        ),
        Case(
            "build",
            ("train", "--dry-run", run, "data.name=mnist", f"data.root={folder}/none"),
            "data.name=mnist",
        ),
        Case(
            "build",
            ("train", "--dry-run", run, "data.name=text", f"data.text.path={folder}/none"),
            "data.text.path",
        ),
        Case("build", ("train", "--dry-run", run, "data.name=nomodule:fn"), "data.name"),
        Case("build", ("train", "--dry-run", *TINY, run, "model.name=gpt"), "model.name=gpt"),
    ]


def export_cases(folder) -> list[Case]:
    """`trainer export` with its arguments in the wrong order or missing: the source first."""
    import torch

    src, run = os.path.join(folder, "w.pt"), os.path.join(folder, "somerun")
    torch.save({"w": torch.zeros(2)}, src)
    os.makedirs(run, exist_ok=True)
    for name in ("config.yaml", "metrics.jsonl"):  # a run folder, not an earlier export
        with open(os.path.join(run, name), "w") as f:
            f.write("name: somerun\n" if name == "config.yaml" else "")
    new, missing = os.path.join(folder, "new-out"), os.path.join(folder, "missing.pt")
    with open(os.path.join(folder, "a-file"), "w") as f:
        f.write("not an export")
    return [
        Case("export order", ("export", missing), f"export {missing}: no such"),
        Case("export order", ("export", "/nonexistent/path"), "export /nonexistent/path: no such"),
        Case("export order", ("export", missing, "-o", "/nonexistent/out"), f"{missing}: no such"),
        Case("export order", ("export", new, "-o", run), f"trainer export {run} -o {new}"),
        Case("export order", ("export", new, src), f"trainer export {src} -o {new}"),
        Case("export order", ("export", src, new), f"trainer export {src} -o {new}"),
        Case("export order", ("export", src, new, run), "trainer export SRC -o OUT"),
        Case("export order", ("export", "-o", new), "src"),
        Case("export order", ("export", src, "-o", run), "other files"),
        Case("export order", ("export", src, "-o", src), "is the source itself"),
        Case("export order", ("export", src, "-o", os.path.join(folder, "a-file")), "is a file"),
        Case("export order", ("export", src, "-o", "/nonexistent/out"), "/nonexistent"),
    ]


LAUNCH = [
    ({}, ["dist.strategy=dp"], "dist.strategy"),
    ({}, ["dist.strategy=none"], "dist.strategy"),
    ({}, ["dist.strategy=fsdp", "model.sync_bn=true"], "model.sync_bn"),
    ({}, ["data.global_batch_size=3"], "data.global_batch_size"),
    ({}, ["optim.lr=nan"], "optim.lr"),
    ({}, ["model.name=gpt", "data.name=text", "model.gpt.layers=3", "dist.mesh=pp=2"], "layers=3"),
    ({}, ["model.name=mlp", "dist.mesh=tp=2", "dist.strategy=none"], "tensor-parallel plan"),
    ({}, [".lr=1"], ".lr"),
    ({"NPROC_PER_NODE": "abc"}, [], "NPROC_PER_NODE"),
    ({"NPROC_PER_NODE": "-2"}, [], "NPROC_PER_NODE"),
    ({"NNODES": "0"}, [], "NNODES"),
    ({"MASTER_PORT": "99999", "NNODES": "2", "MASTER_ADDR": "h"}, [], "MASTER_PORT"),
    ({"MAX_RESTARTS": "-1"}, [], "MAX_RESTARTS"),
    ({"OMP_NUM_THREADS": "abc"}, [], "OMP_NUM_THREADS"),
    ({"TRAIN_ARGS": "optim.lr='unclosed"}, [], "TRAIN_ARGS"),
]
"""trainer-launch --dry-run on a 2-process node: (environment, arguments, what to name)."""


def all_cases(folder) -> list[Case]:
    cases = [
        *field_cases(),
        *key_cases(),
        *syntax_cases(),
        *config_check_cases(),
        *yaml_cases(folder),
        *build_cases(folder),
        *export_cases(folder),
    ]
    assert len(set(cases)) == len(cases), "duplicate cases"
    return cases


# --- bad plug-ins: the user's data factory, splits, model factory and Task ---------------------

BP = "tests.bad_plugins"
"""tests/bad_plugins.py: one broken plug-in per object, the rest of the run tiny and right."""

PLUGIN_BASE = {
    "data.name": f"{BP}:good_data",
    "model.name": f"{BP}:tiny_model",
    "task.name": "auto",
    "data.global_batch_size": "4",
}
DRY_RUN = ("train", "--dry-run", "run_dir=run")
ONE_STEP = (  # a real run: evaluation (metrics over 2 batches, then summarize) at its last step
    "train",
    "train.max_steps=1",
    "data.eval_batch_size=4",
    "log.tensorboard=false",
    "log.progress=plain",
    "run_dir=run",
)


def _plugin(category: str, names: str, *overrides: str, run: bool = False):
    """A Case on the tiny plug-ins with `overrides` replacing their keys (`train --dry-run`, or
    one real step for what only evaluation sees)."""
    values = dict(PLUGIN_BASE)
    for item in overrides:
        key, _, value = item.partition("=")
        values[key] = value
    argv = (*(ONE_STEP if run else DRY_RUN), *(f"{k}={v}" for k, v in values.items()))
    case = Case(f"plug-in {category}", argv, names)
    label = " ".join(o if o.endswith(":") else o.replace(f"{BP}:", "") for o in overrides)
    label += " [one step]" if run else ""
    return pytest.param(case, id=f"{category}: {label}")


def _data(fn: str, names: str):
    return _plugin("data", names, f"data.name={BP}:{fn}")


def _model(fn: str, names: str, *extra: str):
    return _plugin("model", names, f"model.name={BP}:{fn}", *extra)


def _task(category: str, obj: str, names: str, *extra: str, run=False):
    return _plugin(category, names, f"task.name={BP}:{obj}", *extra, run=run)


def plugin_cases() -> list:
    """Bad plug-ins, one contract rule broken each (pytest.params of Cases)."""
    return [
        # the data factory: (DataConfig, seed) -> trainer.DataSpec
        _data("returns_none", "returns_none' returned NoneType, not a trainer.DataSpec"),
        _data("returns_dict", "returns_dict' returned dict, not a trainer.DataSpec"),
        _data("returns_tuple", "returns_tuple' returned tuple, not a trainer.DataSpec"),
        _data("returns_dataset", "returned ArrayDataset, not a trainer.DataSpec"),
        _data("returns_dataspec_class", "returned type, not a trainer.DataSpec"),
        _data("raises_usage_error", "raises_usage_error: /data/ratings.csv not found"),
        _data(
            "data_without_arguments",
            "data_without_arguments",
        ),
        # the splits: the Split protocol (__len__, take)
        _data("split_without_take", "DataSpec.train is a LenOnly, which lacks __len__ or take"),
        _data("split_is_tensor_dataset", "DataSpec.train is a TensorDataset"),
        _data("split_without_len", "DataSpec.train is a TakeOnly, which lacks __len__"),
        _data(
            "split_len_float",
            "LenFloat",
        ),
        _data(
            "split_len_negative",
            "LenNegative",
        ),
        _data("spec_task_not_a_name", "DataSpec.task must be a task name"),
        # take(idx): tensors (a tuple, list or dict of them) with len(idx) rows each
        _data("take_numpy", "Rows.take (train split) returned a tuple of ndarray"),
        _data("take_lists", "Rows.take (train split) returned a tuple of list"),
        _data("take_none", "Rows.take (train split) returned a NoneType"),
        _data("take_dict_with_list", "Rows.take (train split) returned a dict of Tensor, list"),
        _data("take_dict_with_string", "Rows.take (train split) returned a dict of Tensor, str"),
        _data("take_different_lengths", "Rows.take (train split): a batch's tensors must share"),
        _data("take_too_many_rows", "Rows.take (train split) returned 2 samples for 1 indices"),
        _data("take_scalar", "Rows.take (train split): a batch's tensors must share"),
        _data("take_numpy_in_test_split", "Rows.take (test split) returned a tuple of ndarray"),
        # the model factory: called with the arguments it names, returns an nn.Module
        # a model and a batch of different dtypes (the data gives float32)
        _model(
            "model_in_float64",
            "the batch and the model have different dtypes (model parameters float64, the "
            "batch's floating-point tensors float32",
        ),
        _model("model_returns_none", "model_returns_none' returned NoneType, not a torch.nn.Mod"),
        _model("model_returns_dict", "model_returns_dict' returned dict, not a torch.nn.Module"),
        _model("model_returns_factory", "returned function, not a torch.nn.Module"),
        _model("NotAModule", "NotAModule' returned NotAModule, not a torch.nn.Module"),
        _model("NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
        _model("missing", "'tests.bad_plugins' has no callable 'missing'"),
        _model("model_needs_vocab", "missing a required argument: 'vocab_size'"),
        _model("tiny_model", "adjust model.kwargs", "model.kwargs.depth=2"),
        _model(
            "model_with_a_type_error_inside",
            "bad_plugins.py",
        ),
        # the task: a trainer.Task object, subclass or factory returning one
        _task("task", "NotATask", "returned NotATask, not a trainer.Task"),
        _task("task", "task_returns_none", "returned NoneType, not a trainer.Task"),
        _task("task", "task_returns_loss_function", "returned function, not a trainer.Task"),
        _task("task", "LOSS_TABLE", "'tests.bad_plugins:LOSS_TABLE' is a dict, not a trainer.Ta"),
        _task("task", "missing", "'tests.bad_plugins' has no 'missing'"),
        _task("task", "Good.nope", "'tests.bad_plugins' has no 'Good.nope'"),
        _task(
            "task",
            "GOOD",
            "task.kwargs: task.name=tests.bad_plugins:GOOD is a Task object",
            "task.kwargs.smoothing=0.1",
        ),
        _task("task", "Good", "adjust task.kwargs", "task.kwargs.smoothing=0.1"),
        _task("task", "NoLoss", "NoLoss does not define loss(output, batch)"),
        _task("task", "NO_LOSS", "NoLoss does not define loss"),
        # terms_per_sample: a positive int, or None with count()
        *[
            _task("terms", cls, f"{cls}.terms_per_sample={value}: set a positive integer")
            for cls, value in [
                ("TermsZero", "0"),
                ("TermsNegative", "-1"),
                ("TermsFloat", "1.5"),
                ("TermsTrue", "True"),
            ]
        ],
        _task("terms", "TermsNoneNoCount", "TermsNoneNoCount.terms_per_sample is None, so it must"),
        *[
            _task("terms", obj, f"{cls}.terms_per_sample")
            for obj, cls in [
                ("TERMS_ZERO", "TermsZero"),
                ("TERMS_NEGATIVE", "TermsNegative"),
                ("TERMS_FLOAT", "TermsFloat"),
                ("TERMS_TRUE", "TermsTrue"),
                ("TERMS_NONE_NO_COUNT", "TermsNoneNoCount"),
            ]
        ],
        # loss(): a 0-dim float tensor, the SUM, that depends on the model
        _task("loss", "LossFloat", "LossFloat.loss returned float, not a tensor"),
        _task("loss", "LossInt", "LossInt.loss returned int, not a tensor"),
        _task("loss", "LossNone", "LossNone.loss returned NoneType, not a tensor"),
        _task("loss", "LossVector", "LossVector.loss returned a tensor of shape (1,), not a sc"),
        _task("loss", "LossIntTensor", "LossIntTensor.loss returned a torch.int64 tensor"),
        _task("loss", "LossDetached", "LossDetached.loss returned a tensor that does not depend"),
        # count(): a non-negative int (terms_per_sample None), not 0 over the whole global batch
        _task("count", "CountFloat", "CountFloat.count returned 1.0"),
        _task("count", "CountNegative", "CountNegative.count returned -1"),
        _task("count", "CountString", "CountString.count returned '1'"),
        _task("count", "CountFloatTensor", "CountFloatTensor.count returned a tensor of shape ()"),
        _task("count", "CountNone", "CountNone.count returned None"),
        _task("count", "CountZero", "CountZero.count: the global batch of step 1 has 0 loss"),
        _task("count", "CountedWithFixedTerms", "defines count(batch) but terms_per_sample=1"),
        # metrics(): {name: (sum, count)}, the same names for every batch
        _task("metrics", "MetricsList", "MetricsList.metrics returned ["),
        _task("metrics", "MetricsEmpty", "MetricsEmpty.metrics returned {}"),
        _task("metrics", "MetricsMean", "MetricsMean.metrics['loss'] is 1."),
        _task("metrics", "MetricsTriple", "MetricsTriple.metrics['loss'] is ("),
        _task("metrics", "MetricsVectorSum", "its sum is a tensor of shape (7,)"),
        _task("metrics", "MetricsString", "MetricsString.metrics returned 'loss'"),
        _task("metrics", "MetricsNonStringName", "metric names must be non-empty strings, got 0"),
        _task("metrics", "MetricsStringCount", "MetricsStringCount.metrics['loss']: its count"),
        _task(
            "metrics", "MetricsNamesVary", "returned different names on different batches", run=True
        ),
        _task(
            "metrics",
            "MetricsNegativeCount",
            "MetricsNegativeCount.metrics: a count summed",
            run=True,
        ),
        # summarize(): {name: number}
        _task("summarize", "SummarizeList", "SummarizeList.summarize returned list", run=True),
        _task(
            "summarize",
            "SummarizeStringValue",
            "SummarizeStringValue.summarize returned dict",
            run=True,
        ),
        _task("summarize", "SummarizeNone", "SummarizeNone.summarize returned NoneType", run=True),
        _task(
            "summarize", "SummarizeTensorValue", "SummarizeTensorValue.summarize returned", run=True
        ),
        _task(
            "summarize",
            "SummarizeList",
            "SummarizeList.summarize returned list",
        ),
        # forward(): the batch stays on the run's device
        _task(
            "forward",
            "ForwardToMeta",
            "ForwardToMeta.forward: tensors on different devices",
        ),
        _task(
            "forward",
            "ForwardInFloat64",
            "ForwardInFloat64.forward: the batch and the model have different dtypes",
        ),
        _task(
            "forward",
            "ForwardNewTensorOnMeta",
            "ForwardNewTensorOnMeta.forward: tensors on different devices",
        ),
        # plug-in modules that fail to import (tests/bad_plugins.py:BROKEN_MODULES, on sys.path)
        _plugin(
            "import",
            "ImportError: cannot import name 'no_such_name' from 'json'",
            "task.name=broken_plugin_import_name:Task",
        ),
        _plugin(
            "import",
            "No module named 'no_such_dependency_xyz' (",
            "task.name=broken_plugin_missing_dep:Task",
        ),
        _plugin(
            "import",
            "broken_plugin_v2.py:2",
            "model.name=broken_plugin_v2:model",
        ),
        _plugin(
            "import", "SyntaxError: '(' was never closed (", "data.name=broken_plugin_syntax:data"
        ),
        _plugin(
            "import",
            "IndentationError: expected an indented block",
            "model.name=broken_plugin_indent:model",
        ),
        _plugin(
            "import",
            "NameError: name 'widht' is not defined (",
            "task.name=broken_plugin_name_error:Task",
        ),
        _plugin(
            "import",
            "RuntimeError: this module needs a GPU (",
            "model.name=broken_plugin_runtime:model",
        ),
        _plugin(
            "import",
            "broken_plugin_json.py:3",
            "task.name=broken_plugin_json:Task",
        ),
        _plugin(
            "import", "broken_plugin_pkg/__init__.py:1", "data.name=broken_plugin_pkg.tasks:Task"
        ),
        _plugin("import", "cannot import 'no_such_module_xyz'", "task.name=no_such_module_xyz:T"),
        _plugin(
            "import",
            "cannot import 'tests.no_such_module'",
            "model.name=tests.no_such_module:model",
        ),
        _plugin(
            "import", "'tests.bad_plugins' has no callable 'missing'", f"data.name={BP}:missing"
        ),
        _plugin(
            "import",
            "package.module:",
            f"task.name={BP}:",
        ),
        # <fit>:name, what trainer.fit records for objects only its script can hand over
        _plugin(
            "fit name",
            "data.name=<fit>:load_data: an object that a script handed to",
            "data.name=<fit>:load_data",
        ),
        _plugin(
            "fit name",
            "model.name=<fit>:build_model: an object that a script handed to",
            "model.name=<fit>:build_model",
        ),
        _plugin(
            "fit name",
            "task.name=<fit>:MyTask: an object that a script handed to",
            "task.name=<fit>:MyTask",
        ),
    ]


FIT_OVERRIDES = ["train.max_steps=1", "log.tensorboard=false", "log.progress=plain", "run_dir=run"]

FIT_CASES = [
    # (id, trainer.fit's arguments from tests.bad_plugins `bp`, what to name)
    ("config int", lambda bp: {"config": 5}, "trainer.fit: config is a int"),
    ("config list", lambda bp: {"config": ["optim.lr=0.1"]}, "config is a list"),
    ("config bad section", lambda bp: {"config": {"optim": 5}}, "optim: is a section"),
    ("config typo", lambda bp: {"config": {"optim": {"lrr": 0.1}}}, "'optim.lrr'"),
    ("config no preset", lambda bp: {"config": "no-such-preset"}, "'no-such-preset'"),
    ("overrides str", lambda bp: {"overrides": "optim.lr=0.1"}, "overrides must be a list"),
    ("overrides dict", lambda bp: {"overrides": {"optim.lr": 0.1}}, "'optim.lr' must look"),
    (
        "overrides ints",
        lambda bp: {"overrides": [*FIT_OVERRIDES, 5]},
        "overrides",
    ),
    ("model class", lambda bp: {"model": bp.NotAModule}, "returned NotAModule, not a torch"),
    ("model none", lambda bp: {"model": bp.model_returns_none}, "returned NoneType, not a"),
    (
        "model int",
        lambda bp: {"model": 5},
        "nn.Module",
    ),
    (
        "model str",
        lambda bp: {"model": f"{BP}:tiny_model"},
        "nn.Module",
    ),
    ("data none", lambda bp: {"data": bp.returns_none}, "returned NoneType, not a trainer.D"),
    (
        "data int",
        lambda bp: {"data": 5},
        "trainer.DataSpec",
    ),
    (
        "data dataset",
        lambda bp: {"data": bp.returns_dataset(None, 0)},
        "trainer.DataSpec",
    ),
    (
        "data no arguments",
        lambda bp: {"data": bp.data_without_arguments},
        "data_without_arguments",
    ),
    ("task int", lambda bp: {"task": 5}, "'5' is a int, not a trainer.Task"),
    ("task str", lambda bp: {"task": "classification"}, "is a str, not a trainer.Task"),
    ("task not a Task", lambda bp: {"task": bp.NotATask()}, "is a NotATask, not a trainer"),
    ("task no loss", lambda bp: {"task": bp.NoLoss}, "NoLoss does not define loss"),
    ("task no loss object", lambda bp: {"task": bp.NO_LOSS}, "NoLoss"),
    (
        "task terms 0 object",
        lambda bp: {"task": bp.TERMS_ZERO},
        "TermsZero.terms_per_sample",
    ),
]
"""trainer.fit(...) called with bad arguments, exit_on_error=True: SystemExit 2 and one line."""


def fit_cases() -> list:
    return [pytest.param(name, make, names, id=name) for name, make, names in FIT_CASES]


# --- running a case ----------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    stdout: str
    stderr: str


def run_in_process(argv, main=cli.main) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse: main() records and re-raises it, as the script does
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # a bug: what the console script would show
            import traceback

            traceback.print_exc(file=err)
            code = 1
    return Outcome(code, out.getvalue(), err.getvalue())


def run_subprocess(argv) -> Outcome:
    p = subprocess.run(
        [sys.executable, "-m", "trainer", *[os.fsencode(a) for a in argv]],
        capture_output=True,
        env=env(),
        cwd=ROOT,
        timeout=120,
    )
    decode = lambda b: b.decode("utf-8", "backslashreplace")  # noqa: E731
    return Outcome(p.returncode, decode(p.stdout), decode(p.stderr))


MAX_LINE = 1000
"""The longest error line: a key or value of 100,000 characters came back whole; what the user
typed or wrote is shortened (errors.shorten). The longest line by design, MNIST's where to put its
files (two paths), is about 660 characters on pytest's temporary paths."""


def problems(case: Case, o: Outcome) -> list[str]:
    found = []
    if o.code != 2:
        found.append(f"exit {o.code}")
    if "Traceback" in o.stdout + o.stderr:
        found.append("traceback")
    lines = [line for line in o.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    errors = [line for line in lines if ": error: " in line]
    if ": error: " not in last:
        found.append(f"last line is not an error line: {last[:120]!r}")
    elif len(errors) != 1:
        found.append(f"{len(errors)} error lines")
    elif len(last) > MAX_LINE:
        found.append(f"an error line of {len(last):,} characters: {last[:200]!r}")
    elif case.names.lower() not in last.lower() and case.names not in _printable(last):
        found.append(f"does not name {case.names!r}: {last[:200]!r}")
    return found


def _printable(text: str) -> str:
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    from trainer.exitstatus import STATUS_DIR_ENV
    from trainer.ranks import TORCHRUN_VARS

    for name in (*TORCHRUN_VARS, STATUS_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- the tests ---------------------------------------------------------------------------------


def test_every_numeric_field_has_a_range():
    numeric = []
    for key, t in schema_fields():
        base = _base(t)[0]
        if base in (int, float) or (isinstance(base, tuple) and base[1] in (int, float)):
            numeric.append(key)
    assert sorted(numeric) == sorted(RANGES), "RANGES must list exactly the numeric fields"
    for key in RANGES:  # every default is inside its own range
        value = config.example(key).partition("=")[2]
        if value not in ("null",):
            config.load(None, [f"{key}={value}"])
    assert math.inf not in [r.hi for r in RANGES.values()]


def test_generated_bad_inputs_exit_2_with_one_line(clean_env, capsys):
    cases = all_cases(str(clean_env))
    failures: dict[str, list[str]] = {}
    for case in cases:
        found = problems(case, run_in_process(case.argv))
        if found:
            failures.setdefault(case.category, []).append(f"{list(case.argv)}: {'; '.join(found)}")
    by_category: dict[str, int] = {}
    for case in cases:
        by_category[case.category] = by_category.get(case.category, 0) + 1
    failed = sum(map(len, failures.values()))
    with capsys.disabled():
        print(
            f"\n{len(cases)} generated bad-input cases "
            f"({', '.join(f'{k} {v}' for k, v in by_category.items())}): "
            + (
                "all exit 2 with one line naming the key"
                if not failed
                else f"{failed} FAILED ({', '.join(f'{k} {len(v)}' for k, v in failures.items())})"
            )
        )
    assert len(cases) >= 300
    assert not failed, "\n".join(line for lines in failures.values() for line in lines)


def test_trainer_launch_refuses_bad_input_before_torchrun(clean_env, monkeypatch):
    from trainer import launch

    failures = []
    for extra, args, names in LAUNCH:
        with monkeypatch.context() as m:
            m.setenv("NPROC_PER_NODE", "2")
            for name, value in extra.items():
                m.setenv(name, value)
            o = run_in_process(["--dry-run", *args], main=launch.main)
        case = Case("launch", ("trainer-launch", *args), names)
        if found := problems(case, o):
            failures.append(f"{extra} {args}: {found}")
    assert not failures, "\n".join(failures)


def test_a_sample_behaves_the_same_as_a_subprocess(clean_env):
    cases = [c for c in all_cases(str(clean_env)) if c.category != "build"]
    sample = cases[:: max(1, len(cases) // 10)][:10]
    for case in sample:
        sub = run_subprocess(case.argv)
        assert not problems(case, sub), (case, sub.stderr[-2000:])
        inproc = run_in_process(case.argv)
        assert inproc.code == sub.code
        assert inproc.stderr.strip().splitlines()[-1] == sub.stderr.strip().splitlines()[-1]


# --- bad plug-ins ------------------------------------------------------------------------------


@pytest.fixture
def plugin_env(clean_env, monkeypatch):
    """clean_env plus tests/bad_plugins.py's BROKEN_MODULES in a folder on sys.path."""
    from tests.bad_plugins import write_broken_modules

    folder = clean_env / "plugins"
    write_broken_modules(folder)
    monkeypatch.syspath_prepend(str(folder))
    yield clean_env
    for name in [m for m in sys.modules if m.startswith("broken_plugin")]:
        del sys.modules[name]  # what a half-failed import left (broken_plugin_pkg.helpers)


@pytest.mark.parametrize("case", plugin_cases())
def test_a_bad_plugin_exits_2_with_one_line(plugin_env, case):
    o = run_in_process(case.argv)
    assert not problems(case, o), (problems(case, o), o.stderr[-3000:])


@pytest.mark.parametrize(
    "argv",
    [
        DRY_RUN,
        (*DRY_RUN, f"task.name={BP}:Good"),
        (*DRY_RUN, f"task.name={BP}:GOOD"),
        (*DRY_RUN, f"task.name={BP}:good_task"),
        (*DRY_RUN, f"task.name={BP}:Counted"),
        (*ONE_STEP, f"task.name={BP}:Good"),
    ],
    ids=["auto", "Good", "GOOD", "good_task", "Counted", "Good one step"],
)
def test_the_bad_plugins_controls_run(plugin_env, argv):
    """The plug-ins each case breaks one rule of, unbroken: every failure above is the one rule."""
    base = [f"{k}={v}" for k, v in PLUGIN_BASE.items() if not any(a.startswith(k) for a in argv)]
    o = run_in_process([*argv, *base])
    assert o.code == 0, o.stderr[-3000:]


@pytest.mark.parametrize("name, make, names", fit_cases())
def test_trainer_fit_with_bad_arguments_exits_2_with_one_line(plugin_env, name, make, names):
    import trainer
    from tests import bad_plugins

    given = {"overrides": FIT_OVERRIDES, "data": bad_plugins.good_data}
    given = {**given, "model": bad_plugins.tiny_model, **make(bad_plugins)}
    o = run_in_process([], main=lambda argv: trainer.fit(**given))
    case = Case("trainer.fit", (name,), names)
    assert not problems(case, o), (problems(case, o), o.stderr[-3000:])
    assert len([line for line in o.stderr.splitlines() if line.strip()]) == 1, o.stderr


def test_trainer_fit_control_runs(plugin_env):
    import trainer
    from tests import bad_plugins

    summary = trainer.fit(
        None, FIT_OVERRIDES, data=bad_plugins.good_data, model=bad_plugins.tiny_model
    )
    assert summary["steps"] == 1 and summary["eval"]["count"] == 7


def test_a_plugin_task_without_a_loss_metric_finishes_or_says_so_in_one_line(plugin_env):
    o = run_in_process(
        [
            *ONE_STEP,
            *(f"{k}={v}" for k, v in PLUGIN_BASE.items() if k != "task.name"),
            f"task.name={BP}:MetricsWithoutLoss",
        ]
    )
    assert "Traceback" not in o.stderr + o.stdout, o.stderr[-3000:]
    case = Case("plug-in metrics", (), "MetricsWithoutLoss.metrics")
    assert o.code == 0 or not problems(case, o), o.stderr[-3000:]


# --- targeted: a diverging run, and the launcher's output --------------------------------------


def diverging_model(num_classes, in_shape, after=4):
    """tests.helpers' tiny model whose output turns NaN from training forward `after` + 1 on."""
    import torch
    from torch import nn

    class Diverging(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), num_classes))
            self.calls = 0

        def forward(self, x):
            out = self.net(x)
            if self.training:
                self.calls += 1
                if self.calls > after:
                    out = out * torch.tensor(float("nan"))
            return out

    return Diverging()


@pytest.mark.parametrize("log_every, save_every", [(4, 2), (1, 100)])
def test_a_diverging_run_stops_with_exit_2_and_keeps_the_good_checkpoints(
    tmp_path, log_every, save_every
):
    # The loss turns NaN at step 5. Saving every 2 steps but logging every 4: the save after
    # step 6 sees NaN weights first; logging every step: the loss at step 5 stops it.
    run_dir = tmp_path / "run"
    p = run_subprocess(
        (
            "train",
            *TINY,
            "model.name=tests.test_bad_input:diverging_model",
            "train.epochs=4",
            f"log.every_steps={log_every}",
            f"ckpt.every_steps={save_every}",
            "ckpt.every_epochs=0",
            "ckpt.keep_last=100",
            "log.progress=plain",
            f"run_dir={run_dir}",
        )
    )
    assert p.code == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout
    last = p.stderr.strip().splitlines()[-1]
    step = 6 if save_every == 2 else 5
    assert last.startswith("trainer: error: training diverged: ") and f"at step {step}:" in last
    assert "optim.lr" in last and "train.clip_grad_norm" in last
    if save_every == 2:  # the good ones stay; none holds NaN weights
        assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-000000002", "step-000000004"]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "final").exists()
    assert "done:" not in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("key", ["run_dir", "ckpt.dir"])
def test_trainer_launch_refuses_a_folder_it_cannot_write_before_torchrun(tmp_path, key):
    """Every node checks the run folder (and a local ckpt.dir) before torchrun starts: on Slurm a
    read-only one was found by a rank ~30 s in, after the rendezvous, and the other node's
    torchrun printed C++ frames and a RendezvousConnectionError (issue 56 item 1)."""
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "run"  # unwritable for everyone, root included
    args = [f"{key}={bad}"] + ([f"run_dir={tmp_path}/run"] if key == "ckpt.dir" else [])
    p = subprocess.run(
        [str(BIN / "trainer-launch"), *args],
        env=env(NPROC_PER_NODE="2"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"trainer-launch: error: {key} {bad} is not writable on this node")
    assert line.endswith(f"point {key} at writable storage")
    assert "trainer-launch: torchrun" not in p.stderr  # no torchrun started
    assert (tmp_path / "a-file").read_text() == ""  # the file in the way is left as it was


def test_launchers_probing_one_new_folder_at_once_all_find_it_writable(tmp_path):
    """Every node's trainer-launch probes the run folder, on a shared filesystem at the same
    moment: a probe that removed the folders it made failed the others' (EEXIST/ENOENT). Each
    probe makes only a file of its own in the nearest folder that exists, and leaves nothing."""
    import threading

    from trainer import rundir

    for trial in range(20):
        folder, errors = str(tmp_path / f"t{trial}" / "runs" / "name"), []

        def probe(folder=folder, errors=errors):
            errors.append(rundir.probe_nearest(folder))

        probes = [threading.Thread(target=probe) for _ in range(8)]
        for t in probes:
            t.start()
        for t in probes:
            t.join()
        assert errors == [None] * 8, errors
        assert os.listdir(tmp_path) == []  # nothing made, the probe files gone


def test_trainer_launch_ends_with_the_ranks_one_line_once(tmp_path):
    p = subprocess.run(
        [
            str(BIN / "trainer-launch"),
            "data.name=mnist",
            f"data.root={tmp_path}/no-such-root",
            f"run_dir={tmp_path}/run",
            "log.progress=plain",
        ],
        env=env(NPROC_PER_NODE="2"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("trainer: error: data.name=mnist: MNIST not found")
    assert f"{tmp_path}/no-such-root" in lines[-1]
    assert sum("MNIST not found" in line for line in lines) == 1, p.stderr
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr


TORCHRUN_TAIL = [
    b"W1123 11:55:25.303000 8420 torch/distributed/elastic/multiprocessing/api.py:1028] Sending "
    b"process 8489 closing signal SIGTERM\n",
    b"E1123 11:55:25.523000 8420 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    b"(exitcode: 2) local_rank: 0 (pid: 8488) of binary: python\n",
    b"Traceback (most recent call last):\n",
    b'  File "torch/distributed/run.py", line 1142, in <module>\n',
    b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
    b"============================================================\n",
]


def filtered(raws: list[bytes], line: str | None) -> list[str]:
    """What trainer-launch's StderrFilter prints for torchrun's stderr `raws`, finished with
    the ranks' one line (or None: no rank left one)."""
    from trainer.launch import StderrFilter

    out = io.BytesIO()
    stream = io.TextIOWrapper(out, encoding="utf-8")
    f = StderrFilter(stream)
    for raw in raws:
        f.feed(raw)
    f.finish(line)
    stream.flush()
    return out.getvalue().decode().splitlines()


@pytest.mark.parametrize("message", [True, False])
def test_the_launchers_stderr_filter(message):
    raws = [
        b"epoch 1 step 3 loss 0.5\n",
        b"trainer: error: [rank 1] data.root: no such folder\n",
        b"trainer: error: data.root: no such folder\n",
        b"trainer: error: [rank 3] disk full on /tmp\n",
        *TORCHRUN_TAIL,
    ]
    lines = filtered(raws, "trainer: error: data.root: no such folder" if message else None)
    if message:  # the line last, once; a different rank's line kept; torchrun's report dropped
        assert lines == [
            "epoch 1 step 3 loss 0.5",
            "trainer: error: [rank 3] disk full on /tmp",
            "trainer: error: data.root: no such folder",
        ]
    else:  # no rank left a line (a crash): everything, nothing dropped
        assert len(lines) == 4 + len(TORCHRUN_TAIL) and lines[-1].startswith("=====")


TORCHRUN_SIGTERM = [
    b"W1125 07:06:52.492000 2280 torch/distributed/elastic/agent/server/api.py:753] Received 15 "
    b"death signal, shutting down workers\n",
    b"W1125 07:06:52.498000 2280 torch/distributed/elastic/multiprocessing/api.py:1028] Sending "
    b"process 2284 closing signal SIGTERM\n",
    b"[rank1]: a worker's own line while it saves\n",
    b"Traceback (most recent call last):\n",
    b'  File "<frozen runpy>", line 198, in _run_module_as_main\n',
    b'  File "torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run\n',
    b"    time.sleep(monitor_interval)\n",
    b"torch.distributed.elastic.multiprocessing.api.SignalException: Process 2280 got signal: 15\n",
]
"""What torchrun printed when trainer-launch forwarded a SIGTERM (the traceback shortened)."""


@pytest.mark.parametrize("message", [True, False])
def test_the_launchers_stderr_filter_after_a_sigterm(message):
    from tests.test_noise import NOISE

    stop = "trainer: stopped by SIGTERM at step 9; checkpoint step-9 saved: rerun ..."
    raws = [*NOISE, b"epoch 1 step 3 loss 0.5\n", *TORCHRUN_SIGTERM]
    lines = filtered(raws, stop if message else None)
    kept = ["epoch 1 step 3 loss 0.5", "[rank1]: a worker's own line while it saves"]
    if message:  # exit 3 with a checkpoint: the ranks' line, no SignalException traceback
        assert lines == [*kept, stop]
    else:  # no rank said why: torchrun's report is all there is, kept whole (c10d's noise not)
        assert lines[:3] == [*kept, TORCHRUN_SIGTERM[0].decode().strip()]
        assert lines[-1].startswith("torch.distributed.elastic.multiprocessing.api.Signal")
        assert len(lines) == 1 + len(TORCHRUN_SIGTERM)
    # The ranks printed nothing on stderr before (progress goes to stdout): the same
    silent = [raw for raw in TORCHRUN_SIGTERM if not raw.startswith(b"[rank1]")]
    assert filtered(silent, stop if message else None) == (
        [stop] if message else [raw.decode().rstrip() for raw in silent]
    )


def test_the_launchers_stderr_filter_shows_a_ranks_stop_line_once_and_last():
    # Rank 0 prints its stop line (exit 3: not an error) while torchrun stops: it is the node's
    # last line, once, after the workers' own output, without torchrun's traceback.
    stop = "trainer: stopped by SIGTERM at step 9; checkpoint step-9 saved: rerun ..."
    raws = [*TORCHRUN_SIGTERM[:3], f"{stop}\n".encode(), *TORCHRUN_SIGTERM[3:]]
    assert filtered(raws, stop) == ["[rank1]: a worker's own line while it saves", stop]


TORCHRUN_RENDEZVOUS = [
    b"Traceback (most recent call last):\n",
    b'  File "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 156, in '
    b"_create_tcp_store\n",
    b"    store = TCPStore(\n",
    b"            ^^^^^^^^^\n",
    b"torch.distributed.DistNetworkError: The client socket has timed out after 2000ms while "
    b"trying to connect to (10.0.0.9, 29500).\n",
    b"\n",
    b"The above exception was the direct cause of the following exception:\n",
    b"\n",
    b"Traceback (most recent call last):\n",
    b'  File "<frozen runpy>", line 198, in _run_module_as_main\n',
    b'  File "torch/distributed/launcher/api.py", line 346, in launch_agent\n',
    b"torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
    b"C10d store has failed. See inner exception for details.\n",
]
"""What torchrun printed on a node that could not reach node 0's store (the traceback shortened)."""


def launched(raws: list[bytes], host: str = "10.0.0.9", nnodes: str = "2") -> list[str]:
    """What trainer-launch prints for torchrun's stderr `raws` when torchrun failed and no rank
    left a line (run_child's ending)."""
    from trainer.launch.launcher import Rendezvous, StderrFilter, rendezvous_error

    out = io.BytesIO()
    stream = io.TextIOWrapper(out, encoding="utf-8")
    f = StderrFilter(stream)
    for raw in raws:
        f.feed(raw)
    f.close()
    meeting = Rendezvous(f"{host}:29500", host, nnodes, node_rank=1, join_timeout="600")
    f.finish(rendezvous_error(f.rendezvous, meeting) if f.rendezvous else None)
    stream.flush()
    return out.getvalue().decode().splitlines()


def test_a_node_that_cannot_reach_the_rendezvous_ends_in_one_line():
    from tests.test_noise import NOISE

    assert launched([*NOISE, *TORCHRUN_RENDEZVOUS]) == [
        "trainer-launch: error: node 1 cannot reach the rendezvous at 10.0.0.9:29500 (The client "
        "socket has timed out after 2000ms while trying to connect to (10.0.0.9, 29500).): check "
        "that node 0 is running and that MASTER_ADDR and MASTER_PORT name it (a firewall or "
        "NetworkPolicy must let this node reach that port)"
    ]
    # A name that does not resolve is named as such
    (line,) = launched(TORCHRUN_RENDEZVOUS, host="no-such-host.invalid")
    assert "MASTER_ADDR no-such-host.invalid does not resolve" in line, line
    # Node 0 waiting for the others: the join timeout and the ranks to start
    timeout = [
        *TORCHRUN_RENDEZVOUS[8:11],
        b"torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n",
    ]
    assert launched(timeout, host="127.0.0.1", nnodes="3") == [
        "trainer-launch: error: the rendezvous at 127.0.0.1:29500 did not gather 3 nodes within "
        "600 s: start every node (NODE_RANK 0 to 2) with the same MASTER_ADDR, MASTER_PORT and "
        "rendezvous id, or raise RDZV_JOIN_TIMEOUT"
    ]


def test_other_tracebacks_pass_whole_and_in_order():
    worker = [
        b"Traceback (most recent call last):\n",
        b'  File "my_script.py", line 3, in <module>\n',
        b"ValueError: bad\n",
    ]
    # A worker's own traceback before anything else was printed: printed whole at its last line
    assert launched([*worker, b"after\n"]) == [r.decode().rstrip() for r in [*worker, b"after\n"]]
    assert launched(worker) == [r.decode().rstrip() for r in worker]
    from trainer.launch import StderrFilter

    out = io.StringIO()
    live = StderrFilter(out)
    for raw in worker:
        live.feed(raw)
    assert out.getvalue().splitlines() == [r.decode().rstrip() for r in worker]  # not held on
    # Once something was printed, a rendezvous failure is nobody's to drop: kept whole
    raws = [b"epoch 1\n", *TORCHRUN_RENDEZVOUS]
    assert launched(raws) == [r.decode().rstrip() for r in raws]


C10D_BROKEN = [
    b"[W1129 20:35:47.564389439 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3, "
    b"addr=[::ffff:127.0.0.1]:43008, remote=[::ffff:127.0.0.1]:29561): Failed to recv, got 0 "
    b"bytes. Connection was likely closed. Did the remote server shutdown or crash?\n",
    b"Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp"
    b":790 (most recent call first):\n",
    b"frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f38ef15e60d in libc10.so)\n",
    b"<omitting python frames>\n",
    b"frame #20: <unknown function> + 0x891f5 (0x7f38f00a71f5 in libc.so.6)\n",
    b"\n",
]
"""c10d's C++ warning (and its backtrace) when the store node 0's torchrun hosted went away."""
TORCHRUN_LOST = [
    *C10D_BROKEN,
    b"W1129 20:35:47.451000 5800 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
    b"rendezvous/dynamic_rendezvous.py:1346] The node '127.0.0.1_5800_0' has failed to send a "
    b"keep-alive heartbeat to the rendezvous 'i1' due to an error of type "
    b"RendezvousConnectionError.\n",
    b"Traceback (most recent call last):\n",
    b'  File "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 114, in '
    b"_call_store\n",
    b"    return getattr(self._store, store_op)(*args, **kwargs)\n",
    b"torch.distributed.DistNetworkError: Broken pipe\n",
    b"\n",
    b"The above exception was the direct cause of the following exception:\n",
    b"\n",
    b"Traceback (most recent call last):\n",
    b'  File "torch/distributed/elastic/agent/server/api.py", line 959, in _invoke_run\n',
    b"    num_nodes_waiting = rdzv_handler.num_nodes_waiting()\n",
    b'  File "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 116, in '
    b"_call_store\n",
    b"torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
    b"C10d store has failed. See inner exception for details.\n",
]
"""What torchrun printed (~190 lines, shortened) on node 1 when node 0's torchrun ended while
node 1's ranks ran: its watch of the other nodes (num_nodes_waiting) lost node 0's store."""


def test_a_node_that_lost_its_rendezvous_host_while_running_ends_in_one_line():
    assert launched([b"epoch 1\n", *TORCHRUN_LOST]) == [
        "epoch 1",
        "trainer-launch: error: node 1 lost the rendezvous at 10.0.0.9:29500 while its ranks ran "
        "(Broken pipe): node 0 ended first; its log says why (a rank's error there ends the job), "
        "then start all nodes again (the job resumes from the last checkpoint)",
    ]
    # c10d's C++ warnings are held like torchrun's log lines: printed when something follows,
    # dropped when a rank's line explains the failure
    raws = [b"epoch 1\n", *C10D_BROKEN, b"epoch 2\n"]
    assert launched(raws) == [r.decode().rstrip("\n") for r in raws]
    from trainer.launch import StderrFilter

    out = io.StringIO()
    live = StderrFilter(out)
    for raw in [b"epoch 1\n", *C10D_BROKEN]:
        live.feed(raw)
    assert out.getvalue() == "epoch 1\n"
    live.finish("trainer: error: [rank 1] a collective failed")
    assert out.getvalue().splitlines() == [
        "epoch 1",
        "trainer: error: [rank 1] a collective failed",
    ]
    # A worker's traceback once something was printed passes as it comes, line by line
    out = io.StringIO()
    live = StderrFilter(out)
    live.feed(b"epoch 1\n")
    live.feed(b"Traceback (most recent call last):\n")
    assert out.getvalue().splitlines() == ["epoch 1", "Traceback (most recent call last):"]


@pytest.mark.slow
def test_trainer_launch_on_a_node_without_its_rendezvous_exits_4_in_one_line(tmp_path):
    from tests.helpers import free_port

    port = free_port()  # nothing listens there: node 0 never started
    extra = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NODE_RANK="1")
    last = _unreachable_exits_4(tmp_path, RDZV_JOIN_TIMEOUT="2", **extra)
    assert last.startswith(
        f"trainer-launch: error: node 1 cannot reach the rendezvous at 127.0.0.1:{port} ("
    ), last


def _unreachable_exits_4(tmp_path, **extra) -> str:
    """trainer-launch of one process a node with `extra` in its environment, whose rendezvous
    cannot be reached: exit 4, no traceback, no run folder; its last line."""
    p = subprocess.run(
        [str(BIN / "trainer-launch"), f"run_dir={tmp_path}/run"],
        env=env(NPROC_PER_NODE="1", **extra),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 4, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "run").exists(), p.stderr
    return p.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_trainer_launch_without_its_etcd_exits_4_in_one_line(tmp_path):
    """The etcd rendezvous' failure to connect is chained under the etcd client's and urllib3's
    own tracebacks; it still ends in one line naming the etcd and the fix, exit 4."""
    from tests.helpers import free_port

    port = free_port()  # no etcd listens there
    extra = dict(NNODES="1:2", RDZV_BACKEND="etcd", RDZV_ENDPOINT=f"127.0.0.1:{port}")
    last = _unreachable_exits_4(tmp_path, RDZV_ID="no-etcd", **extra)
    assert last.startswith(
        f"trainer-launch: error: this node cannot reach the etcd rendezvous at 127.0.0.1:{port} ("
    ), last
    assert "etcd --enable-v2" in last and "RDZV_ENDPOINT" in last, last
