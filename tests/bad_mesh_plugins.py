"""Models whose model-parallel plug-ins break one rule each, for tests/test_bad_mesh_wing.py.

A model splits under `dist.mesh` through two methods of its own (docs/extending.md): a
tensor-parallel plan, `tensor_parallel_plan(tp)` -> {module name or fnmatch pattern:
ParallelStyle}, and pipeline split points, `pipeline_layers()` -> the name of its ModuleList of
layers (its forward skipping the submodules a stage does not hold). `Net` gets both right; each
factory below breaks one rule of one of them. Everything else is tiny: tests.helpers:tiny's
(1, 4, 4) samples in 3 classes, a width of 8, two residual blocks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from trainer.errors import UsageError
from trainer.parallel.styles import fused_colwise


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(self.fc1(x).relu())


def _good_plan(tp: int) -> dict:
    return {"layers.*.fc1": ColwiseParallel(), "layers.*.fc2": RowwiseParallel()}


class Net(nn.Module):
    """The control: a plan that splits each block's pair, split points at `layers`."""

    def __init__(self, in_shape, num_classes, width=8, hidden=16, blocks=2, plan=_good_plan):
        super().__init__()
        inputs = in_shape[0] * in_shape[1] * in_shape[2]
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(inputs, width))
        self.layers = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.head = nn.Linear(width, num_classes)
        self.plan = plan

    def tensor_parallel_plan(self, tp: int) -> dict:
        return self.plan(tp)

    def pipeline_layers(self) -> str:
        return "layers"

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        layers = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in layers:
            x = layer(x)
        return x if self.head is None else self.head(x)


def good(in_shape, num_classes):
    return Net(in_shape, num_classes)


def four_blocks(in_shape, num_classes):
    return Net(in_shape, num_classes, blocks=4)


def _with_plan(plan: dict | object, **kw):
    return lambda in_shape, num_classes: Net(in_shape, num_classes, plan=lambda tp: plan, **kw)


# --- tensor-parallel plans ----------------------------------------------------------------------

