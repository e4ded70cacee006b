"""Saved state keyed by parameter name, for every layout, through torch.distributed.checkpoint's
state-dict API (get_/set_state_dict and their model and optimizer halves): the one place that
turns a laid-out model (trainer/parallel/parts.py) and its optimizer into saved state and back.

Both checkpoint formats key everything by the whole model's parameter names: DCP shards hold the
flattened form ("state.blocks.0.fc.weight.exp_avg", "param_groups.blocks.0.fc.weight.lr"), whole
files the nested one ({"state": {name: ...}, "param_groups": [{"params": [names], ...}]}). DCP
reshards, gathers and cuts what any layout holds (FSDP's shards, tp's DTensors, a pipeline
stage's part), so any layout's state loads into any other with no remapping of ours: a stage
takes the names it holds, FSDP and tp cut whole tensors into their shards. What is left to us is
a name, not an index: a weight tied across pipeline stages is saved under its whole-model name
(`ModelParts.aliases`), and checkpoints written before names (index-keyed whole optimizer state,
main at 3a8a994 and older) are read through `by_name`.

DCP's state-dict module imports in ~1 s on its own (0.06 s once torch._dynamo, which every
optimizer step imports, is in): so every import of it here is inside a function.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from trainer import ranks
from trainer.errors import first_line
from trainer.parallel.mesh import Mesh
from trainer.parallel.parts import ModelParts
from trainer.strategy import local_part


class StateMismatch(ValueError):
    """A saved state that does not fit this run; `part` names which (model, optimizer,
    scheduler, scaler) and `detail` says how."""

    def __init__(self, part: str, detail: str):
        super().__init__(f"{part}: {detail}")
        self.part, self.detail = part, detail


@contextlib.contextmanager
def loading(part: str):
    """A loader's complaint about the saved contents -> StateMismatch naming the part."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise StateMismatch(part, first_line(e)) from None


def fit_problem(model: nn.Module, state: dict) -> str | None:
    """How a state dict fails to fit `model` (names first, then shapes, then kinds of dtype),
    or None if it fits."""
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        return f"missing {missing[:5]}, unexpected {unexpected[:5]}"
    for name, tensor in expected.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            return f"{name} has shape {tuple(state[name].shape)} there, {tuple(tensor.shape)} here"
    return dtype_mismatch(expected, state)


def dtype_mismatch(expected: dict, state: dict) -> str | None:
    """The first key both state dicts hold whose dtypes are of different kinds (dtype_problem),
    or None."""
    for name, tensor in expected.items():
        if name in state and (problem := dtype_problem(name, state[name].dtype, tensor.dtype)):
            return problem
    return None


def dtype_kind(dtype: torch.dtype) -> str:
    """floating point, complex, boolean or integer: what a load may cast within, never across."""
    if dtype.is_floating_point:
        return "floating point"
    if dtype.is_complex:
        return "complex"
    return "boolean" if dtype == torch.bool else "integer"


def dtype_problem(name: str, there: torch.dtype, here: torch.dtype) -> str | None:
    """Why a saved tensor of dtype `there` may not load into one of dtype `here`, or None. A
    float into another float is a cast (fp16/bf16 weights into an fp32 model); an integer or
    boolean into a float parameter (or the reverse) would turn ids, counts or masks into
    weights: refused, naming the key and both dtypes."""
    if dtype_kind(there) == dtype_kind(here):
        return None
    a, b = (str(d).removeprefix("torch.") for d in (there, here))
    article = "an" if dtype_kind(here) == "integer" else "a"
    return (
        f"{name} is {a} there, {b} here: {dtype_kind(there)} values do not load into "
        f"{article} {dtype_kind(here)} tensor (only float dtypes cast to each other)"
    )


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


# --- DCP's form: this rank's shards, flattened ----------------------------------------------------


def sharded(parts: ModelParts, optimizer, flat: bool = True) -> dict:
    """{"model", "optim"}: this rank's part of the weights and optimizer state, keyed by the
    whole model's names. `flat`: one key per parameter and setting, so that any layout (another
    pp split, a whole model) finds each parameter's state by its name; False: the nested form
    sharded checkpoints had before meshes (meta.json without "optimizer_keys")."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(
        parts.view, optimizer, options=_options(flatten_optimizer_state_dict=flat)
    )
    return {"model": model, "optim": _renamed(optim, parts.aliases)}


def load_sharded(parts: ModelParts, optimizer, state: dict, flat: bool = True) -> None:
    """Load what `sharded(flat)` gave (filled in by DCP), whatever layout and world size saved
    it."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # DCP makes the optimizer's state (a step on zero gradients at lr 0) before filling it in,
    # and skips that where a gradient is set: then it would load nothing. A resume comes before
    # any step, so a gradient here is stale anyway.
    optimizer.zero_grad(set_to_none=True)
    with own_kernels(optimizer):
        set_state_dict(
            parts.view,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=_renamed(state["optim"], parts.aliases, back=True),
            options=_options(flatten_optimizer_state_dict=flat),
        )


