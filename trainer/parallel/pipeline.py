"""Pipeline parallelism (dist.mesh=pp=N): the model's layers split into stages, one (or two,
interleaved) per rank, run by torch.distributed.pipelining's schedules.

**Split points.** A model names its layer container (`pipeline_layers()`, the attribute of a
ModuleList or ModuleDict; the GPT's `blocks`). The layers are cut into equal runs, one per stage;
the submodules registered before the container go to the first stage, those after it to the last.
A stage is the model object with the others' parts set to None and its layers in a ModuleDict
keyed by their original indices, so parameter names, state dicts and checkpoints are the whole
model's. The model's forward skips what it does not hold (the GPT's does).

**Exactness.** Each stage accumulates its micro-batches' gradients in order, the loss is the
task's sum scaled as TrainStep scales it, and torch's schedules run with scale_grads=False: the
gradients are one process's with the same micro-batches, bit for bit. A weight tied across stages
(the GPT's embedding and head) is a copy on each; the copies' per-micro-batch gradients are kept
and added in one process's order ((h1 + e1) + (h2 + e2) + ...), and gradient clipping stacks every
tensor's norm in the whole model's order: so clipping and tied weights keep the bits too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer import batch as batches
from trainer import ranks
from trainer.errors import ConfigError, UsageError
from trainer.parallel import fixedtree
from trainer.parallel.mesh import Mesh, sharded_groups
from trainer.step import TrainStep
from trainer.strategy import Strategy, optimizer_names, unwrap
from trainer.tasks import checked_loss


@dataclass(frozen=True)
class Split:
    """Which stage holds what: the layer container, each stage's layer keys, the modules
    before and after the layers."""

    container: str
    stages: list[list[str]]
    before: list[str]
    after: list[str]

    @property
    def n(self) -> int:
        return len(self.stages)

    def stage_of(self, name: str) -> int:
        """The stage holding the parameter or buffer `name` (a whole-model name)."""
        head, _, rest = name.partition(".")
        if head == self.container:
            key = rest.partition(".")[0]
            return next(i for i, keys in enumerate(self.stages) if key in keys)
        return 0 if head in self.before else self.n - 1


def plan(model: nn.Module, n_stages: int) -> Split:
    """The split of `model` into `n_stages` stages; one line for a model that cannot be split."""
    name = _container_name(model)
    container = getattr(model, name)
    keys = (
        list(container.keys())
        if isinstance(container, nn.ModuleDict)
        else [str(i) for i in range(len(container))]
    )
    if len(keys) % n_stages:
        raise ConfigError(
            f"dist.mesh: {n_stages} pipeline stages cannot split the model's {len(keys)} layers "
            f"({type(model).__name__}.{name}) evenly: use a number of stages that divides "
            f"{len(keys)} (pp x stages per rank), or change the layer count"
        )
    if direct := [n for n, _ in model.named_parameters(recurse=False)]:
        raise UsageError(
            f"{type(model).__name__} holds parameters on its root ({', '.join(direct[:3])}), "
            "which no pipeline stage owns: move them into a submodule registered before or "
            f"after {name}"
        )
    per = len(keys) // n_stages
    children = list(dict(model.named_children()))
    at = children.index(name)
    return Split(
        container=name,
        stages=[keys[i * per : (i + 1) * per] for i in range(n_stages)],
        before=children[:at],
        after=children[at + 1 :],
    )


def _container_name(model: nn.Module) -> str:
    own = getattr(model, "pipeline_layers", None)
    name = own() if callable(own) else None
    if name is None or not isinstance(getattr(model, name, None), (nn.ModuleList, nn.ModuleDict)):
        raise UsageError(
            f"dist.mesh with pp needs the model's split points, but {type(model).__name__} "
            "names none: give it a pipeline_layers() method returning the name of its "
            "ModuleList of layers, whose forward skips submodules set to None "
            "(docs/extending.md, 'Pipeline stages'), or use model.name=gpt"
        )
    return name


def piece(model: nn.Module, split: Split, stages: list[int]) -> nn.Module:
    """The model object holding only `stages`' parts (the same submodules, not copies)."""
    out = copy.copy(model)
    # Its own registries (modules, parameters, hooks), so wrapping one stage (FSDP's hooks, its
    # DTensor parameters) leaves the model and the other stages as they were.
    out.__dict__ = {k: type(v)(v) if isinstance(v, dict) else v for k, v in model.__dict__.items()}
    for name in split.before:
        out._modules[name] = model._modules[name] if 0 in stages else None
    for name in split.after:
        out._modules[name] = model._modules[name] if split.n - 1 in stages else None
    container = getattr(model, split.container)
    layers = (
        dict(container.items())
        if isinstance(container, nn.ModuleDict)
        else {str(i): m for i, m in enumerate(container)}
    )
    kept = [k for s in stages for k in split.stages[s]]
    out._modules[split.container] = nn.ModuleDict({k: layers[k] for k in kept})
    return out


