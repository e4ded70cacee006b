"""The typed config schema: every field has a default and a docstring; `__post_init__` checks
values and says what to set. `walk` is the one walker of the schema's fields."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainer import storage
from trainer.config.ranges import (
    BUCKET_PATHS,
    NONEMPTY,
    PATHS,
    RANGES,
    SAMPLES,
    path_problem,
)
from trainer.errors import ConfigError, UsageError, check_choice, did_you_mean, redact, shorten
from trainer.parallel.layout import DIMS, SCHEDULES

DEFAULT_PRESET = "digits-mlp"


@dataclass(kw_only=True)
class SyntheticConfig:
    """data.name=synthetic: random class prototypes plus noise, generated from data.split_seed."""

    shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    """One sample's shape, e.g. [3,32,32] (an image) or [20] (a feature vector)."""
    num_classes: int = 10
    """Classes (one prototype each)."""
    size: int = 1024
    """Training samples."""
    test_size: int = 256
    """Test samples."""

    def __post_init__(self) -> None:
        if not self.shape:
            raise UsageError("data.synthetic.shape: needs positive sizes like [3,32,32], got []")
        check_fields(self, "data.synthetic.")


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
        check_fields(self, "data.text.")


@dataclass(kw_only=True)
class TokensConfig:
    """data.name=tokens: a flat token file (train.bin / test.bin, nanoGPT's format), read per
    batch through a memory map: never whole, on any rank. `trainer data tokenize` writes one."""

    path: str = "data/tokens"
    """A folder holding train.bin and test.bin (or val.bin), flat arrays of token ids, and
    tokens.json beside them ({"dtype": "uint16", "vocab_size": N}, written by `trainer data
    tokenize`). Without tokens.json set data.tokens.dtype and data.tokens.vocab_size."""
    seq_len: int = 256
    """Tokens the model reads per sample; each sample predicts the next token at every position."""
    dtype: str | None = None
    """uint16 | uint32: how the ids are stored (null: tokens.json says)."""
    vocab_size: int | None = None
    """Token ids are below this (null: tokens.json says)."""
    max_train_tokens: int | None = None
    """Use only the first N tokens of train.bin (null: all of it)."""
    max_test_tokens: int | None = None
    """Use only the first N tokens of the test split: evaluation reads all of it every time."""

    def __post_init__(self) -> None:
        check_fields(self, "data.tokens.")
        if self.dtype is not None:
            check_choice("data.tokens.dtype", self.dtype, ("uint16", "uint32"))


@dataclass(kw_only=True)
class ArraysConfig:
    """data.name=arrays: .npy files read per batch through a memory map (never whole): a folder
    with train/ and test/, each holding one <field>.npy per field, all of the same length."""

    path: str = "data/arrays"
    """The folder holding train/ and test/. Fields x and y give (x, y) batches for the built-in
    tasks; other field names give dict batches {field: tensor} for your own task."""
    task: str | None = None
    """The data's task for task.name=auto: classification | regression | null (classification
    for integer y, regression for float y; none for other fields)."""

    def __post_init__(self) -> None:
        check_fields(self, "data.arrays.")
        if self.task is not None:
            check_choice("data.arrays.task", self.task, ("classification", "regression"))


@dataclass(kw_only=True)
class ShardsConfig:
    """data.name=shards: a dataset `trainer data pack` wrote, in a folder or an s3:// prefix."""

    path: str = "data/shards"
    """The folder or s3://bucket/prefix holding index.json and the .tar shards."""
    window: int = 8
    """Shards an epoch reads at a time, its samples shuffled among them (the order visits the
    shards in a shuffled order, `window` at a time): a bigger window mixes more, a smaller one
    needs less cache. 0: a full shuffle (the same order as the unpacked dataset)."""
    cache_dir: str = "/tmp/trainer-shards"
    """A bucket's shards are downloaded here, once per node (shared by its ranks and workers)."""
    cache_gb: float = 8.0
    """The cache's size limit; least recently used shards are evicted beyond it. Must hold
    2 x window + 2 shards."""

    def __post_init__(self) -> None:
        check_fields(self, "data.shards.")


