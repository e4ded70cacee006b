"""Model factories. Built-ins and `package.module:factory` plug-ins are called the same way.

A factory receives, by keyword and only if its signature names them: in_shape, in_channels,
num_classes (from the dataset unless model.* sets them), data (the DataSpec itself), hidden,
dropout, activation, layers, width, heads (model.gpt.*); plus everything in model.kwargs.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from trainer import registry
from trainer.config import ModelConfig
from trainer.errors import UsageError

_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid}
_NOT_LM = ("mlp", "lenet", "resnet18", "vgg11")  # built-ins that read features or images


def _image(in_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    if len(in_shape) != 3:
        raise UsageError(
            f"model.name={model} needs image inputs (channels, height, width), but the dataset's "
            f"samples have shape {tuple(in_shape)}: use model.name=mlp"
        )
    return in_shape


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


def lenet(
    in_shape: tuple[int, ...], num_classes: int, activation: str = "sigmoid", init: str = "torch"
) -> nn.Module:
    """d2l's LeNet-5: conv(5, pad 2) -> pool -> conv(5) -> pool -> 120 -> 84 -> classes.

    At 28x28 (MNIST, Fashion-MNIST) this is exactly d2l's network. Inputs under 20 px (8x8
    digits) skip the first pooling, so the second convolution still sees a map larger than its
    kernel: 8x8 -> 8x8 -> 4x4 -> 2x2 instead of collapsing to nothing.
    init: torch (PyTorch's default) | xavier (d2l's train_ch6: Xavier-uniform weights, which a
    sigmoid LeNet needs to train at d2l's lr 0.9; model.kwargs.init=xavier).
    """
    if init not in ("torch", "xavier"):
        raise UsageError(f"model.kwargs.init: '{init}' is not one of: torch, xavier")
    c, h, w = _image(in_shape, "lenet")
    act = _ACTIVATIONS[activation]
    pool1 = min(h, w) >= 20
    h1, w1 = (h // 2, w // 2) if pool1 else (h, w)
    h2, w2 = (h1 - 4) // 2, (w1 - 4) // 2
    if h2 < 1 or w2 < 1:
        raise UsageError(f"model.name=lenet needs inputs of at least 6x6 pixels, got {h}x{w}")
    net = nn.Sequential(
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
    if init == "xavier":
        for m in net.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)
    return net


def resnet18(in_shape: tuple[int, ...], num_classes: int, stem: str = "auto") -> nn.Module:
    """torchvision's ResNet-18 (weights=None: random init, nothing downloaded).

    stem: imagenet (7x7 stride-2 conv + max-pool, for ~224 px) | small (3x3 stride-1 conv, no
    max-pool: the CIFAR variant of He et al., so 28-32 px inputs keep their resolution until
    layer2) | auto (small up to 64 px). The first conv takes the dataset's channel count.
    """
    from torchvision.models import resnet18 as torchvision_resnet18

    if stem not in ("auto", "small", "imagenet"):
        raise UsageError(f"model.kwargs.stem: '{stem}' is not one of: auto, small, imagenet")
    c, h, w = _image(in_shape, "resnet18")
    if stem == "auto":
        stem = "small" if max(h, w) <= 64 else "imagenet"
    net = torchvision_resnet18(weights=None, num_classes=num_classes)
    if stem == "small":
        net.conv1 = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif c != 3:
        net.conv1 = nn.Conv2d(c, 64, kernel_size=7, stride=2, padding=3, bias=False)
    # The same init torchvision gives the conv it replaced.
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    return net


_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")  # configuration A


def vgg11(in_shape: tuple[int, ...], num_classes: int, dropout: float = 0.0) -> nn.Module:
    """VGG-11 with batch norm, for small images (CIFAR 32 px, MNIST 28 px, even 8 px).

    The feature layers are VGG's configuration A; a max-pool that would shrink the map below
    1 px is skipped (28 px: 14, 7, 3, 1, then no fifth pool). The classifier is sized for
    the 512 x 1 x 1 map of small inputs (512 -> 512 -> 512 -> classes) instead of ImageNet's
    25,088 -> 4,096 -> 4,096. Init as torchvision's VGG.
    """
    c, h, w = _image(in_shape, "vgg11")
    layers: list[nn.Module] = []
    for v in _VGG11:
        if v == "M":
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2, 2))
                h, w = h // 2, w // 2
            continue
        layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
        c = v
    net = nn.Sequential(
        *layers,  # (512, h, w)
        nn.Flatten(),
        nn.Linear(c * h * w, 512),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(512, 512),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(512, num_classes),
    )
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return net


def _check_fits_data(
    cfg: ModelConfig, in_shape: tuple[int, ...], num_classes: int, task: str | None
) -> None:
    """model.in_channels / model.num_classes against the dataset's, before a shape error deep in
    the first forward pass (or an out-of-range target in the loss) says it less clearly."""
    if cfg.in_channels and task != "lm" and in_shape and cfg.in_channels != in_shape[0]:
        raise UsageError(
            f"model.in_channels={cfg.in_channels}, but the dataset's samples have "
            f"{in_shape[0]} channel(s) (shape {tuple(in_shape)}): set model.in_channels="
            f"{in_shape[0]} or leave it unset (null: taken from the data)"
        )
    if not cfg.num_classes or task is None:
        return
    if task == "regression" and cfg.num_classes != num_classes:
        raise UsageError(
            f"model.num_classes={cfg.num_classes}, but the dataset's targets have {num_classes} "
            f"value(s) per sample: set model.num_classes={num_classes} or leave it unset"
        )
    if task != "regression" and cfg.num_classes < num_classes:
        what = "a vocabulary of" if task == "lm" else "classes 0 to"
        top = num_classes if task == "lm" else num_classes - 1
        raise UsageError(
            f"model.num_classes={cfg.num_classes} outputs cannot score the dataset's {what} "
            f"{top}: set model.num_classes={num_classes} (or more), or leave it unset"
        )


def build(
    cfg: ModelConfig,
    in_shape: tuple[int, ...],
    num_classes: int,
    task: str | None = None,
    *,
    data=None,
    factory=None,
) -> nn.Module:
    """Instantiate model.name (or `factory`, trainer.fit's) with the arguments its factory asks
    for (checked against the dataset's task, when given); `data` is the DataSpec, offered to
    factories that name it."""
    if task == "lm" and cfg.name in _NOT_LM:
        raise UsageError(
            f"model.name={cfg.name} cannot read data.name=text's byte tokens: use model.name=gpt "
            "(or a plug-in factory that takes token ids)"
        )
    if cfg.name == "gpt" and task not in (None, "lm"):
        raise UsageError(
            f"model.name=gpt is a language model, but this dataset's task is {task}: use "
            "data.name=text, or another model"
        )
    in_shape = tuple(in_shape)
    _check_fits_data(cfg, in_shape, num_classes, task)
    if factory is None:
        factory = registry.factory("model.name", cfg.name)
    channels = cfg.in_channels or (in_shape[0] if in_shape else None)
    offered = {
        "in_shape": (channels, *in_shape[1:]) if in_shape else in_shape,
        "in_channels": channels,
        "num_classes": cfg.num_classes or num_classes,
        "data": data,
        "hidden": tuple(cfg.hidden),
        "dropout": cfg.dropout,
        "activation": cfg.activation,
    }
    if cfg.name == "gpt":  # not to plug-ins that happen to name a parameter `layers`
        offered.update(dataclasses.asdict(cfg.gpt))
    model = registry.call_with("model.name", cfg.name, factory, offered, cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model.name: '{cfg.name}' returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model
