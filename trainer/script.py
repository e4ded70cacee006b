"""`trainer.fit`: train your own model, data and task from your own script.

    # train.py
    import sys, trainer
    from mypkg import build_model, load_data, MyTask

    if __name__ == "__main__":
        trainer.fit("my.yaml", sys.argv[1:], model=build_model, data=load_data, task=MyTask())

    torchrun --standalone --nproc-per-node=2 train.py optim.lr=0.01
    trainer-launch -- python train.py optim.lr=0.01      # in a container (compose, Kubernetes)

It is `trainer train` with objects in place of registry names: the same run folder, metrics,
checkpoints, resume, SIGTERM handling, world invariance, export and exit codes. A failure ends
the process as `trainer train` would (one line and exit 2, 3 or 4; a bug keeps its traceback);
`exit_on_error=False` raises the error instead (a notebook, a sweep in one process).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

from trainer.errors import ExitCode, TrainerError, UsageError
from trainer.exitstatus import record_exit, report

GIVEN = "<fit>"
"""The module part of a recorded name for an object only the calling script can hand over (a
module-level object, or a function defined in __main__ or inside a function)."""


def fit(
    config=None,
    overrides: Sequence[str] = (),
    *,
    model=None,
    data=None,
    task=None,
    dry_run: bool = False,
    exit_on_error: bool = True,
) -> dict:
    """Train one rank of the job (torchrun's environment, or one process); the run's summary.

    config: a preset name, a YAML file, a run folder (as `--config`), a dict of config values
        (it may hold `preset: NAME`), a trainer.config.Config, or None (the default preset);
    overrides: `key=value` strings applied last, e.g. sys.argv[1:];
    model: a torch.nn.Module, or a factory called as model.name's are (with in_shape,
        num_classes, data, ... as it names them, plus model.kwargs) after seeding every rank
        alike. A factory gives every world size the same initial weights; a module is used as
        it is (DDP copies rank 0's weights to the others);
    data: a trainer.DataSpec, or a factory (DataConfig, seed) -> DataSpec;
    task: a trainer.Task, or a Task subclass or factory (called with data, num_classes, ...
        as it names them, plus task.kwargs);
    dry_run: `trainer train --dry-run`: one step on an epoch's last batch, one evaluation batch
        (metrics and summarize), a checkpoint round trip; nothing is kept, and the dry run's
        report is returned, not a summary (trainer/dryrun.py check()). `--dry-run` among
        the overrides (a script's sys.argv[1:]) does the same;
    exit_on_error: end the process on a TrainerError with its one line and exit code, as
        `trainer train` does (default); False: raise it.

    What is given replaces data.name, model.name and task.name; the run records an importable
    `module:name` for each (so `trainer eval` can rebuild it), or `<fit>:name` for objects only
    this script can hand over.
    """
    try:
        from trainer.run import Plugins
        from trainer.train import train

        if not isinstance(overrides, str) and "--dry-run" in list(overrides):
            overrides, dry_run = [o for o in overrides if o != "--dry-run"], True
        cfg = _config(config, overrides, model=model, data=data, task=task)
        return train(cfg, dry_run=dry_run, plugins=Plugins(data=data, model=model, task=task))
    except TrainerError as e:
        if not exit_on_error:
            raise
        code = report(e)
        record_exit(code)
        raise SystemExit(code) from None
    except BaseException:
        if exit_on_error:
            record_exit(ExitCode.ERROR)  # a bug: the traceback follows, the launcher learns it
        raise


def _config(config, overrides, **given):
    from trainer import config as configs
    from trainer.config import Config

    if isinstance(overrides, str):
        raise UsageError(
            f"trainer.fit: overrides must be a list of key=value strings, got the string "
            f"{overrides!r}: wrap it in a list"
        )
    wrong = [o for o in overrides if not isinstance(o, str)]
    if wrong:
        raise UsageError(
            f"trainer.fit: overrides must be key=value strings, got {wrong[0]!r}: write "
            "'key=value' (e.g. 'optim.lr=0.01')"
        )
    values = {k: {"name": recorded_name(v)} for k, v in given.items() if v is not None}
    if isinstance(config, Config):
        values = _merged(configs.to_dict(config), values)
        config = None
    elif isinstance(config, Mapping):
        values = _merged(dict(config), values)
        config = values.pop("preset", None)
    elif config is not None and not isinstance(config, str):
        raise UsageError(
            f"trainer.fit: config is a {type(config).__name__}: give a preset name, a YAML "
            "path, a run folder, a dict or a trainer.config.Config"
        )
    return configs.load(config, list(overrides), values=values, source="trainer.fit(config=...)")


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), Mapping):
            out[key] = _merged(dict(out[key]), value)
        else:
            out[key] = value
    return out


def recorded_name(obj) -> str:
    """The name of a given object in the run's config: `module:qualname` for a function or class
    defined at the top of an importable module (so `trainer eval` rebuilds it), else
    `<fit>:name` (an instance, or a function of __main__ or defined inside a function)."""
    if inspect.isfunction(obj) or inspect.isclass(obj):
        module, qualname = obj.__module__, obj.__qualname__
        if module != "__main__" and "<locals>" not in qualname:
            return f"{module}:{qualname}"
        return f"{GIVEN}:{qualname.replace('<locals>.', '')}"
    return f"{GIVEN}:{type(obj).__qualname__}"
