"""Test-split metrics: during training, and `trainer eval SRC` for saved weights."""

from __future__ import annotations

import torch

from trainer import batch as batches
from trainer import data, ranks, sampler
from trainer.errors import UsageError
from trainer.ranks import World
from trainer.strategy import unwrap
from trainer.tasks import Task, checked_metrics, forward


@torch.inference_mode()
def evaluate(
    model,
    spec: data.DataSpec,
    task: Task,
    world: World,
    batch: int,
    *,
    whole_batches: bool = False,
    mesh=None,
    model_forward=None,
) -> dict:
    """The task's metrics over the whole test split, each sample counted once across ranks.

    Each batch's task.metrics (a (sum, count) per metric) go in one float64 row; the rows are
    added over batches and ranks, then task.summarize turns the totals into numbers (the
    built-ins: loss and accuracy; loss, mse and mae in the target's units; loss per token,
    perplexity, bits per byte and next-token accuracy). `count` is the samples evaluated.

    whole_batches (repro.world_invariant): each rank evaluates whole batches, every batch's row
    goes in its own row of a table that the ranks fill in (one rank's row plus zeros: an exact
    all-reduce), and the rows are added in batch order: the same bits on any world size.
    """
    net = unwrap(model)  # no DDP forward: evaluation needs no gradient sync
    was_training = net.training
    net.eval()
    rank, size = (mesh.data_rank, mesh.data_size) if mesh else (world.rank, world.size)
    found = [
        batch_sums(net, task, b, model_forward)
        for b in data.eval_batches(spec, batch, rank, size, whole=whole_batches)
    ]
    net.train(was_training)
    # A pipeline stage before the last has no output; a tensor-parallel rank but the first
    # holds a copy of its replica's: only the rank whose metrics count adds them.
    found = [f for f in found if f is not None and (mesh is None or mesh.contributes)]
    # A rank without batches learns the names from the others.
    names = ranks.first_of_ranks(found[0][0] if found else None)
    if names is None:
        raise UsageError("evaluation: the test split gave no batches on any rank")
    n_batches = -(-len(spec.test) // batch) if whole_batches else None
    return _summary(task, names, _totals(names, found, world, n_batches, (rank, size)))


def batch_metrics(task: Task, found: list, world: World) -> dict:
    """task.summarize over `found` (batch_sums of this rank's batches) added over every rank,
    as `evaluate` does; {} when no rank had a batch. The dry run's one batch per rank."""
    names = ranks.first_of_ranks(found[0][0] if found else None)
    return {} if names is None else _summary(task, names, _totals(names, found, world))


def _totals(
    names, found: list, world: World, n_batches: int | None = None, reader: tuple = (0, 1)
) -> torch.Tensor:
    """The rows of `found` added over batches and ranks: (sum, count) per metric, samples, and
    the names-mismatch flag. With n_batches (whole_batches), a table of a row per batch filled in
    by the ranks (one rank's row plus zeros: an exact all-reduce), added in batch order; `reader`
    (data rank, data size) says which batches this rank's rows are."""
    width = 2 * len(names) + 2  # (sum, count) per metric, samples, a mismatch flag
    rows = [_row(names, sums, n, width, world.device) for _, sums, n in found]
    if n_batches is not None:
        first = sampler.chunk_bounds(n_batches, *reader)[0]
        table = torch.zeros(n_batches, width, dtype=torch.float64, device=world.device)
        for i, row in enumerate(rows):
            table[first + i] = row
        return ranks.all_reduce_sum(table).sum(dim=0)
    totals = torch.zeros(width, dtype=torch.float64, device=world.device)
    for row in rows:
        totals += row
    return ranks.all_reduce_sum(totals)


def _summary(task: Task, names, totals: torch.Tensor) -> dict:
    """task.summarize of the totals (checked), with `count`, the samples, unless it says one."""
    values = totals.tolist()
    if values[-1]:
        raise UsageError(
            f"{type(task).__name__}.metrics returned different names on different batches or "
            f"ranks (expected {', '.join(names)}): return the same metrics for every batch"
        )
    pairs = {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(names)}
    if any(c < 0 for _, c in pairs.values()):
        raise UsageError(f"{type(task).__name__}.metrics: a count summed to less than 0")
    result = summarized(task, pairs)
    result.setdefault("count", int(values[-2]))
    return result


def batch_sums(net, task: Task, b, model_forward=None) -> tuple[tuple[str, ...], dict, int] | None:
    """(metric names, {name: (sum, count)}, samples) of one batch. `model_forward`: a split
    model's forward (the output on the rank whose metrics count, None elsewhere)."""
    out = forward(task, net, b) if model_forward is None else model_forward(b)
    if out is None:
        return None
    sums = checked_metrics(task, task.metrics(out, b))
    return tuple(sums), sums, batches.size(b)


def _row(names, sums: dict, samples: int, width: int, device: str) -> torch.Tensor:
    """One batch's float64 row: each metric's sum and count, the samples, and 1 if its metric
    names are not `names` (added over ranks, so every rank learns of a mismatch)."""
    row = torch.zeros(width, dtype=torch.float64, device=device)
    if tuple(sums) != tuple(names):
        row[-1] = 1
        return row
    for i, (total, count) in enumerate(sums.values()):
        row[2 * i] = total.double() if isinstance(total, torch.Tensor) else total
        row[2 * i + 1] = count.double() if isinstance(count, torch.Tensor) else count
    row[-2] = samples
    return row


def summarized(task: Task, totals: dict) -> dict:
    """task.summarize(totals), checked: a dict of metric name -> number."""
    result = task.summarize(totals)
    if not isinstance(result, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in result.items()
    ):
        raise UsageError(
            f"{type(task).__name__}.summarize returned {type(result).__name__} "
            f"{str(result)[:60]}: return a dict of metric name -> number"
        )
    return result
