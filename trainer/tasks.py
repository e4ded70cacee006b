"""The Task contract: what is learned from a batch, and how it is measured.

A task says how a batch reaches the model (`forward`), the loss as a SUM over this rank's loss
terms (`loss`) and how many terms that sum covers (`count`, or a fixed `terms_per_sample`), and
the evaluation metrics as (sum, count) pairs (`metrics`) that the trainer adds up over batches
and ranks before `summarize` turns them into numbers. Because every rank gives sums, the step
divides by the GLOBAL number of terms: the gradient is the one-process gradient of the whole
global batch on any world size, with any micro-batching (trainer/step.py).

The built-in tasks (classification, regression, lm) are instances of this contract, and so is
yours: `task.name=pkg.module:obj` (a Task, a Task subclass, or a factory returning one), or
`trainer.fit(config, task=...)`. docs/extending.md has a worked example.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trainer import batch as batches
from trainer import registry
from trainer.errors import UsageError, first_line, shorten

Pair = tuple[Any, Any]
"""(sum, count): a float or 0-dim tensor each."""


class Task:
    """Subclass it and define `loss` (and `metrics` for more than the loss).

    Every method receives this rank's slice of a batch, already on the run's device: a tensor,
    or a tuple, list or dict of tensors as your dataset's `take` returns it. A slice may hold 0
    samples (a rank's share of a tail batch smaller than the world): return a zero sum and a
    zero count then, as a sum over nothing does. `trainer train --dry-run` runs that batch.
    """

    name: str | None = None
    """Shown in the run's banner (None: the class's name)."""

    terms_per_sample: int | None = 1
    """Loss terms each sample contributes when that number is fixed (1; the sequence length of
    a language model): the step knows the global count without asking the other ranks. None:
    `count(batch)` says per batch (e.g. tokens that are not padding), and each step adds the
    ranks' counts in one small all-reduce before its backward pass."""

    tokens_per_sample: int | None = None
    """Tokens each sample holds, for a tokens/s rate beside samples/s (None: not reported)."""

    def forward(self, model: torch.nn.Module, batch) -> Any:
        """The model's output for `batch`: model(batch) for a tensor, model(batch[0]) for an
        (inputs, targets) tuple, model(**batch) for a dict."""
        if isinstance(batch, (tuple, list)):  # first: a Mapping check is a call into abc
            return model(batch[0])
        if isinstance(batch, Mapping):
            return model(**batch)
        return model(batch)

    def loss(self, output: Any, batch) -> torch.Tensor:
        """The SUM (not the mean) of this slice's loss terms: a 0-dim float tensor."""
        raise NotImplementedError(f"{type(self).__name__} must define loss(output, batch)")

    def count(self, batch) -> int:
        """How many loss terms `loss` summed over in this slice (default: samples x
        terms_per_sample)."""
        if self.terms_per_sample is None:
            raise NotImplementedError(
                f"{type(self).__name__}: terms_per_sample is None, so define count(batch)"
            )
        return batches.size(batch) * self.terms_per_sample

    def metrics(self, output: Any, batch) -> dict[str, Pair]:
        """Evaluation: {name: (sum, count)} over this slice; the trainer adds sums and counts
        over every batch and rank, then `summarize` divides. Default: the loss per term."""
        return {"loss": (self.loss(output, batch), self.count(batch))}

    def summarize(self, totals: dict[str, tuple[float, float]]) -> dict[str, float]:
        """The reported metrics from the totals: each sum / its count (NaN for no terms)."""
        return {name: _ratio(s, c) for name, (s, c) in totals.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _ratio(total: float, count: float) -> float:
    return total / count if count else math.nan


def _fp32(output: torch.Tensor) -> torch.Tensor:
    """The loss in fp32 whatever the compute dtype (FSDP's bf16 parameters give bf16 outputs);
    an fp32 output as it is (.float() on one is still a dispatched op)."""
    return output if output.dtype == torch.float32 else output.float()


def _target(batch):
    if isinstance(batch, (tuple, list)):  # first: a Mapping check is a call into abc
        return batch[1]
    return batch["y"] if isinstance(batch, Mapping) else batch[1]


class Classification(Task):
    """Cross-entropy over class logits (B, classes) against integer targets (B,); accuracy."""

    name = "classification"

    def loss(self, output, batch):
        return F.cross_entropy(_fp32(output), _target(batch), reduction="sum")

    def metrics(self, output, batch):
        y = _target(batch)
        return {"loss": (self.loss(output, batch), len(y)), "accuracy": _correct(output, y)}


def _correct(output: torch.Tensor, y: torch.Tensor) -> Pair:
    return (output.argmax(dim=-1) == y).sum(), y.numel()


class Regression(Task):
    """Squared error against float targets standardised by `target_scale`; MSE and MAE are
    reported in the target's own units."""

    name = "regression"

    def __init__(self, target_scale: float = 1.0):
        self.target_scale = target_scale

    def loss(self, output, batch):
        output, y = _fp32(output), _target(batch)
        return F.mse_loss(output, y.reshape(output.shape).to(output.dtype), reduction="sum")

    def metrics(self, output, batch):
        y = _target(batch)
        abs_error = (output - y.reshape(output.shape).to(output.dtype)).abs().sum()
        return {"loss": (self.loss(output, batch), len(y)), "mae": (abs_error, len(y))}

    def summarize(self, totals):
        out = super().summarize(totals)
        out["mse"] = out["loss"] * self.target_scale**2
        out["mae"] *= self.target_scale
        return out

    def __repr__(self) -> str:
        return f"Regression(target_scale={self.target_scale})"


class LanguageModel(Task):
    """Next-token prediction: logits (B, T, vocab) against the next tokens (B, T), a loss term
    per token. Reports perplexity, bits per token (per byte when the tokens are bytes) and
    next-token accuracy."""

    name = "lm"

    def __init__(self, seq_len: int, byte_tokens: bool = True):
        self.terms_per_sample = self.tokens_per_sample = seq_len
        self.byte_tokens = byte_tokens

    def loss(self, output, batch):
        out = output.float()
        y = _target(batch)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")

    def metrics(self, output, batch):
        y = _target(batch)
        return {"loss": (self.loss(output, batch), y.numel()), "accuracy": _correct(output, y)}

    def summarize(self, totals):
        loss, tokens = totals["loss"][0] / totals["loss"][1], totals["loss"][1]
        bits = "bits_per_byte" if self.byte_tokens else "bits_per_token"
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            bits: loss / math.log(2),
            "accuracy": totals["accuracy"][0] / tokens,
            "tokens": int(tokens),
        }

    def __repr__(self) -> str:
        return f"LanguageModel(seq_len={self.terms_per_sample}, byte_tokens={self.byte_tokens})"


