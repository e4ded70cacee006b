"""The shape of trainer/, checked: imports only go down the layers below (no circle), no function
is over 60 lines, and the checkpointer is fed state objects: it never reaches into a train step,
and nothing outside it asks whether a checkpoint is sharded."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "trainer"

LAYERS = [
    # Each line may import only from lines above it (not from its own line).
    "trainer checkpoint datasets errors batch sampler results signals noise startup metrics "
    "launch.netif datasets.augment diagnostics.collectives diagnostics.stragglers config.ranges "
    "checkpoint.writer tracking.sender",
    "tracking.mlflow_rest parallel parallel.layout",
    "tracking.wandb_sink",
    "exitstatus envvars registry gpt perf invariant rundir report runlock orphans hf params",
    "config.schema diagnostics.stall launch.threads launch.nodeenv launch.slurm",
    "config.rules config.load config.explain diagnostics.nccl",
    "config diagnostics",  # the packages that re-export their modules
    "repro optim models tasks data ranks",
    "parallel.mesh parallel.fixedtree",
    "datasets.synthetic datasets.tabular datasets.vision datasets.text datasets.arrays strategy "
    "tracking.tracker",
    "datasets.folder datasets.tokens evaluate doctor tracking",
    "state step",  # the Stateful parts; one optimizer step
    "parallel.pipeline parallel.tensor",
    "checkpoint.store",  # the on-disk format
    "checkpoint.sharded",
    "checkpoint.weights",
    "checkpoint.init",  # ckpt.init_weights matched to the model (fine-tuning)
    "checkpoint.resume lora",
    "checkpoint.manager",
    "run",
    "guards finetune",
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
