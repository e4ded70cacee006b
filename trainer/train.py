"""`trainer train`: config -> rank facts -> build (data, model, wrap, resume) -> fit -> finish.

One process of a job. Launch it any of these ways; all end in this same code:

    trainer train                                               # one process, CPU or one GPU
    torchrun --standalone --nproc-per-node=2 -m trainer train   # one node, 2 processes (DDP)
    torchrun --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29500 -m trainer train  # 2 nodes
    trainer-launch                                              # in a container: reads compose/k8s env
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time

import torch

from trainer import (
    dryrun,
    loop,
    metrics,
    namedstate,
    ranks,
    repro,
    rundir,
    startup,
    strategy,
    tracking,
)
from trainer.checkpoint.digest import TensorDigest
from trainer.checkpoint.weights import save_streamed
from trainer.config import Config, check_world_size, to_dict
from trainer.diagnostics import flight_recorder_env
from trainer.errors import ConfigError, first_line, io_error
from trainer.orphans import LauncherWatch
from trainer.parallel.dims import ParallelDims, describe
from trainer.run import Plugins, Run, build
from trainer.runlock import RunLock
from trainer.signals import StopSignal


def train(
    cfg: Config,
    *,
    dry_run: bool = False,
    stop: StopSignal | None = None,
    plugins: Plugins | None = None,
) -> dict:
    """Train one rank of the job described by cfg and torchrun's environment; the summary.

    `stop` receives SIGTERM/SIGINT; without one, handlers are installed for the run itself.
    `plugins`: trainer.fit's objects or factories in place of data.name, model.name, task.name.
    """
    if stop is None:
        with StopSignal() as own:
            return train(cfg, dry_run=dry_run, stop=own, plugins=plugins)
    started = time.time()
    tracking.check(cfg, os.environ)  # a tracking mistake: one line before any work
    world = ranks.from_process(cfg.dist.device, cfg.dist.backend, os.environ)
    dims = describe(cfg, world.size, on_cuda=world.on_cuda)  # the layout, checked: dp x pp x tp
    check_world_size(cfg, world.size)
    with repro.process_settings(cfg.repro, world.device):  # nothing global outlives the call
        return _train(
            cfg, world, dims, stop=stop, started=started, dry_run=dry_run, plugins=plugins
        )


def _train(
    cfg: Config,
    world,
    dims: ParallelDims,
    *,
    stop: StopSignal,
    started: float,
    dry_run: bool,
    plugins: Plugins | None,
) -> dict:
    with (
        _flight_recorder(cfg, world),
        ranks.process_group(world, cfg.dist.timeout_s, even_alone=dims.needs_group),
        LauncherWatch().start() as launcher,  # a rank torchrun started dies with torchrun
    ):
        chosen_here = not cfg.run_dir
        if chosen_here:  # a new folder per run (or the launcher's): rank 0 decides for all
            pick = functools.partial(rundir.resolve, cfg.name, None, claim=not dry_run)
            chosen = ranks.main_decides(pick, error=ConfigError)
            cfg = dataclasses.replace(cfg, run_dir=chosen)
        with _holding(cfg.run_dir, world, launcher):  # one job per run folder
            run = build(
                cfg, world, dims, stop=stop, started=started, plugins=plugins,
                folder_chosen=chosen_here,
            )  # fmt: skip
            result = dryrun.check(run) if dry_run else _fit(run)
        if dry_run and world.is_main and chosen_here:  # no empty folder of a run that never ran
            with contextlib.suppress(OSError):
                os.removedirs(cfg.run_dir)  # relative: runs/<name>/<stamp>, no higher
        return result


def _fit(run: Run) -> dict:
    """Skip a finished run; else record, train to the end and finish (summary, final weights)."""
    previous = finished_summary(run)
    if previous is not None:
        return previous
    with tracking.tracked(run):  # rank 0: MLflow, W&B (log.mlflow, log.wandb), off this thread
        record = record_start(run)
        run.watchdog.start()
        try:
            loop.train_loop(run)
        except (RuntimeError, OSError) as e:  # a lost peer, a collective's timeout: say where
            if run.world.distributed and ranks.is_peer_failure(e):
                run.watchdog.wait_if_firing()
                run.watchdog.dump(f"a collective failed: {first_line(e)}")
            raise
        finally:
            run.watchdog.close()
            run.ckpt.close()  # a background write in flight lands, whatever ended the loop
            run.log.close()
        return finish(run, record)


@contextlib.contextmanager
def _holding(run_dir: str, world, launcher: LauncherWatch):
    """Rank 0 holds the run folder's lock for the job (trainer/runlock.py); a live job's hold
    is refused on every rank in one line (exit 2). Given up at the end, or when the launcher
    dies (then this rank ends at once)."""
    lock = RunLock(run_dir) if world.is_main else None  # rank 0 decides; main_decides on all
    held = ranks.main_decides(lambda: lock.acquire() is not None) and lock is not None
    launcher.on_gone = lock.release if held else None
    try:
        yield
    finally:
        launcher.on_gone = None
        if held:
            lock.release()


@contextlib.contextmanager
def _flight_recorder(cfg: Config, world):
    """NCCL's flight recorder on for GPU jobs (trainer/diagnostics/nccl.py), its dumps under the run
    folder, or runs/<name>/ while the folder is still to be chosen; the variables are set for
    the process group's creation and removed after it is gone."""
    if world.backend != "nccl":
        yield
        return
    added = flight_recorder_env(cfg.run_dir or os.path.join("runs", cfg.name), os.environ)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def finished_summary(run: Run) -> dict | None:
    """The summary of a run that already reached its last step (rank 0 reads it for everyone)."""
    return ranks.main_decides(_read_finished, run)


