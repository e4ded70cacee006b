"""Slurm's variables -> this node's (or this task's) part of the job; the rest is pure.

Inside `srun`, trainer-launch reads the job step from Slurm, never from a hand-written regex:

    nodes           SLURM_STEP_NUM_NODES             (the step's, so a 1-node srun in a 4-node job works)
    this node       SLURM_NODEID
    tasks           SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), spread as SLURM_STEP_TASKS_PER_NODE
    rendezvous host MASTER_ADDR if set (then scontrol is never asked); else the first node of
                    SLURM_STEP_NODELIST, at the address Slurm itself uses for it
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

Every SLURM_* number read is checked (ASCII digits, not empty, within Slurm's 32 bits) and
against the others (`read_shape`): the step's nodes within the job's and its node lists', this
node's index below the nodes, at least one task per node, the tasks per node adding up to the
tasks, this task's rank and local index below them. Contradictions are one line and exit 2,
naming the SLURM_* variables: also NNODES/NODE_RANK that disagree with Slurm, a multi-node job
started in the batch script without srun, more tasks on a node than GPUs, NPROC_PER_NODE with
one task per process, fewer GPUs visible than Slurm says it gave.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from trainer.errors import UsageError, shorten

PORT_BASE, PORT_SPAN = 15000, 15000
"""Per-job rendezvous ports 15000-29999: below Linux's ephemeral range (32768-60999), so no
outgoing connection holds them by chance; a job id picks one, the same on every node."""

USER_NODE_VARS = ("PET_NNODES", "NNODES", "PET_NODE_RANK", "NODE_RANK")

SLURM_MAX = 2**32 - 1
"""Slurm keeps its ids and counts in 32-bit unsigned fields: a larger number was not set by it."""
MAX_NODES = 9999
"""The most nodes trainer-launch gives torchrun (NNODES has at most 4 digits)."""
BY_SLURM = (
    "Slurm sets it in each task under srun, so run trainer-launch under srun and do not set "
    "SLURM_* variables in the job script"
)
BY_SLURM_ALL = BY_SLURM.replace("sets it", "sets them")


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


def slurm_int(env: Mapping[str, str], name: str, what: str, lo: int = 0) -> int | None:
    """A number Slurm sets (None when unset): ASCII digits, at least `lo`, within 32 bits; set
    but empty, negative, another script's digits, garbage or huge is one line naming it."""
    if name not in env:
        return None
    raw = env[name]
    value = raw.strip()
    if not value:
        raise UsageError(f"{name} is set but empty ({what}): {BY_SLURM}")
    if not re.fullmatch(r"[0-9]+", value):
        kind = "negative" if re.fullmatch(r"-[0-9]+", value) else "not a number in ASCII digits"
        raise UsageError(f"{name}={shorten(raw)!r} is {kind} ({what}): {BY_SLURM}")
    if len(value) > 10 or int(value) > SLURM_MAX:
        raise UsageError(
            f"{name}={shorten(value)} is larger than any number Slurm sets ({what}): {BY_SLURM}"
        )
    if int(value) < lo:
        raise UsageError(f"{name}={int(value)} must be >= {lo} ({what}): {BY_SLURM}")
    return int(value)


