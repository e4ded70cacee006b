"""How the dp dimension holds each model part: none | ddp | fsdp | dp, as plain functions of the
run's ParallelDims (trainer/parallel/dims.py). `shard` (FSDP) and `replicate` (DDP,
nn.DataParallel) wrap a part for training, the part's storage given between them
(trainer/parallel/apply.py calls them in its fixed order); `no_sync_for` gives the context that
turns off the gradient sync for all micro-steps but the last; `step_split` reads DDP's own
timings. How a checkpoint holds the weights is the checkpointer's decision, from the state itself
(trainer/state.py: DTensor shards or not). `unwrap` gives the user's module back; a state dict
never carries `module.`/`_orig_mod.`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from trainer.parallel.dims import ParallelDims
    from trainer.ranks import World


def shard(
    model: nn.Module,
    dims: ParallelDims,
    world: World,
    dp_mesh=None,
    ignored: Collection[nn.Parameter] = (),
) -> nn.Module:
    """Under fsdp, `model` sharded by FSDP2 (a model on the meta device too: its parts get their
    storage after); else as it is. `ignored`: parameters FSDP leaves whole on every rank (a
    pipeline's weights tied across stages, whose per-micro-batch gradients it adds itself)."""
    if dims.wraps == "fsdp":
        return _fsdp(model, world, dims.fsdp, dp_mesh, ignored)
    return model


def replicate(model: nn.Module, dims: ParallelDims, world: World, dp_mesh=None) -> nn.Module:
    """Under ddp (several replicas), DDP over `dp_mesh`; under dp, nn.DataParallel; else as it
    is. The model's storage must be there: DDP broadcasts rank 0's weights."""
    if dims.wraps == "ddp" and dims.layout.dp > 1:
        return _ddp(model, world, dims.sync_bn, dp_mesh)
    if dims.wraps == "dp":
        return _data_parallel(model, world)
    return model


def _ddp(model: nn.Module, world: World, sync_bn: bool, dp_mesh) -> nn.Module:
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""
    from torch.nn.parallel import DistributedDataParallel

    if sync_bn:
        model = convert_sync_bn(model, world.device)
    ids = [world.local_rank] if world.on_cuda else None
    # DDP broadcasts rank 0's parameters at construction, so every rank starts identical.
    group = None if dp_mesh is None else dp_mesh.get_group()
    return DistributedDataParallel(model, device_ids=ids, process_group=group)


_MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fsdp(model: nn.Module, world: World, options, dp_mesh, ignored) -> nn.Module:
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

    Each shard unit (transformer block, ResNet stage) is sharded on its own, then the root, so
    only one unit's parameters are gathered at a time. train.precision bf16/fp16 computes in
    that dtype and reduces gradients in fp32 into fp32 master shards. FSDP at world 1 runs on a
    one-rank mesh (FSDP2 and DCP need one).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = dp_mesh or init_device_mesh(torch.device(world.device).type, (world.size,))
    dtype = _MP_DTYPES.get(options.precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    offload = CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "mp_policy": policy, "offload_policy": offload}
    if ignored:
        kwargs["ignored_params"] = set(ignored)
    for unit in shard_units(model):
        fully_shard(unit, reshard_after_forward=options.reshard_after_forward, **kwargs)
    # The root's parameters (embeddings, head) are needed again at once by the backward.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def _data_parallel(model: nn.Module, world: World) -> nn.Module:
    """Legacy single-process nn.DataParallel over this process's GPUs (the tutorials' first
    step). Each step scatters the batch and replicates the model from GPU 0; DDP is faster."""
    if not world.on_cuda:
        return model  # DataParallel on the CPU is the bare module (and would want GPU 0)
    return nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())))


def note(dims: ParallelDims, world: World) -> str | None:
    """A line for the user about how the dp dimension holds the model (rank 0 prints it)."""
    if dims.shards:
        k = dims.shards
        return (
            f"repro.world_invariant: {k} shards per global batch, {k // world.size} per rank, "
            f"gradients added in a fixed tree (the same bits on any world size that divides {k})"
        )
    if dims.dp == "dp":
        gpus = torch.cuda.device_count() if world.on_cuda else 0
        where = f"over {gpus} GPU(s)" if gpus else "on the CPU (it only splits work over GPUs)"
        return (
            f"warning: dist.strategy=dp runs nn.DataParallel {where} in one process; "
            "dist.strategy=ddp under torchrun --nproc-per-node=N (one process per GPU) is faster"
        )
    return None


