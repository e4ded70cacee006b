"""TorchX component: the trainer as one TorchX app, on a laptop, in Docker or on Kubernetes.

    torchx run -s local_cwd trainer/components.py:train --nproc_per_node 2 train.epochs=5
    torchx run -s local_docker trainer/components.py:train --image trainer:cpu --nproc_per_node 2
    torchx run -s kubernetes trainer/components.py:train --nnodes 2 --gpu 8

Every scheduler runs the same per-rank process as the other launchers,
`python -m trainer train --config NAME key=value ...`, under torchrun. The app itself is TorchX's
stock `dist.ddp` (torchrun with a c10d rendezvous on replica 0, `--rdzv_id` = the app id, one
replica per node, resources, mounts). On top of it this adds:

- the trainer's command and config contract, checked here before anything is submitted;
- `run_dir=runs/<app id>` (first, so a `run_dir=` override wins): every job writes its own run
  directory, and a restarted or retried job resumes from its own checkpoints;
- TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (trainer.launch.TORCH_ENV, pytorch#135712);
- torchrun worker-group restarts (dist.ddp 0.7 has none: PET_MAX_RESTARTS, the variable torchrun
  reads as the default of --max-restarts) and, on several nodes, the rendezvous join/read
  timeouts trainer-launch uses (PET_RDZV_CONF), because pods start minutes apart;
- one process per GPU by default, CPUs and memory sized for the GPUs (TorchX's 2 CPUs and
  4 GB would be the whole of an 8-GPU pod, /dev/shm included);
- the runs volume `trainer-runs` (k8s/base/pvc.yaml's claim) at /workspace/runs, so checkpoints
  outlive the pod and a retried job resumes.

/dev/shm is the schedulers' business in TorchX 0.7: `kubernetes` always mounts an
`emptyDir: {medium: Memory}` at /dev/shm (no size limit; it counts against the pod's memory), and
`local_docker` sets the container's shm_size to memMB. `local_cwd` uses the host's.

TorchX reads this file with `exec` (to build `--help` from the docstring), so it imports no torch,
its annotations are `typing` generics TorchX's linter accepts, and its module-level names are few.
"""

import sys
from typing import Any, Dict, List, Optional

try:
    from torchx import specs
    from torchx.components import dist as _torchx_dist
except ImportError:
    raise ImportError(
        "trainer.components needs TorchX: pip install 'repro-trainer[torchx]'"
    ) from None

from trainer.config import DEFAULT_PRESET
from trainer.launch import TORCH_ENV
from trainer.launch.nodeenv import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_MASTER_PORT, DEFAULT_MAX_RESTARTS

DEFAULT_IMAGE = "trainer:cuda"
"""What `make image` builds (IMAGE=trainer, VARIANT=cuda); `trainer:cpu` is `make image VARIANT=cpu`."""

RUNS_DIR = "/workspace/runs"
"""Where the image's jobs write run directories (its WORKDIR is /workspace; run_dir=runs/...)."""
RUNS_VOLUME = "trainer-runs"
"""The claim k8s/base/pvc.yaml creates (ReadWriteMany), mounted at RUNS_DIR by default."""
DEFAULT_CPU, CPU_PER_GPU = 2, 4
DEFAULT_MEM_MB, MEM_MB_PER_GPU = 4096, 16384
"""Per node: enough for the CPU presets, and per GPU for a data loader's workers and /dev/shm
(TorchX's 4 GB default gave an 8-GPU pod 4 GB in all)."""


