"""trainer-launch: each platform's exact environment -> the torchrun command; then real runs.

The platform environments below are what each one injects into a pod (sources: kubeflow/training-
operator pkg/controller.v1/pytorch envvar.go, master.go, elastic.go; kubeflow/trainer's torch
plugin; Kubernetes Indexed Job and JobSet docs; pytorch/torchx dist.ddp and its kubernetes
scheduler), plus what our own manifests add through the downward API (POD_IP, JOB_NAME, JOBSET_NAME).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import env, free_port, wait_for
from trainer import launch
from trainer.errors import UsageError
from trainer.launch import Command, Route, exit_code, make_plan, split_command
from trainer.launch.nodeenv import CONSUMED_PET, launched_by_torchrun, read_node

PY = "/opt/venv/bin/python"
TRAIN = Command(trainer_args=("train",))
TORCHRUN = [PY, "-m", "torch.distributed.run"]


POD_ROUTE = Route("10.0.0.2", "eth0")


def plan(environ, command=TRAIN, gpus=0, cpus=2, route=POD_ROUTE):
    probed = []

    def probe(node, e):
        probed.append(node.host)
        return route

    p = make_plan(environ, command, gpus=gpus, cpus=cpus, python=PY, probe=probe)
    return p, probed


def flags(p) -> dict[str, str]:
    """torchrun's --name=value flags of a plan."""
    out = {}
    for a in p.argv[len(TORCHRUN) :]:
        if not a.startswith("--") or a == "--no-python":
            break
        name, _, value = a[2:].partition("=")
        out[name] = value
    return out


def conf(p) -> dict[str, str]:
    return dict(item.split("=", 1) for item in flags(p)["rdzv-conf"].split(","))


# --- one node ----------------------------------------------------------------------------------


def test_no_env_is_one_standalone_node_with_one_process_per_gpu():
    p, probed = plan({}, gpus=4)
    assert p.child and list(p.argv) == [
        *TORCHRUN,
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--local-addr=127.0.0.1",  # MASTER_ADDR: the host's name need not resolve
        "--max-restarts=0",
        "-m",
        "trainer",
        "train",
    ]
    # 2 CPUs shared by 4 ranks: trainer.launch.threads; gloo on loopback (no hostname lookup)
    assert p.env == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    assert p.unset == ()
    assert probed == []  # one node: nothing to reach


def test_one_node_keeps_a_users_gloo_interface():
    p, _ = plan({"GLOO_SOCKET_IFNAME": "eth1"}, gpus=0)
    assert "GLOO_SOCKET_IFNAME" not in p.env and "--local-addr=127.0.0.1" in p.argv


@pytest.mark.parametrize(
    "nproc, gpus, cpus, want",
    [("auto", 0, 8, 1), ("auto", 2, 8, 2), ("gpu", 3, 8, 3), ("cpu", 0, 8, 8), ("3", 0, 8, 3)],
)
def test_nproc_per_node_values(nproc, gpus, cpus, want):
    assert read_node({"NPROC_PER_NODE": nproc}, gpus=gpus, cpus=cpus).nproc == want


# --- the platforms -----------------------------------------------------------------------------

