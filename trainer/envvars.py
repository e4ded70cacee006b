"""Integers and ports from environment variables, with one-line errors that name the variable.

Shared by the process contract (trainer.world: what torchrun sets for each rank) and the node
contract (trainer.launch.nodeenv: what compose, Kubernetes and Kubeflow set for trainer-launch).
"""

from __future__ import annotations

from trainer.errors import UsageError


def env_int(
    name: str, raw: str, *, lo: int, what: str, error: type[UsageError] = UsageError
) -> int:
    """int(raw), at least `lo`; `what` says what the variable is for, in the error message."""
    try:
        value = int(raw)
    except ValueError:
        raise error(f"{name}={raw!r} is not an integer: {what}") from None
    if value < lo:
        raise error(f"{name}={value} must be >= {lo}: {what}")
    return value


def env_port(name: str, raw: str, *, what: str, error: type[UsageError] = UsageError) -> int:
    """A TCP port number (1-65535)."""
    port = env_int(name, raw, lo=1, what=what, error=error)
    if port > 65535:
        raise error(f"{name}={port} is not a TCP port (1-65535): {what}")
    return port
