"""repro.world_invariant: the same bits on 1, 2, 4, ... ranks.

DDP sums gradients in an order that depends on the world size, and floating-point addition is
not associative, so world sizes agree only to about 1e-7. In this mode each global batch is cut
into K = repro.shards fixed shards (sampler.chunk_bounds over K, whatever the world size); rank r
of W computes the gradients of shards [r*K/W, (r+1)*K/W), one shard at a time, and the K shard
gradients are added in one fixed pairwise tree over the shard index:

    K=8:  ((g0+g1)+(g2+g3)) + ((g4+g5)+(g6+g7))

Each rank's shards are a subtree (a contiguous, power-of-two block), so a rank adds its own
shards locally, the W subtree sums are all-gathered, and every rank adds them in the same tree.
A shard's gradient is the same bits on whichever rank computes it (same samples, same shapes,
same kernels, same weights, and dropout drawn from (seed, step, shard)), so the sum, the clip,
the optimizer step and the next weights are the same bits for every W that divides K.

Floating buffers (BatchNorm's running statistics) get the same treatment: every shard starts from
the step's buffers (BatchNorm normalises with the shard's own statistics: ghost batch norm), and
the shards' updated buffers are averaged in the tree. The K shard losses are gathered and summed
in shard order in float64 for logging.

Cost: K/W forward+backward passes of B/K samples instead of one of B/W per rank (smaller kernels),
and an all-gather of W gradient-sized vectors instead of DDP's bucketed all-reduce (which overlaps
the backward); docs/training.md and bench/ give numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from trainer.sampler import chunk_bounds


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def rank_shards(rank: int, world_size: int, shards: int) -> range:
    """The shard indices rank `rank` computes: a contiguous block of shards // world_size."""
    per_rank = shards // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def shard_seed(seed: int, step: int, shard: int) -> int:
    """The torch RNG seed for shard `shard` of optimizer step `step` (dropout): no rank in it."""
    state = np.random.SeedSequence([seed, step, shard, 0x5A4D]).generate_state(2)
    return int(state[0]) << 32 | int(state[1])


def seed_shard(seed: int, step: int, shard: int, device: str) -> None:
    """Seed the generators the shard's forward draws from: the CPU's, and the GPU's it runs on.

    Not torch.manual_seed: on a CPU-only machine it queues a lazy seed call (with a formatted
    stack) for every accelerator kind, ~1 ms a call, which was a third of a small shard's time.
    """
    value = shard_seed(seed, step, shard)
    torch.default_generator.manual_seed(value)
    if device.startswith("cuda"):
        torch.cuda.default_generators[torch.device(device).index or 0].manual_seed(value)


class TreeSum:
    """Adds tensors fed in index order in a fixed pairwise tree (a binary counter): after
    2**n inputs, `result()` is ((t0+t1)+(t2+t3))+... however the inputs were grouped upstream."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []

    def add(self, t: torch.Tensor) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            t = left + t
            level += 1
        self._stack.append((level, t))

    def result(self) -> torch.Tensor:
        if len(self._stack) != 1:
            raise ValueError(f"a tree sum needs a power-of-two count of inputs ({self._stack!r})")
        return self._stack[0][1]


def tree_sum(tensors) -> torch.Tensor:
    tree = TreeSum()
    for t in tensors:
        tree.add(t)
    return tree.result()


def all_gather(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Every rank's `t`, in rank order (no collective in a single process)."""
    if world_size == 1:
        return [t]
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return parts


class ShardedGradients:
    """One step's shard gradients on this rank, combined over all ranks in the canonical tree.

    Usage per step: `begin()`, then for each of this rank's shards `start_shard(k)`, the shard's
    backward passes, `end_shard(loss_sum)`; then `combine()` writes the summed gradients into the
    parameters' .grad and the averaged buffers back, and returns the K shard losses in order.
    """

    def __init__(self, model: torch.nn.Module, *, rank: int, world_size: int, shards: int):
        self.model, self.rank, self.world_size, self.shards = model, rank, world_size, shards
        self.params = [p for p in model.parameters() if p.requires_grad]
        buffers = list(model.buffers())
        self.float_buffers = [b for b in buffers if b.is_floating_point()]
        self.int_buffers = [b for b in buffers if not b.is_floating_point()]
        self.counters = [
            m.num_batches_tracked
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and m.num_batches_tracked is not None
        ]

    def shards_here(self) -> range:
        return rank_shards(self.rank, self.world_size, self.shards)

    def begin(self) -> None:
        self._saved = [b.detach().clone() for b in self.float_buffers + self.int_buffers]
        self._tree = TreeSum()
        self._losses: list[torch.Tensor] = []

    def start_shard(self) -> None:
        """Every shard starts from the step's buffers and with no gradient."""
        for b, saved in zip(self.float_buffers + self.int_buffers, self._saved, strict=True):
            b.copy_(saved)
        for p in self.params:
            p.grad = None

    def end_shard(self, loss_sum: torch.Tensor) -> None:
        flat = [
            p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
            for p in self.params
        ]
        flat += [b.reshape(-1).to(self.params[0].dtype) for b in self.float_buffers]
        self._tree.add(torch.cat(flat) if flat else loss_sum.new_zeros(0))
        self._losses.append(loss_sum.detach().reshape(1).float())

    def combine(self) -> torch.Tensor:
        """Sum the shard gradients of all ranks (the same bits on every rank and world size);
        returns the K shard loss sums in shard order (float64)."""
        # One all-gather carries the subtree sums and the shard losses (fp32 sums: exact in
        # fp32 transport); the tree then adds in the parameters' dtype, the losses in float64.
        tree = self._tree.result()
        local = torch.cat([tree.float(), torch.cat(self._losses)])
        parts = all_gather(local, self.world_size)
        width = tree.numel()
        total = tree_sum(p[:width].to(tree.dtype) for p in parts)
        losses = torch.cat([p[width:] for p in parts]).double()
        offset = 0
        for p in self.params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        for b in self.float_buffers:  # the shards' buffers, averaged (K is a power of two)
            b.copy_((total[offset : offset + b.numel()] / self.shards).view_as(b))
            offset += b.numel()
        saved_ints = self._saved[len(self.float_buffers) :]
        for b, saved in zip(self.int_buffers, saved_ints, strict=True):
            b.copy_(saved)
        for counter in self.counters:  # one normalisation per step, as the model sees it
            counter.add_(1)
        return losses

    def bounds(self, shard: int, global_count: int) -> tuple[int, int]:
        """[lo, hi) of shard `shard` within this rank's slice of a global batch of global_count."""
        first = chunk_bounds(global_count, self.rank, self.world_size)[0]
        lo, hi = chunk_bounds(global_count, shard, self.shards)
        return lo - first, hi - first
