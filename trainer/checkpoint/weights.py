"""Plain weights in and out: from a run, a checkpoint (whole or sharded) or any state_dict file;
to safetensors.

Weights saved by DataParallel/DDP (`module.`) or torch.compile (`_orig_mod.`) load into the plain
model, and a GPU-saved file loads on the CPU. `export` writes what loads with safetensors alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import torch
from torch import nn

from trainer import hf, rundir, storage
from trainer.checkpoint import store
from trainer.checkpoint.streamed import StreamWriter
from trainer.errors import UsageError, file_kind, io_error, shorten
from trainer.namedstate import dtype_mismatch
from trainer.state import fit_problem, non_finite
from trainer.strategy import unwrap

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove DataParallel/DDP (`module.`) and torch.compile (`_orig_mod.`) key prefixes."""
    out = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def save_weights(
    state: dict[str, torch.Tensor], directory: str, metadata: dict | None = None
) -> str:
    """Write `directory/model.safetensors` atomically; loads with plain safetensors, no trainer."""
    with store.atomic_dir(directory) as tmp:
        store.save_safetensors(state, os.path.join(tmp, "model.safetensors"), metadata)
    return os.path.join(directory, "model.safetensors")


def save_streamed(directory: str, layout: dict, tensors, metadata: dict | None = None) -> str:
    """`directory/model.safetensors` written atomically from `tensors` ((name, tensor) in
    `layout`'s order: {name: (shape, dtype)}), one at a time (streamed.py)."""
    with store.atomic_dir(directory) as tmp:
        _stream(os.path.join(tmp, "model.safetensors"), layout, tensors, metadata)
    return os.path.join(directory, "model.safetensors")


def _stream(path: str, layout: dict, tensors, metadata: dict | None) -> None:
    writer = StreamWriter(path, layout, metadata)
    try:
        for name, tensor in tensors:
            writer.write(name, tensor)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _checkpoint_at(folder: str) -> str | None:
    """The checkpoint `folder` is (verified), or the newest valid one inside it, or None."""
    if store.is_step_dir(folder):
        try:
            store.verify(folder)
        except store.CorruptCheckpoint as e:
            raise UsageError(f"{folder}: corrupt checkpoint ({e}): pick another") from None
        return folder
    return store.latest_in(folder)


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """Weights from a checkpoint dir (whole or sharded), a run dir (its newest valid checkpoint,
    else final/), .safetensors, or a .pt/.pth/.bin state_dict (any prefix).

    Tensors come back on the CPU whatever device saved them; load_state_dict then copies them
    to wherever the model lives (a GPU checkpoint loads on CPU or on another GPU index).
    """
    return read_source(path)[0]


def read_source(path: str) -> tuple[dict[str, torch.Tensor], tuple[str, dict] | None]:
    """read_weights' weights, and (its path, its contents) of the config.json of a Hugging Face
    folder (beside a shard index too), else None: what ckpt.init_convert=hf_gpt2 checks."""
    if storage.is_url(path):  # s3://: a verified local copy, read as any local one
        with store.fetched(path) as local:
            return read_source(local)
    if path.endswith(".index.json") and os.path.isfile(path):
        config = _hf_config(os.path.dirname(path))
        return _finite(_read_files(hf.index_files(path)), path), config
    if os.path.isdir(path):
        checkpoint = _checkpoint_at(path)
        if checkpoint is not None and store.is_sharded(checkpoint):
            from trainer.checkpoint import sharded

            return _finite(sharded.read_model(checkpoint), checkpoint), None
        if checkpoint is None and hf.is_folder(path):  # a Hugging Face folder, maybe sharded
            config = _hf_config(path)
            return _finite(_read_files(hf.weight_files(path)), path), config
        folder = checkpoint or os.path.join(path, "final")
        if not os.path.isfile(os.path.join(folder, "model.safetensors")):
            raise UsageError(
                f"{path}: no verified checkpoint or final/model.safetensors inside: "
                "point at a checkpoint directory, a run directory or a weights file"
            )
        path = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(path):
        if os.path.exists(path):  # a FIFO, socket or device: a read would block or never end
            raise UsageError(
                f"{path}: not a regular file ({_kind(os.stat(path).st_mode)}): point at a "
                "weights file, a checkpoint or run directory, or a Hugging Face folder"
            )
        raise UsageError(f"{path}: no such weights file or directory")
    return _finite(_read_file(path), path), None


