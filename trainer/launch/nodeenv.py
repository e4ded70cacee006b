"""The node environment contract: what each platform sets -> this node's part of the job.

Read in this order of precedence (first non-empty wins), so one image runs under compose, a
Kubernetes Indexed Job or JobSet, Kubeflow PyTorchJob (v1) and TrainJob (v2):

    nodes          PET_NNODES, NNODES                          default 1 (MIN:MAX: elastic)
    processes      PET_NPROC_PER_NODE, NPROC_PER_NODE          default auto (= visible GPUs, else 1)
    node rank      PET_NODE_RANK, NODE_RANK, JOB_COMPLETION_INDEX
    rendezvous     PET_RDZV_ENDPOINT, RDZV_ENDPOINT, else PET_MASTER_ADDR|MASTER_ADDR : PET_MASTER_PORT|MASTER_PORT
    backend        PET_RDZV_BACKEND, RDZV_BACKEND              c10d (a store on node 0) or etcd-v2
    rendezvous id  PET_RDZV_ID, RDZV_ID, JOBSET_NAME, JOB_NAME, else derived from the endpoint
    restarts       PET_MAX_RESTARTS, MAX_RESTARTS              default 0
    join timeout   RDZV_JOIN_TIMEOUT                           default 600 s
    last call      RDZV_LAST_CALL_TIMEOUT                      default 30 s (elastic: wait for more)

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
DEFAULT_ETCD_PORT = 2379
DEFAULT_LAST_CALL_S = 30
"""Elastic jobs: once MIN nodes have joined, how long the rendezvous waits for more (up to MAX)
before it starts them (torchrun's own default)."""
RDZV_BACKENDS = {"c10d": "c10d", "etcd-v2": "etcd-v2", "etcd": "etcd-v2"}
"""What the platforms call them -> torchrun's backend. `etcd` (PyTorchJob's elasticPolicy name)
runs torchrun's etcd-v2 handler: the same dynamic rendezvous as c10d (heartbeats, last call),
with its state in etcd instead of a store on one of the nodes."""
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
    backend: str = "c10d"
    """torchrun's --rdzv-backend: c10d (the store on node 0) or etcd-v2 (an etcd server's v2 API
    at host:port: no node holds the rendezvous, so any node may be lost)."""
    last_call: int = DEFAULT_LAST_CALL_S
    min_nodes: int = 1

    @property
    def multi_node(self) -> bool:
        return self.max_nodes > 1 or self.backend != "c10d"

    @property
    def elastic(self) -> bool:
        return ":" in self.nnodes


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


def _nnodes(name: str | None, raw: str | None) -> tuple[str, int, int]:
    """(as torchrun gets it, MIN, MAX)."""
    if name is None or raw is None:
        return "1", 1, 1
    m = re.fullmatch(r"([0-9]{1,4})(?::([0-9]{1,4}))?", raw)
    if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < int(m.group(1))):
        raise UsageError(
            f"{name}={raw!r} is not a node count: use an integer like 2 (or MIN:MAX for an "
            "elastic job, e.g. 1:4)"
        )
    low, high = int(m.group(1)), int(m.group(2) or m.group(1))
    return (f"{low}:{high}" if m.group(2) else str(low)), low, high


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
    if not re.fullmatch(r"[0-9]+", raw):  # ASCII: str.isdigit() takes '²' and '٣'
        raise UsageError(f"{label} is not valid: use auto, gpu, cpu or a number of processes")
    nproc = env_int(str(name), raw, lo=1, what="the number of processes on this node")
    if gpus and nproc > gpus:
        raise UsageError(
            f"{label} but only {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES={visible!r}): "
            f"use NPROC_PER_NODE=auto or at most {gpus}, or train on CPU (dist.device=cpu)"
        )
    return nproc


def _endpoint(env: Mapping[str, str], default_port: int) -> tuple[str | None, int]:
    """(host, port) of the rendezvous; host None when none is given."""
    name, raw = _first(env, "PET_RDZV_ENDPOINT", "RDZV_ENDPOINT")
    if name and raw:  # PyTorchJob's elastic mode: HOST:PORT
        host, sep, port = raw.rpartition(":")
        if not sep or not host or (raw.count(":") > 1 and not raw.startswith("[")):
            host, port = raw, str(default_port)  # a bare host, or a bare IPv6 address
        host = host.strip("[]")
        if not re.fullmatch(r"[A-Za-z0-9.:_-]+", host):
            raise UsageError(
                f"{name}={raw!r} is not HOST:PORT: give the rendezvous server's name or address "
                f"and port, e.g. etcd:{DEFAULT_ETCD_PORT}"
            )
        return host, _port(name, port)
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


def _optional_int(
    env: Mapping[str, str], names: tuple[str, ...], default: int, lo: int, what: str
) -> int:
    var, raw = _first(env, *names)
    return env_int(var, raw, lo=lo, what=what) if var and raw is not None else default


def _backend(env: Mapping[str, str]) -> str:
    var, raw = _first(env, "PET_RDZV_BACKEND", "RDZV_BACKEND")
    backend = RDZV_BACKENDS.get((raw or "c10d").lower())
    if backend is None:
        raise UsageError(
            f"{var}={raw}: the rendezvous backend is c10d (a store on node 0, the "
            "default) or etcd (an etcd server at RDZV_ENDPOINT, which survives any node)"
        )
    if backend != "c10d" and not _first(env, "PET_RDZV_ENDPOINT", "RDZV_ENDPOINT")[0]:
        raise UsageError(  # MASTER_ADDR names node 0, no etcd server
            f"{var}={raw} needs the etcd server: set RDZV_ENDPOINT=HOST:PORT (port "
            f"{DEFAULT_ETCD_PORT} if left out), an etcd started with --enable-v2"
        )
    return backend


def _limits(env: Mapping[str, str]) -> dict[str, int]:
    """The restart budget and the rendezvous' timeouts."""
    return {
        "max_restarts": _optional_int(
            env,
            ("PET_MAX_RESTARTS", "MAX_RESTARTS"),
            DEFAULT_MAX_RESTARTS,
            0,
            "worker-group restarts before the node fails",
        ),
        "join_timeout": _optional_int(
            env,
            ("RDZV_JOIN_TIMEOUT",),
            DEFAULT_JOIN_TIMEOUT_S,
            1,
            "seconds to wait for the other nodes",
        ),
        "last_call": _optional_int(
            env,
            ("RDZV_LAST_CALL_TIMEOUT",),
            DEFAULT_LAST_CALL_S,
            0,
            "seconds an elastic rendezvous waits for more nodes",
        ),
    }


def read_node(env: Mapping[str, str], *, gpus: int, cpus: int) -> Node:
    """This node's shape from the environment (precedence in the module docstring); pure."""
    nn_var, nn_raw = _first(env, "PET_NNODES", "NNODES")
    nnodes, min_nodes, max_nodes = _nnodes(nn_var, nn_raw)
    backend = _backend(env)
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
    host, port = _endpoint(env, DEFAULT_ETCD_PORT if backend != "c10d" else DEFAULT_MASTER_PORT)
    _, rdzv_id = _first(env, "PET_RDZV_ID", "RDZV_ID", "JOBSET_NAME", "JOB_NAME")
    if host and not rdzv_id:
        # Never a per-pod value: every node dials the same endpoint, so all derive the same id.
        rdzv_id = "trainer-" + re.sub(r"[^A-Za-z0-9]+", "-", f"{host}-{port}").strip("-")
    if backend == "c10d" and max_nodes > 1:
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
        **_limits(env),
        backend=backend,
        min_nodes=min_nodes,
    )
