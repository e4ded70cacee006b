"""Sharded checkpoints with torch.distributed.checkpoint (DCP; about 1 s to import, so the
other checkpoint modules import this one only for a sharded checkpoint): every rank writes and reads its
own shards, and a checkpoint saved on N ranks loads on any other number (DCP reshards).

Loading never runs code from the files: DCP's reader unpickles `.metadata` with plain pickle and
its planner loads non-tensor items with torch.load(weights_only=False), so both are replaced
here: the metadata by an unpickler that admits only DCP's own metadata classes, the items by
torch.load(weights_only=True).
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from trainer.checkpoint.store import SHARDED_DIR, describe_error
from trainer.errors import UsageError, first_line
from trainer.strategy import local_part

_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    *(
        ("pathlib", name)
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with `.metadata` read by an allow-list unpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor items with weights_only=True."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: str):
    """The metadata of the DCP folder `path`, read safely; a UsageError if it cannot be."""
    try:
        return SafeReader(path).read_metadata()
    except Exception as e:  # anything a damaged or foreign file can make the unpickler raise
        raise UsageError(
            f"{os.path.dirname(path)}: unreadable shard metadata ({first_line(e)}): the "
            "checkpoint is damaged or was not written by trainer; use another checkpoint"
        ) from None


def _load(state: dict, path: str, **kwargs) -> None:
    read_metadata(path)  # before DCP's collective: every rank fails the same way, in one line
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), **kwargs)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise UsageError(
            f"{os.path.dirname(path)}: cannot load its shards ({describe_error(e)})"
        ) from None


class ShardWriteError(Exception):
    """A rank could not write its shards (DCP's own CheckpointException is a BaseException,
    which the checkpointer's recovery from a failed save would not catch)."""


class UploadingWriter(dcp.FileSystemWriter):
    """DCP's file writer that, once this rank's shard files are written to its local folder,
    uploads each to `url`/dcp/ (its sha256 in the object's metadata) before reporting them
    written: DCP's coordinator finishes only after every rank's shards are in the bucket, and a
    rank's failed upload is that rank's failure in DCP's CheckpointException."""

    def __init__(self, path: str, url: str, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self._local, self._url = path, url

    def write_data(self, plan, planner):
        from trainer import storage

        written = super().write_data(plan, planner)
        results = written.wait()
        for name in sorted({r.storage_data.relative_path for r in results}):
            local = os.path.join(self._local, name)
            storage.put_file(
                local, storage.join(self._url, SHARDED_DIR, name), storage.sha256_file(local)
            )
        return written


def _save_args(state: dict, folder: str, upload: str | None = None) -> dict:
    """What dcp.save and dcp.async_save take: this rank's shards (`state`: ModelState.state_dict's
    {"model", "optim"}), the writer into folder/dcp (and from there to the bucket prefix
    `upload`), and a planner that writes replicated tensors (BatchNorm statistics) from the
    lowest rank."""
    path = os.path.join(folder, SHARDED_DIR)
    writer = (
        UploadingWriter(path, upload, sync_files=False)
        if upload
        else dcp.FileSystemWriter(path, sync_files=True)
    )
    return {
        "state_dict": state,
        "storage_writer": writer,
        "planner": DefaultSavePlanner(dedup_save_to_lowest_rank=True),
    }


def save(state: dict, folder: str, upload: str | None = None) -> None:
    """Every rank writes its shards of `state` into folder/dcp (a collective); `upload`: a
    bucket prefix each rank uploads its shard files to."""
    try:
        dcp.save(**_save_args(state, folder, upload))
    except CheckpointException as e:
        raise ShardWriteError(describe_error(e)) from None


class HostCopy:
    """DCP's staging for background writes: this rank's shards copied into host buffers made at
    the first save and reused after (fresh buffers cost ~5x the copy in page faults here; DCP's
    own cache pins them, which needs a GPU driver). Safe to reuse: the checkpointer waits for a
    write before it starts the next one."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers = None

    def stage(self, state_dict):
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._buffers is None:
            pin = torch.cuda.is_available()
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=pin)
        return _copy_state_dict(state_dict, self._buffers)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save_in_background(state: dict, folder: str, group, stager=None, upload: str | None = None):
    """Start save() in the background (a collective): every rank copies its shards to host
    memory now (with `stager`, a HostCopy, into its buffers) and writes them on DCP's thread,
    whose plan and metadata exchange run on `group`.
    Returns a Future; its result() raises ShardWriteError when any rank could not write."""
    from concurrent.futures import Future

    upload = dcp.async_save(
        **_save_args(state, folder, upload),
        process_group=group,
        async_stager=stager,  # None: the writer's own (fresh host buffers every save)
    )
    upload = getattr(upload, "upload_completion", upload)  # AsyncSaveResponse or a Future
    done: Future = Future()

    def settle(f: Future) -> None:
        try:
            error = f.exception()
        except BaseException as e:  # cancelled
            error = e
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(ShardWriteError(describe_error(error)))

    upload.add_done_callback(settle)
    return done


def shard_files(folder: str) -> list[str]:
    """The shard files the metadata in folder/dcp names (relative to it)."""
    metadata = read_metadata(os.path.join(folder, SHARDED_DIR))
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def missing_shards(folder: str) -> list[str]:
    """Shard files the metadata names that are not in folder/dcp: another node wrote them to
    storage this one cannot see."""
    path = os.path.join(folder, SHARDED_DIR)
    return [n for n in shard_files(folder) if not os.path.isfile(os.path.join(path, n))]


def load(state: dict, folder: str) -> None:
    """Fill `state` (ModelState.state_dict's form, this rank's layout) from the shards in
    folder/dcp, whatever strategy and world size saved them (a collective)."""
    _load(state, os.path.join(folder, SHARDED_DIR))


def read_model(folder: str) -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint as plain CPU tensors, in this one process.

    Shapes and dtypes come from the metadata, so no model (and no process group) is needed:
    what `trainer export` and `trainer eval` use.
    """
    path = os.path.join(folder, SHARDED_DIR)
    metadata = read_metadata(path)
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    _load(state, path, no_dist=True)
    return {key.removeprefix("model."): value for key, value in state.items()}


def model_layout(folder: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The whole model's names, shapes and dtypes in a sharded checkpoint, from its metadata."""
    metadata = read_metadata(os.path.join(folder, SHARDED_DIR))
    return {
        key.removeprefix("model."): (tuple(m.size), m.properties.dtype)
        for key, m in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }


def iter_model(folder: str):
    """(name, its whole tensor) for each of the model's tensors in a sharded checkpoint, one at
    a time, in this one process: an export never holds more than one."""
    path = os.path.join(folder, SHARDED_DIR)
    for name, (shape, dtype) in model_layout(folder).items():
        state = {f"model.{name}": torch.empty(shape, dtype=dtype)}
        _load(state, path, no_dist=True)
        yield name, state[f"model.{name}"]


def read_local_model(template: dict[str, torch.Tensor], folder: str) -> dict[str, torch.Tensor]:
    """This rank's part of the weights stored in a sharded checkpoint, laid out as `template`
    (the live model's state in DCP's form), on the CPU (a collective): what the dry run
    compares against the live weights."""
    state = {"model": {k: torch.empty_like(v) for k, v in template.items()}}
    _load(state, os.path.join(folder, SHARDED_DIR))
    return {k: local_part(v).detach().cpu() for k, v in state["model"].items()}
