"""repro.world_invariant: the same bits on every world size that divides repro.shards.

DDP sums gradients in an order that depends on the world size, and floating-point addition is
not associative, so world sizes agree only to about 1e-7. In this mode each global batch is cut
into K = repro.shards fixed shards (sampler.chunk_bounds over K, whatever the world size); rank r
of W (W dividing K) computes the gradients of shards [r*K/W, (r+1)*K/W), one shard at a time, and
the K shard gradients are added in one fixed tree over the shard index, a binary counter:

    K=8:  ((g0+g1)+(g2+g3)) + ((g4+g5)+(g6+g7))
    K=6:  ((g0+g1)+(g2+g3)) + (g4+g5)

A node at level j covering shards [m*2^j, (m+1)*2^j) is added to its left sibling when m is odd;
for a K that is not a power of two the maximal aligned blocks left at the end (K's binary
digits, largest first) are folded right to left. A rank adds its own shards in the same counter,
started at its first shard: it ends with the aligned blocks of its range (one block when K/W is a
power of two; [3,6) -> [3,4), [4,6)). Every rank's blocks are all-gathered and every rank feeds
them, in shard order with their levels, into the same counter, which makes the same additions as
feeding the K shard gradients one by one. A shard's gradient is the same bits on whichever rank
computes it (same samples, same shapes, same kernels, same weights, and dropout drawn from
(seed, step, shard)), so the sum, the clip, the optimizer step and the next weights are the same
bits for every W that divides K.

Floating buffers (BatchNorm's running statistics) get the same treatment: every shard starts from
the step's buffers (BatchNorm normalises with the shard's own statistics: ghost batch norm), and
the shards' updated buffers are averaged in the tree. The K shard losses are gathered and summed
in shard order in float64 for logging.

Cost: K/W forward+backward passes of B/K samples instead of one of B/W per rank (smaller kernels),
and an all-gather of W gradient-sized vectors (W times the most blocks a rank's range has where
K/W is not a power of two: up to about 2*log2(K/W)) instead of DDP's bucketed all-reduce (which
overlaps the backward); docs/training.md and bench/ give numbers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import warnings

import numpy as np
import torch

from trainer.sampler import chunk_bounds


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


class _Counter:
    """A binary counter over positions start, start+1, ...: `add(x, level)` feeds a node of
    2**level leaves at the current position (aligned to 2**level); a node with index m (position
    >> level) is added to the node before it when m is odd and that node is on the same level,
    its left sibling. What is left at the end (`pieces()`) are the maximal aligned blocks of the
    positions fed; `result()` folds them right to left. From 0 to a power of two that is the
    pairwise tree ((t0+t1)+(t2+t3))+..., however the inputs were grouped upstream."""

    def __init__(self, start: int = 0) -> None:
        self._stack: list[tuple[int, object]] = []
        self._pos: int | None = start

    def _merge(self, left, right):
        raise NotImplementedError

    def add(self, x, level: int = 0) -> None:
        pos = self._pos
        if pos is None:
            raise ValueError("a tree sum takes no input after its result")
        if pos % (1 << level):
            raise ValueError(f"a node of 2**{level} inputs cannot start at position {pos}")
        self._pos = pos + (1 << level)
        m = pos >> level
        while m & 1 and self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            x = self._merge(left, x)
            level, m = level + 1, m >> 1
        self._stack.append((level, x))

    def pieces(self) -> list[tuple[int, object]]:
        """(level, sum) of each maximal aligned block fed so far, in order."""
        return list(self._stack)

    def result(self):
        """The sum: the pieces folded right to left (one piece for 2**n inputs from 0)."""
        if not self._stack:
            raise ValueError("a tree sum needs at least one input")
        acc = self._stack[-1][1]
        for _, left in reversed(self._stack[:-1]):
            acc = self._merge(left, acc)
        self._stack, self._pos = [(-1, acc)], None
        return acc


def piece_levels(start: int, stop: int) -> list[int]:
    """The levels of the pieces a counter started at `start` ends with after the leaves
    start..stop-1: the maximal aligned blocks of [start, stop), e.g. [3, 6) -> [0, 1)."""
    counter = _Levels(start)
    for _ in range(start, stop):
        counter.add(None)
    return [level for level, _ in counter.pieces()]


class _Levels(_Counter):
    """The counter's shape alone: what it adds is nothing."""

    def _merge(self, left, right) -> None:
        return None


