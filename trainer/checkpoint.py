"""Checkpoints: one directory per save, written under a temporary name and renamed (atomic).

    <ckpt.dir>/step-000000460/
        model.safetensors   unwrapped weights (no `module.`/`_orig_mod.`), CPU tensors
        optimizer.pt        optimizer state_dict
        state.pt            scheduler, grad scaler, every rank's RNG states
        meta.json           loop position, reason, world size, restart count, results, versions, time
        config.yaml         the resolved config
        MANIFEST.sha256     sha256 of every file above; written last, checked before loading

Everything loads with torch.load(weights_only=True): plain tensors, numbers, strings, lists,
dicts. A pickle asking for anything else (code) is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable

import torch
from torch import nn

from trainer.errors import UsageError
from trainer.strategy import unwrap

MANIFEST = "MANIFEST.sha256"
FILES = ("model.safetensors", "optimizer.pt", "state.pt", "meta.json", "config.yaml")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class CorruptCheckpoint(Exception):
    """A checkpoint that fails verification (missing, truncated or altered files)."""


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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- weights ---------------------------------------------------------------------------------


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU, contiguous, unshared tensors of the unwrapped model: no `module.`/`_orig_mod.` keys."""
    return {
        k: v.detach().to("cpu").contiguous().clone() for k, v in unwrap(model).state_dict().items()
    }


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove DataParallel/DDP (`module.`) and torch.compile (`_orig_mod.`) key prefixes."""
    out = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def save_weights(model: nn.Module, directory: str, metadata: dict[str, str] | None = None) -> str:
    """Write `directory/model.safetensors` atomically; loads with plain safetensors, no trainer."""
    from safetensors.torch import save_file

    with atomic_dir(directory) as tmp:
        save_file(
            plain_state_dict(model), os.path.join(tmp, "model.safetensors"), metadata=metadata
        )
    return os.path.join(directory, "model.safetensors")


def _torch_load(path: str):
    """torch.load restricted to tensors and plain containers; code-carrying pickles are refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError, RuntimeError from the zip reader, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"{path}: refused to load ({first}); only tensors and plain containers are accepted "
            "(weights_only=True): re-save the weights with torch.save(model.state_dict(), path)"
        ) from None


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """Weights from a checkpoint/run dir, .safetensors, or a .pt/.pth/.bin state_dict (any prefix).

    Tensors come back on the CPU whatever device saved them; load_state_dict then copies them
    to wherever the model lives (a GPU checkpoint loads on CPU or on another GPU index).
    """
    if os.path.isdir(path):
        found = latest_valid(path) or latest_valid(os.path.join(path, "checkpoints"))
        candidates = (
            [found, os.path.join(path, "final")] if found else [os.path.join(path, "final")]
        )
        for c in candidates:
            if c and os.path.isfile(os.path.join(c, "model.safetensors")):
                path = os.path.join(c, "model.safetensors")
                break
        else:
            raise UsageError(
                f"{path}: no verified checkpoint or final/model.safetensors inside: "
                "point at a checkpoint directory, a run directory or a weights file"
            )
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such weights file or directory")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(path, device="cpu")
        except (SafetensorError, OSError) as e:
            raise UsageError(f"{path}: not a readable safetensors file ({e})") from None
    else:
        state = _torch_load(path)
        for key in ("model", "state_dict", "model_state_dict"):  # common wrappers
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"{path}: does not hold a state_dict of tensors")
    return strip_prefixes(state)


def load_weights_into(model: nn.Module, path: str) -> None:
    """Load weights (any prefix, any device of origin) into the unwrapped model, strictly."""
    state = read_weights(path)
    target = unwrap(model)
    missing, unexpected = target.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UsageError(
            f"{path}: weights do not fit model (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}): check model.* matches the run that saved them"
        )


# --- checkpoints -----------------------------------------------------------------------------


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:09d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every finished checkpoint directory, newest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def verify(path: str) -> None:
    """Raise CorruptCheckpoint unless every file matches the manifest and none is missing."""
    manifest = os.path.join(path, MANIFEST)
    try:
        with open(manifest, encoding="utf-8") as f:
            lines = [line.split() for line in f if line.strip()]
    except OSError as e:
        raise CorruptCheckpoint(f"no readable {MANIFEST} ({e.strerror})") from None
    entries = {}
    for parts in lines:
        if len(parts) != 2:
            raise CorruptCheckpoint(f"malformed {MANIFEST}")
        entries[parts[1]] = parts[0]
    for name in FILES:
        if name not in entries:
            raise CorruptCheckpoint(f"{MANIFEST} does not list {name}")
    for name, digest in entries.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpoint(f"{name} is missing")
        if _sha256(file) != digest:
            raise CorruptCheckpoint(f"{name} does not match its sha256 (truncated or altered)")


