"""Rank facts, read once from torchrun's environment, then passed around; process-group setup.

`from_env` and `choose_device` are pure functions of their inputs (unit-tested against the exact
variables torchrun sets); `init` and `teardown` are the only places with side effects.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import EnvError, RetryableError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str, default: int | None = None, *, lo: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(
                f"{name} is not set but other torchrun variables are: launch with torchrun, or unset RANK/WORLD_SIZE/LOCAL_RANK"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(
            f"{name}='{raw}' is not an integer (set by your launcher; expected torchrun's values)"
        ) from None
    if value < lo:
        raise EnvError(f"{name}={value} must be >= {lo}")
    return value


def from_env(env: Mapping[str, str]) -> DistEnv:
    """DistEnv from torchrun's variables; none set means a single process (world 1)."""
    if not any(env.get(v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return DistEnv(restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0))
    world = _int(env, "WORLD_SIZE", lo=1)
    rank = _int(env, "RANK")
    local_rank = _int(env, "LOCAL_RANK", rank if world == 1 else None)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world, lo=1)
    if rank >= world:
        raise EnvError(
            f"RANK={rank} must be < WORLD_SIZE={world}: the launcher's variables disagree"
        )
    if local_world > world:
        raise EnvError(f"LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world}")
    if local_rank >= local_world:
        raise EnvError(f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world}")
    addr, port = env.get("MASTER_ADDR") or None, None
    if world > 1:
        if not addr or not env.get("MASTER_PORT"):
            raise EnvError(
                f"WORLD_SIZE={world} needs MASTER_ADDR and MASTER_PORT (torchrun sets them): "
                "launch with torchrun or trainer-launch"
            )
        port = _int(env, "MASTER_PORT", lo=1)
        if port > 65535:
            raise EnvError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", rank // local_world),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        master_addr=addr,
        master_port=port,
    )


def choose_device(
    denv: DistEnv, device: str, backend: str, cuda_count: int, visible: str | None = None
) -> tuple[str, str]:
    """(torch device string, process-group backend) for this rank; pure."""
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    if device == "cuda":
        if cuda_count == 0:
            raise EnvError(
                "dist.device=cuda but no CUDA GPU is visible "
                f"(CUDA_VISIBLE_DEVICES={visible!r}): use dist.device=cpu or run with GPUs"
            )
        if denv.local_rank >= cuda_count:
            raise EnvError(
                f"LOCAL_RANK={denv.local_rank} but only {cuda_count} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={visible!r}): use --nproc-per-node <= {cuda_count}"
            )
        device = f"cuda:{denv.local_rank}"
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and not device.startswith("cuda"):
        raise EnvError(
            "dist.backend=nccl needs CUDA devices: use dist.backend=gloo (or auto) on CPU"
        )
    return device, backend


_control_group = None  # set by init() when the main backend is not gloo (e.g. nccl)


def init(denv: DistEnv, device: str, backend: str, timeout_s: int) -> None:
    """Join the process group (world > 1 only) with a bounded timeout, and pin the GPU."""
    global _control_group
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not denv.distributed:
        return
    kwargs = {}
    if backend == "nccl":
        # Eager NCCL init: a broken GPU or network fails here, not in the first step.
        kwargs["device_id"] = torch.device(device)
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=denv.rank,
            world_size=denv.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        if backend != "gloo":
            _control_group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
    except dist.DistError as e:
        raise RetryableError(
            f"could not form the process group at {denv.master_addr}:{denv.master_port} within "
            f"dist.timeout_s={timeout_s} ({_first_line(e)}): check that all {denv.world_size} ranks "
            "started and can reach MASTER_ADDR"
        ) from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


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
def peer_failures_are_retryable(denv: DistEnv, timeout_s: int):
    """Turn a lost peer or a timed-out collective into RetryableError (exit 4, one line)."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        if not denv.distributed or not is_peer_failure(e):
            raise
        raise RetryableError(
            f"rank {denv.rank}: a collective failed or exceeded dist.timeout_s={timeout_s} "
            f"({_first_line(e)}); another rank probably died: see its log"
        ) from None


def control_group():
    """A gloo group for small CPU-side agreements (stop flags), so they never sync the GPU."""
    return _control_group


def teardown() -> None:
    global _control_group
    import torch.distributed as dist

    _control_group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj, src: int = 0):
    """rank src's `obj` on every rank (itself in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_control_group)
    return box[0]


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's `obj`, in rank order, on rank dst (None elsewhere)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=_control_group)
    return out


def all_reduce_sum(tensor):
    """Sum a tensor over all ranks in place (no-op in a single process); returns it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