KERNEL_KEYS = ("fused", "foreach", "capturable")
"""The param_groups entries that say which kernels an optimizer runs, not what it learns."""


@contextlib.contextmanager
def own_kernels(optimizer: torch.optim.Optimizer):
    """A load that keeps this run's kernel choice (optim.fused): torch's load_state_dict takes
    every param_groups entry from the checkpoint, the saving run's fused/foreach among them.
    After the load each group's kernel keys are this optimizer's again, and its step counters
    sit where its kernel reads them: a fused or capturable group's on their parameter's device,
    another's on the CPU (torch loads them where the checkpoint's kernels had them; on the GPU a
    foreach step would read each back, a sync per parameter)."""
    kept = [{k: g[k] for k in KERNEL_KEYS if k in g} for g in optimizer.param_groups]
    yield
    for group, own in zip(optimizer.param_groups, kept, strict=True):
        group.update(own)
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            where = p.device if on_device else torch.device("cpu")
            if isinstance(step, torch.Tensor) and step.device != where:
                optimizer.state[p]["step"] = step.to(where, torch.float32)


def _renamed(flat: dict, aliases: dict[str, str], back: bool = False) -> dict:
    """A flattened optimizer state with each tied copy's keys under its whole-model name
    (`back`: from it to this rank's)."""
    if not aliases:
        return flat
    out = {}
    for key, value in flat.items():
        for alias, name in aliases.items():
            src, dst = (name, alias) if back else (alias, name)
            for kind in ("state.", "param_groups."):
                if key.startswith(kind + src + "."):
                    key = kind + dst + key[len(kind + src) :]
        out[key] = value
    return out


# --- whole state: a model that is not sharded ---------------------------------------------------


def order(view: nn.Module, optimizer) -> list[str]:
    """The names of `optimizer`'s parameters in the order its state_dict numbers them (group
    after group; a tied weight under its first name, as named_parameters gives it)."""
    name_of = {id(p): n for n, p in view.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def whole(parts: ModelParts, optimizer) -> dict:
    """{"model", "optimizer"} of a model this rank holds whole (no DTensors, no split), keyed
    by name: torch's own optimizer state_dict (a plug-in's extra entries too) with each number
    replaced by its parameter's name, the form DCP's get_state_dict gives. The live tensors
    (copy them before training goes on); no collective, and no step of DCP's to make a state."""
    state = optimizer.state_dict()
    return {
        "model": parts.view.state_dict(),
        "optimizer": by_name(state, order(parts.view, optimizer)),
    }


def load_whole(
    parts: ModelParts,
    optimizer,
    state: dict,
    *,
    sharded: bool,
    index_keyed: bool = False,
    numbering=(),
) -> None:
    """Load a whole checkpoint's {"model", "optimizer"} (every rank passes all of it) into any
    layout. A model this rank holds whole (`sharded` false) loads it as torch's own state_dict,
    renumbered for this optimizer; shards and pipeline stages through DCP's set_state_dict,
    which takes this rank's names and cuts them into its shards. `index_keyed`: an optimizer
    state numbered, not named (whole checkpoints written before names), read by the numbering of
    the optimizer that wrote it: this one's where it holds the whole model, else `numbering`
    (the whole model's trainable names group after group). StateMismatch names what does not
    fit."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model = mine(state["model"], parts.view)
    if problem := fit_problem(parts.view, model):
        raise StateMismatch("model", problem)
    with loading("optimizer"):
        optim = state["optimizer"]
        if index_keyed:
            optim = by_name(optim, numbering if parts.pipe else order(parts.view, optimizer))
        optim = _aliased(optim, parts.aliases)
        if problem := group_problem(parts.view, optimizer, optim):
            raise StateMismatch("optimizer", problem)
        if not sharded or not optim["state"]:  # whole, or nothing to cut (SGD: no state)
            optim = _by_index(optim, parts.view, optimizer, exact=not sharded)
            # Copies: torch keeps the tensors it is given, which map the checkpoint's file.
            with own_kernels(optimizer):
                optimizer.load_state_dict(tree_map_only(torch.Tensor, torch.clone, optim))
        else:
            # DCP makes the optimizer's state first (a step on zero gradients at lr 0), and
            # skips that where a gradient is set; a parameter the saved state lacks (it never
            # had a gradient) keeps that fresh state (strict=False).
            optimizer.zero_grad(set_to_none=True)
            options = _options(full_state_dict=True, strict=False)
            with own_kernels(optimizer):
                set_optimizer_state_dict(parts.view, optimizer, optim, options=options)
    load_weights(parts.view, model)  # after DCP's step at lr 0: nothing of it stays


def by_name(state: dict, names) -> dict:
    """torch's own optimizer state_dict (parameters numbered group after group, as the
    optimizer that wrote it numbered them: `names`) keyed by name instead; other entries kept."""
    names = list(names)
    return {
        **state,
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def _by_index(state: dict, view: nn.Module, optimizer, exact: bool = True) -> dict:
    """A whole optimizer state keyed by name as torch's load_state_dict takes it for `optimizer`:
    its groups in this optimizer's order, each parameter numbered as this optimizer numbers it
    (torch matches saved and live parameters by position), the settings of the saved group that
    holds them (group_problem checked there is one). `exact`: the saved groups hold no other
    parameter (a whole model's; a pipeline stage's optimizer holds part of them)."""
    names = order(view, optimizer)
    index = {n: i for i, n in enumerate(names)}
    saved = [n for g in state["param_groups"] for n in g["params"]]
    if exact and (extra := [n for n in saved if n not in index]):
        raise ValueError(f"it holds parameters this optimizer does not ({', '.join(extra[:3])})")
    group_of = {n: g for g in state["param_groups"] for n in g["params"]}
    groups, start = [], 0
    for g in optimizer.param_groups:
        end = start + len(g["params"])
        saved = group_of[names[start]] if end > start else {}
        groups.append({**saved, "params": list(range(start, end))})
        start = end
    own = {index[n]: v for n, v in state["state"].items() if n in index}
    return {**state, "state": own, "param_groups": groups}


def group_problem(view: nn.Module, optimizer, state: dict) -> str | None:
    """How a whole optimizer state keyed by name fails to fit `optimizer` (over `view`'s
    parameters), or None: each of its parameters must be in one saved group, and parameters
    that share a group here share one there (DCP takes a stage's part of each group by name, and
    would take a mismatch silently)."""
    name_of = {id(p): n for n, p in view.named_parameters()}  # a tied weight: its first name
    saved: dict = {}
    for i, g in enumerate(state["param_groups"]):
        for n in g["params"]:
            saved.setdefault(n, i)
    taken: dict = {}
    for j, g in enumerate(optimizer.param_groups):
        names = [name_of.get(id(p)) for p in g["params"]]
        if missing := [n for n in names if n not in saved]:
            return f"parameter {missing[0]} is in none of its param_groups"
        found = {saved[n] for n in names}
        if len(found) > 1 or (found and taken.setdefault(found.pop(), j) != j):
            return f"its param_groups do not match this optimizer's (group {j} here)"
    return None


def _aliased(state: dict, aliases: dict[str, str]) -> dict:
    """A whole optimizer state with each tied copy on this rank also under its local name."""
    if not aliases:
        return state
    own = dict(state["state"])
    groups = [{**g, "params": list(g["params"])} for g in state["param_groups"]]
    for alias, name in aliases.items():
        if name in own:
            own[alias] = own[name]
        for g in groups:
            if name in g["params"]:
                g["params"].append(alias)
    return {"state": own, "param_groups": groups}


def mine(state: dict, view: nn.Module) -> dict:
    """The entries of a whole model's state dict that `view` holds (a stage: its part)."""
    own = view.state_dict().keys()
    return {k: v for k, v in state.items() if k in own}


