"""Issue 55, area E: bad meshes, tensor-parallel plans and pipeline split points through the real
CLI, each one line and exit 2 before any rank starts work (tests/badwing.py's harness: no
traceback, no hang, a good run's files unchanged).

The tables, generated from small lists:

- meshes x world sizes x models, through `trainer config check --world-size=N` (the layout's
  rules without building the model: the product, the strategy, a built-in model without split
  points or plan, the GPT's blocks against the stages) and `train --dry-run` on one process;
- tensor-parallel plans (tests/bad_mesh_plugins.py: keys, styles, widths) x meshes, and
  pipeline split points x meshes, through `trainer plan --world-size=N`, which lays every rank
  out in this process over a fake process group with the code a run uses
  (trainer/parallel/apply.py), so the checks every rank makes at build run here in 0.1 s.

A plug-in's own bug (it raises) keeps its traceback after one line naming it: its own test.
"""

from __future__ import annotations

import pytest

from tests.badwing import WingCase, check, good_run
from tests.test_bad_input import run_in_process

PLUG = "tests.bad_mesh_plugins"
TINY = ("data.name=tests.helpers:tiny", "data.global_batch_size=4", "log.tensorboard=false")
GPT = (
    "model.name=gpt",
    "data.name=text",
    "model.gpt.layers=2",
    "model.gpt.width=32",
    "model.gpt.heads=2",
    "data.text.seq_len=32",
    "data.global_batch_size=8",
)
MODELS = {"gpt": GPT, "mlp": (), "plug-in": (f"model.name={PLUG}:good", *TINY)}
"""The models every mesh is tried with: the built-in GPT (2 blocks, 2 heads), the default
preset's MLP and a plug-in model with both split points and a plan."""


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return good_run(tmp_path_factory)


def _check_config(world: int, *args: str) -> tuple[str, ...]:
    return ("config", "check", f"--world-size={world}", *args)


# --- meshes x world sizes x models: config check --world-size, train --dry-run ------------------

PRODUCTS = [
    ("pp=3", 2, "does not divide the 2 ranks"),
    ("pp=4", 2, "does not divide the 2 ranks"),
    ("dp=2,pp=2", 2, "dp x pp x tp = 4, but 2 rank(s)"),
    ("dp=3", 2, "dp x pp x tp = 3"),
    ("tp=2", 3, "does not divide the 3 ranks"),
    ("dp=1,tp=2", 4, "dp x pp x tp = 2, but 4 rank(s)"),
    ("pp=²", 2, "dist.mesh"),
    ("tp=٢", 2, "dist.mesh"),
    ("pp=" + "9" * 5000, 2, "dist.mesh"),
]
"""A mesh whose degrees the world cannot hold (or cannot be read): the same for every model."""

NO_SPLIT = [(f"model.name={m}", ()) for m in ("mlp", "lenet", "resnet18", "vgg11")]
"""Built-in models without pipeline split points or a tensor-parallel plan."""

GPT_STAGES = [
    ("pp=4", 4, ()),
    ("pp=4", 8, ()),
    ("pp=3", 3, ()),
    ("pp=2", 2, ("dist.pp_schedule=interleaved-1f1b",)),
    ("dp=2,pp=2", 4, ("dist.pp_schedule=interleaved-1f1b",)),
    ("pp=2", 2, ("model.gpt.layers=3",)),
]
"""Pipeline stages that the GPT's blocks (model.gpt.layers=2 unless given) cannot split."""

STRATEGIES = [
    ("pp=2", 2, "dist.strategy=dp", "dist.strategy=dp"),
    ("dp=2,tp=2", 4, "dist.strategy=ddp", "dist.strategy=fsdp"),
    ("dp=2,pp=2", 4, "dist.strategy=none", "dist.strategy=none"),
    ("tp=2", 2, "train.compile=true", "train.compile"),
    ("tp=2", 2, "repro.world_invariant=true", "repro.world_invariant"),
    ("pp=2", 2, "model.sync_bn=true", "model.sync_bn"),
]
"""A mesh with a strategy or setting it does not compose with (on the GPT)."""

RUNS = [
    ("gpt", "pp=2", 2, "2 blocks split into 2 stages"),
    ("gpt", "dp=2,pp=2", 4, "2 blocks, 2 stages, 2 replicas"),
    ("gpt", "tp=2", 2, "2 heads over 2 ranks"),
    ("plug-in", "pp=2", 2, "a plug-in's split points are checked when it is built"),
    ("plug-in", "tp=2", 2, "a plug-in's plan is checked when it is built"),
]


