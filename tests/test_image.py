"""docker/Dockerfile built for real on a Docker engine, with no registry, and compose.yaml's
services run from that image through the real Compose v2 binary (`make test-image`).

What it proves (docs/containers.md): the Dockerfile builds from a plain Debian base (debootstrap +
`docker import`, no `python`, no Docker Hub, not even for a BuildKit frontend) with the lock's
wheels from this machine's package index, and keeps those pip settings out of the image; the
image's entrypoint works in a plain container; the cpu, two-node and tensorboard services run
with their hardened settings in force (checked with `docker inspect` and from inside); a SIGTERM
to a service ends it with exit 3 and a checkpoint that the next `up` resumes; and the compose cpu
run gives the same weights and accuracy as `make run-local`, bit for bit.

Needs root (it starts its own dockerd, and installs docker.io and debootstrap with apt where they
are missing), the package index and a Debian mirror: about 10 minutes and 10 GB of disk at the
peak, all removed afterwards (TRAINER_IMAGE_TEST_KEEP=1 keeps build/image-test/ for a faster
re-run; TRAINER_TEST_DOCKER_HOST=unix:///... uses an engine of your own instead). Where no engine
can be started, or less than 12 GB of disk is free for it, every test skips with the reason in one
line; none passes without a build and a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engine import (
    WORK,
    Engine,
    Unavailable,
    Wheelhouse,
    debian_base,
    disk_used,
    remove_tree,
)
from tests.helpers import ROOT, free_port, train_losses, weights
from tests.test_compose import compose_bin, compose_config

pytestmark = [pytest.mark.image, pytest.mark.slow]

IMAGE = "trainer-imagetest"
# The CUDA variant, because it is the one whose torch is on this machine's package index: the CPU
# variant's torch==X+cpu comes from download.pytorch.org (TORCH_CPU_INDEX), out of reach here. The
# CUDA build runs on a CPU just the same, and it is the very torch `make run-local` uses, so the
# compose services below run from it (compose.yaml names trainer:cpu; the override names this).
VARIANT = "cuda"
TAG = f"{IMAGE}:{VARIANT}"
BASE = f"{IMAGE}-base:bookworm"
PROJECT = IMAGE
SUBNETS = {
    PROJECT: "10.213.1.0/24",
    f"{PROJECT}-sigterm": "10.213.2.0/24",
    f"{PROJECT}-ratings": "10.213.3.0/24",
}  # inside engine.POOL
RATINGS_TAG = f"{IMAGE}-ratings:{VARIANT}"  # examples/ratings/Dockerfile, FROM TAG
KEEP = bool(os.environ.get("TRAINER_IMAGE_TEST_KEEP"))
REPORT = ROOT / "build" / "image-test-report.json"
UID = 1000
STEPS_PER_EPOCH = 23  # digits: 1,438 training samples in global batches of 64
STEPS = 40 * STEPS_PER_EPOCH  # the default config's 40 epochs


def run(cmd, *, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )


def say(line: str) -> None:
    print(f"image-test: {line}", flush=True)


# --- the engine, the base, the build -----------------------------------------------------------


@pytest.fixture(scope="module")
def report():
    data: dict = {}
    yield data
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(data, indent=1) + "\n")
    say(f"measurements in {REPORT.relative_to(ROOT)}")


@pytest.fixture(scope="module")
def engine(report):
    try:
        e = Engine.start()
    except Unavailable as err:
        pytest.skip(f"no Docker engine: {err}")
    report["engine"] = e.version()
    say(f"Docker engine {report['engine']} at {e.host} ({'ours' if e.proc else 'given'})")
    yield e
    if e.proc is None:  # someone else's engine: take away only what we made
        for project in SUBNETS:
            compose(e, project, None, "down", "--volumes", "--remove-orphans", check=False)
        e.docker("image", "rm", "-f", RATINGS_TAG, TAG, BASE, check=False)
        return
    report["engine_disk_bytes"] = disk_used(e.owned["data"])
    say(f"engine data-root at the end: {report['engine_disk_bytes'] / 1e9:.1f} GB")
    e.stop(keep=KEEP)
    if not KEEP:
        remove_tree(WORK)


@pytest.fixture(scope="module")
def image(engine, report):
    """`make image` with a debootstrap base and the lock's wheels served on loopback."""
    t0 = time.monotonic()
    debian_base(engine, BASE)
    report["base_s"] = round(time.monotonic() - t0, 1)
    probe = engine.docker("run", "--rm", BASE, "sh", "-c", "command -v python; python3 -V")
    assert probe.stdout.startswith("Python 3.11"), probe.stdout  # python3 only, as the lock's
    python = re.search(r"Python (\d+\.\d+)", probe.stdout).group(1)
    t1 = time.monotonic()
    wheels = Wheelhouse(python)
    report["wheels_s"], report["wheels_bytes"] = round(time.monotonic() - t1, 1), wheels.size()
    t2 = time.monotonic()
    try:
        build = run(
            [
                "make", "--no-print-directory", "image", f"IMAGE={IMAGE}", f"VARIANT={VARIANT}",
                f"DOCKER={engine.docker_bin}", f"BASE_IMAGE={BASE}", f"PIP_CONF={wheels.pip_conf}",
                "DOCKER_BUILD_ARGS=--network=host --progress=plain",
            ],
            env=engine.env, cwd=ROOT, timeout=3600,
        )  # fmt: skip
    finally:
        wheels.close(keep=KEEP)
    log = build.stdout + build.stderr
    (WORK / "build.log").write_text(log)
    assert build.returncode == 0, log[-5000:]
    report["build_s"] = round(time.monotonic() - t2, 1)
    report["image_bytes"] = int(engine.docker("image", "inspect", "-f", "{{.Size}}", TAG).stdout)
    say(
        f"base {report['base_s']} s, wheels {report['wheels_s']} s "
        f"({report['wheels_bytes'] / 1e9:.1f} GB), build {report['build_s']} s, "
        f"image {report['image_bytes'] / 1e9:.2f} GB"
    )
    return {"tag": TAG, "log": log, "wheel_url": wheels.url, "python": python}


