"""TorchX: trainer/components.py and TorchX's stock dist.ddp, through the real `torchx` CLI.

local_cwd runs for real (2 CPU processes) and must give exactly the numbers of the same config
under plain torchrun. There is no Docker engine or cluster here, so `local_docker` and `kubernetes`
are checked through their dry runs (the exact container and Volcano Job TorchX would submit), and
the local_docker container's command is executed the way the image would run it (its ENTRYPOINT
from docker/Dockerfile, then TorchX's command), with this venv standing in for the image's.
"""

from __future__ import annotations

import configparser
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import dockerfile
from tests.helpers import BIN, REFERENCE, ROOT, env, slow_mlp, train_losses, weights
from trainer.config import DEFAULT_PRESET

COMPONENT = "trainer/components.py:train"  # as typed from the repo root (and in .torchxconfig)
MATCHES_TORCHRUN = [*REFERENCE, "model.kwargs.delay=0"]  # conftest's reference_runs config


def run_local_cwd(tmp_path: Path, *args: str, **kwargs):
    """`torchx run -s local_cwd ARGS`, its logs under tmp_path."""
    return torchx(
        "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}", *args,
        tmp_path=tmp_path, **kwargs,
    )  # fmt: skip


def torchx(*args: str, tmp_path: Path, check: bool = True, timeout: float = 240):
    """The `torchx` CLI from the repo root with only the repo's .torchxconfig (not ~/.torchxconfig)."""
    e = env(TORCHXCONFIG=str(ROOT / ".torchxconfig"))
    e["PATH"] = os.pathsep.join([str(BIN), e["PATH"]])  # local_cwd's `bash -c "torchrun ..."`
    p = subprocess.run(
        [str(BIN / "torchx"), *args],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"torchx {' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}"
        )
    return p


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_same_numbers(run: Path, reference: Path) -> None:
    """Same world size, same steps: the same losses, accuracy and weights, bit for bit (CPU)."""
    assert train_losses(run) == train_losses(reference)
    assert summary(run)["eval"] == summary(reference)["eval"]
    w, ref = weights(run), weights(reference)
    assert w.keys() == ref.keys() and all(w[k].equal(ref[k]) for k in ref)


def torchrun_argv(command: list[str]) -> list[str]:
    """TorchX's `bash -c "torchrun ..."` -> torchrun's argv."""
    assert command[:2] == ["bash", "-c"], command
    argv = shlex.split(command[2])
    assert argv[0] == "torchrun", argv
    return argv


def torchrun_flags(argv: list[str]) -> dict[str, str]:
    """torchrun's `--flag value` pairs, up to the module it runs."""
    flags, i = {}, 1
    while argv[i] != "-m":
        flags[argv[i]] = argv[i + 1]
        i += 2
    return flags


def worker_argv(argv: list[str]) -> list[str]:
    """What each torchrun worker runs: the tail after `-m`."""
    return argv[argv.index("-m") :]


def expected_worker(app_id: str, config: str, overrides: list[str]) -> list[str]:
    return ["-m", "trainer", "train", "--config", config, f"run_dir=runs/{app_id}", *overrides]