def _hf_config(folder: str) -> tuple[str, dict] | None:
    config = hf.check_gpt2_config(folder)
    return None if config is None else (os.path.join(folder, "config.json"), config)


def _read_file(path: str) -> dict[str, torch.Tensor]:
    """One weights file (.safetensors, else a torch.save'd state_dict), prefixes stripped."""
    if path.endswith(".safetensors"):
        state = store.read_safetensors(path)
    else:
        state = _torch_load(path)
        for key in ("model", "state_dict", "model_state_dict"):  # common wrappers
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise UsageError(
            f"{path}: does not hold a state_dict of tensors (a dict of name -> tensor): re-save "
            "the weights with torch.save(model.state_dict(), path)"
        )
    plain = strip_prefixes(state)
    if len(plain) < len(state):
        seen: dict[str, str] = {}
        for key in state:
            name = strip_prefixes({key: None}).popitem()[0]
            if name in seen:
                raise UsageError(
                    f"{path}: holds both {seen[name]} and {key}, one tensor {name} under a "
                    "wrapper's prefix (module., _orig_mod.) and without: re-save the plain "
                    "model's state_dict"
                )
            seen[name] = key
    return plain


_PICKLE_WHY = (
    (re.compile(r"GLOBAL ([\w.]+)"), "it names {}"),
    (re.compile(r"Unsupported operand (\d+)"), "pickle opcode {}"),
)
"""What torch's refusal names (torch 2.14's words): a global it would import, or an opcode its
unpickler does not take."""


def _torch_load(path: str):
    """A torch.save'd file through store.torch_load (weights_only: tensors and plain
    containers), as one line of ours when refused: no warning of torch's before it (a pickle
    protocol it does not expect) and none of its advice (to load with weights_only=False, which
    would run the file's code)."""
    import pickle
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pickle protocol", category=UserWarning)
        try:
            return store.torch_load(path, mmap=True)
        except UsageError as e:
            cause = e.__context__
            if not isinstance(cause, pickle.UnpicklingError):
                raise
            found = [form.format(m[1]) for r, form in _PICKLE_WHY if (m := r.search(str(cause)))]
            what = f" ({shorten(found[0], 80)})" if found else ""
    raise UsageError(
        f"{path}: refused to load (read with weights_only=True): it holds pickled objects "
        f"other than tensors and plain containers{what}, which could run code: re-save the "
        "weights as safetensors, or with torch.save(model.state_dict(), path)"
    )


def _read_files(paths: list[str]) -> dict[str, torch.Tensor]:
    """The shards of one state dict, merged (a name in two shards is refused)."""
    state: dict[str, torch.Tensor] = {}
    for path in paths:
        part = _read_file(path)
        if twice := sorted(state.keys() & part.keys()):
            raise UsageError(
                f"{path}: holds {twice[0]} again (another shard has it): fix the index"
            )
        state.update(part)
    return state