odd_width = _with_plan(_good_plan(2), width=8, hidden=15)
"""fc1's 15 outputs (ColwiseParallel) do not split over 2 ranks: the issue's 730-line error."""
odd_rows = _with_plan({"layers.*.fc2": RowwiseParallel()}, hidden=15)
"""fc2's 15 inputs (RowwiseParallel) do not split over 2 ranks."""
fused_odd = _with_plan({"layers.*.fc1": fused_colwise(3)}, hidden=15)
"""fused_colwise(3) on 15 outputs: parts of 5, which 2 ranks cannot split."""
key_misspelt = _with_plan({"layers.*.fc3": ColwiseParallel(), "layers.*.fc2": RowwiseParallel()})
key_other_model = _with_plan({"blocks.*.attn.qkv": ColwiseParallel()})
"""The GPT's keys on a model that has no `blocks`: every key resolves to nothing."""
key_too_deep = _with_plan({"layers.*.fc1.weight": ColwiseParallel()})
"""A parameter's name, not a module's."""
key_not_a_string = _with_plan({0: ColwiseParallel()})
style_class = _with_plan({"layers.*.fc1": ColwiseParallel, "layers.*.fc2": RowwiseParallel()})
"""The class, not an instance."""
style_string = _with_plan({"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
style_none = _with_plan({"layers.*.fc1": None})
style_module = _with_plan({"layers.*.fc1": nn.Linear(2, 2)})
named_twice = _with_plan({"layers.*.fc1": ColwiseParallel(), "layers.0.fc1": ColwiseParallel()})
not_a_linear = _with_plan({"layers.*": ColwiseParallel()})
"""ColwiseParallel on a Block (it splits Linear and Embedding only)."""
root_style = _with_plan({"": RowwiseParallel()})
"""The whole model (a Net) given RowwiseParallel."""
plan_list = _with_plan([("layers.*.fc1", ColwiseParallel())])
plan_empty = _with_plan({})
plan_none = _with_plan(None)


class WithLookup(Net):
    """A model with an Embedding of 5 dims (embed_odd's)."""

    def __init__(self, in_shape, num_classes, plan):
        super().__init__(in_shape, num_classes, plan=plan)
        self.lookup = nn.Embedding(4, 5)


def embed_odd(in_shape, num_classes):
    """ColwiseParallel on an Embedding of 5 dims."""
    return WithLookup(in_shape, num_classes, lambda tp: {"lookup": ColwiseParallel()})


class PlanAttribute(Net):
    """tensor_parallel_plan is a dict, not a method."""

    tensor_parallel_plan = {"layers.*.fc1": ColwiseParallel()}  # noqa: RUF012


class PlanRaises(Net):
    """tensor_parallel_plan has a bug of its own: its traceback is kept."""

    def tensor_parallel_plan(self, tp: int) -> dict:
        return {f"layers.{i}.fc1": ColwiseParallel() for i in range(len(self.layer))}


class PlanRefuses(Net):
    """tensor_parallel_plan refuses a tp itself, as the docs ask: one line, its own."""

    def tensor_parallel_plan(self, tp: int) -> dict:
        raise UsageError(f"PlanRefuses: tp={tp} needs a width of 16: set model.kwargs.width=16")


def plan_attribute(in_shape, num_classes):
    return PlanAttribute(in_shape, num_classes)


def plan_raises(in_shape, num_classes):
    return PlanRaises(in_shape, num_classes)


def plan_refuses(in_shape, num_classes):
    return PlanRefuses(in_shape, num_classes)


# --- pipeline split points ----------------------------------------------------------------------


def _with_layers(returned, cls=Net, **kw):
    class Split(cls):
        def pipeline_layers(self):
            return returned(self) if callable(returned) else returned

    Split.__name__ = Split.__qualname__ = f"Split{cls.__name__}"
    return lambda in_shape, num_classes: Split(in_shape, num_classes, **kw)


layers_module = _with_layers(lambda self: self.layers)
"""The ModuleList itself, not its name."""
layers_none = _with_layers(None)
layers_int = _with_layers(2)
layers_misspelt = _with_layers("layer")
layers_missing = _with_layers("blocks")
layers_dotted = _with_layers("layers.0")
layers_not_a_list = _with_layers("head")
"""A Linear, not a ModuleList."""


class PlainList(Net):
    """Its blocks in a Python list: no registered submodule."""

    def __init__(self, in_shape, num_classes):
        super().__init__(in_shape, num_classes)
        self.blocks = list(self.layers)


class NoLayers(Net):
    def __init__(self, in_shape, num_classes):
        super().__init__(in_shape, num_classes)
        self.layers = nn.ModuleList()


class RootParameter(Net):
    """A parameter on the model's root, which no stage owns."""

    def __init__(self, in_shape, num_classes):
        super().__init__(in_shape, num_classes)
        self.scale = nn.Parameter(nn.init.ones_(self.head.bias.new_empty(1)))


class NoSkip(Net):
    """Its forward calls every submodule, None or not."""

    def forward(self, x):
        x = self.embed(x)
        for layer in (
            self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        ):
            x = layer(x)
        return self.head(x)


class SplitRaises(Net):
    def pipeline_layers(self) -> str:
        return self.layer_names[0]


class SplitRefuses(Net):
    def pipeline_layers(self) -> str:
        raise UsageError("SplitRefuses: a pipeline needs model.kwargs.blocks >= 4")


layers_plain_list = _with_layers("blocks", PlainList)
layers_empty = _with_layers("layers", NoLayers)


def root_parameter(in_shape, num_classes):
    return RootParameter(in_shape, num_classes)


def no_skip(in_shape, num_classes):
    return NoSkip(in_shape, num_classes)


def split_raises(in_shape, num_classes):
    return SplitRaises(in_shape, num_classes)


def split_refuses(in_shape, num_classes):
    return SplitRefuses(in_shape, num_classes)


three_blocks = _with_layers("layers", blocks=3)
"""3 blocks: 2 stages (or 2 x 2 interleaved) cannot split them."""