def fail_once_mlp(in_shape, num_classes, hidden=(32,), dropout=0.0, delay=0.0):
    """tests.helpers.slow_mlp, except that rank 1 of torchrun's first attempt dies building it."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure: rank 1, first attempt")
    return slow_mlp(in_shape, num_classes, hidden=hidden, dropout=dropout, delay=delay)


# ---------------------------------------------------------------------------------------------
# Real runs on this machine (local_cwd): 2 CPU processes each.


@pytest.mark.slow
def test_stock_dist_ddp_runs_the_trainer_with_no_wrapper(tmp_path, reference_runs):
    run = tmp_path / "run"
    run_local_cwd(
        tmp_path,
        "dist.ddp",
        "-j",
        "1x2",
        "-m",
        "trainer",
        "train",
        *MATCHES_TORCHRUN,
        f"run_dir={run}",
    )
    s = summary(run)
    assert s["world_size"] == 2 and len(s["hostnames"]) == 2
    assert_same_numbers(run, reference_runs(2))


# examples/ratings under the stock component: its own script (trainer.fit) on every rank, as
# docs/torchx.md and examples/ratings/README.md give the command (there data.root is the default).
RATINGS_SCRIPT = "examples/ratings/train.py"


@pytest.mark.slow
def test_stock_dist_ddp_runs_the_ratings_examples_script_bitwise_like_one_process(
    tmp_path, tmp_path_factory
):
    from tests import example_ratings as ratings

    reference = ratings.reference(tmp_path_factory)
    run = tmp_path / "run"
    run_local_cwd(
        tmp_path, "dist.ddp", "-j", "1x2", "--script", RATINGS_SCRIPT, *ratings.SHORT,
        f"data.root={ratings.data(tmp_path_factory)}", f"run_dir={run}",
    )  # fmt: skip
    s = summary(run)
    assert s["world_size"] == 2 and summary(reference)["world_size"] == 1
    assert s["config"]["model"]["name"] == "ratings.model:build"  # what train.py handed over
    assert_same_numbers(run, reference)  # repro.world_invariant: 2 ranks == 1, to the bit


@pytest.mark.slow
@pytest.mark.long  # 34 s: two attempts of a 2-rank worker group (make test-long, as launch's)
def test_max_restarts_restarts_the_worker_group_in_place(tmp_path, reference_runs):
    """The component on local_cwd: a 2-rank job that TorchX reports SUCCEEDED after torchrun
    restarted its worker group (a rank failed on purpose), computing exactly what plain torchrun
    does."""
    run = tmp_path / "run"
    p = run_local_cwd(
        tmp_path,
        COMPONENT,
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        *MATCHES_TORCHRUN,
        f"model.name={__name__}:fail_once_mlp",
        f"run_dir={run}",
    )
    assert "injected failure: rank 1, first attempt" in p.stdout + p.stderr
    assert "Job finished: SUCCEEDED" in p.stderr
    s = summary(run)
    assert s["restart_count"] == 1 and s["world_size"] == 2
    assert len(s["hostnames"]) == 2 and s["strategy"] == "ddp"
    assert s["name"] == DEFAULT_PRESET  # the component's default config
    # It failed while building the model, before any step: the restart trains the same run.
    assert_same_numbers(run, reference_runs(2))


# ---------------------------------------------------------------------------------------------
# Dry runs: what TorchX would submit to Kubernetes (Volcano) and to Docker.


K8S = dict(
    config="digits-lenet",
    image="registry.example/trainer:cuda-1",
    nnodes=2,
    nproc_per_node=4,
    cpu=16,
    gpu=4,
    memMB=64000,
    max_restarts=2,
    claim="team-runs",
    dst="/workspace/runs",
    queue="team-a",
)
OVERRIDES = ["optim.lr=0.01", "train.epochs=3"]


def k8s_dryrun(tmp_path) -> dict:
    k = K8S
    p = torchx(
        "run",
        "--dryrun",
        "-s",
        "kubernetes",
        "-cfg",
        f"queue={k['queue']}",
        COMPONENT,
        "--config",
        k["config"],
        "--image",
        k["image"],
        "--nnodes",
        str(k["nnodes"]),
        "--nproc_per_node",
        str(k["nproc_per_node"]),
        "--cpu",
        str(k["cpu"]),
        "--gpu",
        str(k["gpu"]),
        "--memMB",
        str(k["memMB"]),
        "--max_restarts",
        str(k["max_restarts"]),
        "--mounts",
        f"type=volume,src={k['claim']},dst={k['dst']}",
        "--env",
        "NCCL_DEBUG=INFO",
        *OVERRIDES,
        tmp_path=tmp_path,
    )
    return yaml.safe_load(p.stdout.split("=== SCHEDULER REQUEST ===", 1)[1])


def test_kubernetes_dryrun_is_a_volcano_job_running_the_trainer_under_torchrun(tmp_path):
    from trainer.launch import TORCH_ENV
    from trainer.launch.nodeenv import DEFAULT_JOIN_TIMEOUT_S

    k = K8S
    job = k8s_dryrun(tmp_path)
    app_id = job["metadata"]["name"]
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh/")
    assert job["spec"]["schedulerName"] == "volcano" and job["spec"]["queue"] == k["queue"]
    tasks = job["spec"]["tasks"]
    assert len(tasks) == k["nnodes"] and all(t["replicas"] == 1 for t in tasks)
    for rank, task in enumerate(tasks):
        pod = task["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == k["image"]
        argv = torchrun_argv(c["command"])
        flags = torchrun_flags(argv)
        assert flags["--nnodes"] == str(k["nnodes"])
        assert flags["--nproc_per_node"] == str(k["nproc_per_node"])
        assert flags["--rdzv_id"] == app_id and flags["--rdzv_backend"] == "c10d"
        assert worker_argv(argv) == expected_worker(app_id, k["config"], OVERRIDES)
        limits = c["resources"]["limits"]
        assert limits == {
            "cpu": f"{k['cpu'] * 1000}m",
            "memory": f"{k['memMB']}M",
            "nvidia.com/gpu": str(k["gpu"]),
        }
        e = {v["name"]: v["value"] for v in c["env"]}
        assert TORCH_ENV.items() <= e.items()
        assert e["PET_MAX_RESTARTS"] == str(k["max_restarts"]) and e["NCCL_DEBUG"] == "INFO"
        assert e["PET_RDZV_CONF"] == (
            f"join_timeout={DEFAULT_JOIN_TIMEOUT_S},read_timeout={DEFAULT_JOIN_TIMEOUT_S}"
        )
        if rank == 0:  # the rendezvous host: TorchX points its endpoint at itself
            assert e["TORCHX_RANK0_HOST"] == "localhost"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"] == {"medium": "Memory"}
        assert mounts[k["dst"]]["persistentVolumeClaim"] == {"claimName": k["claim"]}
        assert len(mounts) == 2  # --mounts at /workspace/runs replaced the default claim


def test_the_documented_gpu_job_sizes_memory_for_its_gpus_and_keeps_runs_on_the_claim(tmp_path):
    # `torchx run --dryrun -s kubernetes ...:train --nnodes 2 --gpu 8`, as docs/torchx.md has it:
    # TorchX's 4 GB / 2 CPUs for 8 GPUs (with /dev/shm counted against that memory) and runs
    # that died with the pod, before.
    from trainer.components import RUNS_DIR

    def pods(*extra):
        p = torchx("run", "--dryrun", "-s", "kubernetes", COMPONENT, *extra, tmp_path=tmp_path)
        job = yaml.safe_load(p.stdout.split("=== SCHEDULER REQUEST ===", 1)[1])
        return [t["template"]["spec"] for t in job["spec"]["tasks"]]

    claim = yaml.safe_load((ROOT / "k8s" / "base" / "pvc.yaml").read_text())["metadata"]["name"]
    for pod in pods("--nnodes", "2", "--gpu", "8"):
        (c,) = pod["containers"]
        assert c["resources"]["limits"] == {
            "cpu": "32000m",  # 4 per GPU
            "memory": f"{4096 + 8 * 16384}M",  # 16 GB per GPU on top of the CPU default
            "nvidia.com/gpu": "8",
        }
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"] == {"medium": "Memory"}
        assert mounts[RUNS_DIR]["persistentVolumeClaim"] == {"claimName": claim}
    (cpu_pod,) = pods("--runs_volume", "")  # no GPU: TorchX's defaults; no runs volume asked
    (c,) = cpu_pod["containers"]
    assert c["resources"]["limits"] == {"cpu": "2000m", "memory": "4096M"}
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/dev/shm"]


def test_every_job_gets_its_own_rendezvous_id_and_run_dir(tmp_path):
    ids = []
    for _ in range(2):
        (task, *_) = k8s_dryrun(tmp_path)["spec"]["tasks"]
        flags = torchrun_flags(torchrun_argv(task["template"]["spec"]["containers"][0]["command"]))
        ids.append(flags["--rdzv_id"])
    assert ids[0] != ids[1]


def docker_dryrun(*args: str):
    """The Docker containers TorchX's local_docker would start (its own runner API, in process),
    with the repo's .torchxconfig applied as the CLI applies it."""
    from torchx.runner import config, get_runner

    cfg: dict = {}
    config.apply("local_docker", cfg, dirs=[str(ROOT)])
    with get_runner() as runner:
        info = runner.dryrun_component(
            f"{ROOT}/{COMPONENT}", list(args), "local_docker", cfg=cfg, workspace=None
        )
    return info.request