def train(
    *overrides: str,
    config: str = DEFAULT_PRESET,
    image: str = DEFAULT_IMAGE,
    nnodes: int = 1,
    nproc_per_node: int = 0,
    cpu: int = 0,
    gpu: int = 0,
    memMB: int = 0,
    h: Optional[str] = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    max_retries: int = 0,
    mounts: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
    rdzv_port: int = DEFAULT_MASTER_PORT,
    name: str = "/",
    runs_volume: str = RUNS_VOLUME,
) -> specs.AppDef:
    """Train with the trainer (`python -m trainer train`) under torchrun, on any TorchX scheduler.

    Each of `nnodes` replicas runs torchrun with `nproc_per_node` workers; each worker runs
    `python -m trainer train --config CONFIG run_dir=runs/<app id> OVERRIDES...`, the same process
    command as `make run-local`, compose and Kubernetes manifests. The config and overrides are
    checked before the job is submitted.

    Args:
        overrides: config overrides, key=value (e.g. optim.lr=0.01 train.epochs=5); they come after
            run_dir=runs/<app id>, so run_dir=... here chooses another run directory
        config: a preset name, or a YAML file or run directory as seen from inside the job
        image: container image (local_docker, kubernetes); `make image` builds trainer:cuda and
            `make image VARIANT=cpu` trainer:cpu. local_cwd ignores it and runs this checkout
        nnodes: number of nodes (replicas); more than one uses a c10d rendezvous on replica 0
        nproc_per_node: processes per node; 0: one per GPU (gpu, or h's), else 1
        cpu: CPUs per node; 0: 2, or 4 per GPU
        gpu: GPUs per node (kubernetes: nvidia.com/gpu; local_docker: a GPU device request)
        memMB: memory per node in MB; 0: 4096 plus 16384 per GPU. /dev/shm (a Memory
            emptyDir on kubernetes, shm_size on local_docker) counts against it
        h: a TorchX named resource (e.g. aws_p4d.24xlarge); replaces cpu, gpu and memMB
        max_restarts: torchrun worker-group restarts on each node before the node fails
        max_retries: scheduler-level retries of the whole app (e.g. Volcano job retries)
        mounts: volumes, as type=bind,src=HOST_PATH,dst=PATH or type=volume,src=NAME_OR_CLAIM,dst=PATH
            (e.g. a claim at /workspace/runs keeps run directories beyond the pod)
        env: extra environment variables for every rank (e.g. NCCL_DEBUG=INFO); they win over
            the defaults this component sets
        rdzv_port: rendezvous port on replica 0 (several nodes only)
        name: job name: {experiment}/{run}, {experiment}/, /{run} or {run} (default run: trainer)
        runs_volume: a volume mounted at /workspace/runs so checkpoints outlive the pod and a
            restarted job resumes (kubernetes: this PersistentVolumeClaim, ReadWriteMany, which
            k8s/base/pvc.yaml creates; local_docker: a named volume); "" for none. A --mounts
            entry at /workspace/runs replaces it
    """
    gpus = _gpus_per_node(gpu, h)
    nproc = _procs_per_node(nnodes, nproc_per_node, gpus)
    args = ["train", "--config", config, f"run_dir=runs/{specs.macros.app_id}", *overrides]
    _check_config(config, args[3:], world_size=nnodes * nproc)
    resources = _node_resources(h, cpu, gpu, memMB, gpus)
    limits = {"max_restarts": max_restarts, "max_retries": max_retries, "rdzv_port": rdzv_port}
    role = _role(nnodes, nproc, **limits, env=env, mounts=mounts, runs_volume=runs_volume)
    return _torchx_dist.ddp(*args, m="trainer", image=image, name=name, **resources, **role)


def _gpus_per_node(gpu: int, h: Optional[str]) -> int:
    """--gpu, or the GPUs of the named resource -h (a usage error if TorchX knows no such name)."""
    gpus = gpu
    if h is not None:
        try:
            gpus = specs.resource(h=h).gpu
        except KeyError as e:
            _check(False, f"-h {h}: {e.args[0] if e.args else e}")
    return gpus