def tasks_per_node(raw: str, name: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed counts ('2(x3),1') -> [2, 2, 2, 1]."""
    return [n for n, times in _task_counts(raw, name) for _ in range(times)]


def _task_counts(raw: str, name: str) -> list[tuple[int, int]]:
    """'2(x3),1' -> [(2, 3), (1, 1)]: (tasks, nodes) pairs, each at least 1, not expanded (a
    repeat count may be huge)."""
    pairs: list[tuple[int, int]] = []
    for item in raw.split(","):
        m = re.fullmatch(r"([0-9]{1,10})(?:\(x([0-9]{1,10})\))?", item.strip())
        if not m or int(m.group(1)) < 1 or int(m.group(2) or 1) < 1:
            raise UsageError(
                f"{name}={shorten(raw)!r} is not Slurm's format (tasks on each node, at least "
                f"1, like 2(x3),1): {BY_SLURM}"
            )
        pairs.append((int(m.group(1)), int(m.group(2) or 1)))
    return pairs


def job_port(env: Mapping[str, str]) -> int:
    from trainer.envvars import env_port

    if raw := env.get("MASTER_PORT", "").strip():
        return env_port("MASTER_PORT", raw, what="a TCP port on the first node for the rendezvous")
    job = slurm_int(env, "SLURM_JOB_ID", "Slurm's job id") or 0
    return PORT_BASE + job % PORT_SPAN


# ---------------------------------------------------------------------------------------------
# Slurm's node lists (`gpu[07-08],cpu01`), read without scontrol: how many nodes, the first.


def _hostlist(raw: str) -> list[list[str | list[tuple[str, str]]]] | None:
    """A node list -> its items, each a list of literal text and bracket groups of (first, last)
    ranges as written; None when it is not in the plain syntax (scontrol has the last word)."""
    raw = raw.strip()
    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", raw)
    if not raw or re.search(r"\s", raw) or ",".join(items) != raw:
        return None
    out: list[list[str | list[tuple[str, str]]]] = []
    for item in items:
        tokens = re.findall(r"[^\[\]]+|\[[^\[\]]*\]", item)
        if "".join(tokens) != item:
            return None
        parts: list[str | list[tuple[str, str]]] = []
        for token in tokens:
            if not token.startswith("["):
                parts.append(token)
                continue
            ranges = [re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", r) for r in token[1:-1].split(",")]
            pairs = [(m[1], m[2] or m[1]) for m in ranges if m]
            if len(pairs) != len(ranges) or any(int(a) > int(b) for a, b in pairs):
                return None
            parts.append(pairs)
        out.append(parts)
    return out


def hostlist_count(raw: str) -> int | None:
    """How many nodes a node list names (None: not understood here)."""
    items = _hostlist(raw)
    if items is None:
        return None
    total = 0
    for parts in items:
        count = 1
        for part in parts:
            if not isinstance(part, str):
                count *= sum(int(b) - int(a) + 1 for a, b in part)
        total += count
    return total


def first_host(raw: str) -> str | None:
    """The first node of a node list, as Slurm names it (`gpu[07-08]` -> gpu07)."""
    items = _hostlist(raw)
    if not items:
        return None
    return "".join(p if isinstance(p, str) else p[0][0] for p in items[0])


# ---------------------------------------------------------------------------------------------
# The job step: its shape, checked, then the node contract or a rank's variables.


class Shape(NamedTuple):
    """The step as Slurm's variables say, checked against each other."""

    nodes: int
    node: int
    """This node's index in the step."""
    tasks: int
    here: int
    """Tasks on this node."""
    proc: int
    """This task's rank in the step."""
    local: int
    """This task's index on its node."""


def read_shape(env: Mapping[str, str]) -> Shape:
    """The step's nodes and tasks, this node's and this task's place in them; every contradiction
    is one line naming the SLURM_* variables that disagree (pure)."""
    nodes = slurm_int(env, "SLURM_STEP_NUM_NODES", "the step's nodes", lo=1) or 1
    if nodes > MAX_NODES:
        raise UsageError(
            f"SLURM_STEP_NUM_NODES={nodes}: trainer-launch runs at most {MAX_NODES} nodes "
            "(srun -N with fewer)"
        )
    _check_job_nodes(env, nodes)
    node = slurm_int(env, "SLURM_NODEID", "this node's index in the step") or 0
    if node >= nodes:
        raise UsageError(
            f"SLURM_NODEID={node} but SLURM_STEP_NUM_NODES={nodes}: a node's index runs from 0 to "
            f"{nodes - 1}; {BY_SLURM_ALL}"
        )
    tasks, tasks_var = _tasks(env, nodes)
    here, spread = _tasks_here(env, nodes, node, tasks, tasks_var)
    proc = slurm_int(env, "SLURM_PROCID", "this task's rank in the step") or 0
    if proc >= tasks:
        raise UsageError(
            f"SLURM_PROCID={proc} but {tasks_var}={tasks}: a task's rank runs from 0 to "
            f"{tasks - 1}; {BY_SLURM_ALL}"
        )
    local = slurm_int(env, "SLURM_LOCALID", "this task's index on its node") or 0
    if local >= here:
        raise UsageError(
            f"SLURM_LOCALID={local} but this node (SLURM_NODEID={node}) runs {here} task(s) "
            f"({spread}): a task's index on its node runs from 0 to {here - 1}; {BY_SLURM_ALL}"
        )
    return Shape(nodes, node, tasks, here, proc, local)


def _check_job_nodes(env: Mapping[str, str], nodes: int) -> None:
    """The step's nodes are some of the job's, and each node list names as many as its count."""
    counts = {"SLURM_STEP_NUM_NODES": nodes}
    for var in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        total = slurm_int(env, var, "the job's nodes", lo=1)
        if total is not None and total < nodes:
            raise UsageError(
                f"SLURM_STEP_NUM_NODES={nodes} but {var}={total}: a step runs on some of its "
                f"job's nodes, never more; {BY_SLURM_ALL}"
            )
        if total is not None and var == "SLURM_JOB_NUM_NODES":
            counts[var] = total
    for count_var, list_var in (
        ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST"),
        ("SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"),
    ):
        raw = env.get(list_var, "")
        named = hostlist_count(raw) if raw.strip() and count_var in counts else None
        if named is not None and named != counts[count_var]:
            raise UsageError(
                f"{list_var}={shorten(raw)!r} names {shorten(str(named))} node(s) but "
                f"{count_var}={counts[count_var]}; {BY_SLURM_ALL}"
            )


def _tasks(env: Mapping[str, str], nodes: int) -> tuple[int, str]:
    """(the step's tasks, the variable that said so): at least one on each node."""
    ntasks = slurm_int(env, "SLURM_NTASKS", "the step's tasks", lo=1)
    tasks = slurm_int(env, "SLURM_STEP_NUM_TASKS", "the step's tasks", lo=1)
    var = "SLURM_STEP_NUM_TASKS" if tasks is not None else "SLURM_NTASKS"
    tasks = tasks if tasks is not None else ntasks
    if tasks is None:
        return nodes, "SLURM_STEP_NUM_NODES"  # one task per node
    if tasks < nodes:
        raise UsageError(
            f"{var}={tasks} but SLURM_STEP_NUM_NODES={nodes}: a step runs at least one task on "
            f"each of its nodes; {BY_SLURM_ALL}"
        )
    return tasks, var


def _tasks_here(
    env: Mapping[str, str], nodes: int, node: int, tasks: int, tasks_var: str
) -> tuple[int, str]:
    """(the tasks on this node, what said so): from SLURM_STEP_TASKS_PER_NODE (else
    SLURM_TASKS_PER_NODE, else an even split), which must cover the step's nodes and add up to
    its tasks."""
    var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if v in env), None)
    if var is None:
        if tasks % nodes:
            raise UsageError(
                f"{tasks_var}={tasks} over SLURM_STEP_NUM_NODES={nodes} nodes, and no "
                f"SLURM_STEP_TASKS_PER_NODE says how many run on each; {BY_SLURM_ALL}"
            )
        return tasks // nodes, f"{tasks_var}={tasks} over SLURM_STEP_NUM_NODES={nodes}"
    raw = env[var]
    pairs = _task_counts(raw, var)
    covered, total = sum(t for _, t in pairs), sum(n * t for n, t in pairs)
    if covered != nodes:
        raise UsageError(
            f"{var}={shorten(raw)!r} counts the tasks of {covered} node(s) but "
            f"SLURM_STEP_NUM_NODES={nodes}; {BY_SLURM_ALL}"
        )
    if total != tasks:
        raise UsageError(
            f"{var}={shorten(raw)!r} adds up to {total} task(s) but {tasks_var}={tasks}; "
            f"{BY_SLURM_ALL}"
        )
    return tasks_per_node(raw, var)[node], f"{var}={shorten(raw)}"


