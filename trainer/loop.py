"""Train and evaluation steps, and the epoch loop.

Loss normalisation: each rank sums its samples' losses and scales by world/global_count; DDP
averages gradients over ranks, so every step's gradient is sum(all losses) / global_count,
exactly a single-process step on the whole global batch (world size changes only the order of
the floating-point sum). A rank with an empty slice contributes zero and still all-reduces.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from trainer import data, sampler
from trainer.config import Config
from trainer.dist import DistEnv, all_reduce_sum
from trainer.metrics import RunLogger
from trainer.strategy import unwrap


@dataclass
class LoopState:
    """Where training is: enough to continue at the exact next global batch."""

    epoch: int = 0
    step: int = 0
    """Optimizer steps done in total."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch."""
    samples_seen: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def loss_sum(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) loss over this rank's samples; 0 for an empty slice."""
    if task == "classification":
        return F.cross_entropy(out, y, reduction="sum")
    return F.mse_loss(out, y.reshape(out.shape).to(out.dtype), reduction="sum")


def train_step(
    model, optimizer, scheduler, x, y, global_count: int, world: int, task: str
) -> torch.Tensor:
    """One optimizer step on this rank's slice; returns its share of the global mean loss."""
    optimizer.zero_grad(set_to_none=True)
    local = loss_sum(task, model(x), y)
    (local * (world / global_count)).backward()
    optimizer.step()
    scheduler.step()
    return local.detach() / global_count


@torch.no_grad()
def evaluate(model, spec: data.DataSpec, denv: DistEnv, device: str, batch: int) -> dict:
    """Loss and accuracy (classification) or MSE and MAE (regression, in the target's own
    units) over the whole test split, each sample counted once across ranks."""
    net = unwrap(model)  # no DDP forward: evaluation needs no gradient sync
    was_training = net.training
    net.eval()
    # loss sum, correct (classification) or absolute-error sum (regression), count
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in data.eval_batches(spec, batch, denv.rank, denv.world_size):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = net(x)
        totals[0] += loss_sum(spec.task, out, y).double()
        if spec.task == "classification":
            totals[1] += (out.argmax(dim=1) == y).sum()
        else:
            totals[1] += (out - y.reshape(out.shape).to(out.dtype)).abs().sum().double()
        totals[2] += len(y)
    all_reduce_sum(totals)
    net.train(was_training)
    loss_total, second, count = totals.tolist()
    result = {"loss": loss_total / count, "count": int(count)}
    if spec.task == "classification":
        result["accuracy"] = second / count
    else:  # the loss is the MSE of standardised targets; report both in the target's units
        result["mse"] = loss_total / count * spec.target_scale**2
        result["mae"] = second / count * spec.target_scale
    return result


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    planned = cfg.train.epochs * steps_per_epoch
    return min(planned, cfg.train.max_steps) if cfg.train.max_steps else planned


def fit(
    cfg: Config,
    denv: DistEnv,
    device: str,
    spec: data.DataSpec,
    model,
    optimizer,
    scheduler,
    state: LoopState,
    logger: RunLogger,
) -> dict:
    """Run epochs from `state` to the end; returns the train/eval results for the summary."""
    last_step = total_steps(cfg, len(epoch_plan(cfg, spec, 0)))
    # Sums of this rank's shares of each step's global mean loss; all-reduced only when logged.
    window_loss = torch.zeros((), dtype=torch.float64, device=device)
    epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
    clock = _Clock()
    window_steps = window_samples = 0
    results: dict = {}

    def run_eval() -> None:
        with clock.paused():
            results["eval"] = _eval_and_log(cfg, denv, device, spec, model, state, logger)

    model.train()
    while state.epoch < cfg.train.epochs and state.step < last_step:
        plan = epoch_plan(cfg, spec, state.epoch)
        epoch_loss.zero_()
        epoch_steps = 0
        for _, x, y, count in data.train_batches(
            spec, plan, denv.rank, denv.world_size, state.step_in_epoch
        ):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = train_step(model, optimizer, scheduler, x, y, count, denv.world_size, spec.task)
            window_loss += loss
            epoch_loss += loss
            window_steps += 1
            epoch_steps += 1
            state.step += 1
            state.step_in_epoch += 1
            state.samples_seen += count
            window_samples += count
            logger.tick(state.step)
            if state.step % cfg.log.every_steps == 0 or state.step == last_step:
                all_reduce_sum(window_loss)  # sums the ranks' shares: the global mean loss per step
                elapsed = clock.lap()
                logger.record(
                    {
                        "kind": "train",
                        "step": state.step,
                        "epoch": state.epoch,
                        "loss": window_loss.item() / window_steps,
                        "lr": scheduler.get_last_lr()[0],
                        "samples_per_s": window_samples / elapsed if elapsed > 0 else 0.0,
                    }
                )
                window_loss.zero_()
                window_steps = window_samples = 0
            if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                run_eval()
            if state.step >= last_step:
                break
        all_reduce_sum(epoch_loss)
        results["train"] = {"loss": epoch_loss.item() / max(1, epoch_steps)}
        if state.step_in_epoch >= len(plan):
            if (
                not cfg.train.eval_every_steps
                and (state.epoch + 1) % cfg.train.eval_every_epochs == 0
            ):
                run_eval()
            state.epoch += 1
            state.step_in_epoch = 0
    if results.get("eval", {}).get("step") != state.step:
        run_eval()
    results["train_time_s"] = clock.total
    return results


class _Clock:
    """Wall time of training alone: evaluation is paused out of throughput and train time."""

    def __init__(self) -> None:
        self.total = 0.0
        self._mark = time.perf_counter()
        self._lap_start = self._mark

    def lap(self) -> float:
        now = time.perf_counter()
        self.total += now - self._mark
        self._mark = now
        lap, self._lap_start = now - self._lap_start, now
        return lap

    @contextlib.contextmanager
    def paused(self):
        now = time.perf_counter()
        self.total += now - self._mark
        try:
            yield
        finally:
            resumed = time.perf_counter()
            self._lap_start += resumed - now
            self._mark = resumed


def epoch_plan(cfg: Config, spec: data.DataSpec, epoch: int) -> sampler.EpochPlan:
    return sampler.EpochPlan(
        n=len(spec.train),
        global_batch=cfg.data.global_batch_size,
        seed=cfg.seed,
        epoch=epoch,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
    )


def _eval_and_log(cfg, denv, device, spec, model, state: LoopState, logger: RunLogger) -> dict:
    result = evaluate(model, spec, denv, device, cfg.data.eval_batch_size)
    result["step"] = state.step
    logger.record(
        {
            "kind": "eval",
            "step": state.step,
            "epoch": state.epoch,
            **{f"eval.{k}": v for k, v in result.items() if k != "step"},
        }
    )
    return result
