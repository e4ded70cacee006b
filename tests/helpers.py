"""Test helpers: tiny plug-in datasets/models, and runners for the real CLI and torchrun."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A small digits MLP: 3 epochs x 23 steps, a loss record per step, a checkpoint every 10 steps
# and at each epoch's end (the digits preset saves every 5 epochs).
# slow_mlp with delay 0 is the plain MLP; tests that need time to act mid-run raise the delay.
REFERENCE = [
    "model.name=tests.helpers:slow_mlp",
    "model.hidden=[32]",
    "train.epochs=3",
    "log.every_steps=1",
    "ckpt.every_steps=10",
    "ckpt.every_epochs=1",
    "ckpt.keep_last=100",
    "log.progress=plain",
]
# A 2-block GPT on the first 40 kB of the standard library: about a second of training.
TINY_GPT = [
    "model.name=gpt",
    "data.name=text",
    "model.gpt.layers=2",
    "model.gpt.width=32",
    "model.gpt.heads=2",
    "data.text.seq_len=32",
    "data.text.max_train_bytes=40000",
    "data.text.max_test_bytes=4000",
    "optim.name=adamw",
    "optim.lr=0.003",
    "train.epochs=100",
    "log.every_steps=1",
    "log.progress=plain",
    "log.tensorboard=false",
    "ckpt.every_epochs=1",
]
BIN = Path(sys.executable).parent
# The 9-sample dataset below and its model; global batch 4 leaves a 1-sample last batch. A
# checkpoint at each epoch's end (3 steps), as tests that stop or kill a run mid-way expect.
TINY = [
    "data.name=tests.helpers:tiny",
    "model.name=tests.helpers:tiny_model",
    "data.global_batch_size=4",
    "ckpt.every_epochs=1",
]


def tiny(cfg, seed):
    """9 training samples: with global batch 4 the last batch holds 1 sample (< 2 or 4 ranks)."""
    import torch

    from trainer.data import ArrayDataset, DataSpec

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(9 + 7, 1, 4, 4, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    return DataSpec(
        train=ArrayDataset(x[:9], y[:9]),
        test=ArrayDataset(x[9:], y[9:]),
        task="classification",
        in_shape=(1, 4, 4),
        num_classes=3,
    )


def tiny_model(num_classes, in_shape, width=8):
    """A plug-in model factory: asks for num_classes and in_shape by name."""
    from torch import nn

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_shape[0] * in_shape[1] * in_shape[2], width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(gpu: bool = False, **extra) -> dict[str, str]:
    """A clean environment: no torchrun variables leak in from the test runner.

    GPUs are hidden unless `gpu`: the CPU tests compare gloo runs of 2-4 ranks, which on a GPU
    machine would otherwise pick CUDA (dist.device=auto) and want one GPU per rank.
    """
    from trainer.ranks import TORCHRUN_VARS

    e = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e["OMP_NUM_THREADS"] = "1"
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    e.update(extra)
    return e


def trainer_argv(*args, nproc: int | None = None, max_restarts: int | None = None) -> list[str]:
    """`python -m trainer ARGS`, or the real torchrun running it on nproc local processes."""
    if nproc is None:
        return [sys.executable, "-m", "trainer", *args]
    torchrun = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts is not None:
        torchrun += [f"--max-restarts={max_restarts}", "--monitor-interval=0.2"]
    return [*torchrun, "-m", "trainer", *args]


def trainer(
    *args,
    nproc: int | None = None,
    timeout: float = 180,
    extra_env=None,
    check=True,
    gpu=False,
    torchrun: bool = True,
    warm: bool = True,
):
    """Run `python -m trainer ...`, or under the real torchrun with nproc processes (or, with
    torchrun=False, nproc processes started here with torchrun's variables: see ranks()).

    One process (nproc None) is forked from the warm server (tests/warm.py: its imports already
    done) where its environment allows (_warm_env); warm=False: a fresh interpreter, for a test
    about the process's own start (its imports, the collector while it imports)."""
    if nproc is not None and not torchrun:
        return ranks(*args, nproc=nproc, timeout=timeout, extra_env=extra_env, check=check)
    cmd = trainer_argv(*args, nproc=nproc)
    if nproc is None and warm and not gpu and _warm_env(extra_env):
        proc = _run_warm(args, [env(**(extra_env or {}))], timeout)
        proc = subprocess.CompletedProcess(cmd, proc[0][0], proc[1][0][0], proc[1][0][1])
    else:
        proc = subprocess.run(
            cmd,
            env=env(gpu, **(extra_env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def ranks(*args, nproc: int, timeout: float = 180, extra_env=None, check=True):
    """`python -m trainer ARGS` on nproc local ranks started directly with the variables
    torchrun --standalone gives its workers (RANK, WORLD_SIZE, MASTER_PORT, ...), for tests about
    the numbers rather than the launcher: no torchrun process (a torch import, ~2 s of CPU) and no
    rendezvous, and each rank forked from the warm server (tests/warm.py) where the environment
    allows. As torchrun does, the first rank to fail stops the others. Returns rank 0's stdout,
    every rank's stderr, and the highest exit code."""

    port = free_port()
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
    common |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra_env or {})}
    cmd = [sys.executable, "-m", "trainer", *args]
    envs = [env(**common, RANK=str(rank), LOCAL_RANK=str(rank)) for rank in range(nproc)]
    try:
        codes, texts = _run_warm(args, envs, timeout, warm=_warm_env(extra_env))
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{' '.join(cmd)} on {nproc} ranks: timed out after {timeout} s"
        ) from None
    code = max((c if c >= 0 else 128 - c for c in codes if c is not None), default=1)
    proc = subprocess.CompletedProcess(cmd, code, texts[0][0], "".join(e for _, e in texts))
    if check and code != 0:
        raise AssertionError(
            f"{' '.join(cmd)} on {nproc} ranks exited {code}\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}"
        )
    return proc


WARM_ENV = ("TRAINER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
WARM_ENV += ("MASTER_ADDR", "MASTER_PORT")
"""Variables a warm process may have beyond env()'s: the run's, which nothing reads while the
interpreter starts or torch loads (OMP_*, TORCH_*, PYTHON*, CUDA_*, ... could differ there)."""


def _warm_env(extra_env) -> bool:
    return WARM_RANKS and all(k.startswith(WARM_ENV) for k in (extra_env or {}))


def _run_warm(args, envs, timeout, warm=True):
    """`python -m trainer ARGS` once per environment in `envs`, all at once: forked from the warm
    server (warm) or fresh interpreters. The first to fail stops the others (killed: code None);
    past `timeout`, all are killed and subprocess.TimeoutExpired raised. -> (codes, [(out, err)])."""
    import tempfile
    import time

    cmd = [sys.executable, "-m", "trainer", *args]
    deadline, procs, killed = time.monotonic() + timeout, [], set()
    if warm:
        from tests import warm as warm_server

        warm = all(warm_server.fits(e) for e in envs)  # else what the server imported under
    with tempfile.TemporaryDirectory(prefix="trainer-") as folder:
        outs = [(f"{folder}/{i}.out", f"{folder}/{i}.err") for i in range(len(envs))]
        for e, (out, err) in zip(envs, outs, strict=True):
            if warm:
                procs.append(_Warm(warm_server.start(args, e, ROOT, out, err)))
                continue
            with open(out, "w") as o, open(err, "w") as r:
                procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=o, stderr=r))
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() for p in procs) or time.monotonic() > deadline:
                    for i, p in enumerate(procs):
                        if p.poll() is None:
                            p.kill()
                            killed.add(i)
                time.sleep(0.02)
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(i)
                p.wait()
        texts = [tuple(Path(f).read_text(errors="replace") for f in pair) for pair in outs]
    if time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(cmd, timeout, texts[0][0], texts[0][1])
    return [None if i in killed else p.returncode for i, p in enumerate(procs)], texts


