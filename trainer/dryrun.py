"""`trainer train --dry-run`: fail in minute one, not at 99%.

Exercises the paths a long run only reaches late: one training step on the LAST (smallest)
batch of an epoch, one evaluation batch per rank (what the task's summarize returns for them is
shown), and a checkpoint save + verify + load round trip on the real checkpoint filesystem (read
back by every rank, which proves the storage is shared).
It writes nothing that stays: no metrics, no config, and its checkpoint goes to a private
temporary folder that is removed afterwards.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from trainer import batch as batches
from trainer import data, metrics, ranks
from trainer.errors import UsageError
from trainer.evaluate import batch_metrics, batch_sums
from trainer.strategy import unwrap

if TYPE_CHECKING:
    from trainer.run import Run


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def check(run: Run) -> dict:
    """The dry run of `run`: a report of what ran, or a one-line UsageError for what failed."""
    world = run.world
    run.log.info(run.banner())
    report: dict = {"dry_run": True, "world_size": world.size}
    if world.on_cuda:
        torch.cuda.reset_peak_memory_stats(world.device)
    plan = run.epoch_plan(0)
    report["last_batch"] = _last_batch_step(run, plan)
    report["memory"] = ranks.gather_objects(run.memory())  # after a step: gradients, optimizer
    report["eval_batch"] = _eval_batch(run)
    report["checkpoint"] = run.ckpt.round_trip()
    if world.on_cuda:
        report["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(world.device) / 2**30
    lb, ev, ck = report["last_batch"], report["eval_batch"], report["checkpoint"]
    run.log.info(
        f"dry run ok: last batch (step {lb['step_in_epoch'] + 1}/{len(plan)}, "
        f"{lb['global_samples']} samples over {_readers(run)}) loss {lb['loss']:.4f} in "
        f"{lb['seconds']:.2f} s | eval batch {ev['global_samples']} samples{_shown(ev)} | "
        f"checkpoint {ck['bytes'] / 2**20:.1f} MiB saved, verified and loaded in "
        f"{ck['seconds']:.2f} s\n"
        f"{metrics.memory_line(report['memory']) if world.is_main else ''}"
        f"{_plan_hint(run) if world.is_main else ''}"
    )
    return report


def _plan_hint(run: Run) -> str:
    """Where the same numbers come from before launch."""
    return (
        f"\n(measured; `trainer plan --world-size {run.world.size}` with this config gives them "
        "before launch, activations and the peak included)"
    )


def _readers(run: Run) -> str:
    """'2 rank(s)', or under a split model '2 data-parallel replica(s) of 4 ranks'."""
    if not run.mesh.layout.model_parallel:
        return f"{run.world.size} rank(s)"
    return f"{run.mesh.data_size} data-parallel replica(s) of {run.world.size} ranks"


def _shown(eval_batch: dict) -> str:
    """' (loss 2.305, accuracy 0.08)': what summarize returned for the eval batch ('' if none)."""
    parts = metrics._metrics_text(eval_batch["metrics"])
    return f" ({', '.join(parts)})" if parts else ""


def _last_batch_step(run: Run, plan) -> dict:
    """One training step on the epoch's last, smallest batch, where an uneven tail would crash."""
    world = run.world
    last = len(plan) - 1
    if run.mesh.layout.pp > 1 and run.total_steps < len(plan):
        last = run.total_steps - 1  # a pipeline never reaches a tail it could not split
    mesh = run.mesh
    index, batch, count = next(
        data.train_batches(run.data, plan, mesh.data_rank, mesh.data_size, last)
    )
    started = time.perf_counter()
    loss = run.step(batch, count)
    loss = ranks.all_reduce_sum(loss.double()).item()
    _sync(world.device)
    if not math.isfinite(loss):
        raise UsageError(
            f"dry run: the loss on the last batch is {loss}: check optim.lr and the data"
        )
    return {
        "step_in_epoch": index,
        "global_samples": count,
        "this_rank_samples": batches.size(batch),
        "loss": loss,
        "seconds": time.perf_counter() - started,
    }


def _eval_batch(run: Run) -> dict:
    """One evaluation batch per rank through the task's metrics and summarize (their contract,
    checked on real batches), added over the ranks as an evaluation adds them: what summarize
    returned is shown, so a metric that comes out wrong is seen in minute one too."""
    world = run.world
    started = time.perf_counter()
    net = unwrap(run.model).eval()
    with torch.no_grad():
        mesh, size = run.mesh, run.cfg.data.eval_batch_size
        stream = data.eval_batches(run.data, size, mesh.data_rank, mesh.data_size)
        first = next(stream, None)
        sums = None if first is None else batch_sums(net, run.task, first, run.model_forward)
        found = [] if sums is None else [sums]
    net.train()
    n = 0 if sums is None or not mesh.contributes else batches.size(first)
    found = found if mesh.contributes else []
    counts = ranks.all_reduce_sum(torch.tensor([n], dtype=torch.float64, device=world.device))
    return {
        "global_samples": int(counts.item()),
        "metrics": batch_metrics(run.task, found, world),
        "seconds": time.perf_counter() - started,
    }