class ModelLoss(Task):
    """A model that computes its own loss, the Hugging Face convention: `model(**batch).loss`
    (a dict batch; `model(*batch)` for a tuple), a MEAN over the slice.

    The step needs a sum, so this takes mean x samples, one term per sample. That is exact when
    every sample has the same number of loss terms (no padding, no ignored labels); otherwise a
    slice's mean weighs its tokens differently from the one-process mean over the whole batch,
    and the result moves with the world size and micro-batching. Exact again: a Task whose loss
    is the sum over tokens and whose count() is the number of tokens (docs/extending.md).
    """

    name = "model_loss"

    def forward(self, model, batch):
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (tuple, list)):
            return model(*batch)
        return model(batch)

    def loss(self, output, batch):
        mean = output["loss"] if isinstance(output, Mapping) else getattr(output, "loss", None)
        if mean is None and isinstance(output, (tuple, list)) and output:
            mean = output[0]
        if not isinstance(mean, torch.Tensor):
            raise UsageError(
                "task.name=model_loss: the model's output has no `loss` (as model(**batch).loss "
                "in Hugging Face models): pass the labels in the batch, or write a Task "
                "(docs/extending.md)"
            )
        n = batches.size(batch)
        if n == 0:  # a mean over nothing is NaN; a sum over nothing is 0 (with a graph)
            return mean.nan_to_num(0.0) * 0.0
        return mean.float() * n


def classification() -> Task:
    return Classification()


def regression(data) -> Task:
    return Regression(data.target_scale)


def lm(data) -> Task:
    byte_tokens = data.num_classes <= 256 and data.source.get("tokens", "bytes") == "bytes"
    return LanguageModel(seq_len=data.in_shape[0], byte_tokens=byte_tokens)


def model_loss() -> Task:
    return ModelLoss()


# --- building one from the config ---------------------------------------------------------------


