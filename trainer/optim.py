"""Optimizers and learning-rate schedules. The lr is a pure function of the optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer import params as _params
from trainer import registry
from trainer.config import OptimConfig, SchedConfig
from trainer.errors import UsageError


def build(cfg: OptimConfig, model: torch.nn.Module, whole=None) -> torch.optim.Optimizer:
    """The optimizer of a (wrapped) model: its trainable parameters in optim.groups' groups
    (params.param_groups), by optim.name: a built-in or a plug-in factory. `whole`: the whole
    model's trainable names, where `model` is a pipeline stage's part of it."""
    return build_optimizer(cfg, _params.param_groups(cfg, model.named_parameters(), whole))


def build_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    """optim.name's optimizer over `params` (parameters, or parameter-group dicts)."""
    if ":" in cfg.name:
        return _plugin(cfg, params)
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    params = list(params)
    fused = uses_fused(cfg.fused, params)
    if fused:
        _check_fusable(cls.__name__, params)
    # None, not False, where unfused: torch's default, and the state_dict it always had.
    return cls(
        params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
        fused=fused or None,
    )  # fmt: skip


def _check_fusable(name: str, params: list) -> None:
    """optim.fused=true on parameters torch has no fused kernel for: one line now, where torch
    would raise at the first step (its check runs there, after the whole build)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for p in _tensors(params):
        if p.device.type not in devices or not p.is_floating_point():
            raise UsageError(
                f"optim.fused=true: torch has no fused {name} for a {p.dtype} parameter on "
                f"{p.device.type} (it has one for floating-point parameters on "
                f"{', '.join(devices)}): set optim.fused=null (fused where every parameter is "
                "on a GPU)"
            )


def uses_fused(choice: bool | None, params: list) -> bool:
    """Whether Adam/AdamW runs its fused kernel: optim.fused's choice, or (null) where every
    parameter is on a GPU (the parameters of a run on the CPU keep torch's foreach default,
    and the bits every CPU test and checkpoint holds)."""
    if choice is not None:
        return choice
    tensors = _tensors(params)
    return bool(tensors) and all(p.device.type == "cuda" for p in tensors)


def _plugin(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    """optim.name=package.module:factory, called as factory(params, <the optim.* keys its
    signature names: lr, weight_decay, betas, momentum, nesterov>, **optim.kwargs); it returns a
    torch.optim.Optimizer over exactly the parameters it was given, each group with its lr (the
    schedule sets it), whose state_dict the checkpoints save and a resume loads.

    A broken contract (the wrong thing returned, parameters left out or added) is one line
    naming the plug-in; a TrainerError it raises is its own line; anything else it raises is a
    bug in it and keeps its traceback, after one line naming the plug-in."""
    fn = registry.factory("optim.name", cfg.name)
    params = list(params)
    offered = {
        "params": params,
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "betas": tuple(cfg.betas),
        "momentum": cfg.momentum,
        "nesterov": cfg.nesterov,
    }
    with registry.plugin_bug(f"optim.name={cfg.name}, the optimizer plug-in"):
        optimizer = registry.call_with("optim.name", cfg.name, fn, offered, dict(cfg.kwargs))
    _check_plugin(cfg.name, optimizer, params)
    return optimizer


def _check_plugin(name: str, optimizer, params: list) -> None:
    """What an optimizer plug-in must return (see _plugin), or one line naming what it broke."""
    head = f"optim.name: '{name}' returned"
    if isinstance(optimizer, type):
        raise UsageError(
            f"{head} the class {optimizer.__name__}, not an optimizer: return an instance built "
            f"over the parameters it is given (e.g. return {optimizer.__name__}(params, lr=lr))"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        what = (
            "None (is a `return` missing?)"
            if optimizer is None
            else f"a {type(optimizer).__name__}"
        )
        raise UsageError(
            f"{head} {what}, not a torch.optim.Optimizer: return one (its state_dict is what "
            "checkpoints save)"
        )
    given = {id(p) for p in _tensors(params)}
    held = [p for g in optimizer.param_groups for p in g.get("params", ())]
    missing = len(given - {id(p) for p in held})
    foreign = len([p for p in held if id(p) not in given])
    if missing or foreign:
        what = (
            f"leaves out {missing} of the {len(given)} parameters it was given"
            if missing
            else f"holds {foreign} tensor(s) it was not given"
        )
        raise UsageError(
            f"{head} an optimizer that {what}: build it over `params` (the parameter groups "
            "the trainer passes: what trains, in optim.groups' groups)"
        )
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, bool) or not isinstance(lr, (int, float, torch.Tensor)):
            raise UsageError(
                f"{head} an optimizer whose group {i} has no numeric 'lr' ({lr!r}): the "
                "schedule sets each group's lr: give the optimizer an lr default"
            )


def _tensors(params: list) -> list:
    """The parameters of a list of parameters or of parameter-group dicts."""
    out = []
    for p in params:
        out += list(p["params"]) if isinstance(p, dict) else [p]
    return out


@dataclass(frozen=True)
class Schedule:
    """lr multiplier at a step: linear warm-up, then none | step | cosine. Picklable (resumable)."""

    name: str
    total_steps: int
    steps_per_epoch: int
    warmup_steps: int = 0
    step_size_epochs: int = 1
    gamma: float = 0.1
    min_lr_ratio: float = 0.0
    pct_start: float = 0.3

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "step":
            return self.gamma ** (step // (self.step_size_epochs * self.steps_per_epoch))
        if self.name == "onecycle":  # torch's OneCycleLR shape, as a pure function of the step
            rise = max(1, round(self.pct_start * self.total_steps))
            if step < rise:
                return 1 / 25 + (1 - 1 / 25) * step / rise
            progress = min(1.0, (step - rise) / max(1, self.total_steps - rise))
            return 1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.name == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
                1 + math.cos(math.pi * progress)
            )
        return 1.0


def build_scheduler(cfg: SchedConfig, optimizer, steps_per_epoch: int, total_steps: int):
    schedule = Schedule(
        name=cfg.name,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        warmup_steps=cfg.warmup_steps,
        step_size_epochs=cfg.step_size_epochs,
        gamma=cfg.gamma,
        min_lr_ratio=cfg.min_lr_ratio,
        pct_start=cfg.pct_start,
    )
    return ScheduleLR(optimizer, schedule)


class ScheduleLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR of a Schedule whose step() sets what LambdaLR's sets, base lr x schedule(step)
    on each group, the same fields and values, in one call: torch's step runs a dozen Python
    calls (its order checks, a context manager, two list copies), ~1% of a small model's step,
    all of it run cold after the step's kernels. The first steps, an explicit epoch and tensor
    lrs (filled in place) take torch's own step; the state dict is LambdaLR's."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule) -> None:
        super().__init__(optimizer, schedule)
        self._plain = self._float_lrs()

    def _float_lrs(self) -> bool:
        groups = self.optimizer.param_groups
        return all(type(v) is float for v in [*self.base_lrs, *(g["lr"] for g in groups)])

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or self._step_count <= 1 or not self._plain:
            super().step(epoch)
            return
        self._step_count += 1
        self.last_epoch += 1
        at = self.last_epoch
        lrs = [base * fn(at) for fn, base in zip(self.lr_lambdas, self.base_lrs, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_plain", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._plain = self._float_lrs()  # the checkpoint's base lrs