def test_local_docker_dryrun_containers(tmp_path, monkeypatch):
    from trainer.launch import TORCH_ENV

    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # .torchxconfig copies it into the containers
    monkeypatch.setenv("TORCHXCONFIG", str(ROOT / ".torchxconfig"))  # this file alone
    data = tmp_path / "data"
    nnodes, nproc, cpu, gpu, mem = 2, 2, 3, 2, 6144
    req = docker_dryrun(
        "--image",
        "trainer:cpu",
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        str(nproc),
        "--cpu",
        str(cpu),
        "--gpu",
        str(gpu),
        "--memMB",
        str(mem),
        "--mounts",
        f"type=bind,src={data},dst=/workspace/data,readonly",
        *OVERRIDES,
    )
    assert len(req.containers) == nnodes
    rank0 = req.containers[0].kwargs["name"]
    for c in req.containers:
        assert c.image == "trainer:cpu"
        argv = torchrun_argv(c.command)
        flags = torchrun_flags(argv)
        assert flags["--nnodes"] == str(nnodes) and flags["--nproc_per_node"] == str(nproc)
        assert flags["--rdzv_id"] == req.app_id
        assert worker_argv(argv) == expected_worker(req.app_id, "digits-mlp", OVERRIDES)
        kw = c.kwargs
        assert kw["shm_size"] == kw["mem_limit"] == f"{mem}m"  # /dev/shm as large as the memory
        assert kw["nano_cpus"] == cpu * 10**9
        assert [r["Count"] for r in kw["device_requests"]] == [gpu]
        assert TORCH_ENV.items() <= kw["environment"].items()
        assert kw["environment"]["TORCHX_RANK0_HOST"] == rank0
        assert kw["environment"]["NCCL_DEBUG"] == "INFO"
        mounts = {m["Target"]: (m["Type"], m["Source"], m["ReadOnly"]) for m in kw["mounts"]}
        assert mounts == {
            "/workspace/data": ("bind", str(data), True),
            "/workspace/runs": ("volume", "trainer-runs", False),  # runs outlive the container
        }


