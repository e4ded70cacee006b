"""A run: everything one rank trains with, built once from the config and the rank facts.

`build` is the setup half of `trainer train`: data -> model -> wrap -> optimizer -> resume; the
Run it returns is complete (nothing sets its fields afterwards). The functions that drive a run
(loop.train_loop, dryrun.check, train's record and finish) take the Run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer import (
    data,
    deferred,
    hf,
    lora,
    models,
    optim,
    params,
    perf,
    ranks,
    repro,
    sampler,
    tasks,
)
from trainer.checkpoint.init import load_init
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.resume import Resume
from trainer.checkpoint.weights import find_config, load_weights_into
from trainer.config import Config, TrainConfig
from trainer.diagnostics import ForwardTimer, Stragglers, Watchdog, Where
from trainer.errors import ConfigError, UsageError
from trainer.evaluate import evaluate
from trainer.invariant import ShardedGradients
from trainer.metrics import RunLogger
from trainer.parallel import apply, pipeline, stages
from trainer.parallel import mesh as meshes
from trainer.parallel.dims import ParallelDims
from trainer.parallel.parts import ModelParts
from trainer.ranks import World
from trainer.results import Results
from trainer.signals import StopSignal
from trainer.state import LoopState, ModelState, Parts, RankRNG, ScheduleState
from trainer.step import TrainStep, make_scaler
from trainer.strategy import rank_memory
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


@dataclass(kw_only=True, eq=False, frozen=True)
class Run:
    """Everything one rank trains with; complete when build returns (its fields are never
    reassigned: the loop state, results and step change inside their own objects)."""

    cfg: Config
    world: World
    mesh: meshes.Mesh
    """The layout (ParallelDims: dp x pp x tp, how the dp dimension holds the model) and this
    rank's place on it: which slice of the data it reads and whether its loss counts."""
    parts: ModelParts
    """The model as this rank trains it (trainer/parallel/parts.py)."""
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
    resumed: Resume | None = None
    """The checkpoint the run continues from (None: a fresh start)."""
    deferred: bool = False
    """The model was built without storage and only this rank's part materialized
    (trainer/deferred.py), or built whole (False)."""
    build_s: float | None = None
    """Seconds `build` took on this rank: the data, the model (whole or deferred) laid out on
    its device, the optimizer, and the resume or fresh start."""
    model_forward: Callable | None = None
    """A split model's evaluation forward (batch -> output on the last stage), None for a whole
    one (trainer/parallel/stages.py)."""
    watchdog: Watchdog
    """Names a stall (trainer/diagnostics/); train starts it when training starts."""
    stragglers: Stragglers | None = None
    """Rank 0's per-rank forward and data-wait accounting (None elsewhere)."""
    hosts: list | None = None
    """Rank 0: every rank's (node, host), in rank order (None elsewhere)."""
    folder_chosen: bool = False
    """run_dir was left out and the trainer picked a new folder (a rerun would pick another)."""

    @property
    def model(self) -> torch.nn.Module:
        """This rank's parameters under the whole model's names (the model, unwrapped)."""
        return self.parts.view

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
        return epoch_plan(self.cfg, len(self.data.train), epoch, self.data.train)

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
            f"{self.mesh.dims.name}) | global batch {cfg.data.global_batch_size}, "
            f"{self.steps_per_epoch} steps/epoch"
        )


