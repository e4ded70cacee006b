"""One optimizer step on this rank's slice of the global batch.

Loss normalisation: each rank sums its loss terms (the Task's loss: one per sample, one per token
for lm, or as many as the task's count() says) and scales by world_size / global_terms; data
parallelism averages gradients over ranks, so every step's gradient is sum(all loss terms) /
global_terms, exactly a single-process step on the whole global batch (the world size changes
only the order of the floating-point sum). global_terms is known from the global sample count
when the task has a fixed terms_per_sample, else the ranks add their counts in one all-reduce. A
rank with an empty slice contributes zero and still joins the gradient all-reduce.
"""

from __future__ import annotations

import functools
import operator
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer import batch as batches
from trainer import ranks
from trainer.config import TrainConfig
from trainer.diagnostics import ForwardTimer
from trainer.invariant import ShardedGradients, seed_shard
from trainer.parallel.clip import clipper
from trainer.parallel.mesh import Mesh
from trainer.parallel.parts import ModelParts
from trainer.strategy import no_sync_for
from trainer.tasks import Task, checked_count, checked_loss, forward, no_terms

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compiled_loss(cfg: TrainConfig, parts: ModelParts, mesh: Mesh, task: Task) -> tuple:
    """(the wrapped model before torch.compile, the task's forward and loss compiled as one
    function of (model, batch)) under train.compile and train.compile_loss, else (None, None).
    One graph for a plain model; DDP's and FSDP's forward hooks break it, so there the loss is
    a compiled graph of its own, fed the model's graph's output. A whole model only: a
    pipeline's last stage computes the loss in its schedule (its stages compiled alone)."""
    inner = getattr(parts.running, "_orig_mod", None)
    if not (cfg.compile and cfg.compile_loss) or inner is None or mesh.layout.model_parallel:
        return None, None

    def model_loss(model: nn.Module, batch) -> torch.Tensor:
        return task.loss(task.forward(model, batch), batch)

    return inner, torch.compile(model_loss)


def make_scaler(cfg: TrainConfig, device: str) -> torch.amp.GradScaler:
    """fp16's loss scaler (a disabled pass-through otherwise); its state is checkpointed."""
    return torch.amp.GradScaler(
        torch.device(device).type, init_scale=cfg.fp16_init_scale, enabled=cfg.precision == "fp16"
    )


