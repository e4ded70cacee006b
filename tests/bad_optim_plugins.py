"""Broken optimizer plug-ins (optim.name=tests.bad_optim_plugins:NAME), one mistake each, for
tests/test_bad_fields_wing.py.

The contract (docs/finetuning.md, trainer/optim.py `_plugin`): a factory called with the
parameter groups as `params` and the optim.* keys its signature names returns a
torch.optim.Optimizer over exactly those parameters, each group with an lr. `good` keeps it.
"""

from __future__ import annotations

import torch

from trainer.errors import UsageError


def good(params, lr):
    """The control: plain SGD over what it is given."""
    return torch.optim.SGD(params, lr=lr)


def returns_none(params, lr):
    torch.optim.SGD(params, lr=lr)  # built, but the return was forgotten


def returns_class(params, lr):
    return torch.optim.SGD


def returns_list(params, lr):
    return [torch.optim.SGD(params, lr=lr)]


def returns_scheduler(params, lr):
    return torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(params, lr=lr), lambda step: 1.0)


def returns_state_dict(params, lr):
    return torch.optim.SGD(params, lr=lr).state_dict()


def returns_function(params, lr):
    return good


def returns_generator(params, lr):
    yield torch.optim.SGD(params, lr=lr)


def over_other_tensors(params, lr):
    """An optimizer of tensors of its own: the model would never change."""
    return torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=lr)


def over_first_parameter(params, lr):
    """Only the first parameter: the rest would never train."""
    first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
    return torch.optim.SGD([first], lr=lr)


def over_extra_tensor(params, lr):
    return torch.optim.SGD([*list(params), torch.zeros(3, requires_grad=True)], lr=lr)


class NoLr(torch.optim.Optimizer):
    """An optimizer without an lr default: the schedule has no lr to set."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        return None


def no_lr(params):
    return NoLr(params)


def raises_usage_error(params, lr):
    raise UsageError("raises_usage_error: this optimizer needs optim.kwargs.beta2: set it")


def type_error_inside(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum="high")  # the plug-in's own bug


def needs_an_argument(params, lr, rho):
    return torch.optim.SGD(params, lr=lr)


def raises_runtime_error(params, lr):
    """A bug in the plug-in (not a contract breach): its traceback is kept."""
    raise RuntimeError("bad_optim_plugins: the optimizer's own bug")


NOT_CALLABLE = 5
