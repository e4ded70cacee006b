"""`trainer train`: config -> env -> data -> model -> resume -> wrap -> loop -> export.

One process of a job. Launch it any of these ways; all end in this same code:

    trainer train                                               # one process, CPU or one GPU
    torchrun --standalone --nproc-per-node=2 -m trainer train   # one node, 2 processes (DDP)
    torchrun --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29500 -m trainer train  # 2 nodes
    trainer-launch                                              # in a container: reads compose/k8s env
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from trainer import checkpoint, data, dist, loop, metrics, models, optim, repro, strategy
from trainer.config import Config, check_world_size, to_dict, to_yaml
from trainer.errors import UsageError
from trainer.resume import Checkpointer
from trainer.signals import StopSignal


def run(cfg: Config, *, dry_run: bool = False, stop: StopSignal | None = None) -> dict:
    """Train one rank of the job described by cfg and torchrun's environment.

    `stop` receives SIGTERM/SIGINT; without one, handlers are installed for the run itself.
    """
    if stop is None:
        with StopSignal() as own:
            return run(cfg, dry_run=dry_run, stop=own)
    started = time.time()
    denv, device, backend = dist.resolve(cfg.dist.device, cfg.dist.backend, os.environ)
    wrap_as = strategy.resolve(cfg.dist.strategy, denv)
    check_world_size(cfg, denv.world_size)
    repro.configure(cfg.repro)
    dist.init(denv, device, backend, cfg.dist.timeout_s)
    try:
        with dist.peer_failures_are_retryable(denv, cfg.dist.timeout_s):
            return _train(cfg, denv, device, backend, wrap_as, started, dry_run, stop)
    finally:
        dist.teardown()


def _train(cfg: Config, denv: dist.DistEnv, device: str, backend: str, wrap_as: str,
           started: float, dry_run: bool, stop: StopSignal) -> dict:  # fmt: skip
    say = print if denv.is_main else (lambda *_a, **_k: None)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and every world size
    spec = data.build(cfg.data, cfg.seed, device)
    model = models.build(cfg.model, spec.in_shape, spec.num_classes).to(device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = optim.build_optimizer(cfg.optim, model.parameters())
    steps_per_epoch = len(loop.epoch_plan(cfg, spec, 0))
    last_step = loop.total_steps(cfg, steps_per_epoch)
    scheduler = optim.build_scheduler(cfg.sched, optimizer, steps_per_epoch, last_step)
    scaler = loop.make_scaler(cfg.train, device)
    ckpt = Checkpointer(cfg, denv, device, model, optimizer, scheduler, scaler, info=say)
    state, results = ckpt.restore()
    model = strategy.wrap(model, wrap_as, denv, device, sync_bn=cfg.model.sync_bn)
    if cfg.train.compile:
        model = torch.compile(model)  # after DDP: compiled graphs break at its bucket boundaries
    step = loop.TrainStep(
        cfg.train, model, optimizer, scheduler, scaler, spec.task, denv.world_size, device
    )
    hosts = dist.gather_objects(repro.hostname())
    banner = (
        f"{cfg.name}: {cfg.data.name} ({len(spec.train)} train / {len(spec.test)} test) | "
        f"model {cfg.model.name} | world {denv.world_size} x {device} ({backend}, {wrap_as}) | "
        f"global batch {cfg.data.global_batch_size}, {steps_per_epoch} steps/epoch"
    )
    if dry_run:
        from trainer.preflight import dry_run as preflight

        say(banner)
        return preflight(cfg, denv, device, spec, step, ckpt, state, say)

    run_dir = os.path.abspath(cfg.run_dir)
    summary_path = os.path.join(run_dir, "summary.json")
    if state.step >= last_step and os.path.isfile(summary_path):
        say(
            f"{run_dir} is already complete (step {state.step}/{last_step}); nothing to do. "
            "To train again: ckpt.resume=never, or a new run_dir"
        )
        with open(summary_path, encoding="utf-8") as f:
            return json.load(f)
    record = {
        "name": cfg.name,
        "seed": cfg.seed,
        "world_size": denv.world_size,
        "hostnames": hosts,
        "device": device,
        "backend": backend,
        "strategy": wrap_as,
        "restart_count": denv.restart_count,
        "git": repro.git_commit() if denv.is_main else None,
        "versions": metrics.versions(),
        "argv": sys.argv,
    }
    if denv.is_main:  # only rank 0 writes shared files
        try:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
                f.write(to_yaml(cfg))
            metrics.write_json(os.path.join(run_dir, "run.json"), {**record, "started": started})
        except OSError as e:
            raise UsageError(
                f"cannot write run_dir {run_dir} ({e.strerror}): free space or point run_dir at a "
                "writable volume"
            ) from None
    logger = metrics.RunLogger(
        run_dir if denv.is_main else None,
        progress=cfg.log.progress,
        total_steps=last_step,
        resume_step=state.step if state.step else None,
        tensorboard=cfg.log.tensorboard,
    )
    logger.info(banner)
    try:
        results = loop.fit(cfg, denv, device, spec, step, state, logger, ckpt, stop, results)
    finally:
        logger.close()

    train_time = results["train_time_s"]  # all segments of a resumed run
    summary = {
        **record,
        "steps": state.step,
        "epochs": state.epoch,
        "samples_seen": state.samples_seen,
        "train": results.get("train", {}),
        "eval": {k: v for k, v in results["eval"].items() if k != "step"},
        "train_time_s": train_time,
        "samples_per_s": state.samples_seen / train_time if train_time else 0.0,
        "wall_s": time.time() - started,
        "checkpoint_failures": ckpt.failures,
        "precision": cfg.train.precision,
        "skipped_steps": dist.gather_objects(step.skipped_steps),  # fp16 overflow, per rank
        "peak_gpu_memory_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else None
        ),
        "config": to_dict(cfg),
    }
    if denv.is_main:
        checkpoint.save_weights(
            model, os.path.join(run_dir, "final"), metadata={"config": to_yaml(cfg)}
        )
        metrics.write_json(os.path.join(run_dir, "summary.json"), summary)
        ev = summary["eval"]
        acc = f", accuracy {ev['accuracy']:.4f}" if "accuracy" in ev else ""
        if "mae" in ev:
            acc = f", MSE {ev['mse']:.4g}, MAE {ev['mae']:.4g}"
        say(
            f"done: {state.step} steps in {train_time:.1f} s "
            f"({summary['samples_per_s']:,.0f} samples/s) | test loss {ev['loss']:.4f}{acc} "
            f"({ev['count']} samples)\n"
            f"run dir: {run_dir}  (config.yaml, metrics.jsonl, summary.json, final/model.safetensors)",
            flush=True,
        )
    return summary
