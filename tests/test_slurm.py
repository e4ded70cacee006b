"""Slurm: trainer-launch's reading of a job step (pure, in `make test`), and slurm/train.sbatch on
a real two-node Slurm cluster (tests/slurm.py; `make test-slurm`, marked `slurm`): 2 nodes x 2
processes bitwise equal to one process, the pre-timeout signal -> checkpoint -> requeue -> resume
on fewer nodes with the same bits, one task per process, scancel, and a lost node."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, checkpoints, env, read_jsonl, trainer, wait_for, weights
from trainer.errors import UsageError
from trainer.launch import slurm

# ---------------------------------------------------------------------------------------------
# The pure part: a step's variables -> the node contract or a rank's variables.


def step(nodes=2, tasks=2, node=0, **extra) -> dict[str, str]:
    per_node = tasks // nodes
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NODELIST": "gpu07" if nodes == 1 else f"gpu[07-{6 + nodes:02d}]",
        **extra,
    }


def first(nodelist):
    assert nodelist == "gpu[07-08]"
    return "gpu07", "10.1.0.7"


def test_one_task_per_node_becomes_the_node_contract():
    job = slurm.read_slurm(step(node=1), gpus=4, first_node=first)
    assert job is not None and not job.per_task and not job.hosts_store
    assert job.env == {
        "NNODES": "2",
        "NODE_RANK": "1",
        "RDZV_ID": "slurm-4242-0-r0",
        "MASTER_ADDR": "10.1.0.7",
        "MASTER_PORT": str(15000 + 4242),
    }
    assert "gpu07 (10.1.0.7):19242" in job.summary
    # A requeued job meets under a new id; the user's MASTER_PORT and MASTER_ADDR win.
    again = slurm.read_slurm(
        step(node=0, SLURM_RESTART_COUNT="2", MASTER_PORT="31000", MASTER_ADDR="head"),
        gpus=0,
        first_node=first,
    )
    assert again.hosts_store and again.port == 31000
    assert again.env["RDZV_ID"] == "slurm-4242-0-r2" and "MASTER_ADDR" not in again.env


def test_one_task_per_process_gets_a_ranks_variables():
    job = slurm.read_slurm(
        step(tasks=8, node=1, SLURM_PROCID="5", SLURM_LOCALID="1"), gpus=4, first_node=first
    )
    assert job.per_task and not job.hosts_store
    assert job.env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.1.0.7",
        "MASTER_PORT": "19242",
    }
    # --gpus-per-task=1: each task sees one GPU, its own, as cuda:0.
    bound = slurm.read_slurm(
        step(tasks=8, SLURM_PROCID="3", SLURM_LOCALID="3"), gpus=1, first_node=first
    )
    assert (bound.env["LOCAL_RANK"], bound.env["LOCAL_WORLD_SIZE"]) == ("0", "1")
    # 4 tasks on a node, 2 CPUs each when Slurm does not say per task: its share of the node.
    assert slurm.cpus_for_task({"SLURM_CPUS_ON_NODE": "8"}, 64, bound) == 2
    assert slurm.cpus_for_task({"SLURM_CPUS_PER_TASK": "6"}, 4, bound) == 4


def test_a_one_node_step_needs_no_scontrol():
    def never(_):
        raise AssertionError("scontrol asked for one node")

    job = slurm.read_slurm(step(nodes=1, tasks=1), gpus=0, first_node=never)
    assert job.env == {"NNODES": "1", "NODE_RANK": "0"} and not job.hosts_store
    assert (
        slurm.read_slurm(
            {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1"}, gpus=0, first_node=never
        )
        is None
    )
    assert slurm.read_slurm({}, gpus=0, first_node=never) is None
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]


@pytest.mark.parametrize(
    "env, gpus, says",
    [
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}, 0, "start it with srun"),
        (step(NNODES="4"), 0, "NNODES=4 but Slurm says SLURM_STEP_NUM_NODES=2: unset NNODES"),
        (step(node=1, NODE_RANK="0"), 0, "NODE_RANK=0 but Slurm says SLURM_NODEID=1"),
        (step(tasks=8), 2, "4 tasks on this node but 2 GPU(s) visible to each"),
        (step(tasks=8, NPROC_PER_NODE="4"), 0, "NPROC_PER_NODE=4 but Slurm runs one task per"),
        (step(SLURM_GPUS_ON_NODE="8"), 4, "SLURM_GPUS_ON_NODE=8 but only 4 GPU(s) are visible"),
        (step(SLURM_STEP_TASKS_PER_NODE="two"), 0, "is not Slurm's format"),
        (step(MASTER_PORT="70000"), 0, "MASTER_PORT=70000 is not a TCP port"),
    ],
)
def test_contradictions_are_one_line(env, gpus, says):
    with pytest.raises(UsageError, match=None) as e:
        slurm.read_slurm(env, gpus=gpus, first_node=first)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_first_node_asks_scontrol_and_names_what_does_not_resolve():
    calls = []

    def run(argv, **_):
        calls.append(argv[1:])
        if argv[1:3] == ["show", "hostnames"]:
            return subprocess.CompletedProcess(argv, 0, "node01\nnode02\nnode07\n", "")
        return subprocess.CompletedProcess(argv, 0, "NodeName=node01 NodeAddr=127.0.0.1 x=y", "")

    assert slurm.first_node("node[01-02,07]", run=run) == ("node01", "127.0.0.1")
    assert calls == [["show", "hostnames", "node[01-02,07]"], ["show", "node", "-o", "node01"]]

    def unresolvable(argv, **_):
        out = "nx-unknown.invalid\n" if argv[2] == "hostnames" else "NodeName=nx-unknown.invalid"
        return subprocess.CompletedProcess(argv, 0, out, "")

    with pytest.raises(UsageError, match="does not resolve here .*set MASTER_ADDR to its IP"):
        slurm.first_node("nx-unknown.invalid", run=unresolvable)

    def failing(argv, **_):
        return subprocess.CompletedProcess(
            argv, 1, "", "line 1\nscontrol: error: Invalid node name"
        )

    with pytest.raises(UsageError, match=r"failed \(scontrol: error: Invalid node name\)"):
        slurm.first_node("bad[", run=failing)


def test_a_port_in_use_on_the_first_node_is_one_line():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {port} .* in use on n0 .*set MASTER_PORT"):
            slurm.check_port_free(port, "n0")


def test_a_node_that_cannot_reach_the_first_node_is_told_its_slurm_name():
    """The launcher's plan for node 1 of a 2-node step, and torchrun failing to reach node 0's
    store: one line naming the address, the port and the Slurm node."""
    from tests.test_bad_input import TORCHRUN_RENDEZVOUS
    from trainer.launch.launcher import (
        Command,
        StderrFilter,
        make_plan,
        rendezvous_error,
        slurm_plan,
    )

    job = slurm.read_slurm(step(node=1), gpus=0, first_node=first)
    environ = {**step(node=1), **job.env}
    plan = make_plan(environ, Command(("train",)), gpus=0, cpus=2, python="python")
    plan = slurm_plan(plan, job, environ, 2)
    f = StderrFilter(io.StringIO())
    for raw in TORCHRUN_RENDEZVOUS:
        f.feed(raw)
    f.close()
    line = rendezvous_error(f.rendezvous, plan.rendezvous)
    assert line.startswith(
        "trainer-launch: error: node 1 cannot reach the rendezvous at 10.1.0.7:19242 (Slurm node "
        "gpu07, the first of the step's nodes) (The client socket has timed out"
    ), line


def test_trainer_launch_dry_run_in_a_step_of_one_task_per_process(tmp_path):
    """The whole launcher on a one-node step of 2 tasks: rank variables, threads, a stable run
    folder, no torchrun; and a multi-node job's batch script without srun stops with exit 2."""
    base = env(PATH=os.environ["PATH"], **step(nodes=1, tasks=2, SLURM_PROCID="1"))
    base.update(SLURM_STEP_TASKS_PER_NODE="2", SLURM_CPUS_PER_TASK="1", SLURM_LOCALID="1")
    base.pop("OMP_NUM_THREADS")
    launch = [str(Path(sys.executable).with_name("trainer-launch")), "--dry-run"]
    p = subprocess.run(launch, env=base, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "one task per process, rank 1 of 2 (no torchrun)" in p.stdout
    for part in ("RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "MASTER_ADDR=127.0.0.1"):
        assert part in p.stdout
    assert "OMP_NUM_THREADS=1" in p.stdout and "TRAINER_STABLE_RUN_DIR=1" in p.stdout
    assert "torch.distributed.run" not in p.stdout and "-m trainer train" in p.stdout
    # A step whose task count does not split the global batch: one line before the rank starts.
    three = {**base, "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "3"}
    p = subprocess.run(launch, env=three, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "3" in p.stderr and "global_batch_size" in p.stderr, p.stderr
    batch = {k: v for k, v in base.items() if not k.startswith("SLURM_STEP")}
    batch["SLURM_JOB_NUM_NODES"] = "2"
    p = subprocess.run(launch, env=batch, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "start it with srun" in p.stderr


# ---------------------------------------------------------------------------------------------
# A real cluster: 2 nodes of 2 CPUs, the job script as users submit it.

ARGS = [
    "train.epochs=2",
    "repro.world_invariant=true",
    "log.every_steps=1",  # every step's loss: a resumed run's windows align with the reference's
    "ckpt.every_steps=8",
    "ckpt.keep_last=100",
    "model.name=tests.helpers:slow_mlp",
]
SLOW = "model.kwargs.delay=0.1"  # same numbers, time for a signal to land mid-run
SCRIPT = str(ROOT / "slurm" / "train.sbatch")


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    from tests import slurm as harness

    if reason := harness.unavailable():
        pytest.skip(reason)
    with harness.Cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture
def cluster(started):
    """The module's cluster, left empty for the next test: a failed test's job would hold the
    nodes (and its ranks wait for peers that never come)."""
    yield started
    started.cancel_all()
    started.run(["scontrol", "update", "NodeName=n[0-1]", "State=RESUME"], check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same training in one process, no Slurm: what every layout must equal, bit for bit."""
    run = tmp_path_factory.mktemp("ref") / "run"
    trainer("train", *ARGS, f"run_dir={run}")
    return run


def submit(cluster, tmp: Path, *args: str, sbatch=(), **extra) -> tuple[str, Path, Path]:
    run, log = tmp / "run", tmp / "job.out"
    job_env = env(NPROC_PER_NODE="2", RUN_DIR=str(run), VENV=sys.prefix, **extra)
    argv = [f"--output={log}", "--cpus-per-task=2", *sbatch, SCRIPT, *ARGS, *args]
    return cluster.sbatch(argv, env=job_env, cwd=ROOT), run, log


def trained_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    rows = read_jsonl(path) if path.exists() else []
    return max((r["step"] for r in rows if r.get("kind") == "train"), default=0)


def same_weights(run: Path, reference: Path) -> None:
    mine, ref = weights(run), weights(reference)
    assert mine.keys() == ref.keys()
    for k in ref:
        assert mine[k].dtype == ref[k].dtype and mine[k].equal(ref[k]), k


def same_losses(run: Path, reference: Path) -> None:
    """Every logged training loss equals the reference's at that step (resumed runs repeat none)."""
    ref = {
        r["step"]: r["loss"]
        for r in read_jsonl(reference / "metrics.jsonl")
        if r["kind"] == "train"
    }
    mine = [
        (r["step"], r["loss"]) for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"
    ]
    assert mine and all(loss == ref[s] for s, loss in mine), mine


@pytest.mark.slurm
def test_preempted_job_requeues_and_comes_back_on_fewer_nodes_with_the_same_bits(
    cluster, reference, tmp_path
):
    """2 nodes x 2 processes; the signal Slurm sends before the time limit (--signal=TERM@300,
    sent here with `scancel --signal=TERM`, as slurmctld does) -> every rank checkpoints, the job
    requeues itself. Node n1 is drained meanwhile, so the requeued job waits; shrunk to one node
    it comes back on n0 alone (world 2) and, under repro.world_invariant, ends with the weights
    of one process."""
    job, run, log = submit(cluster, tmp_path, SLOW)
    wait_for(lambda: trained_steps(run) >= 4, 120, "the 2-node job to train 4 steps")
    assert cluster.job(job)["NumNodes"] == "2"
    cluster.run(["scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=test"])
    try:
        cluster.run(["scancel", "--signal=TERM", job])
        wait_for(
            lambda: (
                cluster.job(job).get("Restarts") == "1"
                and cluster.job(job)["JobState"] == "PENDING"
            ),
            120,
            "the job to requeue itself",
        )
        for change in (["NumNodes=1", "NumTasks=1"], ["NumCPUs=2"]):  # one node's worth
            cluster.run(["scontrol", "update", f"JobId={job}", *change])
        assert cluster.wait(job) == "COMPLETED"
    finally:
        cluster.run(["scontrol", "update", "NodeName=n1", "State=RESUME"])
    info, out = cluster.job(job), log.read_text()
    assert info["Restarts"] == "1" and info["NodeList"] == "n0", info
    assert "stopped after a checkpoint (exit 3): requeueing job" in out, out[-3000:]
    assert "trainer: stopped by SIGTERM at step" in out and "resumed from" in out
    assert "Traceback" not in out, out[-3000:]  # torchrun signalled once: its report held back
    summary = __import__("json").loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2  # the second attempt ran on one node
    assert summary["slurm_restart_count"] == 1 and summary["restart_count"] == 0
    same_losses(run, reference)
    same_weights(run, reference)


@pytest.mark.slurm
def test_one_task_per_process_on_two_nodes_equals_one_process(cluster, reference, tmp_path):
    """`srun --ntasks-per-node=2 trainer-launch`: four ranks straight from SLURM_PROCID, no
    torchrun; the same bits as one process."""
    run, log = tmp_path / "run", tmp_path / "job.out"
    launch = str(Path(sys.prefix) / "bin" / "trainer-launch")
    wrap = f"srun {launch} {' '.join(ARGS)} run_dir={run}"
    job = cluster.sbatch(
        ["-N2", "--ntasks-per-node=2", f"--output={log}", "--wrap", wrap], env=env(), cwd=ROOT
    )
    assert cluster.wait(job) == "COMPLETED", log.read_text()[-3000:]
    assert "one task per process, rank 0 of 4 (no torchrun)" in log.read_text()
    same_weights(run, reference)


def step_pids(job: str, node_id: str) -> list[int]:
    """This machine's processes that belong to the job's step on one node (slurmd's tasks and
    their children carry SLURM_JOB_ID and SLURM_NODEID in their environment)."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_NODEID={node_id}".encode()}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= environ and b"SLURM_STEP_ID=0" in environ:
            pids.append(int(entry))
    return pids


@pytest.mark.slurm
def test_a_lost_node_fails_the_attempt_and_the_requeued_job_resumes(cluster, reference, tmp_path):
    """Every process of n1's step SIGKILLed (the node is lost): n0's ranks fail on their broken
    collectives, the job script requeues it (MAX_FAILURE_REQUEUES=1) and the new attempt resumes
    from the last periodic checkpoint, ending with the reference's bits."""
    job, run, log = submit(cluster, tmp_path, SLOW, MAX_FAILURE_REQUEUES="1")
    wait_for(lambda: checkpoints(run), 120, "a periodic checkpoint")
    pids = step_pids(job, "1")
    assert pids and trained_steps(run) < 46, "n1's step was not found running"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert cluster.wait(job) == "COMPLETED", log.read_text()[-3000:]
    out = log.read_text()
    assert cluster.job(job)["Restarts"] == "1"
    assert "failed (exit" in out and "requeueing job" in out and "resumed from" in out, out[-3000:]
    same_weights(run, reference)


@pytest.mark.slurm
def test_scancel_checkpoints_and_stops_without_requeue(cluster, tmp_path):
    """Plain `scancel`: SIGTERM to every process of the job, the batch script included, so
    nothing requeues; every rank saves a checkpoint within KillWait first."""
    job, run, log = submit(cluster, tmp_path, SLOW, "ckpt.every_steps=0")
    wait_for(lambda: trained_steps(run) >= 2, 120, "the job to train")
    cluster.run(["scancel", job])
    assert cluster.wait(job, until=("CANCELLED",)) == "CANCELLED"
    wait_for(lambda: checkpoints(run), 30, "the signal's checkpoint")
    info = cluster.job(job)
    assert info["Restarts"] == "0" and "requeueing" not in log.read_text()
    meta = read_jsonl(run / "metrics.jsonl")
    assert checkpoints(run) and trained_steps(run) < 46, meta[-3:]


@pytest.mark.slurm
def test_the_torchx_component_on_slurm_equals_one_process(cluster, reference, tmp_path):
    """`torchx run -s slurm trainer/components.py:train --nnodes 2 --nproc_per_node 2`: TorchX's
    own sbatch script (a heterogeneous job, one torchrun per node, the c10d rendezvous on the first
    node by its name) trains with the same bits as one process. TorchX follows jobs with `sacct`,
    which needs Slurm's accounting database (slurmdbd): this cluster has none, so `torchx run`
    exits 1 after printing the app handle, and the job is followed with scontrol here."""
    torchx = str(Path(sys.prefix) / "bin" / "torchx")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    argv = [torchx, "run", "--workspace", "", "-s", "slurm", "-cfg", f"job_dir={job_dir}"]
    component = f"{ROOT / 'trainer' / 'components.py'}:train"  # run from tmp_path: torchx
    argv += [component, "--nnodes", "2", "--nproc_per_node", "2", *ARGS]  # leaves a file there
    p = cluster.run(
        argv,
        env=env(PATH=f"{Path(sys.prefix) / 'bin'}:{os.environ['PATH']}"),
        check=False,
        cwd=tmp_path,
    )
    handle = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert handle.startswith("slurm://torchx/"), p.stdout + p.stderr[-2000:]
    job = handle.rpartition("/")[2]
    assert cluster.wait(job) == "COMPLETED", (job_dir / f"slurm-{job}.out").read_text()[-3000:]
    same_weights(job_dir / "runs" / job, reference)


def test_summary_records_slurms_requeue_count_beside_torchruns(tmp_path, monkeypatch):
    """summary.json: `slurm_restart_count` is the job's SLURM_RESTART_COUNT (a requeued job's
    attempt), `restart_count` torchrun's restarts within the attempt; None outside Slurm."""
    import json

    from tests.helpers import TINY, train_here

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    args = ("train", *TINY, "train.max_steps=1", "log.tensorboard=false", "log.progress=plain")
    train_here(*args, f"run_dir={tmp_path / 'off'}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    train_here(*args, f"run_dir={tmp_path / 'on'}")
    got = {
        name: json.loads((tmp_path / name / "summary.json").read_text()) for name in ("off", "on")
    }
    assert got["off"]["slurm_restart_count"] is None
    assert got["on"]["slurm_restart_count"] == 2 and got["on"]["restart_count"] == 0
