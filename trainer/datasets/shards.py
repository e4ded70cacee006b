"""data.name=shards: a dataset packed into tar shards (`trainer data pack`), read from a folder
or an s3:// prefix, through a bounded per-node cache.

The format is WebDataset's: each shard is a plain tar whose members are `<sample>.<field>.npy`
(so `webdataset`, `tar` and numpy read it), written byte-for-byte the same by every pack of the
same data (USTAR headers, no timestamps). Every field has one dtype and one shape, so each sample
takes the same bytes and sample j of a shard starts at j x stride: `index.json` (written last)
maps sample -> (shard, offset) with no per-sample table, and holds each shard's size and sha256.

What a split reads comes through `fetch`: a local shard is read in place (its sha256 checked
once per process); a bucket's is downloaded into the cache folder under its sha256 (a file
there is complete by construction: it is renamed into place only after its hash matched), with
one download per node (a lock file per shard; the kernel frees it when a process dies),
least-recently-used shards evicted beyond data.shards.cache_gb, and `.part-PID-` files of dead
processes swept. A process prefetches the shards its next steps need on a thread.

The order of an epoch (sampler.EpochPlan with `groups`) visits data.shards.window shards at a
time, shuffled within: the global batches stay the same on any world size.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from trainer import storage
from trainer.errors import DataUnavailable, RetryableError, UsageError, first_line, io_error

FORMAT = "trainer-shards"
VERSION = 1
INDEX = "index.json"
BLOCK = 512
SPLITS = ("train", "test")
PACK_FIX = "pack it again with `trainer data pack` (docs/data.md, 'Shards and buckets')"


# --- the format --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of every sample: a `.npy` member of `header` + `nbytes` bytes of data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    header: int
    """Bytes of the .npy header before the data."""

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    @property
    def member(self) -> int:
        """Bytes of the tar member: a 512-byte header, then the .npy padded to 512."""
        return BLOCK + -(-(self.header + self.nbytes) // BLOCK) * BLOCK


@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Layout:
    """What index.json says: the fields, how a batch is built from them, the shards."""

    fields: tuple[Field, ...]
    kind: str
    """tuple | dict | tensor: the structure of the source split's batches."""
    spec: dict
    splits: dict  # split name -> tuple[ShardInfo, ...]

    @property
    def stride(self) -> int:
        return sum(f.member for f in self.fields)


def member_offsets(fields) -> list[int]:
    """Offsets of each field's data from the start of its sample."""
    at, found = 0, []
    for f in fields:
        found.append(at + BLOCK + f.header)
        at += f.member
    return found


def shard_bytes(layout: Layout, samples: int) -> int:
    return samples * layout.stride + 2 * BLOCK  # the tar's end: two zero blocks


def read_index(data: bytes, where: str) -> Layout:
    """The Layout of an index.json's bytes; a one-line UsageError naming `where` otherwise."""

    def bad(why: str) -> UsageError:
        return UsageError(f"data.shards: {where} is not a shard index ({why}): {PACK_FIX}")

    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(first_line(e)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad(f'no "format": "{FORMAT}"')
    if doc.get("version") != VERSION:
        raise bad(f"version {doc.get('version')!r}; this trainer reads version {VERSION}")
    try:
        fields = tuple(
            Field(
                str(f["name"]),
                str(np.dtype(f["dtype"])),
                tuple(int(s) for s in f["shape"]),
                int(f["header"]),
            )
            for f in doc["fields"]
        )
        kind = doc["kind"]
        splits = {
            name: tuple(
                ShardInfo(str(s["name"]), int(s["samples"]), int(s["bytes"]), str(s["sha256"]))
                for s in doc["splits"][name]
            )
            for name in SPLITS
        }
        spec = dict(doc["spec"])
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"{type(e).__name__}: {first_line(e)}") from None
    if kind not in ("tuple", "dict", "tensor") or not fields:
        raise bad(f"kind {kind!r} with {len(fields)} fields")
    if any(np.dtype(f.dtype).hasobject for f in fields):
        raise bad("a field of Python objects")
    layout = Layout(fields, kind, spec, splits)
    for name, shards in splits.items():
        if not shards or not all(s.samples > 0 for s in shards):
            raise bad(f"the {name} split has no samples")
        for s in shards:
            if "/" in s.name or s.name.startswith(".") or s.bytes != shard_bytes(layout, s.samples):
                raise bad(f"shard {s.name!r} of {s.samples} samples and {s.bytes} bytes")
    return layout


