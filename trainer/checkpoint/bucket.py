"""Checkpoints in a bucket (ckpt.dir=s3://bucket/prefix): store.py's format, carried to an object
store, which has no rename and no atomic folder.

    s3://bucket/prefix/step-000000460.5f3a9c1e/   one prefix per save ATTEMPT (never reused)
        model.safetensors, optimizer.pt | dcp/...   the files of store.py's format, each with
        state.pt, meta.json, config.yaml            its sha256 in the object's metadata
        MANIFEST.json                              written LAST, by a conditional put

A save writes its files into a fresh prefix (a random suffix: a retried or concurrent save of the
same step never overwrites another's objects), then the manifest: every object's sha256, size
and ETag, put with If-None-Match so it never replaces one. Only a prefix whose manifest exists
and matches the listing counts as a checkpoint; a prefix without one is a save that died and is
deleted at the next start, with every unfinished multipart upload under the run's prefix. Which
checkpoint is newest costs one listing. Every byte read back is hashed against the manifest: an
object changed after the save is refused, and the next older checkpoint used.

The ranks read a checkpoint from a local copy (`local_copy`): store.py's readers then load it as
they load one on disk. Uploads and downloads stream from and to files (storage.CHUNK bytes in
memory at most a part).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from trainer import storage
from trainer.checkpoint.files import (
    COMMON,
    FILES,
    MANIFEST,
    SHARDED_METADATA,
    CorruptCheckpoint,
    files_under,
)

BUCKET_MANIFEST = "MANIFEST.json"
NAME = re.compile(r"^step-(\d+)\.([0-9a-f]{8})$")
DRY_RUN = ".dry-run-"


def new_name(root: str, step: int) -> str:
    """A prefix no save has used: the step and 8 random hex digits."""
    return storage.join(root, f"step-{step:09d}.{secrets.token_hex(4)}")


def is_checkpoint_name(url: str) -> bool:
    return bool(NAME.match(storage.basename(url)))


@dataclass(frozen=True)
class Found:
    """One save attempt's prefix, from a listing."""

    step: int
    url: str
    objects: dict[str, storage.Listed]
    """Path below the prefix -> the object."""

    @property
    def sealed(self) -> bool:
        return BUCKET_MANIFEST in self.objects