def no_sync_for(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """The context a micro-step whose gradients must not be synchronised yet runs in, for the
    module as it runs (compiled or not): DDP's no_sync, FSDP2's gradient-sync switch (accumulate
    unsharded, reduce-scatter at the last), or nothing."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)  # torch.compile's module: what it compiled
    if isinstance(inner, DistributedDataParallel):
        return inner.no_sync
    if callable(getattr(inner, "set_requires_gradient_sync", None)):  # fully_shard's module
        return functools.partial(_fsdp_no_sync, inner)
    return contextlib.nullcontext


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


_DDP_TIMES = {  # DDP's own averages over its sampled iterations, in ns
    "forward_ms": "avg_forward_compute_time",
    "backward_compute_ms": "avg_backward_compute_time",
    "allreduce_ms": "avg_backward_comm_time",
    "allreduce_overlapped_ms": "avg_backward_compute_comm_overlap_time",
}


def step_split(model: nn.Module) -> dict | None:
    """DDP's sampled timings of this rank (the first iterations, then about every 100th):
    forward, backward compute, the gradient all-reduce, the part of it that overlapped the
    backward, and the rest (`allreduce_exposed_ms`), which the step waited for. None where the
    module is not DDP's (nothing measured)."""
    try:
        data = model._get_ddp_logging_data()
    except (AttributeError, RuntimeError):  # not DDP, or a private API absent in some torch
        return None
    if not all(isinstance(data.get(k), int) for k in _DDP_TIMES.values()):
        return None
    out = {name: data[key] / 1e6 for name, key in _DDP_TIMES.items()}
    out["allreduce_exposed_ms"] = max(0.0, out["allreduce_ms"] - out["allreduce_overlapped_ms"])
    out["last_sampled_iteration"] = data.get("iteration")
    return out


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks a model is made of: what FSDP shards one by one and activation
    checkpointing recomputes. A model lists its own (`shard_units()`, as the GPT does);
    torchvision ResNets give their four residual stages; other models have none."""
    model = unwrap(model)
    own = getattr(model, "shard_units", None)
    if callable(own):
        return list(own())
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    if all(isinstance(s, nn.Module) for s in stages):
        return stages
    return []


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each shard unit's activations in the backward pass instead of storing them.

    The units' forward is wrapped in place (non-reentrant torch.utils.checkpoint), so parameter
    names, and with them state dicts and checkpoints, do not change.
    """
    from torch.utils.checkpoint import checkpoint

    units = shard_units(model)
    if not units:
        raise UsageError(
            f"train.activation_checkpointing=true recomputes a model's blocks, but "
            f"{type(unwrap(model)).__name__} has none that the trainer knows: use model.name=gpt or "
            "resnet18, give your model a shard_units() method, or set it to false"
        )
    for unit in units:
        forward = unit.forward

        @functools.wraps(forward)
        def recomputed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        unit.forward = recomputed


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def rank_memory(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank (its shards under
    fsdp; a gradient counted as the size of its parameter, which a backward allocates)."""
    params = [local_part(p) for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(
        p.numel() * p.element_size()
        for p, q in zip(params, model.parameters(), strict=True)
        if q.requires_grad
    )
    opt_bytes = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v = local_part(v)
                opt_bytes += v.numel() * v.element_size()
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": opt_bytes,
        "total_bytes": param_bytes + grad_bytes + opt_bytes,
    }


def convert_sync_bn(model: nn.Module, device: str) -> nn.Module:
    """BatchNorm*d -> SyncBatchNorm: batch statistics over the whole global batch, not per rank.

    torch implements SyncBatchNorm for GPUs only: on CPU both its forward and DDP's constructor
    raise ValueError, so CPU gets a clear error here instead.
    """
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not has_bn:
        return model
    if not device.startswith("cuda"):  # the same on every rank: rank 0 alone says it
        raise ConfigError(
            "model.sync_bn=true needs CUDA devices: torch's SyncBatchNorm does not run on CPU "
            "(gloo); set model.sync_bn=false (each rank then normalises with its own slice's "
            "statistics)"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module without DDP/DataParallel (`module.`) or torch.compile (`_orig_mod.`)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def plain_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, unshared copies of a state dict's tensors (what safetensors stores)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