PYTORCHJOB_MASTER = {  # training-operator v1: Master replica 0 of a 1 master + 1 worker job
    "PYTHONUNBUFFERED": "0",
    "MASTER_PORT": "23456",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "pj-master-0",
    "PET_MASTER_ADDR": "pj-master-0",
    "WORLD_SIZE": "4",  # replicas x nprocPerNode
    "RANK": "0",  # the NODE index, not a torchrun rank
    "PET_NPROC_PER_NODE": "2",
    "PET_NODE_RANK": "0",
    "PET_NNODES": "2",
}
PYTORCHJOB_WORKER = {**PYTORCHJOB_MASTER, "RANK": "1", "PET_NODE_RANK": "1"}
PYTORCHJOB_ELASTIC = {  # elasticPolicy, Worker replicas only: no MASTER_*, no node rank
    "PYTHONUNBUFFERED": "0",
    "PET_RDZV_ENDPOINT": "ej-worker-0:23456",
    "PET_RDZV_BACKEND": "c10d",
    "PET_NNODES": "1:3",
    "PET_MAX_RESTARTS": "3",
    "PET_NPROC_PER_NODE": "1",
    "PET_RDZV_CONF": "last_call_timeout=30",
}
TRAINJOB_NODE1 = {  # kubeflow/trainer v2 torch plugin, on a JobSet of one Indexed Job
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "1",  # a fieldRef to the job-completion-index annotation
    "PET_MASTER_ADDR": "tj-node-0-0.tj",
    "PET_MASTER_PORT": "29500",
    "JOB_COMPLETION_INDEX": "1",
    "HOSTNAME": "tj-node-0-1",
}
INDEXED_JOB_POD0 = {  # batch/v1 Job, completionMode Indexed, + our env and downward API
    "JOB_COMPLETION_INDEX": "0",
    "HOSTNAME": "train-0",
    "NNODES": "2",
    "NPROC_PER_NODE": "auto",
    "MASTER_ADDR": "train-0.train",
    "MASTER_PORT": "29500",
    "JOB_NAME": "train",
    "POD_IP": "10.8.1.17",
}
JOBSET_POD1 = {  # JobSet: one replicatedJob of one Indexed Job with 2 pods
    "JOB_COMPLETION_INDEX": "1",
    "HOSTNAME": "js-workers-0-1",
    "NNODES": "2",
    "MASTER_ADDR": "js-workers-0-0.js",
    "JOBSET_NAME": "js",  # metadata.labels['jobset.sigs.k8s.io/jobset-name']
    "POD_IP": "10.8.2.5",
}
JOBSET_ONE_POD_PER_JOB = {  # replicas=2 Jobs of 1 pod each: every pod's completion index is 0
    **JOBSET_POD1,
    "JOB_COMPLETION_INDEX": "0",
    "NODE_RANK": "1",  # metadata.annotations['jobset.sigs.k8s.io/job-global-index']
}
TORCHX_WORKER = {  # what torchrun gives rank 1 of TorchX's dist.ddp (observed with torch 2.14.1)
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "34231",
    "OMP_NUM_THREADS": "1",
    "RANK": "1",
    "ROLE_NAME": "",
    "ROLE_RANK": "1",
    "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "train-x1",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "WORLD_SIZE": "2",
    "LOGLEVEL": "WARNING",  # set by dist.ddp
    "TORCHX_RANK0_HOST": "localhost",  # set by the kubernetes scheduler on replica 0
}


def test_pytorchjob_v1_master_hosts_the_rendezvous_and_worker_joins_it():
    master, _ = plan(PYTORCHJOB_MASTER, gpus=2)
    worker, _ = plan(PYTORCHJOB_WORKER, gpus=2)
    for p in (master, worker):
        f = flags(p)
        assert f["nnodes"] == "2" and f["nproc-per-node"] == "2"
        assert f["rdzv-backend"] == "c10d" and f["rdzv-endpoint"] == "pj-master-0:23456"
        assert f["rdzv-id"] == flags(master)["rdzv-id"]  # the same id on every node
        assert set(p.unset) == {k for k in PYTORCHJOB_MASTER if k.startswith("PET_")}
    assert conf(master)["is_host"] == "1" and conf(worker)["is_host"] == "0"
    # RANK/WORLD_SIZE are the operator's per-node values: this is not a torchrun worker.
    assert not launched_by_torchrun(PYTORCHJOB_WORKER)


def test_pytorchjob_v1_elastic_range_restarts_and_conf_pass_through():
    p, _ = plan(PYTORCHJOB_ELASTIC)
    f = flags(p)
    assert f["nnodes"] == "1:3" and f["max-restarts"] == "3"
    assert f["rdzv-endpoint"] == "ej-worker-0:23456"
    c = conf(p)
    assert c["last_call_timeout"] == "30" and c["join_timeout"] == "600"
    assert "is_host" not in c  # no node rank: torchrun recognises its own hostname
    assert "PET_RDZV_CONF" in p.unset and "PET_MAX_RESTARTS" in p.unset


PYTORCHJOB_ELASTIC_ETCD = {  # elasticPolicy rdzvBackend: etcd, rdzvHost/rdzvPort: its Service
    **PYTORCHJOB_ELASTIC,
    "PET_RDZV_BACKEND": "etcd",
    "PET_RDZV_ENDPOINT": "trainer-etcd:2379",
    "PET_RDZV_CONF": "",
}


