"""`parallelize`: the run's layout (the Mesh and its ParallelDims) applied to a model, in one fixed
order, returning the parts this rank trains (trainer/parallel/parts.py).

    channels-last (train.channels_last)
    activation checkpointing (each block's forward wrapped in place, so before any split)
    the pipeline split (pp): this rank's stages, each then parallelized on its own
    each part: the model's tensor-parallel plan (tp) -> FSDP (the dp dimension's shards) ->
               storage for a deferred model's part (trainer/deferred.py: this rank's shards
               and stages only, with one process's initial values) -> DDP / nn.DataParallel
               (the dp dimension's replicas) -> torch.compile

torch.compile comes last, as before meshes: after DDP, whose bucket boundaries compiled graphs
break at. The optimizer, the step, the clip, the checkpoints and evaluation take the returned
ModelParts; nothing is set on them afterwards.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import torch
from torch import nn

from trainer import strategy
from trainer.config import TrainConfig
from trainer.deferred import Deferred
from trainer.parallel import split as splits
from trainer.parallel import tensor
from trainer.parallel.mesh import Mesh
from trainer.parallel.parts import ModelParts, Pipe, whole
from trainer.ranks import World


def parallelize(
    model: nn.Module, mesh: Mesh, world: World, cfg: TrainConfig, later: Deferred | None = None
) -> ModelParts:
    """`model` (built the same on every rank: whole, or on the meta device with `later` to give
    this rank's part its storage and initial values) laid out for this rank."""
    if cfg.channels_last:  # the step converts each 4-d input batch to match
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        strategy.checkpoint_activations(model)
    state = model.state_dict()  # before any split: the whole model's keys, shapes and dtypes
    layout = {"shapes": {k: tuple(v.shape) for k, v in state.items()}}
    layout["dtypes"] = {k: v.dtype for k, v in state.items()}
    plan = None
    if mesh.layout.tp > 1:  # checked on the whole model, before a pipeline split: every rank
        plan, layout["tp_modules"] = tensor.checked_plan(model, mesh.layout.tp)
    if mesh.layout.pp > 1:
        return _pipelined(model, mesh, world, (cfg.compile, later, plan), layout)
    return replace(whole(model, _part(model, mesh, world, (cfg.compile, later, plan))), **layout)


def _part(module: nn.Module, mesh: Mesh, world: World, how: tuple, ignored=()):
    """One part (the model, or a stage): tp plan -> FSDP -> its storage (deferred) -> DDP or
    nn.DataParallel -> compile. `how`: (compile, the Deferred or None, the checked tp plan)."""
    compile, later, plan = how
    if mesh.layout.tp > 1:
        tensor.parallelize(module, mesh, plan)
    dp_mesh = mesh.sub("dp")
    module = strategy.shard(module, mesh.dims, world, dp_mesh, ignored)
    if later is not None:
        later.materialize(module, world.device)
    module = strategy.replicate(module, mesh.dims, world, dp_mesh)
    return torch.compile(module) if compile else module


def _pipelined(model: nn.Module, mesh: Mesh, world: World, how: tuple, layout) -> ModelParts:
    """This rank's stages of `model`, each laid out on its own; the view holds their parts
    under the whole model's names (the stage itself, or under interleaved 1F1B both)."""
    dims = mesh.dims
    split = splits.plan(model, dims.stages)
    local = tuple(mesh.pp_rank + k * dims.layout.pp for k in range(dims.stages_per_rank))
    tied = tuple(splits.tied_weights(model, split))
    # FSDP leaves a tied weight whole on every rank: the pipeline adds its copies' gradients.
    ignored = {model.get_parameter(t.canonical) for t in tied} if dims.wraps == "fsdp" else set()
    pieces = {s: splits.piece(model, split, [s]) for s in local}
    view = pieces[local[0]] if len(local) == 1 else splits.piece(model, split, list(local))
    names = tuple(n for n, _ in model.named_parameters())
    modules = {s: _part(pieces[s], mesh, world, how, ignored) for s in local}
    pipe = Pipe(split, mesh, local, MappingProxyType(modules), tied)
    return ModelParts(
        modules=tuple(modules[s] for s in local), view=view, names=names, pipe=pipe, **layout
    )


def note(parts: ModelParts, mesh: Mesh, world: World) -> str | None:
    """The lines rank 0 prints about the layout (the outermost dimension's, and a warning for
    FSDP with nothing to shard but the root), or None."""
    lines = [_layout_line(parts, mesh, world), _root_only(parts, mesh)]
    return "\n".join(line for line in lines if line) or None


def _layout_line(parts: ModelParts, mesh: Mesh, world: World) -> str | None:
    if parts.pipe is not None:
        p, dims = parts.pipe, mesh.dims
        return (
            f"pipeline: {p.split.n} stages of {len(p.split.stages[0])} layer(s) "
            f"({dims.pp_schedule}), mesh {dims.layout}; this rank holds stage(s) "
            f"{', '.join(map(str, p.local))}"
        )
    if mesh.layout.tp > 1:
        tp, n = mesh.layout.tp, parts.tp_modules
        return (
            f"tensor parallel: each layer split over {tp} ranks ({n} module(s) of the model's "
            f"plan), mesh {mesh.describe()}"
        )
    return strategy.note(mesh.dims, world)


def _root_only(parts: ModelParts, mesh: Mesh) -> str | None:
    """FSDP shards a model unit by unit; one that names no units is gathered whole at every
    step on every rank (more memory than one process's training): say so, and the fix."""
    if mesh.dims.wraps != "fsdp" or strategy.shard_units(parts.view):
        return None
    gathered = sum(p.numel() * p.element_size() for p in parts.view.parameters())  # whole
    name = type(parts.view).__name__
    return (
        f"warning: fsdp: {name} names no shard units, so every step gathers all of its "
        f"{gathered / 2**20:,.1f} MiB of weights on every rank: give it a shard_units() method "
        "returning its blocks (docs/extending.md, 'Shard units')"
    )
