"""A run: everything one rank trains with, built once from the config and the rank facts.

`build` is the setup half of `trainer train`: data -> model -> wrap -> optimizer -> resume. The
functions that drive a run (loop.fit, dryrun.check, train's record and finish) take the Run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from trainer import data, models, optim, perf, repro, sampler, tasks
from trainer.checkpoint.manager import Checkpointer, LoopState
from trainer.checkpoint.weights import load_weights_into
from trainer.config import Config, TrainConfig
from trainer.diagnostics import ForwardTimer, Stragglers, Watchdog
from trainer.errors import ConfigError, UsageError
from trainer.invariant import ShardedGradients
from trainer.metrics import RunLogger
from trainer.ranks import World
from trainer.results import Results
from trainer.signals import StopSignal
from trainer.step import TrainStep, make_scaler
from trainer.strategy import Strategy, WorldInvariant, checkpoint_activations, rank_memory
from trainer.tasks import Task


@dataclass(frozen=True)
class Plugins:
    """What trainer.fit hands over in place of the config's registry names: objects or
    factories (None: the config's data.name, model.name, task.name)."""

    data: object = None
    """A DataSpec, or a factory (DataConfig, seed) -> DataSpec."""
    model: object = None
    """A torch.nn.Module, or a factory called as model.name's are."""
    task: object = None
    """A trainer.Task, or a Task subclass or factory called as task.name's are."""


@dataclass(kw_only=True, eq=False)
class Run:
    cfg: Config
    world: World
    strategy: Strategy
    data: data.DataSpec
    task: Task
    """What is learned from a batch: the loss and the metrics (trainer/tasks.py)."""
    step: TrainStep
    """The model (wrapped for training), its optimizer, schedule and loss scaler."""
    ckpt: Checkpointer
    log: RunLogger
    stop: StopSignal
    state: LoopState
    """Where training is; restored from a checkpoint on resume."""
    results: Results = field(default_factory=Results)
    """Latest train/eval results and the train time so far (restored on resume)."""
    steps_per_epoch: int
    total_steps: int
    flops_per_sample: float | None = None
    """Forward + backward model FLOPs of one sample (perf.flops_per_sample), None if uncounted."""
    peak_flops: float | None = None
    """One device's dense peak FLOP/s for the run's precision, None if unknown (any CPU)."""
    started: float
    """time.time() when `trainer train` began."""
    watchdog: Watchdog = field(default_factory=lambda: Watchdog(where=None, stall_s=0, timeout_s=1))
    """Names a stall (trainer/diagnostics.py); a disabled one until train starts it."""
    stragglers: Stragglers | None = None
    """Rank 0's per-rank forward and data-wait accounting (None elsewhere)."""
    hosts: list | None = None
    """Rank 0: every rank's (node, host), gathered when the run's record is written."""
    folder_chosen: bool = False
    """run_dir was left out and the trainer picked a new folder (a rerun would pick another)."""

    @property
    def model(self) -> torch.nn.Module:
        return self.step.model

    @property
    def run_dir(self) -> str:
        return os.path.abspath(self.cfg.run_dir)

    @property
    def to_resume(self) -> str:
        """How a user continues this run after a stop."""
        if self.folder_chosen:  # the same command would start a new folder
            return (
                f"to resume, rerun with run_dir={self.cfg.run_dir} (trainer train: --resume "
                f"{self.cfg.run_dir})"
            )
        return "rerun the same command to resume"

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    def epoch_plan(self, epoch: int) -> sampler.EpochPlan:
        return epoch_plan(self.cfg, len(self.data.train), epoch)

    def memory(self) -> dict:
        """This rank's parameter, gradient and optimizer bytes (its shards under fsdp), its
        process's peak resident memory (host RAM), and the peak GPU memory torch allocated."""
        report = rank_memory(self.model, self.step.optimizer)
        report["peak_rss_bytes"] = repro.peak_rss_bytes()
        if self.world.on_cuda:
            report["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(self.world.device)
        return report

    def banner(self) -> str:
        cfg, w = self.cfg, self.world
        return (
            f"{cfg.name}: {cfg.data.name} ({len(self.data.train)} train / {len(self.data.test)} "
            f"test) | model {cfg.model.name} | task {self.task.name or type(self.task).__name__} | "
            f"world {w.size} x "
            f"{w.device} ({w.backend}, "
            f"{self.strategy.name}) | global batch {cfg.data.global_batch_size}, "
            f"{self.steps_per_epoch} steps/epoch"
        )


def epoch_plan(cfg: Config, n: int, epoch: int) -> sampler.EpochPlan:
    """The global batches of training epoch `epoch` over n samples."""
    d = cfg.data
    return sampler.EpochPlan(
        n=n,
        global_batch=d.global_batch_size,
        seed=cfg.seed,
        epoch=epoch,
        shuffle=d.shuffle,
        drop_last=d.drop_last,
    )


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    planned = cfg.epochs * steps_per_epoch
    return min(planned, cfg.max_steps) if cfg.max_steps else planned


def _check_shards_fit_batchnorm(cfg: Config, model: torch.nn.Module, n: int) -> None:
    """Under repro.world_invariant BatchNorm normalises each shard alone: it needs 2 samples."""
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    b, k = cfg.data.global_batch_size, cfg.repro.shards
    tail = n % b if n % b and not cfg.data.drop_last else b
    if min(b, tail, n) // k < 2:
        raise ConfigError(
            f"repro.world_invariant=true: BatchNorm normalises each of the repro.shards={k} "
            f"shards alone and needs 2 samples in each, but a batch of {min(b, tail, n)} gives "
            f"fewer: raise data.global_batch_size to at least {2 * k}, set data.drop_last=true, "
            "or lower repro.shards"
        )


def layout(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """train.channels_last: the model's 4-d weights in channels-last memory (the step converts
    each input batch to match)."""
    return model.to(memory_format=torch.channels_last) if cfg.channels_last else model


def _fresh_start(
    cfg: Config, world: World, step: TrainStep, log: RunLogger
) -> tuple[LoopState, Results]:
    """No checkpoint to resume: ckpt.init_weights if set, then each rank's own RNG stream."""
    if cfg.ckpt.init_weights:
        load_weights_into(step.model, cfg.ckpt.init_weights, step.strategy, cfg.model)
        log.info(f"initial weights from {cfg.ckpt.init_weights}")
    repro.seed_rank(cfg.seed, world.rank)
    return LoopState(), Results()


def build(
    cfg: Config,
    world: World,
    strategy: Strategy,
    stop: StopSignal,
    started: float,
    plugins: Plugins | None = None,
) -> Run:
    """Data, task, model, wrapping, optimizer and schedule, then the resume (or a fresh start)."""
    plugins = plugins or Plugins()
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and every world size
    spec = data.build(cfg.data, cfg.seed, world.device, source=plugins.data)
    task = tasks.build(cfg.task, spec, source=plugins.task)
    model = _model(cfg, spec, plugins.model).to(world.device)
    # Counted only where it is reported (rank 0 logs and writes the summary) and where it means
    # something: MFU needs a device whose peak is known (a GPU). Counting costs a model copy, a
    # forward/backward and FlopCounterMode's imports (triton's among them): start-up time for a
    # number a CPU run never shows.
    peak = perf.peak_flops(perf.device_name(world.device), cfg.train.precision)
    flops = (
        perf.flops_per_sample(model, task, next(data.eval_batches(spec, 2, 0, 1)), world.device)
        if world.is_main and peak
        else None
    )
    model = layout(model, cfg.train)
    if cfg.train.activation_checkpointing:
        checkpoint_activations(model)
    model = strategy.wrap(model, world)
    if cfg.train.compile:
        model = torch.compile(model)  # after DDP: compiled graphs break at its bucket boundaries
    per_epoch = len(epoch_plan(cfg, len(spec.train), 0))
    total = total_steps(cfg.train, per_epoch)
    optimizer = optim.build_optimizer(cfg.optim, model.parameters())
    step = TrainStep(
        cfg=cfg.train,
        model=model,
        optimizer=optimizer,
        scheduler=optim.build_scheduler(cfg.sched, optimizer, per_epoch, total),
        scaler=make_scaler(cfg.train, world.device),
        task=task,
        world_size=world.size,
        device=world.device,
        strategy=strategy,
        seed=cfg.seed,
        forward_s=ForwardTimer(world.device),
    )
    if isinstance(strategy, WorldInvariant):
        _check_shards_fit_batchnorm(cfg, model, len(spec.train))
        step.shards = ShardedGradients(
            model, rank=world.rank, world_size=world.size, shards=strategy.shards
        )
    log = RunLogger(
        main=world.is_main, progress=cfg.log.progress, total_steps=total, epochs=cfg.train.epochs
    )
    if note := strategy.note(world):
        log.info(note)
    ckpt = Checkpointer(cfg, world, step, log)
    resumed = ckpt.restore()
    state, results = resumed or _fresh_start(cfg, world, step, log)
    return Run(
        cfg=cfg,
        world=world,
        strategy=strategy,
        data=spec,
        task=task,
        step=step,
        ckpt=ckpt,
        log=log,
        stop=stop,
        state=state,
        results=results,
        steps_per_epoch=per_epoch,
        total_steps=total,
        started=started,
        flops_per_sample=flops,
        peak_flops=peak,
        stragglers=Stragglers(world.size) if world.is_main else None,
    )


def _model(cfg: Config, spec: data.DataSpec, given) -> torch.nn.Module:
    """model.name's model, or trainer.fit's: a module as it is, or a factory called as
    model.name's are (the same seed before it on every rank: the same initial weights)."""
    if isinstance(given, torch.nn.Module):
        return given
    if given is not None and not callable(given):
        hint = f" (a name goes in the config: model.name={given})" if isinstance(given, str) else ""
        raise UsageError(
            f"trainer.fit: model is a {type(given).__name__}: give a torch.nn.Module or a "
            f"factory returning one{hint}"
        )
    return models.build(
        cfg.model, spec.in_shape, spec.num_classes, spec.task, data=spec, factory=given
    )