def build(cfg, data, source=None) -> Task:
    """The task `task.name` names (auto: the dataset's own), made for `data` (a DataSpec); or
    `source`, trainer.fit's: a Task, or a Task subclass or factory."""
    if isinstance(source, Task):
        return checked_task(source)
    if source is not None:
        return from_factory(source, getattr(source, "__name__", repr(source)), data, cfg.kwargs)
    name = data.task if cfg.name == "auto" else cfg.name
    if not name:
        raise UsageError(
            "task.name=auto: the dataset names no task of its own (its DataSpec.task is None): "
            "set task.name to classification, regression, lm, model_loss or "
            "package.module:YourTask (docs/extending.md)"
        )
    obj = registry.resolve("task.name", name)
    if isinstance(obj, Task):
        if cfg.kwargs:
            raise UsageError(
                f"task.kwargs: task.name={name} is a Task object, which takes no arguments: "
                "name its class or a factory instead, or drop task.kwargs"
            )
        return checked_task(obj)
    return from_factory(obj, name, data, cfg.kwargs)


def from_factory(factory, name: str, data, kwargs: Mapping | None = None) -> Task:
    """`factory` (a Task subclass or a function returning a Task) called with the arguments it
    names (data, in_shape, num_classes, target_scale) plus `kwargs`."""
    if not callable(factory):
        raise UsageError(
            f"task.name: '{name}' is a {type(factory).__name__}, not a trainer.Task, a Task "
            "subclass or a factory returning one"
        )
    offered = {
        "data": data,
        "in_shape": data.in_shape,
        "num_classes": data.num_classes,
        "target_scale": data.target_scale,
    }
    task = registry.call_with("task.name", name, factory, offered, kwargs or {})
    if not isinstance(task, Task):
        raise UsageError(
            f"task.name: '{name}' returned {type(task).__name__}, not a trainer.Task: subclass "
            "trainer.Task and define loss(output, batch) (docs/extending.md)"
        )
    return checked_task(task)


def checked_task(task: Task) -> Task:
    """`task` if it keeps the contract's static parts: a loss, and a positive integer
    terms_per_sample or a count()."""
    if inspect.isabstract(type(task)) or type(task).loss is Task.loss:
        raise UsageError(
            f"task.name: {type(task).__name__} does not define loss(output, batch), the SUM of "
            "its loss terms (docs/extending.md)"
        )
    tps = task.terms_per_sample
    if tps is not None and (isinstance(tps, bool) or not isinstance(tps, int) or tps < 1):
        raise UsageError(
            f"task.name: {type(task).__name__}.terms_per_sample={tps!r}: set a positive integer, "
            "or None and define count(batch)"
        )
    if tps is None and type(task).count is Task.count:
        raise UsageError(
            f"task.name: {type(task).__name__}.terms_per_sample is None, so it must define "
            "count(batch), the number of loss terms in a slice"
        )
    if tps is not None and type(task).count is not Task.count:
        raise UsageError(
            f"task.name: {type(task).__name__} defines count(batch) but terms_per_sample={tps}: "
            "the step divides by samples x terms_per_sample and would ignore count(); set "
            "terms_per_sample = None to divide by count(), or drop count()"
        )
    return task


# --- running and checking a task ----------------------------------------------------------------

_DEVICE_MISMATCH = (
    "Expected all tensors to be on the same device",
    "found at least two devices",
    "is not on the expected device",
)


_DTYPE_MISMATCH = (
    "must have the same dtype",
    "should be the same",  # conv: "Input type (double) and bias type (float) should be the same"
    "mixed dtype",
    "does not match weight dtype",
    "expected scalar type",
    "to have one of the following scalar types",
)


def forward(task: Task, model: torch.nn.Module, batch) -> Any:
    """task.forward(model, batch); a batch or tensor on another device than the model's, or of
    another dtype, is one line naming the contract (the trainer moves every tensor of the batch
    to the run's device and leaves dtypes as the data gives them)."""
    try:
        return task.forward(model, batch)
    except (RuntimeError, ValueError) as e:
        text = str(e)
        device = any(m in text for m in _DEVICE_MISMATCH) or _devices_differ(text)
        if isinstance(e, RuntimeError) and device:
            raise UsageError(
                f"{type(task).__name__}.forward: tensors on different devices "
                f"({first_line(e)}): the trainer puts the batch and the model on the run's "
                "device (dist.device); make new tensors on the batch's device (x.new_zeros, "
                "torch.zeros(..., device=x.device)) and do not move the batch yourself"
            ) from None
        if any(m in text for m in _DTYPE_MISMATCH):
            raise dtype_mismatch(task, model, batch, e) from None
        raise


