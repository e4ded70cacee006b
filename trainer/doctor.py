"""`trainer doctor`: the environment problems that otherwise surface hours into a run.

Each check returns (level, name, detail); level is ok | warn | fail. Exit code 2 if any fails.
"""

from __future__ import annotations

import os
import resource
import shutil
from collections.abc import Callable, Mapping

from trainer import rundir

GIB = 2**30
SHM_MIN = 1 * GIB

Check = tuple[str, str, str]


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError:
        return (
            "warn",
            "/dev/shm",
            f"{path} is missing: DataLoader workers and NCCL need shared memory",
        )
    size = st.f_frsize * st.f_blocks
    detail = f"{size / GIB:.2f} GiB"
    if size < SHM_MIN:
        return (
            "warn",
            "/dev/shm",
            f"{detail} (< 1 GiB: DataLoader workers and NCCL can fail with "
            "'bus error'; docker: --shm-size=8g, compose: shm_size, k8s: an emptyDir medium Memory)",
        )
    return ("ok", "/dev/shm", detail)


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def check_ulimits(gpus: int) -> list[Check]:
    out = []
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if gpus and soft != resource.RLIM_INFINITY:
        out.append(
            (
                "warn",
                "ulimit memlock",
                f"{_limit(soft)} bytes: NCCL/RDMA want unlimited "
                "(docker: --ulimit memlock=-1, compose: ulimits.memlock: -1)",
            )
        )
    else:
        out.append(("ok", "ulimit memlock", _limit(soft)))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    level = "warn" if soft != resource.RLIM_INFINITY and soft < 4096 else "ok"
    out.append(
        (
            level,
            "ulimit nofile",
            _limit(soft) + (" (< 4096: many workers/ranks run out)" if level == "warn" else ""),
        )
    )
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    out.append(("ok", "ulimit stack", _limit(soft)))
    return out


def check_gpus(environ: Mapping[str, str]) -> tuple[int, list[Check]]:
    import torch
    import torch.distributed as dist

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) if gpus else "none"
    out = [
        (
            "ok",
            "GPUs",
            f"{gpus} visible ({names}); CUDA_VISIBLE_DEVICES={visible!r}; torch built with CUDA {torch.version.cuda}",
        )
    ]
    if visible is not None and visible.strip() != "" and gpus == 0:
        out.append(
            (
                "warn",
                "GPUs",
                f"CUDA_VISIBLE_DEVICES={visible!r} but torch sees no GPU (driver? container toolkit?)",
            )
        )
    out.append(
        (
            "ok" if dist.is_gloo_available() else "fail",
            "gloo",
            "available" if dist.is_gloo_available() else "missing",
        )
    )
    if gpus:
        nccl = dist.is_nccl_available()
        version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else ""
        out.append(
            (
                "ok" if nccl else "fail",
                "nccl",
                f"available {version}" if nccl else "missing: GPU jobs cannot use nccl",
            )
        )
    else:
        out.append(("ok", "nccl", "not needed (no GPU)"))
    return gpus, out


def check_env(environ: Mapping[str, str], gpus: int) -> list[Check]:
    from trainer.errors import UsageError
    from trainer.ranks import choose_device, from_env

    try:
        world = choose_device(
            from_env(environ), "auto", "auto", gpus, environ.get("CUDA_VISIBLE_DEVICES")
        )
    except UsageError as e:
        return [("fail", "torchrun env", str(e))]
    out = [
        (
            "ok",
            "torchrun env",
            f"rank {world.rank}/{world.size}, local rank {world.local_rank}/{world.local_size}",
        )
    ]
    if (
        int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
        and environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
    ):
        out.append(
            (
                "warn",
                "restarts",
                "--max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 can hang (pytorch#135712); use trainer-launch",
            )
        )
    return out


def check_config(load: Callable) -> tuple[object | None, list[Check]]:
    from trainer.errors import UsageError

    try:
        cfg = load()
    except UsageError as e:
        return None, [("fail", "config", str(e))]
    return cfg, [("ok", "config", f"{cfg.name}: data {cfg.data.name}, model {cfg.model.name}")]


def check_data(cfg) -> Check:
    from trainer import data
    from trainer.errors import UsageError

    try:
        spec = data.build(cfg.data, cfg.seed)
    except UsageError as e:
        return ("fail", "data", str(e))
    return (
        "ok",
        "data",
        f"{cfg.data.name}: {len(spec.train)} train / {len(spec.test)} test samples",
    )


def check_run_dir(run_dir: str) -> Check:
    target = os.path.abspath(run_dir)
    probe = target
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        return (
            "fail",
            "run_dir",
            f"{target}: {probe} is not writable (mount a writable volume for runs)",
        )
    free = shutil.disk_usage(probe).free
    level = "warn" if free < GIB else "ok"
    return (level, "run_dir", f"{target} writable, {free / GIB:.1f} GiB free")


def run(load: Callable, environ: Mapping[str, str] | None = None) -> list[Check]:
    environ = os.environ if environ is None else environ
    gpus, checks = check_gpus(environ)
    checks += [check_shm(), *check_ulimits(gpus), *check_env(environ, gpus)]
    cfg, config_checks = check_config(load)
    checks += config_checks
    if cfg is not None:
        # No run_dir: each run gets a new folder under runs/<name>/ (trainer.rundir).
        checks += [check_data(cfg), check_run_dir(cfg.run_dir or rundir.runs_of(cfg.name))]
    return checks


def render(checks: list[Check]) -> str:
    return "\n".join(f"{level.upper():4}  {name:15} {detail}" for level, name, detail in checks)
