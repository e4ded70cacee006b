"""`dist.mesh` -> the sizes of the mesh's named dimensions; no torch, so `trainer config check`
and every launcher apply the same rules before a process starts.

A mesh is written `dp=2,pp=2` (any order; a dimension left out is 1, except dp, which takes what
the world has left: `pp=2` on 4 ranks is dp=2,pp=2). Ranks are laid out dp-major, tp innermost
(tensor parallelism exchanges the most, so its ranks are neighbours, on one node when they fit).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError

DIMS = ("dp", "pp", "tp")
"""The mesh's dimensions, outermost first: data, pipeline and tensor parallel."""

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""dist.pp_schedule's values: torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B."""


@dataclass(frozen=True)
class Layout:
    """The size of each mesh dimension; their product is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def model_parallel(self) -> bool:
        """Whether the model itself is split (pipeline or tensor parallel)."""
        return self.pp > 1 or self.tp > 1

    def __str__(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) > 1) or "dp=1"


def _fields(text: str) -> dict[str, int]:
    """`dp=2,pp=2` -> {"dp": 2, "pp": 2}; one line naming the fix for anything else."""
    sizes: dict[str, int] = {}
    for part in text.replace(" ", "").split(","):
        name, eq, value = part.partition("=")
        if not eq or name not in DIMS or not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"dist.mesh={text!r}: {part!r} is not a dimension: write sizes like "
                "dist.mesh=dp=2,pp=2 (dimensions dp, pp, tp; each a positive integer)"
            )
        if name in sizes:
            raise ConfigError(f"dist.mesh={text!r}: {name} is given twice: give it once")
        sizes[name] = int(value)
    return sizes


def parse(text: str | None, world_size: int) -> Layout:
    """The layout `dist.mesh` asks for on `world_size` ranks (empty: data parallel only)."""
    if not text or not text.strip():
        return Layout(dp=world_size)
    sizes = _fields(text.strip())
    model = sizes.get("pp", 1) * sizes.get("tp", 1)
    if "dp" not in sizes:
        if world_size % model:
            raise ConfigError(
                f"dist.mesh={text}: pp x tp = {model} does not divide the {world_size} ranks "
                f"launched: launch a multiple of {model} ranks, or change the mesh"
            )
        sizes["dp"] = world_size // model
    layout = Layout(**sizes)
    if layout.size != world_size:
        raise ConfigError(
            f"dist.mesh={text}: dp x pp x tp = {layout.size}, but {world_size} rank(s) were "
            f"launched: launch {layout.size} ranks (e.g. --nproc-per-node={layout.size}), or "
            "change the mesh so its product is the world size"
        )
    return layout