@pytest.fixture(scope="module")
def memlock_ok(engine, image) -> bool:
    """Whether this engine may raise RLIMIT_MEMLOCK (compose's `memlock: -1`): it needs
    CAP_SYS_RESOURCE, which sandboxes such as this CI machine's do not grant."""
    p = engine.docker(
        "run", "--rm", "--ulimit", "memlock=-1:-1", "--entrypoint", "true", TAG, check=False
    )
    if p.returncode != 0:
        assert "operation not permitted" in p.stderr, p.stderr
        say("the engine cannot raise memlock here: the test overrides compose's `memlock: -1`")
    return p.returncode == 0


# --- compose -----------------------------------------------------------------------------------


def compose(engine, project, override, *args, timeout=600, check=True, base="compose.yaml", **env):
    """`docker compose -f base [-f override ...]`: `override` is one file, a list of them or None."""
    overrides = override if isinstance(override, list) else [override] if override else []
    files = ["-f", ROOT / base, *(a for o in overrides for a in ("-f", o))]
    e = {
        k: v
        for k, v in engine.env.items()
        if k not in ("TRAIN_ARGS", "SHM_SIZE", "DATA_DIR", "NODE_CPUS")
        and not k.startswith("COMPOSE_")
    }
    e.update(env)
    p = run([compose_bin(), "-p", project, *files, *args], env=e, cwd=ROOT, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"compose {' '.join(map(str, args))}: {p.stdout[-3000:]}{p.stderr}")
    return p


def write_override(path: Path, project: str, memlock: bool, tensorboard_port: int) -> Path:
    """Test-only settings on top of compose.yaml: this build's image for the CPU services, the
    network in the test's range, a free port for TensorBoard and, where the engine cannot apply
    it, compose's ulimits without memlock."""
    ulimits = compose_config("cpu")["services"]["cpu"]["ulimits"]
    lines = ["services:"]
    for name in ("cpu", "node0", "node1", "tensorboard"):
        lines += [f"  {name}:", f"    image: {TAG}", "    pull_policy: never"]
        if name == "tensorboard":
            lines += ["    ports: !override", f"      - 127.0.0.1:{tensorboard_port}:6006"]
        elif not memlock:
            lines += ["    ulimits: !override"]
            lines += [f"      {k}: {json.dumps(v)}" for k, v in ulimits.items() if k != "memlock"]
    lines += ["networks:", "  default:", "    ipam:", "      config:"]
    lines += [f"        - subnet: {SUBNETS[project]}"]
    path.write_text("\n".join(lines) + "\n")
    return path