WARM_RANKS = os.environ.get("TEST_WARM_RANKS", "1") != "0"
"""helpers.ranks forks its ranks from a warm server (tests/warm.py); TEST_WARM_RANKS=0: fresh
interpreters, as before (to compare, or to rule the server out)."""


class _Warm:
    """A warm rank (multiprocessing.Process) with the few Popen methods ranks() uses."""

    def __init__(self, proc):
        self.proc = proc

    def poll(self):
        return self.proc.exitcode

    @property
    def returncode(self):
        return self.proc.exitcode

    def kill(self):
        self.proc.kill()

    def wait(self):
        self.proc.join()
        return self.proc.exitcode


def train_here(command: str, *args: str, config_file: str | None = None) -> dict:
    """`trainer train [--config config_file] ARGS` on one CPU rank in this process with one
    thread, as each rank of the multi-process runs has (the same bits): no second torch import
    (~3 s of CPU a run). Returns the summary."""
    import torch

    from trainer import config
    from trainer.train import train

    assert command == "train", command
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config.load(config_file, [*args, "dist.device=cpu"]))
    finally:
        torch.set_num_threads(threads)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_losses(run_dir) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in read_jsonl(Path(run_dir) / "metrics.jsonl")
        if r["kind"] == "train"
    }


def weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def slow_mlp(in_shape, num_classes, hidden=(32,), dropout=0.0, delay=0.02):
    """The built-in MLP plus a sleep per forward: gives signal/kill tests time to land mid-run."""
    import time

    from trainer.models import mlp

    model = mlp(in_shape, num_classes, hidden=hidden, dropout=dropout)
    model.register_forward_pre_hook(lambda *_: time.sleep(delay) if model.training else None)
    return model