# --- the cache ---------------------------------------------------------------------------------


class Cache:
    """A node's folder of downloaded shards, named by their sha256, at most `limit` bytes."""

    def __init__(self, folder: str, limit: int):
        self.folder, self.limit = folder, limit
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise io_error(e, f"data.shards.cache_dir {folder} cannot be made", CACHE_FIX) from None
        self.sweep()

    def sweep(self) -> list[str]:
        """Remove the partial downloads of processes that are gone (a SIGKILL mid-download):
        a download holds a lock on its file while it lasts, so one that can be locked is
        dead, whatever its process id says (another container's, or one reused)."""
        gone = []
        for name in _listdir(self.folder):
            if name.startswith((".part-", ".place-")):
                full = os.path.join(self.folder, name)
                try:
                    fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.remove(full)
                    gone.append(name)
                except OSError:
                    pass  # held: a download in progress
                finally:
                    os.close(fd)
        return gone

    def path(self, sha: str) -> str:
        return os.path.join(self.folder, f"{sha}.tar")

    def fetch(self, url: str, info: ShardInfo) -> str:
        """The local path of shard `info` (from `url`), downloaded if this node lacks it."""
        path = self.path(info.sha256)
        what = f"data.shards: caching {url} in {self.folder}"
        try:
            if _touch(path):
                return path
            with _locked(os.path.join(self.folder, f".{info.sha256}.lock")):
                if _touch(path):  # another process on this node fetched it meanwhile
                    return path
                self._download(url, info, path)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the same again would fail again
                raise UsageError(f"{what}: {e.strerror}: {CACHE_FIX}") from None
            raise io_error(e, what, CACHE_FIX) from None
        return path

    def _download(self, url: str, info: ShardInfo, path: str) -> None:
        """Download shard `info` into a part file named with its size (what _make_room counts
        for it), locked while it lasts, checked, then renamed to `path`."""
        part = os.path.join(self.folder, f".part-{os.getpid()}-{info.sha256[:16]}-{info.bytes}")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._make_room()
            with _unavailable(), storage.explained(f"data.shards: reading shard {url}"):
                got = _local_write_errors(storage.get_file, url, part)
            if got != info.sha256:
                raise UsageError(
                    f"data.shards: shard {url} is damaged (its sha256 {got[:12]}... is not "
                    f"the index's {info.sha256[:12]}...): {PACK_FIX}"
                )
            os.rename(part, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
            os.close(fd)

    def _make_room(self) -> None:
        """Evict the least recently used shards until the shards held and the downloads in
        progress (each counted at its full size) fit under the limit."""
        with _locked(os.path.join(self.folder, ".evict.lock")):
            held, total = [], 0
            for name in _listdir(self.folder):
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if name.startswith(".part-"):
                        total += int(name.rsplit("-", 1)[1])
                    elif name.endswith(".tar") and not name.startswith("."):
                        st = os.stat(os.path.join(self.folder, name))
                        held.append((st.st_mtime_ns, st.st_size, name))
                        total += st.st_size
            for _, size, name in sorted(held):
                if total <= self.limit:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.folder, name))
                total -= size

    def held_bytes(self) -> int:
        return sum(
            os.path.getsize(os.path.join(self.folder, n))
            for n in _listdir(self.folder)
            if n.endswith(".tar")
        )


def _local_write_errors(get_file, url: str, part: str) -> str:
    """get_file(url, part), a local write that failed (a full disk) as the OSError it is, not
    the bucket's fault."""
    try:
        return get_file(url, part)
    except storage.BucketError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(e.errno, os.strerror(e.errno)) from None
        raise


@contextlib.contextmanager
def _unavailable():
    """A bucket that stays unreachable past the retries: DataUnavailable (exit 4; a lone process
    saves first); a refused key or a missing object stays a UsageError (exit 2)."""
    try:
        yield
    except DataUnavailable:
        raise
    except RetryableError as e:
        raise DataUnavailable(str(e)) from None