def test_an_etcd_rendezvous_needs_no_node_to_host_it():
    p, _ = plan(PYTORCHJOB_ELASTIC_ETCD)
    f, c = flags(p), conf(p)
    assert f["rdzv-backend"] == "etcd-v2" and f["rdzv-endpoint"] == "trainer-etcd:2379"
    assert f["nnodes"] == "1:3" and f["max-restarts"] == "3"
    assert c == {"join_timeout": "600", "last_call_timeout": "30"}  # no is_host, no store reads
    assert "elastic: 1 to 3 nodes, 3 restart(s), last call 30 s" in p.summary
    assert p.world_size is None and p.worlds == (1, 2, 3)
    # The plain names; a node rank is no reason for is_host (etcd holds the rendezvous).
    env = {"NNODES": "2:4", "NODE_RANK": "0", "RDZV_BACKEND": "etcd-v2", "RDZV_ENDPOINT": "etcd"}
    p, _ = plan({**env, "RDZV_LAST_CALL_TIMEOUT": "5", "NPROC_PER_NODE": "2"})
    assert flags(p)["rdzv-endpoint"] == "etcd:2379" and conf(p)["last_call_timeout"] == "5"
    assert "is_host" not in conf(p) and p.worlds == (4, 6, 8)


def test_trainjob_v2_node_1():
    p, probed = plan(TRAINJOB_NODE1, gpus=8)
    f = flags(p)
    assert f["nnodes"] == "2" and f["nproc-per-node"] == "8"
    assert f["rdzv-endpoint"] == "tj-node-0-0.tj:29500" and conf(p)["is_host"] == "0"
    assert f["rdzv-id"] == "trainer-tj-node-0-0-tj-29500"  # derived from what every node dials
    assert f["local-addr"] == "10.0.0.2" and probed == ["tj-node-0-0.tj"]
    assert p.env["GLOO_SOCKET_IFNAME"] == p.env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_indexed_job_pod_0_uses_pod_ip_and_job_name():
    p, _ = plan(INDEXED_JOB_POD0, gpus=4, route=Route("10.8.1.17", "eth0"))
    f = flags(p)
    assert conf(p)["is_host"] == "1" and f["local-addr"] == "10.8.1.17"
    assert f["rdzv-id"] == "train" and f["nproc-per-node"] == "4"
    assert f["rdzv-endpoint"] == "train-0.train:29500"


def test_jobset_rank_from_completion_index_or_from_node_rank():
    a, _ = plan(JOBSET_POD1)
    b, _ = plan(JOBSET_ONE_POD_PER_JOB)
    for p in (a, b):
        assert conf(p)["is_host"] == "0" and flags(p)["rdzv-id"] == "js"
        assert flags(p)["local-addr"] == "10.8.2.5"


def test_torchx_worker_is_run_directly_not_relaunched():
    for e in (TORCHX_WORKER, {**TORCHX_WORKER, **TRAINJOB_NODE1}):  # with a Kubeflow pod's PET_*
        assert launched_by_torchrun(e)
        p, _ = plan(e, command=Command(trainer_args=("train", "optim.lr=0.1")))
        assert not p.child and list(p.argv) == [PY, "-m", "trainer", "train", "optim.lr=0.1"]


def test_compose_services_exactly_as_compose_yaml_defines_them(compose_env):
    trainer, _ = plan(compose_env("trainer"), gpus=8)
    assert flags(trainer)["nproc-per-node"] == "8" and "standalone" in flags(trainer)
    cpu, _ = plan(compose_env("cpu", "cpu"), gpus=0)
    assert flags(cpu)["nproc-per-node"] == "2"
    nodes = [plan(compose_env(f"node{i}", "two-node"))[0] for i in (0, 1)]
    assert [conf(p)["is_host"] for p in nodes] == ["1", "0"]
    assert {flags(p)["rdzv-endpoint"] for p in nodes} == {"node0:29500"}
    assert len({flags(p)["rdzv-id"] for p in nodes}) == 1


ALL_PLATFORMS = [
    {},
    PYTORCHJOB_MASTER,
    PYTORCHJOB_WORKER,
    PYTORCHJOB_ELASTIC,
    TRAINJOB_NODE1,
    INDEXED_JOB_POD0,
    JOBSET_POD1,
    JOBSET_ONE_POD_PER_JOB,
]


