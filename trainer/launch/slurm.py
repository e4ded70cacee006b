"""Slurm's variables -> this node's (or this task's) part of the job; the rest is pure.

Inside `srun`, trainer-launch reads the job step from Slurm, never from a hand-written regex:

    nodes           SLURM_STEP_NUM_NODES             (the step's, so a 1-node srun in a 4-node job works)
    this node       SLURM_NODEID
    rendezvous host the first node of SLURM_STEP_NODELIST, at the address Slurm itself uses for it
                    (its NodeAddr: `scontrol show hostnames` + `scontrol show node`)
    rendezvous port MASTER_PORT, else 15000 + job id % 15000: two jobs sharing a node do not clash
    rendezvous id   slurm-<job id>-<step id>-r<SLURM_RESTART_COUNT> (a requeued job meets afresh)
    threads         SLURM_CPUS_PER_TASK (else the step's CPUs on this node), shared by its ranks

Two layouts, told apart by the step's task count:

- one task per node (`srun --ntasks-per-node=1 trainer-launch`, the default): each task runs
  torchrun for its node, with NPROC_PER_NODE processes (default: the GPUs Slurm gave the node);
- one task per process (`srun --ntasks-per-node=4 --gpus-per-task=1 trainer-launch`): no
  torchrun; each task is one rank, RANK = SLURM_PROCID of WORLD_SIZE = SLURM_STEP_NUM_TASKS,
  LOCAL_RANK = SLURM_LOCALID (or 0 when Slurm bound one GPU to each task).

Contradictions are one line and exit 2: NNODES/NODE_RANK that disagree with Slurm, a multi-node
job started in the batch script without srun, more tasks on a node than GPUs, NPROC_PER_NODE with
one task per process, fewer GPUs visible than Slurm says it gave.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from trainer.envvars import env_int
from trainer.errors import UsageError

PORT_BASE, PORT_SPAN = 15000, 15000
"""Per-job rendezvous ports 15000-29999: below Linux's ephemeral range (32768-60999), so no
outgoing connection holds them by chance; a job id picks one, the same on every node."""

USER_NODE_VARS = ("PET_NNODES", "NNODES", "PET_NODE_RANK", "NODE_RANK")


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says this process is, in the launcher's terms."""

    env: dict[str, str]
    """Variables to add: the node contract (NNODES, NODE_RANK, MASTER_ADDR, ...) for one task per
    node; a rank's (RANK, WORLD_SIZE, LOCAL_RANK, ...) for one task per process."""
    per_task: bool
    summary: str
    hosts_store: bool
    """This process binds the rendezvous port (node 0, or task 0): it checks the port is free."""
    port: int
    first_node: str
    """The rendezvous node's Slurm name, to name it in messages."""
    tasks_here: int = 1
    """The step's tasks on this node."""
    nodes: int = 1
    """The step's nodes."""