def _finite(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    if bad := non_finite(state):
        raise UsageError(f"{path}: {non_finite_text(bad)}")
    return state


def non_finite_text(bad: list[str], what: str = "the weights hold") -> str:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return (
        f"{what} NaN/inf values ({bad[0]}{more}): the run that saved them diverged; "
        "use an earlier checkpoint (RUN/checkpoints/step-N)"
    )


def load_weights_into(model: nn.Module, path: str, model_cfg=None) -> None:
    """Load weights (any prefix, any device of origin, any saving layout) into `model`,
    strictly: every name and every shape must match, and every value must be finite
    (read_weights refuses NaN/inf).

    `model_cfg` (the ModelConfig that built `model`) lets a mismatch name the config key that
    differs from the config saved with the weights."""
    state = read_weights(path)
    problem = fit_problem(unwrap(model), state)
    if problem and any(".lora_A." in k for k in state):
        raise UsageError(
            f"{path}: holds LoRA adapters (optim.lora_targets), not a whole model: merge them "
            f"into their base weights first (trainer export {path} --merge -o OUT), then use OUT"
        )
    if problem and problem == dtype_mismatch(unwrap(model).state_dict(), state):
        raise UsageError(
            f"{path}: weights do not fit model ({problem}): these are not this model's trained "
            "weights; point at a run, checkpoint or weights file of it"
        )
    if problem:
        raise UsageError(
            f"{path}: weights do not fit model ({problem}): {config_hint(path, model_cfg)}"
        )
    unwrap(model).load_state_dict(state)


_LIKELY_KEY = {
    "mlp": "model.hidden",
    "gpt": "model.gpt.* (width, layers, heads, context)",
    "lenet": "model.num_classes / model.in_channels / data.name",
    "resnet18": "model.num_classes / model.in_channels / data.name",
    "vgg11": "model.num_classes / model.in_channels / data.name",
}


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts -> {"a.b.c": value} (config comparisons)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_hint(path: str, model_cfg=None) -> str:
    """The config key(s) most likely to make weights at `path` fit: the model.* values that
    differ from the config saved with them, else the shape-setting key of this model family."""
    if model_cfg is None:
        return "check model.* matches the run that saved them"
    from omegaconf import OmegaConf

    here = flatten(OmegaConf.to_container(OmegaConf.structured(model_cfg)), "model.")
    saved_path = find_config(path)
    saved = None
    if saved_path:
        try:
            saved = OmegaConf.to_container(OmegaConf.load(saved_path)).get("model")
        except Exception:  # an unreadable config.yaml only costs the hint its precision
            saved = None
    if isinstance(saved, dict):
        there = flatten(saved, "model.")
        diffs = [
            f"{k} ({there.get(k)!r} in {saved_path}, {here.get(k)!r} here)"
            for k in sorted(there.keys() | here.keys())
            if there.get(k) != here.get(k)
        ]
        if diffs:
            return f"likely config key {'; '.join(diffs[:3])}: set it as the saving run did"
    name = str(here.get("model.name"))
    key = _LIKELY_KEY.get(name, "model.kwargs (the factory's arguments)")
    return f"check {key} matches the run that saved them"


def find_config(src: str) -> str | None:
    """The config.yaml that describes weights at `src` (checkpoint dir, run dir, or beside a file)."""
    folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    for candidate in (folder, os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))):
        path = os.path.join(candidate, "config.yaml")
        if os.path.isfile(path):
            return path
    return None


def export(src: str, out: str | None = None, fmt: str = "plain", merged=None) -> str:
    """Plain safetensors from a run dir, checkpoint, or any .pt/.pth/.safetensors state_dict;
    fmt="hf-gpt2": a Hugging Face GPT-2 folder (config.json + model.safetensors) of a
    model.name=gpt run. `merged`: a callable giving the weights instead of reading them
    (`--merge`: LoRA adapters folded into their base weights).

    Checked in the order a user reads the command: the source exists, the output may be
    written, the weights are whole and finite; nothing is written until all three hold."""
    if not os.path.exists(src):
        swapped = out is not None and os.path.exists(out) and not _is_export(out)
        raise UsageError(
            f"export {src}: no such run directory, checkpoint or weights file: "
            + (
                f"the source comes first, the output after -o: trainer export {out} -o {src}"
                if swapped
                else "name what to export first (trainer export RUN_DIR -o OUT)"
            )
        )
    default = out is None
    if out is None:  # RUN/export for a run; beside any other source, never inside it
        out = (
            os.path.join(src, "export")
            if rundir.is_run(src)
            else os.path.normpath(src) + "-export"
            if os.path.isdir(src)
            else os.path.splitext(src)[0] + "-export"
        )
    _check_out(out, src, default)  # before reading: a bad -o fails at once
    if fmt == "plain" and merged is None and (sharded := _sharded_checkpoint(src)):
        return _export_streamed(sharded, out, find_config(src))
    state = merged() if merged else read_weights(src)
    config = find_config(src)
    hf_config = _hf_gpt2(state, config) if fmt == "hf-gpt2" else None
    if hf_config:
        state = hf.to_gpt2(state)
    try:
        with store.atomic_dir(out) as tmp:  # on any error the temporary folder goes, out stays
            store.save_safetensors(
                {k: v.contiguous() for k, v in state.items()},
                os.path.join(tmp, "model.safetensors"),
                EXPORT_METADATA,
            )
            if hf_config:
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    json.dump(hf_config, f, indent=2)
            if config and merged:  # a whole model now: its config names no adapters
                with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
                    f.write(_without_lora(config))
            elif config:
                shutil.copyfile(config, os.path.join(tmp, "config.yaml"))
    except OSError as e:
        raise io_error(e, f"export -o {out}", "name a directory on writable storage") from None
    return os.path.join(out, "model.safetensors")


