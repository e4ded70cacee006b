"""The rules that tie the config to the world it runs on: the strategy dist.strategy names on
N ranks, and how the global batch splits. No torch here, so `trainer config check` applies them
before any process starts."""

from __future__ import annotations

import math

from trainer.config.schema import Config
from trainer.errors import ConfigError, UsageError
from trainer.parallel.layout import Layout, parse


def layout(cfg: Config, world_size: int) -> Layout:
    """The mesh dist.mesh asks for on `world_size` ranks (its product checked against them)."""
    return parse(cfg.dist.mesh, world_size)


def _check_model_parallel(cfg: Config, name: str, lay: Layout) -> None:
    """What cannot compose with a split model (pp or tp), one line each."""
    mesh = f"dist.mesh={cfg.dist.mesh}"
    if name == "dp":
        raise ConfigError(
            f"{mesh} splits the model over processes, but dist.strategy=dp is single-process "
            "nn.DataParallel: use dist.strategy=ddp or fsdp for the data-parallel dimension"
        )
    if cfg.optim.lora_targets and lay.pp > 1:
        raise ConfigError(
            f"{mesh}: LoRA (optim.lora_targets) is not supported under pipeline parallelism "
            "(it freezes the tied embedding the stages exchange, and its narrowed checkpoints "
            "are not split by stage): run it on one process or data-parallel (ddp or fsdp), or "
            "leave optim.lora_targets empty"
        )
    if cfg.repro.world_invariant and lay.tp > 1:
        raise ConfigError(
            f"repro.world_invariant=true gives the same bits on any world size, which {mesh} "
            "cannot: a tensor-parallel layer adds its ranks' partial sums in another order than "
            "one process (docs/training.md): drop tp, or set repro.world_invariant=false"
        )
    if cfg.repro.world_invariant and cfg.model.dropout:
        raise ConfigError(
            f"repro.world_invariant=true with {mesh}: each pipeline stage draws its own dropout "
            f"masks, not one process's: set model.dropout=0 (or repro.world_invariant=false)"
        )
    if lay.tp > 1 and name == "ddp" and lay.dp > 1:
        raise ConfigError(
            f"{mesh}: DDP cannot all-reduce tensor-parallel (DTensor) parameters: set "
            "dist.strategy=fsdp for the data-parallel dimension (FSDP2 composes with tp)"
        )
    if cfg.train.compile and lay.tp > 1:
        raise ConfigError(
            f"train.compile=true is not supported with {mesh} yet (tensor-parallel layers are not "
            "compiled here): set train.compile=false"
        )
    if cfg.train.compile and cfg.repro.world_invariant:
        raise ConfigError(
            f"repro.world_invariant=true with train.compile=true and {mesh}: each stage is compiled "
            "on its own, which fuses kernels unlike one compiled model, so the bits would differ "
            "from world 1's: set train.compile=false"
        )
    if cfg.model.sync_bn:
        raise ConfigError(f"model.sync_bn=true does not compose with {mesh}: set it to false")
    if lay.tp > 1:
        _check_tensor_parallel(cfg, lay)


def _check_tensor_parallel(cfg: Config, lay: Layout) -> None:
    """What tp needs: whole heads on each tp rank, replicated activations that stay the same on
    every tp rank (no dropout: each rank draws its own masks)."""
    mesh = f"dist.mesh={cfg.dist.mesh}"
    if cfg.optim.lora_targets:
        raise ConfigError(
            f"{mesh}: optim.lora_targets wraps Linear layers in adapters, which the "
            "tensor-parallel plan cannot split yet: leave optim.lora_targets empty, or drop tp"
        )
    if cfg.model.dropout:
        raise ConfigError(
            f"{mesh}: model.dropout={cfg.model.dropout} would draw different masks on the tp "
            "ranks, whose activations between layers must stay the same: set model.dropout=0"
        )
    if cfg.model.name != "gpt":
        return
    heads = cfg.model.gpt.heads
    if heads % lay.tp:
        fits = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise ConfigError(
            f"{mesh}: tp={lay.tp} does not divide model.gpt.heads={heads} (each tp rank holds "
            f"whole heads, and width / tp of the width): use tp in {fits}, or model.gpt.heads "
            f"a multiple of {lay.tp}"
        )


