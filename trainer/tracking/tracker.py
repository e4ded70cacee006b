"""Which tracking services a run reports to, and the two hooks a run calls: `check` (before any
work: a mistake is one line, exit 2) and `tracked(run)` (rank 0: a sender per service, fed the
train and eval records metrics.jsonl gets; at the end the artifacts and the run's end state).

No torch at import (perf and repro are imported where a run's facts are read): `trainer config
check` runs `check` too, before any process starts.
"""

from __future__ import annotations

import configparser
import contextlib
import functools
import importlib.util
import json
import netrc
import os
import sys
import threading
import urllib.parse

from trainer import metrics
from trainer.config import Config, to_dict
from trainer.config.schema import check_tracking_uri
from trainer.errors import ConfigError, Preempted, shorten
from trainer.tracking.mlflow_rest import MLflowSink
from trainer.tracking.sender import Sender, already_sent
from trainer.tracking.wandb_sink import WandbSink

QUEUE_SIZE = 10_000
"""Records a sender holds while its service is away (~3 days of a log window a minute)."""
STOP_FLUSH_S = 5.0
"""After a stop or an error, the wait for a service at most (a SIGTERM's checkpoint comes first,
and the grace period before SIGKILL is short)."""
MAX_EXPERIMENT_NAME = 500
"""MLflow's limit (mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH); it refuses ''."""
WANDB_PROJECT_REFUSES = set("/\\#?%:")


def mlflow_uri(cfg: Config, environ) -> str | None:
    """The tracking server's URI (None: no MLflow), or a ConfigError naming the fix."""
    uri = cfg.log.mlflow.uri
    if uri is None:
        return None
    key = "log.mlflow.uri"
    if uri == "env":
        key, uri = "MLFLOW_TRACKING_URI", environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            raise ConfigError(
                "log.mlflow.uri=env, but MLFLOW_TRACKING_URI is not set: export it (e.g. "
                "http://mlflow:5000), or give log.mlflow.uri=http://HOST:PORT"
            )
    check_tracking_uri(key, uri)  # the config's own was checked when it was loaded
    return uri


def experiment(cfg: Config, environ) -> str:
    name = cfg.log.mlflow.experiment or environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.name
    if len(name) > MAX_EXPERIMENT_NAME:
        raise ConfigError(
            f"log.mlflow.experiment: MLflow refuses names over {MAX_EXPERIMENT_NAME} characters "
            f"({shorten(name)!r}): give a shorter log.mlflow.experiment"
        )
    return name


def check(cfg: Config, environ) -> None:
    """What would make tracking fail, said before any work (ConfigError: one line, exit 2)."""
    if mlflow_uri(cfg, environ) is not None:
        experiment(cfg, environ)
    w = cfg.log.wandb
    if w.mode == "off":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"log.wandb.mode={w.mode} needs the wandb package, which is not installed here: "
            "pip install 'repro-trainer[wandb]' (or log.wandb.mode=off)"
        )
    project = w.project or environ.get("WANDB_PROJECT") or cfg.name
    if len(project) > 128 or WANDB_PROJECT_REFUSES & set(project):
        raise ConfigError(
            f"log.wandb.project={shorten(project)!r}: W&B refuses project names over 128 "
            "characters or holding any of / \\ # ? % : (give log.wandb.project=NAME)"
        )
    if w.mode == "online" and not wandb_credentials(environ):
        host = _wandb_host(environ)
        raise ConfigError(
            f"log.wandb.mode=online, but no W&B API key is set here (WANDB_API_KEY is not set, "
            f"and {_netrc_path(environ)} has no entry for {host}): export WANDB_API_KEY (or run "
            "`wandb login`), or set log.wandb.mode=offline and upload later with `wandb sync`"
        )


WANDB_HOST = "https://api.wandb.ai"
"""W&B's server unless WANDB_BASE_URL names another (a self-hosted one)."""


def wandb_credentials(environ) -> str | None:
    """Where wandb.init would find credentials for an online run, as the wandb package looks
    (wandb/sdk/lib/wbauth): WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the netrc entry of the
    W&B host ($NETRC, ~/.netrc or ~/_netrc: what `wandb login` writes), or an api_key in a W&B
    settings file; None: nowhere, so the run would train without ever reaching W&B."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if environ.get(name, "").strip():
            return name
    path, host = _netrc_path(environ), _wandb_host(environ)
    with contextlib.suppress(OSError, netrc.NetrcParseError, UnicodeError):
        entry = netrc.netrc(path).authenticators(host) if os.path.isfile(path) else None
        if entry and entry[2]:
            return path
    home = environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb")
    for settings in (os.path.join(home, "settings"), os.path.join("wandb", "settings")):
        parser = configparser.ConfigParser()
        with contextlib.suppress(OSError, configparser.Error, UnicodeError):
            parser.read(settings if os.path.isfile(settings) else [], encoding="utf-8")
            if parser.get("default", "api_key", fallback="").strip():
                return settings
    return None


def _wandb_host(environ) -> str:
    """The W&B server's host name, as netrc files name it (api.wandb.ai)."""
    url = environ.get("WANDB_BASE_URL") or WANDB_HOST
    with contextlib.suppress(ValueError):
        return urllib.parse.urlsplit(url).netloc or url
    return url


def _netrc_path(environ) -> str:
    """The netrc file wandb reads: $NETRC, else ~/.netrc (or ~/_netrc where only that exists)."""
    if environ.get("NETRC"):
        return os.path.expanduser(environ["NETRC"])
    unix, windows = os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")
    return windows if not os.path.exists(unix) and os.path.exists(windows) else unix


