"""Who this process is in the job, read once from torchrun's environment; the process group.

`World` holds the rank facts together with the torch device and the process-group backend.
`from_env` and `choose_device` are pure functions of their inputs (unit-tested against the exact
variables torchrun sets); `process_group` is the one place that joins and leaves the group. The
few collectives the trainer needs (`broadcast_object`, `gather_objects`, `all_reduce_sum`) are
no-ops in a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.diagnostics import Collectives
from trainer.envvars import env_int, env_port
from trainer.errors import EnvError, RetryableError, first_line

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)
"""The variables torchrun sets for each worker that the trainer reads."""

_FROM_LAUNCHER = "set by your launcher; expected torchrun's values"


@dataclass(frozen=True, kw_only=True)
class World:
    """This process's place in the job, and where it computes."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    """Ranks in the whole job (WORLD_SIZE)."""
    local_size: int = 1
    """Ranks on this node (LOCAL_WORLD_SIZE)."""
    node_rank: int = 0
    restart_count: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    device: str = "cpu"
    """A torch device string: cpu, or cuda:<local rank>."""
    backend: str = "gloo"
    """The process group's backend: gloo or nccl."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def _int(env: Mapping[str, str], name: str, default: int | None = None, *, lo: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(
                f"{name} is not set but other torchrun variables are: launch with torchrun, or "
                "unset RANK/WORLD_SIZE/LOCAL_RANK"
            )
        return default
    return env_int(name, raw, lo=lo, what=_FROM_LAUNCHER, error=EnvError)


def from_env(env: Mapping[str, str]) -> World:
    """The rank facts in torchrun's variables; none set means a single process (world 1)."""
    if not any(env.get(v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return World(restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0))
    size = _int(env, "WORLD_SIZE", lo=1)
    rank = _int(env, "RANK")
    local_rank = _int(env, "LOCAL_RANK", rank if size == 1 else None)
    local_size = _int(env, "LOCAL_WORLD_SIZE", size, lo=1)
    if rank >= size:
        raise EnvError(
            f"RANK={rank} must be < WORLD_SIZE={size}: the launcher's variables disagree"
        )
    if local_size > size:
        raise EnvError(f"LOCAL_WORLD_SIZE={local_size} exceeds WORLD_SIZE={size}")
    if local_rank >= local_size:
        raise EnvError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_size}")
    addr, port = env.get("MASTER_ADDR") or None, None
    if size > 1:
        if not addr or not env.get("MASTER_PORT"):
            raise EnvError(
                f"WORLD_SIZE={size} needs MASTER_ADDR and MASTER_PORT (torchrun sets them): "
                "launch with torchrun or trainer-launch"
            )
        port = env_port("MASTER_PORT", env["MASTER_PORT"], what=_FROM_LAUNCHER, error=EnvError)
    return World(
        rank=rank,
        local_rank=local_rank,
        size=size,
        local_size=local_size,
        node_rank=_int(env, "GROUP_RANK", rank // local_size),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        master_addr=addr,
        master_port=port,
    )


def choose_device(
    world: World, device: str, backend: str, cuda_count: int, visible: str | None = None
) -> World:
    """`world` with the torch device and backend that dist.device / dist.backend ask for; pure."""
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    if device == "cuda":
        if cuda_count == 0:
            raise EnvError(
                "dist.device=cuda but no CUDA GPU is visible "
                f"(CUDA_VISIBLE_DEVICES={visible!r}): use dist.device=cpu or run with GPUs"
            )
        if world.local_rank >= cuda_count:
            raise EnvError(
                f"LOCAL_RANK={world.local_rank} but only {cuda_count} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={visible!r}): use --nproc-per-node <= {cuda_count}"
            )
        device = f"cuda:{world.local_rank}"
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and not device.startswith("cuda"):
        raise EnvError(
            "dist.backend=nccl needs CUDA devices: use dist.backend=gloo (or auto) on CPU"
        )
    return dataclasses.replace(world, device=device, backend=backend)


def from_process(device: str, backend: str, environ: Mapping[str, str]) -> World:
    """This process's World: torchrun's variables, plus the device and backend asked for."""
    import torch

    gpus = torch.cuda.device_count() if device != "cpu" else 0
    return choose_device(
        from_env(environ), device, backend, gpus, environ.get("CUDA_VISIBLE_DEVICES")
    )


_control_group = None  # a gloo group, set by _init when the main backend is not gloo (nccl)
_stop_group = None  # a gloo group of its own for the background stop vote (set when distributed)
_writer_group = None  # a gloo group for background sharded checkpoint writes (made on first use)
_timeout = None  # dist.timeout_s of the job's groups, for the ones made later


@contextlib.contextmanager
def process_group(world: World, timeout_s: int, *, even_alone: bool = False):
    """Join the job's process group (world > 1, or a group of one with even_alone) for the
    block, and leave it whatever happens.

    Setup and every collective are bounded by timeout_s; a lost peer or a timed-out collective
    inside the block becomes a RetryableError (exit 4, one line).
    """
    _init(world, timeout_s, even_alone)
    try:
        with peer_failures_are_retryable(world, timeout_s):
            yield
    finally:
        _teardown()


def _init(world: World, timeout_s: int, even_alone: bool) -> None:
    global _control_group, _stop_group, _timeout
    import torch
    import torch.distributed as dist

    if world.on_cuda:
        torch.cuda.set_device(torch.device(world.device))
    if not (world.distributed or even_alone):
        return
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
    _timeout = kwargs["timeout"]
    if world.backend == "nccl":
        # Eager NCCL init: a broken GPU or network fails here, not in the first step.
        kwargs["device_id"] = torch.device(world.device)
    if world.distributed:
        kwargs.update(init_method="env://", rank=world.rank, world_size=world.size)
    else:  # a group of one: an in-memory store, nothing to rendezvous with
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    from trainer.noise import quiet_c10d

    # c10d prints every retry of the rendezvous from C++ (a backtrace each): the one line below
    # says what they would, so they go; anything else printed meanwhile passes through.
    quiet = quiet_c10d() if world.distributed else contextlib.nullcontext()
    try:
        with quiet:
            dist.init_process_group(backend=world.backend, **kwargs)
            if world.backend != "gloo":
                _control_group = dist.new_group(backend="gloo", timeout=kwargs["timeout"])
            if world.distributed:
                # The stop flag's all-reduce runs in the background while the step computes;
                # its own group keeps it out of the way of the gradient all-reduce's queue.
                _stop_group = dist.new_group(backend="gloo", timeout=kwargs["timeout"])
    except dist.DistError as e:
        where = f"{world.master_addr}:{world.master_port}"
        if unknown := unresolved(world.master_addr):
            reason = f"MASTER_ADDR {world.master_addr} does not resolve: {unknown}"
            fix = "check the name (on Kubernetes, the rank-0 pod's service or hostname)"
        else:
            reason = first_line(e)
            fix = f"check that all {world.size} ranks started and can reach MASTER_ADDR"
        raise RetryableError(
            f"could not form the process group at {where} within dist.timeout_s={timeout_s} "
            f"({reason}): {fix}"
        ) from None


def unresolved(host: str | None) -> str | None:
    """Why `host` does not resolve (the resolver's words), or None when it does."""
    import socket

    if not host:
        return None
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as e:
        return getattr(e, "strerror", None) or first_line(e)
    return None


def _teardown() -> None:
    global _control_group, _stop_group, _writer_group
    import torch.distributed as dist

    _control_group = _stop_group = _writer_group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# gloo reports a vanished peer as a plain RuntimeError from its TCP transport, not a DistError.
_PEER_LOST = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)


