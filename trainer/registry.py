"""Names for datasets, models and tasks, resolved lazily to factories (or, for tasks, objects).

A built-in name is just an alias for an import path, so user plug-ins (`package.module:factory`)
and built-ins go through the same code. This module imports nothing heavy, so config
validation and `trainer --help` stay fast.
"""

import contextlib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping

from trainer.errors import TrainerError, UsageError, check_choice, first_line, shorten

DATASETS: dict[str, str] = {
    "digits": "trainer.datasets.tabular:digits",
    "diabetes": "trainer.datasets.tabular:diabetes",
    "mnist": "trainer.datasets.vision:mnist",
    "fashion_mnist": "trainer.datasets.vision:fashion_mnist",
    "cifar10": "trainer.datasets.vision:cifar10",
    "imagefolder": "trainer.datasets.folder:imagefolder",
    "synthetic": "trainer.datasets.synthetic:synthetic",
    "text": "trainer.datasets.text:text",
    "tokens": "trainer.datasets.tokens:tokens",
    "arrays": "trainer.datasets.arrays:arrays",
    "shards": "trainer.datasets.shards:shards",
}

MODELS: dict[str, str] = {
    "mlp": "trainer.models:mlp",
    "lenet": "trainer.models:lenet",
    "resnet18": "trainer.models:resnet18",
    "vgg11": "trainer.models:vgg11",
    "gpt": "trainer.gpt:gpt",
}

TASKS: dict[str, str] = {
    "classification": "trainer.tasks:classification",
    "regression": "trainer.tasks:regression",
    "lm": "trainer.tasks:lm",
    "model_loss": "trainer.tasks:model_loss",
}

OPTIMIZERS: dict[str, str] = {  # built by trainer.optim itself; plug-ins come through here
    "sgd": "torch.optim:SGD",
    "adam": "torch.optim:Adam",
    "adamw": "torch.optim:AdamW",
}

_TABLES = {
    "data.name": DATASETS,
    "model.name": MODELS,
    "task.name": TASKS,
    "optim.name": OPTIMIZERS,
    "--tokenizer": {},
}


def check(key: str, name: str) -> None:
    """Validate a name without importing anything: a registered alias or `module:attr`."""
    if key == "task.name" and name == "auto":
        return
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise UsageError(f"{key}: '{name}' must look like 'package.module:factory'")
        return
    check_choice(key, name, sorted(_TABLES[key]) + (["auto"] if key == "task.name" else []))


def resolve(key: str, name: str, *, kind: str = ""):
    """The object a name stands for (`package.module:attr`, dots allowed in attr); a one-line
    UsageError when it cannot be imported, naming where the user's module failed."""
    check(key, name)
    target = _TABLES[key].get(name, name)
    module_name, _, attr = target.partition(":")
    if module_name == "<fit>":
        raise UsageError(
            f"{key}={name}: an object that a script handed to trainer.fit; only that script can "
            f"hand it over again: rerun it, or set {key} to an importable package.module:factory"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UsageError(
                f"{key}: cannot import '{module_name}' ({e}); is it installed or on PYTHONPATH?"
            ) from None
        raise UsageError(f"{key}: importing '{module_name}' failed: {_where(e)}") from None
    except Exception as e:  # the user's module raised while it was imported
        top = module_name.partition(".")[0]
        raise UsageError(f"{key}: importing '{module_name}' failed: {_where(e, top)}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UsageError(f"{key}: '{module_name}' has no {kind}'{attr}'")
    return obj


def factory(key: str, name: str) -> Callable:
    """The factory a name stands for; one-line UsageError when it cannot be imported."""
    found = resolve(key, name, kind="callable ")
    if not callable(found):
        module_name, _, attr = _TABLES[key].get(name, name).partition(":")
        raise UsageError(f"{key}: '{module_name}' has no callable '{attr}'")
    return found


def call_with(key: str, name: str, fn: Callable, offered: Mapping, kwargs: Mapping):
    """fn(**the `offered` arguments its signature names, then `kwargs`); arguments it rejects
    are one line naming the key."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): offer nothing
        params = {}
    args = {k: v for k, v in offered.items() if k in params}
    args.update(kwargs)
    kw = key.replace(".name", ".kwargs")
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        raise UsageError(f"{key}: '{name}' rejected its arguments ({e}); adjust {kw}") from None
    except ValueError:
        pass  # no signature to read: the call says
    try:
        return fn(**args)
    except TypeError as e:  # inside the factory: a value of the wrong type (model.kwargs?)
        top = (getattr(fn, "__module__", None) or "").partition(".")[0] or None
        raise UsageError(f"{key}: '{name}' failed: {_where(e, top)}; check {kw}") from None


def _where(e: BaseException, top: str | None = None) -> str:
    """'SyntaxError: invalid syntax (mypkg/data.py:3)': an exception and where it was raised:
    the deepest frame in the plug-in's own package `top` (not the library it called), else the
    deepest outside importlib."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{type(e).__name__}: {e.msg} ({e.filename}:{e.lineno})"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "importlib" not in f.filename]
    if top:
        own = [
            f
            for f in frames
            if f"{os.sep}{top}{os.sep}" in f.filename or os.path.basename(f.filename) == f"{top}.py"
        ]
        frames = own or frames
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {first_line(e)}{at}"


@contextlib.contextmanager
def plugin_bug(what: str) -> Iterator[None]:
    """Around a call into a plug-in's own code (`what` names it: 'Net.tensor_parallel_plan(2),
    the model's tensor-parallel plan'): an exception of its own (a bug: anything but a
    TrainerError, which is already one line) keeps its traceback, exit 1, as docs/extending.md
    says, with one line of ours first naming the plug-in and where it raised, so a long
    traceback out of torch still says whose code it was."""
    try:
        yield
    except TrainerError:
        raise
    except Exception as e:
        print(
            f"trainer: error: {what} raised {_raised_in(e)}: a bug in the plug-in, whose "
            "traceback follows",
            file=sys.stderr,
            flush=True,
        )
        raise


def _raised_in(e: BaseException) -> str:
    """'ValueError: boom (mypkg/model.py:12)': the deepest frame outside trainer and torch."""
    packages = [sys.modules.get(name) for name in (__package__ or "trainer", "torch")]
    ours = tuple(os.path.dirname(m.__file__) + os.sep for m in packages if m and m.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {shorten(first_line(e), 200)}{at}"