def _devices_differ(text: str) -> bool:
    """torch's conv says "Input type (X) and weight type (Y) should be the same" of dtypes and of
    devices alike: a device mismatch when one of X, Y is a CUDA tensor type and the other not."""
    found = re.search(r"Input type \((.*?)\) and \w+ type \((.*?)\)", text)
    return bool(found) and ("cuda" in found[1]) != ("cuda" in found[2])


def _dtypes(tensors) -> str:
    return ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})) or "none"


def dtype_mismatch(task: Task, model: torch.nn.Module, batch, e: BaseException) -> UsageError:
    """One line for a model and a batch of different dtypes (a float64 model, float64 inputs)."""
    params = _dtypes(model.parameters())
    inputs = _dtypes(t for t in batches.tensors(batch) if t.is_floating_point())
    return UsageError(
        f"{type(task).__name__}.forward: the batch and the model have different dtypes "
        f"(model parameters {params}, the batch's floating-point tensors {inputs}: "
        f"{shorten(first_line(e), 160)}): keep the model in float32 (no .double() or dtype=torch.float64; "
        "train.precision=bf16/fp16 computes in lower precision) and give float32 inputs "
        "(convert in your data factory, e.g. x.float())"
    )


# --- checking what a task returns ---------------------------------------------------------------


def checked_loss(task: Task, value) -> torch.Tensor:
    """The loss a task returned, if it is a 0-dim float tensor that depends on the model."""
    if (
        isinstance(value, torch.Tensor)
        and value.dim() == 0
        and value.is_floating_point()
        and (value.requires_grad or not torch.is_grad_enabled())
    ):
        return value  # the checks of every step, in one expression (the errors: below)
    who = f"{type(task).__name__}.loss"
    if not isinstance(value, torch.Tensor):
        raise UsageError(
            f"{who} returned {type(value).__name__}, not a tensor: return the SUM of the slice's "
            "loss terms as a 0-dim float tensor (e.g. F.cross_entropy(..., reduction='sum'))"
        )
    if value.dim() != 0:
        raise UsageError(
            f"{who} returned a tensor of shape {tuple(value.shape)}, not a scalar: return its "
            "SUM (.sum()) and the number of terms from count()"
        )
    if not value.is_floating_point():
        raise UsageError(f"{who} returned a {value.dtype} tensor: the loss must be a float sum")
    if torch.is_grad_enabled() and not value.requires_grad:
        raise UsageError(
            f"{who} returned a tensor that does not depend on the model's parameters (detached, "
            ".item() or computed under no_grad?): compute it from the model's output"
        )
    return value


def checked_count(task: Task, value) -> int:
    """A term count: a non-negative integer (or an integer 0-dim tensor)."""
    who = f"{type(task).__name__}.count"
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(
            f"{who} returned {_shown(value)}: return the number of loss terms in the slice as "
            "an int (e.g. int((labels != -100).sum()))"
        )
    if value < 0:
        raise UsageError(f"{who} returned {value}: a count of loss terms is 0 or more")
    return value


def no_terms(task: Task, step: int) -> UsageError:
    return UsageError(
        f"{type(task).__name__}.count: the global batch of step {step} has 0 loss terms over all "
        "ranks, so its loss has nothing to average: count the terms the loss sums over (every "
        "label masked? check the data)"
    )


def checked_metrics(task: Task, value) -> dict[str, Pair]:
    """{name: (sum, count)} with numbers or scalar tensors, counts 0 or more."""
    who = f"{type(task).__name__}.metrics"
    if not isinstance(value, Mapping) or not value:
        raise UsageError(
            f"{who} returned {_shown(value)}: return a dict {{name: (sum, count)}}, e.g. "
            "{'loss': (loss_sum, n), 'accuracy': (correct, n)}"
        )
    for name, pair in value.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"{who}: metric names must be non-empty strings, got {name!r}")
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise UsageError(
                f"{who}['{name}'] is {_shown(pair)}, not a (sum, count) pair: return sums and "
                f"counts (e.g. (correct, n) for an accuracy), which add up over batches and ranks"
            )
        for part, v in zip(("sum", "count"), pair, strict=True):
            scalar = isinstance(v, torch.Tensor) and v.dim() == 0
            if not (scalar or (isinstance(v, (int, float)) and not isinstance(v, bool))):
                raise UsageError(
                    f"{who}['{name}']: its {part} is {_shown(v)}, not a number or 0-dim tensor: "
                    "reduce it over the slice (.sum())"
                )
    return value


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}" if len(text) > 40 else text
