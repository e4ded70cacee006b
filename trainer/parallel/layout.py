"""`dist.mesh` -> the sizes of the mesh's named dimensions; no torch, so `trainer config check`
and every launcher apply the same rules before a process starts.

A mesh is written `dp=2,pp=2` (any order; a dimension left out is 1, except dp, which takes what
the world has left: `pp=2` on 4 ranks is dp=2,pp=2). Ranks are laid out dp-major, tp innermost
(tensor parallelism exchanges the most, so its ranks are neighbours, on one node when they fit).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError, shorten

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
        # ASCII digits only ('²' and '٢' are digits int() refuses), and no 5,000-digit size
        digits = value.isascii() and value.isdigit() and len(value) <= 9
        if not eq or name not in DIMS or not digits or int(value) < 1:
            raise ConfigError(
                f"dist.mesh={shorten(text)!r}: {shorten(part)!r} is not a dimension: write sizes "
                "like dist.mesh=dp=2,pp=2 (dimensions dp, pp, tp; each a positive integer)"
            )
        if name in sizes:
            raise ConfigError(f"dist.mesh={shorten(text)!r}: {name} is given twice: give it once")
        sizes[name] = int(value)
    return sizes


def _ranks(n: int) -> str:
    """How a world of `n` ranks is asked for: a launch, or `trainer config check` (where the
    message comes before any rank exists: it must not say ranks were launched)."""
    return f"e.g. --nproc-per-node={n}; trainer config check: --world-size={n}"


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
                f"of the job: run it on a multiple of {model} ranks ({_ranks(model)}), or change "
                "the mesh"
            )
        sizes["dp"] = world_size // model
    layout = Layout(**sizes)
    if layout.size != world_size:
        raise ConfigError(
            f"dist.mesh={text}: dp x pp x tp = {layout.size}, but {world_size} rank(s) make up "
            f"the job: run it on {layout.size} ranks ({_ranks(layout.size)}), or change the mesh "
            "so its product is the world size"
        )
    return layout


SPLITS = {"gpt": ("pp", "tp")}
"""The built-in models a split layout can cut, and how: the GPT has pipeline split points (its
blocks) and a tensor-parallel plan; mlp, lenet, resnet18 and vgg11 have neither."""


def check_model(cfg, layout: Layout) -> str | None:
    """What `layout` asks of the model named by `cfg` (a Config), checked without building it,
    so `trainer config check --world-size` and every rank refuse it before any work: a built-in
    model without split points (pp) or a plan (tp) is one line, and pp's stages must split the
    GPT's model.gpt.layers blocks evenly. A plug-in model is checked when it is built (its
    pipeline_layers() and tensor_parallel_plan(tp)): the note saying so, or None."""
    from trainer.registry import MODELS

    name, mesh = cfg.model.name, f"dist.mesh={cfg.dist.mesh}"
    wanted = [d for d in ("pp", "tp") if getattr(layout, d) > 1]
    if not wanted:
        return None
    if name not in MODELS:
        what = " and ".join(_WHAT[d] for d in wanted)
        plugin = f"model.name={shorten(name)} is a plug-in"
        return f"{mesh}: {plugin}, so its {what} are checked when it is built"
    for dim in wanted:
        if dim not in SPLITS.get(name, ()):
            has = "pipeline_layers()" if dim == "pp" else "tensor_parallel_plan(tp)"
            size = getattr(layout, dim)
            raise ConfigError(
                f"{mesh}: model.name={name} has no {_WHAT[dim]}, which {dim}={size} needs: use "
                f"model.name=gpt, a model of your own with a {has} method "
                f"(docs/extending.md, '{_DOC[dim]}'), or drop {dim} from dist.mesh"
            )
    if layout.pp > 1 and name == "gpt":
        _check_gpt_stages(cfg, layout)
    return None


_WHAT = {"pp": "pipeline split points", "tp": "tensor-parallel plan"}
_DOC = {"pp": "Pipeline stages", "tp": "Tensor-parallel plan"}


def _check_gpt_stages(cfg, layout: Layout) -> None:
    """pp x stages per rank must divide the GPT's blocks: each stage holds an equal run."""
    per = 2 if cfg.dist.pp_schedule == "interleaved-1f1b" else 1
    blocks = cfg.model.kwargs.get("layers", cfg.model.gpt.layers)
    key = "model.kwargs.layers" if "layers" in cfg.model.kwargs else "model.gpt.layers"
    stages = layout.pp * per
    if not isinstance(blocks, int) or blocks % stages == 0:
        return
    fits = [str(p) for p in range(2, blocks // per + 1) if blocks % (p * per) == 0]
    use = f"use pp={' or pp='.join(fits)}" if fits else "drop pp"
    if per > 1:
        use += " (or dist.pp_schedule=1f1b, one stage per rank)"
    interleaved = (
        f" ({per} per rank under dist.pp_schedule={cfg.dist.pp_schedule})" if per > 1 else ""
    )
    raise ConfigError(
        f"dist.mesh={cfg.dist.mesh}: {stages} pipeline stages{interleaved} cannot split "
        f"{key}={blocks} blocks evenly (each stage holds an equal run of whole blocks): {use}, "
        f"or make {key} a multiple of {stages}"
    )
