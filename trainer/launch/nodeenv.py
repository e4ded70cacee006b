"""The node environment contract: what each platform sets -> this node's part of the job.

Read in this order of precedence (first non-empty wins), so one image runs under compose, a
Kubernetes Indexed Job or JobSet, Kubeflow PyTorchJob (v1) and TrainJob (v2):

    nodes          PET_NNODES, NNODES                          default 1 (MIN:MAX: elastic)
    processes      PET_NPROC_PER_NODE, NPROC_PER_NODE          default auto (= visible GPUs, else 1)
    node rank      PET_NODE_RANK, NODE_RANK, JOB_COMPLETION_INDEX
    rendezvous     PET_RDZV_ENDPOINT, else PET_MASTER_ADDR|MASTER_ADDR : PET_MASTER_PORT|MASTER_PORT
    rendezvous id  PET_RDZV_ID, RDZV_ID, JOBSET_NAME, JOB_NAME, else derived from the endpoint
    restarts       PET_MAX_RESTARTS, MAX_RESTARTS              default 0
    join timeout   RDZV_JOIN_TIMEOUT                           default 600 s

Platforms' per-node RANK/WORLD_SIZE (PyTorchJob) are not read: the PET_* twins carry the same
facts, and torchrun overwrites both for its workers. Everything here is pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.envvars import env_int, env_port
from trainer.errors import UsageError

DEFAULT_MASTER_PORT = 29500
DEFAULT_JOIN_TIMEOUT_S = 600
"""How long a node waits for the other nodes and for node 0's rendezvous store (pods start
minutes apart when images are pulled; the c10d store's own 60 s connect timeout is too short)."""
DEFAULT_MAX_RESTARTS = 0
"""In-place worker-group restarts. 0: a failure reaches the platform (k8s podFailurePolicy, compose
restart policy) with the trainer's own exit code, and nothing is retried twice."""

TORCHRUN_WORKER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

# Kubeflow's PET_* variables trainer-launch turns into explicit torchrun flags. They are removed
# from torchrun's environment so that it runs exactly the printed command (torchrun reads PET_X as
# the default of --x, and crashes on PET_STANDALONE="", which PyTorchJob sets for standalone jobs).
CONSUMED_PET = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_ID",
    "PET_RDZV_BACKEND",
    "PET_RDZV_CONF",
    "PET_MAX_RESTARTS",
    "PET_STANDALONE",
)


@dataclass(frozen=True)
class Node:
    """This node's part of the job, validated."""

    nnodes: str
    """An integer, or MIN:MAX for an elastic job."""
    max_nodes: int
    nproc: int
    node_rank: int | None
    host: str | None
    port: int
    rdzv_id: str | None
    """Set whenever host is: given, or derived from the endpoint."""
    rdzv_conf: dict[str, str]
    max_restarts: int
    join_timeout: int

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1


def launched_by_torchrun(env: Mapping[str, str]) -> bool:
    """This process is already one rank of a torchrun job (e.g. TorchX's dist.ddp).

    Platforms set RANK/WORLD_SIZE per node (PyTorchJob) but never LOCAL_RANK; torchrun sets all
    three, and TORCHELASTIC_RUN_ID, which tells its workers apart from a Kubeflow pod's PET_*.
    """
    if not all(env.get(v) for v in TORCHRUN_WORKER_VARS):
        return False
    return bool(env.get("TORCHELASTIC_RUN_ID")) or not any(k.startswith("PET_") for k in env)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | tuple[None, None]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None, None


def _nnodes(name: str | None, raw: str | None) -> tuple[str, int]:
    if name is None or raw is None:
        return "1", 1
    m = re.fullmatch(r"(\d+)(?::(\d+))?", raw)
    if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < int(m.group(1))):
        raise UsageError(
            f"{name}={raw!r} is not a node count: use an integer like 2 (or MIN:MAX for an elastic job)"
        )
    return raw, int(m.group(2) or m.group(1))


def _nproc(name: str | None, raw: str, gpus: int, cpus: int, visible: str | None) -> int:
    label = f"{name}={raw}" if name else f"NPROC_PER_NODE={raw} (the default)"
    if raw == "auto":
        return gpus or 1
    if raw == "gpu":
        if not gpus:
            raise UsageError(
                f"{label} but no GPU is visible (CUDA_VISIBLE_DEVICES={visible!r}): "
                "run with GPUs, or use NPROC_PER_NODE=auto or a number"
            )
        return gpus
    if raw == "cpu":
        return max(1, cpus)
    if not raw.isdigit():
        raise UsageError(f"{label} is not valid: use auto, gpu, cpu or a number of processes")
    nproc = env_int(str(name), raw, lo=1, what="the number of processes on this node")
    if gpus and nproc > gpus:
        raise UsageError(
            f"{label} but only {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES={visible!r}): "
            f"use NPROC_PER_NODE=auto or at most {gpus}, or train on CPU (dist.device=cpu)"
        )
    return nproc