def epoch_plan(cfg: Config, n: int, epoch: int, split=None) -> sampler.EpochPlan:
    """The global batches of training epoch `epoch` over n samples (of `split`: one with
    shard_sizes, data.name=shards's, is read data.shards.window shards at a time)."""
    d = cfg.data
    groups = getattr(split, "shard_sizes", None)
    return sampler.EpochPlan(
        groups=None if groups is None else tuple(groups),
        window=d.shards.window,
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


def _check_shards_fit_batchnorm(cfg: Config, model: torch.nn.Module, n: int, pp: int) -> None:
    """Under repro.world_invariant BatchNorm normalises each shard alone: it needs 2 samples
    (and no pipeline, whose micro-batches would update its running statistics in turn)."""
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    if pp > 1:
        raise ConfigError(
            f"repro.world_invariant=true with dist.mesh={cfg.dist.mesh}: BatchNorm's running "
            "statistics would follow the pipeline's micro-batches, not the shards' fixed tree: "
            "use a model without BatchNorm, or drop pp"
        )
    b, k = cfg.data.global_batch_size, cfg.repro.shards
    tail = n % b if n % b and not cfg.data.drop_last else b
    if min(b, tail, n) // k < 2:
        raise ConfigError(
            f"repro.world_invariant=true: BatchNorm normalises each of the repro.shards={k} "
            f"shards alone and needs 2 samples in each, but a batch of {min(b, tail, n)} gives "
            f"fewer: raise data.global_batch_size to at least {2 * k}, set data.drop_last=true, "
            "or lower repro.shards"
        )


def build(
    cfg: Config,
    world: World,
    dims: ParallelDims,
    *,
    stop: StopSignal,
    started: float,
    plugins: Plugins | None = None,
    folder_chosen: bool = False,
) -> Run:
    """Data, task, model, its layout, optimizer and schedule, then the resume (or a fresh
    start): the Run, complete."""
    began = time.perf_counter()
    mesh, plugins = meshes.build(world, dims), plugins or Plugins()  # a DeviceMesh if split
    spec, task = data_and_task(cfg, world.device, plugins)
    model, later, whole_why = _built(cfg, spec, plugins, world.device, _defers(cfg, dims, plugins))
    flops, peak = _flops(cfg, world, spec, task, model)
    model = lora.prepare(cfg.optim, model, cfg.ckpt)  # what trains
    lora_base = lora.base_report(model)  # the base weights LoRA loaded beneath its adapters
    per_epoch = len(epoch_plan(cfg, len(spec.train), 0))
    total = total_steps(cfg.train, per_epoch)
    if cfg.repro.world_invariant:  # the whole model, before a pipeline splits it
        _check_shards_fit_batchnorm(cfg, model, len(spec.train), mesh.layout.pp)
    if mesh.layout.pp > 1:
        pipeline.check_tail(len(spec.train), cfg, mesh, reached=total >= per_epoch)
    numbering = params.numbering(cfg.optim, model.named_parameters())  # the whole model's
    parts = apply.parallelize(model, mesh, world, cfg.train, later)
    step = _train_step(
        cfg, world, parts, mesh=mesh, task=task, steps=(per_epoch, total), order=numbering
    )
    log = RunLogger(
        main=world.is_main, progress=cfg.log.progress, total_steps=total, epochs=cfg.train.epochs
    )
    if note := apply.note(parts, mesh, world):
        log.info(note)
    if later is None and isinstance(plugins.model, torch.nn.Module) and _splits(dims):
        log.info(BUILT_WHOLE)
    if whole_why:
        log.info(f"note: {whole_why}")
    state = Parts(
        model=ModelState(parts, step.optimizer, mesh, numbering),
        schedule=ScheduleState(step.scheduler, step.scaler),
        loop=LoopState(),
        results=Results(),
        rng=RankRNG(world, cfg.seed),
    )
    ckpt = Checkpointer(cfg, world, state, log)
    resumed = ckpt.restore()
    if resumed is None:
        _fresh_start(cfg, state, log, lora_base)
    hosts = ranks.gather_objects((world.node_rank, repro.hostname()))
    return Run(
        cfg=cfg, world=world, mesh=mesh, parts=parts, data=spec, task=task, step=step,
        ckpt=ckpt, log=log, stop=stop, state=state.loop, results=state.results, resumed=resumed,
        steps_per_epoch=per_epoch, total_steps=total, started=started, flops_per_sample=flops,
        peak_flops=peak, model_forward=stages.evaluator(parts.pipe, task, world.device),
        deferred=later is not None, build_s=time.perf_counter() - began,
        watchdog=_watchdog(cfg, world), hosts=hosts,
        stragglers=Stragglers(world.size) if world.is_main else None, folder_chosen=folder_chosen,
    )  # fmt: skip


def inputs(cfg: Config, device: str, plugins: Plugins) -> tuple:
    """(data, task, model): what the config (or trainer.fit's plugins) names, the model built
    after the same seed on every rank and every world size (the same initial weights), batches
    and model on `device`. What `trainer eval` and `trainer export --merge` start from."""
    spec, task = data_and_task(cfg, device, plugins)
    return spec, task, _built(cfg, spec, plugins, device, defer=False)[0]


def data_and_task(cfg: Config, device: str, plugins: Plugins) -> tuple:
    """(data, task): the seed set first, as every rank and world size does before building."""
    torch.manual_seed(cfg.seed)
    spec = data.build(cfg.data, cfg.seed, device, source=plugins.data)
    return spec, tasks.build(cfg.task, spec, source=plugins.task)


def _splits(dims: ParallelDims) -> bool:
    """Whether no rank is to hold the whole model (FSDP's shards, tp, pipeline stages)."""
    return dims.wraps == "fsdp" or dims.layout.model_parallel


def _defers(cfg: Config, dims: ParallelDims, plugins: Plugins) -> bool:
    """Whether the model is built without storage (trainer/deferred.py): where the layout
    splits it. Not for LoRA (its base weights load into the built model) nor a model
    trainer.fit was handed already built."""
    built = isinstance(plugins.model, torch.nn.Module)
    return _splits(dims) and not cfg.optim.lora_targets and not built


BUILT_WHOLE = (
    "note: trainer.fit was handed a model already built, so every rank holds it whole before "
    "the layout cuts it: hand it the model's factory instead and no rank ever does "
    "(docs/extending.md, 'Deferred construction')"
)


def _built(cfg: Config, spec, plugins: Plugins, device: str, defer: bool) -> tuple:
    """(the model on `device`, None, None), or with `defer` (the model on the meta device, the
    Deferred that gives a part of it its storage and one process's initial values, None). A
    model that cannot be built deferred is built whole: (it, None, why)."""
    why = None
    if defer:
        state = torch.get_rng_state()
        try:
            return (*deferred.build(_model, cfg, spec, plugins.model), None)
        except deferred.CannotDefer as e:
            why = str(e)
            torch.set_rng_state(state)  # the whole build draws what the deferred one began to
    return _model(cfg, spec, plugins.model).to(device), None, why


def _flops(cfg: Config, world: World, spec, task: Task, model) -> tuple:
    """(FLOPs per sample, the device's dense peak FLOP/s), each None where not known.

    Counted only where it is reported (rank 0 logs and writes the summary) and where it means
    something: MFU needs a device whose peak is known (a GPU). Counting costs a model copy, a
    forward/backward and FlopCounterMode's imports (triton's among them): start-up time for a
    number a CPU run never shows."""
    peak = perf.peak_flops(perf.device_name(world.device), cfg.train.precision)
    if not (world.is_main and peak):
        return None, peak
    sample = next(data.eval_batches(spec, 2, 0, 1))
    return perf.flops_per_sample(model, task, sample, world.device), peak


def _train_step(
    cfg: Config, world: World, parts: ModelParts, *, mesh, task: Task, steps: tuple, order
) -> TrainStep:
    """The optimizer (built after the layout: FSDP's must see the sharded parameters), schedule,
    scaler and, under repro.world_invariant, the shard gradients, in one TrainStep (a
    PipelineStep under pp). `steps`: (per epoch, in total); `order`: the whole model's trainable
    names (a pipeline stage's optim.groups are checked against them)."""
    per_epoch, total = steps
    split = parts.pipe is not None
    optimizer = optim.build(cfg.optim, parts.view, order if split else None)
    kind, extra = TrainStep, {}
    if split:
        kind, extra = pipeline.PipelineStep, {"micro_batch": pipeline.micro_batch(cfg, mesh.dims)}
    elif mesh.dims.shards:  # per-shard gradients added in the fixed tree
        extra["shards"] = ShardedGradients(
            parts.running, rank=world.rank, world_size=world.size, shards=mesh.dims.shards,
            grouped=not (cfg.train.compile or cfg.train.activation_checkpointing),
        )  # fmt: skip
    return kind(
        **extra,
        cfg=cfg.train,
        parts=parts,
        mesh=mesh,
        optimizer=optimizer,
        scheduler=optim.build_scheduler(cfg.sched, optimizer, per_epoch, total),
        scaler=make_scaler(cfg.train, world.device),
        task=task,
        device=world.device,
        seed=cfg.seed,
        forward_s=ForwardTimer(world.device),
    )


def _fresh_start(cfg: Config, parts: Parts, log: RunLogger, lora_base=None) -> None:
    """No checkpoint to resume: ckpt.init_weights if set (matched by ckpt.init_*; LoRA's were
    loaded beneath its adapters, `lora_base` their report), then each rank's own RNG stream."""
    if lora_base is not None:
        log.info(f"initial weights from {cfg.ckpt.init_weights} (the base beneath LoRA's adapters)")
        log.info(lora_base.table())
    if cfg.ckpt.init_weights and not cfg.optim.lora_targets:  # LoRA: loaded beneath the adapters
        laid = parts.model.parts  # the model as this rank holds it
        report = load_init(
            laid.view, cfg.ckpt, cfg.model, shapes=laid.shapes, dtypes=laid.dtypes
        )  # the whole model's, so every rank refuses what any would (a stage holds a part)
        log.info(f"initial weights from {cfg.ckpt.init_weights}")
        if not cfg.ckpt.init_strict or report.converted or report.excluded:
            log.info(report.table())
    parts.rng.fresh()


def _watchdog(cfg: Config, world: World) -> Watchdog:
    """The stall watchdog of this rank (trainer/diagnostics/), started when training starts."""
    where = Where(
        world.rank, world.node_rank, repro.hostname(), world.size, world.restart_count,
        os.path.abspath(cfg.run_dir),
    )  # fmt: skip
    return Watchdog(where=where, stall_s=cfg.dist.stall_s, timeout_s=cfg.dist.timeout_s)


def evaluate_saved(cfg: Config, src: str) -> dict:
    """`trainer eval`: the weights at `src` (run dir, checkpoint dir or weights file) on cfg's
    data, built as `trainer train` builds them."""
    world = ranks.from_process(cfg.dist.device, cfg.dist.backend, os.environ)
    with ranks.process_group(world, cfg.dist.timeout_s):
        spec, task, model = inputs(cfg, "cpu", Plugins())  # batches go to the model's device
        if _as_starting_weights(cfg, src):  # matched as ckpt.init_weights would be, strictly
            ckpt = dataclasses.replace(cfg.ckpt, init_weights=src, init_strict=True)
            load_init(model, ckpt, cfg.model)
        else:
            load_weights_into(model, src, model_cfg=cfg.model)
        return evaluate(model.to(world.device), spec, task, world, cfg.data.eval_batch_size)


def _as_starting_weights(cfg: Config, src: str) -> bool:
    """`trainer eval` of weights that are not a run's (no config.yaml beside them, as a run, a
    checkpoint and an export have): a Hugging Face folder (its config.json beside the weights),
    or any such source with ckpt.init_convert=hf_gpt2, ckpt.init_rename or ckpt.init_exclude
    given, is evaluated as a run would start from it (the import checked before any training).
    A run's own weights load as they are, whatever its saved ckpt.init_* said."""
    if find_config(src) is not None:
        return False
    ckpt = cfg.ckpt
    hf_folder = os.path.isfile(os.path.join(src, "config.json")) and hf.is_folder(src)
    return (
        hf_folder or ckpt.init_convert == "hf_gpt2" or bool(ckpt.init_rename or ckpt.init_exclude)
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
