"""Resume decisions, as pure functions: which checkpoint, and whether (and how) it continues this
run. The checkpointer (manager.py) acts on the record they return; nothing here loads tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer.checkpoint import store
from trainer.checkpoint.weights import flatten
from trainer.config import Config, to_dict
from trainer.errors import ConfigError, UsageError, first_line

RESUMABLE_CHANGES = (
    "name",
    "run_dir",
    "log.",
    "ckpt.",
    "dist.",
    "repro.",
    "train.epochs",
    "train.max_steps",
    "train.eval_every_steps",
    "train.eval_every_epochs",
    "train.micro_batch_size",
    "train.compile",  # and train.compile_loss
    "optim.fused",  # kernels: the checkpoint's own choice is not loaded (namedstate.own_kernels)
    "train.channels_last",
    "train.activation_checkpointing",
    "fsdp.",
    "data.root",
    "data.download",
    "data.num_workers",
    "data.shards.cache_dir",  # where a node keeps the shards, and how many: not which are read
    "data.shards.cache_gb",
    "data.pin_memory",
    "data.persistent_workers",
    "data.device_resident",
    "data.eval_batch_size",
)
"""Keys that may change between a save and a resume without changing what is computed."""

SCHEDULE_KEYS = ("train.epochs", "train.max_steps")
"""Keys a resume may change that move the run's last step, and with it the lr schedule (a
function of the step and the total): said in one line and recorded, never silent."""


def schedule_changes(saved: dict, current: dict) -> dict[str, list]:
    """{key: [saved, current]} for the SCHEDULE_KEYS a resume changes."""
    a, b = flatten(saved), flatten(current)
    return {k: [a.get(k), b.get(k)] for k in SCHEDULE_KEYS if a.get(k) != b.get(k)}


def config_conflicts(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every change a resume cannot honour exactly."""
    a, b = flatten(saved), flatten(current)
    defaults = flatten(to_dict(Config()))
    diffs = []
    # LoRA reloads its frozen base from ckpt.init_* at every start: another base is another run.
    base = ("ckpt.init_",) if b.get("optim.lora_targets") else ()
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) == b.get(key):
            continue
        if key.startswith(RESUMABLE_CHANGES) and not key.startswith(base):
            continue
        if key not in a and b.get(key) == defaults.get(key):
            continue  # a key added since the save, at its default: what the saving version did
        diffs.append(f"{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return diffs


def choose_resume(resume: str, root: str, warn, skip=()) -> str | None:
    """The checkpoint to resume from for ckpt.resume (auto | never | PATH), or None.

    `skip`: checkpoints that verified but turned out damaged on loading (passed over like
    corrupt ones)."""
    if resume == "never":
        return None
    if resume == "auto":
        found = store.latest_valid(root, warn, skip)
        if found is None and store.list_checkpoints(root):
            # Starting fresh would overwrite them and the run's metrics: let the user decide.
            count = len(store.list_checkpoints(root))
            raise UsageError(
                f"ckpt.resume=auto: no checkpoint in {root} verifies ({count} found, all damaged; "
                f"{_manifest_hint(root)}): resume from a good copy with ckpt.resume=PATH, or "
                "start fresh: move them away, or use a new run_dir"
            )
        return found
    path = resume
    if not os.path.isdir(path):
        raise UsageError(f"ckpt.resume={path}: no such checkpoint directory (or use auto / never)")
    if not store.is_step_dir(path):  # a run dir or a checkpoints folder
        candidate = store.latest_in(path, warn, skip)
        if candidate is None:
            raise _nothing_to_resume(path)
        return candidate
    try:
        store.verify(path)
    except store.CorruptCheckpoint as e:
        raise UsageError(f"ckpt.resume={path}: corrupt checkpoint ({e}); pick another") from None
    return path


def _manifest_hint(folder: str) -> str:
    """How to find a damaged checkpoint's bad files: its manifest lists every file's sha256."""
    newest = os.path.basename(store.list_checkpoints(folder)[0][1])
    return f"`sha256sum -c {store.MANIFEST}` in a step folder, e.g. {newest}, names its bad files"


def _nothing_to_resume(path: str) -> UsageError:
    """ckpt.resume=PATH names a run directory or checkpoints folder with no checkpoint that
    verifies: where it looked, and the ways on."""
    fresh = "or start fresh with ckpt.resume=never or a new run_dir"
    inner = os.path.join(path, "checkpoints")
    folder = next((f for f in (path, inner) if store.list_checkpoints(f)), None)
    if folder is None:
        return UsageError(
            f"ckpt.resume={path}: no checkpoint (step-NNNNNNNNN folder) in it or in {inner}: "
            "point ckpt.resume at a run directory, its checkpoints folder or one step folder, "
            + fresh
        )
    count = len(store.list_checkpoints(folder))
    return UsageError(
        f"ckpt.resume={path}: holds no checkpoint that verifies ({count} in {folder}, all "
        f"damaged; {_manifest_hint(folder)}): point ckpt.resume at another run or checkpoint, "
        + fresh
    )


def saved_config(config_yaml: str) -> dict:
    """A checkpoint's config.yaml as a plain mapping; CorruptCheckpoint if it is not one."""
    from omegaconf import DictConfig, OmegaConf

    try:
        saved = OmegaConf.create(config_yaml)
    except Exception as e:  # YAML syntax, or a value OmegaConf cannot hold
        raise store.CorruptCheckpoint(f"config.yaml is not YAML ({first_line(e)})") from None
    if not isinstance(saved, DictConfig):
        raise store.CorruptCheckpoint(
            f"config.yaml holds a {type(saved).__name__}, not a config mapping"
        )
    return OmegaConf.to_container(saved)


def kernel_changes(saved: dict | None, here: dict) -> list[str]:
    """'key saved -> here' for each kernel fact (device kind, kernels, torch, threads) a
    checkpoint was written with that differs here."""
    if not isinstance(saved, dict):
        return []
    return [f"{k} {saved.get(k)!r} -> {here.get(k)!r}" for k in here if saved.get(k) != here.get(k)]


@dataclass(frozen=True)
class Resume:
    """The decision to continue a run from a checkpoint."""

    path: str
    loop: dict
    """meta.json's loop position (LoopState's fields)."""
    results: dict
    """meta.json's results so far (Results.to_dict's shape)."""
    schedule_changes: dict[str, list] = field(default_factory=dict)
    """The schedule-shaping keys the resume changes (SCHEDULE_KEYS): {key: [saved, now]}."""
    seconds: float = 0.0
    """How long finding, fetching, verifying and loading the checkpoint took."""

    @property
    def step(self) -> int:
        return self.loop["step"]


def decide(path: str, payload: dict, current: dict, kernels: dict, bitwise: bool) -> Resume:
    """Whether the checkpoint at `path` (store.read's payload) continues a run of config
    `current` (a plain mapping) on these `kernels`: the Resume, or a ConfigError naming what
    changed and how to go on (`bitwise`: repro.world_invariant, which needs the same kernels).
    CorruptCheckpoint for a config.yaml that is not a config."""
    saved = saved_config(payload["config_yaml"])
    conflicts = config_conflicts(saved, current)
    if conflicts:
        elsewhere = "a new ckpt.dir" if (current.get("ckpt") or {}).get("dir") else "a new run_dir"
        raise ConfigError(
            f"cannot resume {path}: the config changed ({'; '.join(conflicts[:4])}); "
            f"use the saved values, or start fresh with ckpt.resume=never or {elsewhere}"
        )
    meta = payload["meta"]
    changed = kernel_changes(meta.get("kernels"), kernels) if bitwise else []
    if changed:
        raise ConfigError(
            f"cannot resume {path} bit for bit: it was written with other kernels "
            f"({'; '.join(changed)}): resume where it was written, or start afresh "
            "(ckpt.resume=never); repro.world_invariant=false resumes without the promise"
        )
    return Resume(
        path=path,
        loop=dict(meta["loop"]),
        results=meta.get("results", {}),
        schedule_changes=schedule_changes(saved, current),
    )


def resume_line(resume: Resume, epoch: int, step_in_epoch: int, note: str) -> str:
    """The console line that says where the run continues (epochs counted from 1)."""
    return (
        f"resumed from {resume.path} (step {resume.step}, epoch {epoch + 1}, "
        f"step {step_in_epoch} of the epoch){note}"
    )


def schedule_line(resume: Resume, sched_name: str) -> str | None:
    """The line that says a resume moved the run's end (and so its lr schedule), or None."""
    if not resume.schedule_changes:
        return None
    changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in resume.schedule_changes.items())
    return (
        f"resume changes {changes}: the run now ends at another step, and the lr "
        f"schedule (sched.name={sched_name}) is recomputed for the new length "
        "from here on (recorded in run.json and metrics.jsonl)"
    )