def load_weights(view: nn.Module, state: dict, strict: bool = True) -> None:
    """Whole weights (every rank passes the same) into `view` of any layout: plain tensors
    copied, DTensors cut into this rank's shards. `strict=False`: what `state` lacks keeps its
    value (starting weights that cover part of the model)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(view, state, options=_options(full_state_dict=True, strict=strict))


def whole_tensors(parts: ModelParts, mesh: Mesh, main: bool):
    """The whole model's state, one tensor at a time, in the whole model's order: (name, its
    whole value as a CPU tensor) on the main rank, (name, None) elsewhere. Every rank iterates
    it to the end (a collective): a sharded tensor is gathered by the ranks that hold its
    shards (FSDP's, tp's), a pipeline stage's by its first dp and tp rank, which sends it to
    the main rank; no rank holds more than one whole tensor at a time. Sharded or not is the
    layout's (FSDP or tp), not the parameters' at the time: FSDP2 leaves a root unsharded after
    an evaluation's forward."""
    sharded = mesh.dims.wraps == "fsdp" or mesh.layout.tp > 1
    own = parts.view.state_dict()
    pipe = parts.pipe
    for name in parts.shapes:
        t = own.get(name)
        if t is not None and sharded and hasattr(t, "full_tensor"):
            t = t.full_tensor()  # with the other ranks holding its shards
        if pipe is None:
            yield name, _host(t) if main else None
            continue
        keeper = mesh.peer(dp=0, pp=pipe.split.stage_of(name) % mesh.layout.pp, tp=0)
        if keeper == mesh.rank and not main:
            ranks.send_tensor(t.detach(), 0)
        elif main and keeper != mesh.rank:
            t = ranks.recv_tensor(keeper, str(next(parts.view.parameters()).device))
        yield name, _host(t) if main else None


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def local_weights(view: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of the live weights (its shards where sharded), on the CPU."""
    return {k: local_part(v).detach().cpu() for k, v in view.state_dict().items()}
