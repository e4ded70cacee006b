"""Gradient clipping for every layout: train.clip_grad_norm of the WHOLE model's gradient.

A whole model (none, ddp, fsdp, dp) is clipped by torch's clip_grad_norm_ (FSDP's DTensor
gradients reduce their norms themselves). A split model (pp, tp or both) holds parts of the
gradient on different ranks and meshes, so its norm is put together here as torch's
clip_grad_norm_ computes it on one process: every tensor's norm, stacked in the whole model's
parameter order (a weight tied across stages once), then one 2-norm and the same clamped
coefficient. A tensor sharded over mesh dimensions (tp's columns or rows, fsdp's dp) gets its
norm from its local part's square added over those dimensions' groups; a replicated one (the same
on every tp rank) counts once; the stages' entries are added over the pp group (each entry is
nonzero on one stage only: exact). So a pipeline keeps one process's bits when clipping binds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.parallel.mesh import Mesh, sharded_groups
from trainer.parallel.parts import ModelParts
from trainer.strategy import local_part


def clipper(parts: ModelParts, mesh: Mesh) -> Callable[[float], torch.Tensor]:
    """The clip of `parts` on `mesh`: max_norm -> the whole gradient's norm (clipped in place)."""
    if not mesh.layout.model_parallel:
        params = list(parts.view.parameters())
        return lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm)
    order = {n: i for i, n in enumerate(parts.names)}
    aliases = parts.aliases  # a tied copy's gradient is counted under its whole-model name
    return lambda max_norm: _clip_split(parts, mesh, order, aliases, max_norm)


def _clip_split(parts: ModelParts, mesh: Mesh, order: dict, skip, max_norm: float):
    named = [
        (n, p.grad)
        for n, p in parts.view.named_parameters()
        if p.grad is not None and n not in skip
    ]
    device = next(parts.view.parameters()).device
    norms = torch.zeros(len(order), dtype=torch.float32, device=device)
    if named and not any(hasattr(g, "to_local") for _, g in named):
        found = torch._foreach_norm([g for _, g in named], 2.0)
        for (n, _), v in zip(named, found, strict=True):
            norms[order[n]] = v
    elif named:  # DTensors: squares added over the mesh dimensions each one is sharded on
        norms = _sharded_norms(named, order, norms)
    if mesh.layout.pp > 1:
        _all_reduce(norms, mesh.group("pp"))
    total = torch.linalg.vector_norm(norms, 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [local_part(p.grad) for p in parts.view.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


def _sharded_norms(named: list, order: dict, norms: torch.Tensor) -> torch.Tensor:
    """Each tensor's whole norm from its local part's square, added (one all-reduce per set of
    groups) over the mesh dimensions it is sharded on (fsdp's dp, tp's columns or rows); a plain
    (replicated) tensor counts once."""
    found = torch._foreach_norm([local_part(g) for _, g in named], 2.0)
    by_groups: dict[tuple, list] = {}
    for (n, g), v in zip(named, found, strict=True):
        by_groups.setdefault(sharded_groups(g), []).append((order[n], v.square()))
    for groups, entries in by_groups.items():
        part = torch.zeros_like(norms)
        for i, square in entries:
            part[i] = square
        for group in groups:
            _all_reduce(part, group)
        norms = norms + part  # disjoint entries: exact
    return norms.sqrt()


def _all_reduce(t: torch.Tensor, group) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
