"""Warm ranks for helpers.ranks: `python -m trainer ARGS` forked from a process that has already
imported torch, torch._dynamo and the trainer, instead of a fresh interpreter importing them again.

Each rank of a multi-process run costs ~7 s of CPU before it trains, ~6 s of it importing torch and
torch._dynamo (what every optimizer step imports); on 2 cores the suite's dozens of 2- to 8-rank
runs spent minutes on those imports alone. The ranks here are still one process each, with their
own environment (RANK, WORLD_SIZE, MASTER_PORT, ...), working directory, stdout/stderr files, gloo
group and exit code: only the imports happened before the fork. So only tests about the numbers,
which already start their ranks without torchrun (helpers.ranks), use them.

The server is multiprocessing's forkserver, started once per test process with helpers.env()'s
environment (OMP_NUM_THREADS=1 and no GPU, which torch and libgomp read as they load) and this
module preloaded; it is single-threaded when it forks (nothing it imports starts a thread).
A rank whose environment differs in anything read at import time is started the plain way
(helpers.ranks decides: warm only for the default environment plus run variables).
"""

from __future__ import annotations

import os
import sys

# What the server imports once (preloading this module): the heavy part of every rank's start.
import torch
import torch._dynamo  # what every optimizer step imports
import torch.distributed  # noqa: F401

import trainer.cli
import trainer.train

_CONTEXT = None
_SERVER: dict[str, str] | None = None  # the server's environment, less the run's variables
_PATH: list[str] = []  # sys.path of a fresh `python -m trainer`, after its working directory
MAIN = os.path.join(os.path.dirname(os.path.abspath(trainer.cli.__file__)), "__main__.py")


def _base(environ: dict[str, str]) -> dict[str, str]:
    from tests.helpers import WARM_ENV

    return {k: v for k, v in environ.items() if not k.startswith((*WARM_ENV, "PYTEST_"))}


def fits(environ: dict[str, str]) -> bool:
    """Whether a process with `environ` may be forked from the server: the same environment as
    the server's (started by the first caller) but for the run's variables (helpers.WARM_ENV)."""
    return _SERVER is None or _base(environ) == _SERVER


def context(environ: dict[str, str]):
    """The forkserver context, its server started (once per process) with `environ`."""
    global _CONTEXT, _SERVER
    if _CONTEXT is None:
        import json
        import multiprocessing as mp
        import subprocess
        from multiprocessing import forkserver

        probe = "import json, sys; print(json.dumps(sys.path[1:]))"
        path = subprocess.run(
            [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=True
        )
        _PATH[:] = json.loads(path.stdout)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(environ)  # the server imports torch under the ranks' environment
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _CONTEXT, _SERVER = ctx, _base(environ)
    return _CONTEXT


def start(args, environ: dict[str, str], cwd, out: str, err: str):
    """One process: `python -m trainer ARGS` forked from the server, stdout/stderr into the
    files (a multiprocessing.Process: pid, exitcode, kill, join)."""
    ctx = context(environ)
    argv = [os.fsdecode(a) for a in args]  # as subprocess passes them: str, bytes or PathLike
    proc = ctx.Process(target=_rank, args=(argv, environ, str(cwd), out, err, list(_PATH)))
    proc.start()
    return proc


def _rank(args, environ, cwd, out, err, path) -> None:
    """In the child: what `python -m trainer ARGS` does once its imports are done."""
    import atexit
    import threading
    import traceback

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [MAIN, *args]
    sys.path[:] = [cwd, *path]  # as `python -m` has it: the working directory first
    from trainer.cli import entry

    try:
        code = entry()
    except SystemExit as e:  # argparse, or a raise SystemExit in the run: as the interpreter does
        code = e.code if isinstance(e.code, int) or e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # a bug: the traceback the interpreter would print
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's exit: wait for non-daemon threads, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