def in_job_step(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID", "").strip())


def _int(env: Mapping[str, str], name: str, what: str, lo: int = 0) -> int | None:
    raw = env.get(name, "").strip()
    return None if not raw else env_int(name, raw, lo=lo, what=what)


def tasks_per_node(raw: str) -> list[int]:
    """Slurm's compressed counts ('2(x3),1') -> [2, 2, 2, 1]."""
    out: list[int] = []
    for item in filter(None, raw.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise UsageError(
                f"SLURM_STEP_TASKS_PER_NODE={raw!r} is not Slurm's format (like 2(x3),1): "
                "run trainer-launch under srun"
            )
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def job_port(env: Mapping[str, str]) -> int:
    from trainer.envvars import env_port

    if raw := env.get("MASTER_PORT", "").strip():
        return env_port("MASTER_PORT", raw, what="a TCP port on the first node for the rendezvous")
    job = _int(env, "SLURM_JOB_ID", "Slurm's job id", lo=0) or 0
    return PORT_BASE + job % PORT_SPAN


def read_slurm(
    env: Mapping[str, str],
    *,
    gpus: int,
    first_node: Callable[[str], tuple[str, str]],
) -> SlurmJob | None:
    """This process's part of a Slurm job step, or None outside a multi-rank step (not in
    Slurm, or a one-node batch script: that is an ordinary single node). `gpus`: the GPUs this
    task sees (0 on CPU); `first_node(nodelist) -> (name, address)` asks Slurm."""
    if not in_job_step(env):
        return None
    if not env.get("SLURM_STEP_ID", "").strip():
        nodes = _int(env, "SLURM_JOB_NUM_NODES", "the job's nodes", lo=1) or 1
        if nodes > 1:
            raise UsageError(
                f"trainer-launch is running in the batch script of a {nodes}-node Slurm job, "
                "on its first node only: start it with srun "
                "(srun --ntasks-per-node=1 trainer-launch ...), as slurm/train.sbatch does"
            )
        return None
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "the step's nodes", lo=1) or 1
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", "the step's tasks", lo=1) or nodes
    node = _int(env, "SLURM_NODEID", "this node's index in the step") or 0
    counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", "") or f"{tasks // nodes}")
    here = counts[node] if node < len(counts) else counts[-1]
    _check_user_nodes(env, nodes, node)
    name, addr = "localhost", "127.0.0.1"  # one node: its ranks meet on loopback
    if nodes > 1:
        name, addr = first_node(env.get("SLURM_STEP_NODELIST", "") or env.get("SLURM_NODELIST", ""))
    step = _Step(env["SLURM_JOB_ID"].strip(), nodes, node, tasks, here, name, addr, job_port(env))
    return _per_node(env, gpus, step) if tasks == nodes else _per_task(env, gpus, step)


class _Step(NamedTuple):
    """The job step as read, for the two layouts."""

    job: str
    nodes: int
    node: int
    """This node's index."""
    tasks: int
    here: int
    """Tasks on this node."""
    name: str
    """The first node's Slurm name, and its address."""
    addr: str
    port: int

    @property
    def where(self) -> str:
        return f"{self.name} ({self.addr})" if self.addr != self.name else self.name


def _check_user_nodes(env: Mapping[str, str], nodes: int, node: int) -> None:
    """NNODES/NODE_RANK left in the environment must agree with Slurm (or be absent)."""
    for var in USER_NODE_VARS:
        raw = env.get(var, "").strip()
        if not raw:
            continue
        want = str(nodes) if var.endswith("NNODES") else str(node)
        if raw != want:
            slurm = "SLURM_STEP_NUM_NODES" if var.endswith("NNODES") else "SLURM_NODEID"
            raise UsageError(
                f"{var}={raw} but Slurm says {slurm}={want}: unset {var} in the job script "
                "(under srun, trainer-launch takes the nodes and this node's rank from Slurm)"
            )


def _rdzv_id(env: Mapping[str, str], job: str) -> str:
    step = env.get("SLURM_STEP_ID", "0").strip()
    restart = env.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    return f"slurm-{job}-{step}-r{restart}"


def _per_node(env: Mapping[str, str], gpus: int, step: _Step) -> SlurmJob:
    nodes, node = step.nodes, step.node
    given = _int(env, "SLURM_GPUS_ON_NODE", "the GPUs Slurm gave this node")
    if given and gpus and gpus < given:
        raise UsageError(
            f"SLURM_GPUS_ON_NODE={given} but only {gpus} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}): do not override "
            "CUDA_VISIBLE_DEVICES in the job script"
        )
    added = {"NNODES": str(nodes), "NODE_RANK": str(node)}
    summary = f"Slurm job {step.job}: one task per node, node {node} of {nodes}"
    if nodes > 1:
        added["RDZV_ID"] = env.get("RDZV_ID", "").strip() or _rdzv_id(env, step.job)
        if not env.get("MASTER_ADDR", "").strip():
            added["MASTER_ADDR"] = step.addr
        added["MASTER_PORT"] = str(step.port)
        summary += f", rendezvous on {step.where}:{step.port}"
    return SlurmJob(added, False, summary, node == 0 and nodes > 1, step.port, step.name, 1, nodes)


def _per_task(env: Mapping[str, str], gpus: int, step: _Step) -> SlurmJob:
    here = step.here
    proc = _int(env, "SLURM_PROCID", "this task's rank") or 0
    local = _int(env, "SLURM_LOCALID", "this task's index on its node") or 0
    nproc = env.get("NPROC_PER_NODE", "").strip() or env.get("PET_NPROC_PER_NODE", "").strip()
    if nproc and nproc not in ("1", "auto"):
        raise UsageError(
            f"NPROC_PER_NODE={nproc} but Slurm runs one task per process ({here} on this node): "
            "unset NPROC_PER_NODE, or run one task per node (srun --ntasks-per-node=1) and let "
            "torchrun start the processes"
        )
    local_rank, local_size = local, here
    if gpus == 1 and here > 1:
        local_rank, local_size = 0, 1  # --gpus-per-task=1: each task sees its own GPU as cuda:0
    elif gpus and gpus < here:
        raise UsageError(
            f"{here} tasks on this node but {gpus} GPU(s) visible to each: give each task one "
            "GPU (--gpus-per-task=1), or at most one task per GPU (--ntasks-per-node), or run "
            "one task per node (--ntasks-per-node=1) and let torchrun start one process per GPU"
        )
    added = {
        "RANK": str(proc),
        "WORLD_SIZE": str(step.tasks),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": env.get("MASTER_ADDR", "").strip() or step.addr,
        "MASTER_PORT": str(step.port),
    }
    summary = (
        f"Slurm job {step.job}: one task per process, rank {proc} of {step.tasks} (no "
        f"torchrun), rendezvous on {step.where}:{step.port}"
    )
    return SlurmJob(added, True, summary, proc == 0, step.port, step.name, here, step.nodes)


def cpus_for_task(env: Mapping[str, str], available: int, job: SlurmJob | None) -> int:
    """The CPUs this task may use: SLURM_CPUS_PER_TASK when set, else (one task per process) its
    share of the step's CPUs on this node; never more than the affinity mask and cgroup allow
    (the site's task binding may be off, and then the mask shows the whole node)."""
    per_task = _int(env, "SLURM_CPUS_PER_TASK", "CPUs per task", lo=1)
    if per_task is None and job is not None and job.per_task:
        on_node = _int(env, "SLURM_CPUS_ON_NODE", "the step's CPUs on this node", lo=1)
        per_task = max(1, on_node // job.tasks_here) if on_node else None
    return min(available, per_task) if per_task else available


# ---------------------------------------------------------------------------------------------
# Asking Slurm (side effects): the first node's name and address; is the port free.


def first_node(nodelist: str, run=None) -> tuple[str, str]:
    """(name, address) of the first node of a Slurm node list, from scontrol: `show hostnames`
    expands `node[01-04,07]`, `show node` gives the NodeAddr Slurm itself reaches it at."""
    import socket
    import subprocess

    run = run or subprocess.run

    def scontrol(*args: str) -> str:
        try:
            out = run(["scontrol", *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError(
                f"cannot run `scontrol {' '.join(args)}` ({e}): trainer-launch needs Slurm's "
                "client commands on PATH inside the job (load the site's slurm module)"
            ) from None
        if out.returncode != 0:
            raise UsageError(
                f"`scontrol {' '.join(args)}` failed "
                f"({(out.stderr.strip().splitlines() or [f'exit {out.returncode}'])[-1]}): "
                "check SLURM_STEP_NODELIST and that trainer-launch runs under srun"
            )
        return out.stdout

    if not nodelist.strip():
        raise UsageError("SLURM_STEP_NODELIST is empty: run trainer-launch under srun")
    names = scontrol("show", "hostnames", nodelist).split()
    if not names:
        raise UsageError(f"SLURM_STEP_NODELIST={nodelist!r} names no node: run under srun")
    name = names[0]
    m = re.search(r"\bNodeAddr=(\S+)", scontrol("show", "node", "-o", name))
    addr = m.group(1) if m else name
    try:
        socket.getaddrinfo(addr, None)
    except OSError as e:
        raise UsageError(
            f"the first node of SLURM_STEP_NODELIST={nodelist} is {name}, at NodeAddr {addr}, "
            f"which does not resolve here ({e.strerror or e}): set MASTER_ADDR to its IP "
            "address in the job script"
        ) from None
    return name, addr


def check_port_free(port: int, node: str) -> None:
    """On the node that hosts the rendezvous: is its port free? (Another job on a shared node,
    or a leftover process, holds it: say so now, not after the others' 10-minute join timeout.)"""
    import errno
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return
            raise UsageError(
                f"port {port} for the rendezvous is already in use on {node} (another job on "
                "this node?): set MASTER_PORT to a free port in the job script "
                f"({PORT_BASE}-{PORT_BASE + PORT_SPAN - 1} is where trainer-launch picks them)"
            ) from None