def read_slurm(
    env: Mapping[str, str],
    *,
    gpus: int,
    first_node: Callable[[str], tuple[str, str]],
) -> SlurmJob | None:
    """This process's part of a Slurm job step, or None outside a multi-rank step (not in
    Slurm, or a one-node batch script: that is an ordinary single node). `gpus`: the GPUs this
    task sees (0 on CPU); `first_node(nodelist) -> (name, address)` asks Slurm (never when
    MASTER_ADDR is set: it names the rendezvous host)."""
    if not in_job_step(env):
        return None
    slurm_int(env, "SLURM_JOB_ID", "Slurm's job id")
    if not env.get("SLURM_STEP_ID", "").strip():
        nodes = slurm_int(env, "SLURM_JOB_NUM_NODES", "the job's nodes", lo=1) or 1
        if nodes > 1:
            raise UsageError(
                f"trainer-launch is running in the batch script of a {nodes}-node Slurm job, "
                "on its first node only: start it with srun "
                "(srun --ntasks-per-node=1 trainer-launch ...), as slurm/train.sbatch does"
            )
        return None
    slurm_int(env, "SLURM_STEP_ID", "the step's id")
    slurm_int(env, "SLURM_RESTART_COUNT", "how often the job was requeued")
    shape = read_shape(env)
    _check_user_nodes(env, shape.nodes, shape.node)
    name, addr = "localhost", "127.0.0.1"  # one node: its ranks meet on loopback
    if shape.nodes > 1:
        name, addr = _rendezvous_host(env, first_node)
    step = _Step(env["SLURM_JOB_ID"].strip(), shape, name, addr, job_port(env))
    if shape.tasks == shape.nodes:
        return _per_node(env, gpus, step)
    return _per_task(env, gpus, step)


