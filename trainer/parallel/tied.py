"""Gradients a pipeline adds itself, in one process's order, so that pp keeps one process's bits:
a weight tied across stages (the GPT's embedding and head, a copy on each), whose copies'
per-micro-batch gradients are kept, exchanged over the pp group and added as one process's
backward adds them ((h1 + e1) + (h2 + e2) + ...); and, under repro.world_invariant, every
gradient of this rank's stages added in the fixed tree over all shards (fixedtree.py).
"""

from __future__ import annotations

import torch

from trainer.parallel import fixedtree
from trainer.parallel.parts import ModelParts


def kept_grads(parts: ModelParts):
    """Around the schedule: each tied weight's copy keeps its per-micro-batch gradients (and
    lets nothing accumulate), for add_tied or tree_grads to add in one process's order."""
    pipe, params = parts.pipe, dict(parts.view.named_parameters())
    copies = [
        (t.canonical, params[name])
        for t in pipe.tied
        for s, name in t.names.items()
        if s in pipe.local
    ]
    return fixedtree.keep_grads(copies)


def _tied_micro(parts: ModelParts, kept: dict, n_micro: int) -> dict:
    """canonical name -> its per-micro-batch gradients, each the sum of its copies (exchanged
    over the pp group) in stage order, as one process's backward adds them."""
    pipe = parts.pipe
    group, out = pipe.mesh.group("pp"), {}
    for t in pipe.tied:
        grads = kept.get(t.canonical, [])
        slot = {s: i for i, s in enumerate(sorted(t.names))}
        stacked = torch.zeros((len(t.names), n_micro, *t.shape), device=_device(parts))
        for s in sorted(t.names):
            if s in pipe.local:
                stacked[slot[s]] = torch.stack(grads[len(grads) - n_micro :])
        _all_reduce(stacked, group)
        micro = []
        for i in range(n_micro):
            m = stacked[0, i]
            for k in range(1, stacked.shape[0]):
                m = m + stacked[k, i]
            micro.append(m)
        out[t.canonical] = micro
    return out


def _set_tied(parts: ModelParts, totals: dict) -> None:
    pipe, params = parts.pipe, dict(parts.view.named_parameters())
    for t in pipe.tied:
        for s in t.names:
            if s in pipe.local:
                params[t.names[s]].grad = totals[t.canonical].clone()


def add_tied(parts: ModelParts, kept: dict, n_micro: int) -> None:
    """Each tied weight's gradient: its copies' per-micro-batch gradients exchanged over the pp
    group and added as one process adds them ((h1 + e1) + (h2 + e2) + ...), then averaged over
    the dp group; every copy gets the same bits."""
    pipe, totals = parts.pipe, {}
    for name, micro in _tied_micro(parts, kept, n_micro).items():
        total = micro[0]
        for m in micro[1:]:
            total = total + m
        if pipe.mesh.layout.dp > 1:
            _all_reduce(total, pipe.mesh.group("dp"))
            total = total / pipe.mesh.layout.dp
        totals[name] = total
    _set_tied(parts, totals)


def tree_grads(parts: ModelParts, kept: dict, kept_tied: dict, n_micro: int) -> None:
    """repro.world_invariant: every gradient of this rank's stages as the fixed tree over all
    shards adds it (trainer/parallel/fixedtree.py); tied weights from their per-micro sums.
    `kept`, `kept_tied`: the per-micro-batch gradients kept of the others and of tied copies."""
    pipe = parts.pipe
    tied = _tied_micro(parts, kept_tied, n_micro)
    aliases = {t.names[s]: t.canonical for t in pipe.tied for s in t.names}
    named = [(n, p) for n, p in parts.view.named_parameters() if p.requires_grad]
    per_param = []
    for n, p in named:
        grads = tied[aliases[n]] if n in aliases else kept.get(n, [])[-n_micro:]
        per_param.append(grads or [torch.zeros_like(p)] * n_micro)
    per_micro = [[g[i] for g in per_param] for i in range(n_micro)]
    mesh = pipe.mesh
    summed = fixedtree.tree_sum(per_micro, mesh.group("dp"), mesh.layout.dp, mesh.data_rank)
    for (_, p), g in zip(named, summed, strict=True):
        p.grad = g


def _device(parts: ModelParts) -> torch.device:
    return next(parts.view.parameters()).device


def _all_reduce(t: torch.Tensor, group) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