def mesh_cases() -> list[WingCase]:
    cases = [
        WingCase("mesh product", _check_config(world, *args, f"dist.mesh={mesh}"), names)
        for mesh, world, names in PRODUCTS
        for args in MODELS.values()
    ]
    cases += [
        WingCase("mesh model", _check_config(2, *args, name, f"dist.mesh={mesh}"), name)
        for name, args in NO_SPLIT
        for mesh in ("pp=2", "tp=2")
    ]
    cases += [
        WingCase("gpt stages", _check_config(world, *GPT, *extra, f"dist.mesh={mesh}"), "layers")
        for mesh, world, extra in GPT_STAGES
    ]
    cases += [
        WingCase("mesh strategy", _check_config(w, *GPT, setting, f"dist.mesh={mesh}"), names)
        for mesh, w, setting, names in STRATEGIES
    ]
    cases += [
        WingCase("mesh ok", _check_config(world, *MODELS[m], f"dist.mesh={mesh}"), "", runs=why)
        for m, mesh, world, why in RUNS
    ]
    # one process (no torchrun): a mesh that needs more ranks is refused before any work
    cases += [
        WingCase("mesh train", ("train", "--dry-run", *args, f"dist.mesh={mesh}"), "dist.mesh")
        for mesh in ("pp=2", "tp=2", "dp=1,pp=2,tp=2")
        for args in MODELS.values()
    ]
    return cases


def test_bad_meshes_are_one_line_before_any_rank_starts(good):
    assert check(mesh_cases(), good) >= 60


# --- tensor-parallel plans and pipeline split points: trainer plan --world-size=N ---------------

PLANS = [
    ("odd_width", "'layers.*.fc1' splits layers.0.fc1 (Linear, 15 output features)"),
    ("odd_rows", "'layers.*.fc2' splits layers.0.fc2 (Linear, 15 input features)"),
    ("fused_odd", "(3 fused parts, each split)"),
    ("embed_odd", "'lookup' splits lookup (Embedding, 5 dims) by columns over tp="),
    ("key_misspelt", "the key 'layers.*.fc3' names no module"),
    ("key_other_model", "the key 'blocks.*.attn.qkv' names no module"),
    ("key_too_deep", "a parameter's name: key its module, 'layers.*.fc1'"),
    ("key_not_a_string", "the key 0 (of type int) is not a module name"),
    ("style_class", "'layers.*.fc1' maps to the class ColwiseParallel, not a style"),
    ("style_string", "'layers.*.fc1' maps to 'colwise' (a str), which is not a ParallelStyle"),
    ("style_none", "maps to None (a NoneType), which is not a ParallelStyle"),
    ("style_module", "(a Linear), which is not a ParallelStyle"),
    ("named_twice", "both split layers.0.fc1"),
    ("not_a_linear", "gives layers.0 (Block) ColwiseParallel"),
    ("root_style", "gives the model (Net) RowwiseParallel"),
    ("plan_list", "tensor_parallel_plan(2) returned list"),
    ("plan_empty", "tensor_parallel_plan(2) returned an empty dict"),
    ("plan_none", "tensor_parallel_plan(2) returned NoneType"),
    ("plan_attribute", "PlanAttribute has none: give it a tensor_parallel_plan(tp) method"),
    ("plan_refuses", "PlanRefuses: tp=2 needs a width of 16"),
    ("tests.helpers:tiny_model", "Sequential has none: give it a tensor_parallel_plan(tp)"),
]
"""A plan plug-in that breaks one rule: what the one line must say (tp=2 in every mesh)."""

TP_MESHES = [("tp=2", 2), ("pp=2,tp=2", 4)]
"""tp alone, and with pp: the plan is checked on the whole model before the split."""

SPLITS = [
    ("layers_module", "pipeline_layers() returned the ModuleList itself, not its name"),
    ("layers_none", "pipeline_layers() returned NoneType"),
    ("layers_int", "pipeline_layers() returned int"),
    ("layers_misspelt", "returned 'layer', not a submodule of SplitNet (did you mean 'layers'?)"),
    ("layers_missing", "returned 'blocks', not a submodule of SplitNet"),
    ("layers_dotted", "returned 'layers.0', not a submodule"),
    ("layers_not_a_list", "names 'head', a Linear, not an nn.ModuleList"),
    ("layers_plain_list", "returned 'blocks', a list attribute, not a registered submodule"),
    ("layers_empty", "names 'layers', an empty ModuleList"),
    ("root_parameter", "RootParameter holds parameters on its root (scale)"),
    ("no_skip", "NoSkip's forward uses a submodule that pipeline stage 0 of 2 does not hold"),
    ("split_refuses", "SplitRefuses: a pipeline needs model.kwargs.blocks >= 4"),
    ("three_blocks", "cannot split the model's 3 layers (SplitNet.layers)"),
    ("tests.helpers:tiny_model", "Sequential names none: give it a pipeline_layers() method"),
]
"""A split-points plug-in that breaks one rule: what the one line must say."""

PP_MESHES = [("pp=2", 2, ()), ("dp=2,pp=2", 4, ()), ("pp=2", 2, ("dist.pp_schedule=gpipe",))]


def _planned(world: int, model: str, mesh: str, *extra: str) -> tuple[str, ...]:
    name = model if ":" in model else f"{PLUG}:{model}"
    return (
        "plan",
        f"--world-size={world}",
        *TINY,
        f"model.name={name}",
        f"dist.mesh={mesh}",
        *extra,
    )


