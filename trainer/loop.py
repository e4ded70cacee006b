"""The epoch loop: train steps, logging, evaluation, checkpoints and stop requests, on schedule.

When each of those happens is decided by small pure predicates (should_log, should_eval,
should_save) that the tests check directly; `should_stop` is the one collective among them.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from trainer import data, guards, perf, ranks
from trainer.checkpoint.manager import (
    DATA_UNAVAILABLE,
    EVERY_EPOCHS,
    EVERY_MINUTES,
    EVERY_STEPS,
    FINAL,
    METRICS_FAILED,
    Reason,
)
from trainer.config import CkptConfig, Config, TrainConfig
from trainer.diagnostics import straggler_line
from trainer.errors import DataUnavailable, Preempted
from trainer.evaluate import evaluate
from trainer.signals import StopVote

if TYPE_CHECKING:
    from trainer.run import Run


# --- when --------------------------------------------------------------------------------------


def should_log(every_steps: int, step: int, total_steps: int) -> bool:
    """A train record every log.every_steps optimizer steps, and at the last step."""
    return step % every_steps == 0 or step == total_steps


def should_eval(cfg: TrainConfig, *, step: int, epoch_done: int | None = None) -> bool:
    """After optimizer step `step`, or (epoch_done=N) at the end of the N-th epoch (1-based).

    Every train.eval_every_steps steps if set, else every train.eval_every_epochs epochs; the
    loop evaluates the last step in any case.
    """
    if epoch_done is not None:
        return not cfg.eval_every_steps and epoch_done % cfg.eval_every_epochs == 0
    return bool(cfg.eval_every_steps) and step % cfg.eval_every_steps == 0


def should_save(
    cfg: CkptConfig, *, step: int, total_steps: int, epoch_done: int | None = None
) -> bool:
    """A periodic checkpoint after `step` (or at the end of epoch N). Never at the last step:
    the final save covers it."""
    if step >= total_steps:
        return False
    if epoch_done is not None:
        return bool(cfg.every_epochs) and epoch_done % cfg.every_epochs == 0
    return bool(cfg.every_steps) and step % cfg.every_steps == 0


def save_reason(
    cfg: CkptConfig, *, step: int, total_steps: int, minutes_due: bool
) -> Reason | None:
    """Why to save after optimizer step `step`, or None: every ckpt.every_steps steps, else
    when ckpt.every_minutes have passed (`minutes_due`, rank 0's clock, agreed by all ranks).
    Never at the last step: the final save covers it."""
    if should_save(cfg, step=step, total_steps=total_steps):
        return EVERY_STEPS
    if minutes_due and step < total_steps:
        return EVERY_MINUTES
    return None


def should_stop(run: Run) -> bool:
    """Whether any rank was signalled (SIGTERM/SIGINT): a blocking collective, called by every
    rank (before the first step; between steps the loop uses the background StopVote)."""
    return run.stop.agreed(ranks.control_group())


# --- the loop ----------------------------------------------------------------------------------


def train_loop(run: Run) -> None:
    """Train from run.state to run.total_steps; run.results ends with the train/eval results.

    Saves on schedule and at the end, and stops within about 0.2 s plus one step after the step
    a signal landed in (signals.StopVote), with a checkpoint (Preempted, exit 3).
    """
    cfg, state = run.cfg, run.state
    clock = TrainClock(  # counting on from the earlier segments of a resumed run
        before=run.results.train_time_s, waited=run.results.data_wait_s
    )
    losses = LossSums(run.world.device, run.world.size)
    run.model.train()
    _stop_if_asked(run, clock, should_stop(run))  # a signal during setup stops before step 1
    vote = StopVote(run.stop, ranks.stop_group())
    while state.epoch < cfg.train.epochs and not run.finished:
        plan = run.epoch_plan(state.epoch)
        _train_epoch(run, plan, losses, clock, vote)
        epoch_loss = losses.epoch_mean()
        guards.check_loss(run, epoch_loss)
        run.results.record_train(epoch_loss, state.epoch)
        if state.step_in_epoch >= len(plan):  # the epoch ran to its end
            _end_epoch(run, clock)
    vote.finish()  # the last vote in flight; the run is complete whatever it says
    if run.results.eval_step != state.step:
        _evaluate(run, clock)
    guards.check_log_at_end(run, _save_now(run, clock))
    run.ckpt.wait()  # a background save of the last step may make the final one moot
    if not run.ckpt.on_disk(state.step):
        _save(run, clock, FINAL, must_succeed=True)
    _record_time(run, clock)


def _train_epoch(run: Run, plan, losses: LossSums, clock: TrainClock, vote: StopVote) -> None:
    """The steps of this epoch from run.state on, each followed by what falls due after it."""
    state = run.state
    batches = data.train_batches(
        run.data, plan, run.mesh.data_rank, run.mesh.data_size, state.step_in_epoch
    )
    due = next_due(run.cfg, state.step, run.total_steps)
    for _, batch, count in clock.timed(_or_saved(run, clock, batches)):  # on the device already
        losses.add(run.step(batch, count, state.step), count)
        state.step += 1
        run.watchdog.beat(state.step)
        state.step_in_epoch += 1
        state.samples_seen += count
        run.log.tick(state.step, state.epoch + 1)  # epoch_of(state) within an epoch
        _data_trouble(run)
        if state.step < due:  # no record, evaluation or save: only a stop can fall due
            if vote.poll(state.step):
                _stop_if_asked(run, clock, True)
            continue
        if _after_due_step(run, losses, clock, vote):
            return
        due = next_due(run.cfg, state.step, run.total_steps)


def _data_trouble(run: Run) -> None:
    """Data this rank fetches ahead that cannot be read (a split's `unavailable`: the shards'
    prefetch gave up): a stop request the ranks vote on, so that all save at the same step and
    stop (exit 4) while the batches already fetched last."""
    why = getattr(run.data.train, "unavailable", None)
    if why is not None and not run.stop.requested:
        run.stop.request_data_stop(str(why))


def _or_saved(run: Run, clock: TrainClock, batches):
    """`batches`; data that cannot be read (DataUnavailable, exit 4) first saves the last step
    where this is the only process: with more, the others are inside the step's collectives,
    see this rank gone and stop too (exit 4), and the restart resumes from the last save."""
    try:
        yield from batches
    except DataUnavailable as e:
        if run.world.size > 1 or run.ckpt.on_disk(run.state.step):
            raise
        path = _save(run, clock, DATA_UNAVAILABLE, must_succeed=True)
        raise DataUnavailable(f"{e}; checkpoint {path} saved: {run.to_resume}") from None


def next_due(cfg: Config, step: int, total_steps: int) -> int:
    """The first step after `step` that may be followed by a record, an evaluation or a save
    (their every_steps, the last step): the steps before it only look for a stop."""
    periods = (cfg.log.every_steps, cfg.train.eval_every_steps, cfg.ckpt.every_steps)
    return min(total_steps, *(step - step % p + p for p in periods if p))


def _after_due_step(run: Run, losses: LossSums, clock: TrainClock, vote: StopVote) -> bool:
    """What falls due after this step, in order: the record, the evaluation, a stop, a save;
    whether the run is finished."""
    cfg, state = run.cfg, run.state
    minutes_due = False
    if should_log(cfg.log.every_steps, state.step, run.total_steps):
        vote.every, minutes_due = _log_train(run, losses, clock)
    if should_eval(cfg.train, step=state.step):
        _evaluate(run, clock)
    _stop_if_asked(run, clock, vote.poll(state.step))
    if run.finished:
        return True
    reason = save_reason(
        cfg.ckpt, step=state.step, total_steps=run.total_steps, minutes_due=minutes_due
    )
    if reason is not None:
        _save(run, clock, reason)
    return False


def _end_epoch(run: Run, clock: TrainClock) -> None:
    """An epoch ran to its end: its evaluation and save if due, and the position moves on."""
    cfg, state = run.cfg, run.state
    if should_eval(cfg.train, step=state.step, epoch_done=state.epoch + 1):
        _evaluate(run, clock)
    state.epoch += 1
    state.step_in_epoch = 0
    due = should_save(
        cfg.ckpt, step=state.step, total_steps=run.total_steps, epoch_done=state.epoch
    )
    if due and not run.ckpt.holds(state.step):  # not twice (every_minutes, every_steps)
        _save(run, clock, EVERY_EPOCHS)


def _record_time(run: Run, clock: TrainClock) -> None:
    """The train time and data wait so far, into the results (what a checkpoint and the summary
    hold): the one place they are written."""
    run.results.train_time_s, run.results.data_wait_s = clock.total, clock.waited


def epoch_of(state) -> int:
    """The 1-based epoch the last step belongs to: the one in progress, or the one just ended
    (records of the same step say the same epoch, before and after the loop moves on)."""
    if state.step_in_epoch == 0 and state.epoch > 0:
        return state.epoch
    return state.epoch + 1


def _log_train(run: Run, losses: LossSums, clock: TrainClock) -> tuple[int, bool]:
    """Writes the window's train record; returns the stop-vote cadence the ranks agreed on and
    whether a save is due by wall time (ckpt.every_minutes, rank 0's clock)."""
    samples, steps = losses.window_samples, losses.window_steps
    main = run.world.is_main
    window = losses.window(  # one all-reduce, its slots named (Window)
        rank=run.world.rank,
        vote_every=StopVote.cadence(clock.since_lap() / steps),
        metrics_errno=guards.write_error_code(run),
        save_due=main and run.ckpt.due_by_time(),
        forward_s=run.step.forward_s.take(),
        data_wait_s=clock.waited_in_lap(),
    )
    elapsed, waited = clock.lap()  # after the all-reduce: the window includes waiting for it
    run.watchdog.observe(elapsed / steps)
    if window.metrics_errno:
        guards.stop_for_metrics(run, window.metrics_errno, _save_now(run, clock))
    guards.check_loss(run, window.loss)
    run.results.record_train(window.loss)
    record = {"kind": "train", "step": run.state.step, "epoch": epoch_of(run.state)}
    record["loss"] = window.loss
    record["lr"] = run.step.scheduler.get_last_lr()[0]
    record.update(throughput(run, samples, elapsed, waited))
    if 1 < run.world.size <= RANKS_IN_RECORDS:
        record["rank_forward_ms"] = [round(1e3 * f / steps, 3) for f in window.forward_s]
        record["rank_data_wait_ms"] = [round(1e3 * w / steps, 3) for w in window.data_wait_s]
    run.log.record(record)
    if main:
        _name_stragglers(run, window.forward_s, window.data_wait_s, steps, elapsed)
    return window.vote_every, window.save_due


RANKS_IN_RECORDS = 64
"""Train records carry per-rank times up to this world size (summary.json's table always)."""


def _name_stragglers(run: Run, forward, wait, steps: int, elapsed: float) -> None:
    """Rank 0: a console line and a `straggler` record the first time a rank is slow for
    several windows in a row (trainer/diagnostics/stragglers.py)."""
    for s in run.stragglers.window(forward, wait, steps, elapsed):
        node, host = run.hosts[s.rank] if run.hosts else (None, None)
        run.log.info(straggler_line(s, run.hosts))
        run.log.record(
            {
                "kind": "straggler",
                "step": run.state.step,
                "rank": s.rank,
                "node": node,
                "host": host,
                "slow": s.kind,
                "rank_ms": s.mine_ms,
                "others_median_ms": s.others_ms,
                "step_ms": s.step_ms,
            },
            console=False,
        )


def throughput(run: Run, samples: int, elapsed: float, waited: float) -> dict:
    """samples/s (and tokens/s for a task with tokens_per_sample, as an LM's), the share of time
    this rank waited for data (rank 0's, in percent: the rest is compute and communication,
    which DDP overlaps), and MFU."""
    rate = samples / elapsed if elapsed > 0 else 0.0
    out = {"samples_per_s": rate}
    if run.task.tokens_per_sample:
        out["tokens_per_s"] = rate * run.task.tokens_per_sample
    out["data_wait_pct"] = 100.0 * waited / elapsed if elapsed > 0 else 0.0
    used = perf.mfu(rate, run.flops_per_sample, run.peak_flops, run.world.size)
    if used is not None:
        out["mfu"] = used
    return out


def _evaluate(run: Run, clock: TrainClock) -> None:
    with clock.paused(), run.watchdog.paused():
        result = evaluate(
            run.model,
            run.data,
            run.task,
            run.world,
            run.cfg.data.eval_batch_size,
            whole_batches=run.cfg.repro.world_invariant,
            mesh=run.mesh,
            model_forward=run.model_forward,
        )
        run.results.record_eval(result, run.state.step)
        metrics = {f"eval.{k}": v for k, v in result.items()}
        run.log.record(
            {"kind": "eval", "step": run.state.step, "epoch": epoch_of(run.state), **metrics}
        )


def _save(run: Run, clock: TrainClock, reason: Reason, *, must_succeed: bool = False) -> str | None:
    guards.check_weights(run)  # never a checkpoint of NaN weights over the good ones
    with clock.paused(), run.watchdog.paused():
        _record_time(run, clock)
        if must_succeed:
            return run.ckpt.save(reason)
        run.ckpt.save_or_warn(reason)
        return None


def _save_now(run: Run, clock: TrainClock):
    """The save guards.py makes before it stops the run: this step's, which must land."""
    return lambda: _save(run, clock, METRICS_FAILED, must_succeed=True)


def _stop_if_asked(run: Run, clock: TrainClock, agreed: bool) -> None:
    if not agreed:
        return
    name, step = run.stop.name, run.state.step
    run.ckpt.wait()
    if run.stop.data_stop:  # the data cannot be read: a retry's (exit 4), not a signal's
        why = run.stop.why or "another rank's training data could not be read"
        if run.ckpt.on_disk(step):
            raise DataUnavailable(f"{why}; stopped at step {step}, which is saved: {run.to_resume}")
        path = _save(run, clock, DATA_UNAVAILABLE, must_succeed=True)
        run.log.record({"kind": "stop", "step": step, "signal": name})
        raise DataUnavailable(f"{why}; checkpoint {path} saved: {run.to_resume}")
    if run.ckpt.on_disk(step):  # e.g. signalled during setup: nothing new to save
        raise Preempted(f"stopped by {name} at step {step} before training on")
    path = _save(run, clock, Reason.signal(name), must_succeed=True)
    # The step the signal landed in (its rank's next step boundary): how long the stop took.
    run.log.record({"kind": "stop", "step": step, "signal": name, "noticed": run.stop.noticed_step})
    raise Preempted(f"stopped by {name} at step {step}; checkpoint {path} saved: {run.to_resume}")


# --- bookkeeping -------------------------------------------------------------------------------


_SUMMED = ("vote_every", "metrics_errno", "save_due")
_PER_RANK = ("forward_s", "data_wait_s")


@dataclass(frozen=True)
class Window:
    """What a log window's all-reduce brings every rank."""

    loss: float
    """The window's mean loss per step, over all ranks."""
    vote_every: int
    """The stop vote's cadence the ranks agreed on: the mean of their proposals, rounded up."""
    metrics_errno: int
    """Rank 0's metrics.jsonl write error since the last window (its errno, -1 without one;
    0: none)."""
    save_due: bool
    """ckpt.every_minutes have passed by rank 0's clock."""
    forward_s: list[float]
    """Each rank's forward seconds in the window (straggler accounting)."""
    data_wait_s: list[float]
    """Each rank's seconds waiting for data in the window."""


class LossSums:
    """This rank's shares of each step's global mean loss, summed over the current log window
    and epoch; all-reduced only when read, so logging costs no collective per step.

    A step only appends its loss tensor (two float64 tensor adds a step took 13 us at a load of
    8, 0.3% of the digits MLP's step); the losses are read in one copy when a window or the
    epoch is read and added in step order as float64, the additions the tensors made, so the
    same bits."""

    def __init__(self, device: str, world_size: int = 1):
        self.world_size = world_size
        self.device = device
        self.window_sum = self.epoch = 0.0
        self._pending: list[torch.Tensor] = []
        self.window_steps = self.window_samples = self.epoch_steps = 0

    def add(self, loss: torch.Tensor, count: int) -> None:
        self._pending.append(loss)
        self.window_steps += 1
        self.epoch_steps += 1
        self.window_samples += count

    def _fold(self) -> None:
        """The pending steps' losses into the window and epoch sums, in step order."""
        if not self._pending:
            return
        with torch.no_grad():
            values = torch.stack(self._pending).tolist()  # one copy (one sync on a GPU)
        self._pending.clear()
        window, epoch = self.window_sum, self.epoch
        for v in values:  # float64 additions in step order, as a float64 tensor's += made them
            window += v
            epoch += v
        self.window_sum, self.epoch = window, epoch

    def window(
        self,
        *,
        rank: int = 0,
        vote_every: int = 1,
        metrics_errno: int = 0,
        save_due: bool = False,
        forward_s: float = 0.0,
        data_wait_s: float = 0.0,
    ) -> Window:
        """The window's mean loss per step over all ranks and what else the ranks tell each
        other once a window (Window's fields), in one all-reduce; starts a new window.

        Every value is a slot of one float64 vector summed over the ranks: the ranks' integer
        proposals, flags and 0/1 votes add exactly, and each rank's own times go to slots of its
        own (zeros elsewhere), so the sum hands every rank everyone's."""
        self._fold()
        w = self.world_size
        values = np.zeros(1 + len(_SUMMED) + len(_PER_RANK) * w)  # numpy: no tensor op per slot
        values[: 1 + len(_SUMMED)] = (self.window_sum, vote_every, metrics_errno, int(save_due))
        values[1 + len(_SUMMED) + rank :: w] = (forward_s, data_wait_s)
        loss, *rest = ranks.all_reduce_sum(torch.from_numpy(values).to(self.device)).tolist()
        summed, per_rank = rest[: len(_SUMMED)], rest[len(_SUMMED) :]
        mean = loss / self.window_steps
        self.window_sum = 0.0
        self.window_steps = self.window_samples = 0
        return Window(
            loss=mean,
            vote_every=math.ceil(summed[0] / w),
            metrics_errno=int(summed[1]),
            save_due=summed[2] > 0,
            forward_s=per_rank[:w],
            data_wait_s=per_rank[w:],
        )

    def epoch_mean(self) -> float | None:
        """The epoch's mean loss per step (a collective), None if it had no steps; starts anew."""
        self._fold()
        total = torch.tensor(self.epoch, dtype=torch.float64, device=self.device)
        ranks.all_reduce_sum(total)
        mean = total.item() / self.epoch_steps if self.epoch_steps else None
        self.epoch = 0.0
        self.epoch_steps = 0
        return mean


class TrainClock:
    """Wall time of training alone: evaluation and saves are paused out of throughput and train
    time. `total` starts at `before`, the earlier segments of a resumed run, and counts up to the
    latest lap or pause."""

    def __init__(self, before: float = 0.0, waited: float = 0.0) -> None:
        self.total = before
        self.waited = waited
        """Seconds spent waiting for the next batch, over all segments."""
        self._lap_waited = 0.0
        self._mark = time.perf_counter()
        self._lap_start = self._mark

    def lap(self) -> tuple[float, float]:
        """Seconds of training since the previous lap, and of those, seconds waiting for data."""
        now = time.perf_counter()
        self.total += now - self._mark
        self._mark = now
        lap, self._lap_start = now - self._lap_start, now
        waited, self._lap_waited = self._lap_waited, 0.0
        return lap, waited

    def waited_in_lap(self) -> float:
        """Seconds waiting for data since the previous lap, without starting a new one."""
        return self._lap_waited

    def since_lap(self) -> float:
        """Seconds since the previous lap (pauses left out), without starting a new one."""
        return time.perf_counter() - self._lap_start

    def timed(self, batches):
        """Yield from `batches`, counting the time spent waiting for each one."""
        it = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            waited = time.perf_counter() - started
            self.waited += waited
            self._lap_waited += waited
            yield item

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
