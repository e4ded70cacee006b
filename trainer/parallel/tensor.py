"""Tensor parallelism (dist.mesh=tp=N): each layer's weights split over the tp ranks of a
replica, run by torch.distributed.tensor.parallel (DTensor parameters on the mesh's tp dimension).

**The plan.** A model registers its own: a `tensor_parallel_plan(tp)` method returning a dict for
torch's `parallelize_module`, module names (fnmatch patterns such as `blocks.*.fc`) ->
ColwiseParallel / RowwiseParallel / any ParallelStyle (docs/extending.md). The GPT's is beside it
(GPT.tensor_parallel_plan, Megatron's layout, with trainer/parallel/styles.py's fused q,k,v
split). No sequence parallelism (LayerNorm and dropout on sequence shards) and no
vocabulary-parallel head: on the sizes this trainer runs they save activation memory that is not
the bottleneck.

**Exactness.** A row-parallel layer adds its ranks' partial products, which one process adds
inside one matrix product in another order: tp runs track one process within ~1e-6 over a short
run, never bit for bit (docs/training.md, "Tensor parallelism"). Clipping sees every gradient's
whole norm (trainer/parallel/clip.py).
"""

from __future__ import annotations

from torch import nn

from trainer.errors import UsageError
from trainer.parallel.mesh import Mesh


def plan_of(model: nn.Module, tp: int) -> dict:
    """The model's own plan (`tensor_parallel_plan(tp)`), or one line naming the fix."""
    own = getattr(model, "tensor_parallel_plan", None)
    if not callable(own):
        raise UsageError(
            f"dist.mesh with tp needs a tensor-parallel plan, but {type(model).__name__} has "
            "none: give it a tensor_parallel_plan(tp) method returning {module name: "
            "ColwiseParallel() or RowwiseParallel()} (docs/extending.md, 'Tensor-parallel "
            "plan'), or use model.name=gpt"
        )
    plan = own(tp)
    if not isinstance(plan, dict) or not plan:
        raise UsageError(
            f"{type(model).__name__}.tensor_parallel_plan({tp}) returned "
            f"{type(plan).__name__}: return a dict of module name -> ColwiseParallel / "
            "RowwiseParallel (torch.distributed.tensor.parallel), as parallelize_module takes"
        )
    return plan


def parallelize(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Apply the model's plan on the mesh's tp dimension (in place: the same module object)."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh.sub("tp"), plan_of(model, mesh.layout.tp))
