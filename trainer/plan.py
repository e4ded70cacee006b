"""`trainer plan`: each rank's memory before launch, for the config's mesh, precision and optimizer,
without starting a process group or allocating the model.

For each rank the model is built on the meta device and laid out by the same code a run uses
(trainer/parallel/apply.py), over a fake process group of the world's size in which this process
plays that rank: its parameters, their gradients and the optimizer's state (made by one step on
zero gradients, on the meta device) are that rank's exact bytes, as summary.json's `memory`
counts them. Activations are measured by torch's MemTracker over one micro-batch's forward and
backward on the meta device (the whole model, or each pipeline stage in turn on the previous
one's output; tensor-parallel layers counted unsplit: an upper bound), with and without
activation checkpointing; a pipeline stage keeps the micro-batches its schedule has in flight.
The fixed part (Python, torch, the data, a process group) is this process's own, measured, plus
what a process group and a training loop add (PROCESS_EXTRA, measured on this machine).

    peak = fixed + parameters + gradients + optimizer state + DDP's buckets
           + FSDP's gathered units (the largest, twice: its parameters and gradients, and the
             next one prefetched) + activations x micro-batches in flight
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from trainer import data, optim, params, repro, strategy, tasks
from trainer.config import Config
from trainer.parallel import apply, split
from trainer.parallel import mesh as meshes
from trainer.parallel.dims import ParallelDims, describe
from trainer.ranks import World
from trainer.tasks import forward

PROCESS_EXTRA = 0
"""Bytes a training rank holds beyond a planning process that built the same data and made the
same imports (a process group, the stop vote's and the writer's threads, the metrics): none to
speak of, measured against tests/test_memory.py's five layouts (the planning process's own
tracing tools weigh about as much)."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's memory, in bytes."""

    rank: int
    where: str
    """Its coordinates on the mesh ('dp 0, pp 1')."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    bucket_bytes: int
    """DDP's gradient buckets (a second copy of the gradients)."""
    gather_bytes: int
    """FSDP: the largest unit gathered whole, with its gradients, and the next one's prefetch."""
    activation_bytes: int
    """One micro-batch's activations and the backward's temporaries, as configured."""
    other_activation_bytes: int
    """The same with train.activation_checkpointing the other way."""
    in_flight: int
    """Micro-batches whose activations are held at once (a pipeline stage's schedule)."""
    fixed_bytes: int

    @property
    def model_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.bucket_bytes

    @property
    def peak_bytes(self) -> int:
        extra = self.gather_bytes + self.activation_bytes * self.in_flight
        return self.fixed_bytes + self.model_bytes + extra


def plan(cfg: Config, world_size: int) -> list[RankPlan]:
    """Every rank's RankPlan for `cfg` on `world_size` ranks (CPU, gloo's layout)."""
    dims = describe(cfg, world_size, on_cuda=False)
    torch.manual_seed(cfg.seed)
    spec = data.build(cfg.data, cfg.seed, "cpu")
    task = tasks.build(cfg.task, spec)
    _imports()
    fixed = repro.rss_bytes() + PROCESS_EXTRA  # before any planning: a rank's start
    acts, batch = _activations(cfg, dims, spec, task)
    out = []
    for rank in range(world_size):
        sizes = _rank_sizes(cfg, dims, spec, rank, (task, batch))
        stage, split_act = sizes.pop("stage"), sizes.pop("activations")
        act = dict(acts[stage])
        if split_act is not None:  # tp's own: its layers' outputs are this rank's slices
            ratio = act["other_activation_bytes"] / max(1, act["activation_bytes"])
            act |= {"activation_bytes": split_act, "other_activation_bytes": int(split_act * ratio)}
        out.append(RankPlan(rank=rank, **sizes, **act, fixed_bytes=fixed))
    return out


def _imports() -> None:
    """What every training process imports by its first step (the optimizer's torch._dynamo,
    DCP's state-dict API for checkpoints), so that this process's size is a rank's start."""
    import torch._dynamo
    import torch.distributed.checkpoint.state_dict  # noqa: F401


