"""How the model is spread over ranks (none | ddp), and how to get the plain module back."""

from __future__ import annotations

from torch import nn

from trainer.dist import DistEnv
from trainer.errors import UsageError


def resolve(strategy: str, denv: DistEnv) -> str:
    """The concrete strategy for this world size."""
    if strategy == "auto":
        return "ddp" if denv.distributed else "none"
    if strategy == "none" and denv.distributed:
        raise UsageError(
            f"dist.strategy=none cannot run on {denv.world_size} ranks (each would train alone): "
            "use dist.strategy=ddp or auto, or launch one process"
        )
    return strategy


def wrap(
    model: nn.Module, strategy: str, denv: DistEnv, device: str, sync_bn: bool = False
) -> nn.Module:
    if strategy == "ddp" and denv.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if sync_bn:
            model = convert_sync_bn(model, device)
        ids = [int(device.split(":")[1])] if device.startswith("cuda") else None
        # DDP broadcasts rank 0's parameters at construction, so every rank starts identical.
        return DDP(model, device_ids=ids)
    return model


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
