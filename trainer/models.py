"""Model factories. Built-ins and `package.module:factory` plug-ins are called the same way.

A factory receives, by keyword and only if its signature names them: in_shape, in_channels,
num_classes (from the dataset unless model.* sets them), hidden, dropout, activation; plus
everything in model.kwargs.
"""

from __future__ import annotations

import inspect

from torch import nn

from trainer import registry
from trainer.config import ModelConfig
from trainer.errors import UsageError

_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def mlp(
    in_shape: tuple[int, ...],
    num_classes: int,
    hidden=(256, 128),
    dropout: float = 0.0,
    activation: str = "relu",
) -> nn.Module:
    """Flatten, then Linear+activation(+dropout) per hidden width, then a Linear head."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = 1
    for d in in_shape:
        width *= d
    for h in hidden:
        layers += [nn.Linear(width, h), _ACTIVATIONS[activation]()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def lenet(in_shape: tuple[int, ...], num_classes: int, activation: str = "sigmoid") -> nn.Module:
    """d2l's LeNet-5: conv(5, pad 2) -> pool -> conv(5) -> pool -> 120 -> 84 -> classes.

    At 28x28 (MNIST, Fashion-MNIST) this is exactly d2l's network. Inputs under 20 px (8x8
    digits) skip the first pooling, so the second convolution still sees a map larger than its
    kernel: 8x8 -> 8x8 -> 4x4 -> 2x2 instead of collapsing to nothing.
    """
    c, h, w = in_shape
    act = _ACTIVATIONS[activation]
    pool1 = min(h, w) >= 20
    h1, w1 = (h // 2, w // 2) if pool1 else (h, w)
    h2, w2 = (h1 - 4) // 2, (w1 - 4) // 2
    if h2 < 1 or w2 < 1:
        raise UsageError(f"model.name=lenet needs inputs of at least 6x6 pixels, got {h}x{w}")
    return nn.Sequential(
        nn.Conv2d(c, 6, kernel_size=5, padding=2),
        act(),  # (6, h, w)
        nn.AvgPool2d(2, 2) if pool1 else nn.Identity(),  # (6, h1, w1)
        nn.Conv2d(6, 16, kernel_size=5),
        act(),
        nn.AvgPool2d(2, 2),  # (16, h2, w2)
        nn.Flatten(),
        nn.Linear(16 * h2 * w2, 120),
        act(),
        nn.Linear(120, 84),
        act(),
        nn.Linear(84, num_classes),
    )


def build(cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Instantiate model.name with the arguments its factory asks for."""
    factory = registry.resolve("model.name", cfg.name)
    channels = cfg.in_channels or in_shape[0]
    offered = {
        "in_shape": (channels, *in_shape[1:]),
        "in_channels": channels,
        "num_classes": cfg.num_classes or num_classes,
        "hidden": tuple(cfg.hidden),
        "dropout": cfg.dropout,
        "activation": cfg.activation,
    }
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in offered.items() if k in params}
    kwargs.update(cfg.kwargs)
    try:
        model = factory(**kwargs)
    except TypeError as e:
        raise UsageError(
            f"model.name: '{cfg.name}' rejected its arguments ({e}); adjust model.kwargs"
        ) from None
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model.name: '{cfg.name}' returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
