"""When training must stop on its own: a diverged run (exit 2: the same config diverges again),
and a metrics.jsonl that cannot be written (exit 4 for a full disk or an I/O error, 2 for a
run_dir that cannot be written at all), each after saving what may be saved. The loop
(trainer/loop.py) calls these; `save` is its save of the current step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trainer import ranks
from trainer.errors import ConfigError, TrainerError, first_line, io_error
from trainer.strategy import local_part

if TYPE_CHECKING:
    from trainer.run import Run


def write_error_code(run: Run) -> int:
    """Rank 0's first metrics.jsonl write error as a number that can ride an all-reduce: its
    errno, -1 for an OSError without one, 0 for none (the other ranks write no metrics)."""
    error = run.log.write_error if run.world.is_main else None
    return 0 if error is None else (error.errno or -1)


def check_log_at_end(run: Run, save: Callable[[], str]) -> None:
    """The records written since the last train window (the last evaluation's): one collective
    at the end of the run, where no window's all-reduce follows."""
    code = torch.tensor(float(write_error_code(run)), device=run.world.device)  # NCCL: on GPU
    failed = ranks.all_reduce_sum(code).item()
    if failed:
        stop_for_metrics(run, int(failed), save)


def stop_for_metrics(run: Run, errno: int, save: Callable[[], str]) -> None:
    """metrics.jsonl could not be written (every rank learnt it from an all-reduce): save a
    checkpoint of where the run is, and stop in one line: exit 4 for a full disk or an I/O error
    (rerunning resumes), 2 for a run_dir that cannot be written at all."""
    error = run.log.write_error if run.world.is_main else None
    if error is None:  # the other ranks: the same errno, so the same exit code
        error = OSError(errno, os.strerror(errno)) if errno > 0 else OSError("write failed")
    step = run.state.step
    run.ckpt.wait()
    if run.ckpt.on_disk(step):
        note = f"checkpoint at step {step} already saved"
    else:
        try:
            note = f"checkpoint {save()} saved"
        except TrainerError as e:
            note = f"the checkpoint save failed too: {first_line(e)}"
    raise io_error(
        error,
        f"metrics.jsonl in {run.run_dir} could not be written ({note})",
        "point run_dir at writable storage",
    )


def check_loss(run: Run, loss: float | None) -> None:
    """Stop a diverged run: a non-finite global loss (all-reduced already: every rank agrees)."""
    if loss is not None and not math.isfinite(loss):
        diverged(run, f"the mean train loss is {loss}")


def check_weights(run: Run) -> None:
    """Stop before saving non-finite weights: one flag summed over the ranks, only at saves, so
    no step pays a device-to-host sync for it."""
    flag = torch.zeros((), dtype=torch.float32, device=run.world.device)
    for p in run.model.parameters():
        local = local_part(p.detach())  # FSDP shards
        if local.is_floating_point():
            flag += (~torch.isfinite(local)).any()
    if ranks.all_reduce_sum(flag).item():
        diverged(run, "the weights hold NaN/inf")


def diverged(run: Run, what: str) -> None:
    """Exit 2, not 1 or 4: rerunning the same config diverges the same way; it needs a change."""
    run.ckpt.wait()
    lr, kept = run.cfg.optim.lr, run.ckpt.newest_on_disk()
    raise ConfigError(
        f"training diverged: {what} at step {run.state.step}: lower optim.lr (now {lr:g}, e.g. "
        f"optim.lr={lr / 10:g}) or set train.clip_grad_norm=1.0; "
        + (f"checkpoints up to step {kept} are kept" if kept else "no checkpoint was written")
    )