@pytest.mark.parametrize("environ", ALL_PLATFORMS)
def test_torchrun_always_gets_a_private_rendezvous_store(environ):
    p, _ = plan(environ)
    assert p.child and p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert p.argv[: len(TORCHRUN)] == tuple(TORCHRUN)
    assert not set(p.unset) - set(CONSUMED_PET)


# --- precedence --------------------------------------------------------------------------------


def test_precedence_pet_then_plain_then_job_index():
    base = {"MASTER_ADDR": "a", "NNODES": "3", "NODE_RANK": "2", "JOB_COMPLETION_INDEX": "1"}
    n = read_node(base, gpus=0, cpus=1)
    assert (n.max_nodes, n.node_rank, n.host) == (3, 2, "a")
    n = read_node(
        {**base, "PET_NNODES": "4", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "b"}, gpus=0, cpus=1
    )
    assert (n.max_nodes, n.node_rank, n.host) == (4, 3, "b")
    n = read_node({**base, "NODE_RANK": ""}, gpus=0, cpus=1)
    assert n.node_rank == 1  # empty counts as unset
    n = read_node(
        {**base, "RDZV_ID": "mine", "JOBSET_NAME": "js", "MAX_RESTARTS": "2"}, gpus=0, cpus=1
    )
    assert (n.rdzv_id, n.max_restarts, n.port) == ("mine", 2, 29500)


def test_user_set_socket_interfaces_and_pod_ip_win():
    e = {**JOBSET_POD1, "GLOO_SOCKET_IFNAME": "ib0"}
    p, _ = plan(e, route=Route("10.8.2.5", "eth1"))
    assert "GLOO_SOCKET_IFNAME" not in p.env and p.env["NCCL_SOCKET_IFNAME"] == "eth1"


def test_unreachable_rendezvous_host_leaves_addresses_to_torchrun():
    p, probed = plan({k: v for k, v in TRAINJOB_NODE1.items()}, route=None)
    assert probed and "local-addr" not in flags(p) and "GLOO_SOCKET_IFNAME" not in p.env


# --- bad environments: one line, naming the variable and the fix --------------------------------