@dataclass(kw_only=True)
class DataConfig:
    """The dataset, its splits, the global batch and how batches reach the ranks."""

    name: str = "digits"
    """Dataset: digits | diabetes | mnist | fashion_mnist | cifar10 | imagefolder | synthetic |
    text | tokens | arrays | shards, or `package.module:factory` (docs/extending.md)."""
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
    tokens: TokensConfig = field(default_factory=TokensConfig)
    arrays: ArraysConfig = field(default_factory=ArraysConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Settings of your own data factory (it reads cfg.kwargs; the built-ins read none), e.g.
    data.kwargs.min_length=3."""

    def __post_init__(self) -> None:
        check_fields(self, "data.")
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
    """Transformer blocks."""
    width: int = 128
    """Embedding width; a multiple of heads."""
    heads: int = 4
    """Attention heads per block."""

    def __post_init__(self) -> None:
        check_fields(self, "model.gpt.")
        if self.width % self.heads:
            raise UsageError(
                f"model.gpt.width={self.width} does not split over model.gpt.heads={self.heads}: "
                "use a width that is a multiple of heads"
            )


@dataclass(kw_only=True)
class ModelConfig:
    """The network: a registry name or your own factory, and its shape."""

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
        check_fields(self, "model.")
        check_choice("model.activation", self.activation, ("relu", "sigmoid"))


@dataclass(kw_only=True)
class TaskConfig:
    """What is learned: the loss a step minimises and the metrics evaluation reports."""

    name: str = "auto"
    """auto (the dataset's own: classification, regression or lm) | classification | regression
    | lm | model_loss (the model returns its loss, as model(**batch).loss in Hugging Face) |
    `package.module:obj`, a trainer.Task, a subclass or a factory (docs/extending.md)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the task's class or factory."""

    def __post_init__(self) -> None:
        check_fields(self, "task.")


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer and what it trains: frozen parameters, parameter groups, weight decay."""

    name: str = "adamw"
    """sgd | adam | adamw, or `package.module:factory` called with the parameter groups and the
    keys of optim.* its signature names (lr, weight_decay, betas, momentum, nesterov), then
    optim.kwargs; it returns a torch.optim.Optimizer (docs/finetuning.md)."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """L2 penalty (sgd, adam) or decoupled weight decay (adamw), on every parameter (see
    optim.decay)."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = False
    """SGD: Nesterov momentum."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam/AdamW betas."""
    fused: bool | None = None
    """Adam/AdamW's fused kernel (one kernel updates every parameter): null, the default, uses it
    where every parameter is on a GPU and leaves CPU runs on torch's default (foreach); true
    uses it on any device torch has it for (a CPU too); false never. A resume keeps this run's
    choice, whatever the checkpoint's run chose."""
    decay: str = "all"
    """all: weight_decay on every parameter (the presets' numbers) | no_bias_norm: none on
    biases and norm weights (every 1-d parameter), nanoGPT's and fine-tuning recipes' rule."""
    freeze: str = ""
    """Comma-separated glob patterns of parameter names not to train (e.g. 'tok.*,blocks.0.*'):
    requires_grad off before wrapping, so they are left out of the optimizer and of the
    gradient all-reduce and stay bitwise unchanged. A pattern matching nothing is refused."""
    groups: dict[str, Any] = field(default_factory=dict)
    """Parameter groups by name pattern: optim.groups.NAME={params: 'GLOB,...', lr_mult: 10,
    weight_decay: 0.0}; lr_mult scales optim.lr (default 1), weight_decay replaces optim's.
    Parameters no group names train with optim.lr. Groups may not overlap."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for a plug-in optimizer factory (optim.name=pkg.mod:factory)."""
    lora_targets: str = ""
    """LoRA (pip install 'repro-trainer[finetune]', Hugging Face PEFT): comma-separated glob
    patterns of the Linear/Conv/Embedding module names that get adapters (e.g.
    'blocks.*.attn.qkv'). Only the adapters train and are checkpointed. Empty: no LoRA."""
    lora_also_train: str = ""
    """With LoRA: comma-separated glob patterns of parameters that train in full beside the
    adapters (a new head, e.g. 'fc3.*'), checkpointed with them."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float = 16.0
    """LoRA alpha (the adapter's output is scaled by alpha / r)."""

    def __post_init__(self) -> None:
        if ":" not in self.name:
            check_choice("optim.name", self.name, ("sgd", "adam", "adamw"))
        elif not all(self.name.partition(":")[::2]):
            raise UsageError(f"optim.name: '{self.name}' must look like 'package.module:factory'")
        check_choice("optim.decay", self.decay, ("all", "no_bias_norm"))
        check_fields(self, "optim.")
        for name, group in self.groups.items():
            _check_group(name, group, self.lr)
        if len(self.betas) != 2:
            raise UsageError(
                f"optim.betas: needs two values like [0.9,0.999], got {_number_text(self.betas)}"
            )
        if self.fused and self.name not in ("adam", "adamw"):
            raise UsageError(
                f"optim.fused=true is for adam and adamw, not optim.name={self.name}: drop it "
                "(a plug-in optimizer takes its own options through optim.kwargs)"
            )


GROUP_KEYS = ("params", "lr_mult", "weight_decay")
"""What an optim.groups entry may set."""


def _check_group(name: str, group: Any, lr: float) -> None:
    """optim.groups.NAME: a mapping of params (glob patterns: a comma-separated string or a list
    of strings), lr_mult (optim.lr x lr_mult within optim.lr's range) and weight_decay (within
    optim.weight_decay's), each a finite number."""
    key = f"optim.groups.{name}"
    form = f"{key}='{{params: [fc.*], lr_mult: 10}}'"
    if not isinstance(group, dict):
        raise UsageError(
            f"{key}: a group is a mapping of params (glob patterns), lr_mult and weight_decay, "
            f"not {_kind(group)}: write e.g. {form}"
        )
    if other := sorted(set(group) - set(GROUP_KEYS), key=str):
        raise UsageError(
            f"{key}.{shorten(str(other[0]))}: unknown; a group has {', '.join(GROUP_KEYS)} "
            f"(e.g. {form})"
        )
    _check_group_params(key, group.get("params"), form)
    if "lr_mult" in group:
        mult = _finite(f"{key}.lr_mult", group["lr_mult"], f"{key}.lr_mult=10")
        if mult <= 0 or lr * mult not in RANGES["optim.lr"]:
            zero = " (0 trains nothing: freeze them with optim.freeze)" if mult == 0 else ""
            raise UsageError(
                f"{key}.lr_mult: optim.lr x lr_mult must be {RANGES['optim.lr']} (optim.lr="
                f"{lr:g}), got lr_mult={_number_text(group['lr_mult'])}{zero}; e.g. "
                f"{key}.lr_mult=10"
            )
    if "weight_decay" in group:
        wd = _finite(f"{key}.weight_decay", group["weight_decay"], f"{key}.weight_decay=0.0")
        if wd not in RANGES["optim.weight_decay"]:
            raise UsageError(
                f"{key}.weight_decay: must be {RANGES['optim.weight_decay']} (as "
                f"optim.weight_decay), got {_number_text(group['weight_decay'])}; e.g. "
                f"{key}.weight_decay=0.0"
            )


def _check_group_params(key: str, params: Any, form: str) -> None:
    """A group's params: a non-empty comma-separated string of glob patterns, or a list of them."""
    items = params if isinstance(params, list) else [params]
    if params is None or params == [] or params == "":
        raise UsageError(f"{key}: needs params, the glob patterns of its parameters, e.g. {form}")
    for item in items:
        if not isinstance(item, str):
            raise UsageError(
                f"{key}.params: glob patterns are text ('fc.*,head.*' or [fc.*, head.*]), got "
                f"{_kind(item)} {shorten(repr(item))}: quote it, e.g. {form}"
            )
        if not item.replace(",", "").strip():
            raise UsageError(
                f"{key}.params: {shorten(repr(item))} holds no pattern: name its parameters, "
                f"e.g. {form}"
            )


def _kind(value: Any) -> str:
    """'a list', 'an int', 'null': what a value is, for a message."""
    if value is None:
        return "null"
    name = {dict: "mapping", list: "list", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _finite(key: str, value: Any, sample: str) -> float:
    """`value` as a finite float, or one line naming `key` and a value it takes."""
    try:
        number = float(value) if not isinstance(value, (bool, str)) else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise UsageError(
            f"{key}: needs a finite number, got {shorten(_number_text(value))}; e.g. {sample}"
        )
    return number


@dataclass(kw_only=True)
class SchedConfig:
    """The learning-rate schedule, a pure function of the optimizer step."""

    name: str = "none"
    """none | step | cosine | onecycle. The lr is a pure function of the optimizer step."""
    warmup_steps: int = 0
    """Linear warm-up from 0 to optim.lr over this many steps."""
    step_size_epochs: int = 1
    """step: multiply by gamma every this many epochs (like torch StepLR stepped per epoch)."""
    gamma: float = 0.7
    """step: the factor applied every step_size_epochs."""
    min_lr_ratio: float = 0.0
    """cosine: final lr as a fraction of optim.lr."""
    pct_start: float = 0.3
    """onecycle: share of the steps spent rising from lr/25 to optim.lr (then cosine to lr/1e4)."""

    def __post_init__(self) -> None:
        check_choice("sched.name", self.name, ("none", "step", "cosine", "onecycle"))
        check_fields(self, "sched.")


@dataclass(kw_only=True)
class TrainConfig:
    """How long to train and what each step does (precision, clipping, micro-batches)."""

    epochs: int = 20
    """Passes over the training split (each ends with an evaluation, see eval_every_epochs)."""
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
    compile_loss: bool = True
    """With train.compile: the training step compiles the task's loss with the model's forward
    (one graph without a wrapper; under DDP/FSDP, whose hooks break it, a graph of its own), so
    a language model's logits reach the loss without an fp32 copy of them. false: the loss runs
    eagerly on the compiled model's output. A pipeline (pp) compiles its stages alone either
    way."""
    channels_last: bool = False
    """channels_last memory format for 4-D inputs and conv weights (faster convs on GPU)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's (or residual stage's) activations in the backward
    pass instead of keeping them: less memory, about a third more compute. Same numbers (a
    BatchNorm inside a block updates its running statistics twice per step)."""

    def __post_init__(self) -> None:
        check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))
        check_fields(self, "train.")


@dataclass(kw_only=True)
class DistConfig:
    """How the ranks share the work: strategy, backend, device and timeouts."""

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
    stall_s: float | None = None
    """Seconds without a completed training step after which every rank writes its stacks to
    <run_dir>/diagnostics/, one line names the rank that stalled and where, and the job exits 4
    (docs/troubleshooting.md, "When a job hangs"). null: 30x the slowest log window's mean step,
    at least 60 s; always below dist.timeout_s. 0: off. Evaluation and saves are not counted."""
    mesh: str | None = None
    """The device mesh, named sizes like dp=2,pp=2 or dp=2,tp=2 (dimensions dp, pp, tp, each
    at most once, each size a positive integer in digits 0-9; their product is the world size;
    dp left out takes what remains). pp splits the model's layers into pipeline stages, tp
    splits each layer's matrices; dist.strategy applies to dp. null: data parallel only
    (docs/training.md, "Model parallel")."""
    pp_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved-1f1b (two stages per rank): the pipeline schedule under pp;
    train.micro_batch_size is the pipeline's micro-batch (default: one per stage)."""

    def __post_init__(self) -> None:
        check_choice("dist.strategy", self.strategy, ("auto", "none", "ddp", "fsdp", "dp"))
        check_choice("dist.backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("dist.device", self.device, ("auto", "cpu", "cuda"))
        check_choice("dist.pp_schedule", self.pp_schedule, SCHEDULES)
        check_fields(self, "dist.")
        check_mesh(self.mesh)
        if self.stall_s and self.stall_s >= self.timeout_s:
            raise UsageError(
                f"dist.stall_s={self.stall_s:g} must be below dist.timeout_s={self.timeout_s}: a "
                "stall is named before a collective's timeout ends the job (lower dist.stall_s, "
                "or raise dist.timeout_s)"
            )


MAX_MESH_SIZE = 2**20
"""The largest size of a dist.mesh dimension (more ranks than any job launches)."""


def check_mesh(text: str | None) -> None:
    """dist.mesh's grammar, whatever the world size: NAME=SIZE items separated by commas, each
    NAME one of dp, pp, tp at most once, each SIZE a positive integer in ASCII digits (int()
    takes '²' and '٣' for digits, and refuses a number of over 4,300). null or blank: data
    parallel only. The sizes against the world: rules.layout, when the world is known."""
    if text is None or not text.strip():
        return
    seen: set[str] = set()
    for part in text.replace(" ", "").split(","):
        name, eq, size = part.partition("=")
        problem = _mesh_problem(name, eq, size, seen)
        if problem:
            raise UsageError(
                f"dist.mesh={shorten(text)!r}: {problem}: write sizes like dist.mesh=dp=2,pp=2 "
                "(dimensions dp, pp, tp, each at most once; each size a positive integer)"
            )
        seen.add(name)


def _mesh_problem(name: str, eq: str, size: str, seen: set[str]) -> str | None:
    """What is wrong with one NAME=SIZE item of dist.mesh, or None."""
    if not name and not eq:
        return "an empty item (two commas, or one at an end)"
    if not eq:
        return f"{shorten(name, 30)!r} has no '=SIZE'"
    if name not in DIMS:
        if not name:
            return f"'={shorten(size, 20)}' names no dimension"
        return f"{shorten(name, 30)!r} is not a dimension{did_you_mean(name, DIMS)}"
    if name in seen:
        return f"{name} is given twice"
    if not size:
        return f"{name} has no size"
    if not (size.isascii() and size.isdigit()):
        return f"{name}'s size {shorten(size, 20)!r} is not a whole number in digits 0-9"
    if len(size) > 7 or int(size) > MAX_MESH_SIZE:
        return f"{name}={shorten(size, 20)} is over {MAX_MESH_SIZE:,}, more ranks than any job has"
    if int(size) < 1:
        return f"{name}={size}: a size is at least 1 (1, or {name} left out: not split)"
    return None


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
class MLflowConfig:
    """log.mlflow: the run in an MLflow tracking server (rank 0 alone talks to it, off the
    training thread: a server that is down or slow never costs the run; docs/training.md,
    "Tracking"). Credentials come from the environment only: MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD."""

    uri: str | None = None
    """The tracking server, http://HOST:PORT or https://...; `env`: $MLFLOW_TRACKING_URI (what
    a Kubernetes Secret or compose sets). null: no MLflow."""
    experiment: str | None = None
    """The MLflow experiment (created if absent). null: $MLFLOW_EXPERIMENT_NAME, else `name`."""
    run_name: str | None = None
    """The MLflow run's name. null: the run folder's name."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Tags of your own beside the run's facts, e.g. log.mlflow.tags.team=vision."""
    log_weights: bool = False
    """Also upload final/model.safetensors as an artifact at the end (config.yaml, summary.json
    and the report's PNGs always are)."""
    flush_s: float = 30.0
    """At the end, wait at most this long for the server to take what is still queued (5 s at
    most after a stop or an error); then one warning line says what was not sent
    (metrics.jsonl has it all)."""

    def __post_init__(self) -> None:
        check_fields(self, "log.mlflow.")
        if self.uri is not None and self.uri != "env":
            check_tracking_uri("log.mlflow.uri", self.uri)


TRACKING_SCHEMES = ("http", "https")
"""What log.mlflow.uri may be: a tracking server (a file or database store is served first)."""


def check_tracking_uri(key: str, uri: str) -> None:
    """A tracking server's URI: http(s)://HOST[:PORT] with a host, a port in 1-65535 and no
    password (config.yaml would keep it), without a network; one line naming `key` and the fix.
    tracking.mlflow_uri applies it to $MLFLOW_TRACKING_URI too."""
    shown = shorten(redact(uri))
    form = "give the tracking server as http://HOST:PORT or https://HOST"
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port
    except ValueError as e:  # an unclosed '[', a port that is not a number or past 65535
        raise ConfigError(f"{key}={shown!r} is not a URL ({_port_problem(e)}): {form}") from None
    if parts.scheme not in TRACKING_SCHEMES or not parts.netloc:
        scheme = f"scheme '{shorten(parts.scheme, 20)}'" if parts.scheme else "no scheme"
        if not parts.scheme or (not parts.netloc and parts.path[:1].isdigit()):  # host:port
            scheme += f" (did you mean http://{shown}?)"
        raise ConfigError(
            f"{key}={shown!r} has {scheme}: {form} (a file or database store: serve it with "
            "`mlflow server --backend-store-uri URI` and point the trainer at that)"
        )
    if not parts.hostname or any(not c.isprintable() or c.isspace() for c in uri):
        what = "no host" if not parts.hostname else "a space or control character"
        raise ConfigError(f"{key}={shown!r} has {what}: {form}")
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ConfigError(f"{key}={shown!r}: the port is empty or 0: {form} (PORT 1-65535)")
    if parts.password is not None and key == "log.mlflow.uri":
        raise ConfigError(
            "log.mlflow.uri holds a password, which config.yaml and the run's params would keep: "
            "drop it from the URI and export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        )


def _port_problem(e: ValueError) -> str:
    """urllib's reason a URL does not split, in a line's words."""
    text = str(e)
    if "Port out of range" in text:
        return "its port is past 65535"
    if "Port could not be cast" in text:
        return "its port is not a number"
    if "IPv6" in text:
        return "an IPv6 address opened with '[' and not closed with ']'"
    return shorten(text)


@dataclass(kw_only=True)
class WandbConfig:
    """log.wandb: the run in Weights & Biases (pip install 'repro-trainer[wandb]'), rank 0 alone,
    off the training thread. WANDB_API_KEY comes from the environment."""

    mode: str = "off"
    """off | offline (the run under <run_dir>/tracking/wandb, for `wandb sync` to upload later)
    | online."""
    project: str | None = None
    """The W&B project. null: $WANDB_PROJECT, else `name`."""
    entity: str | None = None
    """The W&B team or user. null: $WANDB_ENTITY, else your default entity."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Tags of your own beside the run's facts (each becomes a `key=value` W&B tag)."""
    flush_s: float = 30.0
    """At the end, wait at most this long for W&B to take what is still queued."""

    def __post_init__(self) -> None:
        check_fields(self, "log.wandb.")
        check_choice("log.wandb.mode", self.mode, ("off", "offline", "online"))


@dataclass(kw_only=True)
class LogConfig:
    """Metrics records, console progress, TensorBoard and experiment tracking."""

    every_steps: int = 10
    """Write a metrics.jsonl record (and a console line) every N optimizer steps."""
    progress: str = "auto"
    """auto (a bar on a TTY, plain lines otherwise) | bar | plain | none."""
    tensorboard: bool = True
    """Also write TensorBoard event files to <run_dir>/tb (skipped, with a note, if the
    tensorboard package is not installed: pip install 'repro-trainer[tensorboard]')."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        check_fields(self, "log.")
        check_choice("log.progress", self.progress, ("auto", "bar", "plain", "none"))


@dataclass(kw_only=True)
class CkptConfig:
    """Checkpoints: where, how often, how many, and what to resume or start from."""

    dir: str | None = None
    """Where checkpoints go (default: <run_dir>/checkpoints): a step-<N> folder per save."""
    every_steps: int = 0
    """Save every N optimizer steps (0: off)."""
    every_epochs: int = 1
    """Save at the end of every N epochs (0: off). The last step and SIGTERM always save."""
    every_minutes: float = 30.0
    """Also save when this many minutes of wall time passed since the last save (or the start),
    however long an epoch is (0: off). Decided by rank 0 at a log window (log.every_steps), so
    every rank saves at the same step."""
    keep_last: int = 3
    """Keep the newest N checkpoints; older ones are deleted after a successful save."""
    async_save: bool = True
    """Scheduled saves (every_steps, every_epochs) stall training only for a host copy of the
    state (under fsdp, each rank's shards); it is written, checksummed and renamed into place in
    the background, one save at a time. Signal and final saves are always written in place.
    false: every save blocks until it is on disk."""
    resume: str = "auto"
    """auto (newest checkpoint in `dir` that verifies) | never | PATH (a checkpoint or run dir)."""
    init_weights: str | None = None
    """Start from these weights when not resuming (a resume continues its own run): a run or
    checkpoint dir, .safetensors/.pt/.pth/.bin (`module.`/`_orig_mod.` prefixes stripped, any
    saving device), a sharded `*.index.json`, or a Hugging Face model folder. Weights only: the
    optimizer and loop start fresh (docs/finetuning.md)."""
    init_convert: str = "auto"
    """auto (a Hugging Face GPT-2 layout into model.name=gpt is converted) | none | hf_gpt2."""
    init_rename: dict[str, str] = field(default_factory=dict)
    """Key renames {REGEX: REPLACEMENT}, each applied to every source key in turn (after the
    conversion; re.sub), e.g. ckpt.init_rename='{^encoder\\.: backbone.}'. Each regex must
    compile and each replacement refer only to groups its regex has (\\1, \\g<name>)."""
    init_exclude: str = ""
    """Comma-separated glob patterns of (renamed) keys not to load, e.g. 'fc.*' for a new head:
    the model's tensors they match keep their fresh initialisation, even under init_strict."""
    init_strict: bool = True
    """Every model tensor (bar the excluded) loaded, nothing left over, every shape equal. false:
    load what fits and print one table (loaded / missing / unexpected / shape-mismatched)."""

    def __post_init__(self) -> None:
        check_fields(self, "ckpt.")
        check_choice("ckpt.init_convert", self.init_convert, ("auto", "none", "hf_gpt2"))
        for pattern, replacement in self.init_rename.items():
            check_rename(pattern, replacement)


RENAME_FORM = SAMPLES["ckpt.init_rename"]


def check_rename(pattern: str, replacement: Any) -> None:
    """One ckpt.init_rename rule, before any weights are read: a regex that compiles, and a
    replacement (text) whose group references (\\1, \\g<name>) the regex has and whose escapes
    re.sub knows; one line naming the rule and the fix. (Whether it matches a key, and what it
    renames to: checkpoint.init, against the weights.)"""
    shown = shorten(str(pattern), 40)
    if not isinstance(replacement, str):
        raise UsageError(
            f"ckpt.init_rename: the replacement of '{shown}' is {_kind(replacement)}, not text: "
            f"map each REGEX to a REPLACEMENT string, e.g. {RENAME_FORM}"
        )
    if not pattern:
        raise UsageError(
            "ckpt.init_rename: an empty regex matches between every two characters of every "
            f"key: give the part of the names to replace, e.g. {RENAME_FORM}"
        )
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise UsageError(
            f"ckpt.init_rename: '{shown}' is not a regex ({shorten(str(e))}): fix it, e.g. "
            f"{RENAME_FORM}"
        ) from None
    try:
        compiled.sub(replacement, "")  # the template is parsed against the regex's groups
    except (re.error, IndexError) as e:
        raise UsageError(
            f"ckpt.init_rename: the replacement '{shorten(replacement, 40)}' of '{shown}' "
            f"{_template_problem(e, compiled)}"
        ) from None


def _template_problem(e: Exception, compiled: re.Pattern) -> str:
    """Why a replacement does not fit its regex, and the fix."""
    groups = compiled.groups
    has = f"the regex has {groups} group{'s' if groups != 1 else ''}" + (
        f" ({', '.join(compiled.groupindex)} named)" if compiled.groupindex else ""
    )
    text = str(e).split(" at position")[0]
    if "invalid group reference" in text or "unknown group name" in text:
        fix = (
            "add a group (...) to the regex"
            if not groups
            else "use \\1" + (f" to \\{groups}" if groups > 1 else "")
        )
        return f"refers to a group it lacks ({text}; {has}): {fix}"
    if "bad escape" in text:
        return (
            f"has a {text}: a replacement knows \\1, \\g<name>, \\n and \\t; write a "
            "literal backslash as \\\\"
        )
    return (
        f"is not a replacement for it ({shorten(text)}; {has}): write a group as \\1 or \\g<name>"
    )


@dataclass(kw_only=True)
class ReproConfig:
    """Reproducibility: deterministic kernels, and the same bits on any world size."""

    deterministic: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms, cuDNN deterministic
    and no benchmark, CUBLAS_WORKSPACE_CONFIG). Slower on GPU; CPU runs are bitwise anyway."""
    world_invariant: bool = False
    """The same bits on every world size dividing repro.shards: each global batch is cut into
    that many fixed shards, each rank computes its shards' gradients one by one, and all shard
    gradients are added in one fixed tree (docs/training.md: how, and what it costs). Strategy
    none or ddp; with dist.device=cuda also set repro.deterministic=true."""
    shards: int = 8
    """Shards per global batch under repro.world_invariant: any count; the world sizes that
    divide it give the same bits (1, 2, 4 or 8 ranks for 8; 1, 2, 3, 4, 6 or 12 for 12, for
    an elastic job that may lose a node of 3). Set it to the smallest count every world size
    the run will use divides: each rank computes shards / world of them, and a small model
    pays per shard (the digits MLP's throughput falls with every doubling; docs/training.md)."""


@dataclass(kw_only=True)
class Config:
    name: str = DEFAULT_PRESET
    """Run name: runs go to runs/<name>/."""
    run_dir: str | None = None
    """Where config.yaml, metrics.jsonl, checkpoints/, summary.json and final/ are written.
    null: a new folder runs/<name>/<YYYYmmdd-HHMMSS> for each `trainer train` (`--resume`
    continues the newest); under trainer-launch (compose, Kubernetes) runs/<name>, so a restarted
    pod resumes. A path: that folder, resumed on its own when it holds checkpoints."""
    seed: int = 0
    """Seeds model init and the data order; same seed + same global batch = same numbers."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
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

        check_fields(self, "")
        registry.check("data.name", self.data.name)
        registry.check("model.name", self.model.name)
        registry.check("task.name", self.task.name)
        k = self.repro.shards
        if k not in RANGES["repro.shards"]:
            raise ConfigError(
                f"repro.shards: must be {RANGES['repro.shards']} (the fixed shards of each global "
                f"batch), got {k}; e.g. {example('repro.shards')}"
            )


@dataclass(frozen=True)
class Field:
    """One field of the schema, found by walk()."""

    key: str
    """Its dotted key, e.g. optim.lr."""
    type: Any
    """Its type hint, resolved (a section's is its dataclass)."""
    value: Any
    """Its value in the walked config (its default when walking a class)."""
    section: bool
    """A nested section of keys (e.g. optim), not a value."""


def walk(node: Any = None, prefix: str = "", *, nested: bool = True) -> Iterator[Field]:
    """The fields of a schema dataclass or config instance (default: the Config class), each
    section followed by its own fields (unless nested=False), in declaration order."""
    node = Config if node is None else node
    cls = node if isinstance(node, type) else type(node)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not isinstance(node, type):
            value = getattr(node, f.name)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        t = hints[f.name]
        section = dataclasses.is_dataclass(t)
        yield Field(f"{prefix}{f.name}", t, value, section)
        if section and nested:
            yield from walk(value, f"{prefix}{f.name}.")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=1)
def fields() -> tuple[Field, ...]:
    """Every field of the schema with its default (sections too), walked once."""
    return tuple(walk())


@functools.lru_cache(maxsize=1)
def defaults() -> dict[str, Any]:
    """Dotted key -> default value, for every field of the schema."""
    return {f.key: f.value for f in fields()}


# ---------------------------------------------------------------------------------------------
# The fields against ranges.py's tables: the checks every section's __post_init__ runs, and the
# hints an error shows (a key's range, a value the schema accepts).


def _number_text(value) -> str:
    """repr of a number or a list of them, short: Python refuses str() of an int over 4,300
    digits, and a line should not hold one."""
    try:
        return shorten(repr(value))
    except ValueError:  # int too long for str()
        return "an integer of more than 4,300 digits"


def example(key: str) -> str:
    """`key=<its default>`: a value the schema accepts, to show in an error (a sample value for
    the keys whose default is empty: ranges.SAMPLES)."""
    if key in SAMPLES:
        return SAMPLES[key]
    node = defaults().get(key)
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
    items = " for each item" if isinstance(defaults().get(key), list) else ""
    return f" (needs a number {RANGES[key]}{items}, e.g. {example(key)})"


def check_fields(obj: Any, prefix: str) -> None:
    """Check the direct numeric and string fields of one schema dataclass against the tables."""
    for f in walk(obj, prefix, nested=False):
        key, value = f.key, f.value
        if isinstance(value, str) and key in NONEMPTY and not value.strip():
            raise UsageError(f"{key}: must not be empty; e.g. {example(key)}")
        if isinstance(value, str) and key in PATHS and key != "name":
            storage.check_path(key, value, buckets=key in BUCKET_PATHS)
        if isinstance(value, str) and key in PATHS and (problem := path_problem(value)):
            what = "the run's folder name (runs/<name>/)" if key == "name" else "a path"
            raise UsageError(f"{key}: {what} {problem}")
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or key not in RANGES:
                continue
            if v not in RANGES[key]:
                each = " for each item" if isinstance(value, list) else ""
                shown = _number_text(value if isinstance(value, list) else v)
                raise UsageError(
                    f"{key}: must be {RANGES[key]}{each}, got {shown}; e.g. {example(key)}"
                )
