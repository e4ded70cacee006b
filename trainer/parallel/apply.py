"""`parallelize`: the run's layout (the Mesh and its ParallelDims) applied to a model, in one fixed
order, returning the parts this rank trains (trainer/parallel/parts.py).

    channels-last (train.channels_last)
    activation checkpointing (each block's forward wrapped in place, so before any split)
    the pipeline split (pp): this rank's stages, each then parallelized on its own
    each part: the model's tensor-parallel plan (tp) -> DDP / FSDP / nn.DataParallel (the dp
               dimension) -> torch.compile

torch.compile comes last, as before meshes: after DDP, whose bucket boundaries compiled graphs
break at. The optimizer, the step, the clip, the checkpoints and evaluation take the returned
ModelParts; nothing is set on them afterwards.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from trainer import strategy
from trainer.config import TrainConfig
from trainer.parallel import split as splits
from trainer.parallel import tensor
from trainer.parallel.mesh import Mesh
from trainer.parallel.parts import ModelParts, Pipe, whole
from trainer.ranks import World


def parallelize(model: nn.Module, mesh: Mesh, world: World, cfg: TrainConfig) -> ModelParts:
    """`model` (built the same on every rank) laid out for this rank."""
    if cfg.channels_last:  # the step converts each 4-d input batch to match
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        strategy.checkpoint_activations(model)
    if mesh.layout.pp == 1:
        return whole(model, _part(model, mesh, world, cfg.compile))
    return _pipelined(model, mesh, world, cfg.compile)


def _part(module: nn.Module, mesh: Mesh, world: World, compile: bool, ignored=()) -> nn.Module:
    """One part (the model, or a stage): tp plan -> the dp dimension's wrapper -> compile."""
    if mesh.layout.tp > 1:
        tensor.parallelize(module, mesh)
    module = strategy.wrap(module, mesh.dims, world, mesh.sub("dp"), ignored)
    return torch.compile(module) if compile else module


def _pipelined(model: nn.Module, mesh: Mesh, world: World, compile: bool) -> ModelParts:
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
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = tuple(n for n, _ in model.named_parameters())
    modules = {s: _part(pieces[s], mesh, world, compile, ignored) for s in local}
    pipe = Pipe(split, mesh, local, MappingProxyType(modules), tied)
    return ModelParts(
        modules=tuple(modules[s] for s in local), view=view, names=names, shapes=shapes, pipe=pipe
    )


def note(parts: ModelParts, mesh: Mesh, world: World) -> str | None:
    """The line rank 0 prints about the layout (the outermost dimension's), or None."""
    if parts.pipe is not None:
        p, dims = parts.pipe, mesh.dims
        return (
            f"pipeline: {p.split.n} stages of {len(p.split.stages[0])} layer(s) "
            f"({dims.pp_schedule}), mesh {dims.layout}; this rank holds stage(s) "
            f"{', '.join(map(str, p.local))}"
        )
    if mesh.layout.tp > 1:
        tp = mesh.layout.tp
        return f"tensor parallel: each layer split over {tp} ranks, mesh {mesh.describe()}"
    return strategy.note(mesh.dims, world)
