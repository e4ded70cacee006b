"""Checkpoints and exported weights: written under a temporary name, then renamed (atomic)."""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
from torch import nn

from trainer.strategy import unwrap


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    On any error the temporary directory is removed and `path` is left as it was.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        old = None
        if os.path.exists(path):
            old = os.path.join(parent, f".{os.path.basename(path)}.old-{os.getpid()}")
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU, contiguous, unshared tensors of the unwrapped model: no `module.`/`_orig_mod.` keys."""
    return {
        k: v.detach().to("cpu").contiguous().clone() for k, v in unwrap(model).state_dict().items()
    }


def save_weights(model: nn.Module, directory: str, metadata: dict[str, str] | None = None) -> str:
    """Write `directory/model.safetensors` atomically; loads with plain safetensors, no trainer."""
    from safetensors.torch import save_file

    with atomic_dir(directory) as tmp:
        save_file(
            plain_state_dict(model), os.path.join(tmp, "model.safetensors"), metadata=metadata
        )
    return os.path.join(directory, "model.safetensors")
