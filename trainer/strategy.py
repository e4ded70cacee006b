"""How the model is spread over ranks: none | ddp | fsdp | dp, behind one small interface.

A Strategy wraps the model for training, turns off the gradient sync for all micro-steps but the
last, and moves whole (unsharded) state dicts in and out. How a checkpoint holds the weights is
the checkpointer's decision, from the state itself (trainer/state.py: DTensor shards or not).
`unwrap` gives the user's module back; a state dict never carries `module.`/`_orig_mod.`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.errors import UsageError

if TYPE_CHECKING:
    from trainer.config import Config
    from trainer.ranks import World


class Strategy:
    """none: the model as it is, in one process."""

    name = "none"
    needs_group = False
    """A process group even for one process."""
    dp_mesh = None
    """The data-parallel dimension of a model-parallel run's mesh (a 1-D DeviceMesh), which
    DDP and FSDP then span; None: the whole world (pure data parallelism)."""

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        return model

    def note(self, world: World) -> str | None:
        """A line for the user about this choice (rank 0 prints it), or None."""
        return None

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around a micro-step whose gradients must not be synchronised yet."""
        return contextlib.nullcontext()

    def full_state_dict(self, model: nn.Module, world: World | None = None) -> dict | None:
        """The whole model's weights as plain CPU tensors (a collective for sharded strategies:
        every rank calls it). With `world`, only rank 0 receives them (None elsewhere)."""
        if world is not None and not world.is_main:
            return None
        return plain_state_dict(model)

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load whole weights (every rank passes all of them) into the wrapped model."""
        unwrap(model).load_state_dict(state)

    def load_optimizer_state(self, model: nn.Module, optimizer, state: dict) -> None:
        """Load torch's own (whole, index-keyed) optimizer state_dict."""
        optimizer.load_state_dict(state)

    def step_split(self, model: nn.Module) -> dict | None:
        """Where a step's time went, as the wrapper itself measured it (None: not measured)."""
        return None

    def select(self, state: dict) -> dict:
        """This rank's entries of a whole model's state dict (all of them: it holds the model)."""
        return state

    def canonical(self, optim_state: dict, back: bool = False) -> dict:
        """A flattened optimizer state dict under the whole model's parameter names (`back`:
        from them to this rank's); the same names here."""
        return optim_state


_DDP_TIMES = {  # DDP's own averages over its sampled iterations, in ns
    "forward_ms": "avg_forward_compute_time",
    "backward_compute_ms": "avg_backward_compute_time",
    "allreduce_ms": "avg_backward_comm_time",
    "allreduce_overlapped_ms": "avg_backward_compute_comm_overlap_time",
}


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
        group = None if self.dp_mesh is None else self.dp_mesh.get_group()
        return DistributedDataParallel(model, device_ids=ids, process_group=group)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()

    def step_split(self, model: nn.Module) -> dict | None:
        """DDP's sampled timings of this rank (the first iterations, then about every 100th):
        forward, backward compute, the gradient all-reduce, the part of it that overlapped the
        backward, and the rest (`allreduce_exposed_ms`), which the step waited for."""
        try:
            data = model._get_ddp_logging_data()
        except (AttributeError, RuntimeError):  # a private API: absent in some torch version
            return None
        if not all(isinstance(data.get(k), int) for k in _DDP_TIMES.values()):
            return None
        out = {name: data[key] / 1e6 for name, key in _DDP_TIMES.items()}
        out["allreduce_exposed_ms"] = max(0.0, out["allreduce_ms"] - out["allreduce_overlapped_ms"])
        out["last_sampled_iteration"] = data.get("iteration")
        return out


_MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FSDP(Strategy):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

    Each shard unit (transformer block, ResNet stage) is sharded on its own, then the root, so
    only one unit's parameters are gathered at a time. train.precision bf16/fp16 computes in
    that dtype and reduces gradients in fp32 into fp32 master shards.
    """

    name = "fsdp"
    needs_group = True
    """Even on one rank: FSDP2 and DCP work on a device mesh, which needs a process group."""

    def __init__(self, precision: str, reshard_after_forward: bool, cpu_offload: bool):
        self.precision = precision
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.whole: set[nn.Parameter] = set()
        """Parameters left whole on every rank (FSDP's ignored_params): a pipeline's weights
        tied across stages, whose per-micro-batch gradients it adds itself."""

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        mesh = self.dp_mesh or init_device_mesh(torch.device(world.device).type, (world.size,))
        dtype = _MP_DTYPES.get(self.precision)
        policy = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None
        )
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        options = {"mesh": mesh, "mp_policy": policy, "offload_policy": offload}
        if self.whole:
            options["ignored_params"] = self.whole
        for unit in shard_units(model):
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **options)
        # The root's parameters (embeddings, head) are needed again at once by the backward.
        fully_shard(model, reshard_after_forward=False, **options)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        model.set_requires_gradient_sync(False)  # accumulate unsharded; reduce-scatter at the last
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_state_dict(self, model: nn.Module, world: World | None = None) -> dict | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload keeps the whole weights on global rank 0 only; a model split over a mesh
        # needs them on each stage's dp rank 0, so there every rank gathers its stage's.
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.dp_mesh is None)
        state = get_model_state_dict(model, options=options)  # all-gathers; rank 0 keeps it
        if world is not None and not world.is_main:
            return None
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}

    def load_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state(self, model: nn.Module, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        keyed = _by_parameter_name(model, optimizer, state)
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, keyed, options=options)


class DataParallel(Strategy):
    """Legacy single-process nn.DataParallel over this process's GPUs (the tutorials' first
    step). Each step scatters the batch and replicates the model from GPU 0; DDP is faster."""

    name = "dp"

    def note(self, world: World) -> str | None:
        gpus = torch.cuda.device_count() if world.on_cuda else 0
        where = f"over {gpus} GPU(s)" if gpus else "on the CPU (it only splits work over GPUs)"
        return (
            f"warning: dist.strategy=dp runs nn.DataParallel {where} in one process; "
            "dist.strategy=ddp under torchrun --nproc-per-node=N (one process per GPU) is faster"
        )

    def wrap(self, model: nn.Module, world: World) -> nn.Module:
        if not world.on_cuda:
            return model  # DataParallel on the CPU is the bare module (and would want GPU 0)
        return nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())))


class WorldInvariant(Strategy):
    """repro.world_invariant over strategy none or ddp: a plain replica per rank (no DDP hooks);
    the train step combines the shard gradients itself (trainer/invariant.py). Every rank builds
    the same initial weights from the seed, or loads the same checkpoint."""

    def __init__(self, name: str, shards: int):
        self.name, self.shards = name, shards

    def note(self, world: World) -> str | None:
        return (
            f"repro.world_invariant: {self.shards} shards per global batch, "
            f"{self.shards // world.size} per rank, gradients added in a fixed tree (the same "
            f"bits on any world size that divides {self.shards})"
        )


def choose(cfg: Config, world: World) -> Strategy:
    """The strategy dist.strategy names, checked against this world (auto: ddp on several ranks).

    Mistakes are the same on every rank, so they are ConfigErrors: rank 0 reports them.
    """
    from trainer.config import layout_of, resolve_strategy

    name = resolve_strategy(cfg, world.size, on_cuda=world.on_cuda)
    dp = layout_of(cfg, world.size).dp
    if cfg.repro.world_invariant:
        return WorldInvariant(name, cfg.repro.shards)
    if name == "fsdp":
        return FSDP(cfg.train.precision, cfg.fsdp.reshard_after_forward, cfg.fsdp.cpu_offload)
    if name == "dp":
        return DataParallel()
    if name == "ddp" and dp > 1:
        return DDP(sync_bn=cfg.model.sync_bn)
    return Strategy()


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


def _by_parameter_name(model: nn.Module, optimizer, state: dict) -> dict:
    """torch's optimizer state_dict keyed by parameter name instead of number: the form
    torch.distributed.checkpoint's set_* functions take. A whole checkpoint numbers the trainable
    parameters group after group (optim.groups, optim.decay), as `optimizer`, built by the same
    config over the same model, does."""
    names = optimizer_names(model, optimizer)
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def optimizer_names(model: nn.Module, optimizer) -> list[str]:
    """The names of `optimizer`'s parameters in the order its state_dict numbers them."""
    name_of = {id(p): n for n, p in unwrap(model).named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


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
    """The user's module without DDP/DataParallel (`module.`) or torch.compile (`_orig_mod.`)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU, contiguous, unshared tensors of the unwrapped model: no `module.`/`_orig_mod.` keys."""
    return {
        k: v.detach().to("cpu").contiguous().clone() for k, v in unwrap(model).state_dict().items()
    }