@pytest.mark.parametrize(
    "environ, gpus, fragment",
    [
        (
            {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a"},
            0,
            "NODE_RANK=2 must be < NNODES=2",
        ),
        ({"NODE_RANK": "1"}, 0, "NODE_RANK=1 must be < NNODES=1 (the default)"),
        (
            {"PET_NNODES": "2", "PET_NODE_RANK": "5", "MASTER_ADDR": "a"},
            0,
            "PET_NODE_RANK=5 must be < PET_NNODES=2",
        ),
        ({"NNODES": "two"}, 0, "NNODES='two' is not a node count"),
        ({"NNODES": "0"}, 0, "NNODES='0' is not a node count"),
        ({"NNODES": "3:2"}, 0, "NNODES='3:2' is not a node count"),
        ({"NPROC_PER_NODE": "4"}, 2, "NPROC_PER_NODE=4 but only 2 GPU(s) are visible"),
        ({"NPROC_PER_NODE": "gpu"}, 0, "NPROC_PER_NODE=gpu but no GPU is visible"),
        (
            {"NPROC_PER_NODE": "many"},
            0,
            "NPROC_PER_NODE=many is not valid: use auto, gpu, cpu or a number",
        ),
        ({"NPROC_PER_NODE": "0"}, 0, "NPROC_PER_NODE=0 must be >= 1"),
        (
            {"NNODES": "2", "NODE_RANK": "0"},
            0,
            "NNODES=2 needs the rendezvous host: set MASTER_ADDR",
        ),
        ({"NNODES": "2", "MASTER_ADDR": "a"}, 0, "NNODES=2 needs this node's rank: set NODE_RANK"),
        ({"MASTER_PORT": "70000"}, 0, "MASTER_PORT=70000 is not a TCP port"),
        ({"PET_MASTER_PORT": "http"}, 0, "PET_MASTER_PORT='http' is not an integer"),
        ({"MAX_RESTARTS": "-1"}, 0, "MAX_RESTARTS=-1 must be >= 0"),
        ({"RDZV_JOIN_TIMEOUT": "0"}, 0, "RDZV_JOIN_TIMEOUT=0 must be >= 1"),
        (
            {"PET_RDZV_BACKEND": "zookeeper"},
            0,
            "PET_RDZV_BACKEND=zookeeper: the rendezvous backend is c10d",
        ),
        (
            {"RDZV_BACKEND": "etcd", "MASTER_ADDR": "node0"},  # MASTER_ADDR is no etcd server
            0,
            "RDZV_BACKEND=etcd needs the etcd server: set RDZV_ENDPOINT=HOST:PORT",
        ),
        ({"RDZV_ENDPOINT": "a b:2379"}, 0, "RDZV_ENDPOINT='a b:2379' is not HOST:PORT"),
        ({"RDZV_ENDPOINT": "etcd:x"}, 0, "RDZV_ENDPOINT='x' is not an integer"),
        ({"RDZV_LAST_CALL_TIMEOUT": "-1"}, 0, "RDZV_LAST_CALL_TIMEOUT=-1 must be >= 0"),
        ({"NNODES": "1:99999"}, 0, "NNODES='1:99999' is not a node count"),
        ({"PET_RDZV_CONF": "is_host"}, 0, "PET_RDZV_CONF: 'is_host' must look like key=value"),
        ({"JOB_COMPLETION_INDEX": "x"}, 0, "JOB_COMPLETION_INDEX='x' is not an integer"),
    ],
)
def test_unknown_or_contradictory_values_are_one_line_errors(environ, gpus, fragment):
    with pytest.raises(UsageError) as err:
        plan(environ, gpus=gpus)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# --- the command -------------------------------------------------------------------------------


def test_arguments_go_to_trainer_train_after_train_args():
    e = {"TRAIN_ARGS": "--config digits-lenet 'optim.betas=[0.9,0.95]'"}
    assert split_command([], {}).trainer_args == ("train",)
    assert split_command(["optim.lr=1"], e).trainer_args == (
        "train",
        "--config",
        "digits-lenet",
        "optim.betas=[0.9,0.95]",
        "optim.lr=1",
    )
    assert split_command(["config", "show"], e).trainer_args == ("config", "show")
    assert not split_command(["config", "show"], e).distributed
    with pytest.raises(UsageError, match="TRAIN_ARGS: cannot split"):
        split_command([], {"TRAIN_ARGS": "a='b"})


@pytest.mark.parametrize(
    "argv, under_torchrun, direct",
    [
        (
            ["python", "s.py", "--lr", "1"],
            ["--no-python", "python", "s.py", "--lr", "1"],
            ["python", "s.py", "--lr", "1"],
        ),
        (["s.py", "x"], ["s.py", "x"], [PY, "s.py", "x"]),
        (["./bin/tool", "-v"], ["--no-python", "./bin/tool", "-v"], ["./bin/tool", "-v"]),
    ],
)
def test_foreign_code_after_double_dash(argv, under_torchrun, direct):
    c = split_command(["--", *argv], {"TRAIN_ARGS": "ignored=1"})
    assert not c.is_trainer and c.distributed
    p, _ = plan({}, command=c)
    assert list(p.argv[-len(under_torchrun) :]) == under_torchrun
    assert c.direct_argv(PY) == direct
    with pytest.raises(UsageError, match="nothing after '--'"):
        split_command(["--"], {})


def test_plan_prints_as_one_shell_line_that_round_trips():
    p, _ = plan(
        {**PYTORCHJOB_WORKER, "TRAIN_ARGS": "x"}, command=Command(trainer_args=("train", "a b=c"))
    )
    words = shlex.split(p.shell())
    assert words[0] == "env" and "-u" in words and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in words
    assert words[-len(p.argv) :] == list(p.argv)


# --- the node's exit code ----------------------------------------------------------------------


def test_exit_code_prefers_the_ranks_codes_over_torchruns(tmp_path):
    assert exit_code(1, str(tmp_path), None) == 1
    assert exit_code(1, str(tmp_path), signal.SIGTERM) == 128 + signal.SIGTERM
    assert exit_code(-signal.SIGKILL, str(tmp_path), None) == 128 + signal.SIGKILL
    (tmp_path / "attempt-0.rank-1.exit").write_text("3\n")
    assert exit_code(1, str(tmp_path), None) == 1  # a 3 without a signal here: group teardown
    assert exit_code(1, str(tmp_path), signal.SIGTERM) == 3
    (tmp_path / "attempt-0.rank-0.exit").write_text("4\n")
    assert exit_code(1, str(tmp_path), None) == 4
    # a restarted attempt that succeeded: what an earlier attempt left does not count
    assert exit_code(0, str(tmp_path), None) == 0


def test_a_signal_before_torchrun_starts_means_it_never_starts():
    signals = launch.Forwarder()
    signals.received.append(signal.SIGTERM)  # e.g. the pod was deleted during the config check
    never = launch.Plan(argv=("/nonexistent/torchrun",), env={}, unset=(), child=True, summary="")
    assert launch.run_child(never, signals) == 128 + signal.SIGTERM


# --- real runs ---------------------------------------------------------------------------------

LAUNCH = str(Path(sys.executable).parent / "trainer-launch")
TINY = [
    "data.name=tests.launch_plugins:tiny",
    "model.name=tests.helpers:tiny_model",
    "data.global_batch_size=4",
    "data.eval_batch_size=4",
    "log.progress=plain",
]


def launcher(args, *, cwd, timeout=180, **extra):
    return subprocess.run(
        [LAUNCH, *args],
        env=env(**extra),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_prints_the_command_and_runs_nothing(tmp_path):
    p = launcher(["--dry-run", "optim.lr=0.5"], cwd=tmp_path, NPROC_PER_NODE="2", PET_STANDALONE="")
    assert p.returncode == 0, p.stderr
    comment, summary, line = p.stdout.splitlines()
    assert comment.startswith("# 1 node x 2 process(es)") and "TRAINER_STATUS_DIR" in summary
    words = shlex.split(line)
    assert words[:3] == ["env", "-u", "PET_STANDALONE"]
    assert words[-5:] == ["--max-restarts=0", "-m", "trainer", "train", "optim.lr=0.5"]
    assert not (tmp_path / "runs").exists()


def test_bad_override_is_one_line_and_exit_2_before_torchrun(tmp_path):
    t = time.monotonic()
    p = launcher(["optim.lrr=0.1"], cwd=tmp_path, NPROC_PER_NODE="2")
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        "trainer-launch: error: command line: unknown key 'optim.lrr' (did you mean 'optim.lr'?); "
        "valid keys here: name, lr, weight_decay, momentum, nesterov, betas, fused, decay, freeze, "
        "groups, kwargs, lora_targets, lora_also_train, lora_rank, lora_alpha"
    ]
    assert p.stdout == "" and time.monotonic() - t < 30  # torchrun never started


@pytest.mark.parametrize(
    "nodes",
    [
        {"NPROC_PER_NODE": "2"},
        {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "2"},
    ],
)
def test_a_batch_that_does_not_split_over_the_job_is_exit_2_before_torchrun(tmp_path, nodes):
    world = int(nodes.get("NNODES", "1")) * 2
    p = launcher(["--dry-run", "data.global_batch_size=6"], cwd=tmp_path, **nodes)
    assert p.returncode == (2 if 6 % world else 0), p.stderr
    if world == 4:
        assert p.stderr.splitlines() == [
            "trainer-launch: error: data.global_batch_size=6 does not split over 4 ranks: "
            "use a multiple of 4 (e.g. data.global_batch_size=4 or 8)"
        ]
        assert p.stdout == ""


ELASTIC = {"NNODES": "1:3", "RDZV_BACKEND": "etcd", "RDZV_ENDPOINT": "127.0.0.1:2379"}


@pytest.mark.parametrize(
    "args, says",
    [
        (["data.global_batch_size=48"], None),
        (
            ["data.global_batch_size=64"],
            "NNODES=1:3 may form a world of 3 ranks (3 node(s) x 1), where "
            "data.global_batch_size=64 does not split over 3 ranks (of its worlds, 1, 2 would): "
            "use a multiple of 6, which every world in the range splits (e.g. "
            "data.global_batch_size=60 or 66), or narrow NNODES",
        ),
        (
            ["data.global_batch_size=48", "repro.world_invariant=true"],
            "NNODES=1:3 may form a world of 3 ranks (3 node(s) x 1), where "
            "repro.world_invariant=true cuts each global batch into repro.shards=8 shards, "
            "which 3 ranks cannot split evenly (of its worlds, 1, 2 would): set repro.shards to "
            "a multiple of 6, which every world in the range splits (e.g. repro.shards=24)",
        ),
        (["data.global_batch_size=48", "repro.world_invariant=true", "repro.shards=6"], None),
    ],
)
def test_an_elastic_job_is_checked_on_every_world_it_may_form(tmp_path, args, says):
    p = launcher(["--dry-run", *args], cwd=tmp_path, NPROC_PER_NODE="1", **ELASTIC)
    if says is None:
        assert p.returncode == 0, p.stderr
        assert "--rdzv-backend=etcd-v2" in p.stdout
        return
    assert p.returncode == 2 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"trainer-launch: error: {says}") and "1, 2 would" in line


