"""What a run saves and restores, where, and who does what across ranks.

Rank 0 picks the checkpoint and writes it; every rank loads it (the checkpoint directory must be
storage all nodes share); every rank learns each outcome, so no rank waits on a peer that gave up.
The on-disk format is store.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from trainer import metrics, ranks, repro
from trainer.checkpoint import store
from trainer.checkpoint.weights import load_weights_into
from trainer.config import Config, to_dict, to_yaml
from trainer.errors import ConfigError, RetryableError, UsageError, first_line

if TYPE_CHECKING:
    from trainer.metrics import RunLogger
    from trainer.ranks import World
    from trainer.step import TrainStep

# Keys that may change between a save and a resume without changing what is computed.
RESUMABLE_CHANGES = (
    "name",
    "run_dir",
    "log.",
    "ckpt.",
    "dist.",
    "repro.",
    "train.epochs",
    "train.max_steps",
    "train.eval_every_steps",
    "train.eval_every_epochs",
    "train.micro_batch_size",
    "train.compile",
    "train.channels_last",
    "train.activation_checkpointing",
    "fsdp.",
    "data.root",
    "data.download",
    "data.num_workers",
    "data.pin_memory",
    "data.persistent_workers",
    "data.device_resident",
    "data.eval_batch_size",
)


@dataclass
class LoopState:
    """Where training is: enough to continue at the exact next global batch."""

    epoch: int = 0
    step: int = 0
    """Optimizer steps done in total."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch."""
    samples_seen: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def checkpoint_dir(cfg: Config) -> str:
    """ckpt.dir, defaulting to <run_dir>/checkpoints (kept unresolved in the config, so a re-run
    under another run_dir never resumes from the original run's checkpoints)."""
    return os.path.abspath(cfg.ckpt.dir or os.path.join(cfg.run_dir, "checkpoints"))