def _without_lora(config_path: str) -> str:
    """A LoRA run's config.yaml for its merged weights: optim.lora_* back to their defaults (the
    adapters are in the weights), the rest as the run had it."""
    import dataclasses

    from trainer import config

    cfg = config.load(config_path, [])
    defaults = config.OptimConfig()
    optim = dataclasses.replace(
        cfg.optim,
        lora_targets=defaults.lora_targets,
        lora_also_train=defaults.lora_also_train,
        lora_rank=defaults.lora_rank,
        lora_alpha=defaults.lora_alpha,
    )
    return config.to_yaml(dataclasses.replace(cfg, optim=optim))


def _sharded_checkpoint(src: str) -> str | None:
    """The sharded checkpoint `src` is or holds (its newest valid one), else None."""
    if not os.path.isdir(src):
        return None
    checkpoint = _checkpoint_at(src)
    return checkpoint if checkpoint is not None and store.is_sharded(checkpoint) else None


def _export_streamed(checkpoint: str, out: str, config: str | None) -> str:
    """A sharded checkpoint's model exported tensor by tensor (no whole copy in memory); a
    tensor holding NaN/inf stops it, and nothing is written."""
    from trainer.checkpoint import sharded

    def finite(tensors):
        for name, t in tensors:
            if t.is_floating_point() and not bool(t.isfinite().all()):
                raise UsageError(f"{checkpoint}: {non_finite_text([name])}")
            yield name, t

    layout = sharded.model_layout(checkpoint)
    try:
        with store.atomic_dir(out) as tmp:  # on any error the temporary folder goes, out stays
            tensors = finite(sharded.iter_model(checkpoint))
            _stream(os.path.join(tmp, "model.safetensors"), layout, tensors, EXPORT_METADATA)
            if config:
                shutil.copyfile(config, os.path.join(tmp, "config.yaml"))
    except OSError as e:
        raise io_error(e, f"export -o {out}", "name a directory on writable storage") from None
    return os.path.join(out, "model.safetensors")


EXPORTED = {"model.safetensors", "config.yaml", "config.json"}
EXPORT_METADATA = {"format": "pt", "written_by": "trainer export"}
"""The metadata of an export's model.safetensors: what tells an earlier export (which a new
one may replace) from a folder of the same file names it did not write (a run's final/, a
download of another model)."""


def _hf_gpt2(state: dict, config: str | None) -> dict:
    """The config.json of a GPT-2 folder for our GPT's weights (heads: the run's config.yaml)."""
    if "tok.weight" not in state or "pos.weight" not in state:
        raise UsageError(
            "export --format hf-gpt2: these weights are not a model.name=gpt model's (no "
            "tok.weight/pos.weight): export them without --format"
        )
    heads = None
    if config:
        from omegaconf import OmegaConf

        heads = OmegaConf.select(OmegaConf.load(config), "model.gpt.heads")
    if not heads:
        raise UsageError(
            "export --format hf-gpt2: no config.yaml beside the weights says model.gpt.heads: "
            "export a run or checkpoint directory"
        )
    return hf.gpt2_config(state, int(heads))


def check_bucket_out(url: str) -> None:
    """`export -o s3://...`: the prefix holds nothing but an earlier export's objects (those
    are replaced), so an export never writes over what it did not write itself."""
    with storage.explained(f"export -o {url}"):
        names = {rel for rel, _ in storage.walk(url)}
        other = sorted(names - EXPORTED)
        # model.safetensors goes up last: a prefix without it is an upload cut short
        foreign = not other and "model.safetensors" in names and not _bucket_export(url)
    if other:
        raise UsageError(
            f"export -o {url}: the prefix holds other objects ({', '.join(other[:3])}) that an "
            "export would mix with: name a new prefix (or an earlier export's)"
        )
    if foreign:
        raise UsageError(
            f"export -o {url}: the prefix holds a model.safetensors no export wrote (another "
            "model's weights?) that an export would replace: name a new prefix (or an earlier "
            "export's)"
        )


