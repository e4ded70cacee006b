"""What a run saves and restores, where, and who does what across ranks.

Rank 0 picks the checkpoint and writes it; every rank loads it (the checkpoint directory must be
storage all nodes share); every rank learns each outcome, so no rank waits on a peer that gave up.
The on-disk format is store.py's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from trainer import metrics, ranks, repro
from trainer.checkpoint import store
from trainer.checkpoint.weights import flatten, load_weights_into
from trainer.config import Config, to_dict, to_yaml
from trainer.errors import (
    ConfigError,
    RetryableError,
    UsageError,
    first_line,
    io_error,
    is_permanent_io,
)

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


WRITABLE_FIX = "point ckpt.dir (default <run_dir>/checkpoints) at writable storage"


def config_conflicts(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every change a resume cannot honour exactly."""
    a, b = flatten(saved), flatten(current)
    diffs = []
    for key in sorted(a.keys() | b.keys()):
        if key.startswith(RESUMABLE_CHANGES) or a.get(key) == b.get(key):
            continue
        diffs.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return diffs


def choose_resume(resume: str, root: str, warn, skip=()) -> str | None:
    """The checkpoint to resume from for ckpt.resume (auto | never | PATH), or None.

    `skip`: checkpoints that verified but turned out damaged on loading (passed over like
    corrupt ones)."""
    if resume == "never":
        return None
    if resume == "auto":
        found = store.latest_valid(root, warn, skip)
        if found is None and store.list_checkpoints(root):
            # Starting fresh would overwrite them and the run's metrics: let the user decide.
            raise UsageError(
                f"ckpt.resume=auto: no checkpoint in {root} verifies (all are damaged): move them "
                "away, resume from a good copy with ckpt.resume=PATH, or use a new run_dir"
            )
        return found
    path = resume
    if not os.path.isdir(path):
        raise UsageError(f"ckpt.resume={path}: no such checkpoint directory (or use auto / never)")
    if not store.is_step_dir(path):  # a run dir or a checkpoints folder
        candidate = store.latest_in(path, warn, skip)
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
        """The loop state to start from (resumed or fresh) and the results saved with it.

        A checkpoint that verifies but whose contents do not fit (edited and re-sealed, another
        model) is passed over like a corrupt one under ckpt.resume=auto (or a run directory):
        the next older one is tried. A checkpoint named by path is refused (exit 2).
        """
        self.check_writable()
        damaged: list[str] = []
        if self.world.is_main:
            store.remove_stale_temporaries(self.root)
        while True:
            choice, error = None, None
            if self.world.is_main:
                try:
                    choice = choose_resume(self.cfg.ckpt.resume, self.root, self.log.info, damaged)
                except UsageError as e:
                    error = str(e)
            choice, error = ranks.broadcast_object((choice, error))
            if error:
                raise ConfigError(error)  # rank 0 decided for everyone: reported once
            if choice is None:
                return self._fresh_start()
            try:
                loaded, problem = self._load(choice), None
            except store.CorruptCheckpoint as e:
                loaded, problem = None, first_line(e)
            problems = ranks.gather_objects(problem)  # the ranks agree before anyone trains on
            if self.world.is_main:
                problem = next((p for p in problems if p), None)
            problem = ranks.broadcast_object(problem)
            if problem is None:
                return loaded
            if store.is_step_dir(self.cfg.ckpt.resume):
                raise ConfigError(
                    f"ckpt.resume={self.cfg.ckpt.resume}: damaged checkpoint ({problem}); "
                    "pick another"
                )
            self.log.info(
                f"checkpoint {choice} is damaged ({problem}); falling back to an older one"
            )
            damaged.append(choice)

    def check_writable(self) -> None:
        """Fail before any work when ckpt.dir cannot hold checkpoints: exit 2 when the path is
        at fault (read-only, no permission, under a file, under /proc), 4 when it may clear up."""
        problem = None
        if self.world.is_main:
            created = []  # the folders the probe makes, removed again: it leaves nothing behind
            folder = self.root
            while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
                created.append(folder)
                folder = os.path.dirname(folder)
            try:
                os.makedirs(self.root, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=self.root)
                os.close(fd)
                os.remove(probe)
            except OSError as e:
                error = io_error(e, f"ckpt.dir {self.root} is not writable", WRITABLE_FIX)
                problem = (isinstance(error, UsageError), str(error))
            finally:
                for folder in created:  # deepest first
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
        problem = ranks.broadcast_object(problem)
        if problem:
            permanent, message = problem
            raise ConfigError(message) if permanent else CheckpointWriteError(message)

    def _fresh_start(self) -> tuple[LoopState, dict]:
        if self.cfg.ckpt.init_weights:
            load_weights_into(
                self.step.model, self.cfg.ckpt.init_weights, self.step.strategy, self.cfg.model
            )
            self.log.info(f"initial weights from {self.cfg.ckpt.init_weights}")
        repro.seed_rank(self.cfg.seed, self.world.rank)
        self.last_saved_step = 0  # step 0 needs no checkpoint: a fresh start recreates it
        return LoopState(), {}

    def _load(self, path: str) -> tuple[LoopState, dict]:
        if not os.path.isdir(path):
            raise UsageError(
                f"rank {self.world.rank} on {repro.hostname()} cannot see checkpoint {path}: "
                "ckpt.dir must be on storage every node mounts (a shared volume / RWX PVC)"
            )
        payload = store.read(path)  # raises CorruptCheckpoint for contents that do not fit
        meta, extra = payload["meta"], payload["extra"]
        from omegaconf import DictConfig, OmegaConf

        try:
            saved_cfg = OmegaConf.create(payload["config_yaml"])
        except Exception as e:  # YAML syntax, or a value OmegaConf cannot hold
            raise store.CorruptCheckpoint(f"config.yaml is not YAML ({first_line(e)})") from None
        if not isinstance(saved_cfg, DictConfig):
            raise store.CorruptCheckpoint(
                f"config.yaml holds a {type(saved_cfg).__name__}, not a config mapping"
            )
        saved_cfg = OmegaConf.to_container(saved_cfg)
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
            _check_weights(step.model, payload["model"])
            step.strategy.load_state_dict(step.model, payload["model"])
            with _damaged_if_it_fails("optimizer.pt does not fit this optimizer"):
                step.strategy.load_optimizer_state(step.model, step.optimizer, payload["optimizer"])
        sched = dict(extra["scheduler"])
        # The lr is a pure function of the step: keep this run's schedule, restore its position.
        lambdas = sched.get("lr_lambdas", [])
        sched["lr_lambdas"] = [None] * (len(lambdas) if isinstance(lambdas, list) else 0)
        with _damaged_if_it_fails("state.pt: the scheduler state does not fit"):
            step.scheduler.load_state_dict(sched)
        if extra.get("scaler"):
            with _damaged_if_it_fails("state.pt: the grad scaler state does not fit"):
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
        permanent = False
        try:
            if self.step.strategy.sharded:
                path = self._write_sharded(target, state, results, reason, rngs)
            else:
                path = self._write_whole(target, state, results, reason, rngs)
            error = None
        except Exception as e:  # OSError, torch/safetensors/DCP write errors: disk full, I/O, ...
            path, error = None, store.describe_error(e)
            permanent = is_permanent_io(store.root_cause(e))
        if error and self.world.is_main:
            error = (
                f"checkpoint at step {state.step} could not be written to {target} ({error}); "
                f"the previous checkpoint is intact: {store.latest_valid(self.root) or 'none yet'}"
            )
            if permanent:  # read-only, no permission, ...: no retry can help
                error = f"ckpt.dir {self.root}: {error}: {WRITABLE_FIX}"
        # Rank 0 wrote (or sealed) it: its outcome is everyone's.
        path, error, permanent = ranks.broadcast_object((path, error, error and permanent))
        if error:
            self.failures += 1
            raise (ConfigError if permanent else CheckpointWriteError)(error)
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
                error = (e.errno, e.strerror or first_line(e), e.filename)
        tmp, error = ranks.broadcast_object((tmp, error))
        if error:
            raise OSError(*error)  # with its errno: a read-only ckpt.dir is not worth a retry
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


def _check_weights(model, state: dict) -> None:
    """A checkpoint's weights have this model's names and shapes (CorruptCheckpoint if not)."""
    from trainer.strategy import unwrap

    expected = unwrap(model).state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise store.CorruptCheckpoint(
            f"model.safetensors does not hold this model's weights (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    for name, tensor in expected.items():
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise store.CorruptCheckpoint(
                f"model.safetensors: {name} has shape {tuple(state[name].shape)}, the model "
                f"{tuple(tensor.shape)}"
            )


class _damaged_if_it_fails:
    """Turn a state loader's complaint about saved contents into CorruptCheckpoint."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, (KeyError, IndexError, TypeError, ValueError, RuntimeError)):
            raise store.CorruptCheckpoint(f"{self.what} ({first_line(e)})") from None
        return False


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
