"""Reproducibility: deterministic settings, per-rank RNG streams, and what a run records."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess

import numpy as np
import torch

from trainer.config import ReproConfig


@contextlib.contextmanager
def process_settings(cfg: ReproConfig, device: str):
    """repro.* for one run (deterministic kernels, the thread count), and on leaving the block
    every process-wide setting the run touches as it was: those two, and the RNG states the run
    seeds (torch, CUDA, numpy, random). So two runs in one process (trainer.fit twice, tests)
    start alike, and the caller's process is as it left it."""
    cudnn = torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
        torch.get_num_threads(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        np.random.get_state(),
        random.getstate(),
    )
    configure(cfg)
    pin_threads(cfg, device)
    try:
        yield
    finally:
        determinism, warn_only, cudnn.deterministic, cudnn.benchmark, threads = saved[:5]
        torch.use_deterministic_algorithms(determinism, warn_only=warn_only)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_rng_state(saved[5])
        if saved[6] is not None:
            torch.cuda.set_rng_state_all(saved[6])
        np.random.set_state(saved[7])
        random.setstate(saved[8])


def configure(cfg: ReproConfig) -> None:
    """Apply repro.deterministic before any CUDA work."""
    if not cfg.deterministic:
        return
    # cuBLAS needs a fixed workspace for deterministic GEMMs; it must be set before CUDA init.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def pin_threads(cfg: ReproConfig, device: str) -> int | None:
    """Under repro.world_invariant on the CPU, one intra-op thread: a CPU kernel's reductions
    split over threads, so the bits depended on OMP_NUM_THREADS (world 1 with its 2 default
    threads and world 2 under torchrun, 1 each, differed from step 7 of the default config).
    Returns the thread count it replaced (to restore), or None when it changed nothing."""
    if not cfg.world_invariant or not device.startswith("cpu") or torch.get_num_threads() == 1:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


def kernel_set(device: str) -> dict:
    """What, besides the config and the data, decides the bits of a world_invariant run: the
    kind of device, its kernels and the thread count (recorded in run.json and checkpoints)."""
    out = {"device": device.split(":")[0], "torch": torch.__version__}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
        out["cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version()
    else:
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["threads"] = torch.get_num_threads()
    return out


def seed_rank(seed: int, rank: int) -> None:
    """Give each rank its own RNG stream (dropout etc.), fixed by (seed, rank).

    Called after model init, which uses torch.manual_seed(seed) on every rank so all ranks
    (and all world sizes) start from identical weights.
    """
    entropy = np.random.SeedSequence([seed, rank, 0x7EED]).generate_state(2)
    derived = int(entropy[0]) << 32 | int(entropy[1])
    torch.manual_seed(derived)
    np.random.seed(derived % 2**32)
    random.seed(derived)


def rng_state(device: str) -> dict:
    """This process's RNG states as plain tensors/numbers (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": list(random.getstate()[1]),
    }
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def set_rng_state(state: dict, device: str) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    random.setstate((3, tuple(state["python"]), None))
    if device.startswith("cuda") and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], torch.device(device))


def git_commit() -> dict | None:
    """The commit of the code being run: $TRAINER_GIT_COMMIT (set in images), else git."""
    if os.environ.get("TRAINER_GIT_COMMIT"):
        return {"commit": os.environ["TRAINER_GIT_COMMIT"], "dirty": None}
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now (/proc; the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def hostname() -> str:
    return socket.gethostname()
