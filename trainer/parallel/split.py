"""Pipeline split planning: a model's layers cut into equal runs of stages, and each stage as the
model object holding only its parts.

**Split points.** A model names its layer container (`pipeline_layers()`, the attribute of a
ModuleList or ModuleDict; the GPT's `blocks`). The layers are cut into equal runs, one per stage;
the submodules registered before the container go to the first stage, those after it to the last.
A stage is the model object with the others' parts set to None and its layers in a ModuleDict
keyed by their original indices, so parameter names, state dicts and checkpoints are the whole
model's. The model's forward skips what it does not hold (the GPT's does). A weight that one
module object shares between stages (the GPT's embedding and head) is `Tied`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from trainer import registry
from trainer.errors import ConfigError, UsageError, did_you_mean, first_line, shorten


@dataclass(frozen=True)
class Split:
    """Which stage holds what: the layer container, each stage's layer keys, the modules
    before and after the layers."""

    container: str
    stages: list[list[str]]
    before: list[str]
    after: list[str]

    @property
    def n(self) -> int:
        return len(self.stages)

    def stage_of(self, name: str) -> int:
        """The stage holding the parameter or buffer `name` (a whole-model name)."""
        head, _, rest = name.partition(".")
        if head == self.container:
            key = rest.partition(".")[0]
            return next(i for i, keys in enumerate(self.stages) if key in keys)
        return 0 if head in self.before else self.n - 1


def plan(model: nn.Module, n_stages: int) -> Split:
    """The split of `model` into `n_stages` stages; one line for a model that cannot be split."""
    name = _container_name(model)
    container = getattr(model, name)
    keys = (
        list(container.keys())
        if isinstance(container, nn.ModuleDict)
        else [str(i) for i in range(len(container))]
    )
    if len(keys) % n_stages:
        raise ConfigError(
            f"dist.mesh: {n_stages} pipeline stages cannot split the model's {len(keys)} layers "
            f"({type(model).__name__}.{name}) evenly: use a number of stages that divides "
            f"{len(keys)} (pp x stages per rank), or change the layer count"
        )
    if direct := [n for n, _ in model.named_parameters(recurse=False)]:
        raise ConfigError(
            f"{type(model).__name__} holds parameters on its root ({', '.join(direct[:3])}), "
            "which no pipeline stage owns: move them into a submodule registered before or "
            f"after {name}"
        )
    per = len(keys) // n_stages
    children = list(dict(model.named_children()))
    at = children.index(name)
    return Split(
        container=name,
        stages=[keys[i * per : (i + 1) * per] for i in range(n_stages)],
        before=children[:at],
        after=children[at + 1 :],
    )


def _container_name(model: nn.Module) -> str:
    """The name `pipeline_layers()` gives: a child of the model that is a non-empty ModuleList
    or ModuleDict. Anything else breaks the contract (docs/extending.md, 'Pipeline stages'): one
    line naming the method and what it returned; its own exception keeps its traceback, after a
    line naming it."""
    who = type(model).__name__
    own = getattr(model, "pipeline_layers", None)
    if not callable(own):
        raise ConfigError(
            f"dist.mesh with pp needs the model's split points, but {who} names none: give it a "
            "pipeline_layers() method returning the name of its ModuleList of layers, whose "
            "forward skips submodules set to None (docs/extending.md, 'Pipeline stages'), or use "
            "model.name=gpt"
        )
    with registry.plugin_bug(f"{who}.pipeline_layers(), the model's pipeline split points,"):
        name = own()
    fix = "return the name of its ModuleList of layers (docs/extending.md, 'Pipeline stages')"
    if not isinstance(name, str):
        got = type(name).__name__
        what = f"the {got} itself, not its name" if isinstance(name, nn.Module) else got
        raise ConfigError(f"{who}.pipeline_layers() returned {what}: {fix}, e.g. 'layers'")
    children = dict(model.named_children())
    found = children.get(name)
    if found is None:
        there = getattr(model, name, None) if name.isidentifier() else None
        why = (
            f"a {type(there).__name__} attribute, not a registered submodule (keep the layers in "
            "an nn.ModuleList)"
            if there is not None
            else f"not a submodule of {who}{did_you_mean(name, children)} (its children: "
            f"{', '.join(list(children)[:12]) or 'none'})"
        )
        raise ConfigError(f"{who}.pipeline_layers() returned {shorten(name)!r}, {why}: {fix}")
    if not isinstance(found, (nn.ModuleList, nn.ModuleDict)):
        raise ConfigError(
            f"{who}.pipeline_layers() names {name!r}, a {type(found).__name__}, not an "
            "nn.ModuleList or nn.ModuleDict of layers: hold the layers in one (the model's "
            "forward runs them in turn, skipping None)"
        )
    if not len(found):
        raise ConfigError(
            f"{who}.pipeline_layers() names {name!r}, an empty {type(found).__name__}: a "
            "pipeline needs layers to split, at least one per stage"
        )
    return name


def piece(model: nn.Module, split: Split, stages: list[int]) -> nn.Module:
    """The model object holding only `stages`' parts (the same submodules, not copies)."""
    out = copy.copy(model)
    # Its own registries (modules, parameters, hooks), so wrapping one stage (FSDP's hooks, its
    # DTensor parameters) leaves the model and the other stages as they were.
    out.__dict__ = {k: type(v)(v) if isinstance(v, dict) else v for k, v in model.__dict__.items()}
    for name in split.before:
        out._modules[name] = model._modules[name] if 0 in stages else None
    for name in split.after:
        out._modules[name] = model._modules[name] if split.n - 1 in stages else None
    container = getattr(model, split.container)
    layers = (
        dict(container.items())
        if isinstance(container, nn.ModuleDict)
        else {str(i): m for i, m in enumerate(container)}
    )
    kept = [k for s in stages for k in split.stages[s]]
    out._modules[split.container] = nn.ModuleDict({k: layers[k] for k in kept})
    return out


