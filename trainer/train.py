"""`trainer train`: config -> env -> data -> model -> wrap -> loop -> export.

One process of a job. Launch it any of these ways; all end in this same code:

    trainer train                                               # one process, CPU or one GPU
    torchrun --standalone --nproc-per-node=2 -m trainer train   # one node, 2 processes (DDP)
    torchrun --nnodes=2 --node-rank=0 --rdzv-endpoint=HOST:29500 -m trainer train  # 2 nodes
    trainer-launch                                              # in a container: reads compose/k8s env
"""

from __future__ import annotations

import os
import socket
import time

import torch

from trainer import checkpoint, data, dist, loop, metrics, models, optim, strategy
from trainer.config import Config, to_dict, to_yaml
from trainer.errors import UsageError


def check_batch(cfg: Config, denv: dist.DistEnv) -> None:
    b, w = cfg.data.global_batch_size, denv.world_size
    if b % w:
        lo, hi = (b // w) * w, (b // w + 1) * w
        suggestion = f"{lo} or {hi}" if lo else f"{hi}"
        raise UsageError(
            f"data.global_batch_size={b} does not split over {w} ranks: "
            f"use a multiple of {w} (e.g. data.global_batch_size={suggestion})"
        )


def run(cfg: Config) -> dict:
    """Train one rank of the job described by cfg and torchrun's environment."""
    started = time.time()
    denv = dist.from_env(os.environ)
    device, backend = dist.choose_device(
        denv,
        cfg.dist.device,
        cfg.dist.backend,
        torch.cuda.device_count() if cfg.dist.device != "cpu" else 0,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    wrap_as = strategy.resolve(cfg.dist.strategy, denv)
    check_batch(cfg, denv)
    dist.init(denv, device, backend, cfg.dist.timeout_s)
    try:
        with dist.peer_failures_are_retryable(denv, cfg.dist.timeout_s):
            return _train(cfg, denv, device, backend, wrap_as, started)
    finally:
        dist.teardown()


def _train(
    cfg: Config, denv: dist.DistEnv, device: str, backend: str, wrap_as: str, started: float
) -> dict:
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and every world size
    spec = data.build(cfg.data, cfg.seed, device)
    model = models.build(cfg.model, spec.in_shape, spec.num_classes).to(device)
    model = strategy.wrap(model, wrap_as, denv, device, sync_bn=cfg.model.sync_bn)
    optimizer = optim.build_optimizer(cfg.optim, model.parameters())
    steps_per_epoch = len(loop.epoch_plan(cfg, spec, 0))
    last_step = loop.total_steps(cfg, steps_per_epoch)
    scheduler = optim.build_scheduler(cfg.sched, optimizer, steps_per_epoch, last_step)

    run_dir = os.path.abspath(cfg.run_dir)
    if denv.is_main:  # only rank 0 writes shared files
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(to_yaml(cfg))
    logger = metrics.RunLogger(
        run_dir if denv.is_main else None, progress=cfg.log.progress, total_steps=last_step
    )
    logger.info(
        f"{cfg.name}: {cfg.data.name} ({len(spec.train)} train / {len(spec.test)} test) | "
        f"model {cfg.model.name} | world {denv.world_size} x {device} ({backend}, {wrap_as}) | "
        f"global batch {cfg.data.global_batch_size}, {steps_per_epoch} steps/epoch"
    )
    state = loop.LoopState()
    try:
        results = loop.fit(cfg, denv, device, spec, model, optimizer, scheduler, state, logger)
    finally:
        logger.close()

    summary = {
        "name": cfg.name,
        "world_size": denv.world_size,
        "device": device,
        "backend": backend,
        "strategy": wrap_as,
        "seed": cfg.seed,
        "steps": state.step,
        "epochs": state.epoch,
        "samples_seen": state.samples_seen,
        "train": results["train"],
        "eval": {k: v for k, v in results["eval"].items() if k != "step"},
        "train_time_s": results["train_time_s"],
        "samples_per_s": state.samples_seen / results["train_time_s"]
        if results["train_time_s"]
        else 0.0,
        "wall_s": time.time() - started,
        "hostname": socket.gethostname(),
        "versions": metrics.versions(),
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
        print(
            f"done: {state.step} steps in {summary['train_time_s']:.1f} s "
            f"({summary['samples_per_s']:,.0f} samples/s) | test loss {ev['loss']:.4f}{acc} "
            f"({ev['count']} samples)\n"
            f"run dir: {run_dir}  (config.yaml, metrics.jsonl, summary.json, final/model.safetensors)",
            flush=True,
        )
    return summary