def _bucket_export(url: str) -> bool:
    """Whether url/model.safetensors is an export's (EXPORT_METADATA in its header: the
    header alone is read, two ranged reads)."""
    bucket, key = storage.split(storage.join(url, "model.safetensors"))

    def read(start: int, end: int) -> bytes:
        where = f"bytes={start}-{end}"
        return storage.client().get_object(Bucket=bucket, Key=key, Range=where)["Body"].read()

    what = f"reading {storage.join(url, 'model.safetensors')}"
    size = int.from_bytes(storage.retried(what, lambda: read(0, 7)), "little")
    if not 2 <= size <= _MAX_HEADER:
        return False
    try:
        header = json.loads(storage.retried(what, lambda: read(8, 7 + size)).decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get("written_by") == EXPORT_METADATA["written_by"]


def upload_export(folder: str, url: str) -> str:
    """The files of the local export `folder` uploaded under `url` (each with its sha256),
    model.safetensors last; returns its URL."""
    names = sorted(os.listdir(folder), key=lambda n: n == "model.safetensors")
    with storage.explained(f"export -o {url}"):
        for name in names:
            path = os.path.join(folder, name)
            storage.put_file(path, storage.join(url, name), storage.sha256_file(path))
    return storage.join(url, "model.safetensors")


SCAN_DEPTH = 4
"""How deep check_source looks into a source folder (RUN/checkpoints/step-N/dcp/FILE)."""


def check_source(src: str) -> None:
    """A local source of eval or export is a regular file or a folder whose entries (SCAN_DEPTH
    deep, links followed to files) are files and folders only: a FIFO where a weights file,
    manifest or config is read would block the read forever, a device would never end. One
    line naming it instead. A source that does not exist is left to the reader to name."""
    try:
        info = os.stat(src)
    except OSError:
        return
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        raise UsageError(
            f"{src}: is {_kind(info.st_mode)}, not a run directory, checkpoint or weights file: "
            "name one of those"
        )
    if stat.S_ISDIR(info.st_mode):
        _scan(src, src, SCAN_DEPTH)


def _scan(src: str, folder: str, depth: int) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return  # an unreadable folder: the reader names it, if it reads it at all
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if depth > 1:
                    _scan(src, entry.path, depth - 1)
                continue
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a dangling link: read as missing
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UsageError(
                f"{src}: {entry.path} is {_kind(mode)}, not a file, which a read would block "
                "on or never finish: remove it, or point at another source"
            )


def _kind(mode: int) -> str:
    return file_kind(mode, "not a regular file")


def _is_export(path: str, legacy: bool = False) -> bool:
    """An earlier export's folder, which a new export may replace: a real folder (not a link)
    of regular files, only names export writes, and a model.safetensors export marked as its
    own (EXPORT_METADATA): a run's final/ or another model's download is not one.

    `legacy`: also an export of the versions before the mark (metadata {"format": "pt"}
    alone), where nothing else can be: RUN/export, the default for a run."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        names = set(os.listdir(path))
    except OSError:
        return False
    if "model.safetensors" not in names or not names <= EXPORTED:
        return False
    for name in names:
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(path, name)).st_mode):
                return False
        except OSError:
            return False
    header = _safetensors_header(os.path.join(path, "model.safetensors"))
    meta = header.get("__metadata__") if header else None
    if legacy and meta == {"format": "pt"}:
        return True
    return isinstance(meta, dict) and meta.get("written_by") == EXPORT_METADATA["written_by"]


_MAX_HEADER = 100 * 1024 * 1024
"""safetensors' own bound on a header."""


def _safetensors_header(path: str) -> dict | None:
    """The JSON header of the safetensors file at `path`, or None when it is not one. Looked at
    before it is read: a regular file only (no FIFO, device or link is opened), opened without
    blocking, and no more than its header read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < 8:
            return None
        size = int.from_bytes(os.pread(fd, 8, 0), "little")
        if not 2 <= size <= min(_MAX_HEADER, info.st_size - 8):
            return None
        header = json.loads(os.pread(fd, size, 8).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return header if isinstance(header, dict) else None


def _owner(path: str) -> tuple[str, str] | None:
    """(folder, what) of the run folder, else the checkpoint, that `path` is or lies inside
    (where it really is, links resolved), the innermost; None when it is in neither."""
    from trainer.checkpoint.files import MANIFEST

    here, checkpoint = os.path.realpath(path), None
    while True:
        if checkpoint is None and os.path.isfile(os.path.join(here, MANIFEST)):
            checkpoint = here  # a checkpoint of a run is named by its run
        if rundir.is_run(here):
            return here, "run folder"
        parent = os.path.dirname(here)
        if parent == here:
            return None if checkpoint is None else (checkpoint, "checkpoint")
        here = parent


def _inside(path: str, folder: str) -> bool:
    """Whether the real path `path` lies strictly inside the real folder `folder`."""
    return path != folder and os.path.commonpath([path, folder]) == folder


def _check_out(out: str, src: str | None = None, default: bool = False) -> None:
    """`out` is a directory export may create or replace: its parent exists and is a directory;
    it is no link; it is neither the source, nor inside it, nor holds it; it is not, and is not
    inside, a run folder or a checkpoint (a run's own files: final/, checkpoints/ ...), except a
    run folder's export/ (the default for a run); and it is absent, empty, or an earlier export
    (_is_export). Anything else would be lost when the new export replaces it.

    `default`: `out` is the default for `src` (no -o given): the message says so."""
    where = f"export {src}: its default output {out}" if default else f"export -o {out}"
    fix = "name the output with -o, a new folder" if default else "name a new folder"
    _check_out_place(out, where, fix)
    real = os.path.realpath(out)
    owner = _owner(out)
    run_export = owner is not None and owner[1] == "run folder"
    run_export = run_export and real == os.path.join(owner[0], "export")
    source = None
    if src is not None and not storage.is_url(src) and os.path.exists(src):
        source = os.path.realpath(src)
    if source is not None and (real == source or _inside(source, real)):
        relation = "is the source itself" if real == source else f"holds the source {src}"
        raise UsageError(
            f"{where}: {relation}: an export never writes over what it reads: {fix} elsewhere"
        )
    try:
        names = set(os.listdir(out)) if os.path.isdir(out) else set()
    except OSError as e:
        raise UsageError(f"{where}: cannot be listed ({e.strerror}): {fix}") from None
    if owner is not None and not run_export:
        folder, what = owner
        placed = "is" if real == folder else "is inside"
        held = f" and holds other files ({', '.join(sorted(names)[:3])})" if names else ""
        also = f" (or {os.path.join(folder, 'export')})" if what == "run folder" else ""
        through = f" (really {real})" if real != os.path.abspath(out) else ""
        raise UsageError(
            f"{where}{through}: {placed} the {what} {folder}{held}, and an export never writes "
            f"into a run's own folders: {fix} outside it{also}"
        )
    if source is not None and _inside(real, source) and not run_export:
        raise UsageError(
            f"{where}: is inside the source {src}: an export never writes into what it reads: "
            f"{fix} elsewhere"
        )
    if os.path.isdir(out):
        if names and not _is_export(out, legacy=run_export):
            other = sorted(names - EXPORTED) or sorted(names)
            what = "other files" if names - EXPORTED else "files no export wrote"
            raise UsageError(
                f"{where}: a folder that holds {what} ({', '.join(other[:3])}) would be "
                f"replaced: {fix} (or an earlier export's)"
            )
    elif os.path.lexists(out):
        raise UsageError(f"{where}: is a file, not a directory: {fix}")


def _check_out_place(out: str, where: str, fix: str) -> None:
    """`out`'s parent exists and is a folder, and `out` is no link (an export replaces what -o
    names: the link, not what it points at)."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        if os.path.exists(parent):
            raise UsageError(f"{where}: {parent} is a file, not a folder: fix the path")
        raise UsageError(f"{where}: the folder {parent} does not exist: create it first")
    if os.path.islink(out):
        raise UsageError(
            f"{where}: is a symbolic link (to {os.readlink(out)}), which an export would "
            f"replace: {fix} (or the folder itself, if it is an earlier export)"
        )