def _read_finished(run: Run) -> dict | None:
    path = os.path.join(run.run_dir, "summary.json")
    if not (run.finished and os.path.isfile(path)):
        return None
    with open(path, encoding="utf-8") as f:
        summary = json.load(f)
    run.log.info(
        f"{run.run_dir} is already complete (step {run.state.step}/{run.total_steps}); "
        "nothing to do. To train again: leave run_dir out (a new folder), or ckpt.resume=never"
    )
    return summary


def record_start(run: Run) -> dict:
    """config.yaml and run.json in run_dir (rank 0), the metrics log opened; returns the record
    of where and how the run runs (run.json without its start time)."""
    record = _run_record(run, hosts=[host for _, host in run.hosts] if run.hosts else None)
    if run.world.is_main:  # only rank 0 writes shared files
        try:
            os.makedirs(run.run_dir, exist_ok=True)
            with open(os.path.join(run.run_dir, "config.yaml"), "w", encoding="utf-8") as f:
                f.write(run.ckpt.config_yaml)
            run_json = {**record, "started": run.started, "resumes": _resumes(run)}
            metrics.write_json(os.path.join(run.run_dir, "run.json"), run_json)
        except OSError as e:
            raise io_error(
                e, f"cannot write run_dir {run.run_dir}", "point run_dir at a writable volume"
            ) from None
    resume_step = run.state.step or None
    run.log.open(run.run_dir, resume_step=resume_step, tensorboard=run.cfg.log.tensorboard)
    run.log.info(run.banner())
    if run.resumed is not None:
        restored = {"kind": "restored", "step": run.resumed.step, "path": run.resumed.path}
        run.log.record({**restored, "seconds": run.resumed.seconds}, console=False)
    if changes := _schedule_changes(run):
        change = {"kind": "resume", "step": run.state.step, "changes": changes}
        run.log.record(change, console=False)
    return record


def _resumes(run: Run) -> list[dict]:
    """run.json's history of resumes that changed the schedule (earlier ones kept)."""
    earlier = []
    try:
        with open(os.path.join(run.run_dir, "run.json"), encoding="utf-8") as f:
            earlier = json.load(f).get("resumes") or []
    except (OSError, ValueError, AttributeError):
        earlier = []
    if changes := _schedule_changes(run):
        earlier = [*earlier, {"step": run.state.step, "changes": changes}]
    return earlier


def _schedule_changes(run: Run) -> dict:
    """The schedule-shaping keys this segment's resume changed (empty: none, or no resume)."""
    return run.resumed.schedule_changes if run.resumed else {}