class TreeSum(_Counter):
    """Adds tensors fed in index order in the fixed tree (_Counter), out of place."""

    def _merge(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return left + right


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


class ListTree(_Counter):
    """The tree over lists of tensors (one per parameter), added in place with one foreach call
    per merge: the same element-wise additions as TreeSum on their concatenation, without
    copying any shard's gradient. `add(items, level=1)` feeds a pair already added;
    `ListTree(start=a)`: a rank's tree over its shards from shard a."""

    def _merge(self, left: list[torch.Tensor], right: list[torch.Tensor]) -> list[torch.Tensor]:
        if right:
            torch._foreach_add_(left, right)  # left + right, element by element
        return left


def combine_pieces(pieces: list, rank: int, world_size: int, shards: int, gather, tail=None):
    """Every rank's pieces added in the global tree: (the sums, in the items' dtypes; every
    rank's `tail` in rank order, or None). `pieces`: this rank's ListTree.pieces() over its
    block of shards (rank_shards); every rank's piece levels follow from (rank, world_size,
    shards), so one all-gather (`gather`: a flat fp32 tensor -> every rank's, in rank order)
    carries them, padded to the largest piece count, then the flattened fp32 `tail`."""
    like = pieces[0][1]
    sizes = [t.numel() for t in like]
    width = sum(sizes)
    levels = [piece_levels(b.start, b.stop) for b in
              (rank_shards(r, world_size, shards) for r in range(world_size))]  # fmt: skip
    if (got := [level for level, _ in pieces]) != levels[rank]:
        raise ValueError(f"rank {rank}'s pieces have levels {got}, its block's {levels[rank]}")
    slots = max(len(lv) for lv in levels)
    device = like[0].device if like else (tail.device if tail is not None else None)
    flat = [t.reshape(-1).float() for _, items in pieces for t in items]
    flat.append(torch.zeros((slots - len(pieces)) * width, device=device))
    if tail is not None:
        flat.append(tail.reshape(-1).float())
    parts = gather(torch.cat(flat))
    tree = ListTree()
    for part, lv in zip(parts, levels, strict=True):
        for i, level in enumerate(lv):
            got = part[i * width : (i + 1) * width].split(sizes)
            tree.add([x.view_as(t).to(t.dtype) for x, t in zip(got, like, strict=True)], level)
    tails = torch.cat([p[slots * width :] for p in parts]) if tail is not None else None
    return tree.result(), tails


class ShardedGradients:
    """One step's shard gradients on this rank, combined over all ranks in the canonical tree.

    Usage per step: `begin(fold)`, then for each of this rank's shards `start_shard()`, the
    shard's backward passes, `end_shard(loss_sum)`; then `combine()` writes the summed gradients
    into the parameters' .grad and the averaged buffers back, and returns the K shard losses.

    The first level of the tree, g(2j) + g(2j+1), is left to autograd when `fold` (each shard's
    gradient comes from one backward pass) and this rank's block starts at an even shard and
    holds an even count: the odd shard's backward accumulates into the even shard's gradients,
    which is that addition, in place. Every other level is one in-place
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
        here = self.shards_here()
        self._tree, self._losses = ListTree(start=here.start), []
        # Pairs (2j, 2j+1) only: a block from an odd shard, or of an odd count, has a lone one.
        self._fold = fold and len(here) > 1 and here.start % 2 == 0 and len(here) % 2 == 0
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
        losses = torch.cat(self._losses)
        if self.world_size > 1:
            summed, losses = self._across_ranks(self._tree.pieces(), losses)
        else:
            summed = self._tree.result()
        for p, g in zip(self.params, summed, strict=False):
            p.grad = g
        for b, s in zip(self.float_buffers, summed[len(self.params) :], strict=True):
            b.copy_(s / self.shards)  # the shards' buffers, averaged (one division: any K)
        saved_ints = self._saved[len(self.float_buffers) :]
        for b, saved in zip(self.int_buffers, saved_ints, strict=True):
            b.copy_(saved)
        for counter in self.counters:  # one normalisation per step, as the model sees it
            counter.add_(1)
        return losses.double()

    def _across_ranks(self, pieces: list, losses: torch.Tensor) -> tuple[list, torch.Tensor]:
        """One all-gather carries every rank's pieces (its block's aligned subtree sums) and
        shard losses (fp32 sums: exact in fp32 transport); all ranks' pieces are then added in
        the global tree, in their dtypes (combine_pieces)."""
        gather = lambda flat: all_gather(flat, self.world_size)  # noqa: E731
        return combine_pieces(pieces, self.rank, self.world_size, self.shards, gather, losses)

    def bounds(self, shard: int, global_count: int) -> tuple[int, int]:
        """[lo, hi) of shard `shard` within this rank's slice of a global batch of global_count."""
        first = chunk_bounds(global_count, self.rank, self.world_size)[0]
        lo, hi = chunk_bounds(global_count, shard, self.shards)
        return lo - first, hi - first
