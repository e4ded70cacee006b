"""What a run saves and restores, where, and who does what across ranks.

Rank 0 picks the checkpoint and writes it; every rank loads it (the checkpoint directory must be
storage all nodes share); every rank learns each outcome, so no rank waits on a peer that gave up.
The on-disk format is store.py's.

Scheduled saves (ckpt.async_save) stall the ranks only for a host copy of the state: rank 0
writes the files, checksums, manifest and rename in a background thread (under fsdp, after every
rank's shards, which DCP writes on its own thread), one save at a time, and every rank learns the
outcome at the next save, stop or end (`wait`). A save that must be on disk before the process
goes on (a signal's, the final one) is written in place.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from trainer import metrics, ranks, repro
from trainer.checkpoint import store
from trainer.checkpoint.weights import flatten, non_finite, non_finite_text
from trainer.config import Config, to_dict, to_yaml
from trainer.errors import (
    ConfigError,
    RetryableError,
    UsageError,
    first_line,
    io_error,
    is_permanent_io,
)
from trainer.results import Results
from trainer.step import StateMismatch

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


SCHEDULE_KEYS = ("train.epochs", "train.max_steps")
"""Keys a resume may change that move the run's last step, and with it the lr schedule (a
function of the step and the total): said in one line and recorded, never silent."""


def schedule_changes(saved: dict, current: dict) -> dict[str, list]:
    """{key: [saved, current]} for the SCHEDULE_KEYS a resume changes."""
    a, b = flatten(saved), flatten(current)
    return {k: [a.get(k), b.get(k)] for k in SCHEDULE_KEYS if a.get(k) != b.get(k)}


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


ROUTINE_SAVES = ("every_steps", "every_epochs", "every_minutes", "final")
"""Saves on schedule: metrics.jsonl records only (one console line per epoch was noise)."""
BACKGROUND_SAVES = ("every_steps", "every_epochs", "every_minutes")
"""Saves that may land after training went on: nothing waits for them to be on disk."""


def host_copy(obj):
    """`obj` with every tensor copied to the host and every container copied: a snapshot that
    training can go on changing the original of (the optimizer updates its state in place)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class Checkpointer:
    """Saves and restores everything `step` trains (model, optimizer, schedule, loss scaler) with
    the loop position and every rank's RNG, in checkpoint_dir(cfg)."""

    def __init__(self, cfg: Config, world: World, step: TrainStep, log: RunLogger):
        self.cfg, self.world, self.step, self.log = cfg, world, step, log
        self.root = checkpoint_dir(cfg)
        self.last_saved_step: int | None = None
        """The newest step whose checkpoint is on disk (a background write counts once waited)."""
        self.last_save_time = time.monotonic()
        """When the last save that did not fail began (or this run segment started):
        ckpt.every_minutes counts from it."""
        self.failures = 0
        self._pending: int | None = None
        """The step of the background write in flight (every rank knows it; rank 0 runs it)."""
        self._future: Future | None = None
        """Rank 0: the writer thread's job (its outcome is everyone's)."""
        self._shards: Future | None = None
        """Other ranks, sharded: their own shards' background write."""
        self._executor: ThreadPoolExecutor | None = None
        self._stager = None
        """Sharded background saves: host buffers for the shards, reused from save to save."""
        self.resumed_with: dict[str, list] = {}
        """The schedule-shaping keys the resume changed (SCHEDULE_KEYS): {key: [saved, now]}."""

    # --- restore -----------------------------------------------------------------------------

    def restore(self) -> tuple[LoopState, Results] | None:
        """The loop state to resume from and the results saved with it; None for a fresh start
        (run.build then initialises the weights and seeds the ranks).

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
                self.last_saved_step = 0  # step 0 needs no checkpoint: a fresh start remakes it
                return None
            try:
                loaded, problem = self._load(choice), None
            except store.CorruptCheckpoint as e:
                loaded, problem = None, first_line(e)
            problem = ranks.first_of_ranks(problem)  # the ranks agree before anyone trains on
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

    def _load(self, path: str) -> tuple[LoopState, Results]:
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
        current = to_dict(self.cfg)
        conflicts = config_conflicts(saved_cfg, current)
        self.resumed_with = schedule_changes(saved_cfg, current)
        if conflicts:
            raise ConfigError(
                f"cannot resume {path}: the config changed ({'; '.join(conflicts[:4])}); "
                "use the saved values, or start fresh with ckpt.resume=never or a new run_dir"
            )
        self._check_same_kernels(path, meta)
        trained = {k: extra.get(k) for k in ("scheduler", "scaler")}
        if store.is_sharded(path):
            from trainer.checkpoint import sharded

            sharded.load(self.step.model, self.step.optimizer, path)
        else:
            trained.update(model=payload["model"], optimizer=payload["optimizer"])
        try:
            self.step.load_state_dict(trained)
        except StateMismatch as e:
            raise store.CorruptCheckpoint(f"{_PARTS[e.part]} ({e.detail})") from None
        if bad := self._non_finite():
            raise store.CorruptCheckpoint(
                non_finite_text(bad, "its model or optimizer state holds")
            )
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
            f"resumed from {path} (step {state.step}, epoch {state.epoch + 1}, "
            f"step {state.step_in_epoch} of the epoch){note}"
        )
        if self.resumed_with:
            changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.resumed_with.items())
            self.log.info(
                f"resume changes {changes}: the run now ends at another step, and the lr "
                f"schedule (sched.name={self.cfg.sched.name}) is recomputed for the new length "
                "from here on (recorded in run.json and metrics.jsonl)"
            )
        self.last_saved_step = state.step
        return state, Results.from_dict(meta.get("results", {}))

    def _check_same_kernels(self, path: str, meta: dict) -> None:
        """Under repro.world_invariant, a resume on another kind of device, kernel set or torch
        cannot continue the same bits: one line says which and how to go on."""
        saved = meta.get("kernels")
        if not self.cfg.repro.world_invariant or not isinstance(saved, dict):
            return
        here = repro.kernel_set(self.world.device)
        changed = [
            f"{k} {saved.get(k)!r} -> {here.get(k)!r}" for k in here if saved.get(k) != here.get(k)
        ]
        if changed:
            raise ConfigError(
                f"cannot resume {path} bit for bit: it was written with other kernels "
                f"({'; '.join(changed)}): resume where it was written, or start afresh "
                "(ckpt.resume=never); repro.world_invariant=false resumes without the promise"
            )

    def _non_finite(self) -> list[str]:
        """What of the loaded model and optimizer state holds NaN/inf (this rank's part): a
        checkpoint that would only diverge on its first step."""
        import torch

        from trainer.strategy import unwrap

        bad = non_finite(unwrap(self.step.model).state_dict())
        for i, per_param in enumerate(self.step.optimizer.state.values()):
            tensors = {f"optimizer state {i}.{k}": v for k, v in per_param.items()}
            bad += non_finite({k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)})
        return bad

    # --- save --------------------------------------------------------------------------------

    def save(self, state: LoopState, results: Results, reason: str) -> str:
        """Write the run's next checkpoint (a collective), prune old ones, and say so; raises
        CheckpointWriteError (ConfigError when ckpt.dir cannot be written at all) on every rank.
        A background save returns once the state is copied; `wait` reports how it ended."""
        started, began = time.perf_counter(), time.monotonic()
        self.wait()  # at most one write in flight
        background = self.cfg.ckpt.async_save and reason in BACKGROUND_SAVES
        path = self.write(self.root, state, results, reason, background=background)
        # Written (or its write in flight): ckpt.every_minutes counts from here. A failed save
        # does not count, so the next log window tries again.
        self.last_save_time = began
        if background:
            self._pending = state.step
        else:
            if self.world.is_main:
                store.prune(self.root, self.cfg.ckpt.keep_last)
            self.last_saved_step = state.step
        took = time.perf_counter() - started
        record = {"kind": "checkpoint", "step": state.step, "reason": reason, "seconds": took}
        self.log.record({**record, "background": background, "path": path}, console=False)
        if reason not in ROUTINE_SAVES:  # a save the user should see (a signal's): say so
            self.log.info(f"checkpoint {os.path.basename(path)} ({reason}, {took:.2f} s)")
        return path

    @property
    def newest_step(self) -> int | None:
        """The step of the newest save on disk or in flight (a failed one does not count)."""
        return self._pending if self._pending is not None else self.last_saved_step

    def wait(self) -> None:
        """The background write in flight, if any, lands, and every rank learns how (a
        collective when one is in flight). A failure is a warning, as any scheduled save's is
        (the previous checkpoint is intact), except one no retry can fix: ConfigError, exit 2."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        self._own_shards_written()
        outcome = None
        if self.world.is_main:
            assert self._future is not None
            started = time.perf_counter()
            outcome = (*self._future.result(), time.perf_counter() - started)
            self._future = None
        seconds, error, permanent, waited = ranks.broadcast_object(outcome)
        if error:
            self.failures += 1
            if permanent:  # no later save can succeed either: exit 2 now, as a blocking save
                raise ConfigError(error)
            self.log.info(f"WARNING: {error}; training continues, the next save will retry")
            return
        self.last_saved_step = step
        record = {"kind": "checkpoint_written", "step": step, "seconds": seconds}
        self.log.record({**record, "waited": waited}, console=False)

    def close(self) -> None:
        """Let a write in flight finish (this rank alone: no collective) and stop the thread."""
        self._own_shards_written()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _own_shards_written(self) -> None:
        """A rank other than 0 waits for its shards' background write: one DCP write in flight
        per rank. How it went is rank 0's to say (DCP gathers every rank's result there)."""
        shards, self._shards = self._shards, None
        if shards is not None:
            with contextlib.suppress(Exception):
                shards.result()

    def _in_background(self, step: int, job) -> None:
        """Run `job` (which writes the checkpoint of `step`) on the writer thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._future = self._executor.submit(self._background_write, step, job)

    def _background_write(self, step: int, job) -> tuple[float, str | None, bool]:
        """(seconds, None, False) once the checkpoint is in place and old ones pruned, else
        (seconds, what went wrong, whether retrying is moot). Never raises: the ranks learn the
        outcome from rank 0 in `wait`."""
        started = time.perf_counter()
        try:
            job()
            store.prune(self.root, self.cfg.ckpt.keep_last)
            return time.perf_counter() - started, None, False
        except Exception as e:
            return time.perf_counter() - started, *self._failure(self.root, step, e)

    def _failure(self, root: str, step: int, e: BaseException) -> tuple[str, bool]:
        """What to say of a checkpoint that could not be written, and whether retrying is moot
        (read-only, no permission, ...: then the line says where to point ckpt.dir)."""
        try:
            previous = store.latest_valid(self.root) or "none yet"
        except Exception:  # the storage that just failed may fail this read too
            previous = f"the newest valid one in {self.root}"
        error = (
            f"checkpoint at step {step} could not be written to {root} "
            f"({store.describe_error(e)}); the previous checkpoint is intact: {previous}"
        )
        if permanent := is_permanent_io(store.root_cause(e)):
            error = f"ckpt.dir {self.root}: {error}: {WRITABLE_FIX}"
        return error, permanent

    def write(
        self, root: str, state: LoopState, results: Results, reason: str, background=False
    ) -> str:
        """Write a full checkpoint of this step into `root` (a collective) and return its path;
        a failure raises on every rank. save() is the run's; the dry run writes to a scratch
        folder. `background`: rank 0 copies the state and hands the writing to its thread."""
        rngs = ranks.gather_objects(repro.rng_state(self.world.device))
        permanent = False
        try:
            if self.step.strategy.sharded:
                path = self._write_sharded(root, state, results, reason, rngs, background)
            else:
                path = self._write_whole(root, state, results, reason, rngs, background)
            error = None
        except Exception as e:  # OSError, torch/safetensors/DCP write errors: disk full, I/O, ...
            path, error = None, store.describe_error(e)
            if self.world.is_main:
                error, permanent = self._failure(root, state.step, e)
        # Rank 0 wrote (or sealed) it: its outcome is everyone's.
        path, error, permanent = ranks.broadcast_object((path, error, error and permanent))
        if error:
            self.failures += 1
            raise (ConfigError if permanent else CheckpointWriteError)(error)
        return path

    def _write_whole(
        self, root: str, state: LoopState, results: Results, reason: str, rngs, background: bool
    ):
        """Rank 0 writes the whole checkpoint; the other ranks hold the same replica."""
        if not self.world.is_main:
            return None
        trained = self.step.state_dict()  # the model's weights: CPU copies already
        model, optimizer = trained.pop("model"), trained.pop("optimizer")
        common = self._common(state, results, reason, rngs, "whole", trained)
        if not background:
            return store.write(root, state.step, model=model, optimizer=optimizer, **common)
        job = functools.partial(
            store.write,
            root,
            state.step,
            model=model,
            optimizer=host_copy(optimizer),
            **host_copy(common),
        )
        self._in_background(state.step, job)
        return store.step_dir(root, state.step)

    def _write_sharded(
        self, root: str, state: LoopState, results: Results, reason: str, rngs, background: bool
    ):
        """Every rank writes its shards into one temporary directory (rank 0 names it), which
        rank 0 then seals with the common files and the manifest and renames into place. In the
        background: every rank copies its shards to host memory and DCP writes them on its own
        thread; rank 0's writer thread waits for all of them, then seals and renames."""
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
            common = None
            if self.world.is_main:
                schedule = self.step.state_dict(tensors=False)
                common = self._common(state, results, reason, rngs, "sharded", schedule)
            if background:
                group = ranks.writer_group()
                if self._stager is None:
                    self._stager = sharded.HostCopy()
                written = sharded.save_in_background(
                    self.step.model, self.step.optimizer, tmp, group, self._stager
                )
                if not self.world.is_main:
                    self._shards = written
                    return None
                seal = functools.partial(self._seal, written, tmp, path, host_copy(common))
                self._in_background(state.step, seal)
                return path
            sharded.save(self.step.model, self.step.optimizer, tmp)  # any rank's failure: all raise
            if self.world.is_main:
                self._seal(None, tmp, path, common)
        except BaseException:
            if self.world.is_main:
                store.abort(tmp)
            raise
        return path if self.world.is_main else None

    @staticmethod
    def _seal(written: Future | None, tmp: str, path: str, common: dict) -> None:
        """Rank 0, once every rank's shards are in `tmp` (`written`: their background write):
        add the common files and the manifest, and rename it into place; a failure removes it."""
        from trainer.checkpoint import sharded

        try:
            if written is not None:
                written.result()  # ShardWriteError when any rank could not write
            missing = sharded.missing_shards(tmp)
            if missing:
                raise OSError(
                    f"shards {', '.join(missing[:3])} never arrived: ckpt.dir must be storage "
                    "every node mounts (a shared volume / RWX PVC)"
                )
            store.seal(tmp, **common)
            store.commit(tmp, path)
        except BaseException:
            store.abort(tmp)
            raise

    def _common(
        self, state: LoopState, results: Results, reason: str, rngs, fmt: str, trained: dict
    ) -> dict:
        """state.pt, meta.json and config.yaml: what every checkpoint holds beside the tensors
        (`trained`: TrainStep.state_dict's schedule and scaler)."""
        return {
            "extra": {
                "scheduler": trained["scheduler"],
                "scaler": trained["scaler"],
                "rng": rngs,
                "world_size": self.world.size,
            },
            "meta": {
                "loop": state.as_dict(),
                "format": fmt,
                "strategy": self.step.strategy.name,
                "reason": reason,
                "world_size": self.world.size,
                "restart_count": self.world.restart_count,
                "time": time.time(),
                "results": results.to_dict(),
                "versions": self._versions,
                "kernels": repro.kernel_set(self.world.device),
            },
            "config_yaml": self.config_yaml,
        }

    # The same for every save of the run, and slow to make (OmegaConf: ~0.17 s a call here;
    # package metadata ~0.02 s): once per run, not once per save.
    @functools.cached_property
    def config_yaml(self) -> str:
        """The run's config as YAML: config.yaml in each checkpoint, the run folder and final/."""
        return to_yaml(self.cfg)

    @functools.cached_property
    def _versions(self) -> dict:
        return metrics.versions()

    def save_or_warn(self, state: LoopState, results: Results, reason: str) -> None:
        """Periodic saves: a failure is reported loudly but training goes on."""
        try:
            self.save(state, results, reason)
        except CheckpointWriteError as e:
            self.log.info(f"WARNING: {e}; training continues, the next save will retry")


_PARTS = {
    "model": "model.safetensors does not hold this model's weights",
    "optimizer": "optimizer.pt does not fit this optimizer",
    "scheduler": "state.pt: the scheduler state does not fit",
    "scaler": "state.pt: the grad scaler state does not fit",
}
"""What a checkpoint file holds of each part of TrainStep.state_dict, for CorruptCheckpoint."""
