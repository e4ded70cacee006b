"""The hand-written loop the trainer is measured against: one process, or DDP under torchrun.

    python bench/bare.py STEPS EVERY [--config NAME] OVERRIDE...          # world 1
    torchrun --standalone --nproc-per-node=2 bench/bare.py STEPS EVERY ...   # DDP (gloo on CPU)

The textbook way, on the trainer's own model, optimizer and data (built from the same config
overrides): the whole training split as one normalised tensor on the device, one shared random
permutation, and each step a plain slice of it: the global batch at world 1, rank r's contiguous
share of it under DDP (torch.distributed + DistributedDataParallel, same global batch). No
sampler, logging, checkpoints or stop checks.

Each step sets the lr of the config's schedule on the optimizer by hand before the step, as
nanoGPT's get_lr does. A language model (data.name=text) is trained the way nanoGPT's train.py does
it: each step each rank draws its share of the global batch as random windows of the token stream
(get_batch), the mean cross-entropy over every position and gradient clipping
(train.clip_grad_norm).

`build(cfg, steps)` is the loop without its clock: bench/interleaved.py runs it between the
trainer's own windows, in the trainer's process.

It times windows of EVERY steps like the trainer's log records (the device synchronised at each
window's edges) and prints one JSON line on rank 0: the windows' global samples/s (sequences
for a language model), and the wall clock (time.time()) when the first step finished, for the
launch-to-first-step startup row.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _schedule(cfg, schedule_cls, total: int):
    """The config's lr multiplier as a function of the step (the trainer's own schedule)."""
    return schedule_cls(
        name=cfg.sched.name,
        total_steps=total,
        steps_per_epoch=total,
        warmup_steps=cfg.sched.warmup_steps,
        step_size_epochs=cfg.sched.step_size_epochs,
        gamma=cfg.sched.gamma,
        min_lr_ratio=cfg.sched.min_lr_ratio,
        pct_start=cfg.sched.pct_start,
    )


class Loop:
    """The hand-written loop, built: `step(i)` runs optimizer step i, `sync()` waits for the
    device, `samples` is the global batch a step trains on."""

    def __init__(self, step, sync, samples: int, peak=None) -> None:
        self.step, self.sync, self.samples, self.peak = step, sync, samples, peak


def build(cfg, steps: int) -> Loop:
    """The loop for `cfg` over `steps` steps, in this process: under torchrun its DDP model joins
    the default process group, which must be up. The model's init and the data's permutation are
    drawn from cfg.seed; the caller's global RNG state is left as it was."""
    import torch

    with torch.random.fork_rng():
        return _build(cfg, steps)


def _build(cfg, steps: int) -> Loop:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer import data, models, optim
    from trainer.optim import Schedule

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cuda = cfg.dist.device != "cpu" and torch.cuda.is_available()
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    torch.manual_seed(cfg.seed)  # same model init and permutation on every rank
    spec = data.build(cfg.data, cfg.seed, "cpu")
    ds = spec.train
    lm = spec.task == "lm"
    if lm:
        tokens, seq = ds.tokens.to(device), cfg.data.text.seq_len
        x = y = None
    else:
        x = data.pixels_to_float(ds.x, ds.mean, ds.std).to(device)
        y = ds.y.to(device)
    model = models.build(cfg.model, spec.in_shape, spec.num_classes, spec.task).to(device)
    if cfg.train.channels_last and not lm:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = optim.build_optimizer(cfg.optim, model.parameters())
    net = torch.compile(model) if cfg.train.compile else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    batch = cfg.data.global_batch_size
    share = batch // world
    sched, base_lr, clip = _schedule(cfg, Schedule, steps), cfg.optim.lr, cfg.train.clip_grad_norm
    autocast = torch.device(device).type

    def set_lr(i: int) -> None:
        for group in opt.param_groups:
            group["lr"] = base_lr * sched(i)

    if lm:
        gen = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + rank)
        offsets = torch.arange(seq, device=device)

        def get_batch() -> tuple:
            ix = torch.randint(len(tokens) - seq - 1, (share,), device=device, generator=gen)
            window = tokens[ix[:, None] + offsets]
            target = tokens[ix[:, None] + offsets + 1]
            return window.long(), target.long()

        def step(i: int) -> None:
            set_lr(i)
            inputs, targets = get_batch()
            with torch.autocast(autocast, dtype=dtype, enabled=dtype is not None):
                logits = net(inputs)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        perm = torch.randperm(len(x), device=device)

        def step(i: int) -> None:
            set_lr(i)
            n = len(x)
            start = (i * batch) % (n - batch)
            idx = perm[start + rank * share : start + (rank + 1) * share]
            with torch.autocast(autocast, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if cuda else None
    return Loop(step, sync, share * world, peak)


def main(argv: list[str]) -> int:
    steps, every, overrides = int(argv[0]), int(argv[1]), argv[2:]

    import torch
    import torch.distributed as dist

    from trainer import config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    name = None
    if overrides[:1] == ["--config"]:
        name, overrides = overrides[1], overrides[2:]
    cfg = config.load(name, overrides)
    cuda = cfg.dist.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    loop = build(cfg, steps)
    windows: list[float] = []
    first_step_time = None
    loop.sync()
    t = time.perf_counter()
    for i in range(steps):
        loop.step(i)
        if i == 0:
            loop.sync()
            first_step_time = time.time()
        if (i + 1) % every == 0:
            loop.sync()
            now = time.perf_counter()
            windows.append(every * loop.samples / (now - t))
            t = now
    out = {
        "windows": windows,
        "first_step_time": first_step_time,
        "threads": torch.get_num_threads(),
        "world_size": world,
    }
    if loop.peak is not None:
        out["peak_gpu_memory_gib"] = loop.peak()
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