@dataclass(kw_only=True, eq=False)
class TrainStep:
    """One optimizer step: the model (wrapped for training) and what updates it, and how a step
    runs. What of them a checkpoint holds is trainer/state.py's (ModelState, ScheduleState).

    Micro-steps (train.micro_batch_size) accumulate gradients without synchronising until the
    last, so there is one all-reduce per step and the gradient equals the unsplit step's.
    A rank with an empty slice still runs one (empty) micro-step to join that all-reduce.
    """

    cfg: TrainConfig
    parts: ModelParts
    """The model as this rank trains it (trainer/parallel/parts.py): a whole model runs as
    parts.running; the optimizer holds parts.view's parameters."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    task: Task
    """What the loss is and how a batch reaches the model (trainer/tasks.py)."""
    mesh: Mesh = field(default_factory=Mesh)
    """The run's layout and this rank's place (trainer/parallel/mesh.py): how many slices a
    global batch is cut into, and whether this rank's loss counts (under tp every rank of a
    replica computes the same loss, and only its first returns it and counts its terms)."""
    device: str = "cpu"
    skipped_steps: int = 0
    """fp16 steps skipped for an inf/nan gradient."""
    shards: ShardedGradients | None = None
    """repro.world_invariant: per-shard gradients summed in a fixed tree (trainer/invariant.py)."""
    seed: int = 0
    """Seeds each shard's dropout (with the step and shard index) under repro.world_invariant."""
    forward_s: ForwardTimer = field(default_factory=lambda: ForwardTimer("cpu"))
    """This rank's forward time (straggler accounting: trainer/diagnostics/stragglers.py)."""
    _start_key: tuple | None = field(default=None, repr=False)
    _start_grad: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Read once: a step asked the scaler and the precision's dtype twice (~1% of a small
        # model's step went to such calls, all of them run cold after the step's kernels).
        self._fp16 = self.scaler.is_enabled()
        self._dtype = _DTYPES[self.cfg.precision]
        self._world_size = self.mesh.data_size
        self._contributes = self.mesh.contributes
        self._running = self.parts.running
        self._inner, self._compiled_loss = compiled_loss(self.cfg, self.parts, self.mesh, self.task)
        self._no_sync = no_sync_for(self._running)
        self._clip_to = clipper(self.parts, self.mesh)

    @property
    def fast_paths(self) -> dict[str, bool]:
        """What run.json records of the kernels this step chose: the loss compiled with the
        forward (train.compile_loss), Adam's fused update (optim.fused)."""
        fused = any(bool(g.get("fused")) for g in self.optimizer.param_groups)
        return {"loss_compiled": self._compiled_loss is not None, "fused_optimizer": fused}

    @property
    def model(self) -> nn.Module:
        """The module a whole model runs as (wrapped, compiled)."""
        return self.parts.running

    def _chunks(self, batch) -> list:
        return batches.split(batch, self.cfg.micro_batch_size)

    def __call__(self, batch, global_count: int, index: int = 0) -> torch.Tensor:
        """Returns this rank's share of the step's global mean loss (detached): summed over
        ranks, the global mean loss.

        batch: this rank's slice (trainer/batch.py), on the device; global_count: samples in
        the whole global batch, over all ranks; index: the optimizer step's number (seeds
        dropout under repro.world_invariant).
        """
        if self.cfg.channels_last:
            batch = batches.map_tensors(_channels_last, batch)
        if self.shards is not None:
            return self._world_invariant(batch, global_count, index)
        self.optimizer.zero_grad(set_to_none=True)
        chunks = self._chunks(batch)
        terms = self._global_terms(global_count, lambda: chunks, index)
        # Sum of losses x world / global terms: after the gradient average, sum / terms.
        factor = self._world_size / terms
        *early, last = chunks
        sums = []
        for chunk in early:  # accumulated without the gradient all-reduce
            with self._no_sync():
                sums.append(self._backward(chunk, factor))
        sums.append(self._backward(last, factor))  # the gradient all-reduce (DDP)
        total = functools.reduce(operator.add, sums)  # in micro-step order
        self._update()
        return total / terms if self._contributes else torch.zeros_like(total)

    def _global_terms(self, global_count: int, pieces, index: int) -> int:
        """Loss terms in the whole global batch: from the sample count for a task with a fixed
        terms_per_sample, else the ranks' counts of their `pieces()` added in one all-reduce."""
        per_sample = self.task.terms_per_sample
        if per_sample is not None:
            return global_count * per_sample
        pieces = pieces if self._contributes else list
        local = sum(checked_count(self.task, self.task.count(p)) for p in pieces())
        total = torch.tensor(float(local), dtype=torch.float64, device=self.device)
        terms = int(ranks.all_reduce_sum(total).item())
        if terms == 0:
            raise no_terms(self.task, index + 1)
        return terms

    def _backward(self, batch, factor: float) -> torch.Tensor:
        """Forward, summed loss, backward of loss x factor (scaled for fp16); the summed loss.

        Without a loss scaler the factor is the gradient backward starts from: the gradient
        (loss x factor).backward() would pass on, float32(factor), the same bits, without the
        multiplication and its backward node (two tensor ops a micro-step). A loss that is not
        a plain tensor (a DTensor from a model's own tensor-parallel plan) takes the product."""
        local = self._summed(batch)
        if self._fp16 or type(local) is not torch.Tensor:
            self.scaler.scale(local * factor).backward()
        else:
            local.backward(self._start(factor, local))
        return local.detach()

    def _loss(self, batch, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and summed loss: (loss x factor, scaled for fp16: what backward runs on;
        the summed loss, detached)."""
        local = self._summed(batch)
        return self.scaler.scale(local * factor), local.detach()

    def _summed(self, batch) -> torch.Tensor:
        """The forward and the task's summed loss under the precision's autocast: bf16/fp16, and
        no context at all in fp32 (a disabled autocast still cost ~30 us a step, 1% of a small
        model's)."""
        if self._dtype is None:
            return self._forward_loss(batch)
        with torch.autocast(torch.device(self.device).type, dtype=self._dtype):
            return self._forward_loss(batch)

    def _forward_loss(self, batch) -> torch.Tensor:
        """The forward (timed for the straggler report) and the task's summed loss; under
        train.compile_loss both in one compiled graph (timed together)."""
        self.forward_s.start()
        if self._compiled_loss is not None:
            try:
                loss = self._compiled_loss(self._inner, batch)
            except Exception:
                # One process only: a rank rerunning alone would wait in a collective the
                # others never join (DDP's buffer broadcast, FSDP's gathers).
                if self._world_size == 1 and (mistake := self._eager_mistake(batch)):
                    raise mistake from None
                raise
            self.forward_s.stop()
            return checked_loss(self.task, loss)
        out = forward(self.task, self._running, batch)
        self.forward_s.stop()
        return checked_loss(self.task, self.task.loss(out, batch))

    def _eager_mistake(self, batch) -> Exception | None:
        """After the compiled forward and loss failed: the same two eagerly, so that a mistake
        in the task, the model or the data reads as it does without compile (dynamo wraps it in
        a long TorchRuntimeError), with the forward's one-line translations: the exception the
        eager run raised, or None when it ran (the compiler's own failure then stands)."""
        try:
            with torch.no_grad():
                self.task.loss(forward(self.task, self._inner, batch), batch)
        except Exception as e:
            return e
        return None

    def _start(self, factor: float, like: torch.Tensor) -> torch.Tensor:
        """`factor` as the 0-dim gradient backward starts from at `like`, made again when the
        factor changes (a tail batch, a task whose term count varies) or when a backward changed
        it in place (its version counter moved: a custom autograd Function may)."""
        key = (factor, like.dtype, like.device)
        grad = self._start_grad
        if self._start_key != key or grad is None or grad._version != 0:
            self._start_key = key
            grad = self._start_grad = torch.full((), factor, dtype=like.dtype, device=like.device)
        return grad

    def _loss_for(self, terms: int):
        return lambda piece: self._loss(piece, 1.0 / terms)

    def _world_invariant(self, batch, global_count: int, index: int) -> torch.Tensor:
        """Each of this rank's shards on its own, then the fixed tree over all shards; the same
        bits for every world size dividing repro.shards (trainer/invariant.py)."""
        shards = self.shards
        mine = [(k, *shards.bounds(k, global_count)) for k in shards.shards_here()]
        pieces = lambda: [batches.cut(batch, lo, hi) for _, lo, hi in mine]  # noqa: E731
        terms = self._global_terms(global_count, pieces, index)
        micro, widest = self.cfg.micro_batch_size, max(hi - lo for _, lo, hi in mine)
        whole = not micro or widest <= micro  # each shard's gradient is one backward pass
        # Whole shards go through one backward pass per group (of at most micro samples).
        group = max(1, micro // max(widest, 1)) if micro else len(mine)
        seed = lambda k: seed_shard(self.seed, index, k, self.device)  # noqa: E731
        grouped = whole and shards.grouped
        # Each cut starts on ALIGN bytes, wherever this world puts it (batch.aligned)
        cut = lambda lo, hi: batches.aligned(batches.cut(batch, lo, hi))  # noqa: E731
        cuts = [(k, cut(lo, hi) if hi > lo else None) for k, lo, hi in mine]
        if not (grouped and shards.run_grouped(cuts, group, self._loss_for(terms), seed)):
            shards.begin(fold=whole)
            for k, lo, hi in mine:
                shards.start_shard()
                local = torch.zeros((), dtype=torch.float32, device=self.device)
                if hi > lo:  # an empty shard (a tail batch smaller than the shards) adds zeros
                    seed(k)
                    for chunk in self._chunks(batches.cut(batch, lo, hi)):
                        local += self._backward(batches.aligned(chunk), 1.0 / terms)
                shards.end_shard(local)
        losses = shards.combine()
        self._update()
        # Rank 0 carries the whole step's loss and the others zero, so the loop's sum over
        # ranks adds only exact zeros to it.
        mean = losses.sum() / terms
        return mean if shards.rank == 0 else torch.zeros_like(mean)

    def _update(self) -> None:
        """Clip, step (skipped on an fp16 overflow), update the loss scale, advance the lr."""
        if self.cfg.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            self._clip_to(self.cfg.clip_grad_norm)
        if not self._fp16:
            self.optimizer.step()
            self.scheduler.step()
            return
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.get_scale() >= scale:
            self.scheduler.step()
            return
        self.skipped_steps += 1
        with warnings.catch_warnings():
            # After a skipped fp16 step torch warns the schedule may skip its first value; ours
            # is a pure function of the step count, which counts skipped steps too.
            warnings.filterwarnings(
                "ignore", message=re.escape("Detected call of `lr_scheduler.step()`")
            )
            self.scheduler.step()


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """train.channels_last: 4-d inputs (images) in channels-last memory, as the weights are."""
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