def is_peer_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(marker in str(e) for marker in _PEER_LOST)


@contextlib.contextmanager
def peer_failures_are_retryable(world: World, timeout_s: int):
    """Turn a lost peer or a timed-out collective into RetryableError (exit 4, one line)."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        if not world.distributed or not is_peer_failure(e):
            raise
        raise RetryableError(
            f"rank {world.rank}: a collective failed or exceeded dist.timeout_s={timeout_s} "
            f"({first_line(e)}); another rank probably died: see its log"
        ) from None


def control_group():
    """A gloo group for small CPU-side agreements (stop flags), so they never sync the GPU."""
    return _control_group


def stop_group():
    """The gloo group of the background stop-flag all-reduce (None in a single process)."""
    return _stop_group


def writer_group():
    """A gloo group of its own for the collectives of a background checkpoint write (DCP's plan
    and metadata exchange run on its thread while training uses the others). A collective the
    first time: every rank calls it at the same save."""
    global _writer_group
    import torch.distributed as dist

    if _writer_group is None:
        _writer_group = dist.new_group(backend="gloo", timeout=_timeout)
    return _writer_group


def _joined() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def broadcast_object(obj, src: int = 0):
    """rank src's `obj` on every rank (itself in a single process)."""
    import torch.distributed as dist

    if not _joined():
        return obj
    Collectives.enter("broadcast")
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_control_group)
    return box[0]


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's `obj`, in rank order, on rank dst (None elsewhere)."""
    import torch.distributed as dist

    if not _joined():
        return [obj]
    Collectives.enter("gather")
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=_control_group)
    return out


