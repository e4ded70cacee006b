"""What a run saves and restores, where, and who does what across ranks.

The Checkpointer is handed the run's Stateful parts (trainer/state.py: model and optimizer, the
schedule, the loop position, the results, the RNG streams) and alone decides the format (whole
files from rank 0, or every rank's DCP shards where the weights are sharded), verification and
fallback. Rank 0 picks the checkpoint and writes it; every rank loads it (the checkpoint
directory must be storage all nodes share); every rank learns each outcome, so no rank waits on
a peer that gave up. The on-disk format is store.py's; resume decisions are resume.py's.

Scheduled saves (ckpt.async_save) stall the ranks only for a host copy of the state: rank 0
writes the files, checksums, manifest and rename on its writer thread (writer.py; under fsdp,
after every rank's shards, which DCP writes on its own thread), one save at a time, and every
rank learns the outcome at the next save, stop or end (`wait`). A save that must be on disk
before the process goes on (a signal's, the final one) is written in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer import metrics, ranks, repro, rundir, storage
from trainer.checkpoint import bucket, store
from trainer.checkpoint.resume import Resume, choose_resume, decide, resume_line, schedule_line
from trainer.checkpoint.weights import non_finite_text
from trainer.checkpoint.writer import BackgroundWriter, timed
from trainer.config import Config, to_dict, to_yaml
from trainer.errors import (
    ConfigError,
    RetryableError,
    UsageError,
    first_line,
    io_error,
    is_permanent_io,
)
from trainer.state import StateMismatch
from trainer.strategy import plain_copy

if TYPE_CHECKING:
    from trainer.metrics import RunLogger
    from trainer.ranks import World
    from trainer.state import Parts


def checkpoint_dir(cfg: Config) -> str:
    """ckpt.dir, defaulting to <run_dir>/checkpoints (kept unresolved in the config, so a re-run
    under another run_dir never resumes from the original run's checkpoints); a bucket's URL
    (s3://bucket/prefix) as it is."""
    if storage.is_url(cfg.ckpt.dir):
        return cfg.ckpt.dir.rstrip("/")
    return os.path.abspath(cfg.ckpt.dir or os.path.join(cfg.run_dir, "checkpoints"))


class CheckpointWriteError(RetryableError):
    """A checkpoint could not be written (full disk, I/O error); the previous one is intact."""


WRITABLE_FIX = "point ckpt.dir (default <run_dir>/checkpoints) at writable storage"


@dataclass(frozen=True)
class Reason:
    """Why a checkpoint is saved (meta.json's and metrics.jsonl's "reason"), and what follows."""

    name: str
    scheduled: bool = False
    """On schedule: it may land after training went on (ckpt.async_save writes it in the
    background), and metrics.jsonl alone records it (a console line each was noise)."""
    quiet: bool = False
    """No console line (every scheduled save, and the final one)."""

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def signal(name: str) -> Reason:
        return Reason(f"signal {name}")


EVERY_STEPS = Reason("every_steps", scheduled=True, quiet=True)
EVERY_EPOCHS = Reason("every_epochs", scheduled=True, quiet=True)
EVERY_MINUTES = Reason("every_minutes", scheduled=True, quiet=True)
FINAL = Reason("final", quiet=True)
METRICS_FAILED = Reason("metrics write failed")
DATA_UNAVAILABLE = Reason("data unavailable")
DRY_RUN = Reason("dry-run")


def save_due(cfg, last_save: float, now: float | None = None) -> bool:
    """Whether ckpt.every_minutes of wall time (time.monotonic) passed since the last save."""
    if not cfg.every_minutes:
        return False
    now = time.monotonic() if now is None else now
    return now - last_save >= 60 * cfg.every_minutes


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
    """Saves and restores a run's Parts in checkpoint_dir(cfg)."""

    def __init__(self, cfg: Config, world: World, parts: Parts, log: RunLogger):
        self.cfg, self.world, self.parts, self.log = cfg, world, parts, log
        self.root = checkpoint_dir(cfg)
        self.failures = 0
        self._on_disk: int | None = None
        """The newest step whose checkpoint is on disk (a background write counts once waited)."""
        self._last_save = time.monotonic()
        """When the last save that did not fail began (or this run segment started):
        ckpt.every_minutes counts from it."""
        self._writer = BackgroundWriter()
        self._stager = None
        """Sharded background saves: host buffers for the shards, reused from save to save."""
        self._resumed: str | None = None
        """The checkpoint this run segment resumed from: retention never deletes it."""

    # --- what the loop asks ------------------------------------------------------------------

    def on_disk(self, step: int) -> bool:
        """Whether the checkpoint of `step` is on disk (a background write once it landed)."""
        return self._on_disk == step

    def holds(self, step: int) -> bool:
        """Whether a save of `step` is on disk or in flight (a failed one does not count)."""
        newest = self._writer.step if self._writer.step is not None else self._on_disk
        return newest == step

    def newest_on_disk(self) -> int | None:
        """The step of the newest checkpoint on disk this run segment knows of (0 on a fresh
        start: step 0 needs none), None before restore."""
        return self._on_disk

    def due_by_time(self, now: float | None = None) -> bool:
        """Whether ckpt.every_minutes have passed since the last save (this rank's clock)."""
        return save_due(self.cfg.ckpt, self._last_save, now)

    # --- restore -----------------------------------------------------------------------------

    def restore(self) -> Resume | None:
        """Load the checkpoint ckpt.resume picks into the parts; the Resume record, or None for a
        fresh start (run.build then initialises the weights and seeds the ranks).

        A checkpoint that verifies but whose contents do not fit (edited and re-sealed, another
        model) is passed over like a corrupt one under ckpt.resume=auto (or a run directory):
        the next older one is tried. A checkpoint named by path is refused (exit 2).
        """
        self.check_writable()
        started = time.perf_counter()
        damaged: list[str] = []
        if self.world.is_main:
            store.remove_stale_temporaries(self.root)
        if storage.is_url(self.root):  # every node: local copies that SIGKILLed runs left
            bucket.sweep_local()
        while True:
            # Rank 0 decides for everyone; a mistake is reported once (ConfigError).
            choice = ranks.main_decides(self._choose, damaged)
            if choice is None:
                self._on_disk = 0  # step 0 needs no checkpoint: a fresh start remakes it
                if self.cfg.ckpt.resume == "never" and self.world.is_main:
                    self._say_what_stays()
                return None
            try:
                resumed, problem = self._load(choice), None
            except store.CorruptCheckpoint as e:
                resumed, problem = None, first_line(e)
            problem = ranks.first_of_ranks(problem)  # the ranks agree before anyone trains on
            if problem is None:
                self._resumed = choice
                # The listing, download, verification and load: metrics.jsonl's "restored".
                return dataclasses.replace(resumed, seconds=time.perf_counter() - started)
            if store.is_step_dir(self.cfg.ckpt.resume):
                raise ConfigError(
                    f"ckpt.resume={self.cfg.ckpt.resume}: damaged checkpoint ({problem}); "
                    "pick another"
                )
            self.log.info(
                f"checkpoint {choice} is damaged ({problem}); falling back to an older one"
            )
            damaged.append(choice)

    def _say_what_stays(self) -> None:
        """ckpt.resume=never into a folder or prefix holding an earlier run's checkpoints: they
        stay, and count in retention and in a later ckpt.resume=auto. Said, never silent."""
        try:
            found = store.list_checkpoints(self.root)
        except OSError:
            return
        if found:
            self.log.info(
                f"note: ckpt.resume=never: {self.root} holds {len(found)} checkpoint(s) of an "
                f"earlier run (newest: step {found[0][0]}); they stay, and count in "
                "ckpt.keep_last and in a later ckpt.resume=auto: give each run its own ckpt.dir "
                "to keep them apart"
            )

    def _choose(self, damaged: list[str]) -> str | None:
        """choose_resume on rank 0: a mistake is a ConfigError (exit 2); storage that cannot be
        listed or read (a bucket's server down: exit 4; a key refused: exit 2) one line too."""
        try:
            with storage.explained(f"cannot list the checkpoints in {self.root}"):
                return choose_resume(self.cfg.ckpt.resume, self.root, self.log.info, damaged)
        except UsageError as e:
            raise ConfigError(str(e)) from None

    def check_writable(self) -> None:
        """Fail before any work when ckpt.dir cannot hold checkpoints: exit 2 when the path is
        at fault (read-only, no permission, under a file, under /proc), 4 when it may clear up."""
        ranks.main_decides(self._probe)

    def _probe(self) -> None:
        """Rank 0: create ckpt.dir and a file in it, then remove what the probe made (in a
        bucket: put and delete an object, which proves the bucket, the key and its rights)."""
        if storage.is_url(self.root):
            try:
                with storage.explained(f"ckpt.dir {self.root} is not writable"):
                    storage.probe(self.root)
            except UsageError as e:
                raise ConfigError(str(e)) from None
            except RetryableError as e:
                raise CheckpointWriteError(str(e)) from None
            return
        if (e := rundir.probe_folder(self.root)) is not None:
            error = io_error(e, f"ckpt.dir {self.root} is not writable", WRITABLE_FIX)
            raise (ConfigError if isinstance(error, UsageError) else CheckpointWriteError)(
                str(error)
            )

    def _load(self, path: str) -> Resume:
        """Load the checkpoint at `path` into the parts (a collective under fsdp); one in a
        bucket from a verified local copy (every rank makes its own, and the ranks agree that
        every copy verified before any loads: a rank that could not fetch its copy must not
        leave the others waiting in DCP's collectives)."""
        if not storage.is_url(path):
            return self._load_from(path, path)
        folder = bucket.local_folder("checkpoint")
        try:
            problem = None
            try:
                bucket.download(path, folder)
            except store.CorruptCheckpoint as e:
                problem = ("damaged", first_line(e))
            except OSError as e:  # storage.BucketError: the server, the key, the network
                problem = ("unreadable", str(e))
            problem = ranks.first_of_ranks(problem)
            if problem and problem[0] == "damaged":
                raise store.CorruptCheckpoint(problem[1])
            if problem:
                raise RetryableError(
                    f"cannot read checkpoint {path} ({problem[1]}); the run did not start: "
                    "rerun once the bucket answers"
                )
            return self._load_from(path, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _load_from(self, path: str, local: str) -> Resume:
        if not os.path.isdir(local):
            raise UsageError(
                f"rank {self.world.rank} on {repro.hostname()} cannot see checkpoint {path}: "
                "ckpt.dir must be on storage every node mounts (a shared volume / RWX PVC)"
            )
        payload = store.read(local)  # raises CorruptCheckpoint for contents that do not fit
        bitwise = self.cfg.repro.world_invariant
        kernels = repro.kernel_set(self.world.device) if bitwise else {}
        resume = decide(path, payload, to_dict(self.cfg), kernels, bitwise)
        self._load_parts(local, payload)
        loop = self.parts.loop
        loop.load_state_dict(resume.loop)
        self.parts.results.load_state_dict(resume.results)
        note = self.parts.rng.load_state_dict(payload["extra"]["rng"], step=loop.step)
        self.log.info(resume_line(resume, loop.epoch, loop.step_in_epoch, note))
        if line := schedule_line(resume, self.cfg.sched.name):
            self.log.info(line)
        self._on_disk = loop.step
        return resume

    def _load_parts(self, path: str, payload: dict) -> None:
        """The weights, optimizer state, schedule and scaler from the checkpoint; whatever of
        them does not fit, or holds NaN/inf, is a CorruptCheckpoint."""
        model, extra = self.parts.model, payload["extra"]
        try:
            if store.is_sharded(path):
                from trainer.checkpoint import sharded

                flat = payload["meta"].get("optimizer_keys") == "flat"  # older: nested
                state = model.state_dict(flat)
                sharded.load(state, path)
                model.load_state_dict(state, flat)
            else:  # optimizer state keyed by name; by index before names ("optimizer_keys")
                named = payload["meta"].get("optimizer_keys") == "names"
                model.load_whole_state_dict(
                    {"model": payload["model"], "optimizer": payload["optimizer"]},
                    index_keyed=not named,
                )
            self.parts.schedule.load_state_dict({k: extra.get(k) for k in ("scheduler", "scaler")})
        except StateMismatch as e:
            raise store.CorruptCheckpoint(f"{_PARTS[e.part]} ({e.detail})") from None
        if bad := model.non_finite():
            raise store.CorruptCheckpoint(
                non_finite_text(bad, "its model or optimizer state holds")
            )

    # --- save --------------------------------------------------------------------------------

    def save(self, reason: Reason) -> str:
        """Write the run's next checkpoint (a collective), prune old ones, and say so; raises
        CheckpointWriteError (ConfigError when ckpt.dir cannot be written at all) on every rank.
        A background save returns once the state is copied; `wait` reports how it ended."""
        started, began = time.perf_counter(), time.monotonic()
        self.wait()  # at most one write in flight
        step = self.parts.loop.step
        background = self.cfg.ckpt.async_save and reason.scheduled
        path = self.write(self.root, reason, background=background)
        # Written (or its write in flight): ckpt.every_minutes counts from here. A failed save
        # does not count, so the next log window tries again.
        self._last_save = began
        if background:
            self._writer.step = step  # every rank: each learns the outcome at the next wait
        else:
            if self.world.is_main:
                store.prune(self.root, self.cfg.ckpt.keep_last, (self._resumed, path))
            self._on_disk = step
        took = time.perf_counter() - started
        record = {"kind": "checkpoint", "step": step, "reason": str(reason), "seconds": took}
        self.log.record({**record, "background": background, "path": path}, console=False)
        if not reason.quiet:  # a save the user should see (a signal's): say so
            self.log.info(f"checkpoint {os.path.basename(path)} ({reason}, {took:.2f} s)")
        return path

    def save_or_warn(self, reason: Reason) -> None:
        """Periodic saves: a failure is reported loudly but training goes on."""
        try:
            self.save(reason)
        except CheckpointWriteError as e:
            self.log.info(f"WARNING: {e}; training continues, the next save will retry")

    def wait(self) -> None:
        """The background write in flight, if any, lands, and every rank learns how (a
        collective when one is in flight). A failure is a warning, as any scheduled save's is
        (the previous checkpoint is intact), except one no retry can fix: ConfigError, exit 2."""
        if self._writer.step is None:
            return
        step, outcome, waited = self._writer.finish()  # the outcome is rank 0's
        seconds, error, permanent, waited = ranks.broadcast_object(
            (*outcome, waited) if outcome else None
        )
        if error:
            self.failures += 1
            if permanent:  # no later save can succeed either: exit 2 now, as a blocking save
                raise ConfigError(error)
            self.log.info(f"WARNING: {error}; training continues, the next save will retry")
            return
        self._on_disk = step
        record = {"kind": "checkpoint_written", "step": step, "seconds": seconds}
        self.log.record({**record, "waited": waited}, console=False)

    def close(self) -> None:
        """Let a write in flight finish (this rank alone: no collective) and stop the thread."""
        self._writer.close()

    def write(self, root: str, reason: Reason, background: bool = False) -> str:
        """Write a full checkpoint of this step into `root` (a collective) and return its path;
        a failure raises on every rank. save() is the run's; the dry run writes to a scratch
        folder. `background`: rank 0 copies the state and hands the writing to its thread."""
        rngs = self.parts.rng.state_dict()
        step, permanent = self.parts.loop.step, False
        how = self._write_sharded if self.parts.model.sharded else self._write_whole
        try:
            path, error = how(root, reason, rngs, background), None
        except Exception as e:  # OSError, torch/safetensors/DCP write errors: disk full, I/O, ...
            path, error = None, store.describe_error(e)
            if self.world.is_main:
                error, permanent = self._failure(root, step, e)
        # Rank 0 wrote (or sealed) it: its outcome is everyone's.
        path, error, permanent = ranks.broadcast_object((path, error, error and permanent))
        if error:
            self.failures += 1
            raise (ConfigError if permanent else CheckpointWriteError)(error)
        return path

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

    def _in_background(self, step: int, write, path: str) -> None:
        """Rank 0: run `write` (which puts the checkpoint of `step` at `path`), then prune, on
        the writer thread; its outcome is everyone's at the next `wait`."""

        def job() -> None:
            write()
            store.prune(self.root, self.cfg.ckpt.keep_last, (self._resumed, path))

        self._writer.start(timed(job, lambda e: self._failure(self.root, step, e)))

    def _write_whole(self, root: str, reason: Reason, rngs, background: bool) -> str | None:
        """Rank 0 writes the whole checkpoint; the other ranks hold the same replica."""
        if not self.world.is_main:
            return None
        step = self.parts.loop.step
        whole = self.parts.model.whole_state_dict()  # the live tensors, keyed by name
        model, optimizer = plain_copy(whole["model"]), whole["optimizer"]  # safetensors: unshared
        common = self._common(reason, rngs, "whole")
        if not background:
            return store.write(root, step, model=model, optimizer=optimizer, **common)
        path = store.new_checkpoint(root, step)
        job = functools.partial(
            store.write, root, step, model=model, optimizer=host_copy(optimizer), path=path,
            **host_copy(common),
        )  # fmt: skip
        self._in_background(step, job, path)
        return path

    def _write_sharded(self, root: str, reason: Reason, rngs, background: bool) -> str | None:
        """Every rank writes its shards into one temporary directory (rank 0 names it), which
        rank 0 then seals with the common files and the manifest and renames into place. In the
        background: every rank copies its shards to host memory and DCP writes them on its own
        thread; rank 0's writer thread waits for all of them, then seals and renames."""
        from trainer.checkpoint import sharded

        step = self.parts.loop.step
        remote = storage.is_url(root)
        if remote:  # every rank writes its shards to a local folder and uploads them from there
            path = ranks.broadcast_object(store.new_checkpoint(root, step))
            tmp = bucket.staging(path)
        else:
            path = store.step_dir(root, step)
            # With its errno: a read-only ckpt.dir is not worth a retry.
            tmp = ranks.main_decides(store.begin, path, catch=(OSError,))
        upload = path if remote else None
        try:
            common = self._common(reason, rngs, "sharded") if self.world.is_main else None
            state = self.parts.model.state_dict()
            if background:
                return self._shards_in_background(state, tmp, path, common, upload)
            sharded.save(state, tmp, upload)  # any rank's failure: all raise
            if self.world.is_main:
                _seal(None, tmp, path, common)
            elif remote:
                store.abort(tmp)
        except BaseException:
            if self.world.is_main or remote:
                store.abort(tmp)
            raise
        return path if self.world.is_main else None

    def _shards_in_background(
        self, state: dict, tmp: str, path: str, common, upload: str | None
    ) -> str | None:
        """Every rank's shards copied to host memory and written on DCP's thread; rank 0's writer
        thread seals the folder once all have landed."""
        from trainer.checkpoint import sharded

        if self._stager is None:
            self._stager = sharded.HostCopy()
        step = self.parts.loop.step
        written = sharded.save_in_background(state, tmp, ranks.writer_group(), self._stager, upload)
        if not self.world.is_main:
            if upload:  # this rank's local copy of its shards goes once they are uploaded
                written.add_done_callback(lambda _: store.abort(tmp))
            self._writer.start(None, shards=written)
            return None
        self._in_background(
            step, functools.partial(_seal, written, tmp, path, host_copy(common)), path
        )
        return path

    def _common(self, reason: Reason, rngs, fmt: str) -> dict:
        """state.pt, meta.json and config.yaml: what every checkpoint holds beside the tensors."""
        p = self.parts
        return {
            "extra": {**p.schedule.state_dict(), "rng": rngs, "world_size": self.world.size},
            "meta": {
                "loop": p.loop.state_dict(),
                "format": fmt,
                # Both keyed by parameter name: flattened in DCP's shards, nested in whole files.
                "optimizer_keys": "flat" if fmt == "sharded" else "names",
                "strategy": p.model.layout,
                "reason": str(reason),
                "world_size": self.world.size,
                "restart_count": self.world.restart_count,
                "time": time.time(),
                "results": p.results.state_dict(),
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

    # --- the dry run's round trip ------------------------------------------------------------

    def round_trip(self) -> dict:
        """Save, verify and load a checkpoint in a private folder beside the real ones; every
        rank reads it back (which proves the storage is shared), then it is removed. A failure
        is one UsageError on every rank."""
        scratch = ranks.broadcast_object(
            storage.join(self.root, f"{bucket.DRY_RUN}{uuid.uuid4().hex[:8]}")
        )
        remote = storage.is_url(scratch)
        started = time.perf_counter()
        path = self.write(scratch, DRY_RUN)
        try:
            first = self._agree(lambda: store.verify(path))  # per rank: no collective inside
            if not first:
                first = self._agree(lambda: self._holds_live_weights(path))
            if first:
                size = 0
            elif remote:
                size = sum(item.size for item in storage.listing(path))
            else:
                size = sum(os.path.getsize(os.path.join(path, f)) for f in store.files_under(path))
        finally:
            ranks.gather_objects(None)  # every rank is done reading before the delete
            if self.world.is_main and remote:
                bucket.delete_prefix(scratch)
            elif self.world.is_main:
                shutil.rmtree(scratch, ignore_errors=True)
                with contextlib.suppress(OSError):  # leave no empty checkpoints folder behind
                    os.rmdir(self.root)
        if first:
            raise UsageError(f"dry run: checkpoint round trip in {self.root} failed ({first})")
        return {"bytes": size, "seconds": time.perf_counter() - started}

    def _agree(self, check) -> str | None:
        """Run `check` on every rank; the first rank's error, on every rank (None if all
        passed)."""
        error = None
        try:
            check()
        except (UsageError, store.CorruptCheckpoint, OSError) as e:
            error = f"rank {self.world.rank}: {e}"
        return ranks.first_of_ranks(error)

    def _holds_live_weights(self, path: str) -> None:
        """The checkpoint holds exactly this rank's live weights (its shards, when sharded)."""
        import torch

        model = self.parts.model
        with store.readable(path) as local:
            if store.is_sharded(local):
                from trainer.checkpoint import sharded

                saved = sharded.read_local_model(model.state_dict()["model"], local)
            else:
                saved = store.read(local)["model"]
        for name, tensor in model.local_weights().items():
            if not torch.equal(saved[name], tensor):
                raise UsageError(f"the round trip changed {name}")


def _seal(written, tmp: str, path: str, common: dict) -> None:
    """Rank 0, once every rank's shards are in `tmp` (`written`: their background write): add
    the common files and the manifest, and rename it into place; a failure removes it."""
    from trainer.checkpoint import sharded

    try:
        if written is not None:
            written.result()  # ShardWriteError when any rank could not write
        if storage.is_url(path):
            store.seal(tmp, **common)
            bucket.publish(tmp, path, sharded.shard_files(tmp))  # every rank's shards there
            store.abort(tmp)  # the local copy
            return
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


_PARTS = {
    "model": "model.safetensors does not hold this model's weights",
    "optimizer": "optimizer.pt does not fit this optimizer",
    "scheduler": "state.pt: the scheduler state does not fit",
    "scaler": "state.pt: the grad scaler state does not fit",
}
"""What a checkpoint file holds of each part (StateMismatch's), for CorruptCheckpoint."""