def image_run(command: list[str], container_env: dict[str, str], workspace: Path):
    """argv and env of a `docker run IMAGE COMMAND...` of docker/Dockerfile's CPU image, with the
    image's paths mapped to this machine (/opt/venv -> this venv, /workspace -> `workspace`)."""
    image = dockerfile.read(
        ROOT / "docker" / "Dockerfile", {"VARIANT": "cpu"}, base_env={"PATH": os.environ["PATH"]}
    )
    mapping = {
        image.env["VIRTUAL_ENV"]: sys.prefix,
        image.env["HOME"]: str(workspace / "home"),
        image.workdir: str(workspace),
    }
    e = env()
    for key, value in {**image.env, **container_env}.items():
        for image_path, local in mapping.items():
            value = value.replace(image_path, local)
        e[key] = value
    (workspace / "home").mkdir(parents=True, exist_ok=True)
    return [*image.entrypoint, *command], e


@pytest.mark.slow
def test_local_docker_container_command_runs_through_the_image_entrypoint(tmp_path, reference_runs):
    # Docker appends TorchX's command to the image's ENTRYPOINT (trainer-launch), which must run
    # it as is: `trainer-launch bash -c "torchrun ..."`.
    (c,) = docker_dryrun(
        "--image", "trainer:cpu", "--nproc_per_node", "2", *MATCHES_TORCHRUN, "run_dir=runs/docker"
    ).containers
    argv, e = image_run(c.command, c.kwargs["environment"], tmp_path)
    p = subprocess.run(argv, env=e, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "is no trainer subcommand: running it as is" in p.stderr
    run = tmp_path / "runs" / "docker"
    assert summary(run)["world_size"] == 2
    assert_same_numbers(run, reference_runs(2))


def test_entrypoint_runs_any_executable_as_is_and_trainer_subcommands_as_before():
    from trainer.cli import COMMANDS
    from trainer.launch import make_plan, split_command

    path = {"PATH": os.environ["PATH"]}
    command = ["bash", "-c", "torchrun --nnodes 1 -m trainer train"]
    c = split_command(command, path)
    assert c.as_is and not c.distributed
    p = make_plan(path, c, gpus=0, cpus=2, python=sys.executable)
    assert list(p.argv) == command and not p.child and not p.env
    assert "train" in COMMANDS and "config" in COMMANDS
    assert split_command(["config", "show"], path).trainer_args == ("config", "show")
    assert split_command(["no-such-program-here"], path).trainer_args == ("no-such-program-here",)
    assert split_command(["optim.lr=1"], path).trainer_args == ("train", "optim.lr=1")
    launched = subprocess.run([str(BIN / "trainer-launch"), "sh", "-c", "exit 7"], env=env())
    assert launched.returncode == 7  # exec'd: the command's own exit code


# ---------------------------------------------------------------------------------------------
# The component itself: help, errors, imports, defaults.


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_help_shows_the_docstring(tmp_path):
    import docstring_parser

    from trainer import components

    p = torchx("run", COMPONENT, "--help", tmp_path=tmp_path)
    shown = _squeeze(p.stdout)
    doc = docstring_parser.parse(components.train.__doc__)
    assert _squeeze(doc.short_description) in shown and _squeeze(doc.long_description) in shown
    assert [p.arg_name for p in doc.params] == list(inspect.signature(components.train).parameters)
    for param in doc.params:
        assert _squeeze(param.description) in shown, param.arg_name


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["optim.lrr=0.1"], "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
        (["--config", "digits-lenett"], "(did you mean 'digits-lenet'?)"),
        (["--gpu", "2", "--nproc_per_node", "4"], "--nproc_per_node 4 but 2 GPU(s) per node"),
        (["-h", "no-such-host"], "-h no-such-host: No named resource found"),
        (["--memMB", "100"], "--memMB 100: use 256 MB or more"),
        (["--cpu", "-1"], "--cpu -1: use 1 or more CPUs"),
        (
            ["--nnodes", "2", "--nproc_per_node", "2", "data.global_batch_size=6"],
            "data.global_batch_size=6 does not split over 4 ranks",
        ),
    ],
)
def test_mistakes_stop_before_submitting_in_one_line(tmp_path, args, fragment):
    p = torchx(
        "run",
        "--dryrun",
        "-s",
        "kubernetes",
        "-cfg",
        "queue=q",
        COMPONENT,
        *args,
        tmp_path=tmp_path,
        check=False,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert fragment in p.stderr and "Traceback" not in p.stderr
    assert "SCHEDULER REQUEST" not in p.stdout


def test_one_process_per_gpu_by_default_also_for_a_named_resource():
    from torchx import specs

    from trainer import components

    p4d = specs.resource(h="aws_p4d.24xlarge").gpu
    for kwargs, gpus, nproc in (
        ({}, 0, 1),
        ({"gpu": 4}, 4, 4),
        ({"h": "aws_p4d.24xlarge"}, p4d, p4d),
    ):
        role = components.train(**kwargs).roles[0]
        assert role.resource.gpu == gpus
        flags = torchrun_flags(torchrun_argv([role.entrypoint, *role.args]))
        assert flags["--nproc_per_node"] == str(nproc)


def test_a_config_only_inside_the_image_is_left_to_the_job():
    from trainer import components

    app = components.train("optim.lr=0.1", config="/workspace/configs/mine.yaml")
    assert "--config /workspace/configs/mine.yaml" in app.roles[0].args[1]


def test_importing_and_calling_the_component_loads_no_torch():
    code = (
        "import sys; from trainer import components as c; c.train('train.epochs=1', nproc_per_node=2); "
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], env=env(), check=True, timeout=60)


def test_without_the_extra_the_import_says_what_to_install():
    code = "import sys; sys.modules['torchx'] = None; import trainer.components"
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "ImportError: trainer.components needs TorchX: pip install 'repro-trainer[torchx]'"
    )


def test_torchxconfig_defaults_match_the_makefile_image_and_run_the_built_image():
    from trainer import components

    make = (ROOT / "Makefile").read_text()
    var = {k: re.search(rf"^{k}\s*\?=\s*(\S+)", make, re.M).group(1) for k in ("IMAGE", "VARIANT")}
    built = f"{var['IMAGE']}:{var['VARIANT']}"
    cfg = configparser.ConfigParser()
    cfg.optionxform = str  # TorchX reads keys case-sensitively
    cfg.read(ROOT / ".torchxconfig")
    assert cfg[f"component:{COMPONENT}"]["image"] == built == components.DEFAULT_IMAGE
    assert cfg["component:dist.ddp"]["image"] == built
    assert cfg["cli:run"]["workspace"] == ""  # no patched images: the image `make image` built
    assert cfg["kubernetes"]["queue"] and cfg["local_cwd"]["log_dir"]
