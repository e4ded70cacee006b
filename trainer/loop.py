"""Train and evaluation steps, and the epoch loop.

Loss normalisation: each rank sums its samples' losses and scales by world/global_count; DDP
averages gradients over ranks, so every step's gradient is sum(all losses) / global_count,
exactly a single-process step on the whole global batch (world size changes only the order of
the floating-point sum). A rank with an empty slice contributes zero and still all-reduces.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from trainer import data, sampler
from trainer.config import Config, TrainConfig
from trainer.dist import DistEnv, all_reduce_sum, control_group
from trainer.errors import Preempted
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


_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_scaler(cfg: TrainConfig, device: str) -> torch.amp.GradScaler:
    """fp16's loss scaler (a disabled pass-through otherwise); its state is checkpointed."""
    return torch.amp.GradScaler(
        torch.device(device).type, init_scale=cfg.fp16_init_scale, enabled=cfg.precision == "fp16"
    )


class TrainStep:
    """One optimizer step on this rank's slice of the global batch.

    Micro-steps (train.micro_batch_size) accumulate gradients under DDP's no_sync until the
    last, so there is one all-reduce per step and the gradient equals the unsplit step's.
    A rank with an empty slice still runs one (empty) micro-step to join that all-reduce.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model,
        optimizer,
        scheduler,
        scaler,
        task: str,
        world: int,
        device: str,
    ):
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.task, self.world = task, world
        self.device_type = torch.device(device).type
        self.dtype = _DTYPES[cfg.precision]
        self.micro = cfg.micro_batch_size
        self.clip = cfg.clip_grad_norm
        self.channels_last = cfg.channels_last
        self.skipped_steps = 0

    def _chunks(self, x, y):
        if not self.micro or len(x) <= self.micro:
            return [(x, y)]
        return list(zip(x.split(self.micro), y.split(self.micro), strict=True))

    def __call__(self, x, y, global_count: int) -> torch.Tensor:
        """Returns this rank's share of the step's global mean loss (detached)."""
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        self.optimizer.zero_grad(set_to_none=True)
        chunks = self._chunks(x, y)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for i, (xc, yc) in enumerate(chunks):
            last = i == len(chunks) - 1
            sync = (
                contextlib.nullcontext()
                if last or not hasattr(self.model, "no_sync")
                else self.model.no_sync()
            )
            with sync:
                with torch.autocast(
                    self.device_type, dtype=self.dtype, enabled=self.dtype is not None
                ):
                    local = loss_sum(self.task, self.model(xc), yc)
                # Sum of losses x world / global count: after DDP's average, sum/global_count.
                self.scaler.scale(local * (self.world / global_count)).backward()
            total += local.detach().float()
        if self.clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)  # skips the step if any gradient is inf/nan (fp16)
        self.scaler.update()
        if scale is not None and self.scaler.get_scale() < scale:
            self.skipped_steps += 1
        with warnings.catch_warnings():
            # After a skipped fp16 step torch warns the schedule may skip its first value; ours
            # is a pure function of the step count, which counts skipped steps too.
            warnings.filterwarnings(
                "ignore", message=re.escape("Detected call of `lr_scheduler.step()`")
            )
            self.scheduler.step()
        return total / global_count


@torch.inference_mode()
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


def fit(cfg: Config, denv: DistEnv, device: str, spec: data.DataSpec, step: TrainStep,
        state: LoopState, logger: RunLogger, ckpt, stop, results: dict | None = None) -> dict:  # fmt: skip
    """Run epochs from `state` to the end; returns the train/eval results for the summary.

    `ckpt` (resume.Checkpointer) saves on schedule and at the end; `stop` (signals.StopSignal)
    is checked by all ranks together at every step boundary.
    """
    last_step = total_steps(cfg, len(epoch_plan(cfg, spec, 0)))
    # Sums of this rank's shares of each step's global mean loss; all-reduced only when logged.
    window_loss = torch.zeros((), dtype=torch.float64, device=device)
    epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
    clock = _Clock()
    window_steps = window_samples = 0
    results = dict(results or {})
    time_before = results.get("train_time_s", 0.0)  # earlier segments of a resumed run

    def save(reason: str, *, must_succeed: bool = False) -> str | None:
        with clock.paused():
            results["train_time_s"] = time_before + clock.total
            if must_succeed:
                return ckpt.save(state, results, reason)
            ckpt.save_or_warn(state, results, reason)
            return None

    def run_eval() -> None:
        with clock.paused():
            results["eval"] = _eval_and_log(cfg, denv, device, spec, step.model, state, logger)

    def check_stop() -> None:
        if stop.agreed(control_group()):
            if ckpt.last_saved_step == state.step:  # e.g. signalled during setup: nothing new
                raise Preempted(f"stopped by {stop.name} at step {state.step} before training on")
            path = save(f"signal {stop.name}", must_succeed=True)
            raise Preempted(
                f"stopped by {stop.name} at step {state.step}; checkpoint {path} saved: "
                "rerun the same command to resume"
            )

    step.model.train()
    check_stop()  # a signal during setup stops here, before the first step
    while state.epoch < cfg.train.epochs and state.step < last_step:
        plan = epoch_plan(cfg, spec, state.epoch)
        epoch_loss.zero_()
        epoch_steps = 0
        for _, x, y, count in data.train_batches(
            spec, plan, denv.rank, denv.world_size, state.step_in_epoch
        ):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = step(x, y, count)
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
                results["train"] = {"loss": window_loss.item() / window_steps}
                logger.record({
                    "kind": "train",
                    "step": state.step,
                    "epoch": state.epoch,
                    "loss": results["train"]["loss"],
                    "lr": step.scheduler.get_last_lr()[0],
                    "samples_per_s": window_samples / elapsed if elapsed > 0 else 0.0,
                })  # fmt: skip
                window_loss.zero_()
                window_steps = window_samples = 0
            if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                run_eval()
            check_stop()
            if state.step >= last_step:
                break
            if cfg.ckpt.every_steps and state.step % cfg.ckpt.every_steps == 0:
                save("every_steps")
        all_reduce_sum(epoch_loss)
        if epoch_steps:
            results["train"] = {"loss": epoch_loss.item() / epoch_steps, "epoch": state.epoch}
        if state.step_in_epoch >= len(plan):
            if (
                not cfg.train.eval_every_steps
                and (state.epoch + 1) % cfg.train.eval_every_epochs == 0
            ):
                run_eval()
            state.epoch += 1
            state.step_in_epoch = 0
            every = cfg.ckpt.every_epochs
            if every and state.epoch % every == 0 and state.step < last_step:
                save("every_epochs")
    if results.get("eval", {}).get("step") != state.step:
        run_eval()
    if ckpt.last_saved_step != state.step:
        save("final", must_succeed=True)
    results["train_time_s"] = time_before + clock.total
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
