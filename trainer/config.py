"""The typed config schema and its merge: schema defaults < preset < --config file < CLI key=value.

Every field has a default and a docstring; `__post_init__` checks values and says what to set.
`load()` turns every mistake (unknown key, wrong type, bad choice) into a one-line UsageError.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from trainer.errors import ConfigError, UsageError, check_choice, did_you_mean, first_line

DEFAULT_PRESET = "digits-mlp"


MAX_SEED = 2**63 - 1
"""Seeds go to torch.manual_seed and numpy's SeedSequence: non-negative 64-bit integers."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field (or each item of a numeric list) accepts; NaN never is."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            return False  # no range here includes NaN or an infinity
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.lo == 1 and isinstance(self.lo, int):
            low = "> 0"  # a count
        else:
            low = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        return f"{low} and {'<' if self.hi_open else '<='} {_num(self.hi)}"


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 2**16:
        if x & (x - 1) == 0:
            return f"2**{x.bit_length() - 1}"
        if x & (x + 1) == 0:
            return f"2**{x.bit_length()}-1"
        return str(x) if x < 10**9 else f"{x:.0e}"
    return f"{x:g}" if isinstance(x, float) else str(x)


_STEPS = 10**12
_BATCH = 2**24
RANGES: dict[str, Range] = {
    # The one table of numeric ranges: every int/float field of the schema (and of its lists)
    # has an entry, checked in __post_init__ by _check_ranges; tests/test_bad_input.py walks it.
    "seed": Range(0, MAX_SEED),
    "data.synthetic.shape": Range(1, 2**16),
    "data.synthetic.num_classes": Range(2, 10**6),
    "data.synthetic.size": Range(1, 10**9),
    "data.synthetic.test_size": Range(1, 10**9),
    "data.text.seq_len": Range(1, 2**20),
    "data.text.max_train_bytes": Range(1, 2**50),
    "data.text.max_test_bytes": Range(1, 2**50),
    "data.global_batch_size": Range(1, _BATCH),
    "data.eval_batch_size": Range(1, _BATCH),
    "data.test_fraction": Range(0.0, 1.0, lo_open=True, hi_open=True),
    "data.split_seed": Range(0, MAX_SEED),
    "data.crop_padding": Range(0, 1024),
    "data.image_size": Range(1, 8192),
    "data.num_workers": Range(0, 1024),
    "model.gpt.layers": Range(1, 1024),
    "model.gpt.width": Range(1, 2**16),
    "model.gpt.heads": Range(1, 1024),
    "model.hidden": Range(1, 2**20),
    "model.dropout": Range(0.0, 1.0, hi_open=True),
    "model.num_classes": Range(1, 10**7),
    "model.in_channels": Range(1, 2**16),
    "optim.lr": Range(0.0, 10.0, lo_open=True),
    "optim.weight_decay": Range(0.0, 10.0),
    "optim.momentum": Range(0.0, 1.0, hi_open=True),
    "optim.betas": Range(0.0, 1.0, hi_open=True),
    "sched.warmup_steps": Range(0, _STEPS),
    "sched.step_size_epochs": Range(1, 10**6),
    "sched.gamma": Range(0.0, 1.0, lo_open=True),
    "sched.min_lr_ratio": Range(0.0, 1.0),
    "sched.pct_start": Range(0.0, 1.0, lo_open=True, hi_open=True),
    "train.epochs": Range(1, 10**6),
    "train.max_steps": Range(1, _STEPS),
    "train.eval_every_steps": Range(0, _STEPS),
    "train.eval_every_epochs": Range(1, 10**6),
    "train.fp16_init_scale": Range(1.0, 1e38),  # below float32's max
    "train.micro_batch_size": Range(1, _BATCH),
    "train.clip_grad_norm": Range(0.0, 1e6, lo_open=True),
    "dist.timeout_s": Range(1, 7 * 24 * 3600),
    "log.every_steps": Range(1, _STEPS),
    "ckpt.every_steps": Range(0, _STEPS),
    "ckpt.every_epochs": Range(0, 10**6),
    "ckpt.keep_last": Range(1, 10**6),
    "repro.shards": Range(1, 2**16),
}