def slow_gpt(in_shape, num_classes, layers=2, width=32, heads=2, dropout=0.0, delay=0.02):
    """The built-in GPT plus a sleep per training forward (see slow_mlp)."""
    import time

    from trainer.gpt import gpt

    model = gpt(in_shape, num_classes, layers=layers, width=width, heads=heads, dropout=dropout)
    model.register_forward_pre_hook(lambda *_: time.sleep(delay) if model.training else None)
    return model


def counting_gpt(in_shape, num_classes, count_dir, layers=2, width=32, heads=2, dropout=0.0):
    """The built-in GPT that appends one byte to count_dir/rank-<r> per block forward with grad.

    The hook sits on each block's attention, which the block's own forward calls: a forward that
    activation checkpointing recomputes in the backward pass counts again (a hook on the block
    itself would not, the recompute calls the wrapped forward directly).
    """
    import torch

    from trainer.gpt import gpt

    model = gpt(in_shape, num_classes, layers=layers, width=width, heads=heads, dropout=dropout)
    path = Path(count_dir) / f"rank-{os.environ.get('RANK', '0')}"

    def count(*_):
        if torch.is_grad_enabled():
            with open(path, "a") as f:
                f.write("x")

    for block in model.blocks:
        block.attn.register_forward_pre_hook(count)
    return model


def wait_for(predicate, timeout: float, what: str, proc=None, interval: float = 0.05):
    """Poll until predicate() is truthy; fail with `what` (and the process's output) on timeout."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(
                f"process exited ({proc.returncode}) while waiting for {what}\n{out[-3000:]}"
            )
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def checkpoints(run_dir) -> list[str]:
    """The run's checkpoint folders, [] before it has one. The checkpointer's start-up probe
    makes ckpt.dir and removes it again (rundir.probe_folder): a poll may find it gone."""
    try:
        names = os.listdir(Path(run_dir) / "checkpoints")
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(name for name in names if name.startswith("step-"))


def alive(pid: int) -> bool:
    """The process exists and is no zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def apt_install(packages: Sequence[str], binaries: Sequence[str], what: str) -> str | None:
    """Install Debian `packages` with apt-get unless every one of `binaries` is on PATH; why not,
    in one line (`what` names them), or None when they are there (tests/slurm.py, tests/etcd.py)."""
    if all(shutil.which(b) for b in binaries):
        return None
    if shutil.which("apt-get") is None:
        return f"needs {' '.join(packages)} ({what}) and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:]
            return f"`{' '.join(cmd)}` failed: {' '.join(tail)}"
    missing = [b for b in binaries if not shutil.which(b)]
    return f"missing after apt-get install: {' '.join(missing)}" if missing else None


def children(pid: int) -> list[int]:
    """Direct child process ids (torchrun's workers), read from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def thread_wakeups(thread) -> int:
    """How often `thread` of this process gave up the CPU so far (a thread asleep in a wait:
    each wake-up is one), from /proc."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return int(next(x for x in f if x.startswith("voluntary_ctxt_switches")).split()[1])


def spawn(*args, nproc: int | None = None, extra_env=None, max_restarts: int = 0):
    """Start the trainer (or torchrun) in the background, output in proc.stdout."""
    cmd = trainer_argv(*args, nproc=nproc, max_restarts=max_restarts)
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen(cmd, env=env(**(extra_env or {})), cwd=ROOT, **out)


def nan_model(num_classes, in_shape):
    """A model whose outputs are NaN: what a diverged run looks like on its first step."""
    import torch

    model = tiny_model(num_classes, in_shape)
    with torch.no_grad():
        model[-1].bias.fill_(float("nan"))
    return model


def shared_run(tmp_path_factory, key: str, make: Callable[[Path], None]) -> Path:
    """The folder of run `key`, made once per session by `make(folder)`: on first use by any
    worker, which holds the run's lock while it trains; the others wait and reuse it. A run
    whose maker failed (or died) is made again by the next test that asks."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder = root / "shared-runs" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.parent.mkdir(exist_ok=True)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if not (folder / ".made").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            (folder / "key.txt").write_text(key)
            make(folder)
            (folder / ".made").touch()
    return folder


def slow_writing_mlp(
    in_shape, num_classes, marker_dir, write_delay=1.0, hidden=(32,), dropout=0.0, delay=0.02
):
    """slow_mlp whose checkpoint writes pause `write_delay` s halfway (model.safetensors written,
    optimizer.pt not yet), after leaving marker_dir/writing-<step> holding the writing thread's
    name: a test can kill the process in the middle of a (background) write."""
    import re
    import threading
    import time

    from trainer.checkpoint import store

    real = store._torch_save

    def halfway(obj, path):
        if path.endswith("optimizer.pt"):
            step = int(re.search(r"step-(\d+)", path).group(1))
            (Path(marker_dir) / f"writing-{step}").write_text(threading.current_thread().name)
            time.sleep(write_delay)
        real(obj, path)

    store._torch_save = halfway
    return slow_mlp(in_shape, num_classes, hidden=hidden, dropout=dropout, delay=delay)
