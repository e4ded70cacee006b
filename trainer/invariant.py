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

import ctypes
import ctypes.util
import warnings

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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory for the next step instead of returning it to the OS.

    A step here allocates K/W shard gradients at once (8 x 1.2 MB on the digits MLP) and frees
    them together; past glibc's dynamic thresholds (about twice the largest block) the freed top
    of the heap went back to the OS after every step and was page-faulted in again on the next:
    1,124 minor faults and 5 ms of system time a step, a fifth of the step (docs/benchmarks.md).
    Blocks under 32 MiB now come from the heap, which keeps up to 256 MiB free. Plain runs free
    one gradient set at a time and never faulted. False where the C library has no mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 256 << 20))


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


class ListTree:
    """TreeSum over lists of tensors (one per parameter), added in place with one foreach call
    per merge: the same element-wise additions as TreeSum on their concatenation, without
    copying any shard's gradient. `add(items, level=1)` feeds a pair already added."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, list[torch.Tensor]]] = []

    def add(self, items: list[torch.Tensor], level: int = 0) -> None:
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            if items:
                torch._foreach_add_(left, items)  # left + right, element by element
            items = left
            level += 1
        self._stack.append((level, items))

    def result(self) -> list[torch.Tensor]:
        if len(self._stack) != 1:
            raise ValueError(
                f"a tree sum needs a power-of-two count of inputs ({len(self._stack)})"
            )
        return self._stack[0][1]


class ShardedGradients:
    """One step's shard gradients on this rank, combined over all ranks in the canonical tree.

    Usage per step: `begin(fold)`, then for each of this rank's shards `start_shard()`, the
    shard's backward passes, `end_shard(loss_sum)`; then `combine()` writes the summed gradients
    into the parameters' .grad and the averaged buffers back, and returns the K shard losses.

    The first level of the tree, g(2j) + g(2j+1), is left to autograd when `fold` (each shard's
    gradient comes from one backward pass): the odd shard's backward accumulates into the even
    shard's gradients, which is that addition, in place. Every other level is one in-place
    foreach add over the parameters' gradients: no shard gradient is copied or concatenated.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: int,
        world_size: int,
        shards: int,
        grouped: bool = True,
    ):
        self.model, self.rank, self.world_size, self.shards = model, rank, world_size, shards
        self.params = [p for p in model.parameters() if p.requires_grad]
        if self.params and self.params[0].device.type == "cpu":
            keep_freed_memory()
        self.grouped = grouped
        """Several shards' backward passes in one call (run_grouped); False: one at a time
        (torch.compile, activation checkpointing, or a model that reached its parameters
        some other way than through its modules)."""
        buffers = list(model.buffers())
        self.float_buffers = [b for b in buffers if b.is_floating_point()]
        self.int_buffers = [b for b in buffers if not b.is_floating_point()]
        self.counters = [
            m.num_batches_tracked
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and m.num_batches_tracked is not None
        ]
        index = {id(p): i for i, p in enumerate(self.params)}
        self._slots = [  # every place a module holds a trainable parameter (tied ones: each)
            (m, name, index[id(p)])
            for m in model.modules()
            for name, p in m._parameters.items()
            if p is not None and id(p) in index
        ]
        bufs = {id(b): j for j, b in enumerate(self.float_buffers + self.int_buffers)}
        self._buffer_slots = [
            (m, name, bufs[id(b)])
            for m in model.modules()
            for name, b in m._buffers.items()
            if b is not None and id(b) in bufs
        ]

    def shards_here(self) -> range:
        return rank_shards(self.rank, self.world_size, self.shards)

    def begin(self, fold: bool = False) -> None:
        """`fold`: each shard's gradient is one backward pass (no micro-steps inside a shard),
        so an odd shard may accumulate into its even neighbour's gradients (see the class)."""
        self._saved = [b.detach().clone() for b in self.float_buffers + self.int_buffers]
        self._tree, self._losses = ListTree(), []
        self._fold = fold and len(self.shards_here()) > 1
        self._left: tuple[list, list] | None = None  # an even shard's (grads, buffers)

    def start_shard(self) -> None:
        """Every shard starts from the step's buffers; with no gradient, or (folding, an odd
        shard) with its even neighbour's, which its backward pass adds to."""
        for b, saved in zip(self.float_buffers + self.int_buffers, self._saved, strict=True):
            b.copy_(saved)
        left = self._left[0] if self._left is not None else [None] * len(self.params)
        for p, g in zip(self.params, left, strict=True):
            p.grad = g
        self._versions = [g._version if g is not None else -1 for g in left]

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def end_shard(self, loss_sum: torch.Tensor) -> None:
        """After a shard's backward passes (none for an empty shard: its gradients are zeros)."""
        self._losses.append(loss_sum.detach().reshape(1).float())
        bufs = [b.detach().clone() for b in self.float_buffers]
        if not self._fold:
            self._tree.add([*self._grads(), *bufs])
            return
        if self._left is None:  # even: the odd neighbour's backward adds to these gradients
            self._left = (self._grads(), bufs)
            return
        grads, left_bufs = self._left
        self._left = None
        for p, g, version in zip(self.params, grads, self._versions, strict=True):
            if p.grad is g and g._version == version:  # no gradient from the odd shard: add its
                g.add_(torch.zeros_like(g))  # zeros, as the tree does (-0.0 + 0.0 is +0.0)
        if bufs:
            torch._foreach_add_(left_bufs, bufs)
        self._tree.add([*self._grads(), *left_bufs], level=1)

    def run_grouped(self, pieces: list, group: int, loss_of, seed) -> bool:
        """This rank's shards, `group` at a time: each shard's forward with its own leaf
        tensors in place of the parameters (the same storage), then one backward pass for the
        group. Each shard's gradient is the one its own backward pass gives (the same kernels
        on the same shapes; tests/test_world_invariant.py checks that groups of 1, 2 and 4
        agree bit for bit), without one autograd call per shard.

        pieces: (shard index, its samples or None for an empty shard) in order; loss_of(piece)
        -> (what to call backward on, the detached loss sum); seed(k) seeds shard k's forward.
        False (nothing combined): the model reached its parameters outside its modules; the
        caller computes the step shard by shard instead, and so does every later step."""
        self.begin()
        for p in self.params:
            p.grad = None
        for at in range(0, len(pieces), group):
            part = pieces[at : at + group]
            leaves = [self._forward(k, piece, loss_of, seed) for k, piece in part]
            roots = [r for r, *_ in leaves if r is not None]
            if roots:
                torch.autograd.backward(roots)
            if any(p.grad is not None for p in self.params):
                self._undo()
                return False
            for _, alias, bufs, loss in leaves:
                grads = [a.grad if a.grad is not None else torch.zeros_like(a) for a in alias]
                self._tree.add([*grads, *bufs])
                self._losses.append(loss)
        return True

    def _undo(self) -> None:
        """No gradients, and shard by shard from now on."""
        for p in self.params:
            p.grad = None
        self.grouped = False
        warnings.warn(
            "repro.world_invariant: the model reaches some parameters other than through its "
            "modules' attributes, so each shard runs its own backward pass (slower, same bits)",
            stacklevel=2,
        )

    def _forward(self, k: int, piece, loss_of, seed) -> tuple:
        """Shard k's forward with fresh leaves for its parameters and its own copies of the
        step's buffers (which its backward may need unchanged): (backward root or None, the
        leaves, its buffers after, its loss sum as float32). The model's own tensors are back
        in place when it returns."""
        alias = [p.detach().requires_grad_(True) for p in self.params]
        copies = [saved.clone() for saved in self._saved]
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        root = None
        if piece is not None:
            seed(k)
            self._swap(alias, copies)
            try:
                root, local = loss_of(piece)
            finally:
                self._swap(self.params, self.float_buffers + self.int_buffers)
            total += local
        return root, alias, copies[: len(self.float_buffers)], total.reshape(1)

    def _swap(self, params: list, buffers: list) -> None:
        for m, name, i in self._slots:
            m._parameters[name] = params[i]
        for m, name, j in self._buffer_slots:
            m._buffers[name] = buffers[j]

    def combine(self) -> torch.Tensor:
        """Sum the shard gradients of all ranks (the same bits on every rank and world size);
        returns the K shard loss sums in shard order (float64)."""
        for p in self.params:
            p.grad = None
        summed = self._tree.result()
        losses = torch.cat(self._losses)
        if self.world_size > 1:
            summed, losses = self._across_ranks(summed, losses)
        for p, g in zip(self.params, summed, strict=False):
            p.grad = g
        for b, s in zip(self.float_buffers, summed[len(self.params) :], strict=True):
            b.copy_(s / self.shards)  # the shards' buffers, averaged (K is a power of two)
        saved_ints = self._saved[len(self.float_buffers) :]
        for b, saved in zip(self.int_buffers, saved_ints, strict=True):
            b.copy_(saved)
        for counter in self.counters:  # one normalisation per step, as the model sees it
            counter.add_(1)
        return losses.double()

    def _across_ranks(self, summed: list, losses: torch.Tensor) -> tuple[list, torch.Tensor]:
        """One all-gather carries every rank's subtree sums and shard losses (fp32 sums: exact
        in fp32 transport); the W subtree sums are then added in the tree, in their dtypes."""
        flat = [t.reshape(-1).float() for t in summed]
        parts = all_gather(torch.cat([*flat, losses]), self.world_size)
        width = sum(t.numel() for t in flat)
        tree = ListTree()
        for part in parts:
            pieces = part[:width].split([t.numel() for t in summed])
            tree.add([x.view_as(t).to(t.dtype) for x, t in zip(pieces, summed, strict=True)])
        return tree.result(), torch.cat([p[width:] for p in parts])

    def bounds(self, shard: int, global_count: int) -> tuple[int, int]:
        """[lo, hi) of shard `shard` within this rank's slice of a global batch of global_count."""
        first = chunk_bounds(global_count, self.rank, self.world_size)[0]
        lo, hi = chunk_bounds(global_count, shard, self.shards)
        return lo - first, hi - first