NONEMPTY = frozenset(
    {"name", "run_dir", "data.name", "data.root", "data.text.path", "model.name", "ckpt.dir"}
    | {"ckpt.resume", "ckpt.init_weights"}
)
"""String fields that must not be empty (null, where allowed, is the way to say "none")."""


def _example(key: str) -> str:
    """`key=<its default>`: a value the schema accepts, to show in an error."""
    node: Any = Config()
    for part in key.split("."):
        node = getattr(node, part, None)
    if isinstance(node, list):
        node = "[" + ",".join(map(str, node)) + "]"
    if isinstance(node, bool):
        node = str(node).lower()
    return f"{key}={'null' if node is None else node}"


def range_hint(key: str) -> str:
    """' (needs a number >= lo and <= hi, e.g. key=default)' for a key of RANGES, else ''."""
    key = re.sub(r"\[\d+\]$", "", key)
    if key not in RANGES:
        return ""
    items = (
        " for each item" if key in ("data.synthetic.shape", "model.hidden", "optim.betas") else ""
    )
    return f" (needs a number {RANGES[key]}{items}, e.g. {_example(key)})"


def _check_ranges(obj: Any, prefix: str) -> None:
    """Check the direct numeric and string fields of one schema dataclass against the tables."""
    import dataclasses

    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if isinstance(value, str) and key in NONEMPTY and not value.strip():
            raise UsageError(f"{key}: must not be empty; e.g. {_example(key)}")
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or key not in RANGES:
                continue
            if v not in RANGES[key]:
                each = " for each item" if isinstance(value, list) else ""
                shown = repr(value) if isinstance(value, list) else str(v)
                raise UsageError(
                    f"{key}: must be {RANGES[key]}{each}, got {shown}; e.g. {_example(key)}"
                )


@dataclass(kw_only=True)
class SyntheticConfig:
    """data.name=synthetic: random class prototypes plus noise, generated from data.split_seed."""

    shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    """One sample's shape, e.g. [3,32,32] (an image) or [20] (a feature vector)."""
    num_classes: int = 10
    size: int = 1024
    """Training samples."""
    test_size: int = 256
    """Test samples."""

    def __post_init__(self) -> None:
        if not self.shape:
            raise UsageError("data.synthetic.shape: needs positive sizes like [3,32,32], got []")
        _check_ranges(self, "data.synthetic.")


@dataclass(kw_only=True)
class TextConfig:
    """data.name=text: byte-level tokens (a vocabulary of 256) for the language-model task."""

    path: str | None = None
    """A text file, or a folder of them (every file under it, sorted). null: the running
    Python's own standard-library .py sources (about 14 MB, nothing to download)."""
    seq_len: int = 256
    """Tokens (bytes) the model reads per sample; each sample predicts the next byte at every
    position."""
    max_train_bytes: int | None = None
    """Use only the first N bytes of the training split (null: all of it)."""
    max_test_bytes: int | None = None
    """Use only the first N bytes of the test split: evaluation reads all of it every time."""

    def __post_init__(self) -> None:
        _check_ranges(self, "data.text.")


