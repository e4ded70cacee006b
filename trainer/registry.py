"""Names for datasets and models, resolved lazily to factories.

A built-in name is just an alias for an import path, so user plug-ins (`package.module:factory`)
and built-ins go through the same code. This module imports nothing heavy, so config
validation and `trainer --help` stay fast.
"""

import importlib
from collections.abc import Callable

from trainer.errors import UsageError, check_choice

DATASETS: dict[str, str] = {
    "digits": "trainer.datasets.tabular:digits",
    "diabetes": "trainer.datasets.tabular:diabetes",
    "mnist": "trainer.datasets.vision:mnist",
    "fashion_mnist": "trainer.datasets.vision:fashion_mnist",
    "cifar10": "trainer.datasets.vision:cifar10",
    "imagefolder": "trainer.datasets.folder:imagefolder",
    "synthetic": "trainer.datasets.synthetic:synthetic",
    "text": "trainer.datasets.text:text",
}

MODELS: dict[str, str] = {
    "mlp": "trainer.models:mlp",
    "lenet": "trainer.models:lenet",
    "resnet18": "trainer.models:resnet18",
    "vgg11": "trainer.models:vgg11",
    "gpt": "trainer.gpt:gpt",
}

_TABLES = {"data.name": DATASETS, "model.name": MODELS}


def check(key: str, name: str) -> None:
    """Validate a name without importing anything: a registered alias or `module:attr`."""
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise UsageError(f"{key}: '{name}' must look like 'package.module:factory'")
        return
    check_choice(key, name, sorted(_TABLES[key]))


def factory(key: str, name: str) -> Callable:
    """The factory a name stands for; one-line UsageError when it cannot be imported."""
    check(key, name)
    target = _TABLES[key].get(name, name)
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(
            f"{key}: cannot import '{module_name}' ({e}); is it installed or on PYTHONPATH?"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{key}: '{module_name}' has no callable '{attr}'")
    return factory
