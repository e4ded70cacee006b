"""The typed config schema and its merge: schema defaults < preset < --config file < CLI key=value.

Every field has a default and a docstring; `__post_init__` checks values and says what to set.
`load()` turns every mistake (unknown key, wrong type, bad choice) into a one-line UsageError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from trainer.errors import ConfigError, UsageError, check_choice, did_you_mean, first_line

DEFAULT_PRESET = "digits-mlp"


def _positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


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
        if not self.shape or any(d < 1 for d in self.shape):
            raise UsageError(
                f"data.synthetic.shape: needs positive sizes like [3,32,32], got {self.shape}"
            )
        if self.num_classes < 2:
            raise UsageError(f"data.synthetic.num_classes: must be >= 2, got {self.num_classes}")
        _positive("data.synthetic.size", self.size)
        _positive("data.synthetic.test_size", self.test_size)


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
        _positive("data.text.seq_len", self.seq_len)
        for key in ("max_train_bytes", "max_test_bytes"):
            value = getattr(self, key)
            if value is not None:
                _positive(f"data.text.{key}", value)


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
        _positive("data.global_batch_size", self.global_batch_size)
        _positive("data.eval_batch_size", self.eval_batch_size)
        if not 0.0 < self.test_fraction < 1.0:
            raise UsageError(
                f"data.test_fraction: must be between 0 and 1, got {self.test_fraction}"
            )
        _positive("data.crop_padding", self.crop_padding, allow_zero=True)
        _positive("data.image_size", self.image_size)
        _positive("data.num_workers", self.num_workers, allow_zero=True)
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
        _positive("model.gpt.layers", self.layers)
        _positive("model.gpt.width", self.width)
        _positive("model.gpt.heads", self.heads)


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
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"model.dropout: must be in [0, 1), got {self.dropout}")
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
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
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
        if not 0.0 < self.pct_start < 1.0:
            raise UsageError(f"sched.pct_start: must be between 0 and 1, got {self.pct_start}")
        _positive("sched.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("sched.step_size_epochs", self.step_size_epochs)


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
        _positive("train.epochs", self.epochs)
        _positive("train.eval_every_epochs", self.eval_every_epochs)
        check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        _positive("train.fp16_init_scale", self.fp16_init_scale)
        if self.micro_batch_size is not None:
            _positive("train.micro_batch_size", self.micro_batch_size)
        if self.clip_grad_norm is not None:
            _positive("train.clip_grad_norm", self.clip_grad_norm)
        if self.max_steps is not None:
            _positive("train.max_steps", self.max_steps)
        _positive("train.eval_every_steps", self.eval_every_steps, allow_zero=True)


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
        _positive("dist.timeout_s", self.timeout_s)


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
        _positive("log.every_steps", self.every_steps)
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
        _positive("ckpt.every_steps", self.every_steps, allow_zero=True)
        _positive("ckpt.every_epochs", self.every_epochs, allow_zero=True)
        _positive("ckpt.keep_last", self.keep_last)
        if not self.resume:
            raise UsageError("ckpt.resume: set auto, never, or a checkpoint path")


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

        registry.check("data.name", self.data.name)
        registry.check("model.name", self.model.name)
        k = self.repro.shards
        if k < 1 or k & (k - 1):
            raise ConfigError(
                f"repro.shards={k} must be a power of two (1, 2, 4, 8, 16, ...): the shards' "
                "gradients are added in a binary tree"
            )


def check_world_size(cfg: Config, world_size: int) -> None:
    """The global batch must split evenly over the ranks (each takes an equal slice); under
    repro.world_invariant the ranks must split the shards evenly too."""
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

    try:
        node = OmegaConf.create(text)
    except Exception as e:  # yaml.YAMLError and OmegaConf's own grammar errors
        raise UsageError(f"{source}: not valid YAML ({first_line(e)})") from None
    if not isinstance(node, DictConfig):
        raise UsageError(f"{source}: must be a YAML mapping of config keys")
    return node


def _layer_for(config: str | None):
    """(source, DictConfig) layers for --config: a preset name or a YAML file path."""
    if config is None:
        config = DEFAULT_PRESET
    names = presets()
    if config in names:
        text = resources.files("trainer.conf").joinpath(f"{config}.yaml").read_text()
        return [(f"preset '{config}'", _read_yaml(text, f"preset '{config}'"))]
    if os.path.isdir(config) and os.path.isfile(os.path.join(config, "config.yaml")):
        config = os.path.join(config, "config.yaml")  # a run directory: re-run it
    if not os.path.isfile(config):
        raise UsageError(
            f"--config: '{config}' is neither a preset{did_you_mean(config, names)} nor a YAML file; "
            f"presets: {', '.join(names)}"
        )
    with open(config, encoding="utf-8") as f:
        node = _read_yaml(f.read(), config)
    layers = []
    base = node.pop("preset", None)  # a user file may build on a preset: `preset: digits-lenet`
    if base is not None:
        layers += _layer_for(str(base))
    return [*layers, (config, node)]


def _cli_layer(overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key or key.startswith("-"):
            raise UsageError(f"override '{item}' must look like key=value (e.g. optim.lr=0.01)")
    try:
        return ("command line", OmegaConf.from_dotlist(list(overrides)))
    except Exception as e:
        raise UsageError(f"command line: cannot parse overrides ({first_line(e)})") from None


def _valid_keys(schema, full_key: str) -> list[str]:
    parent = full_key.rpartition(".")[0]
    from omegaconf import OmegaConf

    node = OmegaConf.select(schema, parent) if parent else schema
    return list(node.keys()) if node is not None and hasattr(node, "keys") else []


def _merge_error(e: Exception, schema, source: str) -> UsageError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = getattr(e, "full_key", None) or "?"
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent, _, leaf = key.rpartition(".")
        valid = _valid_keys(schema, key)
        hint = did_you_mean(leaf, valid)
        if hint and parent:
            hint = hint.replace(" '", f" '{parent}.", 1)
        return UsageError(
            f"{source}: unknown key '{key}'{hint}; valid keys here: {', '.join(valid)}"
        )
    return UsageError(f"{source}: {key}: {first_line(e)}")


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

    schema = OmegaConf.structured(Config)
    merged = schema
    for source, layer in [*_layer_for(config), _cli_layer(list(overrides))]:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _merge_error(e, schema, source) from None
    try:
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except UsageError:
        raise
    except OmegaConfBaseException as e:
        raise _merge_error(e, schema, "config") from None
    return cfg


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))
