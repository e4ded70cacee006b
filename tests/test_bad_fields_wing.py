"""Bad values of the last wave's config fields, refused where the config is parsed (issue 55
item 1, issue 56 item 19): `trainer config check` refuses everything `train --dry-run` would.

A table of cases generated per sub-area, run by tests/badwing.py's harness in this process, each
through `config check` and `train --dry-run` where the key is the config's:

- dist.mesh strings x bad forms (digits that are not ASCII, zero, empty items, unknown or
  repeated dimensions, sizes past any job): the grammar, whatever the world size;
- ckpt.init_rename rules x bad regexes, replacement templates (a group the regex lacks, a bad
  escape) and types (text, a number, a list where a mapping goes; a list as a replacement);
- optim.groups specs x bad members (params that are not patterns, lr_mult and weight_decay that
  are not finite or out of optim.lr's and optim.weight_decay's ranges, unknown keys, shapes);
- glob keys (optim.freeze, optim.lora_*, ckpt.init_exclude) x what YAML does to a leading `*`
  and other shapes: the line says to quote, with a real value to copy;
- log.mlflow.uri x bad forms (scheme, host, port, an unclosed IPv6 '[') and $MLFLOW_TRACKING_URI;
- log.wandb.mode=online x missing credentials (no WANDB_API_KEY, no netrc entry for the host);
- optimizer plug-ins (tests/bad_optim_plugins.py) x broken returns (`train --dry-run`: config
  check does not import plug-ins).

Valid neighbours of the bad values (`runs=` cases) still pass, and unit tests below pin the pure
checks (check_mesh, check_rename, a group, a tracking URI, where W&B's credentials are found),
that a plug-in's own bug keeps its traceback after one line naming it, and that `config check`
runs the tracking checks without importing torch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.badwing import WingCase, check, good_run
from tests.helpers import ROOT
from tests.test_bad_input import run_in_process
from trainer.config import load
from trainer.config.schema import _check_group, check_mesh, check_rename, check_tracking_uri
from trainer.errors import UsageError

BASE = (
    "data.name=tests.helpers:tiny",
    "model.name=tests.helpers:tiny_model",
    "data.global_batch_size=4",
    "log.tensorboard=false",
    "log.progress=none",
)
"""The tiny data and MLP (parameters 1.weight, 1.bias, 3.weight, 3.bias): a dry run of it takes
a fraction of a second, so each bad value is the one thing wrong."""

CHECK = ("config", "check")
DRY = ("train", "--dry-run")


def _both(area: str, args: tuple[str, ...], names: str, *, env=(), runs="", world=2):
    """The case through `config check --world-size=N` and `train --dry-run` (world 1)."""
    return [
        WingCase(area, (*CHECK, f"--world-size={world}", *BASE, *args), names, env=env, runs=runs),
        WingCase(area, (*DRY, *BASE, "run_dir=dry", *args), names, env=env, runs=runs),
    ]


# --- dist.mesh -----------------------------------------------------------------------------------

MESH_BAD = [
    # (dist.mesh, what the line says is wrong with it)
    ("pp=²", "pp's size '²' is not a whole number in digits 0-9"),  # int() takes it: a traceback
    ("pp=٣", "is not a whole number in digits 0-9"),  # an Arabic-Indic three
    ("tp=¹", "is not a whole number in digits 0-9"),
    ("dp=٢,pp=1", "dp's size '٢' is not a whole number"),
    ("dp=0", "dp=0: a size is at least 1"),
    ("pp=0", "pp=0: a size is at least 1"),
    ("pp=00", "pp=00: a size is at least 1"),
    ("pp=-1", "pp's size '-1' is not a whole number"),
    ("pp=1.5", "pp's size '1.5' is not a whole number"),
    ("pp=2e1", "pp's size '2e1' is not a whole number"),
    ("pp=", "pp has no size"),
    ("=2", "'=2' names no dimension"),
    ("pp", "'pp' has no '=SIZE'"),
    ("xp=2", "'xp' is not a dimension"),
    ("dpp=2", "'dpp' is not a dimension (did you mean 'pp'?)"),
    ("pp=2,pp=2", "pp is given twice"),
    ("pp=2,,tp=1", "an empty item (two commas, or one at an end)"),
    ("pp=2,", "an empty item (two commas, or one at an end)"),
    ("pp:2", "'pp:2' has no '=SIZE'"),
    ("pp=2;tp=1", "pp's size '2;tp=1' is not a whole number"),
    ("pp=99999999", "pp=99999999 is over 1,048,576"),
    ("pp=" + "9" * 5000, "(5,000 characters) is over 1,048,576"),  # past int()'s 4,300 digits
]


def mesh_cases() -> list[WingCase]:
    return [c for m, says in MESH_BAD for c in _both("dist.mesh", (f"dist.mesh={m}",), says)]


# --- ckpt.init_rename ------------------------------------------------------------------------------

MAPPING = "takes a mapping {REGEX: REPLACEMENT}"
RENAME_BAD = [
    # (ckpt.init_rename, what the line says)
    (r"{'^(\d+)\.': '\9.'}", "invalid group reference 9; the regex has 1 group): use \\1"),
    (r"{'^a': '\g<x>'}", "unknown group name 'x'; the regex has 0 groups): add a group"),
    (r"{'^(?P<n>a)': '\g<m>'}", "unknown group name 'm'; the regex has 1 group (n named)"),
    (r"{'^a': '\q'}", "has a bad escape \\q: a replacement knows \\1, \\g<name>"),
    (r"{'a': '\g<1'}", "is not a replacement for it (missing >, unterminated name"),
    (r"{'(': x}", "'(' is not a regex (missing ), unterminated subpattern"),
    (r"{'a{1,2': x, '[': y}", "'[' is not a regex (unterminated character set"),
    ("{'': x}", "an empty regex matches between every two characters"),
    ("{a: [1]}", "the replacement of 'a' is a list, not text"),  # accepted before
    ("{a: {b: 1}}", "the replacement of 'a' is a mapping, not text"),
    ("abc", f"{MAPPING}, not the text 'abc'"),  # OmegaConf's "Cannot assign" before
    ("5", f"{MAPPING}, not the number 5"),
    ("[a]", f"{MAPPING}, not a list"),
]


def rename_cases() -> list[WingCase]:
    cases = []
    for rule, says in RENAME_BAD:
        cases += _both("ckpt.init_rename", (f"ckpt.init_rename={rule}",), says)
    cases += _both(
        "ckpt.init_rename", ("ckpt.init_rename.a=null",), "ckpt.init_rename.a: needs a replacement"
    )
    ok = r"ckpt.init_rename={'^(\d+)\.': 'layer\1.', '^(?P<k>x)': '\g<k>'}"
    cases += _both("ckpt.init_rename", (ok,), "", runs="groups the regexes have")
    return cases


# --- optim.groups --------------------------------------------------------------------------------

TEXT = "params: glob patterns are text"
FINITE = "needs a finite number"
A_GROUP = "a group is a mapping of params (glob patterns), lr_mult and weight_decay"
GROUP_BAD = [
    # (optim.groups.head, what the line says)
    ("{params: 5}", f"{TEXT} ('fc.*,head.*' or [fc.*, head.*]), got an int 5"),  # a traceback
    ("{params: [3.*, 5]}", f"{TEXT} ('fc.*,head.*' or [fc.*, head.*]), got an int 5"),
    ("{params: {x: 1}}", f"{TEXT} ('fc.*,head.*' or [fc.*, head.*]), got a mapping"),
    ("{params: ''}", "needs params, the glob patterns of its parameters"),
    ("{params: ','}", "params: ',' holds no pattern"),
    ("{params: null}", "needs params, the glob patterns of its parameters"),
    ("{lr_mult: 2}", "needs params, the glob patterns of its parameters"),
    ("{params: '3.*', weight_decay: 1e9}", "weight_decay: must be >= 0 and <= 10"),  # loss 1e14
    ("{params: '3.*', weight_decay: -0.1}", "weight_decay: must be >= 0 and <= 10"),
    ("{params: '3.*', weight_decay: .nan}", f"weight_decay: {FINITE}, got nan"),
    ("{params: '3.*', lr_mult: .nan}", f"lr_mult: {FINITE}, got nan"),  # "diverged" at step 3
    ("{params: '3.*', lr_mult: .inf}", f"lr_mult: {FINITE}, got inf"),
    ("{params: '3.*', lr_mult: -.inf}", f"lr_mult: {FINITE}, got -inf"),
    ("{params: '3.*', lr_mult: 1e400}", f"lr_mult: {FINITE}, got inf"),
    ("{params: '3.*', lr_mult: -1}", "optim.lr x lr_mult must be > 0 and <= 10"),
    ("{params: '3.*', lr_mult: 0}", "0 trains nothing: freeze them with optim.freeze"),
    ("{params: '3.*', lr_mult: 1e5}", "optim.lr x lr_mult must be > 0 and <= 10 (optim.lr=0.001)"),
    ("{params: '3.*', lr_mult: '10'}", f"lr_mult: {FINITE}, got '10'"),
    ("{params: '3.*', lr_mult: true}", f"lr_mult: {FINITE}, got True"),
    ("{params: '3.*', lr_mult: [1]}", f"lr_mult: {FINITE}, got [1]"),
    ("{params: '3.*', momentum: 0.5}", "momentum: unknown; a group has params, lr_mult"),
    ("5", f"{A_GROUP}, not an int"),
    ("[1]", f"{A_GROUP}, not a list"),
    ("abc", f"{A_GROUP}, not a string"),
]
NAMED = "takes named groups, optim.groups.NAME={params: [GLOB, ...], lr_mult: N}"


def group_cases() -> list[WingCase]:
    cases = []
    for spec, says in GROUP_BAD:
        cases += _both("optim.groups", (f"optim.groups.head={spec}",), says)
    for whole, given in (("5", "the number 5"), ("[1]", "a list"), ("abc", "the text 'abc'")):
        cases += _both("optim.groups", (f"optim.groups={whole}",), f"{NAMED}, not {given}")
    ok = "optim.groups.head={params: [3.*], lr_mult: 10, weight_decay: 0.0}"
    cases += _both("optim.groups", (ok, "optim.lr=0.01"), "", runs="a group in range")
    return cases


# --- glob keys -----------------------------------------------------------------------------------

QUOTE = "quote the value, YAML's quotes inside the shell's, e.g. "
ONE_STRING = "takes comma-separated glob patterns in one string, not"
GLOB_BAD = [
    # (key, value, what the line says)
    ("optim.freeze", "*", f"{QUOTE}\"optim.freeze='*'\""),  # "cannot parse" alone before
    ("optim.freeze", "*.bias", f"{QUOTE}\"optim.freeze='*.bias'\""),
    ("optim.freeze", "[*.bias]", f"{QUOTE}\"optim.freeze='*.bias'\""),
    ("optim.freeze", "*weight", f"{QUOTE}\"optim.freeze='*weight'\""),  # an undefined alias
    ("optim.freeze", "&x", "optim.freeze: '&x' is null: YAML reads a leading '&' as an anchor"),
    ("optim.freeze", "[1.*, 3.*]", f"{ONE_STRING} a list: e.g. optim.freeze='tok.*,blocks.0.*'"),
    ("optim.freeze", "{a: 1}", f"{ONE_STRING} a mapping: e.g. optim.freeze="),
    ("optim.freeze", "", "e.g. optim.freeze='tok.*,blocks.0.*', or leave optim.freeze out"),
    ("optim.lora_targets", "", "e.g. optim.lora_targets='blocks.*.attn.qkv'"),  # "e.g. ...=" before
    ("optim.lora_targets", "*.qkv", f"{QUOTE}\"optim.lora_targets='*.qkv'\""),
    ("optim.lora_also_train", "*", f"{QUOTE}\"optim.lora_also_train='*'\""),
    ("optim.lora_also_train", "[fc.*]", f"{ONE_STRING} a list: e.g. optim.lora_also_train='fc3.*'"),
    ("ckpt.init_exclude", "*.bias", f"{QUOTE}\"ckpt.init_exclude='*.bias'\""),
    ("ckpt.init_exclude", "", "e.g. ckpt.init_exclude='fc.*', or leave ckpt.init_exclude out"),
]


def glob_cases() -> list[WingCase]:
    cases = []
    for key, value, says in GLOB_BAD:
        cases += _both("globs", (f"{key}={value}",), says)
    cases += _both("globs", ("optim.freeze='*.bias'",), "", runs="YAML's quotes inside")
    cases += _both("globs", ("optim.freeze=1.*,*.bias",), "", runs="'*' not leading")
    return cases


# --- log.mlflow.uri ------------------------------------------------------------------------------

URI_BAD = [
    "http://[::1",  # Invalid IPv6 URL: a traceback before
    "http://[::1]:99999",
    "http://127.0.0.1:notaport",  # accepted at start before
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://127.0.0.1:",
    "http://127.0.0.1:-1",
    "127.0.0.1:5000",  # `config check` said ok, `train` refused
    "localhost",
    "ftp://h",
    "sqlite:///m.db",
    "http://",
    "http:///path",
    "http://:5000",
    "http://ho st:5000",
    "http://u:secret@h:5000",
]


def uri_cases() -> list[WingCase]:
    cases = []
    for uri in URI_BAD:
        cases += _both("log.mlflow.uri", (f"log.mlflow.uri={uri}",), "log.mlflow.uri")
    for uri in ("http://[::1", "http://h:99999", "h:5000"):  # the URI from the environment
        env = (("MLFLOW_TRACKING_URI", uri),)
        cases += _both("log.mlflow.uri", ("log.mlflow.uri=env",), "MLFLOW_TRACKING_URI", env=env)
    for uri in ("http://127.0.0.1:5000", "https://mlflow.example.com/", "http://[::1]:5000"):
        cases += _both("log.mlflow.uri", (f"log.mlflow.uri={uri}",), "", runs="a server's URI")
    return cases


# --- log.wandb.mode=online -------------------------------------------------------------------------


def wandb_cases(folder) -> list[WingCase]:
    """`online` without an API key anywhere wandb would look (folder: netrc files, settings)."""
    if importlib.util.find_spec("wandb") is None:
        return []
    nothing = (
        ("WANDB_API_KEY", ""),
        ("WANDB_IDENTITY_TOKEN_FILE", ""),
        ("NETRC", str(folder / "no-netrc")),
        ("WANDB_CONFIG_DIR", str(folder / "no-settings")),
        ("WANDB_BASE_URL", ""),
    )
    netrc = ("NETRC", str(folder / "netrc"))  # an entry for api.wandb.ai
    no_password = ("NETRC", str(folder / "netrc-no-password"))
    other_host = (("WANDB_BASE_URL", "https://wandb.example.com"), netrc)
    key = ("WANDB_API_KEY", "x" * 40)
    online = ("log.wandb.mode=online", "log.wandb.project=p")
    cases = []
    for env in (nothing, _env(nothing, no_password), _env(nothing, *other_host)):
        cases += _both("log.wandb.mode", online, "log.wandb.mode=online", env=env)
    cases += _both("log.wandb.mode", online, "", env=_env(nothing, key), runs="WANDB_API_KEY")
    cases += _both("log.wandb.mode", online, "", env=_env(nothing, netrc), runs="netrc's key")
    offline = ("log.wandb.mode=offline", "log.wandb.project=p")
    cases += _both("log.wandb.mode", offline, "", env=nothing, runs="offline needs no key")
    return cases


def _env(base: tuple, *pairs: tuple[str, str]) -> tuple:
    out = dict(base)
    out.update(dict(pairs))
    return tuple(out.items())


# --- optimizer plug-ins --------------------------------------------------------------------------

OP = "tests.bad_optim_plugins"
OPTIM_BAD = [
    ("returns_none", "returned None (is a `return` missing?)"),
    ("returns_class", "returned the class SGD, not an optimizer"),
    ("returns_list", "returned a list, not a torch.optim.Optimizer"),
    ("returns_scheduler", "returned a LambdaLR, not a torch.optim.Optimizer"),
    ("returns_state_dict", "returned a dict, not a torch.optim.Optimizer"),
    ("returns_function", "returned a function, not a torch.optim.Optimizer"),
    ("returns_generator", "returned a generator, not a torch.optim.Optimizer"),
    ("over_other_tensors", "leaves out 4 of the 4 parameters it was given"),
    ("over_first_parameter", "leaves out 3 of the 4 parameters it was given"),
    ("over_extra_tensor", "holds 1 tensor(s) it was not given"),
    ("no_lr", "group 0 has no numeric 'lr'"),
    ("raises_usage_error", "raises_usage_error: this optimizer needs optim.kwargs.beta2"),
    ("type_error_inside", "type_error_inside' failed: TypeError"),
    ("needs_an_argument", "missing a required argument: 'rho'"),
    ("NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
    ("missing", "has no callable 'missing'"),
]


def optim_cases() -> list[WingCase]:
    dry = (*DRY, *BASE, "run_dir=dry")
    cases = [
        WingCase("optim plug-in", (*dry, f"optim.name={OP}:{name}"), says)
        for name, says in OPTIM_BAD
    ]
    groups = ("optim.groups.head={params: [3.*], lr_mult: 10}", "optim.decay=no_bias_norm")
    first = f"optim.name={OP}:over_first_parameter"
    return [
        *cases,
        WingCase("optim plug-in", (*dry, first, *groups), "leaves out 3 of the 4 parameters"),
        WingCase("optim plug-in", (*dry, f"optim.name={OP}:good"), "", runs="SGD over params"),
        WingCase(
            "optim plug-in", (*dry, f"optim.name={OP}:good", *groups), "", runs="over the groups"
        ),
    ]


# --- the table -----------------------------------------------------------------------------------


@pytest.fixture
def wing_env(monkeypatch, tmp_path):
    """No torchrun or tracking variables from the test runner; no GPU; a folder of netrc files
    (one with an entry for api.wandb.ai, one whose entry has no key)."""
    from trainer.exitstatus import STATUS_DIR_ENV
    from trainer.ranks import TORCHRUN_VARS

    for name in (*TORCHRUN_VARS, STATUS_DIR_ENV, "MLFLOW_TRACKING_URI", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40)
    (tmp_path / "netrc-no-password").write_text("machine api.wandb.ai\n  login user\n")
    (tmp_path / "netrc").chmod(0o600)
    return tmp_path


def all_cases(folder) -> list[WingCase]:
    return [
        *mesh_cases(),
        *rename_cases(),
        *group_cases(),
        *glob_cases(),
        *uri_cases(),
        *wandb_cases(folder),
        *optim_cases(),
    ]


def test_bad_fields_of_the_wing_are_one_line_each(wing_env, tmp_path_factory):
    cases = all_cases(wing_env)
    assert len(cases) >= 200
    check(cases, good_run(tmp_path_factory))
    assert not (wing_env / "dry").exists()  # no dry run left a folder


def test_the_table_covers_every_mesh_dimension_and_group_key():
    from trainer.config.schema import GROUP_KEYS
    from trainer.parallel.layout import DIMS

    assert {m.partition("=")[0] for m, _ in MESH_BAD} >= set(DIMS)
    assert {k for spec, _ in GROUP_BAD for k in GROUP_KEYS if k in spec} == set(GROUP_KEYS)


# --- the pure checks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh, says",
    [
        ("pp=²", "pp's size '²' is not a whole number in digits 0-9"),
        ("pp=0", "pp=0: a size is at least 1"),
        ("pp=2,pp=2", "pp is given twice"),
        ("dpp=2", "'dpp' is not a dimension (did you mean 'pp'?)"),
        ("pp=2,", "an empty item"),
        ("pp", "'pp' has no '=SIZE'"),
        ("pp=", "pp has no size"),
        ("=2", "'=2' names no dimension"),
        ("tp=" + "9" * 5000, "is over 1,048,576"),
    ],
)
def test_check_mesh_names_the_item_and_the_form(mesh, says):
    with pytest.raises(UsageError) as e:
        check_mesh(mesh)
    assert says in str(e.value) and "dist.mesh=dp=2,pp=2" in str(e.value)


@pytest.mark.parametrize("mesh", [None, "", "  ", "dp=2", "pp=2, tp=2", "dp=1,pp=2,tp=4"])
def test_check_mesh_takes_the_grammar(mesh):
    check_mesh(mesh)


@pytest.mark.parametrize(
    "pattern, replacement, says",
    [
        (r"^(\d+)\.", r"\9.", r"refers to a group it lacks (invalid group reference 9; the regex"),
        (r"^(\d+)\.", r"\2", r"has 1 group): use \1"),
        (r"^(a)(b)", r"\3", r"use \1 to \2"),
        ("^a", r"\1", "add a group (...) to the regex"),
        ("^a", r"\g<x>", "unknown group name 'x'"),
        ("^a", r"\q", r"bad escape \q"),
        ("(", "x", "'(' is not a regex (missing ), unterminated subpattern"),
        ("", "x", "an empty regex"),
        ("a", ["x"], "the replacement of 'a' is a list, not text"),
    ],
)
def test_check_rename_names_the_rule_and_what_is_wrong(pattern, replacement, says):
    with pytest.raises(UsageError) as e:
        check_rename(pattern, replacement)
    assert str(e.value).startswith("ckpt.init_rename: ") and says in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "group, says",
    [
        ({"params": "3.*", "lr_mult": float("nan")}, "lr_mult: needs a finite number, got nan"),
        ({"params": "3.*", "lr_mult": 10**400}, "lr_mult: needs a finite number"),
        ({"params": "3.*", "lr_mult": 20_000}, "optim.lr x lr_mult must be > 0 and <= 10"),
        ({"params": "3.*", "lr_mult": 0}, "0 trains nothing: freeze them with optim.freeze"),
        ({"params": "3.*", "weight_decay": 1e9}, "weight_decay: must be >= 0 and <= 10"),
        ({"params": ["3.*", 5]}, "params: glob patterns are text"),
        ({"params": " , "}, "holds no pattern"),
        ([1], "a group is a mapping of params"),
    ],
)
def test_a_group_takes_the_top_level_ranges(group, says):
    with pytest.raises(UsageError) as e:
        _check_group("head", group, 1e-3)
    assert str(e.value).startswith("optim.groups.head") and says in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "uri, says",
    [
        ("http://[::1", "is not a URL (an IPv6 address opened with '[' and not closed with ']')"),
        ("http://h:notaport", "is not a URL (its port is not a number)"),
        ("http://h:70000", "is not a URL (its port is past 65535)"),
        ("http://h:0", "the port is empty or 0"),
        ("http://:5000", "has no host"),
        ("http://h\t:5000", "a space or control character"),
        ("h:5000", "(did you mean http://h:5000?)"),
        ("localhost", "has no scheme"),
    ],
)
def test_a_tracking_uri_is_checked_without_a_network(uri, says):
    with pytest.raises(UsageError) as e:
        check_tracking_uri("log.mlflow.uri", uri)
    assert says in str(e.value), str(e.value)


def test_wandb_credentials_are_looked_for_where_wandb_looks(tmp_path):
    from trainer.tracking.tracker import wandb_credentials

    none = {"NETRC": str(tmp_path / "none"), "WANDB_CONFIG_DIR": str(tmp_path / "none")}
    assert wandb_credentials(none) is None
    assert wandb_credentials({**none, "WANDB_API_KEY": "k"}) == "WANDB_API_KEY"
    assert wandb_credentials({**none, "WANDB_API_KEY": " "}) is None
    (tmp_path / "netrc").write_text("machine w.example.com login u password k\n")
    netrc = {**none, "NETRC": str(tmp_path / "netrc")}
    assert wandb_credentials(netrc) is None  # an entry for another host
    assert wandb_credentials({**netrc, "WANDB_BASE_URL": "https://w.example.com"}) == str(
        tmp_path / "netrc"
    )
    (tmp_path / "settings").mkdir()
    (tmp_path / "settings" / "settings").write_text("[default]\napi_key = k\n")
    with_settings = {**none, "WANDB_CONFIG_DIR": str(tmp_path / "settings")}
    assert wandb_credentials(with_settings) == str(tmp_path / "settings" / "settings")


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["optim.lora_targets="], "e.g. optim.lora_targets='blocks.*.attn.qkv'"),
        (["ckpt.init_rename=abc"], r"not the text 'abc': write e.g. ckpt.init_rename='{^encoder"),
        (["optim.groups=5"], "not the number 5: write e.g. optim.groups.head='{params: [fc.*]"),
        (["optim.freeze=*.bias"], "quote the value, YAML's quotes inside the shell's, e.g. "),
    ],
)
def test_each_line_shows_a_value_to_copy(overrides, says):
    with pytest.raises(UsageError) as e:
        load(None, overrides)
    assert says in str(e.value), str(e.value)
    if "*.bias" in overrides[0]:
        assert str(e.value).endswith("e.g. \"optim.freeze='*.bias'\"")
        assert load(None, ["optim.freeze='*.bias'"]).optim.freeze == "*.bias"


def test_an_optimizer_plugins_own_bug_keeps_its_traceback_after_one_line_naming_it(wing_env):
    name = f"{OP}:raises_runtime_error"
    o = run_in_process((*DRY, *BASE, "run_dir=dry", f"optim.name={name}"))
    lines = o.stderr.strip().splitlines()
    assert o.code == 1, o.stderr[-2000:]
    first = next(i for i, line in enumerate(lines) if line.startswith("trainer: error:"))
    assert name in lines[first] and "bad_optim_plugins.py:" in lines[first], lines[first]
    assert "a bug in the plug-in" in lines[first]
    assert lines[first + 1].startswith("Traceback")  # ours first, then the traceback
    assert lines[-1] == "RuntimeError: bad_optim_plugins: the optimizer's own bug"


def test_config_check_runs_the_tracking_checks_without_importing_torch():
    """Issue 56 item 19: `trainer config check` skipped the tracking checks, because importing
    them imported torch; now it makes them, and torch stays out of the process."""
    code = (
        "import sys\n"
        "from trainer import cli\n"
        "bad = cli.main(['config', 'check', 'log.mlflow.uri=h:5000'])\n"
        "ok = cli.main(['config', 'check', 'log.mlflow.uri=http://h:5000'])\n"
        "assert (bad, ok) == (2, 0), (bad, ok)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI",)}
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert p.returncode == 0, p.stderr
    assert "did you mean http://h:5000?" in p.stderr
