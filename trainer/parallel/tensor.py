"""Tensor parallelism (dist.mesh=tp=N): each layer's weights split over the tp ranks of a
replica, run by torch.distributed.tensor.parallel (DTensor parameters on the mesh's tp dimension).

**The plan.** A model's plan is a dict for torch's `parallelize_module`: module names (fnmatch
patterns such as `blocks.*.fc`) -> ColwiseParallel / RowwiseParallel / any ParallelStyle. A model
gives its own (`tensor_parallel_plan(tp)`, docs/extending.md); the GPT's is `gpt_plan` below,
Megatron's layout: in each block the fused q,k,v projection and the MLP's first layer are split by
output columns (each rank holds heads / tp whole heads and 4 x width / tp hidden units) and the two
output projections by input rows, whose partial sums one all-reduce adds (two a block forward,
two backward). Embeddings, head (tied to the embedding), LayerNorms and biases of the row-parallel
layers stay replicated: every tp rank computes the same activations between blocks, the same
logits and the same loss. No sequence parallelism (LayerNorm and dropout on sequence shards) and
no vocabulary-parallel head: on the sizes this trainer runs they save activation memory that
is not the bottleneck.

**The fused q,k,v weight.** The GPT keeps q, k and v in one [3C, C] Linear. A plain column split
would hand rank 0 all of q and half of k; so the weight is kept as a plain column shard (Shard(0)
of the true [3C, C] weight: checkpoints, FSDP and DCP's resharding see an ordinary weight) and
each forward re-cuts it with one all-to-all into [q_r; k_r; v_r] (DTensor's _StridedShard), the
rows of this rank's heads; the backward sends the gradient back the same way.

**Exactness.** A row-parallel layer adds its ranks' partial products, which one process adds
inside one matrix product in another order: tp runs track one process within ~1e-6 over a short
run, never bit for bit (docs/training.md, "Tensor parallelism").
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.errors import ConfigError, UsageError
from trainer.parallel.mesh import Mesh, sharded_groups
from trainer.strategy import Strategy, _by_parameter_name, unwrap


def _styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def fused_colwise(parts: int):
    """A ColwiseParallel for a Linear whose output is `parts` outputs side by side (the GPT's
    q, k, v): stored as a plain column shard, computed as this rank's slice of every part."""
    from torch.distributed.tensor.placement_types import _StridedShard

    colwise, _ = _styles()

    class FusedColwiseParallel(colwise):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module = super()._apply(module, device_mesh)
            cut = [_StridedShard(0, split_factor=parts)]

            def forward(x, _m=module):
                w = _m.weight.redistribute(device_mesh, cut)
                b = None if _m.bias is None else _m.bias.redistribute(device_mesh, cut)
                return torch.nn.functional.linear(x, w, b)

            module.forward = forward
            return module

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local()  # [q_r, k_r, v_r]: this rank's heads, side by side

    return FusedColwiseParallel()


def gpt_plan(model: nn.Module, tp: int) -> dict:
    """The GPT's plan (see the module's docstring); one line when tp does not split its heads."""
    heads = model.blocks[next(iter(_keys(model.blocks)))].attn.heads
    check_heads(heads, tp, f"{type(model).__name__}'s attention")
    colwise, rowwise = _styles()
    return {
        "blocks.*.attn.qkv": fused_colwise(3),
        "blocks.*.attn.proj": rowwise(),
        "blocks.*.fc": colwise(),
        "blocks.*.proj": rowwise(),
    }


def _keys(container: nn.Module):
    return container.keys() if isinstance(container, nn.ModuleDict) else range(len(container))


def check_heads(heads: int, tp: int, where: str) -> None:
    """tp must divide the attention heads (and so the width and the MLP's 4 x width)."""
    if heads % tp:
        fits = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ConfigError(
            f"dist.mesh tp={tp} does not divide {where}'s {heads} heads (each tp rank holds "
            f"whole heads): use tp in {fits}, or model.gpt.heads a multiple of {tp}"
        )


def plan_of(model: nn.Module, tp: int) -> dict:
    """The model's own plan (`tensor_parallel_plan(tp)`), the GPT's, or one line naming the fix."""
    from trainer.gpt import GPT

    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        plan = own(tp)
        if not isinstance(plan, dict) or not plan:
            raise UsageError(
                f"{type(model).__name__}.tensor_parallel_plan({tp}) returned "
                f"{type(plan).__name__}: return a dict of module name -> ColwiseParallel / "
                "RowwiseParallel (torch.distributed.tensor.parallel), as parallelize_module takes"
            )
        return plan
    if isinstance(model, GPT):
        return gpt_plan(model, tp)
    raise UsageError(
        f"dist.mesh with tp needs a tensor-parallel plan, but {type(model).__name__} has none: "
        "give it a tensor_parallel_plan(tp) method returning {module name: ColwiseParallel() or "
        "RowwiseParallel()} (docs/extending.md, 'Tensor-parallel plan'), or use model.name=gpt"
    )


def parallelize(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Apply the model's plan on the mesh's tp dimension (in place: the same module object)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = plan_of(model, mesh.layout.tp)
    return parallelize_module(model, mesh.sub("tp"), plan)


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for a model whose gradients are DTensors on different meshes (tp,
    dp x tp) and plain tensors (replicated: the same on every tp rank, counted once). The squared
    norms of the local parts are added per set of sharded mesh dimensions, then over those
    dimensions' groups (one all-reduce each): every rank gets the whole model's norm."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sums: dict[tuple, torch.Tensor] = {}
    for g in grads:
        groups = sharded_groups(g)
        square = torch.linalg.vector_norm(_local(g), 2.0, dtype=torch.float32).square()
        sums[groups] = square if groups not in sums else sums[groups] + square
    total = torch.zeros((), dtype=torch.float32, device=_local(grads[0]).device)
    for groups, square in sums.items():
        for group in groups:
            dist.all_reduce(square, group=group)
        total = total + square
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_([_local(g) for g in grads], coef.to(_local(grads[0]).dtype))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class TensorParallel(Strategy):
    """dist.mesh with tp: the plan applied on the tp dimension, then `dp` (none or fsdp, over the
    dp dimension) wraps the model. Whole state dicts are the whole model's (gathered)."""

    needs_group = True

    def __init__(self, dp: Strategy, mesh: Mesh):
        self.dp, self.mesh = dp, mesh
        self.dp_mesh = dp.dp_mesh
        self.name = "tp" if dp.name == "none" else f"{dp.name}+tp"

    def wrap(self, model: nn.Module, world) -> nn.Module:
        parallelize(model, self.mesh)
        return self.dp.wrap(model, world)

    def note(self, world) -> str | None:
        tp = self.mesh.layout.tp
        return f"tensor parallel: each layer split over {tp} ranks, mesh {self.mesh.describe()}"

    def no_sync(self, model: nn.Module):
        return self.dp.no_sync(model)

    def step_split(self, model: nn.Module) -> dict | None:
        return self.dp.step_split(model)

    def clip_grad_norm(self, params, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(params, max_norm)

    def full_state_dict(self, model: nn.Module, world=None) -> dict | None:
        """The whole weights on rank 0 (None elsewhere): every rank gathers (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)
        state = get_model_state_dict(unwrap(model), options=options)
        if world is not None and not world.is_main:
            return None
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        """Whole weights (every rank passes all of them), cut into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(unwrap(model), state, options=options)

    def load_optimizer_state(self, model: nn.Module, optimizer, state: dict) -> None:
        """A whole optimizer state dict (numbered parameters), cut into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        keyed = _by_parameter_name(model, optimizer, state)
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(unwrap(model), optimizer, keyed, options=options)