def latest_valid(root: str, warn: Callable[[str], None] | None = None) -> str | None:
    """The newest checkpoint under root that verifies; corrupt newer ones are reported, skipped."""
    for _, path in list_checkpoints(root):
        try:
            verify(path)
            return path
        except CorruptCheckpoint as e:
            if warn:
                warn(f"checkpoint {path} is corrupt ({e}); falling back to an older one")
    return None


def resolve_resume(resume: str, root: str, warn: Callable[[str], None]) -> str | None:
    """The checkpoint to resume from for ckpt.resume (auto | never | PATH), or None."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_valid(root, warn)
    path = resume
    if not os.path.isdir(path):
        raise UsageError(f"ckpt.resume={path}: no such checkpoint directory (or use auto / never)")
    is_checkpoint = os.path.isfile(os.path.join(path, MANIFEST)) or _STEP_DIR.match(
        os.path.basename(os.path.normpath(path))
    )
    if not is_checkpoint:  # a run dir or a checkpoints folder
        candidate = latest_valid(path, warn) or latest_valid(
            os.path.join(path, "checkpoints"), warn
        )
        if candidate is None:
            raise UsageError(f"ckpt.resume={path}: holds no checkpoint that verifies")
        return candidate
    try:
        verify(path)
    except CorruptCheckpoint as e:
        raise UsageError(f"ckpt.resume={path}: corrupt checkpoint ({e}); pick another") from None
    return path


def _write_torch(obj, path: str) -> None:
    """torch.save through Python I/O: a full disk raises OSError ENOSPC, not a C++ enforce message."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def save(
    root: str,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    meta: dict,
    config_yaml: str,
) -> str:
    """Write a complete checkpoint for `step` atomically; returns its directory."""
    from safetensors.torch import save_file

    path = step_dir(root, step)
    with atomic_dir(path) as tmp:
        save_file(plain_state_dict(model), os.path.join(tmp, "model.safetensors"))
        _write_torch(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        _write_torch(extra, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(config_yaml)
        lines = [f"{_sha256(os.path.join(tmp, name))}  {name}\n" for name in FILES]
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            f.writelines(lines)
    return path


def load(path: str) -> dict:
    """Read a verified checkpoint: {'model', 'optimizer', 'extra', 'meta', 'config_yaml'}."""
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        with open(os.path.join(path, "config.yaml"), encoding="utf-8") as f:
            config_yaml = f.read()
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: unreadable checkpoint ({e})") from None
    return {
        "model": read_weights(os.path.join(path, "model.safetensors")),
        "optimizer": _torch_load(os.path.join(path, "optimizer.pt")),
        "extra": _torch_load(os.path.join(path, "state.pt")),
        "meta": meta,
        "config_yaml": config_yaml,
    }


def prune(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints and stale temporary dirs."""
    removed = []
    for _, path in list_checkpoints(root)[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_temporaries(root: str) -> None:
    """Clean up after a process killed mid-save.

    `.step-N.tmp-*` never became a checkpoint: delete it. `.step-N.old-*` is a complete one that
    was being replaced: put it back if the replacement never landed, else delete it.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in sorted(names):
        m = re.match(r"^\.(step-\d+)\.(tmp|old)-\d+$", name)
        if not m:
            continue
        path, final = os.path.join(root, name), os.path.join(root, m.group(1))
        if m.group(2) == "old" and not os.path.exists(final):
            os.rename(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)


def find_config(src: str) -> str | None:
    """The config.yaml that describes weights at `src` (checkpoint dir, run dir, or beside a file)."""
    folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    for candidate in (folder, os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))):
        path = os.path.join(candidate, "config.yaml")
        if os.path.isfile(path):
            return path
    return None


def export(src: str, out: str | None = None) -> str:
    """Plain safetensors from a run dir, checkpoint, or any .pt/.pth/.safetensors state_dict."""
    from safetensors.torch import save_file

    state = read_weights(src)
    if out is None:
        out = (
            os.path.join(src, "export")
            if os.path.isdir(src)
            else os.path.splitext(src)[0] + "-export"
        )
    config = find_config(src)
    with atomic_dir(out) as tmp:
        save_file(
            {k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors")
        )
        if config:
            shutil.copyfile(config, os.path.join(tmp, "config.yaml"))
    return os.path.join(out, "model.safetensors")