@dataclass(kw_only=True)
class DataConfig:
    name: str = "digits"
    """Dataset: digits | diabetes | mnist | fashion_mnist | cifar10 | imagefolder | synthetic |
    text, or `package.module:factory`."""
    root: str = "data"
    """Folder holding on-disk datasets (mnist, fashion_mnist, cifar10, imagefolder); the error
    for a missing folder names the files to put there."""
    download: bool = False
    """Let torchvision download mnist/fashion_mnist/cifar10 into data.root if absent (needs the
    network and a writable root; rank 0 downloads while the other ranks wait)."""
    verify_checksums: bool = True
    """cifar10: check each file against torchvision's published md5. Off: any well-formed copy."""
    global_batch_size: int = 64
    """Samples per optimizer step summed over ALL ranks; each rank takes an equal slice."""
    eval_batch_size: int = 512
    """Samples per evaluation batch, summed over all ranks."""
    shuffle: bool = True
    """Shuffle training order each epoch (a permutation from seed and epoch)."""
    drop_last: bool = False
    """Drop a final partial global batch. Off: the short tail batch is trained, on any world size."""
    test_fraction: float = 0.2
    """Held-out share for datasets without an official test split (sklearn)."""
    split_seed: int = 0
    """Seed of that train/test split (and of the synthetic data): fixed apart from `seed` so the
    test set never changes."""
    normalize: bool = True
    """Image datasets: subtract the dataset's per-channel mean and divide by its std (off: pixels
    in [0, 1], as d2l's ToTensor-only pipeline)."""
    augment: bool = False
    """Train-time random crop (zero padding data.crop_padding) and horizontal flip, CIFAR-style.
    Each sample's draw depends only on (seed, epoch, sample index): not on ranks or workers."""
    crop_padding: int = 4
    """Pixels of zero padding for the random crop (0: flips only)."""
    image_size: int = 32
    """imagefolder: each image is resized (shorter side) and centre-cropped to this square."""
    num_workers: int = 0
    """DataLoader worker processes per rank (decoding and augmentation); 0: in the main process."""
    pin_memory: bool = True
    """Page-locked host batches for faster, asynchronous copies to a GPU (ignored on CPU)."""
    persistent_workers: bool = False
    """Keep the workers alive between epochs (needs data.num_workers > 0)."""
    device_resident: bool = False
    """Move the whole in-memory dataset to the device once; batches are gathered and augmented
    there, with no per-step host-to-device copy. A no-op move on CPU."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    text: TextConfig = field(default_factory=TextConfig)

    def __post_init__(self) -> None:
        _check_ranges(self, "data.")
        if self.persistent_workers and self.num_workers == 0:
            raise UsageError(
                "data.persistent_workers=true needs worker processes: set data.num_workers >= 1 "
                "or data.persistent_workers=false"
            )
        if self.device_resident and self.num_workers:
            raise UsageError(
                "data.device_resident=true gathers batches on the device, without loader workers: "
                "set data.num_workers=0 (or data.device_resident=false)"
            )


@dataclass(kw_only=True)
class GPTConfig:
    """model.name=gpt: a decoder-only transformer (vocabulary and sequence length: the data's)."""

    layers: int = 4
    width: int = 128
    """Embedding width; a multiple of heads."""
    heads: int = 4

    def __post_init__(self) -> None:
        _check_ranges(self, "model.gpt.")
        if self.width % self.heads:
            raise UsageError(
                f"model.gpt.width={self.width} does not split over model.gpt.heads={self.heads}: "
                "use a width that is a multiple of heads"
            )


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "mlp"
    """Model: mlp | lenet | resnet18 | vgg11 | gpt, or `package.module:factory`."""
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    """Hidden layer widths (mlp)."""
    dropout: float = 0.0
    """Dropout probability (mlp, vgg11's classifier). Non-zero dropout draws per-rank randomness."""
    activation: str = "relu"
    """relu | sigmoid (lenet: d2l uses sigmoid)."""
    num_classes: int | None = None
    """Output size; default: taken from the dataset."""
    in_channels: int | None = None
    """Input channels; default: taken from the dataset."""
    sync_bn: bool = False
    """Under DDP, replace BatchNorm by SyncBatchNorm (batch statistics over the global batch, so
    BN models match a single process). torch supports it on CUDA only. World 1: no change."""
    gpt: GPTConfig = field(default_factory=GPTConfig)
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the factory (useful for plug-ins)."""

    def __post_init__(self) -> None:
        _check_ranges(self, "model.")
        check_choice("model.activation", self.activation, ("relu", "sigmoid"))


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    """sgd | adam | adamw."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW betas."""

    def __post_init__(self) -> None:
        check_choice("optim.name", self.name, ("sgd", "adam", "adamw"))
        _check_ranges(self, "optim.")
        if len(self.betas) != 2:
            raise UsageError(f"optim.betas: needs two values like [0.9,0.999], got {self.betas}")


@dataclass(kw_only=True)
class SchedConfig:
    name: str = "none"
    """none | step | cosine | onecycle. The lr is a pure function of the optimizer step."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to optim.lr over this many steps."""
    step_size_epochs: int = 1
    """step: multiply by gamma every this many epochs (like torch StepLR stepped per epoch)."""
    gamma: float = 0.7
    min_lr_ratio: float = 0.0
    """cosine: final lr as a fraction of optim.lr."""
    pct_start: float = 0.3
    """onecycle: share of the steps spent rising from lr/25 to optim.lr (then cosine to lr/1e4)."""

    def __post_init__(self) -> None:
        check_choice("sched.name", self.name, ("none", "step", "cosine", "onecycle"))
        _check_ranges(self, "sched.")


@dataclass(kw_only=True)
class TrainConfig:
    epochs: int = 20
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (null: run all epochs)."""
    eval_every_steps: int = 0
    """Evaluate every N optimizer steps; 0: at epoch ends (see eval_every_epochs)."""
    eval_every_epochs: int = 1
    """With eval_every_steps=0: evaluate every N epochs. The last step is always evaluated."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16: autocast dtype. fp16 adds a GradScaler; on overflow every rank skips
    the step together (DDP gives them the same gradients)."""
    fp16_init_scale: float = 65536.0
    """fp16: the GradScaler's initial loss scale."""
    micro_batch_size: int | None = None
    """Per-rank samples per forward/backward. Smaller than the rank's share of the global batch:
    the step is split into micro-steps (no DDP sync until the last), same result, less memory."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value (after the all-reduce, before the step)."""
    compile: bool = False
    """torch.compile the model (after DDP wrapping)."""
    channels_last: bool = False
    """channels_last memory format for 4-D inputs and conv weights (faster convs on GPU)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's (or residual stage's) activations in the backward
    pass instead of keeping them: less memory, about a third more compute. Same numbers (a
    BatchNorm inside a block updates its running statistics twice per step)."""

    def __post_init__(self) -> None:
        check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        _check_ranges(self, "train.")


@dataclass(kw_only=True)
class DistConfig:
    strategy: str = "auto"
    """auto (ddp when world > 1, else none) | none (world 1 only) | ddp | fsdp (FSDP2: parameters,
    gradients and optimizer state sharded over the ranks) | dp (nn.DataParallel over this
    process's GPUs; one process only)."""
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU) | nccl | gloo."""
    device: str = "auto"
    """auto (cuda if available) | cpu | cuda."""
    timeout_s: int = 300
    """Bound on any collective and on process-group setup: a lost peer fails, never hangs."""

    def __post_init__(self) -> None:
        check_choice("dist.strategy", self.strategy, ("auto", "none", "ddp", "fsdp", "dp"))
        check_choice("dist.backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("dist.device", self.device, ("auto", "cpu", "cuda"))
        _check_ranges(self, "dist.")


@dataclass(kw_only=True)
class FSDPConfig:
    """dist.strategy=fsdp. Sharding units: each transformer block (each residual stage of a
    ResNet), then the root; mixed precision follows train.precision (bf16/fp16 parameters and
    compute, fp32 gradient reduction and fp32 master weights)."""

    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gather again for the backward):
    less memory, one more all-gather per unit. false keeps them until the backward (ZeRO-2)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in CPU memory between uses
    (CUDA only): fits larger models, slower steps."""