def _rendezvous_host(
    env: Mapping[str, str], first_node: Callable[[str], tuple[str, str]]
) -> tuple[str, str]:
    """(the first node's Slurm name, the address the others reach it at): MASTER_ADDR when set,
    without asking scontrol (an image may have none); else scontrol's NodeAddr."""
    nodelist = env.get("SLURM_STEP_NODELIST", "").strip() or env.get("SLURM_NODELIST", "").strip()
    if master := env.get("MASTER_ADDR", "").strip():
        return first_host(nodelist) or master, master
    return first_node(nodelist)


class _Step(NamedTuple):
    """The job step as read, for the two layouts."""

    job: str
    shape: Shape
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
                f"{var}={shorten(raw)} but Slurm says {slurm}={want}: unset {var} in the job "
                "script (under srun, trainer-launch takes the nodes and this node's rank from "
                "Slurm)"
            )


def _rdzv_id(env: Mapping[str, str], job: str) -> str:
    step = env.get("SLURM_STEP_ID", "0").strip()
    restart = env.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    return f"slurm-{job}-{step}-r{restart}"


def _per_node(env: Mapping[str, str], gpus: int, step: _Step) -> SlurmJob:
    nodes, node = step.shape.nodes, step.shape.node
    given = slurm_int(env, "SLURM_GPUS_ON_NODE", "the GPUs Slurm gave this node")
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
    here, proc, local = step.shape.here, step.shape.proc, step.shape.local
    slurm_int(env, "SLURM_GPUS_ON_NODE", "the GPUs Slurm gave this node")
    nproc = env.get("NPROC_PER_NODE", "").strip() or env.get("PET_NPROC_PER_NODE", "").strip()
    if nproc and nproc not in ("1", "auto"):
        raise UsageError(
            f"NPROC_PER_NODE={shorten(nproc)} but Slurm runs one task per process ({here} on "
            "this node): unset NPROC_PER_NODE, or run one task per node "
            "(srun --ntasks-per-node=1) and let torchrun start the processes"
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
        "WORLD_SIZE": str(step.shape.tasks),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": env.get("MASTER_ADDR", "").strip() or step.addr,
        "MASTER_PORT": str(step.port),
    }
    summary = (
        f"Slurm job {step.job}: one task per process, rank {proc} of {step.shape.tasks} (no "
        f"torchrun), rendezvous on {step.where}:{step.port}"
    )
    nodes = step.shape.nodes
    return SlurmJob(added, True, summary, proc == 0, step.port, step.name, here, nodes)