@contextlib.contextmanager
def stage_forward(model: nn.Module, stage: int, n: int) -> Iterator[None]:
    """Around a pipeline stage's forward: a model whose forward calls a submodule its stage does
    not hold (None: the contract says to skip those) is one line naming the stage and the fix,
    not a TypeError out of the first step."""
    try:
        yield
    except (TypeError, AttributeError) as e:
        text = str(e)
        called = "'NoneType' object is not callable" in text
        reached = "'NoneType' object has no attribute" in text
        holds_none = any(m is None for m in model._modules.values())
        if not (holds_none and (called or reached)):
            raise  # another bug of the model's: its own traceback
        raise UsageError(
            f"{type(model).__name__}'s forward uses a submodule that pipeline stage {stage} of "
            f"{n} does not hold ({shorten(first_line(e), 120)}): a stage holds its layers and "
            "sets the others to None, so the forward must skip None submodules, as "
            "docs/extending.md ('Pipeline stages') shows"
        ) from None


@dataclass(frozen=True)
class Tied:
    """A weight used in two stages (the GPT's embedding and head): its name in each stage."""

    names: dict[int, str]
    """stage -> the parameter's name there"""
    canonical: str
    """The name the whole model's optimizer state uses (its first)."""
    shape: tuple
    """The weight's shape (every stage knows it: the whole model was built everywhere)."""


def tied_weights(model: nn.Module, split: Split) -> list[Tied]:
    """The trained parameters that one module object shares between stages. A frozen one
    (optim.freeze, applied to the whole model before the split, so on every rank alike) has no
    gradient to exchange: its copies stay equal as they are."""
    by_id: dict[int, list[str]] = {}
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        by_id.setdefault(id(p), []).append(name)
        shapes[id(p)] = tuple(p.shape)
    out = []
    for key, names in by_id.items():
        stages = {split.stage_of(n): n for n in reversed(names)}
        if len(stages) > 1:
            out.append(Tied(names=stages, canonical=names[0], shape=shapes[key]))
    return out