@dataclass(kw_only=True)
class LogConfig:
    every_steps: int = 10
    """Write a metrics.jsonl record (and a console line) every N optimizer steps."""
    progress: str = "auto"
    """auto (a bar on a TTY, plain lines otherwise) | bar | plain | none."""
    tensorboard: bool = True
    """Also write TensorBoard event files to <run_dir>/tb (skipped, with a note, if the
    tensorboard package is not installed: pip install 'trainer[tensorboard]')."""

    def __post_init__(self) -> None:
        _check_ranges(self, "log.")
        check_choice("log.progress", self.progress, ("auto", "bar", "plain", "none"))


@dataclass(kw_only=True)
class CkptConfig:
    dir: str | None = None
    """Where checkpoints go (default: <run_dir>/checkpoints): a step-<N> folder per save."""
    every_steps: int = 0
    """Save every N optimizer steps (0: off)."""
    every_epochs: int = 1
    """Save at the end of every N epochs (0: off). The last step and SIGTERM always save."""
    keep_last: int = 3
    """Keep the newest N checkpoints; older ones are deleted after a successful save."""
    resume: str = "auto"
    """auto (newest checkpoint in `dir` that verifies) | never | PATH (a checkpoint or run dir)."""
    init_weights: str | None = None
    """Start from these weights (.safetensors/.pt/.pth; `module.`/`_orig_mod.` prefixes are
    stripped) when not resuming. Weights only: the optimizer and loop start fresh."""

    def __post_init__(self) -> None:
        _check_ranges(self, "ckpt.")