def main_decides(decide, *args, catch: tuple = (), error: type[Exception] | None = None):
    """Rank 0 runs decide(*args); what it returns, or the error it raises (a TrainerError, or one
    of `catch`), reaches every rank: all return the same value or raise the same error (with
    `error`: as that class, e.g. ConfigError for a mistake rank 0 alone reports). The other
    ranks never call `decide`."""
    from trainer.errors import TrainerError

    caught = (TrainerError, *catch)
    outcome = None
    if not _joined() or _rank() == 0:
        try:
            outcome = (decide(*args), None)
        except caught as e:
            outcome = (None, e)
    value, failed = broadcast_object(outcome)
    if failed is not None:
        raise error(str(failed)) if error else failed
    return value


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def first_of_ranks(obj):
    """The lowest rank's non-None `obj` (e.g. an error), on every rank; None if every rank's is
    None. Rank 0 gathers and picks, so all ranks act on the same one."""
    objs = gather_objects(obj)
    return broadcast_object(next((o for o in objs if o is not None), None) if objs else None)


def all_reduce_sum(tensor):
    """Sum a tensor over all ranks in place (no-op in a single process); returns it."""
    import torch.distributed as dist

    if _joined():
        Collectives.enter("all_reduce")
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def _wire_dtypes() -> list:
    """What send_tensor carries (its header names the dtype by its place here)."""
    import torch

    return [
        torch.float32, torch.bfloat16, torch.float16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    ]  # fmt: skip


def send_tensor(t, dst: int) -> None:
    """Tensor `t` to rank `dst`, which need not know its dtype or shape (recv_tensor): a header
    of its size, then the header (dtype, dimensions, shape), then the data. Point to point."""
    import torch
    import torch.distributed as dist

    head = torch.tensor([_wire_dtypes().index(t.dtype), t.dim(), *t.shape], dtype=torch.int64)
    size = torch.tensor([head.numel()], dtype=torch.int64)
    dist.send(size.to(t.device), dst)
    dist.send(head.to(t.device), dst)
    dist.send(t.contiguous(), dst)


def recv_tensor(src: int, device: str):
    """The tensor rank `src` sends with send_tensor, on `device`."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    head = torch.zeros(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(head, src)
    dtype, _, *shape = head.tolist()
    out = torch.empty(shape, dtype=_wire_dtypes()[dtype], device=device)
    dist.recv(out, src)
    return out
