"""The shape of trainer/, checked: imports only go down the layers below (no circle), no function
is over 60 lines, and the checkpointer is fed state objects: it never reaches into a train step,
and nothing outside it asks whether a checkpoint is sharded."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "trainer"

LAYERS = [
    # Each line may import only from lines above it (not from its own line).
    "jsonfile",
    "trainer checkpoint datasets errors batch sampler results signals noise startup metrics "
    "launch.netif datasets.augment diagnostics.collectives diagnostics.stragglers config.ranges "
    "checkpoint.writer checkpoint.digest tracking.sender",
    "tracking.mlflow_rest parallel parallel.styles storage checkpoint.files",
    "tracking.wandb_sink",
    "exitstatus envvars registry gpt perf invariant rundir report runlock orphans hf params "
    "deferred",
    "parallel.layout parallel.split",  # the layout's checks name the built-in models (registry)
    "config.schema diagnostics.stall launch.threads launch.nodeenv launch.slurm",
    "launch.oom",
    "config.rules config.load config.explain diagnostics.nccl",
    "config diagnostics",  # the packages that re-export their modules
    "repro optim models tasks data ranks parallel.dims",  # dims: the layout, described once
    "parallel.mesh parallel.fixedtree strategy",
    "datasets.synthetic datasets.tabular datasets.vision datasets.text datasets.arrays "
    "datasets.shards tracking.tracker parallel.parts parallel.tensor",
    "datasets.folder datasets.tokens datasets.pack evaluate doctor tracking parallel.stages parallel.tied "
    "parallel.clip namedstate",  # namedstate: saved state keyed by name, every layout
    "state step parallel.apply",  # the Stateful parts; one optimizer step; parallelize
    "parallel.pipeline",
    "checkpoint.bucket",  # the format in a bucket (s3://)
    "checkpoint.store",  # the on-disk format
    "checkpoint.sharded checkpoint.streamed",
    "checkpoint.weights",
    "checkpoint.init",  # ckpt.init_weights matched to the model (fine-tuning)
    "checkpoint.resume lora",
    "checkpoint.manager",
    "run",
    "guards finetune plan",  # plan: each rank's memory before launch
    "loop dryrun",
    "train",
    "script cli",
    "launch.launcher",
    "launch __main__",
    "components",  # the TorchX component: the launcher's contract, before submitting
]
LAYER = {
    f"trainer.{m}" if m != "trainer" else m: i
    for i, line in enumerate(LAYERS)
    for m in line.split()
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """module -> the trainer modules it imports anywhere (top level, in functions, for typing)."""

    def resolve(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainer"):
                for alias in node.names:
                    found.add(resolve(f"{node.module}.{alias.name}"))
            elif isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.startswith("trainer")}
        edges[name] = found - {name}
    return edges


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports that do not go strictly down the layers (a package may import its own modules)."""
    return [
        f"{a} ({LAYER[a]}) imports {b} ({LAYER[b]})"
        for a, targets in edges.items()
        for b in sorted(targets)
        if LAYER[b] >= LAYER[a] and not b.startswith(f"{a}.")
    ]


def test_imports_go_down_the_layers_and_never_in_a_circle():
    modules = _modules()
    assert sorted(set(modules) - set(LAYER)) == [], "place each new module in LAYERS"
    assert sorted(set(LAYER) - set(modules)) == [], "LAYERS names modules that are gone"
    assert _upward(_imports(modules)) == []  # strictly downward imports admit no circle


def test_the_layer_check_catches_an_upward_import_and_a_circle():
    """step.py importing the checkpoint package (the import this layering removed), and two
    modules of one layer importing each other (the config circle that was), are caught."""
    assert _upward({"trainer.step": {"trainer.checkpoint.weights"}})
    assert _upward({"trainer.state": {"trainer.step"}, "trainer.step": {"trainer.state"}})
    assert _upward({"trainer.config.ranges": {"trainer.config.schema"}})
    assert not _upward({"trainer.config": {"trainer.config.schema"}})


def test_no_function_is_over_60_lines():
    long = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} "
        f"({node.end_lineno - node.lineno + 1} lines)"
        for path in _modules().values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


def _attributes(path: pathlib.Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def test_the_checkpointer_is_fed_state_objects_and_alone_knows_the_format():
    modules = _modules()
    edges = _imports(modules)
    checkpoint = {m: p for m, p in modules.items() if m.startswith("trainer.checkpoint")}
    for name in checkpoint:  # no train step, run, loop or strategy object inside
        assert not edges[name] & {"trainer.step", "trainer.run", "trainer.loop"}, name
    tree = ast.parse(modules["trainer.checkpoint.manager"].read_text())
    chains = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    # A step number (parts.loop.step, the writer's step) is fine; `something.step.model` is not.
    reaching = [c for c in chains if ".step." in c]
    assert reaching == []  # the step's model, optimizer, strategy: never touched here
    inside = {"optimizer", "scheduler", "scaler", "strategy"} & _attributes(
        modules["trainer.checkpoint.manager"]
    )
    assert inside == set()
    outside = [
        m
        for m, path in modules.items()
        if m not in checkpoint
        and m != "trainer.state"
        and {"is_sharded", "sharded"} & _attributes(path)
    ]
    assert outside == []  # nobody else branches on how a checkpoint holds the weights


# --- the layout: one description, functions over it, nothing wrapped or patched after -----------

STRUCTURE_NAMES = {"step", "strategy", "dp", "fsdp", "how", "parts", "mesh", "dims", "pipe"}
"""What the run's layout objects are called where they are used: none may get an attribute
assigned outside its own class (an object completed after construction)."""


def _classes(modules: dict[str, pathlib.Path]) -> dict[str, tuple[str, list[str]]]:
    """class name -> (its module, its bases' names), over trainer/."""
    out = {}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                out[node.name] = (name, bases)
    return out


def _wrappers(trees: dict[str, ast.AST], classes: dict) -> list[str]:
    """Classes that take or hold an object of their own kind (themselves or a base of theirs):
    a strategy that wraps another strategy."""

    def kin(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            c = todo.pop()
            if c in classes and c not in seen:
                seen.add(c)
                todo += classes[c][1]
        return seen

    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            family = kin(node.name)
            held = [s.annotation for s in node.body if isinstance(s, ast.AnnAssign)]
            for init in (s for s in node.body if isinstance(s, ast.FunctionDef)):
                if init.name == "__init__":
                    held += [a.annotation for a in init.args.args + init.args.kwonlyargs]
            words = {w for a in held if a is not None for w in _words(ast.unparse(a))}
            if words & family:
                found.append(f"{module}.{node.name} holds a {sorted(words & family)}")
    return found


def _words(text: str) -> set[str]:
    import re

    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))