def params(cfg: Config) -> dict[str, str]:
    """The resolved config flattened to dotted keys (optim.lr), values as text."""
    out = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, str) else json.dumps(v)

    walk(to_dict(cfg), "")
    return out


def facts(run, environ) -> dict[str, str]:
    """The run's facts as tags: where and how it runs, and what ran it."""
    from trainer import perf, repro  # torch: only where a run is (not in `config check`)

    w, cfg = run.world, run.cfg
    out = {
        "world_size": w.size,
        "mesh": str(run.mesh.layout),
        "strategy": run.mesh.dims.name,
        "device": w.device,
        "devices": f"{w.size} x {perf.device_name(w.device) or w.device}",
        "backend": w.backend,
        "torch": metrics.versions().get("torch"),
        "git": _commit(repro.git_commit()),
        "image": environ.get("TRAINER_IMAGE"),
        "world_invariant": cfg.repro.world_invariant,
        "precision": cfg.train.precision,
        "run_dir": run.run_dir,
    }
    return {
        k: str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in out.items()
        if v is not None
    }


def _commit(git: dict | None) -> str | None:
    if not git:
        return None
    return git["commit"] + ("-dirty" if git.get("dirty") else "")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def sinks(run, environ) -> list:
    """The run's sinks (rank 0), each with its flush_s: MLflow, W&B, or none."""
    cfg, folder = run.cfg, os.path.join(run.run_dir, "tracking")
    name, tags = os.path.basename(run.run_dir), facts(run, environ)
    out = []
    if (uri := mlflow_uri(cfg, environ)) is not None:
        m = cfg.log.mlflow
        sink = MLflowSink(
            uri=uri,
            environ=environ,
            experiment=experiment(cfg, environ),
            run_name=m.run_name or name,
            params=params(cfg),
            tags={**tags, **{k: str(v) for k, v in m.tags.items()}},
            state_path=os.path.join(folder, "mlflow.json"),
        )
        out.append((sink, m.flush_s))
    if (w := cfg.log.wandb).mode != "off":
        sink = WandbSink(
            project=w.project or environ.get("WANDB_PROJECT") or cfg.name,
            entity=w.entity or environ.get("WANDB_ENTITY"),
            mode=w.mode,
            run_name=name,
            config={**to_dict(cfg), "facts": tags},
            tags={**tags, **w.tags},
            state_path=os.path.join(folder, "wandb.json"),
            folder=folder,
        )
        out.append((sink, w.flush_s))
    return out


class Tracker:
    """Rank 0's senders; `record` is what RunLogger.record calls with each record it writes."""

    def __init__(self, chosen: list):
        self.senders = []
        for sink, flush_s in chosen:
            skip = sink.state.get("sent")  # what an earlier attempt of this run sent
            sender = Sender(sink, size=QUEUE_SIZE, warn=_warn).start()
            self.senders.append((sender, skip, flush_s))

    def record(self, record: dict) -> None:
        if record.get("kind") not in ("train", "eval"):
            return
        for sender, skip, _ in self.senders:
            if not already_sent(skip, record):
                sender.put(record)

    def close(self, status: str, files) -> None:
        for sender, _, flush_s in self.senders:
            if status != "FINISHED":  # a stop's grace period (k8s, Slurm) is not ours to spend
                flush_s = min(flush_s, STOP_FLUSH_S)
            sender.close(status, files, flush_s)

    def line(self) -> str:
        said = []
        for sender, _, _ in self.senders:
            sink = sender.sink
            again = " (continued)" if sink.state else ""
            said.append(f"{sink.name} {sink.where}{again}")
        return "tracking: " + ", ".join(said) + " (off the training thread)"


def artifacts(run):
    """A function (called once, on a sender thread, by whichever asks first) returning the
    (name, path) pairs to upload: config.yaml, summary.json, the report's PNGs and, with
    log.mlflow.log_weights, the final weights."""
    lock = threading.Lock()

    @functools.cache
    def made() -> list[tuple[str, str]]:
        d = run.run_dir
        out = [(n, os.path.join(d, n)) for n in ("config.yaml", "summary.json")]
        with contextlib.suppress(Exception):  # a report that cannot be drawn: the rest still goes
            from trainer.report import write_report

            for path in write_report([d], os.path.join(d, "report"), note=lambda _: None):
                if path.endswith(".png"):
                    out.append((f"report/{os.path.basename(path)}", path))
        if run.cfg.log.mlflow.log_weights:
            out.append(("final/model.safetensors", os.path.join(d, "final", "model.safetensors")))
        return [(name, path) for name, path in out if os.path.isfile(path)]

    def files() -> list[tuple[str, str]]:
        with lock:
            return made()

    return files


@contextlib.contextmanager
def tracked(run, environ=None):
    """Rank 0 reports the run's records to the configured services while the block runs, then
    their artifacts and end state (FINISHED, KILLED after a stop, FAILED); it never raises."""
    environ = os.environ if environ is None else environ
    chosen = sinks(run, environ) if run.world.is_main else []
    if not chosen:
        yield
        return
    tracker = Tracker(chosen)
    run.log.info(tracker.line())
    run.log.sinks.append(tracker)
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except Preempted:
        status = "KILLED"
        raise
    finally:
        run.log.sinks.remove(tracker)
        with contextlib.suppress(Exception):  # tracking never changes how a run ends
            tracker.close(status, artifacts(run))