class Project:
    """One compose project (its own volumes and network) with the test override."""

    def __init__(self, engine, name, folder: Path, memlock: bool):
        self.engine, self.name, self.memlock = engine, name, memlock
        self.tensorboard_port = free_port()
        self.override = write_override(
            folder / "override.yaml", name, memlock, self.tensorboard_port
        )
        self.data = folder / "data"  # DATA_DIR: mounted read-only at /workspace/data
        self.data.mkdir(mode=0o755)

    def __call__(self, *args, timeout=600, check=True, **env):
        return compose(self.engine, self.name, self.override, *args, timeout=timeout,
                       check=check, DATA_DIR=str(self.data), **env)  # fmt: skip

    def container(self, service: str) -> str:
        ids = self("ps", "--all", "--quiet", service).stdout.split()
        assert len(ids) == 1, ids
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(self.engine.docker("inspect", self.container(service)).stdout)[0]

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", "--no-log-prefix", service).stdout

    def copy_out(self, service: str, path: str, dest: Path) -> Path:
        self.engine.docker("cp", f"{self.container(service)}:{path}", str(dest))
        return dest

    def wait(self, service: str, timeout: float) -> int:
        p = self.engine.docker("wait", self.container(service), timeout=timeout)
        return int(p.stdout.strip())

    def down(self) -> None:
        profiles = [a for p in ("cpu", "two-node", "tensorboard") for a in ("--profile", p)]
        self(*profiles, "down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)


@pytest.fixture(scope="module")
def project(engine, image, memlock_ok, tmp_path_factory):
    p = Project(engine, PROJECT, tmp_path_factory.mktemp("compose"), memlock_ok)
    yield p
    p.down()


@pytest.fixture(scope="module")
def cpu_run(project, tmp_path_factory, report):
    """`docker compose --profile cpu up cpu`, the default config: its run folder, copied out."""
    t = time.monotonic()
    up = project("--profile", "cpu", "up", "--no-build", "--abort-on-container-exit",
                 "--exit-code-from", "cpu", "cpu", check=False)  # fmt: skip
    report["compose_cpu_wall_s"] = round(time.monotonic() - t, 1)
    assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-2000:]
    run_dir = project.copy_out(
        "cpu", "/workspace/runs/cpu/digits-mlp", tmp_path_factory.mktemp("cpu") / "run"
    )
    report["compose_cpu_samples_per_s"] = round(summary(run_dir)["samples_per_s"])
    return run_dir


def summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def assert_same_numbers(run: Path, reference: Path) -> None:
    """The same losses, accuracy and final weights, bit for bit."""
    assert train_losses(run) == train_losses(reference)
    assert summary(run)["eval"] == summary(reference)["eval"]
    w, ref = weights(run), weights(reference)
    assert w.keys() == ref.keys() and all(w[k].equal(ref[k]) for k in ref)


def assert_hardened(c: dict, memlock: bool) -> None:
    """What compose.yaml's x-hardened and x-training ask for, as the engine applied it."""
    host = c["HostConfig"]
    assert c["Config"]["User"] == f"{UID}:{UID}"
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
    assert host["Init"] is True and "no-new-privileges:true" in host["SecurityOpt"]
    assert set(host["Tmpfs"]) == {"/tmp", "/home/trainer"}
    assert host["ShmSize"] == 2 * 1024**3 and host.get("IpcMode") != "host"
    limits = {u["Name"]: u["Hard"] for u in host["Ulimits"] or []}
    assert limits["stack"] == 64 * 1024**2 and ("memlock" in limits) == memlock
    mounts = {m["Destination"]: m for m in c["Mounts"]}
    assert mounts["/workspace/data"]["RW"] is False and mounts["/workspace/runs"]["RW"] is True


# --- the tests ---------------------------------------------------------------------------------