def cpus_for_task(env: Mapping[str, str], available: int, job: SlurmJob | None) -> int:
    """The CPUs this task may use: SLURM_CPUS_PER_TASK when set, else (one task per process) its
    share of the step's CPUs on this node; never more than the affinity mask and cgroup allow
    (the site's task binding may be off, and then the mask shows the whole node)."""
    per_task = slurm_int(env, "SLURM_CPUS_PER_TASK", "the CPUs of each task", lo=1)
    on_node = slurm_int(env, "SLURM_CPUS_ON_NODE", "the step's CPUs on this node", lo=1)
    if per_task is None and job is not None and job.per_task:
        per_task = max(1, on_node // job.tasks_here) if on_node else None
    return min(available, per_task) if per_task else available


def nproc_warning(env: Mapping[str, str], nproc: int) -> str | None:
    """One task per node: the line to print when its torchrun starts more processes than the task
    has CPUs (they would share them, one thread each); None when they fit."""
    per_task = slurm_int(env, "SLURM_CPUS_PER_TASK", "the CPUs of each task", lo=1)
    if per_task is None or nproc <= per_task:
        return None
    var = next((v for v in ("PET_NPROC_PER_NODE", "NPROC_PER_NODE") if env.get(v, "").strip()), "")
    said = f"{var}={env[var].strip()}" if var else "NPROC_PER_NODE (unset: one per GPU)"
    return (
        f"trainer-launch: warning: {said} starts {nproc} processes in a task of "
        f"SLURM_CPUS_PER_TASK={per_task} CPU(s): they will share them, one thread each; ask for "
        f"--cpus-per-task={nproc} or more (sbatch/srun), or lower NPROC_PER_NODE"
    )


# ---------------------------------------------------------------------------------------------
# Asking Slurm (side effects): the first node's name and address; is the port free.

WITHOUT_SCONTROL = (
    "or set MASTER_ADDR to the first node's address in the job script (then scontrol is not needed)"
)


def first_node(nodelist: str, run=None) -> tuple[str, str]:
    """(name, address) of the first node of a Slurm node list, from scontrol: `show hostnames`
    expands `node[01-04,07]`, `show node` gives the NodeAddr Slurm itself reaches it at."""
    import socket
    import subprocess

    run = run or subprocess.run

    def scontrol(*args: str) -> str:
        said = f"scontrol {shorten(' '.join(args), 100)}"
        try:
            out = run(
                ["scontrol", *args], capture_output=True, text=True, errors="replace", timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UsageError(
                f"cannot run `{said}` ({shorten(str(e), 160)}): trainer-launch asks Slurm's "
                "scontrol for the address of the step's first node: load the site's slurm "
                f"module (scontrol on PATH), {WITHOUT_SCONTROL}"
            ) from None
        if out.returncode != 0:
            why = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
            raise UsageError(
                f"`{said}` failed ({shorten(why, 160)}): check SLURM_STEP_NODELIST and that "
                f"trainer-launch runs under srun, {WITHOUT_SCONTROL}"
            )
        return out.stdout

    if not nodelist.strip():
        raise UsageError(
            f"SLURM_STEP_NODELIST is empty: run trainer-launch under srun, {WITHOUT_SCONTROL}"
        )
    names = scontrol("show", "hostnames", nodelist).split()
    if not names:
        raise UsageError(
            f"SLURM_STEP_NODELIST={shorten(nodelist)!r} names no node (scontrol show hostnames): "
            f"run trainer-launch under srun, {WITHOUT_SCONTROL}"
        )
    name = names[0]
    m = re.search(r"\bNodeAddr=(\S+)", scontrol("show", "node", "-o", name))
    addr = m.group(1) if m else name
    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise UsageError(
            f"the first node of SLURM_STEP_NODELIST={shorten(nodelist)} is {shorten(name)}, at "
            f"NodeAddr {shorten(addr)}, which does not resolve here ({shorten(why, 100)}): set "
            "MASTER_ADDR to its IP address in the job script"
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