def _rank_sizes(cfg: Config, dims: ParallelDims, spec, rank: int, step) -> dict:
    """Rank `rank`'s parameter, gradient and optimizer bytes (and buckets, gathered units), its
    part laid out over a fake process group in which this process is that rank; under tp alone
    (no FSDP, no pipeline) its activations too, traced on that part (`step`: the task and a
    micro-batch)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = World(rank=rank, size=dims.layout.size, local_size=dims.layout.size)
    torch.distributed.init_process_group(
        "fake", store=FakeStore(), rank=rank, world_size=dims.layout.size
    )
    try:
        mesh = meshes.build(world, _unreplicated(dims))
        with torch.device("meta"):
            model = _build(cfg, spec)
        order = params.numbering(cfg.optim, model.named_parameters())
        train = dataclasses.replace(cfg.train, compile=False)
        parts = apply.parallelize(model, mesh, world, train)
        trainable = [p for p in parts.view.parameters() if p.requires_grad]
        grads = sum(_bytes(p) for p in trainable)
        return {
            "where": mesh.describe(),
            "param_bytes": sum(_bytes(p) for p in parts.view.parameters()),
            "grad_bytes": grads,
            "optimizer_bytes": _optimizer_bytes(cfg, parts, order),
            "bucket_bytes": grads if dims.wraps == "ddp" and dims.layout.dp > 1 else 0,
            "gather_bytes": 4 * _largest_unit(parts.view) if dims.wraps == "fsdp" else 0,
            "stage": parts.pipe.local[0] if parts.pipe else 0,
            "activations": _split_activations(dims, parts, *step),
        }
    finally:
        torch.distributed.destroy_process_group()


def _split_activations(dims: ParallelDims, parts, task, batch) -> int | None:
    """tp alone: one micro-batch's activations on this rank's part (None for other layouts)."""
    if dims.layout.tp == 1 or dims.layout.pp > 1 or dims.wraps == "fsdp":
        return None
    for p in parts.view.parameters():
        p.grad = None
    return _peak(parts.running, lambda m: task.loss(forward(task, m, batch), batch))


def _unreplicated(dims: ParallelDims) -> ParallelDims:
    """DDP and nn.DataParallel change no tensor's size (and DDP cannot wrap a meta model):
    the layout without them. FSDP and tp stay: they cut the tensors."""
    return dims if dims.wraps in ("none", "fsdp") else dataclasses.replace(dims, dp="none")


def _build(cfg: Config, spec) -> torch.nn.Module:
    from trainer.run import _model

    return _model(cfg, spec, None)


def _bytes(t: torch.Tensor) -> int:
    t = strategy.local_part(t)
    return t.numel() * t.element_size()


def _optimizer_bytes(cfg: Config, parts, order) -> int:
    """The optimizer's state after one step on zero gradients, on the meta device (unfused:
    the fused kernels run on no meta tensor, and their state is the same tensors)."""
    how = dataclasses.replace(cfg.optim, fused=False)
    optimizer = optim.build(how, parts.view, order if parts.pipe else None)
    for p in parts.view.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    with contextlib.suppress(RuntimeError, NotImplementedError):  # a plug-in's .item()
        optimizer.step()
    return sum(
        _bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def _largest_unit(view: torch.nn.Module) -> int:
    units = strategy.shard_units(view) or [view]
    return max(sum(p.numel() * p.element_size() for p in u.parameters()) for u in units)


def _activations(cfg: Config, dims: ParallelDims, spec, task) -> tuple[dict[int, dict], object]:
    """(stage -> its activation bytes for one micro-batch, with and without activation
    checkpointing, and the micro-batches it holds at once; that micro-batch on meta)."""
    local = max(1, cfg.data.global_batch_size // dims.layout.dp)
    micro = cfg.train.micro_batch_size or local
    if dims.layout.pp > 1:
        from trainer.parallel.pipeline import micro_batch

        micro = micro_batch(cfg, dims)
    batch = spec.train.take(torch.arange(min(micro, len(spec.train))))
    batch = tuple(t.to("meta") for t in batch) if isinstance(batch, tuple) else batch
    on, off = (_traced(cfg, dims, spec, task, batch, ac) for ac in (True, False))
    n_micro = max(1, local // micro)
    out = {}
    for stage in range(dims.stages):
        configured, other = (on, off) if cfg.train.activation_checkpointing else (off, on)
        out[stage] = {
            "activation_bytes": configured[stage],
            "other_activation_bytes": other[stage],
            "in_flight": _in_flight(dims, stage, n_micro),
        }
    return out, batch


def _in_flight(dims: ParallelDims, stage: int, n_micro: int) -> int:
    """Micro-batches whose activations a stage holds at once: every one under GPipe (all
    forwards, then all backwards), at most the stages after it under 1F1B; 1 without pp."""
    if dims.layout.pp == 1:
        return 1
    if dims.pp_schedule == "gpipe":
        return n_micro
    return min(n_micro, dims.stages - stage)


def _traced(cfg: Config, dims: ParallelDims, spec, task, batch, checkpointed: bool) -> list[int]:
    """Each stage's peak of activations and temporaries over one micro-batch's forward and
    backward, on the meta device (one entry without pp)."""
    with torch.device("meta"):
        model = _build(cfg, spec)
    if checkpointed and strategy.shard_units(model):
        strategy.checkpoint_activations(model)
    if dims.layout.pp == 1:
        pieces = [model]
    else:
        cut = split.plan(model, dims.stages)
        pieces = [split.piece(model, cut, [s]) for s in range(dims.stages)]
    out, x = [], None
    for s, piece in enumerate(pieces):
        last, first = s == len(pieces) - 1, s == 0
        held = {}

        def step(m, x=x, last=last, first=first, held=held, s=s):
            split_at = split.stage_forward(m, s, len(pieces)) if len(pieces) > 1 else None
            with split_at or contextlib.nullcontext():
                y = forward(task, m, batch) if first else m(x)
            held["y"] = y
            return task.loss(y, batch) if last else y.float().sum()

        out.append(_peak(piece, step))
        y = held["y"]
        x = y.detach().requires_grad_(y.is_floating_point())
    return out


def _peak(module: torch.nn.Module, loss_of) -> int:
    """The peak of what a forward and backward of `module` (`loss_of(module)`, then backward)
    holds beyond the module's own parameters, buffers and gradients, by torch's MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        loss_of(module).backward()
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(d["Total"] for d in peak.values())
    return total - sum(d.get(k, 0) for d in peak.values() for k in _held_kinds())


def _held_kinds() -> tuple:
    """What MemTracker counts that the plan counts apart: the parameters and buffers, and the
    gradients the backward makes (gradient bytes)."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    return (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD)


def table(plans: list[RankPlan]) -> str:
    """The plan as a table, a row per rank, MiB."""
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    head = ("rank", "where", "params", "grads", "optimizer", "buckets", "gathered",
            "activations", "x", "other AC", "fixed", "peak")  # fmt: skip
    rows = [
        (str(p.rank), p.where, mib(p.param_bytes), mib(p.grad_bytes), mib(p.optimizer_bytes),
         mib(p.bucket_bytes), mib(p.gather_bytes), mib(p.activation_bytes), str(p.in_flight),
         mib(p.other_activation_bytes), mib(p.fixed_bytes), mib(p.peak_bytes))
        for p in plans
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    return "\n".join([*lines, "MiB a rank; activations: one micro-batch, x: held at once"])