@dataclass(kw_only=True)
class ReproConfig:
    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms, cuDNN deterministic
    and no benchmark, CUBLAS_WORKSPACE_CONFIG). Slower on GPU; CPU runs are bitwise anyway."""
    world_invariant: bool = False
    """The same bits on every world size dividing repro.shards: each global batch is cut into
    that many fixed shards, each rank computes its shards' gradients one by one, and all shard
    gradients are added in one fixed tree (docs/training.md: how, and what it costs). Strategy
    none or ddp; with dist.device=cuda also set repro.deterministic=true."""
    shards: int = 8
    """Shards per global batch under repro.world_invariant: a power of two that the world size
    divides (1, 2, 4 or 8 ranks for 8)."""


@dataclass(kw_only=True)
class Config:
    name: str = DEFAULT_PRESET
    """Run name; the default run_dir is runs/<name>."""
    run_dir: str = "runs/${name}"
    """Where config.yaml, metrics.jsonl, summary.json and final/ are written."""
    seed: int = 0
    """Seeds model init and the data order; same seed + same global batch = same numbers."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    repro: ReproConfig = field(default_factory=ReproConfig)

    def __post_init__(self) -> None:
        from trainer import registry

        _check_ranges(self, "")
        registry.check("data.name", self.data.name)
        registry.check("model.name", self.model.name)
        k = self.repro.shards
        if k < 1 or k & (k - 1):
            raise ConfigError(
                f"repro.shards={k} must be a power of two (1, 2, 4, 8, 16, ...): the shards' "
                "gradients are added in a binary tree"
            )


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


def presets() -> list[str]:
    return sorted(
        p.name[:-5] for p in resources.files("trainer.conf").iterdir() if p.name.endswith(".yaml")
    )


def _read_yaml(text: str, source: str):
    from omegaconf import DictConfig, OmegaConf

    kind = _yaml_kind(text)
    if kind == "empty":
        raise UsageError(
            f"{source}: the file has no config keys: put some in it (e.g. `optim: {{lr: 0.01}}`), "
            "or leave --config out"
        )
    if kind not in ("mapping", "?"):
        raise UsageError(
            f"{source}: must be a YAML mapping of config keys (like `optim: {{lr: 0.01}}`), "
            f"not a single {kind}"
        )
    try:
        node = OmegaConf.create(text)
    except Exception as e:  # yaml.YAMLError and OmegaConf's own grammar errors
        raise UsageError(f"{source}: not valid YAML ({first_line(e)})") from None
    if not isinstance(node, DictConfig):
        raise UsageError(f"{source}: must be a YAML mapping of config keys")
    return node


