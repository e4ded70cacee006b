"""repro.world_invariant under pipeline parallelism: dp x pp gives the world-1 run's bits.

A world-invariant run cuts each global batch into K fixed shards and adds their gradients in one
fixed tree over the shard index (trainer/invariant.py). Under dist.mesh=dp=D,pp=P each
data-parallel replica holds K/D consecutive shards and its pipeline runs them as its
micro-batches, one shard each. Every stage keeps each parameter's per-micro-batch gradient (a
hook that returns zeros, so nothing accumulates); the replica adds its K/D in the tree (from its
first shard: it ends with its block's aligned subtree sums), and all replicas' subtree sums,
all-gathered over the dp group, are added in the same tree. A micro-batch's
gradient is the shard's one-process gradient (the pipeline's per-micro-batch backward is the
same computation: the bitwise pipeline tests rest on it), and a weight tied across stages has its
copies added per micro-batch first, as one process's backward of the shard adds them. So every
stage ends with the world-1 run's summed gradient, and clipping and the optimizer step follow as
there.

Cost: each rank keeps K/D gradient copies of its stages' parameters during a step.
"""

from __future__ import annotations

import contextlib

import torch

from trainer.invariant import ListTree, combine_pieces


@contextlib.contextmanager
def keep_grads(named: list[tuple[str, torch.Tensor]]):
    """Around a backward: name -> the gradients each of its parameters received, in order, one
    per backward pass through it; nothing accumulates into .grad (the hooks return zeros)."""
    kept: dict[str, list[torch.Tensor]] = {}
    handles = [p.register_hook(_keeper(kept.setdefault(n, []))) for n, p in named]
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


def _keeper(grads: list):
    def hook(g: torch.Tensor) -> torch.Tensor:
        grads.append(g.detach().clone())
        return torch.zeros_like(g)

    return hook


def tree_sum(
    per_micro: list[list[torch.Tensor]], group=None, replicas: int = 1, replica: int = 0
) -> list:
    """per_micro[i]: micro-batch (shard) i's gradients, one per parameter -> their sums in the
    fixed tree over all shards: this replica's (replica `replica` of the dp `group`'s
    `replicas`, holding shards replica*n .. replica*n + n - 1 of n * replicas) added in the
    tree, then every replica's subtree sums (an all-gather in fp32) added in rank order."""
    n = len(per_micro)
    tree = ListTree(start=replica * n)
    for grads in per_micro:
        tree.add(list(grads))
    if replicas == 1:
        return tree.result()
    import torch.distributed as dist

    def gather(flat: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(flat) for _ in range(replicas)]
        dist.all_gather(parts, flat, group=group)
        return parts

    summed, _ = combine_pieces(tree.pieces(), replica, replicas, n * replicas, gather)
    return summed


def step_loss(sums: dict, first: int, shards: int, terms: int, lead: bool, device) -> torch.Tensor:
    """The step's mean loss as the world-1 run computes it (its K shard sums in shard order, in
    float64, over the terms) on the `lead` rank, exact zeros elsewhere: each replica's last stage
    puts its shards' float32 sums at their indices (from `first`) and one all-reduce adds them
    to zeros. `sums`: micro-batch index -> its summed loss (empty where the loss does not count)."""
    from trainer import ranks

    losses = torch.zeros(shards, dtype=torch.float64, device=device)
    for i, value in sums.items():
        losses[first + i] = value.reshape(()).float().double()
    losses = ranks.all_reduce_sum(losses)
    mean = losses.sum() / terms
    return mean if lead else torch.zeros_like(mean)
