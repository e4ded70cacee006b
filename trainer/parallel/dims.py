"""How a run spreads over its ranks, described once (torchtitan's ParallelDims): the mesh's sizes
(dp x pp x tp), how the dp dimension holds the model (none | ddp | fsdp | dp), and the options that
go with it. Plain data and no torch: built from the config and the world size before the process
group exists, read by everything that used to ask a strategy object (the process group, the mesh,
parallelize, the step, the checkpoint's meta.json, the banner and the tracking tags).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainer.parallel.layout import Layout

if TYPE_CHECKING:
    from trainer.config import Config


@dataclass(frozen=True)
class FsdpOptions:
    """FSDP2's settings (fsdp.* and train.precision)."""

    precision: str = "fp32"
    """bf16/fp16: compute in that dtype, reduce gradients in fp32 into fp32 master shards."""
    reshard_after_forward: bool = True
    cpu_offload: bool = False


@dataclass(frozen=True)
class ParallelDims:
    """The layout of one run: the same on every rank, fixed for the run."""

    layout: Layout = field(default_factory=Layout)
    dp: str = "none"
    """How the dp dimension holds the model: none, ddp (a replica per rank, gradients
    all-reduced), fsdp (parameters, gradients and optimizer state sharded) or dp (one process's
    nn.DataParallel over its GPUs)."""
    shards: int = 0
    """repro.world_invariant: the K fixed shards of every global batch (0: off). Replicas are
    then plain (no DDP hooks): the step adds the shard gradients in a fixed tree itself."""
    pp_schedule: str = "1f1b"
    """torch.distributed.pipelining's schedule under pp (gpipe, 1f1b, interleaved-1f1b)."""
    sync_bn: bool = False
    """model.sync_bn under ddp: BatchNorm statistics over the whole global batch."""
    fsdp: FsdpOptions = field(default_factory=FsdpOptions)

    @property
    def wraps(self) -> str:
        """What wraps each model part on the dp dimension: dp's value, but none under
        repro.world_invariant (plain replicas)."""
        return "none" if self.shards else self.dp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages a rank holds: two under interleaved 1F1B, else one."""
        return 2 if self.pp_schedule == "interleaved-1f1b" else 1

    @property
    def stages(self) -> int:
        """Pipeline stages in all (1 without pp)."""
        return self.layout.pp * self.stages_per_rank if self.layout.pp > 1 else 1

    @property
    def needs_group(self) -> bool:
        """A process group even for one process: FSDP2 and DCP work on a device mesh, and a
        split model's collectives run on its groups."""
        return self.wraps == "fsdp" or self.layout.model_parallel

    @property
    def name(self) -> str:
        """'fsdp', 'fsdp+tp', 'ddp+pp', 'tp+pp', ...: the banner's and meta.json's word for it."""
        words = [] if self.dp == "none" and self.layout.model_parallel else [self.dp]
        words += [d for d in ("tp", "pp") if getattr(self.layout, d) > 1]
        return "+".join(words)


def describe(cfg: Config, world_size: int, on_cuda: bool | None = None) -> ParallelDims:
    """The run's ParallelDims from its config on `world_size` ranks (dist.strategy auto: ddp on
    several data-parallel ranks, fsdp for the dp dimension of a tp mesh). A combination that
    cannot run is one ConfigError, the same on every rank: the layout's demands on the model
    too, where they are known without building it (layout.check_model), before any process
    group."""
    from trainer.config import layout_of, resolve_strategy
    from trainer.parallel.layout import check_model

    dp = resolve_strategy(cfg, world_size, on_cuda=on_cuda)
    layout = layout_of(cfg, world_size)
    check_model(cfg, layout)
    if dp == "ddp" and layout.dp == 1 and not cfg.repro.world_invariant:
        dp = "none"  # one replica: nothing to all-reduce
    return ParallelDims(
        layout=layout,
        dp=dp,
        shards=cfg.repro.shards if cfg.repro.world_invariant else 0,
        pp_schedule=cfg.dist.pp_schedule,
        sync_bn=cfg.model.sync_bn,
        fsdp=FsdpOptions(cfg.train.precision, cfg.fsdp.reshard_after_forward, cfg.fsdp.cpu_offload),
    )
