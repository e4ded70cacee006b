"""`trainer train --dry-run`: fail in minute one, not at 99%.

Exercises the paths a long run only reaches late: one training step on the LAST (smallest)
batch of an epoch, one evaluation batch, and a checkpoint save + verify + load round trip on the
real checkpoint filesystem (read back by every rank, which proves the storage is shared).
It writes nothing that stays: no metrics, no config, and its checkpoint goes to a private
temporary folder that is removed afterwards.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import uuid

import torch

from trainer import checkpoint, data, dist, loop
from trainer.config import Config
from trainer.errors import UsageError
from trainer.strategy import unwrap


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def dry_run(cfg: Config, denv, device, spec, step: loop.TrainStep, ckpt, state, say) -> dict:
    model = step.model
    report: dict = {"dry_run": True, "world_size": denv.world_size}
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)

    plan = loop.epoch_plan(cfg, spec, 0)
    last = len(plan) - 1
    index, x, y, count = next(data.train_batches(spec, plan, denv.rank, denv.world_size, last))
    x, y = x.to(device), y.to(device)
    started = time.perf_counter()
    loss = step(x, y, count)
    loss = dist.all_reduce_sum(loss.double()).item()
    _sync(device)
    report["last_batch"] = {"step_in_epoch": index, "global_samples": count,
                            "this_rank_samples": len(y), "loss": loss,
                            "seconds": time.perf_counter() - started}  # fmt: skip
    if not math.isfinite(loss):
        raise UsageError(
            f"dry run: the loss on the last batch is {loss}: check optim.lr and the data"
        )

    started = time.perf_counter()
    net = unwrap(model).eval()
    with torch.no_grad():
        ex, ey = next(data.eval_batches(spec, cfg.data.eval_batch_size, denv.rank, denv.world_size))
        counts = torch.tensor([len(ey)], dtype=torch.float64, device=device)
        net(ex.to(device))
    dist.all_reduce_sum(counts)
    net.train()
    report["eval_batch"] = {"global_samples": int(counts.item()),
                            "seconds": time.perf_counter() - started}  # fmt: skip

    # Checkpoint round trip into a private folder beside the real checkpoints.
    scratch = dist.broadcast_object(os.path.join(ckpt.root, f".dry-run-{uuid.uuid4().hex[:8]}"))
    started = time.perf_counter()
    path = ckpt.save(state, {}, "dry-run", root=scratch)
    error, size = None, 0
    try:
        checkpoint.verify(path)
        payload = checkpoint.load(path)  # every rank reads it back: is the storage shared?
        for name, tensor in unwrap(model).state_dict().items():
            if not torch.equal(payload["model"][name], tensor.detach().cpu()):
                raise UsageError(f"the round trip changed {name}")
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    except (UsageError, checkpoint.CorruptCheckpoint, OSError) as e:
        error = f"rank {denv.rank}: {e}"
    errors = dist.gather_objects(error)  # also: every rank is done reading before the delete
    first = dist.broadcast_object(next((e for e in errors if e), None) if denv.is_main else None)
    if denv.is_main:
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):  # leave no empty checkpoints folder behind
            os.rmdir(ckpt.root)
    if first:
        raise UsageError(f"dry run: checkpoint round trip in {ckpt.root} failed ({first})")
    report["checkpoint"] = {"bytes": size, "seconds": time.perf_counter() - started}
    if device.startswith("cuda"):
        report["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30

    lb, ev, ck = report["last_batch"], report["eval_batch"], report["checkpoint"]
    say(
        f"dry run ok: last batch (step {lb['step_in_epoch'] + 1}/{len(plan)}, {lb['global_samples']} "
        f"samples over {denv.world_size} rank(s)) loss {lb['loss']:.4f} in {lb['seconds']:.2f} s | "
        f"eval batch {ev['global_samples']} samples | checkpoint {ck['bytes'] / 2**20:.1f} MiB saved, "
        f"verified and loaded in {ck['seconds']:.2f} s"
        + (
            f" | peak GPU memory {report['peak_gpu_memory_gib']:.2f} GiB"
            if "peak_gpu_memory_gib" in report
            else ""
        )
    )
    return report
