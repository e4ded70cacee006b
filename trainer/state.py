"""What survives a restart: the Stateful parts of a run, each with state_dict / load_state_dict.

    ModelState     the model's weights and the optimizer's state keyed by parameter name
                   (trainer/namedstate.py), in torch.distributed.checkpoint's form (this rank's
                   shards) or whole (rank 0's copy of everything)
    ScheduleState  the lr schedule's position and the fp16 loss scaler
    LoopState      where training is: epoch, step, samples seen. It is also the data position:
                   the sampler is a pure function of (seed, epoch, step in epoch), see sampler.py
    RankRNG        every rank's RNG streams
    Results        (trainer/results.py) what the run has measured so far

run.build makes them around the objects it built; the checkpointer (trainer/checkpoint/) takes
them as `Parts`, decides format, verification and fallback, and never reaches inside.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

import torch

from trainer import namedstate, ranks, repro
from trainer.namedstate import StateMismatch, fit_problem, loading
from trainer.parallel.mesh import Mesh
from trainer.parallel.parts import ModelParts
from trainer.results import Results
from trainer.strategy import local_part

if TYPE_CHECKING:
    from trainer.ranks import World

__all__ = ["StateMismatch", "fit_problem", "loading"]  # the checkpoint package's names for them


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
    """The model as this rank trains it (ModelParts) and its optimizer, saved and loaded by
    parameter name for every layout (trainer/namedstate.py)."""

    def __init__(
        self, parts: ModelParts, optimizer: torch.optim.Optimizer, mesh: Mesh, numbering=()
    ):
        self.parts, self.optimizer, self.mesh = parts, optimizer, mesh
        self.numbering = tuple(numbering)
        """The whole model's trainable parameter names group after group (params.numbering):
        what an index-keyed optimizer state (a whole checkpoint written before names) numbers,
        read by a pipeline stage, whose own optimizer holds only its part."""
        # Looked at once, as built: FSDP2 leaves a root's parameters unsharded after a forward
        # with no backward (an evaluation), so asking later could give another answer on the
        # next save, and rank 0 alone would gather.
        self.sharded = parts.pipe is not None or any(
            hasattr(p, "to_local") for p in parts.view.parameters()
        )
        """Whether this rank holds only part of the weights (DTensor shards, as under fsdp or
        tp, or a pipeline's stages): then no rank can write the whole model alone."""

    @property
    def model(self) -> torch.nn.Module:
        """This rank's parameters under the whole model's names."""
        return self.parts.view

    @property
    def layout(self) -> str:
        """How the weights are spread ('fsdp', 'ddp+pp', ...): recorded in meta.json."""
        return self.mesh.dims.name

    def state_dict(self, flat: bool = True) -> dict:
        """{"model", "optim"} in torch.distributed.checkpoint's form, keyed by parameter name,
        this rank's shards (DCP imports in ~1 s: called for sharded saves only)."""
        return namedstate.sharded(self.parts, self.optimizer, flat)

    def load_state_dict(self, state: dict, flat: bool = True) -> None:
        """Load what state_dict(flat) gave (filled in by DCP), whatever layout and world size
        saved it."""
        namedstate.load_sharded(self.parts, self.optimizer, state, flat)

    def whole_state_dict(self) -> dict:
        """{"model": the whole weights, "optimizer": the optimizer state keyed by name} of a
        model this rank holds whole: the live tensors (a whole checkpoint copies them)."""
        return namedstate.whole(self.parts, self.optimizer)

    def load_whole_state_dict(self, state: dict, index_keyed: bool = False) -> None:
        """Load a whole checkpoint's {"model", "optimizer"} (every rank passes all of it) into
        this layout; `index_keyed`: an optimizer state numbered rather than named (written
        before names). StateMismatch names the part that does not fit."""
        namedstate.load_whole(
            self.parts, self.optimizer, state, sharded=self.sharded, index_keyed=index_keyed,
            numbering=self.numbering,
        )  # fmt: skip

    def local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's part of the live weights (its shards where sharded), on the CPU."""
        return namedstate.local_weights(self.parts.view)

    def non_finite(self) -> list[str]:
        """What of this rank's model and optimizer state holds NaN/inf: a checkpoint that would
        only diverge on its first step."""
        bad = non_finite(self.parts.view.state_dict())
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