def scan(root: str) -> tuple[list[Found], list[storage.Listed]]:
    """Every save attempt under `root`, newest first (one listing), and the objects of dry runs
    and of anything else that is not a checkpoint."""
    groups: dict[str, dict[str, storage.Listed]] = {}
    other = []
    for rel, item in storage.walk(root):
        head, _, rest = rel.partition("/")
        if NAME.match(head) and rest:
            groups.setdefault(head, {})[rest] = item
        elif head.startswith(DRY_RUN):
            other.append(item)
    found = [
        Found(int(NAME.match(h)[1]), storage.join(root, h), objs) for h, objs in groups.items()
    ]
    return sorted(found, key=lambda f: (f.step, f.url), reverse=True), other


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, url) of every sealed checkpoint under `root`, newest first."""
    return [(f.step, f.url) for f in scan(root)[0] if f.sealed]


def manifest(url: str) -> dict[str, dict]:
    """The manifest of the checkpoint at `url`: {path: {sha256, size, etag}}."""
    try:
        entries = json.loads(storage.get_bytes(storage.join(url, BUCKET_MANIFEST)))["files"]
    except FileNotFoundError:
        raise CorruptCheckpoint(f"no {BUCKET_MANIFEST}") from None
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpoint(f"{BUCKET_MANIFEST} is not a manifest") from None
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise CorruptCheckpoint(f"no {BUCKET_MANIFEST}") from None
        raise
    if not isinstance(entries, dict) or not all(
        isinstance(v, dict) and {"sha256", "size", "etag"} <= v.keys() for v in entries.values()
    ):
        raise CorruptCheckpoint(f"{BUCKET_MANIFEST} is not a manifest")
    return entries


def verify(url: str, objects: dict[str, storage.Listed] | None = None) -> dict[str, dict]:
    """The manifest of `url` once every object it names is in the listing with its size and
    ETag (an object replaced after the save has another); CorruptCheckpoint otherwise. The
    bytes themselves are hashed when they are read (`download`)."""
    if objects is None:
        objects = dict(storage.walk(url))
    entries = manifest(url)
    needed = (*COMMON, SHARDED_METADATA) if SHARDED_METADATA in entries else FILES
    for name in needed:
        if name not in entries:
            raise CorruptCheckpoint(f"{BUCKET_MANIFEST} does not list {name}")
    for name, entry in entries.items():
        found = objects.get(name)
        if found is None:
            raise CorruptCheckpoint(f"{name} is missing")
        if found.size != entry["size"] or found.etag != entry["etag"]:
            raise CorruptCheckpoint(f"{name} is not the object the save wrote (size or ETag)")
    return entries


def latest_valid(root: str, warn: Callable[[str], None] | None = None, skip=()) -> str | None:
    """The newest sealed checkpoint under `root` whose objects match its manifest."""
    for found in scan(root)[0]:
        if not found.sealed or found.url in skip:
            continue
        try:
            verify(found.url, found.objects)
            return found.url
        except CorruptCheckpoint as e:
            if warn:
                warn(f"checkpoint {found.url} is corrupt ({e}); falling back to an older one")
    return None


def publish(local: str, url: str, shards: list[str] | None = None) -> str:
    """Upload the checkpoint written in the local folder `local` to the fresh prefix `url`,
    then seal it with the manifest (a conditional put). Files other ranks uploaded there
    already (their DCP shards) are taken into the manifest by their recorded sha256; `shards`:
    the shard files the sharded metadata names, each of which must be there."""
    present = dict(storage.walk(url))
    entries = {}
    for rel in files_under(local):
        if rel == MANIFEST:
            continue
        if rel in present:  # this rank's own shards, uploaded as DCP wrote them
            continue
        path = os.path.join(local, rel)
        digest = storage.sha256_file(path)
        etag = storage.put_file(path, storage.join(url, rel), digest)
        entries[rel] = {"sha256": digest, "size": os.path.getsize(path), "etag": etag}
    for rel in present:
        size, etag, digest = storage.head_sha256(storage.join(url, rel))
        if not digest:
            raise OSError(f"{storage.join(url, rel)} carries no sha256: not written by trainer")
        entries[rel] = {"sha256": digest, "size": size, "etag": etag}
    missing = sorted(f"dcp/{n}" for n in shards or () if f"dcp/{n}" not in entries)
    if missing:
        raise OSError(f"shards {', '.join(missing[:3])} never reached {url}")
    body = json.dumps({"files": dict(sorted(entries.items()))}, indent=1).encode()
    storage.put_bytes(storage.join(url, BUCKET_MANIFEST), body, only_new=True)
    return url


def download(url: str, local: str) -> None:
    """Copy the checkpoint at `url` into the empty local folder `local` (store.py's layout, with
    a MANIFEST.sha256), hashing every object: CorruptCheckpoint when one differs from the
    manifest."""
    entries = verify(url)
    lines = []
    for rel, entry in sorted(entries.items()):
        path = os.path.join(local, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if storage.get_file(storage.join(url, rel), path) != entry["sha256"]:
            raise CorruptCheckpoint(f"{rel} does not match its sha256 (altered in the bucket)")
        lines.append(f"{entry['sha256']}  {rel}\n")
    with open(os.path.join(local, MANIFEST), "w", encoding="utf-8") as f:
        f.writelines(lines)


@contextlib.contextmanager
def local_copy(url: str):
    """A verified local copy of the checkpoint at `url` for the block's duration."""
    folder = local_folder("checkpoint")
    try:
        download(url, folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def staging(url: str) -> str:
    """A fresh local folder to write a checkpoint for `url` into before it is uploaded."""
    return local_folder("staging")


LOCAL = re.compile(r"^trainer-(staging|checkpoint|object)-(\d+)-")
"""The local folders a bucket's checkpoints pass through ($TMPDIR), named by the process."""


def local_folder(kind: str) -> str:
    """A fresh folder in $TMPDIR named trainer-KIND-PID-..., which sweep_local removes once
    that process is gone (a SIGKILL leaves it behind)."""
    return tempfile.mkdtemp(prefix=f"trainer-{kind}-{os.getpid()}-")


def sweep_local() -> list[str]:
    """Remove this node's local checkpoint folders whose process is gone; returns them."""
    folder, removed = tempfile.gettempdir(), []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        found = LOCAL.match(name)
        if found and not _alive(int(found[2])):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def delete_prefix(url: str, objects=None) -> None:
    bucket, _ = storage.split(url)
    keys = [o.key for o in (objects if objects is not None else storage.listing(url))]
    storage.delete(bucket, keys)


def prune(root: str, keep_last: int, protect=()) -> list[str]:
    """Delete all but the newest `keep_last` sealed checkpoints under `root` (never `protect`:
    the one this run resumed from); the manifest goes first, so a prune cut short leaves an
    unsealed prefix (swept at the next start), never a sealed one with objects missing."""
    bucket, _ = storage.split(root)
    removed = []
    sealed = [f for f in scan(root)[0] if f.sealed]
    for found in sealed[keep_last:]:
        if found.url in protect:
            continue
        manifest_key = found.objects[BUCKET_MANIFEST].key
        storage.delete(bucket, [manifest_key])
        storage.delete(bucket, [o.key for o in found.objects.values() if o.key != manifest_key])
        removed.append(found.url)
    return removed


def sweep(root: str) -> None:
    """At a run's start: abort unfinished multipart uploads under `root`, and delete what saves
    that died left (prefixes without a manifest, dry runs' scratch)."""
    storage.abort_uploads(root)
    found, other = scan(root)
    bucket, _ = storage.split(root)
    keys = [o.key for f in found if not f.sealed for o in f.objects.values()]
    storage.delete(bucket, keys + [o.key for o in other])
