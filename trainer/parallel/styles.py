"""Tensor-parallel styles a model's own plan may use beside torch's ColwiseParallel and
RowwiseParallel, and the check every attention plan makes; imported by the models that register
a plan (the GPT's is GPT.tensor_parallel_plan), so it sits below them and imports no model.

**The fused q,k,v weight.** The GPT keeps q, k and v in one [3C, C] Linear. A plain column split
would hand rank 0 all of q and half of k; so the weight is kept as a plain column shard (Shard(0)
of the true [3C, C] weight: checkpoints, FSDP and DCP's resharding see an ordinary weight) and
each forward re-cuts it with one all-to-all into [q_r; k_r; v_r] (DTensor's _StridedShard), the
rows of this rank's heads; the backward sends the gradient back the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.errors import ConfigError


def styles():
    """torch's (ColwiseParallel, RowwiseParallel), imported when a plan is made."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def fused_colwise(parts: int):
    """A ColwiseParallel for a Linear whose output is `parts` outputs side by side (the GPT's
    q, k, v): stored as a plain column shard, computed as this rank's slice of every part."""
    from torch.distributed.tensor.placement_types import _StridedShard

    colwise, _ = styles()

    class FusedColwiseParallel(colwise):
        fused = parts
        """The outputs side by side: tp must divide each (tensor.checked_plan checks)."""

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


def check_heads(heads: int, tp: int, where: str) -> None:
    """tp must divide the attention heads (and so the width and the MLP's 4 x width)."""
    if heads % tp:
        fits = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ConfigError(
            f"dist.mesh tp={tp} does not divide {where}'s {heads} heads (each tp rank holds "
            f"whole heads): use tp in {fits}, or model.gpt.heads a multiple of {tp}"
        )