def plugin_cases() -> list[WingCase]:
    cases = [
        WingCase("tp plan", _planned(world, model, mesh), names)
        for model, names in PLANS
        for mesh, world in TP_MESHES
        if not (model == "tests.helpers:tiny_model" and "pp" in mesh)  # no split points either
    ]
    cases += [
        WingCase("pp split", _planned(world, model, mesh, *extra), names)
        for model, names in SPLITS
        for mesh, world, extra in PP_MESHES
    ]
    cases += [  # the controls: the rule each case breaks is the only thing wrong
        WingCase("tp plan", _planned(w, "good", mesh), "", runs="Net's plan splits 2 x 2 Linears")
        for mesh, w in [*TP_MESHES, ("dp=2,tp=2", 4)]
    ]
    cases += [
        WingCase("pp split", _planned(w, "good", mesh, *x), "", runs="Net's 2 blocks in 2 stages")
        for mesh, w, x in PP_MESHES
    ]
    cases.append(
        WingCase(
            "pp split",
            _planned(2, "four_blocks", "pp=2", "dist.pp_schedule=interleaved-1f1b"),
            "",
            runs="4 blocks, 2 x 2 interleaved stages",
        )
    )
    return cases


def test_bad_plan_and_split_plugins_are_one_line_naming_the_plugin(good):
    assert check(plugin_cases(), good) >= 80


# --- a plug-in's own bug: its traceback, after one line naming it -------------------------------


@pytest.mark.parametrize(
    "model, mesh, names",
    [
        ("plan_raises", "tp=2", "PlanRaises.tensor_parallel_plan(2), the model's tensor-parallel"),
        ("split_raises", "pp=2", "SplitRaises.pipeline_layers(), the model's pipeline split"),
    ],
)
def test_a_plugins_own_bug_keeps_its_traceback_after_a_line_naming_it(model, mesh, names):
    o = run_in_process(_planned(2, model, mesh))
    lines = [line for line in o.stderr.splitlines() if line.strip()]
    assert o.code == 1 and "Traceback" in o.stderr, o.stderr[-2000:]
    assert lines[0].startswith("trainer: error: ") and names in lines[0], lines[:2]
    assert "raised AttributeError" in lines[0] and "bad_mesh_plugins.py:" in lines[0], lines[0]
    assert lines[1].startswith("Traceback"), lines[:2]


# --- what the ok line and the banner say -----------------------------------------------------


def test_config_check_says_a_plugin_model_is_checked_when_built():
    o = run_in_process(_check_config(2, *MODELS["plug-in"], "dist.mesh=pp=2"))
    assert o.code == 0, o.stderr
    assert "model.name=tests.bad_mesh_plugins:good is a plug-in, so its pipeline split points" in (
        o.stdout
    )
    o = run_in_process(_check_config(2, *GPT, "dist.mesh=pp=2"))
    assert o.code == 0 and "checked when it is built" not in o.stdout, o.stdout + o.stderr


def test_no_mesh_message_says_ranks_were_launched():
    """`config check` launches nothing: its (and the launch's) messages must not say so."""
    for mesh, world, _ in PRODUCTS[:6]:
        o = run_in_process(_check_config(world, f"dist.mesh={mesh}"))
        assert o.code == 2 and "launched" not in o.stderr, o.stderr


# --- the checks as functions (no process group) ------------------------------------------------


def test_the_gpt_plan_passes_the_check_and_counts_its_modules():
    from trainer.gpt import GPT as Model
    from trainer.parallel import split, tensor

    model = Model(vocab=16, seq_len=8, layers=4, width=16, heads=4)
    for tp in (2, 4):
        plan, n = tensor.checked_plan(model, tp)
        assert n == 4 * 4 and sorted(plan) == sorted(tensor.plan_of(model, tp))
    cut = split.plan(model, 2)
    first = split.piece(model, cut, [0])
    assert tensor.part_plan({**plan, "tok": None}, first).keys() == {*plan, "tok"}
    last = split.piece(model, cut, [1])
    assert tensor.part_plan({**plan, "tok": None}, last).keys() == set(plan)  # tok: stage 0's


@pytest.mark.parametrize(
    "layers, mesh, schedule, ok",
    [
        (2, "pp=2", "1f1b", True),
        (4, "pp=2", "interleaved-1f1b", True),
        (2, "pp=2", "interleaved-1f1b", False),
        (6, "pp=4", "1f1b", False),
        (12, "pp=4", "gpipe", True),
    ],
)
def test_the_gpt_stage_check_needs_no_model(layers, mesh, schedule, ok):
    from trainer import config
    from trainer.errors import ConfigError
    from trainer.parallel.layout import check_model, parse

    settings = [f"model.gpt.layers={layers}", f"dist.pp_schedule={schedule}", f"dist.mesh={mesh}"]
    cfg = config.load("stdlib-gpt", settings)
    lay = parse(mesh, 4)
    if ok:
        assert check_model(cfg, lay) is None
    else:
        with pytest.raises(ConfigError, match=f"model.gpt.layers={layers} blocks"):
            check_model(cfg, lay)