class CheckpointWriteError(RetryableError):
    """A checkpoint could not be written (full disk, I/O error); the previous one is intact."""


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_conflicts(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every change a resume cannot honour exactly."""
    a, b = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(a.keys() | b.keys()):
        if key.startswith(RESUMABLE_CHANGES) or a.get(key) == b.get(key):
            continue
        diffs.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return diffs


def choose_resume(resume: str, root: str, warn) -> str | None:
    """The checkpoint to resume from for ckpt.resume (auto | never | PATH), or None."""
    if resume == "never":
        return None
    if resume == "auto":
        return store.latest_valid(root, warn)
    path = resume
    if not os.path.isdir(path):
        raise UsageError(f"ckpt.resume={path}: no such checkpoint directory (or use auto / never)")
    if not store.is_step_dir(path):  # a run dir or a checkpoints folder
        candidate = store.latest_in(path, warn)
        if candidate is None:
            raise UsageError(f"ckpt.resume={path}: holds no checkpoint that verifies")
        return candidate
    try:
        store.verify(path)
    except store.CorruptCheckpoint as e:
        raise UsageError(f"ckpt.resume={path}: corrupt checkpoint ({e}); pick another") from None
    return path


class Checkpointer:
    """Saves and restores everything `step` trains (model, optimizer, schedule, loss scaler) with
    the loop position and every rank's RNG, in checkpoint_dir(cfg)."""

    def __init__(self, cfg: Config, world: World, step: TrainStep, log: RunLogger):
        self.cfg, self.world, self.step, self.log = cfg, world, step, log
        self.root = checkpoint_dir(cfg)
        self.last_saved_step: int | None = None
        self.failures = 0

    # --- restore -----------------------------------------------------------------------------

    def restore(self) -> tuple[LoopState, dict]:
        """The loop state to start from (resumed or fresh) and the results saved with it."""
        choice, error = None, None
        if self.world.is_main:
            try:
                store.remove_stale_temporaries(self.root)
                choice = choose_resume(self.cfg.ckpt.resume, self.root, self.log.info)
            except UsageError as e:
                error = str(e)
        choice, error = ranks.broadcast_object((choice, error))
        if error:
            raise ConfigError(error)  # rank 0 decided for everyone: reported once
        if choice is None:
            if self.cfg.ckpt.init_weights:
                load_weights_into(self.step.model, self.cfg.ckpt.init_weights, self.step.strategy)
                self.log.info(f"initial weights from {self.cfg.ckpt.init_weights}")
            repro.seed_rank(self.cfg.seed, self.world.rank)
            self.last_saved_step = 0  # step 0 needs no checkpoint: a fresh start recreates it
            return LoopState(), {}
        return self._load(choice)

    def _load(self, path: str) -> tuple[LoopState, dict]:
        if not os.path.isdir(path):
            raise UsageError(
                f"rank {self.world.rank} on {repro.hostname()} cannot see checkpoint {path}: "
                "ckpt.dir must be on storage every node mounts (a shared volume / RWX PVC)"
            )
        payload = store.read(path)
        meta, extra = payload["meta"], payload["extra"]
        from omegaconf import OmegaConf

        saved_cfg = OmegaConf.to_container(OmegaConf.create(payload["config_yaml"]))
        conflicts = config_conflicts(saved_cfg, to_dict(self.cfg))
        if conflicts:
            raise ConfigError(
                f"cannot resume {path}: the config changed ({'; '.join(conflicts[:4])}); "
                "use the saved values, or start fresh with ckpt.resume=never or a new run_dir"
            )
        step = self.step
        if store.is_sharded(path):
            from trainer.checkpoint import sharded

            sharded.load(step.model, step.optimizer, path)
        else:
            step.strategy.load_state_dict(step.model, payload["model"])
            step.strategy.load_optimizer_state(step.model, step.optimizer, payload["optimizer"])
        sched = dict(extra["scheduler"])
        # The lr is a pure function of the step: keep this run's schedule, restore its position.
        sched["lr_lambdas"] = [None] * len(sched.get("lr_lambdas", []))
        step.scheduler.load_state_dict(sched)
        if extra.get("scaler"):
            step.scaler.load_state_dict(extra["scaler"])
        state = LoopState(**meta["loop"])
        rngs = extra["rng"]
        if len(rngs) == self.world.size:
            repro.set_rng_state(rngs[self.world.rank], self.world.device)
            note = ""
        else:
            # Data order and augmentation never depend on these streams (see sampler.py); only
            # per-rank randomness such as dropout restarts from a fresh, seeded stream.
            repro.seed_rank(self.cfg.seed + state.step, self.world.rank)
            note = f"; world size {len(rngs)} -> {self.world.size}: per-rank RNG reseeded"
        self.log.info(
            f"resumed from {path} (step {state.step}, epoch {state.epoch}, "
            f"step {state.step_in_epoch} of the epoch){note}"
        )
        self.last_saved_step = state.step
        return state, meta.get("results", {})

    # --- save --------------------------------------------------------------------------------

    def save(self, state: LoopState, results: dict, reason: str, root: str | None = None) -> str:
        """Write a full checkpoint (a collective); raises CheckpointWriteError on every rank.

        `root` saves elsewhere (the dry run's scratch folder) without pruning or counting it.
        """
        rngs = ranks.gather_objects(repro.rng_state(self.world.device))
        started = time.perf_counter()
        target = root or self.root
        try:
            if self.step.strategy.sharded:
                path = self._write_sharded(target, state, results, reason, rngs)
            else:
                path = self._write_whole(target, state, results, reason, rngs)
            error = None
        except Exception as e:  # OSError, torch/safetensors/DCP write errors: disk full, I/O, ...
            path, error = None, store.describe_error(e)
        if error and self.world.is_main:
            error = (
                f"checkpoint at step {state.step} could not be written to {target} ({error}); "
                f"the previous checkpoint is intact: {store.latest_valid(self.root) or 'none yet'}"
            )
        # Rank 0 wrote (or sealed) it: its outcome is everyone's.
        path, error = ranks.broadcast_object((path, error))
        if error:
            self.failures += 1
            raise CheckpointWriteError(error)
        if root is None:
            if self.world.is_main:
                store.prune(self.root, self.cfg.ckpt.keep_last)
            self.last_saved_step = state.step
        if reason != "dry-run":
            took = time.perf_counter() - started
            self.log.info(f"checkpoint {os.path.basename(path)} ({reason}, {took:.2f} s)")
        return path

    def _write_whole(self, root: str, state: LoopState, results: dict, reason: str, rngs):
        """Rank 0 writes the whole checkpoint; the other ranks hold the same replica."""
        if not self.world.is_main:
            return None
        step = self.step
        return store.write(
            root,
            state.step,
            model=step.strategy.full_state_dict(step.model),
            optimizer=step.optimizer.state_dict(),
            **self._common(state, results, reason, rngs, "whole"),
        )

    def _write_sharded(self, root: str, state: LoopState, results: dict, reason: str, rngs):
        """Every rank writes its shards into one temporary directory (rank 0 names it), which
        rank 0 then seals with the common files and the manifest and renames into place."""
        path = store.step_dir(root, state.step)
        tmp, error = None, None
        if self.world.is_main:
            try:
                tmp = store.begin(path)
            except OSError as e:
                error = first_line(e)
        tmp, error = ranks.broadcast_object((tmp, error))
        if error:
            raise OSError(error)
        from trainer.checkpoint import sharded

        try:
            sharded.save(self.step.model, self.step.optimizer, tmp)  # any rank's failure: all raise
            if self.world.is_main:
                missing = sharded.missing_shards(tmp)
                if missing:
                    raise OSError(
                        f"shards {', '.join(missing[:3])} never arrived: ckpt.dir must be storage "
                        "every node mounts (a shared volume / RWX PVC)"
                    )
                store.seal(tmp, **self._common(state, results, reason, rngs, "sharded"))
                store.commit(tmp, path)
        except BaseException:
            if self.world.is_main:
                store.abort(tmp)
            raise
        return path if self.world.is_main else None

    def _common(self, state: LoopState, results: dict, reason: str, rngs, fmt: str) -> dict:
        """state.pt, meta.json and config.yaml: what every checkpoint holds beside the tensors."""
        step = self.step
        return {
            "extra": {
                "scheduler": step.scheduler.state_dict(),
                "scaler": step.scaler.state_dict(),
                "rng": rngs,
                "world_size": self.world.size,
            },
            "meta": {
                "loop": state.as_dict(),
                "format": fmt,
                "strategy": step.strategy.name,
                "reason": reason,
                "world_size": self.world.size,
                "restart_count": self.world.restart_count,
                "time": time.time(),
                "results": _jsonable(results),
                "versions": metrics.versions(),
            },
            "config_yaml": to_yaml(self.cfg),
        }

    def save_or_warn(self, state: LoopState, results: dict, reason: str) -> None:
        """Periodic saves: a failure is reported loudly but training goes on."""
        try:
            self.save(state, results, reason)
        except CheckpointWriteError as e:
            self.log.info(f"WARNING: {e}; training continues, the next save will retry")


def _jsonable(results: dict) -> dict:
    out = {}
    for k, v in results.items():
        if isinstance(v, dict):
            out[k] = _jsonable(v)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = v.item()
    return out
