"""Experiment tracking (trainer/tracking/): a real `mlflow server` (SQLite, artifacts in a temp
folder, 127.0.0.1), started once for the module and read back with MlflowClient; W&B offline.

The server runs from its own venv (.venv/mlflow-server, built on first use from
tests/mlflow-server.txt: mlflow pins importlib_metadata<10, which requirements.lock holds at
10.2.0); the trainer talks to it with the standard library alone. Without the server's packages
(no index to install them from) the server tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    BIN,
    ROOT,
    TINY,
    checkpoints,
    env,
    free_port,
    read_jsonl,
    spawn,
    train_here,
    trainer,
    wait_for,
)
from trainer import config
from trainer.errors import ConfigError, redact
from trainer.tracking import check
from trainer.tracking.sender import Sender, Sink, already_sent, metrics_of, sent_after
from trainer.tracking.tracker import params

SERVER_VENV = ROOT / ".venv" / "mlflow-server"
PINS = ROOT / "tests" / "mlflow-server.txt"
SHORT = [*TINY, "train.epochs=3", "log.every_steps=1", "log.tensorboard=false", "log.progress=none"]
# 3 epochs x 23 steps of the digits MLP, 50 ms a step: a few seconds to act in mid-run.
KILLABLE = [
    "model.name=tests.helpers:slow_mlp",
    "model.hidden=[16]",
    "model.kwargs.delay=0.05",
    "train.epochs=3",
    "log.every_steps=1",
    "log.tensorboard=false",
    "log.progress=plain",
    "ckpt.every_steps=10",
    "ckpt.keep_last=100",
]


# --- what is sent, and the sender: no server -------------------------------------------------


def _cfg(*overrides: str):
    return config.load(None, list(overrides))


@pytest.mark.parametrize(
    "overrides, environ, says",
    [
        (["log.mlflow.uri=sqlite:///m.db"], {}, "has scheme 'sqlite': give the tracking server"),
        (["log.mlflow.uri=127.0.0.1:5000"], {}, "(did you mean http://127.0.0.1:5000?)"),
        (["log.mlflow.uri=localhost"], {}, "has no scheme"),
        (["log.mlflow.uri=env"], {}, "MLFLOW_TRACKING_URI is not set: export it"),
        (["log.mlflow.uri=env"], {"MLFLOW_TRACKING_URI": "file:/x"}, "MLFLOW_TRACKING_URI="),
        (["log.mlflow.uri=http://u:secret@h:5000"], {}, "export MLFLOW_TRACKING_USERNAME"),
        (
            ["log.mlflow.uri=http://h:5000", f"log.mlflow.experiment={'x' * 501}"],
            {},
            "MLflow refuses names over 500 characters",
        ),
        (["log.wandb.mode=offline", "log.wandb.project=a/b"], {}, "W&B refuses project names"),
    ],
)
def test_tracking_mistakes_are_one_line_naming_the_fix(overrides, environ, says):
    with pytest.raises(ConfigError) as e:
        check(_cfg(*overrides), environ)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert "secret" not in str(e.value)


def test_wandb_without_its_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'repro-trainer\[wandb\]'"):
        check(_cfg("log.wandb.mode=offline"), {})


def test_a_bad_uri_exits_2_with_one_line_before_any_work(tmp_path):
    p = trainer(
        "train", *SHORT, f"run_dir={tmp_path / 'run'}", "log.mlflow.uri=ftp://h", check=False
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr
    assert "log.mlflow.uri='ftp://h' has scheme 'ftp'" in p.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_no_tracking_is_configured_by_default():
    check(_cfg(), {"MLFLOW_TRACKING_URI": "http://h:1"})  # the variable alone turns nothing on
    assert _cfg().log.mlflow.uri is None and _cfg().log.wandb.mode == "off"


def test_params_are_the_flattened_config_and_metrics_the_records_numbers():
    p = params(_cfg("optim.lr=0.01", "model.kwargs.width=3"))
    assert p["optim.lr"] == "0.01" and p["model.hidden"] == "[512, 512]"
    assert p["model.kwargs.width"] == "3" and p["data.kwargs"] == "{}" and p["run_dir"] == "null"
    record = {"kind": "train", "step": 3, "epoch": 1, "time": 5.0, "loss": 0.5, "lr": 1e-3}
    record |= {"rank_forward_ms": [1.0, 2.0], "nan": float("nan"), "flag": True}
    assert metrics_of(record) == {"loss": 0.5, "lr": 1e-3}
    assert redact("https://me:pw@host:1/x") == "https://host:1/x"


@pytest.mark.parametrize(
    "mesh, world, want",
    [
        ("pp=2", 2, ("pp=2", "pp")),
        ("dp=2,pp=2", 4, ("dp=2,pp=2", "ddp+pp")),
        ("", 2, ("dp=2", "ddp")),
    ],
)
def test_the_mesh_and_strategy_tags_are_the_runs_layout(mesh, world, want):
    """The tags come from the run's layout (its ParallelDims), not from the world size: a pp=2
    run on 2 ranks is tagged pp=2, not dp=2."""
    from types import SimpleNamespace

    from trainer.parallel.dims import describe
    from trainer.parallel.mesh import Mesh
    from trainer.ranks import World
    from trainer.tracking.tracker import facts

    cfg = config.load("stdlib-gpt", [f"dist.mesh={mesh}"] if mesh else [])
    w = World(rank=0, size=world, local_size=world, master_addr="x", master_port=1)
    run = SimpleNamespace(world=w, cfg=cfg, mesh=Mesh(describe(cfg, world)), run_dir="/r")
    tags = facts(run, {})
    assert (tags["mesh"], tags["strategy"], tags["world_size"]) == (*want, str(world))


def test_a_resume_skips_exactly_what_the_earlier_attempt_sent():
    train = lambda s: {"kind": "train", "step": s}  # noqa: E731
    sent = sent_after(None, [train(1), train(2)])
    sent = sent_after(sent, [{"kind": "eval", "step": 2}])
    assert sent == [2, ["eval", "train"]]
    assert already_sent(sent, train(2)) and not already_sent(sent, train(3))
    assert not already_sent([2, ["train"]], {"kind": "eval", "step": 2})
    assert not already_sent(sent, {"kind": "stop", "step": 1})


class FakeSink(Sink):
    """Down until `up` is set; records what it was sent."""

    name, where = "Fake", "nowhere"

    def __init__(self, up: bool = True, slow_s: float = 0.0):
        self.up, self.slow_s = up, slow_s
        self.got, self.finished, self.state = [], None, {}

    def connect(self):
        if not self.up:
            raise ConnectionRefusedError("[Errno 111] Connection refused")

    def send(self, records):
        time.sleep(self.slow_s)
        if not self.up:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        self.got.extend(r["step"] for r in records)

    def finish(self, status, files):
        self.finished = (status, files)
        return []


def test_a_sink_that_comes_back_gets_everything_in_order():
    sink, lines = FakeSink(up=False), []
    sender = Sender(sink, size=100, warn=lines.append).start()
    for step in range(1, 31):
        sender.put({"kind": "train", "step": step})
    time.sleep(0.3)
    sink.up = True
    assert sender.close("FINISHED", lambda: [("a", "b")], flush_s=20)
    assert sink.got == list(range(1, 31)) and sink.finished == ("FINISHED", [("a", "b")])
    assert lines == []


def test_files_refused_for_one_cause_say_it_once():
    """A server whose artifacts are not proxied refuses every file for the same reason: one
    line naming the files, the reason once (it was repeated for each of 5 files)."""

    class Refusing(FakeSink):
        def finish(self, status, files):
            why = "NO_PROXY: artifacts go to /srv/mlruns, not the server"
            return [(name, why) for name, _ in files[:-1]] + [(files[-1][0], "413: too large")]

    lines = []
    sender = Sender(Refusing(), size=10, warn=lines.append).start()
    files = [(n, f"/r/{n}") for n in ("config.yaml", "summary.json", "a.png", "b.png", "w")]
    assert not sender.close("FINISHED", files, flush_s=20)
    assert lines == [
        "warning: Fake at nowhere refused config.yaml, summary.json, a.png and b.png (NO_PROXY: "
        "artifacts go to /srv/mlruns, not the server); w (413: too large)"
    ]


def test_a_sink_that_stays_down_costs_a_bounded_wait_and_one_line():
    sink, lines = FakeSink(up=False, slow_s=0.0), []
    sender = Sender(sink, size=5, warn=lines.append).start()
    started = time.perf_counter()
    for step in range(1, 9):  # the queue holds 5: 3 are dropped, never blocking
        sender.put({"kind": "train", "step": step})
    assert time.perf_counter() - started < 0.1
    assert not sender.close("FINISHED", [], flush_s=0.5)
    assert time.perf_counter() - started < 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: Fake at nowhere: 8 records (steps 1-8)")
    assert "Connection refused" in lines[0] and "metrics.jsonl holds every record" in lines[0]


def test_a_run_whose_server_is_down_trains_exits_0_and_says_so_once(tmp_path, capsys):
    run_dir = tmp_path / "run"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    summary = train_here(
        "train", *SHORT, f"run_dir={run_dir}", f"log.mlflow.uri={url}", "log.mlflow.flush_s=0.5"
    )
    assert summary["steps"] == 9
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "10 records (steps 1-9)" in warnings[0], err


# --- a real MLflow server ---------------------------------------------------------------------


def _server_python() -> Path:
    """The server venv's python, built from PINS on first use (uv, pip's configured index)."""
    python, stamp = SERVER_VENV / "bin" / "python", SERVER_VENV / ".pins"
    pins = PINS.read_text()
    SERVER_VENV.parent.mkdir(exist_ok=True)
    with open(f"{SERVER_VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (xdist workers)
        if python.exists() and stamp.exists() and stamp.read_text() == pins:
            return python
        flags = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "uv_flags.py")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(SERVER_VENV)], check=True)
        cert = flags[1].removeprefix("cert=") if len(flags) > 1 else ""
        built = subprocess.run(
            [
                *(str(BIN / "uv"), "pip", "install", "--quiet", "--compile-bytecode"),
                *("--python", str(python), *shlex.split(flags[0])),
                *("--index-strategy", "unsafe-best-match", "-r", str(PINS)),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, **({"SSL_CERT_FILE": cert} if cert else {})},
        )
        if built.returncode != 0:
            pytest.skip(f"no mlflow server: installing {PINS.name} failed: {built.stderr[-300:]}")
        stamp.write_text(pins)
        return python


class Server:
    """`mlflow server` on 127.0.0.1:port, its SQLite store and artifacts in `folder`."""

    def __init__(self, python: Path, folder: Path):
        self.python, self.folder, self.port = python, folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> Server:
        cmd = [str(self.python), "-m", "mlflow", "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}"]
        cmd += ["--artifacts-destination", str(self.folder / "artifacts")]
        log = open(self.folder / "server.log", "a")  # noqa: SIM115 (the server's own)
        # A session of its own: `mlflow server` runs uvicorn and job workers as children, which
        # outlive it; a kill ends the whole group.
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, env=env(), cwd=self.folder, start_new_session=True
        )
        return self

    def up(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_up(self, timeout: float = 240) -> None:
        """Until it answers, and once more through the calls a run makes: a new server's first
        requests take seconds (lazy imports, the store's first queries), longer than a test's
        whole run."""
        wait_for(self.up, timeout, f"mlflow server on {self.url}", self.proc, interval=0.5)
        from trainer.tracking.mlflow_rest import Client

        client = Client(self.url, {})
        experiment = client.call("POST", "experiments/create", {"name": f"warm-up {time.time()}"})
        run = client.call("POST", "runs/create", experiment)["run"]["info"]["run_id"]
        metric = {"key": "loss", "value": 1.0, "timestamp": 0, "step": 1}
        client.call("POST", "runs/log-batch", {"run_id": run, "metrics": [metric]})
        client.call("GET", "metrics/get-history", {"run_id": run, "metric_key": "loss"})

    def kill(self) -> None:
        """SIGKILL to the server and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def read(self, run_id: str) -> dict:
        """The run as MlflowClient reads it: status, params, tags, every metric's history,
        artifacts."""
        script = (
            "import json, sys\n"
            "from mlflow.tracking import MlflowClient\n"
            "c = MlflowClient(sys.argv[1]); r = c.get_run(sys.argv[2]); i = r.info.run_id\n"
            "h = {k: [[m.step, m.value] for m in c.get_metric_history(i, k)] for k in r.data.metrics}\n"
            "a = [f.path for f in c.list_artifacts(i)] + [f.path for f in c.list_artifacts(i, 'report')]\n"
            "print(json.dumps({'status': r.info.status, 'name': r.info.run_name, 'params': r.data.params,"
            " 'tags': r.data.tags, 'metrics': h, 'artifacts': a,"
            " 'experiment': c.get_experiment(r.info.experiment_id).name}))\n"
        )
        out = subprocess.run(
            [str(self.python), "-c", script, self.url, run_id],
            capture_output=True,
            text=True,
            env=env(),
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(_server_python(), tmp_path_factory.mktemp("mlflow")).start()
    try:
        s.wait_up()
        yield s
    finally:
        s.kill()


def _history(run_dir: Path) -> dict[str, list[list]]:
    """metrics.jsonl's train and eval numbers as MLflow histories: {key: [[step, value], ...]}."""
    out: dict[str, list[list]] = {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if r["kind"] in ("train", "eval"):
            for key, value in metrics_of(r).items():
                out.setdefault(key, []).append([r["step"], value])
    return out


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "tracking" / "mlflow.json").read_text())["run_id"]


def _sent(run_dir: Path, url: str) -> int:
    """The last train step the server holds (0: none yet)."""
    import urllib.request

    try:
        query = f"run_id={_run_id(run_dir)}&metric_key=loss"
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/metrics/get-history?{query}") as r:
            return max((int(m["step"]) for m in json.load(r).get("metrics", [])), default=0)
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.mlflow  # make test-mlflow: the server's venv and start cost ~1 min of the budget
@pytest.mark.slow  # the server's start (module-wide): ~10 s alone, ~40 s on a loaded machine
def test_a_server_killed_mid_run_and_restarted_gets_every_metric_param_tag_and_artifact(
    server, tmp_path
):
    run_dir = tmp_path / "run"
    proc = spawn(
        "train",
        *KILLABLE,
        f"run_dir={run_dir}",
        f"log.mlflow.uri={server.url}",
        "log.mlflow.experiment=tracking-test",
        "log.mlflow.tags.team=vision",
        "log.mlflow.log_weights=true",
        "log.mlflow.flush_s=400",  # the end waits for the server to come back
    )
    wait_for(lambda: _sent(run_dir, server.url) >= 5, 120, "the first records on the server", proc)
    killed_at = _sent(run_dir, server.url)
    server.kill()
    assert not server.up()  # gone: nothing answers on its port
    server.start()  # on the same port and store: up again in ~10-40 s, after training ended
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "warning" not in out, out[-3000:]
    got = server.read(_run_id(run_dir))
    assert killed_at < 69 and got["status"] == "FINISHED"
    assert got["metrics"] == _history(run_dir)  # the gap is filled: steps 1-69, once each
    assert got["name"] == "run" and got["experiment"] == "tracking-test"
    assert got["params"] == params(config.load(str(run_dir / "config.yaml"), []))
    tags = got["tags"]
    assert tags["world_size"] == "1" and tags["strategy"] == "none" and tags["team"] == "vision"
    assert tags["world_invariant"] == "false" and tags["torch"] and tags["mesh"] == "dp=1"
    assert {"config.yaml", "summary.json", "report/loss.png", "final"} <= set(got["artifacts"])


@pytest.mark.mlflow
@pytest.mark.slow
def test_a_sigkilled_run_resumed_continues_the_same_mlflow_run(server, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", *KILLABLE, f"run_dir={run_dir}", f"log.mlflow.uri={server.url}"]
    proc = spawn(*args)
    wait_for(
        lambda: "step-000000020" in checkpoints(run_dir) and _sent(run_dir, server.url) >= 22,
        120,
        "checkpoint 20 and step 22 on the server",
        proc,
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first, sent = _run_id(run_dir), _sent(run_dir, server.url)
    p = trainer(*args)
    assert "resumed from" in p.stdout and "(continued)" in p.stdout
    assert _run_id(run_dir) == first
    got, history = server.read(first), _history(run_dir)
    assert got["status"] == "FINISHED"
    assert got["metrics"].keys() == history.keys()
    for key, points in got["metrics"].items():  # every step once: none twice, none missing
        assert [s for s, _ in points] == [s for s, _ in history[key]], key
    # Steps 21..`sent` are the killed attempt's, which the resume recomputed: the same loss, lr
    # and eval bits (CPU); the throughput that attempt measured, not the one metrics.jsonl has.
    for key in ("loss", "lr", "eval.loss", "eval.accuracy"):
        assert got["metrics"][key] == history[key], key
    timed = {s: v for s, v in got["metrics"]["samples_per_s"]}
    assert all(timed[s] == v for s, v in history["samples_per_s"] if not 20 < s <= sent)


# --- W&B, offline ----------------------------------------------------------------------------


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's
    log format (32 KiB blocks; each chunk: crc32c, length, type 1 full | 2 first | 3 middle |
    4 last)."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, out, part = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            part = chunk
        elif kind in (3, 4):
            part += chunk
        if kind in (1, 4):
            out.append(part)
    return out


def _wandb_history(folder: Path) -> list[dict]:
    """The history rows of the offline run(s) under folder (W&B's own protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_wandb_offline_writes_a_run_wandb_sync_can_upload(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    train_here(
        "train", *SHORT, f"run_dir={run_dir}", "log.wandb.mode=offline", "log.wandb.project=t"
    )
    state = json.loads((run_dir / "tracking" / "wandb.json").read_text())
    assert state["sent"] == [9, ["eval", "train"]]
    rows = _wandb_history(run_dir / "tracking")
    losses = {r["_step"]: r["loss"] for r in rows if "loss" in r}
    assert losses == {s: v for s, v in ((h[0], h[1]) for h in _history(run_dir)["loss"])}
    assert any("eval.accuracy" in r for r in rows)
    assert list((run_dir / "tracking" / "wandb").glob(f"offline-run-*-{state['id']}"))


# --- where users run it: compose and Kubernetes ----------------------------------------------


def test_the_compose_tracking_profile_serves_mlflow_on_localhost_with_a_volume():
    from tests.test_compose import compose_config

    s = compose_config("tracking")["services"]["mlflow"]
    assert s["command"][:2] == ["mlflow", "server"]
    assert "--backend-store-uri=sqlite:////mlflow/mlflow.db" in s["command"]
    assert any(a.startswith("--allowed-hosts=mlflow,mlflow:5000,") for a in s["command"])
    assert [(v["source"], v["target"]) for v in s["volumes"]] == [("mlflow", "/mlflow")]
    assert [(p["host_ip"], p["target"]) for p in s["ports"]] == [("127.0.0.1", 5000)]
    assert s["read_only"] is True and s["cap_drop"] == ["ALL"]


@pytest.mark.k8s
@pytest.mark.parametrize("overlay", ["cpu-smoke", "gpu", "jobset", "kubeflow", "elastic"])
def test_the_k8s_component_admits_only_the_jobs_pods(overlay, tmp_path):
    from tests import k8s as kube

    if kube.kubectl() is None:
        pytest.skip("needs kubectl (its built-in kustomize)")
    objs = kube.render_with(tmp_path, overlay, ["tracking"])
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    kinds = ("Deployment", "Service", "PersistentVolumeClaim", "NetworkPolicy")
    assert {(kind, "mlflow") for kind in kinds} <= by_kind.keys()
    policy = by_kind[("NetworkPolicy", "mlflow")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "mlflow"}
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 5000}]
    admitted = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    pod = kube.pods(objs)[0]  # a training pod, with the labels its controller sets
    assert any(labels.items() <= pod.labels.items() for labels in admitted), pod.labels
    for other in (o for o in objs if o["kind"] == "Deployment"):  # mlflow, elastic's etcd
        labels_ = other["spec"]["template"]["metadata"]["labels"]
        assert not any(labels.items() <= labels_.items() for labels in admitted), labels_