@pytest.mark.parametrize(
    "failure, code",
    [("usage", 2), pytest.param("retryable", 4, marks=pytest.mark.long)],  # retryable: 39 s
)
@pytest.mark.slow
def test_the_ranks_exit_code_comes_through_torchrun(tmp_path, failure, code):
    # the ranks fail while building their data; torchrun itself exits 1 whatever they return
    p = launcher(
        [*TINY, f"data.name=tests.launch_plugins:fail_{failure}", f"run_dir={tmp_path}/run"],
        cwd=tmp_path,
        NPROC_PER_NODE="2",
    )
    assert p.returncode == code, p.stderr[-3000:]
    assert f"dataset fails on purpose ({failure})" in p.stderr


@pytest.mark.slow
@pytest.mark.long  # ~20 s: two nodes of one process each
def test_a_node_whose_rendezvous_host_ended_says_so_in_one_line(tmp_path):
    """Node 0's rank refuses its input (exit 2) while node 1's rank is still preparing its
    data: node 0's torchrun ends and takes the rendezvous store with it. Node 1 printed 112-194
    lines (c10d's C++ backtraces, torchrun's RendezvousConnectionError traceback, then its rank's
    broken-collective line). Now: one line naming node 0 as where to look, exit 4; a rank's own
    line (a broken collective, or "stopped by SIGTERM" and exit 3 where torchrun's SIGTERM found it
    at a stop point) does not stand for the cause."""
    port = str(free_port())
    nodes = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RDZV_ID": "lost"}
    args = [*TINY, "data.name=tests.launch_plugins:fail_on_node_0", f"run_dir={tmp_path}/run"]
    common = {**nodes, "NPROC_PER_NODE": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = [
        subprocess.Popen([LAUNCH, *args], env=env(**common, NODE_RANK=str(n)), cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for n in (0, 1)
    ]  # fmt: skip
    (_, err0), (_, err1) = (p.communicate(timeout=180) for p in procs)
    assert procs[0].returncode == 2, err0[-3000:]
    # (c10d numbers the ranks in the order the nodes joined: node 0's may be rank 1)
    last = re.sub(r"^trainer: error: \[rank \d\] ", "trainer: error: ", err0.splitlines()[-1])
    assert last == "trainer: error: dataset fails on purpose (node 0)", err0[-3000:]
    mine = [x for x in err1.splitlines() if not x.startswith("trainer-launch: ") or "error" in x]
    assert procs[1].returncode == 4 and len(mine) == 1, err1[-3000:]
    assert mine[0].startswith(
        f"trainer-launch: error: node 1 lost the rendezvous at 127.0.0.1:{port} while its ranks "
        "ran ("
    ), mine
    assert "node 0 ended first; its log says why" in mine[0]


@pytest.mark.slow
@pytest.mark.long  # 45 s: two attempts of a 2-rank torchrun (TorchX's restart: test_torchx.py)
def test_max_restarts_recovers_and_reports_success(tmp_path):
    # attempt 0: rank 1 exits 4 (attempt-0.rank-1.exit); attempt 1 trains to the end
    p = launcher(
        [
            *TINY,
            "data.name=tests.launch_plugins:fail_first_attempt",
            "train.epochs=2",
            f"run_dir={tmp_path}/run",
        ],
        cwd=tmp_path,
        NPROC_PER_NODE="2",
        MAX_RESTARTS="1",
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fails on purpose (attempt 0)" in p.stderr and "done: 6 steps" in p.stdout


def test_foreign_script_runs_on_every_rank(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        "import os, sys\n"
        "open(f'rank{os.environ[\"RANK\"]}.txt', 'w').write(' '.join(sys.argv[1:]))\n"
    )
    p = launcher(["--", "python", str(script), "a", "b"], cwd=tmp_path, NPROC_PER_NODE="2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "rank0.txt").read_text() == (tmp_path / "rank1.txt").read_text() == "a b"


def test_under_torchrun_it_runs_the_trainer_in_place(tmp_path):
    # what TorchX's dist.ddp gives each rank: here a world of 1, so it trains alone
    p = launcher(
        [*TINY, "train.epochs=1", f"run_dir={tmp_path}/run"],
        cwd=tmp_path,
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        TORCHELASTIC_RUN_ID="x",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "already rank 0 of 1 under torchrun" in p.stderr and "done: 3 steps" in p.stdout
    assert "torch.distributed.run" not in p.stderr


def test_a_foreign_command_that_does_not_exist_is_exit_2(tmp_path):
    torchrun_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}
    p = launcher(["--", "no-such-command-xyz"], cwd=tmp_path, **torchrun_rank)
    assert p.returncode == 2
    assert (
        p.stderr.splitlines()[-1] == "trainer-launch: error: no-such-command-xyz: command not found"
    )


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.long  # 20 s: make test-long (make test stays in its 12 minutes)
def test_sigterm_is_forwarded_and_everything_stops(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                LAUNCH,
                *TINY,
                "train.epochs=1000000",
                "log.every_steps=50",
                f"run_dir={tmp_path}/run",
            ],
            env=env(NPROC_PER_NODE="2"),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Until the ranks are training (the plain progress line of step 50 of many).
        wait_for(lambda: "step 50/" in log.read_text(), 120, "step 50", proc)
        family = _descendants(proc.pid)
        assert len(family) >= 3  # torchrun and its 2 workers
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    # The ranks agree to stop, checkpoint and exit 3 ("preempted, resumable": the code a
    # podFailurePolicy maps to Ignore); torchrun alone would have reported 1 or 143.
    assert code == 3, log.read_text()[-3000:]
    assert took < 40
    assert list((tmp_path / "run" / "checkpoints").glob("step-*")), log.read_text()[-3000:]
    # A right answer without noise: no torchrun SignalException traceback (~29 lines) after the
    # ranks' one line, which comes last.
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("trainer: stopped by SIGTERM")
    assert text.count("stopped by SIGTERM") == 1, text[-3000:]  # rank 0's own copy held back
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in family if _alive(p)]


@pytest.fixture
def compose_env():
    from tests.test_compose import compose_config

    def get(service: str, *profiles: str) -> dict[str, str]:
        return dict(compose_config(*profiles)["services"][service].get("environment") or {})

    return get


def test_a_rank_the_oom_killer_ended_is_named_in_one_line(tmp_path):
    """trainer-launch reads its memory cgroup's OOM kill count (v2 memory.events, v1
    memory.oom_control) before and after torchrun: a kill in between is the node's one line,
    naming the rank torchrun's report gives (exitcode -9), the limit and the fix."""
    from trainer.launch import oom

    v2 = tmp_path / "v2"
    (v2 / "pod").mkdir(parents=True)
    (v2 / "pod" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (v2 / "pod" / "memory.max").write_text(str(3 << 30))
    (tmp_path / "cg2").write_text("0::/pod\n")
    v1 = tmp_path / "v1" / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "cg1").write_text("12:memory:/job\n3:cpu,cpuacct:/job\n")
    after2 = oom.memory(v2, tmp_path / "cg2")
    after1 = oom.memory(tmp_path / "v1", tmp_path / "cg1")
    assert after2 == oom.Memory(1, 3 << 30) and after1 == oom.Memory(2, 1 << 30)
    assert oom.memory(tmp_path / "none", tmp_path / "cg2") is None
    report = [
        b"Root Cause (first observed failure):\n", b"[0]:\n", b"  rank      : 3 (local_rank: 1)\n",
        b"  exitcode  : -9 (pid: 4242)\n", b"  traceback : Signal 9 (SIGKILL) received by PID\n",
    ]  # fmt: skip
    assert oom.killed_rank(report) == 3
    line = oom.line(oom.Memory(0, None), after2, 3, "2")
    assert line.startswith("trainer: error: rank 3 was killed by the out-of-memory killer")
    assert "3.0 GiB for 2 rank(s)" in line and "trainer plan" in line and "\n" not in line
    assert oom.line(after2, after2, 3, "2") is None  # no kill in between: no line