def _yaml_kind(text: str) -> str:
    """mapping | list | string | number | boolean | empty, or ? when it does not parse."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return "?"
    if value is None:
        return "empty"
    kinds = {dict: "mapping", list: "list", str: "string", int: "number", float: "number"}
    return "boolean" if isinstance(value, bool) else kinds.get(type(value), "?")


def _read_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        binary = b"\0" in raw
        raise UsageError(
            f"--config {path}: "
            + (
                "is a binary file, not YAML: give a YAML file, a preset name or a run directory"
                if binary
                else f"is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}): save it "
                "as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            )
        ) from None


def _layer_for(config: str | None, seen: tuple[str, ...] = ()):
    """(source, DictConfig) layers for --config: a preset name or a YAML file path."""
    if config is None:
        config = DEFAULT_PRESET
    names = presets()
    if config in names:
        text = resources.files("trainer.conf").joinpath(f"{config}.yaml").read_text()
        return [(f"preset '{config}'", _read_yaml(text, f"preset '{config}'"))]
    if os.path.isdir(config):
        if not os.path.isfile(os.path.join(config, "config.yaml")):
            raise UsageError(
                f"--config: '{config}' is a directory without config.yaml (not a run "
                "directory): give a run directory, a YAML file or a preset name"
            )
        config = os.path.join(config, "config.yaml")  # a run directory: re-run it
    if not os.path.isfile(config):
        raise UsageError(
            f"--config: '{config}' is neither a preset{did_you_mean(config, names)} nor a YAML file; "
            f"presets: {', '.join(names)}"
        )
    if os.path.realpath(config) in seen:
        raise UsageError(f"{config}: `preset:` includes itself (a cycle): remove that line")
    node = _read_yaml(_read_file(config), config)
    layers = []
    base = node.pop("preset", None)  # a user file may build on a preset: `preset: digits-lenet`
    if base is not None:
        if not isinstance(base, str) or not base:
            raise UsageError(
                f"{config}: preset: needs a preset name or a YAML path (e.g. preset: digits-lenet)"
                f", got {base}"
            )
        layers += _layer_for(base, (*seen, os.path.realpath(config)))
    return [*layers, (config, node)]


_BOOLS = ("true", "false", "yes", "no", "on", "off", "1", "0")


@functools.lru_cache(maxsize=1)
def _bool_keys() -> frozenset[str]:
    """Dotted keys of the schema's bool fields (OmegaConf would take `2` for true)."""
    import dataclasses
    import typing

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                yield from walk(t, f"{prefix}{f.name}.")
            elif t is bool:
                yield f"{prefix}{f.name}"

    return frozenset(walk(Config, ""))


_KEY = re.compile(r"^[A-Za-z_][\w-]*(\[\d+\])?(\.[A-Za-z_][\w-]*(\[\d+\])?)*$")