CACHE_FIX = (
    "free space there, or set data.shards.cache_dir to a folder with room (and data.shards.cache_gb "
    "below what it can hold)"
)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _touch(path: str) -> bool:
    """Mark `path` used now (the LRU's clock); whether it exists."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


_HELD: dict[str, threading.Lock] = {}
_GUARD = threading.Lock()
_FORK_GATE = threading.Lock()
"""Held by a prefetch thread while it fetches, and by a fork (a loader worker starting): no
worker is forked while a prefetch is inside boto3 or holds one of our locks, whose state the
worker would inherit half-way."""


def _before_fork() -> None:
    _FORK_GATE.acquire()


def _after_fork_in_parent() -> None:
    _FORK_GATE.release()


def _after_fork() -> None:
    """A forked loader worker starts with none of these locks held."""
    global _HELD, _GUARD, _FORK_GATE
    _HELD, _GUARD, _FORK_GATE = {}, threading.Lock(), threading.Lock()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork
)


@contextlib.contextmanager
def _locked(path: str):
    """One holder of `path` at a time on this node: a thread lock within the process, flock
    across processes (freed when a process dies; no worker forks while one is held: the fork
    gate and the main thread's own calls)."""
    with _GUARD:
        lock = _HELD.setdefault(path, threading.Lock())
    with lock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # per open file: no false EDEADLK between threads
            yield
        finally:
            os.close(fd)


# --- a split -----------------------------------------------------------------------------------


class ShardSplit:
    """One split of a packed dataset: take(idx) gathers samples from the shards' mapped bytes."""

    lazy = True

    def __init__(
        self, root: str, name: str, layout: Layout, cache: Cache | None, window: int, seen: str
    ):
        self.root, self.name, self.layout, self.cache = root, name, layout, cache
        self.seen = seen
        """A folder of markers, one per local shard whose sha256 this node has checked."""
        self.shards: tuple[ShardInfo, ...] = layout.splits[name]
        self.shard_sizes = tuple(s.samples for s in self.shards)
        """Samples per shard, in order: what sampler.EpochPlan's shard-aware order groups by."""
        self.window = window
        self.first = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.offsets = member_offsets(layout.fields)
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified: set[int] = set()
        self._prefetcher: _Prefetcher | None = None
        stats = layout.spec.get("stats")
        if stats is not None:  # images: pixels_to_float's statistics, as the source had
            self.mean = None if stats[0] is None else torch.tensor(stats[0], dtype=torch.float32)
            self.std = None if stats[1] is None else torch.tensor(stats[1], dtype=torch.float32)

    def __getstate__(self):  # to a loader worker: its own maps, its own prefetch
        state = dict(self.__dict__)
        state.update(_maps=OrderedDict(), _prefetcher=None, _verified=set())
        return state

    def __len__(self) -> int:
        return int(self.first[-1])

    def url(self, shard: int) -> str:
        name = self.shards[shard].name
        return (
            storage.join(self.root, name)
            if storage.is_url(self.root)
            else os.path.join(self.root, name)
        )

    def local(self, shard: int) -> str:
        """The local file of shard `shard`: in place, or fetched into the node's cache."""
        info = self.shards[shard]
        if self.cache is not None:
            return self.cache.fetch(self.url(shard), info)
        path = self.url(shard)
        if shard in self._verified:
            return path
        try:
            st = os.stat(path)
            # checked once per node while the file stays the same (inode, size, mtime)
            seen = os.path.join(self.seen, f"{info.sha256}-{st.st_dev}-{st.st_ino}-"
                                f"{st.st_size}-{st.st_mtime_ns}")  # fmt: skip
            if not os.path.exists(seen):
                with _locked(os.path.join(self.seen, f".{info.sha256}.lock")):  # one hashes
                    if not os.path.exists(seen):
                        self._check(path, info)
                        with contextlib.suppress(OSError):  # no marker: hashed again next time
                            open(seen, "wb").close()
        except OSError as e:
            raise io_error(e, f"data.shards: reading shard {path}", PACK_FIX) from None
        self._verified.add(shard)
        return path

    def _check(self, path: str, info: ShardInfo) -> None:
        got = storage.sha256_file(path)
        if got != info.sha256:
            raise UsageError(
                f"data.shards: shard {path} is damaged (its sha256 {got[:12]}... is not the "
                f"index's {info.sha256[:12]}...): {PACK_FIX}"
            )

    def _map(self, shard: int) -> np.ndarray:
        """Shard `shard`'s bytes, mapped (the last few stay mapped; an evicted one's space is
        freed once its map is dropped)."""
        found = self._maps.get(shard)
        if found is not None:
            self._maps.move_to_end(shard)
            return found
        for attempt in range(3):  # a cached file evicted by another process between the two
            path = self.local(shard)
            try:
                mapped = np.memmap(path, np.uint8, "r")
                break
            except FileNotFoundError:
                if attempt == 2 or self.cache is None:
                    raise
        if len(mapped) != self.shards[shard].bytes:
            raise UsageError(
                f"data.shards: shard {self.url(shard)} holds {len(mapped)} bytes, not the index's "
                f"{self.shards[shard].bytes} (truncated?): {PACK_FIX}"
            )
        self._maps[shard] = mapped
        while len(self._maps) > max(4, 2 * _window(self.window, len(self.shards)) + 2):
            self._maps.popitem(last=False)
        return mapped

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, sample within it) of each sample of `idx`."""
        shard = np.searchsorted(self.first, idx, side="right") - 1
        return shard, idx - self.first[shard]

    def take(self, idx) -> tuple | dict | torch.Tensor:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range 0..{len(self) - 1}")
        shard, within = self.locate(idx)
        stride, count = self.layout.stride, len(idx)
        out = [np.empty((count, f.nbytes), dtype=np.uint8) for f in self.layout.fields]
        for s in np.unique(shard):
            mapped = self._map(int(s))
            rows = np.flatnonzero(shard == s)
            samples = self.shards[int(s)].samples
            for k, f in enumerate(self.layout.fields):  # every sample's field: one strided view
                view = np.lib.stride_tricks.as_strided(
                    mapped[self.offsets[k] :], (samples, f.nbytes), (stride, 1), writeable=False
                )
                out[k][rows] = view[within[rows]]
        out = [
            a.view(f.dtype).reshape(count, *f.shape)
            for a, f in zip(out, self.layout.fields, strict=True)
        ]
        tensors = [torch.from_numpy(a) for a in out]
        if self.layout.kind == "tensor":
            return tensors[0]
        if self.layout.kind == "dict":
            return {f.name: t for f, t in zip(self.layout.fields, tensors, strict=True)}
        return tuple(tensors)

    def span(self, lo: int, hi: int):
        return self.take(np.arange(lo, hi, dtype=np.int64))

    # prefetch: the shards this process's next steps need, fetched on a thread ahead of them

    @property
    def unavailable(self) -> DataUnavailable | None:
        """Why the shards ahead cannot be fetched (the prefetch gave up), or None: the loop
        turns it into a stop the ranks agree on (a checkpoint, then exit 4)."""
        p = self._prefetcher
        return p.error if p is not None and isinstance(p.error, DataUnavailable) else None

    def prefetch(self, steps: list[np.ndarray]) -> _Prefetcher | None:
        """Start fetching, in the order they are first needed, the shards of `steps` (this
        rank's samples of each step ahead): at most data.shards.window shards beyond the one
        the current step reads. Returns the prefetcher, whose advance(k) says step k is due."""
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None
        if self.cache is None or not steps:
            return None
        self._prefetcher = _Prefetcher(self, steps, max(1, self.window))
        return self._prefetcher


class _Prefetcher:
    def __init__(self, split: ShardSplit, steps: list[np.ndarray], ahead: int):
        self.split, self.ahead = split, ahead
        self.order: list[int] = []  # shards in the order first needed
        self.due_at: list[int] = []  # for each step, how many of `order` it needs fetched
        seen: set[int] = set()
        for idx in steps:
            for s in (
                np.unique(split.locate(np.asarray(idx, dtype=np.int64))[0]) if len(idx) else ()
            ):
                if int(s) not in seen:
                    seen.add(int(s))
                    self.order.append(int(s))
            self.due_at.append(len(self.order))
        self.step = 0
        self.error: BaseException | None = None
        self._wake = threading.Condition()
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        self.thread.start()

    def advance(self, step: int) -> None:
        with self._wake:
            self.step = step
            self._wake.notify()

    def stop(self) -> None:
        """Stop fetching (after the shard in flight) and wait for the thread to end."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self.thread.join()

    def _limit(self) -> int:
        current = self.due_at[min(self.step, len(self.due_at) - 1)]
        return current + self.ahead

    def _run(self) -> None:
        for k, shard in enumerate(self.order):
            with self._wake:
                while not self._stopped and k >= self._limit():
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                with _FORK_GATE:
                    self.split.local(shard)
            except BaseException as e:  # the step that needs it fetches again and says why
                self.error = e
                return


# --- the factory -------------------------------------------------------------------------------


def _window(window: int, shards: int) -> int:
    """The shards an epoch reads at a time: all of them for window 0 (a full shuffle)."""
    return shards if window <= 0 or window >= shards else window


def open_index(root: str) -> tuple[Layout, str]:
    """The Layout of `root`'s index.json, and the sha256 of its bytes."""
    where = storage.join(root, INDEX) if storage.is_url(root) else os.path.join(root, INDEX)
    if storage.is_url(root):
        with storage.explained(f"data.shards.path {root}: reading {INDEX}"):
            if not storage.exists(where):
                raise UsageError(
                    f"data.shards.path {root} holds no {INDEX}: point it at what `trainer data "
                    "pack` wrote (a packing that did not finish has none)"
                )
            data = storage.get_bytes(where)
    else:
        try:
            with open(where, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise UsageError(
                f"data.shards.path {root} holds no {INDEX}: point it at what `trainer data pack` "
                "wrote (a packing that did not finish has none)"
            ) from None
        except OSError as e:
            raise io_error(e, f"data.shards.path {root}: reading {INDEX}", PACK_FIX) from None
    return read_index(data, where), hashlib.sha256(data).hexdigest()


def check_present(root: str, layout: Layout) -> None:
    """Every shard the index names is there with its size (one listing for a bucket): a
    missing or truncated shard is one line before any work."""
    wanted = {s.name: s.bytes for shards in layout.splits.values() for s in shards}
    if storage.is_url(root):
        with storage.explained(f"data.shards.path {root}: listing the shards"):
            sizes = {storage.basename(item.key): item.size for item in storage.listing(root)}
    else:
        sizes = {}
        for name in wanted:
            with contextlib.suppress(FileNotFoundError):
                sizes[name] = os.path.getsize(os.path.join(root, name))
    for name, size in wanted.items():
        if name not in sizes:
            raise UsageError(f"data.shards: shard {name} is missing from {root}: {PACK_FIX}")
        if sizes[name] != size:
            raise UsageError(
                f"data.shards: shard {name} in {root} holds {sizes[name]} bytes, not the index's "
                f"{size} (truncated or replaced?): {PACK_FIX}"
            )


def shards(cfg, seed: int):
    """data.name=shards: the dataset `trainer data pack` wrote to data.shards.path."""
    from trainer.data import DataSpec

    s = cfg.shards
    root = s.path.rstrip("/") if storage.is_url(s.path) else os.path.abspath(s.path)
    layout, digest = open_index(root)
    check_present(root, layout)
    cache = None
    if storage.is_url(root):
        every = [x.bytes for shards_ in layout.splits.values() for x in shards_]
        limit = int(s.cache_gb * (1 << 30))
        count = 2 * _window(s.window, len(layout.splits["train"])) + 2
        need = min(sum(every), count * max(every))  # window 0: a full shuffle reads them all
        if limit < need:
            raise UsageError(
                f"data.shards.cache_gb={s.cache_gb} holds less than the {count} shards of "
                f"{max(every) / 2**20:.1f} MiB a window of {s.window} reads and prefetches: set "
                f"data.shards.cache_gb >= {need / 2**30:.2f} or a smaller data.shards.window"
            )
        cache = Cache(os.path.abspath(s.cache_dir), limit)
    seen = os.path.join(os.path.abspath(s.cache_dir), "checked")
    try:
        os.makedirs(seen, exist_ok=True)
    except OSError as e:
        raise io_error(
            e, f"data.shards.cache_dir {s.cache_dir} cannot be made", CACHE_FIX
        ) from None
    spec = layout.spec
    splits = {name: ShardSplit(root, name, layout, cache, s.window, seen) for name in SPLITS}
    return DataSpec(
        train=splits["train"],
        test=splits["test"],
        task=spec.get("task"),
        in_shape=tuple(spec.get("in_shape") or ()),
        num_classes=int(spec.get("num_classes") or 0),
        target_scale=float(spec.get("target_scale", 1.0)),
        source={"packed": spec.get("source") or {}, "shards": root, "index_sha256": digest},
    )
