"""How the model is spread over ranks (none | ddp), behind one small interface.

A Strategy wraps the model for training, turns off the gradient sync for all micro-steps but the
last, and gives the plain module back (`unwrap`) for saving, exporting and evaluation.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from torch import nn

from trainer.errors import UsageError

if TYPE_CHECKING:
    from trainer.ranks import World


class Strategy:
    """none: the model as it is, in one process."""

    name = "none"

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around a micro-step whose gradients must not be synchronised yet."""
        return contextlib.nullcontext()


class DDP(Strategy):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

    name = "ddp"

    def __init__(self, sync_bn: bool = False):
        self.sync_bn = sync_bn

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        if self.sync_bn:
            model = convert_sync_bn(model, world.device)
        ids = [world.local_rank] if world.on_cuda else None
        # DDP broadcasts rank 0's parameters at construction, so every rank starts identical.
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()


def choose(name: str, world: World, *, sync_bn: bool = False) -> Strategy:
    """The strategy dist.strategy names, for this world size (auto: ddp on several ranks)."""
    if name == "auto":
        name = "ddp" if world.distributed else "none"
    if name == "none" and world.distributed:
        raise UsageError(
            f"dist.strategy=none cannot run on {world.size} ranks (each would train alone): "
            "use dist.strategy=ddp or auto, or launch one process"
        )
    if name == "ddp" and world.distributed:
        return DDP(sync_bn=sync_bn)
    return Strategy()


def convert_sync_bn(model: nn.Module, device: str) -> nn.Module:
    """BatchNorm*d -> SyncBatchNorm: batch statistics over the whole global batch, not per rank.

    torch implements SyncBatchNorm for GPUs only: on CPU both its forward and DDP's constructor
    raise ValueError, so CPU gets a clear error here instead.
    """
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not has_bn:
        return model
    if not device.startswith("cuda"):
        raise UsageError(
            "model.sync_bn=true needs CUDA devices: torch's SyncBatchNorm does not run on CPU "
            "(gloo); set model.sync_bn=false (each rank then normalises with its own slice's "
            "statistics)"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module without DDP (`module.`) or torch.compile (`_orig_mod.`) wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
