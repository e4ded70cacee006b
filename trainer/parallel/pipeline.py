"""Pipeline parallelism (dist.mesh=pp=N): the model's layers split into stages, one (or two,
interleaved) per rank (trainer/parallel/split.py; laid out by apply.py), run by
torch.distributed.pipelining's schedules, looked up by name.

**Exactness.** Each stage accumulates its micro-batches' gradients in order, the loss is the
task's sum scaled as TrainStep scales it, and torch's schedules run with scale_grads=False: the
gradients are one process's with the same micro-batches, bit for bit. A weight tied across stages
(the GPT's embedding and head) is a copy on each; the copies' per-micro-batch gradients are kept
and added in one process's order (tied.py), and gradient clipping stacks every tensor's norm in
the whole model's order (clip.py): so clipping and tied weights keep the bits too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer import batch as batches
from trainer.errors import ConfigError
from trainer.parallel import fixedtree, tied
from trainer.parallel.dims import ParallelDims
from trainer.parallel.mesh import Mesh
from trainer.parallel.stages import make_stages, model_inputs
from trainer.step import TrainStep
from trainer.tasks import checked_loss


def micro_batch(cfg, dims: ParallelDims) -> int:
    """Samples per pipeline micro-batch (cfg: the Config): a shard under repro.world_invariant,
    else train.micro_batch_size, else each replica's slice of the global batch over the stages."""
    b = cfg.data.global_batch_size
    if dims.shards:
        return b // dims.shards
    return cfg.train.micro_batch_size or max(1, b // dims.layout.dp // dims.stages)


def check_tail(n: int, cfg, mesh: Mesh, reached: bool) -> None:
    """One line before any work, not a crash at the end of an epoch: the epoch's last, smaller
    global batch must split into equal micro-batches, at least one per stage, on every dp rank."""
    b, dp = cfg.data.global_batch_size, mesh.layout.dp
    tail = 0 if cfg.data.drop_last else n % b
    if not tail or not reached:
        return
    stages, micro = mesh.dims.stages, micro_batch(cfg, mesh.dims)
    sizes = {(tail * (r + 1)) // dp - (tail * r) // dp for r in range(dp)}
    if len(sizes) == 1 and (size := sizes.pop()) % micro == 0 and size // micro >= stages:
        return
    raise ConfigError(
        f"dist.mesh={mesh.layout}: the epoch's last batch holds {tail} of the {n} training samples, "
        f"which do not split into equal micro-batches of {micro} (at least {stages}) on each of "
        f"{dp} dp rank(s), and a pipeline cannot run unequal ones: set data.drop_last=true, or a "
        "data.global_batch_size that divides the training split"
    )


@dataclass(kw_only=True, eq=False)
class PipelineStep(TrainStep):
    """TrainStep under pp: the rank's slice split into equal micro-batches that flow through the
    stages on torch's schedule; loss and gradient scaling as TrainStep's micro-steps."""

    micro_batch: int = 1
    """Samples per pipeline micro-batch (micro_batch above)."""
    _micro: dict = field(default_factory=dict)
    """This step's micro-batches, loss terms and the micro-batches' summed losses."""
    _stages: list = field(default_factory=list)
    """torch's PipelineStage of each local stage, made at the first step (its shapes)."""
    _schedules: dict = field(default_factory=dict)
    """micro-batch count -> torch's schedule (a tail step may have fewer)."""

    @property
    def tree_shards(self) -> int:
        """repro.world_invariant: K, the shards of each global batch (the micro-batches are
        this replica's K / dp of them), gradients added in the fixed tree; 0: off."""
        return self.mesh.dims.shards

    def _chunks(self, batch) -> list:
        return batches.split(batch, self.micro_batch)

    def __call__(self, batch, global_count: int, index: int = 0) -> torch.Tensor:
        parts, pipe, mesh = self.parts, self.parts.pipe, self.mesh
        self.optimizer.zero_grad(set_to_none=True)
        chunks = self._chunks(batch)
        if len({batches.size(c) for c in chunks}) > 1:
            raise ConfigError(
                f"dist.mesh (pp): a step of {batches.size(batch)} samples per rank splits into "
                "unequal micro-batches, which a pipeline cannot run: set data.drop_last=true "
                "or a data.global_batch_size that the train split divides"
            )
        terms = self._pipeline_terms(global_count, chunks, index)
        # Sum of losses x dp / global terms: after the dp average, sum / terms (the fixed tree
        # adds the replicas' gradients instead: sum / terms).
        factor = (1.0 if self.tree_shards else mesh.data_size) / terms
        self._micro = {"chunks": chunks, "terms": terms, "sums": {}, "factor": factor}
        arg_mbs = [model_inputs(self.task, c) for c in chunks] if pipe.first else None
        if not self._stages:
            self._stages = make_stages(pipe, arg_mbs[0] if arg_mbs else None, self.device)
        copies = {t.names[s] for t in pipe.tied for s in t.names}
        own = [(n, p) for n, p in parts.view.named_parameters() if p.requires_grad]
        own = [(n, p) for n, p in own if n not in copies] if self.tree_shards else []
        with tied.kept_grads(parts) as per_micro, fixedtree.keep_grads(own) as kept:
            self.forward_s.start()
            self._schedule(len(chunks)).step(
                arg_mbs=arg_mbs,
                target_mbs=[torch.tensor(i) for i in range(len(chunks))] if pipe.last else None,
            )
            self.forward_s.stop()
        if self.tree_shards:
            tied.tree_grads(parts, kept, per_micro, len(chunks))
        else:
            tied.add_tied(parts, per_micro, len(chunks))
        self._update()
        sums = self._micro["sums"]
        if self.tree_shards:
            first = mesh.data_rank * len(chunks)
            lead = mesh.contributes and mesh.data_rank == 0
            sums = sums if mesh.contributes else {}
            return fixedtree.step_loss(sums, first, self.tree_shards, terms, lead, self.device)
        if not (mesh.contributes and sums):
            return torch.zeros((), device=self.device)
        total = sums[0]
        for i in range(1, len(chunks)):
            total = total + sums[i]
        return total / terms

    def _micro_loss(self, out, i) -> torch.Tensor:
        """The schedule's loss_fn (built once, so it reads the step's micro-batches from self):
        the task's summed loss of micro-batch `i` (the target handed through the schedule is
        its index: a batch may be any structure), scaled as TrainStep scales a micro-step's."""
        now = self._micro
        local = checked_loss(self.task, self.task.loss(out, now["chunks"][int(i)]))
        # The last call per micro-batch counts: the first step's first may be torch's shape
        # inference on placeholder activations.
        now["sums"][int(i)] = local.detach()
        return self.scaler.scale(local * now["factor"])

    def _pipeline_terms(self, global_count: int, chunks, index: int) -> int:
        """Loss terms in the global batch; counted (one all-reduce) by the ranks whose loss
        counts, when the task has no fixed terms_per_sample."""
        if self.task.terms_per_sample is not None:
            return global_count * self.task.terms_per_sample
        return self._global_terms(
            global_count, lambda: chunks if self.mesh.contributes else [], index
        )

    def _schedule(self, n_micro: int):
        """torch's schedule dist.pp_schedule names, for n_micro micro-batches."""
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )

        if n_micro not in self._schedules:
            kind = get_schedule_class(self.mesh.dims.pp_schedule.replace("-", ""))
            stages = self._stages[0] if issubclass(kind, PipelineScheduleSingle) else self._stages
            self._schedules[n_micro] = kind(
                stages, n_micro, loss_fn=self._micro_loss, scale_grads=False
            )
        return self._schedules[n_micro]
