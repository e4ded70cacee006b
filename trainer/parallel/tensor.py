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

from fnmatch import fnmatch

from torch import nn

from trainer import registry
from trainer.errors import ConfigError, did_you_mean, shorten
from trainer.parallel.mesh import Mesh


def plan_of(model: nn.Module, tp: int) -> dict:
    """The model's own plan (`tensor_parallel_plan(tp)`), or one line naming the fix."""
    own = getattr(model, "tensor_parallel_plan", None)
    if not callable(own):
        raise ConfigError(
            f"dist.mesh with tp needs a tensor-parallel plan, but {type(model).__name__} has "
            "none: give it a tensor_parallel_plan(tp) method returning {module name: "
            "ColwiseParallel() or RowwiseParallel()} (docs/extending.md, 'Tensor-parallel "
            "plan'), or use model.name=gpt"
        )
    with registry.plugin_bug(f"{_who(model, tp)}, the model's tensor-parallel plan,"):
        plan = own(tp)
    if not isinstance(plan, dict) or not plan:
        got = "an empty dict" if isinstance(plan, dict) else type(plan).__name__
        raise ConfigError(
            f"{type(model).__name__}.tensor_parallel_plan({tp}) returned {got}: return a dict of "
            "module name -> ColwiseParallel / RowwiseParallel (torch.distributed.tensor.parallel), "
            "as parallelize_module takes"
        )
    return plan


def checked_plan(model: nn.Module, tp: int) -> tuple[dict, int]:
    """(the model's plan, how many modules it splits), checked against the WHOLE model (before
    a pipeline split, on every rank alike) so that what torch would warn about and skip, or
    fail on deep in a forward, is one line naming the plan's key: a key that is not a module
    name, a value that is not a ParallelStyle (the class itself, a string), a key that names no
    module (with the names there are), two keys splitting one module, ColwiseParallel or
    RowwiseParallel on a module that is not a Linear or Embedding, or a split dimension tp does
    not divide (the module's size and tp)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    from trainer.parallel.styles import styles

    plan, who = plan_of(model, tp), _who(model, tp)
    named: dict[str, str] = {}  # module name -> the key that split its weight
    modules: set[str] = set()  # every module a key names
    for key, style in plan.items():
        if not isinstance(key, str):
            raise ConfigError(
                f"{who}: the key {shorten(repr(key))} (of type {type(key).__name__}) is not a "
                "module name: key the plan by module names or fnmatch patterns, e.g. 'layers.*.fc1'"
            )
        if isinstance(style, type) and issubclass(style, ParallelStyle):
            raise ConfigError(
                f"{who}: '{shorten(key)}' maps to the class {style.__name__}, not a style: "
                f"write {style.__name__}() (an instance)"
            )
        if not isinstance(style, ParallelStyle):
            raise ConfigError(
                f"{who}: '{shorten(key)}' maps to {shorten(repr(style))} (a "
                f"{type(style).__name__}), which is not a ParallelStyle: use ColwiseParallel() or "
                "RowwiseParallel() (torch.distributed.tensor.parallel), or "
                "trainer.parallel.styles.fused_colwise(n) for a fused Linear"
            )
        splits = isinstance(style, styles())  # a weight split: twice cannot work
        for name in _resolve(model, key, who):
            modules.add(name)
            if splits and name in named:
                raise ConfigError(
                    f"{who}: '{shorten(key)}' and '{shorten(named[name])}' both split "
                    f"{name or 'the model itself'}, whose weight can be split once: name it once"
                )
            if splits:
                named[name] = key
            _check_divides(who, key, name, model.get_submodule(name), style, tp)
    return plan, len(modules)


def _who(model: nn.Module, tp: int) -> str:
    return f"{type(model).__name__}.tensor_parallel_plan({tp})"


def _resolve(model: nn.Module, key: str, who: str | None) -> list[str]:
    """The names of the modules `key` names, as torch's parallelize_module resolves it (dotted
    fnmatch tokens, one level each; '' the model itself). None matching: one line naming the
    token no child matched and the children there (who None: [] instead)."""
    level = [("", model)]
    for token in key.split(".") if key else []:
        found = [
            (f"{prefix}.{n}" if prefix else n, child)
            for prefix, module in level
            for n, child in module.named_children()
            if fnmatch(n, token)
        ]
        if not found:
            if who is None:
                return []
            there = sorted({n for _, m in level for n, _ in m.named_children()})
            where = ", ".join(p for p, _ in level[:3]) or f"the model ({type(model).__name__})"
            tensors = {n for _, m in level for n, _ in m.named_parameters(recurse=False)}
            listed = ", ".join(there[:12]) or "none"
            held = (
                f" (a parameter's name: key its module, '{shorten(key.rpartition('.')[0])}')"
                if any(fnmatch(n, token) for n in tensors)
                else f"{did_you_mean(token, there)} (its modules: {listed})"
            )
            raise ConfigError(
                f"{who}: the key '{shorten(key)}' names no module: nothing in {where} matches "
                f"'{shorten(token)}'{held}: key the plan by the names named_modules() gives, "
                "fnmatch patterns allowed (e.g. 'layers.*.fc1')"
            )
        level = found
    return [name for name, _ in level]


def _check_divides(who: str, key: str, name: str, module: nn.Module, style, tp: int) -> None:
    """ColwiseParallel / RowwiseParallel (and fused_colwise) split a Linear's or an Embedding's
    weight along one dimension: only those modules, and tp (x the fused parts) must divide it."""
    from trainer.parallel.styles import styles

    colwise, rowwise = styles()
    if not isinstance(style, (colwise, rowwise)):
        return  # a style of the model's own: it knows what it splits
    col = isinstance(style, colwise)
    kind = "ColwiseParallel" if col else "RowwiseParallel"
    if isinstance(module, nn.Linear):
        size, what = (module.out_features, "output") if col else (module.in_features, "input")
        what += " features"
    elif isinstance(module, nn.Embedding):
        size, what = (module.embedding_dim, "dims") if col else (module.num_embeddings, "rows")
    else:
        raise ConfigError(
            f"{who}: '{shorten(key)}' gives {name or 'the model'} ({type(module).__name__}) "
            f"{kind}, which splits an nn.Linear or nn.Embedding only: name the Linear layers "
            f"inside it (e.g. '{name + '.' if name else ''}<linear>'), or give it a ParallelStyle "
            "of your own"
        )
    parts = getattr(style, "fused", 1)
    if size % (tp * parts):
        fused = f" ({parts} fused parts, each split)" if parts > 1 else ""
        raise ConfigError(
            f"{who}: '{shorten(key)}' splits {name} ({type(module).__name__}, {size} {what}) "
            f"{'by columns' if col else 'by rows'} over tp={tp} ranks{fused}, and tp does not "
            f"divide it: make its {what} a multiple of {tp * parts}, or use a tp that divides "
            f"{size // parts}"
        )


def part_plan(plan: dict, part: nn.Module) -> dict:
    """The entries of the (checked) plan that name modules `part` holds: a pipeline stage holds
    some of the model's modules (the others None), and torch warns about every key it skips."""
    return {k: v for k, v in plan.items() if _resolve(part, k, None)}


def parallelize(model: nn.Module, mesh: Mesh, plan: dict | None = None) -> nn.Module:
    """Apply the model's plan (checked_plan's, or the model's own) on the mesh's tp dimension (in
    place: the same module object)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if plan is None:
        plan = checked_plan(model, mesh.layout.tp)[0]
    return parallelize_module(model, mesh.sub("tp"), part_plan(plan, model))