def _procs_per_node(nnodes: int, nproc_per_node: int, gpus: int) -> int:
    """--nproc_per_node (0: one per GPU, else 1), checked against the nodes and the GPUs."""
    nproc = nproc_per_node or gpus or 1
    _check(nnodes >= 1, f"--nnodes {nnodes}: use 1 or more nodes")
    _check(nproc >= 1, f"--nproc_per_node {nproc}: use 1 or more processes (0: one per GPU)")
    _check(
        gpus == 0 or nproc <= gpus,
        f"--nproc_per_node {nproc} but {gpus} GPU(s) per node: use at most one process per GPU "
        "(or no GPUs and dist.device=cpu)",
    )
    return nproc


def _node_resources(h: Optional[str], cpu: int, gpu: int, memMB: int, gpus: int) -> Dict[str, Any]:
    """dist.ddp's resource arguments: CPUs and memory sized for the node's GPUs unless given."""
    cpu = cpu or max(DEFAULT_CPU, CPU_PER_GPU * gpus)
    memMB = memMB or DEFAULT_MEM_MB + MEM_MB_PER_GPU * gpus
    _check(cpu >= 1, f"--cpu {cpu}: use 1 or more CPUs per node (0: 2, or 4 per GPU)")
    _check(memMB >= 256, f"--memMB {memMB}: use 256 MB or more (0: 4096 plus 16384 per GPU)")
    return {"h": h, "cpu": cpu, "gpu": gpu, "memMB": memMB}


def _role(
    nnodes: int,
    nproc: int,
    *,
    max_restarts: int,
    max_retries: int,
    rdzv_port: int,
    env: Optional[Dict[str, str]],
    mounts: Optional[List[str]],
    runs_volume: str,
) -> Dict[str, Any]:
    """dist.ddp's arguments for the replicas: their shape, restarts, environment and mounts."""
    role_env = dict(TORCH_ENV)
    role_env["PET_MAX_RESTARTS"] = str(max_restarts)
    if nnodes > 1:
        timeout = DEFAULT_JOIN_TIMEOUT_S
        role_env["PET_RDZV_CONF"] = f"join_timeout={timeout},read_timeout={timeout}"
    role_env.update(env or {})
    # Option tokens, as TorchX splits --mounts: type=..., src=..., dst=...
    mounts = list(mounts or [])
    if runs_volume and RUNS_DIR not in _mount_dsts(mounts):
        mounts += ["type=volume", f"src={runs_volume}", f"dst={RUNS_DIR}"]
    return {
        "j": f"{nnodes}x{nproc}",
        "env": role_env,
        "max_retries": max_retries,
        "rdzv_port": rdzv_port,
        "mounts": mounts,
    }


def _mount_dsts(mounts: List[str]) -> List[str]:
    """The container paths --mounts already uses (TorchX gives its options one per item)."""
    return [
        opt.split("=", 1)[1].rstrip("/")
        for opt in mounts
        if opt.startswith(("dst=", "destination="))
    ]


def _check(ok: bool, message: str) -> None:
    """A usage error: one line and exit code 2, as argparse (and the trainer) do."""
    if not ok:
        print(f"trainer.components: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _check_config(config: str, overrides: List[str], world_size: int) -> None:
    """Load the config here, so a typo fails now rather than in a pod after scheduling.

    TorchX macros (${app_id}, ...) get sample values first. A config file that exists only inside
    the image (or a mount) cannot be read here; the job checks it when it starts. A bare name is
    a preset, checked here like any other.
    """
    import os

    from trainer import config as trainer_config
    from trainer.errors import UsageError

    is_path = os.sep in config or config.endswith((".yaml", ".yml"))
    if is_path and not os.path.exists(config):
        return
    sample = specs.macros.Values(
        img_root="", app_id="app-id", replica_id="0", rank0_env="TORCHX_RANK0_HOST"
    )
    try:
        cfg = trainer_config.load(config, [sample.substitute(o) for o in overrides])
        trainer_config.check_world_size(cfg, world_size)
    except UsageError as e:
        _check(False, str(e))