@dataclass
class Tied:
    """A weight used in two stages (the GPT's embedding and head): its name in each stage."""

    names: dict[int, str]
    """stage -> the parameter's name there"""
    canonical: str
    """The name the whole model's optimizer state uses (its first)."""
    shape: tuple
    """The weight's shape (every stage knows it: the whole model was built everywhere)."""


def tied_weights(model: nn.Module, split: Split) -> list[Tied]:
    """The parameters that one module object shares between stages."""
    by_id: dict[int, list[str]] = {}
    shapes = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        shapes[id(p)] = tuple(p.shape)
    out = []
    for key, names in by_id.items():
        stages = {split.stage_of(n): n for n in reversed(names)}
        if len(stages) > 1:
            out.append(Tied(names=stages, canonical=names[0], shape=shapes[key]))
    return out


@dataclass(eq=False)
class Pipe:
    """This rank's stages and what runs them."""

    split: Split
    mesh: Mesh
    local: list[int]
    """The stage indices on this rank (two under interleaved 1F1B)."""
    modules: dict[int, nn.Module]
    """stage -> its module as the schedule runs it (wrapped by the dp strategy)."""
    view: nn.Module
    """One module holding this rank's stages' parts under their whole-model names: what the
    optimizer, state dicts and checkpoints see."""
    names: list[str]
    """The whole model's parameter names in order (optimizer numbering, clipping order)."""
    tied: list[Tied]
    schedule_name: str
    stages: list = field(default_factory=list)
    schedules: dict = field(default_factory=dict)

    @property
    def first(self) -> bool:
        return 0 in self.local

    @property
    def last(self) -> bool:
        return self.split.n - 1 in self.local

    def owner(self, stage: int) -> int:
        """The global rank running `stage` in this rank's replica."""
        return self.mesh.peer(pp=stage % self.mesh.layout.pp)

    def schedule(self, n_micro: int, loss_fn):
        """torch's schedule for n_micro micro-batches (one per distinct count: a tail step)."""
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        if n_micro not in self.schedules:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(self.schedule_name)
            stages = self.stages[0] if kind else self.stages
            kind = kind or ScheduleInterleaved1F1B
            self.schedules[n_micro] = kind(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
        return self.schedules[n_micro]


def build(
    model: nn.Module, mesh: Mesh, schedule: str, dp: Strategy, world, compile: bool = False
) -> Pipe:
    """Split `model` (built identically on every rank) and keep this rank's stages, each wrapped
    by the data-parallel strategy `dp` over the dp dimension (and compiled, train.compile: the
    module the schedule runs; the view, optimizer and checkpoints keep the plain names)."""
    pp = mesh.layout.pp
    per_rank = 2 if schedule == "interleaved-1f1b" else 1
    split = plan(model, pp * per_rank)
    local = [mesh.pp_rank + k * pp for k in range(per_rank)]
    names = [n for n, _ in model.named_parameters()]
    tied = tied_weights(model, split)
    modules = {s: piece(model, split, [s]) for s in local}
    view = modules[local[0]] if per_rank == 1 else piece(model, split, local)
    pipe = Pipe(split, mesh, local, {}, view, names, tied, schedule)
    fsdp = dp if dp.name == "fsdp" else getattr(dp, "dp", None)  # under tp: its dp strategy
    if tied and fsdp is not None and fsdp.name == "fsdp":  # whole: _tied_grads' hooks see grads
        fsdp.whole = {model.get_parameter(t.canonical) for t in tied}
    for s in local:
        pipe.modules[s] = dp.wrap(modules[s], world)
        if compile:  # after DDP, as without a mesh
            pipe.modules[s] = torch.compile(pipe.modules[s])
    return pipe


def _make_stages(pipe: Pipe, inputs: tuple, device: str) -> None:
    """torch's PipelineStage for each of this rank's stages, with its input and output shapes
    given (static mode) from one micro-batch run through the stages once: torch's inference on
    the first step would run a pass DDP counts as a backward."""
    from torch.distributed.pipelining import PipelineStage

    seen: dict[int, tuple] = {}
    with torch.no_grad():
        run_through(pipe, inputs, device, seen)
    for s in pipe.local:
        # Activations carry gradients: torch derives the backward's buffers from these.
        stage_in, stage_out = (
            tuple(map(_needs_grad, v)) if isinstance(v, tuple) else _needs_grad(v) for v in seen[s]
        )
        pipe.stages.append(
            PipelineStage(
                pipe.modules[s], s, pipe.split.n, torch.device(device),
                input_args=stage_in, output_args=stage_out, group=pipe.mesh.group("pp"),
            )
        )  # fmt: skip


def _needs_grad(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True) if t.is_floating_point() else t


def run_through(pipe: Pipe, inputs: tuple | None, device: str, seen: dict | None = None):
    """The stages one after another on `inputs` (the first stage's; None elsewhere), activations
    sent point to point: the model's output on the last stage's rank, None on the others.
    `seen`: each local stage's (inputs, output)."""
    x = inputs
    for s in range(pipe.split.n):
        if s not in pipe.local:
            continue
        if s > 0 and pipe.owner(s - 1) != pipe.mesh.rank:
            x = (_recv(pipe.owner(s - 1), device),)
        y = unwrap(pipe.modules[s])(*x)
        if seen is not None:
            seen[s] = (x, y)
        if s == pipe.split.n - 1:
            return y
        if pipe.owner(s + 1) != pipe.mesh.rank:
            _send(y, pipe.owner(s + 1))
        x = (y,)
    return None


def check_tail(n: int, cfg, mesh: Mesh, reached: bool) -> None:
    """One line before any work, not a crash at the end of an epoch: the epoch's last, smaller
    global batch must split into equal micro-batches, at least one per stage, on every dp rank."""
    b, dp = cfg.data.global_batch_size, mesh.layout.dp
    tail = 0 if cfg.data.drop_last else n % b
    if not tail or not reached:
        return
    stages = mesh.layout.pp * (2 if cfg.dist.pp_schedule == "interleaved-1f1b" else 1)
    micro = cfg.train.micro_batch_size or max(1, b // dp // stages)
    if cfg.repro.world_invariant:  # a shard per micro-batch
        micro = b // cfg.repro.shards
    sizes = {(tail * (r + 1)) // dp - (tail * r) // dp for r in range(dp)}
    if len(sizes) == 1 and (size := sizes.pop()) % micro == 0 and size // micro >= stages:
        return
    raise ConfigError(
        f"dist.mesh={mesh.layout}: the epoch's last batch holds {tail} of the {n} training samples, "
        f"which do not split into equal micro-batches of {micro} (at least {stages}) on each of "
        f"{dp} dp rank(s), and a pipeline cannot run unequal ones: set data.drop_last=true, or a "
        "data.global_batch_size that divides the training split"
    )


def model_inputs(task, b) -> tuple:
    """The positional arguments task.forward hands the model for batch `b` (keywords are not
    supported under pp: one line)."""
    seen: list = []

    class Recorder(nn.Module):
        def forward(self, *args, **kwargs):
            if kwargs:
                raise UsageError(
                    f"{type(task).__name__}.forward passes keyword arguments to the model; "
                    "under pp a stage receives positional tensors only"
                )
            seen.append(args)
            return None

    task.forward(Recorder(), b)
    return seen[0]


@dataclass(kw_only=True, eq=False)
class PipelineStep(TrainStep):
    """TrainStep under pp: the rank's slice split into equal micro-batches that flow through the
    stages on torch's schedule; loss and gradient scaling as TrainStep's micro-steps."""

    pipe: Pipe
    data_size: int = 1
    micro_batch: int = 1
    """Samples per pipeline micro-batch (train.micro_batch_size, or the rank's slice over the
    stages)."""
    _micro: dict = field(default_factory=dict)
    """This step's micro-batches, loss terms and the micro-batches' summed losses."""
    tree_shards: int = 0
    """repro.world_invariant: K, the shards of each global batch (the micro-batches are this
    replica's K / dp of them), gradients added in the fixed tree (fixedtree.py); 0: off."""

    def _chunks(self, batch) -> list:
        return batches.split(batch, self.micro_batch)

    def __call__(self, batch, global_count: int, index: int = 0) -> torch.Tensor:
        pipe = self.pipe
        self.optimizer.zero_grad(set_to_none=True)
        chunks = self._chunks(batch)
        if len({batches.size(c) for c in chunks}) > 1:
            raise ConfigError(
                f"dist.mesh (pp): a step of {batches.size(batch)} samples per rank splits into "
                "unequal micro-batches, which a pipeline cannot run: set data.drop_last=true "
                "or a data.global_batch_size that the train split divides"
            )
        terms = self._pipeline_terms(global_count, chunks, index)
        # Sum of losses x dp / global terms: after the dp average, sum / terms (the fixed tree
        # adds the replicas' gradients instead: sum / terms).
        factor = (1.0 if self.tree_shards else self.data_size) / terms
        self._micro = {"chunks": chunks, "terms": terms, "sums": {}, "factor": factor}
        arg_mbs = [model_inputs(self.task, c) for c in chunks] if pipe.first else None
        if not pipe.stages:
            _make_stages(pipe, arg_mbs[0] if arg_mbs else None, self.device)
        tied = {t.names[s] for t in pipe.tied for s in t.names}
        own = [(n, p) for n, p in pipe.view.named_parameters() if p.requires_grad]
        own = [(n, p) for n, p in own if n not in tied] if self.tree_shards else []
        with _tied_grads(pipe) as per_micro, fixedtree.keep_grads(own) as kept:
            self.forward_s.start()
            pipe.schedule(len(chunks), self._micro_loss).step(
                arg_mbs=arg_mbs,
                target_mbs=[torch.tensor(i) for i in range(len(chunks))] if pipe.last else None,
            )
            self.forward_s.stop()
        if self.tree_shards:
            _tree_grads(pipe, kept, _tied_micro(pipe, per_micro, len(chunks)), len(chunks))
        else:
            _add_tied(pipe, per_micro, len(chunks))
        self._update()
        sums = self._micro["sums"]
        if self.tree_shards:
            first = pipe.mesh.data_rank * len(chunks)
            lead = pipe.mesh.contributes and pipe.mesh.data_rank == 0
            sums = sums if pipe.mesh.contributes else {}
            return fixedtree.step_loss(sums, first, self.tree_shards, terms, lead, self.device)
        if not (pipe.mesh.contributes and sums):
            return torch.zeros((), device=self.device)
        total = sums[0]
        for i in range(1, len(chunks)):
            total = total + sums[i]
        return total / terms

    def _micro_loss(self, out, i) -> torch.Tensor:
        """The schedule's loss_fn (built once, so it reads the step's micro-batches from self):
        the task's summed loss of micro-batch `i` (the target handed through the schedule is
        its index: a batch may be any structure), scaled as TrainStep scales a micro-step's."""
        now = self._micro
        local = checked_loss(self.task, self.task.loss(out, now["chunks"][int(i)]))
        # The last call per micro-batch counts: the first step's first may be torch's shape
        # inference on placeholder activations.
        now["sums"][int(i)] = local.detach()
        return self.scaler.scale(local * now["factor"])

    def _pipeline_terms(self, global_count: int, chunks, index: int) -> int:
        """Loss terms in the global batch; counted (one all-reduce) by the ranks whose loss
        counts, when the task has no fixed terms_per_sample."""
        if self.task.terms_per_sample is not None:
            return global_count * self.task.terms_per_sample
        return self._global_terms(
            global_count, lambda: chunks if self.pipe.mesh.contributes else [], index
        )

    def _clip(self) -> None:
        """The whole model's gradient norm, as torch's clip_grad_norm_ computes it on one
        process: every tensor's norm, stacked in the whole model's order (a tied weight once),
        then scaled by the same clamped coefficient. Sharded (fsdp) gradients: each tensor's
        norm from its shards' squares added over the dp group."""
        pipe, max_norm = self.pipe, self.cfg.clip_grad_norm
        order = {n: i for i, n in enumerate(pipe.names)}
        skip = {t.names[s] for t in pipe.tied for s in t.names if t.names[s] != t.canonical}
        named = [
            (n, p.grad)
            for n, p in pipe.view.named_parameters()
            if p.grad is not None and n not in skip
        ]
        norms = torch.zeros(len(pipe.names), dtype=torch.float32, device=self.device)
        sharded = any(hasattr(g, "to_local") for _, g in named)
        if named and not sharded:
            found = torch._foreach_norm([g for _, g in named], 2.0)
            for (n, _), v in zip(named, found, strict=True):
                norms[order[n]] = v
        elif named:  # DTensors: squares added over the mesh dimensions each one is sharded on
            norms = _sharded_norms(named, order, norms)
        _all_reduce(norms, pipe.mesh.group("pp"))
        total = torch.linalg.vector_norm(norms, 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [_local(p.grad) for p in pipe.view.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))

    @torch.no_grad()
    def eval_forward(self, b):
        """The model's output for batch `b` on the last stage (None on the others)."""
        inputs = model_inputs(self.task, b) if self.pipe.first else None
        return run_through(self.pipe, inputs, self.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded_norms(named: list, order: dict, norms: torch.Tensor) -> torch.Tensor:
    """Each tensor's whole norm from its local part's square, added (one all-reduce per set of
    groups) over the mesh dimensions it is sharded on (fsdp's dp, tp's columns or rows); a plain
    (replicated) tensor counts once."""
    found = torch._foreach_norm([_local(g) for _, g in named], 2.0)
    by_groups: dict[tuple, list] = {}
    for (n, g), v in zip(named, found, strict=True):
        by_groups.setdefault(sharded_groups(g), []).append((order[n], v.square()))
    for groups, entries in by_groups.items():
        part = torch.zeros_like(norms)
        for i, square in entries:
            part[i] = square
        for group in groups:
            _all_reduce(part, group)
        norms = norms + part  # disjoint entries: exact
    return norms.sqrt()


def _all_reduce(t: torch.Tensor, group) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _send(t: torch.Tensor, dst: int) -> None:
    import torch.distributed as dist

    head = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int64)
    size = torch.tensor([head.numel()], dtype=torch.int64)
    dist.send(size.to(t.device), dst)
    dist.send(head.to(t.device), dst)
    dist.send(t.contiguous(), dst)


def _recv(src: int, device: str) -> torch.Tensor:
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    head = torch.zeros(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(head, src)
    dtype, _, *shape = head.tolist()
    out = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    dist.recv(out, src)
    return out


def _tied_grads(pipe: Pipe):
    """Around the schedule: each tied weight's copy keeps its per-micro-batch gradients (and
    lets nothing accumulate), for _add_tied to add in one process's order."""
    params = dict(pipe.view.named_parameters())
    copies = [
        (t.canonical, params[name])
        for t in pipe.tied
        for s, name in t.names.items()
        if s in pipe.local
    ]
    return fixedtree.keep_grads(copies)


def _tied_micro(pipe: Pipe, kept: dict, n_micro: int) -> dict:
    """canonical name -> its per-micro-batch gradients, each the sum of its copies (exchanged
    over the pp group) in stage order, as one process's backward adds them."""
    group, out = pipe.mesh.group("pp"), {}
    for t in pipe.tied:
        grads = kept.get(t.canonical, [])
        slot = {s: i for i, s in enumerate(sorted(t.names))}
        stacked = torch.zeros((len(t.names), n_micro, *t.shape), device=_device(pipe))
        for s in sorted(t.names):
            if s in pipe.local:
                stacked[slot[s]] = torch.stack(grads[len(grads) - n_micro :])
        _all_reduce(stacked, group)
        micro = []
        for i in range(n_micro):
            m = stacked[0, i]
            for k in range(1, stacked.shape[0]):
                m = m + stacked[k, i]
            micro.append(m)
        out[t.canonical] = micro
    return out


def _set_tied(pipe: Pipe, totals: dict) -> None:
    params = dict(pipe.view.named_parameters())
    for t in pipe.tied:
        for s in t.names:
            if s in pipe.local:
                params[t.names[s]].grad = totals[t.canonical].clone()


def _add_tied(pipe: Pipe, kept: dict, n_micro: int) -> None:
    """Each tied weight's gradient: its copies' per-micro-batch gradients exchanged over the pp
    group and added as one process adds them ((h1 + e1) + (h2 + e2) + ...), then averaged over
    the dp group; every copy gets the same bits."""
    totals = {}
    for name, micro in _tied_micro(pipe, kept, n_micro).items():
        total = micro[0]
        for m in micro[1:]:
            total = total + m
        if pipe.mesh.layout.dp > 1:
            _all_reduce(total, pipe.mesh.group("dp"))
            total = total / pipe.mesh.layout.dp
        totals[name] = total
    _set_tied(pipe, totals)


def _tree_grads(pipe: Pipe, kept: dict, tied: dict, n_micro: int) -> None:
    """repro.world_invariant: every gradient of this rank's stages as the fixed tree over all
    shards adds it (trainer/parallel/fixedtree.py); tied weights from their per-micro sums."""
    aliases = {t.names[s]: t.canonical for t in pipe.tied for s in t.names}
    named = [(n, p) for n, p in pipe.view.named_parameters() if p.requires_grad]
    per_param = []
    for n, p in named:
        grads = tied[aliases[n]] if n in aliases else kept.get(n, [])[-n_micro:]
        per_param.append(grads or [torch.zeros_like(p)] * n_micro)
    per_micro = [[g[i] for g in per_param] for i in range(n_micro)]
    summed = fixedtree.tree_sum(per_micro, pipe.mesh.group("dp"), pipe.mesh.layout.dp)
    for (_, p), g in zip(named, summed, strict=True):
        p.grad = g


def _device(pipe: Pipe) -> torch.device:
    return next(pipe.view.parameters()).device


class Pipelined(Strategy):
    """A split model's checkpoints and whole weights: `dp` is the data-parallel strategy each
    stage is wrapped in; whole state dicts are the whole model's (gathered on rank 0)."""

    needs_group = True
    splits_model = True

    def __init__(self, dp: Strategy, pipe: Pipe | None = None, order: list[str] | None = None):
        self.dp, self.pipe = dp, pipe
        self.order = order or []
        """The whole model's trainable parameter names as its optimizer numbers them
        (params.numbering): what a whole checkpoint's optimizer indices mean."""
        self.name = f"{dp.name}+pp" if dp.name != "none" else "pp"

    def note(self, world) -> str | None:
        p = self.pipe
        return (
            f"pipeline: {p.split.n} stages of {len(p.split.stages[0])} layer(s) "
            f"({p.schedule_name}), mesh {p.mesh.layout}; this rank holds stage(s) "
            f"{', '.join(map(str, p.local))}"
        )

    def full_state_dict(self, model: nn.Module, world=None) -> dict | None:
        """The whole model's weights on rank 0 (None elsewhere; every rank calls this)."""
        mine = self.dp.full_state_dict(model)
        if self.pipe.mesh.dp_rank != 0 or self.pipe.mesh.tp_rank != 0:
            mine = None
        parts = ranks.gather_objects(mine)
        if world is not None and not world.is_main:
            return None
        whole: dict = {}
        for part in parts or []:
            whole.update(part or {})
        return whole

    def canonical(self, optim_state: dict, back: bool = False) -> dict:
        """A tied copy's optimizer state under the whole model's name (its first: the GPT's
        head.weight is tok.weight there), so checkpoints of any layout name it alike."""
        pairs = [
            (t.names[s], t.canonical)
            for t in self.pipe.tied
            for s in t.names
            if s in self.pipe.local
        ]
        pairs = [(a, c) for a, c in pairs if a != c]
        if not pairs:
            return optim_state
        out = {}
        for key, value in optim_state.items():
            for alias, name in pairs:
                src, dst = (name, alias) if back else (alias, name)
                for kind in ("state.", "param_groups."):
                    if key.startswith(kind + src + "."):
                        key = kind + dst + key[len(kind + src) :]
            out[key] = value
        return out

    def select(self, state: dict) -> dict:
        """This rank's stages' entries of a whole state dict."""
        own = unwrap(self.pipe.view).state_dict()
        return {k: v for k, v in state.items() if k in own}

    def load_state_dict(self, model: nn.Module, state: dict) -> None:
        self.dp.load_state_dict(model, self.select(state))

    def load_optimizer_state(self, model: nn.Module, optimizer, state: dict) -> None:
        """A whole model's optimizer state -> this rank's, group by group. The whole state numbers
        the whole model's trainable parameters group after group (`self.order`); this rank's
        optimizer holds its stages' part of each group that has one."""
        alias = {t.names[s]: t.canonical for t in self.pipe.tied for s in t.names}
        whole = {n: i for i, n in enumerate(self.order)}
        group_of = {i: g for g in state["param_groups"] for i in g["params"]}
        here = [whole[alias.get(n, n)] for n in optimizer_names(model, optimizer)]
        groups, start = [], 0
        for g in optimizer.param_groups:
            end = start + len(g["params"])
            groups.append({**group_of[here[start]], "params": list(range(start, end))})
            start = end
        mine = {
            "state": {j: state["state"][i] for j, i in enumerate(here) if i in state["state"]},
            "param_groups": groups,
        }
        self.dp.load_optimizer_state(model, optimizer, mine)