def _check_micro_batches(cfg: Config, lay: Layout) -> None:
    """Under pp the rank's slice splits into equal micro-batches, at least one per stage."""
    if lay.pp < 2:
        return
    local = cfg.data.global_batch_size // lay.dp
    stages = lay.pp * (2 if cfg.dist.pp_schedule == "interleaved-1f1b" else 1)
    micro = cfg.train.micro_batch_size or max(1, local // stages)
    if cfg.repro.world_invariant:
        micro = _shard_micro_batch(cfg, lay)
    over = f" on each of {lay.dp} dp ranks" if lay.dp > 1 else ""
    where = f"dist.mesh={cfg.dist.mesh} ({stages} pipeline stages{over})"
    if local % micro:
        raise ConfigError(
            f"{where}: each data-parallel rank's {local} samples do not split into equal "
            f"micro-batches of {micro}: set train.micro_batch_size to a divisor of {local}"
        )
    if local // micro < stages:
        raise ConfigError(
            f"{where}: {local // micro} micro-batch(es) per step leave(s) stages idle; a pipeline "
            f"needs at least one per stage: set train.micro_batch_size <= {local // stages} or "
            f"raise data.global_batch_size to at least {stages * micro * lay.dp}"
        )


def _shard_micro_batch(cfg: Config, lay: Layout) -> int:
    """Under repro.world_invariant a pipeline's micro-batch is one shard: B / repro.shards."""
    b, k = cfg.data.global_batch_size, cfg.repro.shards
    where = f"repro.world_invariant=true with dist.mesh={cfg.dist.mesh}"
    if b % k:
        raise ConfigError(
            f"{where} runs each of the repro.shards={k} shards as one pipeline micro-batch, which "
            f"must be equal: set data.global_batch_size to a multiple of {k}"
        )
    if cfg.train.micro_batch_size not in (None, b // k):
        raise ConfigError(
            f"{where}: the pipeline's micro-batch is one shard ({b // k} samples), not "
            f"train.micro_batch_size={cfg.train.micro_batch_size}: leave it unset (null)"
        )
    stages = lay.pp * (2 if cfg.dist.pp_schedule == "interleaved-1f1b" else 1)
    if k // lay.dp < stages:
        multiple = f", a multiple of {lay.dp}" if lay.dp > 1 else ""
        raise ConfigError(
            f"{where}: each data-parallel replica runs its {k // lay.dp} shard(s) as micro-batches, "
            f"fewer than its {stages} pipeline stages: set repro.shards to {stages * lay.dp} or more"
            f"{multiple}"
        )
    return b // k


def _check_world_invariant(cfg: Config, name: str, on_cuda: bool | None) -> None:
    if name in ("fsdp", "dp"):
        why = {
            "fsdp": "FSDP reduce-scatters gradients in an order that depends on the world size",
            "dp": "nn.DataParallel sums gradients over however many GPUs it finds",
        }[name]
        raise ConfigError(
            f"repro.world_invariant=true works with dist.strategy=ddp or none, not {name}: {why}; "
            "set dist.strategy=ddp (or repro.world_invariant=false)"
        )
    if cfg.model.sync_bn:
        raise ConfigError(
            "repro.world_invariant=true normalises BatchNorm per shard, the same on any world "
            "size; model.sync_bn=true would normalise over each rank's shards: set "
            "model.sync_bn=false"
        )
    cuda = on_cuda if on_cuda is not None else cfg.dist.device == "cuda"
    if cuda and not cfg.repro.deterministic:
        raise ConfigError(
            "repro.world_invariant=true on CUDA needs deterministic kernels (atomics make some "
            "backward passes vary run to run): add repro.deterministic=true"
        )


def resolve_strategy(cfg: Config, world_size: int, *, on_cuda: bool | None = None) -> str:
    """The strategy dist.strategy names on `world_size` ranks (auto: ddp on several ranks), or a
    ConfigError for a combination that cannot run. on_cuda None: not known yet (config check).

    The rules trainer.parallel.dims.describe applies to a run, kept here (no torch) so `trainer
    config check` applies them too. Mistakes are the same on every rank, so they are ConfigErrors: rank 0 reports them.
    """
    lay = layout(cfg, world_size)
    name = cfg.dist.strategy
    if name == "auto":  # tp's DTensor parameters need fsdp for the dp dimension
        name = ("fsdp" if lay.tp > 1 else "ddp") if lay.dp > 1 else "none"
    if lay.model_parallel:
        _check_model_parallel(cfg, name, lay)
    if cfg.repro.world_invariant:
        _check_world_invariant(cfg, name, on_cuda)
    if name == "none" and lay.dp > 1:
        raise ConfigError(
            f"dist.strategy=none cannot run on {lay.dp} ranks (each would train alone): "
            "use dist.strategy=ddp or auto, or launch one process"
        )
    if name == "dp" and world_size > 1:
        raise ConfigError(
            f"dist.strategy=dp is single-process nn.DataParallel, but {world_size} processes were "
            "launched: use dist.strategy=ddp under torchrun (one process per GPU), or launch one"
        )
    if name == "fsdp":
        if cfg.model.sync_bn:
            raise ConfigError(
                "model.sync_bn=true works with dist.strategy=ddp; under fsdp each rank normalises "
                "with its own slice's statistics: set model.sync_bn=false"
            )
        if cfg.fsdp.cpu_offload and (on_cuda is False or cfg.dist.device == "cpu"):
            raise ConfigError(
                "fsdp.cpu_offload=true moves shards off the GPU, but this run computes on the CPU: "
                "set fsdp.cpu_offload=false (or dist.device=cuda)"
            )
    return name


def check_world_size(cfg: Config, world_size: int) -> None:
    """The global batch must split evenly over the ranks (each takes an equal slice); under
    repro.world_invariant the ranks must split the shards evenly too."""
    if world_size < 1:
        raise UsageError(f"--world-size: must be >= 1 (the ranks in the job), got {world_size}")
    lay = layout(cfg, world_size)
    b, w = cfg.data.global_batch_size, lay.dp
    k = cfg.repro.shards
    if cfg.repro.world_invariant and k % w:
        fits = ", ".join(str(d) for d in range(1, k + 1) if k % d == 0)
        raise ConfigError(
            f"repro.world_invariant=true cuts each global batch into repro.shards={k} shards, "
            f"which {w} ranks cannot split evenly: run on {fits} ranks, or set repro.shards to a "
            f"multiple of {w} (e.g. repro.shards={math.lcm(k, w)}, which {k} divides too)"
        )
    if b % w:
        lo, hi = (b // w) * w, (b // w + 1) * w
        suggestion = f"{lo} or {hi}" if lo else f"{hi}"
        raise ConfigError(
            f"data.global_batch_size={b} does not split over {w} ranks: "
            f"use a multiple of {w} (e.g. data.global_batch_size={suggestion})"
        )
    _check_micro_batches(cfg, lay)