def _patched(trees: dict[str, ast.AST]) -> list[str]:
    """Attributes assigned on a layout object from outside it (`strategy.dp_mesh = ...`)."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = ast.unparse(t.value).rpartition(".")[2]
                if owner in STRUCTURE_NAMES:
                    found.append(f"{module}:{node.lineno} {ast.unparse(t)} = ...")
    return found


def _probes(trees: dict[str, ast.AST], classes: dict) -> list[str]:
    """isinstance/issubclass checks of a layout class (trainer.strategy, trainer.parallel.*)
    outside the module that defines it."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                continue
            for word in _words(ast.unparse(node.args[1])):
                home = classes.get(word, ("",))[0]
                layout = home == "trainer.strategy" or home.startswith("trainer.parallel")
                if layout and home != module:
                    found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_layout_object_wraps_another_is_patched_or_probed():
    """The layout is one description (ParallelDims, Mesh) and functions over it: no strategy
    holds another strategy, nothing is set on a strategy, step or parts after construction, and
    nobody outside a layout class's module asks whether an object is one."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in modules.items()}
    classes = _classes(modules)
    assert _wrappers(trees, classes) == []
    assert _patched(trees) == []
    assert _probes(trees, classes) == []


def test_the_layout_checks_catch_the_chain_they_replaced():
    """Snippets of the strategy chain this structure replaced are caught."""
    old = ast.parse(
        "class Strategy: pass\n"
        "class Pipelined(Strategy):\n"
        "    def __init__(self, dp: Strategy, pipe=None): self.dp = dp\n"
        "def build(strategy, step, dp):\n"
        "    strategy.dp_mesh = None\n"
        "    step.shards = None\n"
        "    dp.whole = set()\n"
    )
    classes = {
        "Strategy": ("trainer.strategy", []),
        "Pipelined": ("trainer.strategy", ["Strategy"]),
    }
    assert _wrappers({"trainer.strategy": old}, classes)
    assert len(_patched({"trainer.run": old})) == 3
    probe = ast.parse("def f(s): return isinstance(s, pipeline.Pipelined)")
    assert _probes({"trainer.run": probe}, {"Pipelined": ("trainer.parallel.pipeline", [])})
    assert not _probes(
        {"trainer.parallel.pipeline": probe}, {"Pipelined": ("trainer.parallel.pipeline", [])}
    )


def test_the_layout_records_are_frozen():
    import dataclasses

    import pytest
    import torch

    from trainer.parallel.dims import ParallelDims
    from trainer.parallel.mesh import Mesh
    from trainer.parallel.parts import whole

    for record, field in (
        (ParallelDims(), "dp"),
        (Mesh(), "rank"),
        (whole(torch.nn.Linear(2, 2)), "view"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, field, None)


def test_saved_state_is_keyed_by_name_whatever_the_layout():
    """What a checkpoint holds of the model and optimizer is keyed by the whole model's
    parameter names in every layout: a world-1 run's whole state and the union of a pp=2
    run's stages' shards name the same entries (the tied head under tok.weight), and no entry
    is a number (an index-keyed optimizer state means what the optimizer's order meant)."""
    import torch

    from trainer import config, namedstate, optim, params
    from trainer.gpt import GPT
    from trainer.parallel.apply import parallelize
    from trainer.parallel.dims import describe
    from trainer.parallel.mesh import Mesh
    from trainer.parallel.parts import whole
    from trainer.ranks import World

    cfg = config.load("stdlib-gpt", ["dist.mesh=pp=2", "optim.decay=no_bias_norm"])
    torch.manual_seed(0)
    model = GPT(256, 16, 4, 32, 2)
    opt = optim.build(cfg.optim, model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = namedstate.whole(whole(model), opt)
    names = {n for n, _ in model.named_parameters()}
    assert set(saved["optimizer"]["state"]) == names
    assert all(set(g["params"]) <= names for g in saved["optimizer"]["param_groups"])
    flat_whole = set(namedstate.sharded(whole(model), opt)["optim"])
    stages = set()
    order = params.numbering(cfg.optim, model.named_parameters())
    for rank in range(2):
        parts = parallelize(
            model, Mesh(describe(cfg, 2), rank=rank, pp_rank=rank), World(), cfg.train
        )
        stage_opt = optim.build(cfg.optim, parts.view, order)
        for p in parts.view.parameters():
            p.grad = torch.ones_like(p)
        stage_opt.step()
        stages |= set(namedstate.sharded(parts, stage_opt)["optim"])
    assert stages == flat_whole
    assert not any(part.isdigit() for key in flat_whole for part in key.split(".")[1:2])
