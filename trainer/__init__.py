"""A reproducible, torchrun-compatible PyTorch training stack.

Importing this package does no work: no I/O, no environment reads, no torch import.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "fit": "trainer.script:fit",
    "Task": "trainer.tasks:Task",
    "DataSpec": "trainer.data:DataSpec",
    "ArrayDataset": "trainer.data:ArrayDataset",
    "UsageError": "trainer.errors:UsageError",
}
"""The public names, imported on first use (`import trainer` stays free of torch)."""

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    import importlib

    module, _, attr = _PUBLIC[name].partition(":")
    return getattr(importlib.import_module(module), attr)
