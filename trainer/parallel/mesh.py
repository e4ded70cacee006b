"""The run's device mesh: this rank's coordinates on dp x pp x tp, its groups, and the one
answer to "which slice of the global batch do I read, and does my loss count" that the sampler,
the loss sums, evaluation, the dry run and the step ask.

Pure data parallelism is the mesh dp=world: the data view is the world itself (rank, size), and
nothing builds a torch DeviceMesh, so such a run is exactly what it was before meshes existed.
Under pp or tp every rank of one data-parallel replica reads the same slice; only the last
pipeline stage's first tensor-parallel rank holds the loss and the metrics, so sums over all
ranks add each replica's once (the others add exact zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.parallel.dims import ParallelDims
from trainer.parallel.layout import DIMS, Layout
from trainer.ranks import World


def coordinates(rank: int, layout: Layout) -> tuple[int, int, int]:
    """(dp, pp, tp) of a global rank: dp-major, tp innermost (init_device_mesh's order)."""
    tp = rank % layout.tp
    pp = (rank // layout.tp) % layout.pp
    return rank // (layout.tp * layout.pp), pp, tp


def rank_of(layout: Layout, dp: int, pp: int, tp: int) -> int:
    """The global rank at (dp, pp, tp)."""
    return (dp * layout.pp + pp) * layout.tp + tp


@dataclass(frozen=True)
class Mesh:
    """The run's layout (ParallelDims) and this rank's place on it: built once per run."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0
    device_mesh: Any = None
    """torch's DeviceMesh over ("dp", "pp", "tp"), built only for a split model."""

    @property
    def layout(self) -> Layout:
        """The mesh's sizes (dp, pp, tp)."""
        return self.dims.layout

    @property
    def data_rank(self) -> int:
        """Which slice of each global batch this rank reads (its data-parallel rank)."""
        return self.dp_rank

    @property
    def data_size(self) -> int:
        """How many slices each global batch is cut into (the data-parallel size)."""
        return self.layout.dp

    @property
    def contributes(self) -> bool:
        """Whether this rank's loss and metrics count: the last pipeline stage's first
        tensor-parallel rank of each replica (every rank under pure data parallelism)."""
        return self.pp_rank == self.layout.pp - 1 and self.tp_rank == 0

    def sub(self, dim: str):
        """The 1-D DeviceMesh of `dim` through this rank (None without a DeviceMesh)."""
        return None if self.device_mesh is None else self.device_mesh[dim]

    def group(self, dim: str):
        """The process group of `dim` through this rank (None without a DeviceMesh)."""
        return None if self.device_mesh is None else self.device_mesh.get_group(dim)

    def peer(self, **coords: int) -> int:
        """The global rank that differs from this one only in the given coordinates."""
        here = {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}
        return rank_of(self.layout, **{**here, **coords})

    def describe(self) -> str:
        """'dp=2,pp=2 (rank 2: dp 1, pp 0)' for the banner."""
        here = ", ".join(
            f"{d} {getattr(self, d + '_rank')}" for d in DIMS if getattr(self.layout, d) > 1
        )
        return f"{self.layout} (rank {self.rank}{': ' + here if here else ''})"


def build(world: World, dims: ParallelDims) -> Mesh:
    """The mesh of this run; a DeviceMesh (a collective: every rank calls this) for a split
    model only."""
    layout = dims.layout
    dp, pp, tp = coordinates(world.rank, layout)
    device_mesh = None
    if layout.model_parallel:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(
            torch.device(world.device).type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=DIMS
        )
    return Mesh(dims, world.rank, dp, pp, tp, device_mesh)


def sharded_groups(t) -> tuple:
    """The process groups of the mesh dimensions a DTensor is sharded over (plain: none)."""
    if not hasattr(t, "placements"):
        return ()
    # Not is_shard(): FSDP's _StridedShard (dp over a tp shard) is a shard it does not count.
    return tuple(
        t.device_mesh.get_group(i) for i, p in enumerate(t.placements) if not p.is_replicate()
    )