def _leaf_keys(node=None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (nested sections too)."""
    import dataclasses

    node = Config if node is None else node
    keys = []
    for f in dataclasses.fields(node):
        key = prefix + f.name
        keys.append(key)
        t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if t is not None and dataclasses.is_dataclass(t):
            keys += _leaf_keys(t, key + ".")
    return keys


def _suggest(key: str) -> str:
    """' (did you mean 'optim.lr'?)' for a misspelt or misplaced dotted key, else ''."""
    keys = _leaf_keys()
    cleaned = ".".join(p for p in key.replace(" ", "").split(".") if p)
    if cleaned in keys and cleaned != key:
        return f" (did you mean '{cleaned}'?)"
    leaf = cleaned.rpartition(".")[2]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf and cleaned not in keys:
        return f" (did you mean '{same_leaf[0]}'?)"
    return did_you_mean(cleaned, keys)


def _printable(text: str) -> str:
    """The text with undecodable bytes (from a non-UTF-8 argv) shown as \\xNN escapes."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _cli_layer(overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        key, eq, value = item.partition("=")
        shown = _printable(item)
        if not eq or not key or key.startswith("-"):
            raise UsageError(f"override '{shown}' must look like key=value (e.g. optim.lr=0.01)")
        if _printable(key) != key:
            raise UsageError(
                f"override '{shown}': the key is not valid UTF-8: type the key in plain ASCII "
                f"(e.g. optim.lr=0.01){_suggest(_printable(key))}"
            )
        if not _KEY.match(key):
            raise UsageError(
                f"override '{shown}': '{key}' is not a dotted key like optim.lr{_suggest(key)}"
            )
        if key in _bool_keys() and value.strip().lower() not in _BOOLS:
            raise UsageError(
                f"command line: {key}: '{_printable(value)}' is not true or false "
                f"(e.g. {_example(key)})"
            )
        if _printable(value) != value:
            raise UsageError(
                f"override '{shown}': the value of {key} is not valid UTF-8: retype it "
                f"(e.g. {_example(key) if key in _leaf_keys() else key + '=...'}), or write it "
                "in a UTF-8 --config file"
            )
    items = []
    for item in overrides:
        try:
            items.append(OmegaConf.from_dotlist([item]))
        except Exception as e:
            key = item.partition("=")[0]
            raise UsageError(
                f"command line: {key}: cannot parse '{item.partition('=')[2]}' "
                f"({first_line(e)}); quote lists like {key}=[1,2] and strings with spaces"
            ) from None
    return [(f"command line: {item}", layer) for item, layer in zip(overrides, items, strict=True)]


def _valid_keys(schema, full_key: str) -> list[str]:
    parent = full_key.rpartition(".")[0]
    from omegaconf import OmegaConf

    node = OmegaConf.select(schema, parent) if parent else schema
    return list(node.keys()) if node is not None and hasattr(node, "keys") else []


def _first_key(layer) -> str | None:
    """The full dotted key of the (first) leaf in a layer: the key a one-override layer sets."""
    from omegaconf import DictConfig

    key, node = "", layer
    while isinstance(node, DictConfig) and len(node) >= 1:
        name = next(iter(node.keys()))
        key = f"{key}.{name}" if key else str(name)
        node = node._get_node(name)
        if len(getattr(node, "keys", lambda: [None, None])()) != 1:
            break
    return key or None


def _merge_error(e: Exception, schema, source: str, layer=None) -> UsageError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = getattr(e, "full_key", None) or (_first_key(layer) if layer is not None else None)
    source = "command line" if source.startswith("command line: ") else source
    if not key:
        return UsageError(f"{source}: {first_line(e)}")
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent, _, leaf = key.rpartition(".")
        valid = _valid_keys(schema, key)
        hint = did_you_mean(leaf, valid)
        if hint and parent:
            hint = hint.replace(" '", f" '{parent}.", 1)
        hint = hint or _suggest(key)
        return UsageError(
            f"{source}: unknown key '{key}'{hint}; valid keys here: {', '.join(valid)}"
        )
    message = first_line(e)
    if "Merge error" in message or "is not a subclass" in message:
        message = f"is a section of keys, not a value: set its keys, e.g. {_section_example(key)}"
        return UsageError(f"{source}: {key}: {message}")
    hint = range_hint(key)
    if "valid bool" in message:
        hint = f" (set true or false, e.g. {_example(key)})"
    if not hint and "None" in message:
        hint = f" (give it a value, e.g. {_example(key)})" if key in _leaf_keys() else ""
    return UsageError(f"{source}: {key}: {message}{hint}")


def _section_example(key: str) -> str:
    import dataclasses

    node: Any = Config()
    for part in key.split("."):
        node = getattr(node, part, None)
    if dataclasses.is_dataclass(node):
        first = dataclasses.fields(node)[0].name
        return _example(f"{key}.{first}")
    return f"{key}.<key>=<value>"


def load(config: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Merge schema < preset < --config file < CLI overrides into a validated Config."""
    try:
        return _load(config, overrides)
    except ConfigError:
        raise
    except UsageError as e:
        raise ConfigError(str(e)) from None


def _load(config: str | None, overrides: list[str] | tuple[str, ...]) -> Config:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = _schema()
    merged = schema
    for source, layer in [*_layer_for(config), *_cli_layer(list(overrides))]:
        try:
            merged = OmegaConf.merge(merged, layer)
        except (OmegaConfBaseException, TypeError, ValueError) as e:  # TypeError: list <- dict
            raise _merge_error(e, schema, source, _culprit(schema, layer)) from None
    try:
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except UsageError:
        raise
    except OmegaConfBaseException as e:
        raise _merge_error(e, schema, "config") from None
    return cfg


@functools.lru_cache(maxsize=1)
def _schema():
    """The structured schema (built once: merges copy it, never change it)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config)


def _culprit(schema, layer):
    """The top-level section of `layer` whose merge fails (a layer of that key alone)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for name in list(layer.keys()):
        part = OmegaConf.create({name: layer._get_node(name)})
        try:
            OmegaConf.merge(schema, part)
        except (OmegaConfBaseException, TypeError, ValueError):
            return part
    return layer


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))
