"""The rules that tie the config to the world it runs on: the strategy dist.strategy names on
N ranks, and how the global batch splits. No torch here, so `trainer config check` applies them
before any process starts."""

from __future__ import annotations

from trainer.config.schema import Config
from trainer.errors import ConfigError, UsageError


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

    The rules of trainer.strategy.choose, kept here (no torch) so `trainer config check` applies
    them too. Mistakes are the same on every rank, so they are ConfigErrors: rank 0 reports them.
    """
    name = cfg.dist.strategy
    if name == "auto":
        name = "ddp" if world_size > 1 else "none"
    if cfg.repro.world_invariant:
        _check_world_invariant(cfg, name, on_cuda)
    if name == "none" and world_size > 1:
        raise ConfigError(
            f"dist.strategy=none cannot run on {world_size} ranks (each would train alone): "
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
    b, w = cfg.data.global_batch_size, world_size
    k = cfg.repro.shards
    if cfg.repro.world_invariant and k % w:
        fits = ", ".join(str(2**i) for i in range(k.bit_length()) if 2**i <= k)
        raise ConfigError(
            f"repro.world_invariant=true cuts each global batch into repro.shards={k} shards, "
            f"which {w} ranks cannot split evenly: run on {fits} ranks, or set repro.shards to a "
            f"power of two that {w} divides"
        )
    if b % w:
        lo, hi = (b // w) * w, (b // w + 1) * w
        suggestion = f"{lo} or {hi}" if lo else f"{hi}"
        raise ConfigError(
            f"data.global_batch_size={b} does not split over {w} ranks: "
            f"use a multiple of {w} (e.g. data.global_batch_size={suggestion})"
        )