def _slurm_restarts(environ) -> int | None:
    """Slurm's requeue count of the job (SLURM_RESTART_COUNT: 0 for the first attempt, absent
    until Slurm requeues it there), beside torchrun's restart_count (restarts within one
    attempt); None outside a Slurm job."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    raw = environ.get("SLURM_RESTART_COUNT", "0")
    return int(raw) if raw.isascii() and raw.isdigit() else None


def _run_record(run: Run, hosts: list | None) -> dict:
    w = run.world
    return {
        "name": run.cfg.name,
        "seed": run.cfg.seed,
        "world_size": w.size,
        "hostnames": hosts,
        "device": w.device,
        "backend": w.backend,
        "strategy": run.mesh.dims.name,
        "model_build": "deferred" if run.deferred else "whole",
        "build_s": run.build_s,
        "restart_count": w.restart_count,
        "slurm_restart_count": _slurm_restarts(os.environ),
        "git": repro.git_commit() if w.is_main else None,
        "versions": metrics.versions(),
        "argv": sys.argv,
        "data": run.data.source,
        "kernels": repro.kernel_set(w.device),
        "fast_paths": run.step.fast_paths,
        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "startup": startup.report(),
    }


def finish(run: Run, record: dict) -> dict:
    """summary.json and final/model.safetensors (rank 0), and the closing console line."""
    state, results, w = run.state, run.results, run.world
    train_time = results.train_time_s  # all segments of a resumed run
    skipped = ranks.gather_objects(run.step.skipped_steps)  # fp16 overflow, per rank
    failed, digest = _write_final(run)  # every rank: the weights stream to rank 0
    memory = ranks.gather_objects(run.memory())  # after the final save: its peak counts
    summary = {
        **record,
        "steps": state.step,
        "epochs": state.epoch,
        "samples_seen": state.samples_seen,
        "train": results.train(),
        "eval": dict(results.eval),
        "train_time_s": train_time,
        **_throughput(run, train_time),
        "wall_s": time.time() - run.started,
        "checkpoint_failures": run.ckpt.failures,
        "precision": run.cfg.train.precision,
        "skipped_steps": skipped,
        "memory": memory,  # per rank
        "step_split_ms": _step_split(run),  # rank 0's, where measured (ddp)
        "ranks": run.stragglers.table(run.hosts) if run.stragglers else None,
        "peak_gpu_memory_gib": (
            torch.cuda.max_memory_allocated(w.device) / 2**30 if w.on_cuda else None
        ),
        "config": to_dict(run.cfg),
        "weights_sha256": digest,  # final/'s tensors alone (checkpoint/digest.py); rank 0's
    }
    if w.is_main:
        try:
            if failed is not None:
                raise failed
            metrics.write_json(os.path.join(run.run_dir, "summary.json"), summary)
        except OSError as e:
            raise io_error(
                e,
                f"final/ or summary.json in {run.run_dir} could not be written (the checkpoint of "
                f"step {state.step} is saved: rerunning the same command writes them)",
                "point run_dir at writable storage",
            ) from None
        run.log.info(_done_line(run, summary))
    return summary


def _write_final(run: Run) -> tuple[OSError | None, str | None]:
    """final/model.safetensors, streamed tensor by tensor from the ranks that hold the weights
    (a collective: every rank goes through all of them), and on rank 0 its tensors' digest
    (checkpoint/digest.py: the same for the same weights, whatever the file's metadata); rank
    0's write error, returned once every rank has."""
    p, main = run.parts, run.world.is_main
    tensors = namedstate.whole_tensors(p, run.mesh, main)
    error, digest = None, TensorDigest()

    def digested():
        for name, tensor in tensors:
            digest.add(name, tensor)
            yield name, tensor

    if main:
        layout = {k: (p.shapes[k], p.dtypes[k]) for k in p.shapes}
        final = os.path.join(run.run_dir, "final")
        try:
            save_streamed(final, layout, digested(), metadata={"config": run.ckpt.config_yaml})
        except OSError as e:
            error = e
    for _ in tensors:  # the rest (or all, off rank 0), so the others' sends are met
        pass
    return error, (digest.hexdigest() if main and error is None else None)


def _step_split(run: Run) -> dict | None:
    """DDP's own timing of the step, of a whole model (None where not measured)."""
    return strategy.step_split(run.parts.running) if run.parts.pipe is None else None


def _throughput(run: Run, train_time: float) -> dict:
    """Whole-run throughput: samples/s (tokens/s), data-wait share, FLOPs per sample, MFU."""
    out = loop.throughput(run, run.state.samples_seen, train_time, run.results.data_wait_s)
    out["flops_per_sample"] = run.flops_per_sample
    out["peak_flops"] = run.peak_flops
    out.setdefault("mfu", None)
    return out


def _rate(summary: dict) -> str:
    rate = f"{summary['samples_per_s']:,.0f} samples/s"
    if "tokens_per_s" in summary:
        rate += f", {summary['tokens_per_s']:,.0f} tokens/s"
    if summary.get("mfu") is not None:
        rate += f", MFU {100 * summary['mfu']:.1f}%"
    return rate


def _done_line(run: Run, summary: dict) -> str:
    ev = summary["eval"]
    if "bits_per_byte" in ev:
        quality = f", {ev['bits_per_byte']:.3f} bits/byte (perplexity {ev['perplexity']:.2f})"
    elif "mae" in ev and "mse" in ev:
        quality = f", MSE {ev['mse']:.4g}, MAE {ev['mae']:.4g}"
    elif set(ev) <= {"loss", "accuracy", "count"}:
        quality = f", accuracy {ev['accuracy']:.4f}" if "accuracy" in ev else ""
    else:  # a task of the user's: its own metrics, as it named them
        shown = [(k, v) for k, v in ev.items() if k not in ("loss", "count")][:4]
        quality = "".join(f", {k} {v:.4g}" for k, v in shown)
    loss = f"test loss {ev['loss']:.4f}" if "loss" in ev else "test"
    return (
        f"done: {summary['steps']} steps in {summary['train_time_s']:.1f} s "
        f"({_rate(summary)}) | {loss}{quality} "
        f"({ev['count']} samples)\n{metrics.memory_line(summary['memory'])}\n"
        f"run dir: {run.run_dir}  (config.yaml, metrics.jsonl, summary.json, "
        "final/model.safetensors)"
    )
