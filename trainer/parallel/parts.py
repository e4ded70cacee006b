"""The model as this rank trains it: what trainer/parallel/apply.py's `parallelize` returns, and
what the optimizer, the train step, the clip, the checkpoints and evaluation take.

Plain records, complete when made: `ModelParts` holds the module(s) as they run (wrapped by DDP or
FSDP, compiled), one view of this rank's parameters under the whole model's names, the whole
model's parameter names and state shapes (known before any split), and under pp the `Pipe`: the
split, this rank's stages and the weights tied across stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.parallel.mesh import Mesh
from trainer.parallel.split import Split, Tied


@dataclass(frozen=True, eq=False)
class Pipe:
    """This rank's pipeline stages and how they connect."""

    split: Split
    mesh: Mesh
    local: tuple[int, ...]
    """The stage indices on this rank (two under interleaved 1F1B)."""
    modules: Mapping[int, nn.Module]
    """stage -> its module as the schedule runs it (wrapped on the dp dimension, compiled)."""
    tied: tuple[Tied, ...]

    @property
    def first(self) -> bool:
        return 0 in self.local

    @property
    def last(self) -> bool:
        return self.split.n - 1 in self.local

    def owner(self, stage: int) -> int:
        """The global rank running `stage` in this rank's replica."""
        return self.mesh.peer(pp=stage % self.mesh.layout.pp)


@dataclass(frozen=True, eq=False)
class ModelParts:
    """This rank's part of the model, laid out."""

    modules: tuple[nn.Module, ...]
    """As they run: the whole model wrapped (DDP, FSDP, nn.DataParallel, compiled), or this
    rank's pipeline stages in stage order."""
    view: nn.Module
    """This rank's parameters and buffers under the whole model's names, unwrapped: what the
    optimizer, state dicts, checkpoints and evaluation see (the model itself without pp)."""
    names: tuple[str, ...]
    """The whole model's parameter names in order (a tied weight once): the clip's order."""
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """The whole model's state_dict keys -> shapes, taken before any split: what starting
    weights are matched against on every rank alike."""
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    """The whole model's state_dict keys -> dtypes (with `shapes`: a whole file's layout)."""
    pipe: Pipe | None = None
    """pp only: the split and this rank's stages."""
    tp_modules: int = 0
    """tp only: how many of the whole model's modules its tensor-parallel plan splits."""

    @property
    def aliases(self) -> dict[str, str]:
        """A tied weight's name on this rank's stages -> its whole-model name (the GPT's last
        stage holds head.weight, which the whole model names tok.weight): a saved state keys
        it by the whole-model name whatever the layout."""
        if self.pipe is None:
            return {}
        here = self.pipe.local
        return {
            t.names[s]: t.canonical
            for t in self.pipe.tied
            for s in t.names
            if s in here and t.names[s] != t.canonical
        }

    @property
    def running(self) -> nn.Module:
        """The one module a whole (unsplit) model runs as."""
        return self.modules[0]


def whole(model: nn.Module, running: nn.Module | None = None) -> ModelParts:
    """The parts of a model that is not split: `running` (default: the model) as it runs."""
    from trainer.strategy import unwrap

    running = model if running is None else running
    view = unwrap(running)
    return ModelParts(
        modules=(running,),
        view=view,
        names=tuple(n for n, _ in view.named_parameters()),
        shapes={k: tuple(v.shape) for k, v in view.state_dict().items()},
        dtypes={k: v.dtype for k, v in view.state_dict().items()},
    )