def test_the_image_builds_from_no_registry_and_keeps_the_test_pip_settings_out(engine, image):
    assert "docker/dockerfile" not in image["log"]  # no frontend image pulled (# syntax=)
    info = json.loads(engine.docker("image", "inspect", TAG).stdout)[0]
    config = info["Config"]
    assert config["User"] == f"{UID}:{UID}" and config["Entrypoint"] == ["trainer-launch"]
    labels = config["Labels"]
    head = run(["git", "rev-parse", "HEAD"], cwd=ROOT).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == head or not head
    env = dict(v.split("=", 1) for v in config["Env"])
    assert not {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"} & set(env)
    history = engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", TAG).stdout
    assert image["wheel_url"] not in history and "no-index" not in history
    inside = engine.docker(
        "run", "--rm", "--network=none", "--entrypoint", "sh", TAG, "-c",
        "test ! -e /etc/pip.conf && test ! -e /opt/venv/pip.conf && pip config list",
        check=False,
    )  # fmt: skip
    assert inside.returncode == 0, inside.stdout + inside.stderr
    # Only the image's own PIP_* (no cache, no version check), from its ENV: no file, no index.
    settings = inside.stdout.splitlines()
    assert settings and all(line.startswith(":env:.") for line in settings), settings
    assert not [line for line in settings if re.search(r"index|find-links|trusted|cert", line)]


def test_help_and_a_two_process_training_job_in_a_plain_container(engine, image, tmp_path):
    p = engine.docker("run", "--rm", TAG, "--help")
    assert p.stdout.startswith("usage: trainer-launch")
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chown(runs, UID, UID)
    # No network at all: the host's name does not resolve, so the ranks must meet on loopback.
    name = f"{IMAGE}-plain"
    try:
        p = engine.docker(
            "run", "--rm", "--name", name, "--network=none", "--shm-size=1g",
            "-e", "NPROC_PER_NODE=2", "-v", f"{runs}:/workspace/runs", TAG,
            "train.max_steps=40", "run_dir=runs/plain", check=False, timeout=300,
        )  # fmt: skip
    finally:
        engine.docker("rm", "-f", name, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 node x 2 process(es)" in p.stderr and "OMP_NUM_THREADS=" in p.stderr
    s = summary(runs / "plain")
    assert (s["world_size"], s["steps"], s["backend"]) == (2, 40, "gloo")
    # `trainer report` works in the image (matplotlib was a dev-only extra: a traceback here).
    p = engine.docker(
        "run", "--rm", "--network=none", "-v", f"{runs}:/workspace/runs", TAG,
        "report", "runs/plain", check=False, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (runs / "plain" / "report" / "loss.png").stat().st_size > 1000
    assert "| run |" in (runs / "plain" / "report" / "report.md").read_text()


def test_compose_cpu_runs_hardened_and_equals_make_run_local(project, cpu_run, tmp_path, report):
    assert_hardened(project.inspect("cpu"), project.memlock)
    assert project.inspect("cpu")["State"]["ExitCode"] == 0
    s = summary(cpu_run)
    assert (s["world_size"], s["steps"], s["backend"]) == (2, STEPS, "gloo")
    local = tmp_path / "local"
    e = {k: v for k, v in os.environ.items() if k not in ("TRAIN_ARGS", "ARGS", "NPROC")}
    made = run(["make", "--no-print-directory", "run-local", f"RUN_DIR={local}"], env=e, cwd=ROOT)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert_same_numbers(cpu_run, local)
    report["bitwise_equal_to_run_local"] = True
    report["accuracy"] = s["eval"]["accuracy"]
    say(f"compose cpu == make run-local bit for bit (accuracy {s['eval']['accuracy']:.4f})")


def test_two_node_after_cpu_trains_its_own_run_one_thread_per_node(project, cpu_run, report):
    # Same runs volume as the cpu run above: node0 must train, not find that run "complete".
    t = time.monotonic()
    project("--profile", "two-node", "up", "--no-build", "--detach", "node0", "node1")
    codes = [project.wait(n, timeout=900) for n in ("node0", "node1")]
    report["compose_two_node_wall_s"] = round(time.monotonic() - t, 1)
    logs = [project.logs(n) for n in ("node0", "node1")]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "already complete" not in logs[0]
    for name, log in zip(("node0", "node1"), logs, strict=True):
        c = project.inspect(name)
        assert_hardened(c, project.memlock)
        assert c["HostConfig"]["NanoCpus"] == 10**9  # `cpus: 1` each: they share this host
        assert "OMP_NUM_THREADS=1 " in log and "2 nodes x 1 process(es)" in log
    run_dir = project.copy_out(
        "node0", "/workspace/runs/two-node/digits-mlp", cpu_run.parent / "2n"
    )
    s = summary(run_dir)
    assert (s["world_size"], s["steps"]) == (2, STEPS) and len(set(s["hostnames"])) == 2
    assert_same_numbers(run_dir, cpu_run)  # 2 ranks in 2 containers == 2 ranks in one
    sps = report["compose_two_node_samples_per_s"] = round(s["samples_per_s"])
    cpu_sps = report["compose_cpu_samples_per_s"]
    say(f"samples/s: cpu profile {cpu_sps:,}, two-node profile {sps:,}")
    # Oversubscribed (2 threads per container on 2 cores) it ran ~20x slower than the cpu profile.
    assert sps > cpu_sps / 4, (sps, cpu_sps)


def test_tensorboard_serves_the_runs_volume_on_localhost(project, cpu_run):
    project("--profile", "tensorboard", "up", "--no-build", "--detach", "tensorboard")
    base = f"http://127.0.0.1:{project.tensorboard_port}"
    deadline, status, runs = time.monotonic() + 120, None, []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/", timeout=5) as r:
                status = r.status
            with urllib.request.urlopen(f"{base}/data/runs", timeout=5) as r:
                runs = json.loads(r.read())
            if "cpu/digits-mlp/tb" in runs:
                break
        except OSError:
            pass
        time.sleep(1)
    assert status == 200 and "cpu/digits-mlp/tb" in runs, (
        status,
        runs,
        project.logs("tensorboard"),
    )
    c = project.inspect("tensorboard")
    assert c["HostConfig"]["ReadonlyRootfs"] and c["Config"]["User"] == f"{UID}:{UID}"
    assert c["HostConfig"]["PortBindings"]["6006/tcp"][0]["HostIp"] == "127.0.0.1"


def test_compose_hosts_file_on_two_hosts_equals_one_container_bit_for_bit(
    engine, project, cpu_run, tmp_path, report
):
    """compose.hosts.yaml as two real hosts would run it, on one engine: two `host-cpu`
    containers with host networking, NODE_RANK 0 and 1, the rendezvous on 127.0.0.1, the runs on
    one bind-mounted folder (the shared storage). Same numbers as the cpu service's 2 ranks."""
    shared = tmp_path / "shared-runs"
    shared.mkdir()
    os.chown(shared, UID, UID)  # docs/containers.md: the image's user writes the runs
    override = tmp_path / "hosts-override.yaml"
    lines = ["services:", "  host-cpu:", f"    image: {TAG}", "    pull_policy: never"]
    lines += ["    cpus: 1"]  # two "hosts" on one machine's 2 cores: a core each
    if not project.memlock:
        lines += ["    ulimits: !override", "      stack: 67108864"]
    override.write_text("\n".join(lines) + "\n")
    common = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                  RUNS_DIR=str(shared), NPROC_PER_NODE="1", DATA_DIR=str(project.data))  # fmt: skip
    names = [f"{PROJECT}-host{rank}" for rank in (0, 1)]

    def hosts(name, *args, **env):
        return compose(engine, name, override, *args, base="compose.hosts.yaml", **common, **env)

    t = time.monotonic()
    try:
        for rank, name in enumerate(names):
            # Two hosts have two addresses: both on 127.0.0.1, torchrun's node identities
            # (address, pid) collided whenever both agents got the same pid in their own PID
            # namespaces, and the rendezvous waited for a second node forever.
            hosts(name, "--profile", "cpu", "up", "--no-build", "--detach", "host-cpu",
                  NODE_RANK=str(rank), HOST_IP=f"127.0.0.{rank + 1}")  # fmt: skip
        ids = [hosts(n, "ps", "--all", "--quiet", "host-cpu", NODE_RANK="0").stdout.split()[0]
               for n in names]  # fmt: skip
        codes = [int(engine.docker("wait", i, timeout=900).stdout.strip()) for i in ids]
        report["compose_hosts_wall_s"] = round(time.monotonic() - t, 1)
        logs = [engine.docker("logs", i).stdout + engine.docker("logs", i).stderr for i in ids]
        assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
        for i, log in zip(ids, logs, strict=True):
            c = json.loads(engine.docker("inspect", i).stdout)[0]
            assert c["HostConfig"]["NetworkMode"] == "host"
            assert_hardened(c, project.memlock)
            assert "2 nodes x 1 process(es)" in log and "OMP_NUM_THREADS=1 " in log, log[-2000:]
        run_dir = shared / "hosts" / "digits-mlp"  # rank 0 wrote it on the "shared storage"
        s = summary(run_dir)
        assert (s["world_size"], s["steps"]) == (2, STEPS)
        assert_same_numbers(run_dir, cpu_run)  # 2 hosts x 1 rank == 1 container x 2 ranks
        say(f"compose.hosts.yaml: 2 host-network containers == the cpu service, bit for bit "
            f"({report['compose_hosts_wall_s']} s)")  # fmt: skip
    finally:
        for name in names:
            hosts(name, "--profile", "cpu", "down", "--volumes", "--timeout", "5",
                  NODE_RANK="0", check=False)  # fmt: skip


def _wait_for_line(read, pattern: str, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(pattern, read(), re.M):
            return m
        time.sleep(0.5)
    raise AssertionError(f"no line matching {pattern!r} in {timeout} s: {read()[-3000:]}")


def _wait_for_step(read, minimum: int, timeout: float = 300) -> int:
    """The first progress line ("step 1,234/5,678 ...") at or past step `minimum`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(m.replace(",", "")) for m in re.findall(r"^step ([\d,]+)/", read(), re.M)]
        if steps and max(steps) >= minimum:
            return max(steps)
        time.sleep(0.5)
    raise AssertionError(f"no step {minimum} in {timeout} s: {read()[-3000:]}")


def _wait_until_gone(group: int, timeout: float = 120) -> None:
    """Until no process of process group `group` is left (the ranks saved and exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"process group {group} still alive after {timeout} s")


def test_one_run_through_three_launchers_and_two_stops_ends_bitwise_at_world_1(
    engine, image, memlock_ok, tmp_path, report
):
    """The headline as a user meets it: a run started by `make run-local` (2 ranks) is stopped
    by SIGTERM, resumed in a compose container on 1 rank, stopped again, and finished by the
    Kubernetes cpu-smoke overlay's two pods (network namespaces, tests/test_k8s_multinode.py),
    all on one run folder. Under repro.world_invariant its final weights equal an uninterrupted
    one-process run's, bit for bit."""
    from tests import k8s as kube
    from tests.test_k8s_multinode import Cluster, _network, _unavailable

    if reason := _unavailable():
        pytest.skip(reason)
    shared = tmp_path / "shared"  # the runs storage every launcher sees
    shared.mkdir()
    config = shared / "train.yaml"  # the cpu-smoke overlay's own config file, for all three
    config.write_text((ROOT / "k8s" / "overlays" / "cpu-smoke" / "train.yaml").read_text())
    steps = 60 * STEPS_PER_EPOCH
    overrides = ["repro.world_invariant=true", "train.epochs=60", "ckpt.every_epochs=5"]
    run_dir = shared / "headline"

    # The reference: one process, start to end.
    e = {k: v for k, v in os.environ.items() if k not in ("TRAIN_ARGS", "ARGS", "NPROC")}
    ref = tmp_path / "reference"
    p = run([str(ROOT / ".venv" / "bin" / "trainer"), "train", "--config", str(config),
             *overrides, f"run_dir={ref}"], env=e, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

    # 1. make run-local (2 ranks), SIGTERM to its process group once it is well under way.
    log = tmp_path / "run-local.log"
    with open(log, "w") as out:
        make = subprocess.Popen(
            ["make", "--no-print-directory", "run-local", f"RUN_DIR={run_dir}",
             f"ARGS=--config {config} {' '.join(overrides)}"],
            env=e, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_for_step(log.read_text, 230)
        os.killpg(make.pid, signal.SIGTERM)  # as Ctrl-C would: make, torchrun and the ranks
        make.wait(timeout=120)
        _wait_until_gone(make.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(make.pid, signal.SIGKILL)
    first = re.search(r"stopped by SIGTERM at step (\d+); checkpoint", log.read_text())
    assert first, log.read_text()[-3000:]
    first_stop = int(first.group(1))

    # 2. compose, 1 rank, on the same folder (the image's user writes to it), SIGTERM again.
    for path in [shared, *shared.rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    override = tmp_path / "headline-override.yaml"
    lines = ["services:", "  cpu:", f"    image: {TAG}", "    pull_policy: never"]
    lines += ["    volumes: !override", f"      - {shared}:/workspace/runs"]
    if not memlock_ok:
        lines += ["    ulimits: !override", "      stack: 67108864"]
    override.write_text("\n".join(lines) + "\n")
    name = f"{PROJECT}-headline"
    data = tmp_path / "data"
    data.mkdir()
    args = " ".join(["--config runs/train.yaml", "run_dir=runs/headline", *overrides])

    def c(*a, **kw):
        return compose(engine, name, override, *a, NPROC_PER_NODE="1", TRAIN_ARGS=args,
                       DATA_DIR=str(data), **kw)  # fmt: skip

    try:
        c("--profile", "cpu", "up", "--no-build", "--detach", "cpu")
        logs = lambda: c("logs", "--no-color", "--no-log-prefix", "cpu").stdout  # noqa: E731
        _wait_for_line(logs, rf"resumed from \S+ \(step {first_stop},")
        _wait_for_step(logs, first_stop + 230)
        c("stop", "cpu", timeout=120)
        container = c("ps", "--all", "--quiet", "cpu").stdout.split()[0]
        code = json.loads(engine.docker("inspect", container).stdout)[0]["State"]["ExitCode"]
        assert code == 3, logs()[-3000:]
        second = re.search(r"stopped by SIGTERM at step (\d+); checkpoint", logs())
        assert second and int(second.group(1)) > first_stop, logs()[-3000:]
        assert "1 node x 1 process(es)" in logs()
    finally:
        c("--profile", "cpu", "down", "--volumes", "--timeout", "5", check=False)
    second_stop = int(second.group(1))

    # 3. the cpu-smoke overlay's two pods finish it (trainer-launch, c10d across namespaces).
    pods = kube.pods(kube.render("cpu-smoke"))
    with _network(pods) as net:
        extra = {"TRAIN_ARGS": " ".join([f"run_dir={run_dir}", *overrides])}
        (tmp_path / "k8s").mkdir()
        cluster = Cluster(tmp_path / "k8s", net, extra_env=extra)
        try:
            codes = cluster.run_all()
        finally:
            cluster.close()
    assert codes == [0, 0], cluster.logs()
    assert f"(step {second_stop}," in cluster.log(0) and "resumed from" in cluster.log(0)

    s = summary(run_dir)
    assert (s["steps"], s["world_size"]) == (steps, 2)
    assert s["eval"] == summary(ref)["eval"]
    w, r = weights(run_dir), weights(ref)
    assert w.keys() == r.keys() and all(w[k].equal(r[k]) for k in r)
    report["headline_stops"] = [first_stop, second_stop]
    say(f"run-local (2 ranks) -> SIGTERM at step {first_stop} -> compose (1 rank) -> SIGTERM at "
        f"step {second_stop} -> 2 netns pods -> step {steps}: == one process, bit for bit")  # fmt: skip


INSIDE = r"""
set -u
echo "uid=$(id -u) gid=$(id -g)"
grep -E '^(CapEff|NoNewPrivs):' /proc/self/status | tr -d '\t'
echo "pid1=$(tr '\0' ' ' < /proc/1/cmdline)"
echo "stack=$(ulimit -s) memlock=$(ulimit -l)"
echo "shm=$(df -k /dev/shm | awk 'NR==2 {print $2}')"
touch /probe 2>/dev/null && echo "root=rw" || echo "root=ro"
touch /workspace/data/probe 2>/dev/null && echo "data=rw" || echo "data=ro"
touch /tmp/probe /workspace/runs/probe && echo "tmp+runs=rw"
awk '$3 == "tmpfs" {print "tmpfs=" $2}' /proc/mounts
"""


def test_sigterm_to_a_compose_service_checkpoints_exits_3_and_up_resumes(
    engine, image, memlock_ok, tmp_path, report
):
    p = Project(engine, f"{PROJECT}-sigterm", tmp_path, memlock_ok)
    epochs = 60  # ~20 s of training: the SIGTERM lands long before the end
    args = dict(TRAIN_ARGS=f"train.epochs={epochs}")
    try:
        p("--profile", "cpu", "up", "--no-build", "--detach", "cpu", **args)
        deadline = time.monotonic() + 300
        while not re.search(r"^step [\d,]+/[\d,]+ .* elapsed, ETA", log := p.logs("cpu"), re.M):
            assert time.monotonic() < deadline and "exited" not in p("ps", "-a", "cpu").stdout, log
            time.sleep(0.5)
        # From inside the running container: who it runs as and what it may touch.
        seen = p("exec", "-T", "cpu", "sh", "-c", INSIDE).stdout
        facts = dict(line.split("=", 1) for line in seen.split() if "=" in line)
        assert facts["uid"] == facts["gid"] == str(UID), seen
        assert "CapEff:0000000000000000" in seen and "NoNewPrivs:1" in seen, seen
        assert facts["pid1"].startswith("/sbin/docker-init") and "trainer-launch" in seen, seen
        assert facts["stack"] == "65536" and (facts["memlock"] == "unlimited") == memlock_ok
        assert int(facts["shm"]) == 2 * 1024**2, seen  # KiB
        assert (facts["root"], facts["data"], facts["tmp+runs"]) == ("ro", "ro", "rw"), seen
        assert {"/tmp", "/home/trainer"} <= set(re.findall(r"tmpfs=(\S+)", seen)), seen

        t = time.monotonic()
        p("stop", "cpu", timeout=120)  # SIGTERM to docker-init -> trainer-launch -> the ranks
        report["sigterm_stop_s"] = round(time.monotonic() - t, 1)
        assert p.inspect("cpu")["State"]["ExitCode"] == 3, p.logs("cpu")[-3000:]
        m = re.search(r"stopped by SIGTERM at step (\d+); checkpoint (\S+) saved", p.logs("cpu"))
        assert m, p.logs("cpu")[-3000:]
        step, checkpoint = int(m.group(1)), m.group(2)
        saved = p.copy_out("cpu", checkpoint, tmp_path / "checkpoint")
        assert (saved / "meta.json").is_file(), sorted(saved.iterdir())

        up = p("--profile", "cpu", "up", "--no-build", "--abort-on-container-exit",
               "--exit-code-from", "cpu", "cpu", check=False, **args)  # fmt: skip
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-2000:]
        assert f"resumed from {checkpoint} (step {step}," in p.logs("cpu")
        run_dir = p.copy_out("cpu", "/workspace/runs/cpu/digits-mlp", tmp_path / "run")
        assert summary(run_dir)["steps"] == epochs * STEPS_PER_EPOCH
        say(f"SIGTERM at step {step}: exit 3 in {report['sigterm_stop_s']} s, resumed to the end")
    finally:
        p.down()


def test_the_ratings_example_built_on_the_image_runs_in_compose_like_one_local_process(
    engine, image, memlock_ok, tmp_path, tmp_path_factory, report
):
    """A user's project on the image: examples/ratings/Dockerfile built FROM it (its package
    pip-installed with the build backend from the pip.conf secret, no registry), then
    `docker compose -f compose.yaml -f examples/ratings/compose.yaml --profile cpu up cpu`: the
    example's train.py on 2 ranks in the hardened cpu service. Under repro.world_invariant its
    metrics, losses and weights equal train.py's trainer.fit on one rank here, to the bit."""
    import tomllib

    from tests import example_ratings as ratings

    backend = tomllib.loads((ratings.EXAMPLE / "pyproject.toml").read_text())["build-system"]
    t = time.monotonic()
    wheels = Wheelhouse(image["python"], backend["requires"], name="ratings-wheels")
    try:
        build = engine.docker(
            "build", "-f", ratings.DOCKERFILE, "--build-arg", f"BASE_IMAGE={TAG}",
            "--secret", f"id=pip.conf,src={wheels.pip_conf}", "--network=host",
            "--progress=plain", "-t", RATINGS_TAG, ratings.EXAMPLE, check=False,
        )  # fmt: skip
    finally:
        wheels.close()
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    report["ratings_build_s"] = round(time.monotonic() - t, 1)
    history = engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", RATINGS_TAG)
    assert wheels.url not in history.stdout and "no-index" not in history.stdout

    override = tmp_path / "ratings-override.yaml"  # the test's image, subnet and ulimits only
    lines = ["services:", "  cpu:", f"    image: {RATINGS_TAG}", "    pull_policy: never"]
    if not memlock_ok:
        lines += ["    ulimits: !override", "      stack: 67108864"]
    name = f"{PROJECT}-ratings"
    lines += ["networks:", "  default:", "    ipam:", "      config:"]
    lines += [f"        - subnet: {SUBNETS[name]}"]
    override.write_text("\n".join(lines) + "\n")
    data = tmp_path / "data"  # DATA_DIR: unused (the CSVs are in the image), mounted read-only
    data.mkdir()

    def c(*args, **kw):
        return compose(engine, name, [ratings.COMPOSE_FILE, override], *args, DATA_DIR=str(data),
                       TRAIN_ARGS=" ".join(ratings.SHORT), **kw)  # fmt: skip

    t = time.monotonic()
    try:
        up = c("--profile", "cpu", "up", "--no-build", "--abort-on-container-exit",
               "--exit-code-from", "cpu", "cpu", check=False)  # fmt: skip
        report["ratings_compose_wall_s"] = round(time.monotonic() - t, 1)
        logs = c("logs", "--no-color", "--no-log-prefix", "cpu").stdout
        assert up.returncode == 0, logs[-3000:] + up.stderr[-2000:]
        container = c("ps", "--all", "--quiet", "cpu").stdout.split()[0]
        inspected = json.loads(engine.docker("inspect", container).stdout)[0]
        assert inspected["Config"]["Image"] == RATINGS_TAG
        assert_hardened(inspected, memlock_ok)
        assert "1 node x 2 process(es)" in logs, logs[-3000:]
        run_dir = tmp_path / "run"
        engine.docker("cp", f"{container}:/workspace/runs/cpu/ratings", str(run_dir))
    finally:
        c("--profile", "cpu", "down", "--volumes", "--timeout", "5", check=False)

    reference = ratings.reference(tmp_path_factory)
    s, ref = summary(run_dir), summary(reference)
    assert (s["world_size"], ref["world_size"], s["backend"]) == (2, 1, "gloo")
    assert s["config"]["model"]["name"] == "ratings.model:build"  # what train.py handed over
    assert_same_numbers(run_dir, reference)
    report["ratings_rmse"] = s["eval"]["rmse"]
    say(f"ratings example image ({report['ratings_build_s']} s to build) in compose on 2 ranks "
        f"({report['ratings_compose_wall_s']} s) == 1 local rank, bit for bit "
        f"(rmse {s['eval']['rmse']:.4f})")  # fmt: skip
