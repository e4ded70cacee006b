"""Save and restore the whole training state, coordinated across ranks.

The on-disk format is checkpoint.py's; this module decides what goes in and who does what:
rank 0 picks the checkpoint and writes it, every rank loads it (ckpt.dir must be storage all
nodes share), and every rank learns the outcome, so no rank waits on a peer that gave up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from trainer import checkpoint, dist, metrics, repro
from trainer.config import Config, ckpt_dir, to_dict, to_yaml
from trainer.errors import ConfigError, RetryableError, UsageError
from trainer.loop import LoopState
from trainer.strategy import unwrap

# Keys that may change between a save and a resume without changing what is computed.
RESUMABLE_CHANGES = (
    "name", "run_dir", "log.", "ckpt.", "dist.", "repro.",
    "train.epochs", "train.max_steps", "train.eval_every_steps", "train.eval_every_epochs",
    "train.micro_batch_size", "train.compile", "train.channels_last",
    "data.root", "data.download", "data.num_workers", "data.pin_memory",
    "data.persistent_workers", "data.device_resident", "data.eval_batch_size",
)  # fmt: skip


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


class Checkpointer:
    def __init__(self, cfg: Config, denv: dist.DistEnv, device: str, model, optimizer, scheduler,
                 scaler=None, info: Callable[[str], None] = print):  # fmt: skip
        self.cfg, self.denv, self.device = cfg, denv, device
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.root = ckpt_dir(cfg)
        self.info = info if denv.is_main else (lambda _msg: None)
        self.last_saved_step: int | None = None
        self.failures = 0

    # --- restore -----------------------------------------------------------------------------

    def restore(self) -> tuple[LoopState, dict]:
        """The loop state to start from (resumed or fresh) and the results saved with it."""
        choice, error = None, None
        if self.denv.is_main:
            try:
                checkpoint.remove_stale_temporaries(self.root)
                choice = checkpoint.resolve_resume(self.cfg.ckpt.resume, self.root, self.info)
            except UsageError as e:
                error = str(e)
        choice, error = dist.broadcast_object((choice, error))
        if error:
            raise ConfigError(error)  # rank 0 decided for everyone: reported once
        if choice is None:
            if self.cfg.ckpt.init_weights:
                checkpoint.load_weights_into(self.model, self.cfg.ckpt.init_weights)
                self.info(f"initial weights from {self.cfg.ckpt.init_weights}")
            repro.seed_rank(self.cfg.seed, self.denv.rank)
            self.last_saved_step = 0  # step 0 needs no checkpoint: a fresh start recreates it
            return LoopState(), {}
        return self._load(choice)

    def _load(self, path: str) -> tuple[LoopState, dict]:
        if not os.path.isdir(path):
            raise UsageError(
                f"rank {self.denv.rank} on {repro.hostname()} cannot see checkpoint {path}: "
                "ckpt.dir must be on storage every node mounts (a shared volume / RWX PVC)"
            )
        payload = checkpoint.load(path)
        meta, extra = payload["meta"], payload["extra"]
        from omegaconf import OmegaConf

        saved_cfg = OmegaConf.to_container(OmegaConf.create(payload["config_yaml"]))
        conflicts = config_conflicts(saved_cfg, to_dict(self.cfg))
        if conflicts:
            raise ConfigError(
                f"cannot resume {path}: the config changed ({'; '.join(conflicts[:4])}); "
                "use the saved values, or start fresh with ckpt.resume=never or a new run_dir"
            )
        unwrap(self.model).load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        sched = dict(extra["scheduler"])
        # The lr is a pure function of the step: keep this run's schedule, restore its position.
        sched["lr_lambdas"] = [None] * len(sched.get("lr_lambdas", []))
        self.scheduler.load_state_dict(sched)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        state = LoopState(**meta["loop"])
        rngs = extra["rng"]
        if len(rngs) == self.denv.world_size:
            repro.set_rng_state(rngs[self.denv.rank], self.device)
            note = ""
        else:
            # Data order and augmentation never depend on these streams (see sampler.py); only
            # per-rank randomness such as dropout restarts from a fresh, seeded stream.
            repro.seed_rank(self.cfg.seed + state.step, self.denv.rank)
            note = f"; world size {len(rngs)} -> {self.denv.world_size}: per-rank RNG reseeded"
        self.info(
            f"resumed from {path} (step {state.step}, epoch {state.epoch}, "
            f"step {state.step_in_epoch} of the epoch){note}"
        )
        self.last_saved_step = state.step
        return state, meta.get("results", {})

    # --- save --------------------------------------------------------------------------------

    def save(self, state: LoopState, results: dict, reason: str, root: str | None = None) -> str:
        """Write a full checkpoint (a collective); raises CheckpointWriteError on every rank."""
        rngs = dist.gather_objects(repro.rng_state(self.device))
        path, error = None, None
        if self.denv.is_main:
            started = time.perf_counter()
            target = root or self.root
            try:
                path = checkpoint.save(
                    target,
                    state.step,
                    model=self.model,
                    optimizer=self.optimizer,
                    extra={
                        "scheduler": self.scheduler.state_dict(),
                        "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                        "rng": rngs,
                        "world_size": self.denv.world_size,
                    },
                    meta={
                        "loop": state.as_dict(),
                        "reason": reason,
                        "world_size": self.denv.world_size,
                        "restart_count": self.denv.restart_count,
                        "time": time.time(),
                        "results": _jsonable(results),
                        "versions": metrics.versions(),
                    },
                    config_yaml=to_yaml(self.cfg),
                )
                if root is None:
                    checkpoint.prune(self.root, self.cfg.ckpt.keep_last)
                took = time.perf_counter() - started
                if reason != "dry-run":
                    self.info(f"checkpoint {os.path.basename(path)} ({reason}, {took:.2f} s)")
            except Exception as e:  # OSError, torch/safetensors write errors: disk full, I/O, ...
                previous = checkpoint.latest_valid(self.root)
                error = (
                    f"checkpoint at step {state.step} could not be written to {target} ({e}); "
                    f"the previous checkpoint is intact: {previous or 'none yet'}"
                )
        path, error = dist.broadcast_object((path, error))
        if error:
            self.failures += 1
            raise CheckpointWriteError(error)
        if root is None:
            self.last_saved_step = state.step
        return path

    def save_or_warn(self, state: LoopState, results: dict, reason: str) -> None:
        """Periodic saves: a failure is reported loudly but training goes on."""
        try:
            self.save(state, results, reason)
        except CheckpointWriteError as e:
            self.info(f"WARNING: {e}; training continues, the next save will retry")


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
