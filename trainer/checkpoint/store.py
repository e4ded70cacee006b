"""The on-disk format: one directory per save, written under a temporary name and renamed.

    <checkpoint dir>/step-000000460/
        model.safetensors   whole: unwrapped weights (no `module.`/`_orig_mod.`), CPU tensors
        optimizer.pt        whole: the optimizer's state_dict
        dcp/                sharded (fsdp) instead of the two above: torch.distributed.checkpoint
                            files, one per rank (__<rank>_0.distcp) and .metadata, holding
                            {"model": ..., "optim": ...} keyed by parameter name
        state.pt            scheduler, grad scaler, every rank's RNG states
        meta.json           loop position, format, reason, world size, restarts, results, versions
        config.yaml         the resolved config
        MANIFEST.sha256     sha256 of every file above (dcp/ included); written last, checked
                            before loading

A whole checkpoint is written by rank 0; a sharded one by every rank into the same temporary
directory, which rank 0 seals with the manifest and renames. Everything loads without running
code: torch.load(weights_only=True) (plain tensors, numbers, strings, lists, dicts), safetensors,
and DCP's own tensor files.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import stat
from collections.abc import Callable

import torch

from trainer import storage
from trainer.checkpoint.files import (  # noqa: F401  (the format's names, re-exported)
    COMMON,
    FILES,
    MANIFEST,
    SHARDED_DIR,
    SHARDED_METADATA,
    STEP_DIR,
    WHOLE,
    CorruptCheckpoint,
    files_under,
)
from trainer.errors import UsageError, first_line
from trainer.state import LOOP_KEYS


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def begin(path: str) -> str:
    """A fresh temporary sibling of `path` to write into; returns its name."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit(tmp: str, path: str) -> None:
    """Make everything in `tmp` durable, then put it at `path` in one rename (replacing any
    directory there only once the new one is complete)."""
    parent = os.path.dirname(os.path.abspath(path))
    for rel in files_under(tmp):
        with open(os.path.join(tmp, rel), "rb") as f:
            os.fsync(f.fileno())
    for folder, _, _ in os.walk(tmp):  # the entries of dcp/ too, not just its files' contents
        _fsync_dir(folder)
    old = None
    if os.path.exists(path):
        old = os.path.join(parent, f".{os.path.basename(path)}.old-{os.getpid()}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def abort(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    On any error the temporary directory is removed and `path` is left as it was.
    """
    tmp = begin(path)
    try:
        yield tmp
        commit(tmp, path)
    except BaseException:
        abort(tmp)
        raise


_sha256 = storage.sha256_file


def torch_load(path: str, mmap: bool = False):
    """torch.load restricted to tensors and plain containers; code-carrying pickles are refused.
    `mmap`: the tensors map the file (copy on write) instead of being read into memory, so a
    rank that keeps a slice of each pays for that slice (the rest is page cache, shared by the
    ranks of a node and given back under pressure); a file in torch's legacy format is read."""
    try:
        if mmap:
            with contextlib.suppress(RuntimeError):  # not torch's zip format: read it whole
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError, RuntimeError from the zip reader, ...
        raise UsageError(
            f"{path}: refused to load ({first_line(e)}); only tensors and plain containers are "
            "accepted (weights_only=True): re-save the weights with "
            "torch.save(model.state_dict(), path)"
        ) from None


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, on the CPU, mapping the file (safetensors reads a page when
    it is touched: a rank that keeps a slice pays for that slice); a one-line UsageError when it
    is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as e:
        raise UsageError(f"{path}: not a readable safetensors file ({e})") from None


def save_safetensors(
    state: dict[str, torch.Tensor], path: str, metadata: dict | None = None
) -> None:
    """safetensors' save_file, whose failed writes (full disk, I/O error, read-only disk) raise
    an OSError with the OS's errno, as any other file's do: safetensors says it only in its
    message, and without the errno a read-only disk would pass for a retryable failure.

    The file gets the mode any tool's new file gets (0666 less the umask): safetensors (0.8)
    writes a temporary file of mode 0600 and renames it, which another user, or a pod of another
    uid on the shared volume, could not read."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state, path, metadata=metadata)
    except SafetensorError as e:
        found = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
        if found is None:
            raise
        raise OSError(int(found[2]), found[1], path) from None
    os.chmod(path, 0o666 & ~umask())


def umask() -> int:
    """This process's umask, read without setting it: os.umask sets it, and in between another
    thread (the checkpoint writer, the metrics) would create files with the wrong mode."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): set and restore at once
    os.umask(mask)
    return mask


def _torch_save(obj, path: str) -> None:
    """torch.save through Python I/O: a full disk raises OSError ENOSPC, not a C++ enforce message."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:09d}")


def new_checkpoint(root: str, step: int) -> str:
    """Where the checkpoint of `step` goes: step-N in a folder; in a bucket a fresh prefix (an
    object store cannot replace a folder in one rename: bucket.py)."""
    if storage.is_url(root):
        from trainer.checkpoint import bucket

        return bucket.new_name(root, step)
    return step_dir(root, step)


def _bucket():
    from trainer.checkpoint import bucket

    return bucket


def is_step_dir(path: str) -> bool:
    """Whether `path` looks like one checkpoint (a manifest, or a step-N name)."""
    if storage.is_url(path):
        return _bucket().is_checkpoint_name(path)
    return os.path.isfile(os.path.join(path, MANIFEST)) or bool(
        STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    )


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every finished checkpoint directory, newest first."""
    if storage.is_url(root):
        return _bucket().list_checkpoints(root)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def is_sharded(path: str) -> bool:
    """A sharded (DCP) checkpoint, as opposed to a whole one."""
    return os.path.isfile(os.path.join(path, SHARDED_METADATA))


MANIFEST_LIMIT = 1 << 20
"""The largest MANIFEST.sha256 read (a checkpoint's lists a few files: ~100 bytes a line)."""


def _read_regular(path: str, limit: int) -> bytes:
    """A regular file's bytes, opened without following a link or blocking (a FIFO or a device
    where the manifest belongs would hang a plain open or read forever): OSError otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        chunks, size = [], 0
        while chunk := os.read(fd, limit + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit:,} bytes", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def verify(path: str) -> None:
    """Raise CorruptCheckpoint unless every file matches the manifest and none is missing."""
    if storage.is_url(path):
        _bucket().verify(path)
        return
    manifest = os.path.join(path, MANIFEST)
    try:
        text = _read_regular(manifest, MANIFEST_LIMIT).decode("utf-8")
    except OSError as e:
        raise CorruptCheckpoint(f"no readable {MANIFEST} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise CorruptCheckpoint(f"{MANIFEST} is not text (non-UTF-8 bytes)") from None
    lines = [line.split() for line in text.splitlines() if line.strip()]
    entries = {}
    for parts in lines:
        if len(parts) != 2:
            raise CorruptCheckpoint(f"malformed {MANIFEST}")
        entries[parts[1]] = parts[0]
    needed = (*COMMON, SHARDED_METADATA) if SHARDED_METADATA in entries else FILES
    for name in needed:
        if name not in entries:
            raise CorruptCheckpoint(f"{MANIFEST} does not list {name}")
    for name, digest in entries.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpoint(f"{name} is missing")
        if _sha256(file) != digest:
            raise CorruptCheckpoint(f"{name} does not match its sha256 (truncated or altered)")


def latest_valid(root: str, warn: Callable[[str], None] | None = None, skip=()) -> str | None:
    """The newest checkpoint under root that verifies; corrupt newer ones are reported, skipped
    (and so are those in `skip`: found damaged on loading)."""
    for _, path in list_checkpoints(root):
        if path in skip:
            continue
        try:
            verify(path)
            return path
        except CorruptCheckpoint as e:
            if warn:
                warn(f"checkpoint {path} is corrupt ({e}); falling back to an older one")
    return None


def latest_in(folder: str, warn: Callable[[str], None] | None = None, skip=()) -> str | None:
    """The newest valid checkpoint in a checkpoints folder or in a run directory's checkpoints/."""
    return latest_valid(folder, warn, skip) or latest_valid(
        storage.join(folder, "checkpoints"), warn, skip
    )


def write(
    root: str,
    step: int,
    *,
    model: dict[str, torch.Tensor],
    optimizer: dict,
    extra: dict,
    meta: dict,
    config_yaml: str,
    path: str | None = None,
) -> str:
    """Write a complete whole checkpoint for `step` atomically (at `path`, else where
    new_checkpoint says); returns its directory.

    `model` is a plain state_dict of CPU tensors (what safetensors stores). In a bucket: written
    to a local folder, then uploaded and sealed (bucket.publish).
    """
    path = path or new_checkpoint(root, step)
    if storage.is_url(root):
        tmp = _bucket().staging(path)
        try:
            _write_whole(tmp, model, optimizer, extra=extra, meta=meta, config_yaml=config_yaml)
            return _bucket().publish(tmp, path)
        finally:
            abort(tmp)
    with atomic_dir(path) as tmp:
        _write_whole(tmp, model, optimizer, extra=extra, meta=meta, config_yaml=config_yaml)
    return path


def _write_whole(tmp: str, model, optimizer, **common) -> None:
    save_safetensors(model, os.path.join(tmp, "model.safetensors"))
    _torch_save(optimizer, os.path.join(tmp, "optimizer.pt"))
    seal(tmp, **common)


@contextlib.contextmanager
def readable(path: str):
    """`path` itself, or for a checkpoint in a bucket a verified local copy (bucket.local_copy)
    for the block's duration."""
    if storage.is_url(path):
        with _bucket().local_copy(path) as local:
            yield local
    else:
        yield path


@contextlib.contextmanager
def fetched(url: str, warn: Callable[[str], None] | None = None):
    """What a bucket URL names, copied to local disk for the block: a checkpoint (its prefix),
    the newest valid checkpoint under a run's prefix (or its checkpoints/; `warn` hears of newer
    damaged ones), an export's prefix (model.safetensors and its config), or one object (a
    weights file). A one-line UsageError when it names none of them, or the bucket cannot be
    read (storage.explained)."""

    folder = _bucket().local_folder("object")
    try:
        with storage.explained(f"reading {url}"):
            local = _fetch(url, folder, warn)
        yield local
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fetch(url: str, folder: str, warn) -> str:
    target = url if is_step_dir(url) else latest_in(url, warn)
    if target is not None:
        if warn and target != url:
            warn(f"{url}: using its newest valid checkpoint, {target}")
        local = os.path.join(folder, storage.basename(target))
        try:
            _bucket().download(target, local)
        except CorruptCheckpoint as e:
            raise UsageError(f"{target}: corrupt checkpoint ({e}): pick another") from None
        return local
    objects = {rel for rel, _ in storage.walk(url)}
    if "model.safetensors" in objects:  # an export's prefix: the weights and their config
        local = os.path.join(folder, storage.basename(url))
        os.makedirs(local)
        for name in sorted(objects & {"model.safetensors", "config.yaml", "config.json"}):
            storage.get_file(storage.join(url, name), os.path.join(local, name))
        return local
    if not storage.exists(url):
        raise UsageError(
            f"{url}: nothing trainer can read there (no step-N.xxxxxxxx checkpoint prefix with a "
            "manifest, no exported model.safetensors, no object of that name): name a run's "
            "checkpoint prefix, one checkpoint, an export's prefix or a weights object"
        )
    local = os.path.join(folder, storage.basename(url))
    storage.get_file(url, local)
    return local


def seal(tmp: str, *, extra: dict, meta: dict, config_yaml: str) -> None:
    """Add the common files to a checkpoint being written in `tmp`, then the manifest of all."""
    _torch_save(extra, os.path.join(tmp, "state.pt"))
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
        f.write(config_yaml)
    write_manifest(tmp)


def write_manifest(folder: str) -> None:
    """MANIFEST.sha256: the sha256 of every other file below `folder` (written last)."""
    rels = [rel for rel in files_under(folder) if rel != MANIFEST]
    lines = [f"{_sha256(os.path.join(folder, rel))}  {rel}\n" for rel in rels]
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        f.writelines(lines)


def read(path: str) -> dict:
    """Read a verified checkpoint: {'extra', 'meta', 'config_yaml'} and, if whole, {'model',
    'optimizer'}; a sharded one's tensors are loaded by the ranks (manager.py)."""
    try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        with open(os.path.join(path, "config.yaml"), encoding="utf-8") as f:
            config_yaml = f.read()
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise CorruptCheckpoint(
            f"meta.json or config.yaml is unreadable ({first_line(e)})"
        ) from None
    payload = {
        "extra": torch_load(os.path.join(path, "state.pt")),
        "meta": meta,
        "config_yaml": config_yaml,
    }
    if not is_sharded(path):
        payload["model"] = read_safetensors(os.path.join(path, "model.safetensors"))
        payload["optimizer"] = torch_load(os.path.join(path, "optimizer.pt"), mmap=True)
    check_payload(payload)
    return payload


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rng_problem(state) -> str | None:
    """What is wrong with one rank's saved RNG states (repro.rng_state's layout), or None."""
    if not isinstance(state, dict):
        return f"is a {type(state).__name__}, not a dict"
    torch_state = state.get("torch")
    expected = torch.get_rng_state()
    if (
        not isinstance(torch_state, torch.Tensor)
        or torch_state.dtype != expected.dtype
        or torch_state.shape != expected.shape
    ):
        return f"'torch' is not a {expected.dtype} tensor of shape {tuple(expected.shape)}"
    n = state.get("numpy")
    if (
        not isinstance(n, dict)
        or not isinstance(n.get("keys"), torch.Tensor)
        or n["keys"].dtype != torch.int64
        or tuple(n["keys"].shape) != (624,)
        or not _is_int(n.get("pos"))
        or not 0 <= n["pos"] <= 624
        or not _is_int(n.get("has_gauss"))
        or not _is_number(n.get("cached_gaussian"))
    ):
        return "'numpy' is not a MT19937 state (624 int64 keys, pos, has_gauss, cached_gaussian)"
    py = state.get("python")
    if not isinstance(py, list) or len(py) != 625 or not all(_is_int(v) for v in py):
        return "'python' is not a list of 625 ints"
    cuda = state.get("cuda")
    if cuda is not None and (not isinstance(cuda, torch.Tensor) or cuda.dtype != torch.uint8):
        return "'cuda' is not a uint8 tensor"
    return None


def check_payload(payload: dict) -> None:
    """Raise CorruptCheckpoint naming the file and what is wrong when a checkpoint that verifies
    does not hold what a resume needs (a checkpoint edited and re-sealed, or from another tool)."""
    meta = payload["meta"]
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(f"meta.json holds a {type(meta).__name__}, not an object")
    loop = meta.get("loop")
    if not isinstance(loop, dict):
        raise CorruptCheckpoint(f"meta.json: 'loop' is {type(loop).__name__}, not an object")
    if sorted(loop) != sorted(LOOP_KEYS) or not all(_is_int(v) and v >= 0 for v in loop.values()):
        raise CorruptCheckpoint(
            f"meta.json: 'loop' must hold the non-negative integers {', '.join(LOOP_KEYS)} "
            f"(it holds {loop!r:.120})"
        )
    results = meta.get("results", {})
    if (
        not isinstance(results, dict)
        or not isinstance(results.get("train", {}), dict)
        or not isinstance(results.get("eval", {}), dict)
        or not _is_number(results.get("train_time_s", 0.0))
        or not _is_number(results.get("data_wait_s", 0.0))
    ):
        raise CorruptCheckpoint("meta.json: 'results' is not {train: {...}, eval: {...}, ...}")
    extra = payload["extra"]
    if not isinstance(extra, dict):
        raise CorruptCheckpoint(f"state.pt holds a {type(extra).__name__}, not a dict")
    for key in ("scheduler", "scaler"):
        if not isinstance(extra.get(key, {} if key == "scaler" else None), dict):
            raise CorruptCheckpoint(f"state.pt: '{key}' is missing or not a dict")
    rngs = extra.get("rng")
    if not isinstance(rngs, list) or not rngs:
        raise CorruptCheckpoint("state.pt: 'rng' is not a list of every rank's RNG states")
    for rank, state in enumerate(rngs):
        problem = _rng_problem(state)
        if problem:
            raise CorruptCheckpoint(f"state.pt: rank {rank}'s RNG state {problem}")
    if "optimizer" in payload:
        opt = payload["optimizer"]
        if (
            not isinstance(opt, dict)
            or not isinstance(opt.get("state"), dict)
            or not isinstance(opt.get("param_groups"), list)
            or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list)
                for g in opt["param_groups"]
            )
        ):
            raise CorruptCheckpoint(
                "optimizer.pt is not an optimizer state_dict ({'state': ..., 'param_groups': "
                "[{'params': [...], ...}]})"
            )