def _endpoint(env: Mapping[str, str]) -> tuple[str | None, int]:
    """(host, port) of the rendezvous; host None when none is given."""
    raw = env.get("PET_RDZV_ENDPOINT", "").strip()
    if raw:  # PyTorchJob's elastic mode: HOST:PORT
        host, sep, port = raw.rpartition(":")
        if not sep or not host:
            host, port = raw, str(DEFAULT_MASTER_PORT)
        return host.strip("[]"), _port("PET_RDZV_ENDPOINT", port)
    _, host = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    port_var, port = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
    return host, _port(port_var, port) if port_var and port else DEFAULT_MASTER_PORT


def _port(name: str, raw: str) -> int:
    return env_port(name, raw, what="a TCP port on node 0 for the rendezvous")


def _rdzv_conf(raw: str | None) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (raw or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"PET_RDZV_CONF: {item!r} must look like key=value (comma-separated)")
        conf[key.strip()] = value.strip()
    return conf


def read_node(env: Mapping[str, str], *, gpus: int, cpus: int) -> Node:
    """This node's shape from the environment (precedence in the module docstring); pure."""
    nn_var, nn_raw = _first(env, "PET_NNODES", "NNODES")
    nnodes, max_nodes = _nnodes(nn_var, nn_raw)
    np_var, np_raw = _first(env, "PET_NPROC_PER_NODE", "NPROC_PER_NODE")
    nproc = _nproc(np_var, np_raw or "auto", gpus, cpus, env.get("CUDA_VISIBLE_DEVICES"))
    rank_var, rank_raw = _first(env, "PET_NODE_RANK", "NODE_RANK", "JOB_COMPLETION_INDEX")
    node_rank = None
    if rank_var and rank_raw is not None:
        node_rank = env_int(
            rank_var, rank_raw, lo=0, what="this node's rank, 0 on the rendezvous host"
        )
        if node_rank >= max_nodes:
            nodes = f"{nn_var}={nn_raw}" if nn_var else "NNODES=1 (the default)"
            raise UsageError(
                f"{rank_var}={node_rank} must be < {nodes}: node ranks run from 0 to nodes - 1"
            )
    host, port = _endpoint(env)
    rs_var, rs_raw = _first(env, "PET_MAX_RESTARTS", "MAX_RESTARTS")
    restarts = DEFAULT_MAX_RESTARTS
    if rs_var and rs_raw is not None:
        restarts = env_int(rs_var, rs_raw, lo=0, what="worker-group restarts before the node fails")
    jt_var, jt_raw = _first(env, "RDZV_JOIN_TIMEOUT")
    join = DEFAULT_JOIN_TIMEOUT_S
    if jt_var and jt_raw is not None:
        join = env_int(jt_var, jt_raw, lo=1, what="seconds to wait for the other nodes")
    _, rdzv_id = _first(env, "PET_RDZV_ID", "RDZV_ID", "JOBSET_NAME", "JOB_NAME")
    if host and not rdzv_id:
        # Never a per-pod value: every node dials the same endpoint, so all derive the same id.
        rdzv_id = "trainer-" + re.sub(r"[^A-Za-z0-9]+", "-", f"{host}-{port}").strip("-")
    backend = env.get("PET_RDZV_BACKEND", "").strip() or "c10d"
    if backend != "c10d":
        raise UsageError(
            f"PET_RDZV_BACKEND={backend}: trainer-launch uses torchrun's c10d rendezvous "
            "(a store on node 0, no extra service); unset it"
        )
    if max_nodes > 1:
        if not host:
            raise UsageError(
                f"{nn_var}={nn_raw} needs the rendezvous host: set MASTER_ADDR to node 0's "
                f"address (and MASTER_PORT, default {DEFAULT_MASTER_PORT})"
            )
        if node_rank is None and ":" not in nnodes:
            raise UsageError(
                f"{nn_var}={nn_raw} needs this node's rank: set NODE_RANK (0 on the node at "
                f"MASTER_ADDR={host}) or run as an Indexed Job (JOB_COMPLETION_INDEX)"
            )
    return Node(
        nnodes=nnodes,
        max_nodes=max_nodes,
        nproc=nproc,
        node_rank=node_rank,
        host=host,
        port=port,
        rdzv_id=rdzv_id,
        rdzv_conf=_rdzv_conf(env.get("PET_RDZV_CONF")),
        max_restarts=restarts,
        join_timeout=join,
    )
