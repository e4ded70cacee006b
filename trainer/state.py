"""What survives a restart: the Stateful parts of a run, each with state_dict / load_state_dict.

    ModelState     the model's weights and the optimizer's state, in torch.distributed.checkpoint's
                   form (this rank's shards under fsdp) or whole (rank 0's copy of everything)
    ScheduleState  the lr schedule's position and the fp16 loss scaler
    LoopState      where training is: epoch, step, samples seen. It is also the data position:
                   the sampler is a pure function of (seed, epoch, step in epoch), see sampler.py
    RankRNG        every rank's RNG streams
    Results        (trainer/results.py) what the run has measured so far

run.build makes them around the objects it built; the checkpointer (trainer/checkpoint/) takes
them as `Parts`, decides format, verification and fallback, and never reaches inside.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer import ranks, repro
from trainer.errors import first_line
from trainer.results import Results
from trainer.strategy import Strategy, local_part, unwrap

if TYPE_CHECKING:
    from trainer.ranks import World


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
    """How a state dict fails to fit `model` (names first, then shapes), or None if it fits."""
    expected = unwrap(model).state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        return f"missing {missing[:5]}, unexpected {unexpected[:5]}"
    for name, tensor in expected.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            return f"{name} has shape {tuple(state[name].shape)} there, {tuple(tensor.shape)} here"
    return None


def non_finite(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding NaN or inf (this rank's shard of a DTensor)."""
    return [
        name
        for name, t in state.items()
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and not bool(local_part(t).isfinite().all())
    ]


class ModelState:
    """The model (as wrapped for training) and its optimizer, through the strategy that spread
    them over the ranks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy):
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        # Looked at once, as built: FSDP2 leaves a root's parameters unsharded after a forward
        # with no backward (an evaluation), so asking later could give another answer on the
        # next save, and rank 0 alone would gather.
        self.sharded = any(hasattr(p, "to_local") for p in model.parameters()) or getattr(
            strategy, "splits_model", False
        )
        """Whether this rank holds only shards of the weights (DTensors, as under fsdp): then no
        rank can write the whole model alone; or a model split into pipeline stages)."""

    @property
    def layout(self) -> str:
        """How the weights are spread (the strategy's name): recorded in meta.json."""
        return self.strategy.name

    def state_dict(self, flat: bool = True) -> dict:
        """{"model", "optim"} in torch.distributed.checkpoint's form: keyed by parameter name,
        this rank's shards where sharded (DCP imports in ~1 s: called for sharded saves only)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # Flattened: one key per parameter, param groups included, so any layout (another pp
        # split, a whole model) finds each parameter's state by its name. `flat=False`: the
        # form sharded checkpoints had before meshes (meta.json without "optimizer_keys").
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        model_state, optim_state = get_state_dict(
            unwrap(self.model), self.optimizer, options=options
        )
        return {"model": model_state, "optim": self.strategy.canonical(optim_state)}

    def load_state_dict(self, state: dict, flat: bool = True) -> None:
        """Load what state_dict(flat) gave (filled in by DCP), whatever layout and world size
        saved it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            unwrap(self.model),
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=self.strategy.canonical(state["optim"], back=True),
            options=StateDictOptions(flatten_optimizer_state_dict=flat),
        )

    def whole_state_dict(self) -> dict:
        """{"model": the whole weights as plain CPU tensors (no `module.`/`_orig_mod.`),
        "optimizer": torch's own state_dict (parameters numbered)}: a whole checkpoint's."""
        return {
            "model": self.strategy.full_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_whole_state_dict(self, state: dict) -> None:
        """Load what whole_state_dict gave (every rank passes all of it); StateMismatch names the
        part that does not fit."""
        state = {**state, "model": self.strategy.select(state["model"])}
        if problem := fit_problem(self.model, state["model"]):
            raise StateMismatch("model", problem)
        self.strategy.load_state_dict(self.model, state["model"])
        with loading("optimizer"):
            self.strategy.load_optimizer_state(self.model, self.optimizer, state["optimizer"])

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's part of the live weights (its shards where sharded), on the CPU."""
        state = unwrap(self.model).state_dict()
        return {k: local_part(v).detach().cpu() for k, v in state.items()}

    def non_finite(self) -> list[str]:
        """What of this rank's model and optimizer state holds NaN/inf: a checkpoint that would
        only diverge on its first step."""
        bad = non_finite(unwrap(self.model).state_dict())
        for i, per_param in enumerate(self.optimizer.state.values()):
            bad += non_finite({f"optimizer state {i}.{k}": v for k, v in per_param.items()})
        return bad


class ScheduleState:
    """The lr schedule's position and the fp16 loss scaler."""

    def __init__(self, scheduler, scaler: torch.amp.GradScaler):
        self.scheduler, self.scaler = scheduler, scaler

    def state_dict(self, flat: bool = True) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The lr schedule is this run's (a pure function of the step, so a resume may change
        train.epochs): only the scheduler's position is restored."""
        sched = dict(state["scheduler"])
        lambdas = sched.get("lr_lambdas", [])
        sched["lr_lambdas"] = [None] * (len(lambdas) if isinstance(lambdas, list) else 0)
        with loading("scheduler"):
            self.scheduler.load_state_dict(sched)
        if state.get("scaler"):
            with loading("scaler"):
                self.scaler.load_state_dict(state["scaler"])


@dataclass
class LoopState:
    """Where training is: enough to continue at the exact next global batch."""

    epoch: int = 0
    step: int = 0
    """Optimizer steps done in total."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch."""
    samples_seen: int = 0

    def state_dict(self, flat: bool = True) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, state[f.name])


LOOP_KEYS = tuple(f.name for f in fields(LoopState))
"""What meta.json's "loop" holds."""


class RankRNG:
    """Every rank's RNG streams (torch, numpy, Python): a resume on the same world size goes on
    with each rank's own; on another world size each rank gets a fresh seeded stream."""

    def __init__(self, world: World, seed: int):
        self.world, self.seed = world, seed

    def state_dict(self) -> list | None:
        """Every rank's states in rank order, on rank 0 (None elsewhere): a collective."""
        return ranks.gather_objects(repro.rng_state(self.world.device))

    def load_state_dict(self, saved: list, *, step: int) -> str:
        """This rank's saved stream, or a fresh one seeded from the seed and `step` where the
        world size changed; returns what to add to the resume line ("" when nothing)."""
        if len(saved) == self.world.size:
            repro.set_rng_state(saved[self.world.rank], self.world.device)
            return ""
        # Data order and augmentation never depend on these streams (see sampler.py); only
        # per-rank randomness such as dropout restarts from a fresh, seeded stream.
        repro.seed_rank(self.seed + step, self.world.rank)
        return f"; world size {len(saved)} -> {self.world.size}: per-rank RNG reseeded"

    def fresh(self) -> None:
        """A fresh start: each rank's own stream from the seed."""
        repro.seed_rank(self.seed, self.world.rank)


@dataclass(frozen=True, eq=False)
class Parts:
    """Everything a checkpoint holds of a run, as the objects the run trains with."""

    model: ModelState
    schedule: ScheduleState
    loop: LoopState
    results: Results
    rng: RankRNG