def prune(root: str, keep_last: int, protect=()) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints (never those in `protect`: the one this
    run resumed from, and the one it just wrote, which an earlier run's higher steps in the same
    folder would otherwise push out)."""
    if storage.is_url(root):
        return _bucket().prune(root, keep_last, protect)
    removed = []
    for _, path in list_checkpoints(root)[keep_last:]:
        if path in protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_temporaries(root: str) -> None:
    """Clean up after a process killed mid-save.

    `.step-N.tmp-*` never became a checkpoint: delete it. `.step-N.old-*` is a complete one that
    was being replaced: put it back if the replacement never landed, else delete it.
    In a bucket: unfinished multipart uploads are aborted and unsealed prefixes deleted.
    """
    if storage.is_url(root):
        _bucket().sweep(root)
        return
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


def _first_failure(e: BaseException) -> tuple[int, object] | None:
    """(rank, its error) for the first rank inside DCP's CheckpointException, else None."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    rank, cause = sorted(failures.items())[0]
    return rank, cause[0] if isinstance(cause, tuple) else cause  # (exception, stack summary)


def root_cause(e: BaseException) -> BaseException:
    """The exception behind an error: the first rank's inside DCP's CheckpointException."""
    first = _first_failure(e)
    return first[1] if first and isinstance(first[1], BaseException) else e


def describe_error(e: BaseException) -> str:
    """One line for an error, reaching inside DCP's CheckpointException to the first rank's."""
    first = _first_failure(e)
    if first is None:
        return first_line(e)
    rank, inner = first
    return f"rank {rank}: {first_line(inner) if isinstance(inner, BaseException) else inner}"
