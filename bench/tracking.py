"""What experiment tracking costs a run: the digits MLP on one CPU process with MLflow off and on,
against a live `mlflow server` (SQLite, on 127.0.0.1) that this script starts, rows round-robin
as bench.py runs them. A train record every 10 steps: 60 records a run go to the server.

    python bench/tracking.py [--reps 5] [--quick]     -> bench/results/tracking-cpu.json

The server runs from tests/test_tracking.py's venv (.venv/mlflow-server, built from
tests/mlflow-server.txt on the tests' first use); the trainer needs no package for it. Its own
module, not a suite of bench.py: it registers a suite there for the run and changes nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import bench

SERVER_PYTHON = bench.ROOT / ".venv" / "mlflow-server" / "bin" / "python"
BASE = [
    a if a != "log.every_steps=50" else "log.every_steps=10"
    for a in bench.CPU_BASE  # the digits MLP, 600 steps, device-resident data
]


def rows(uri: str) -> list[bench.Row]:
    group = "digits MLP, 1 process, a record every 10 steps"
    return [
        bench.Row("tracking off", "trainer", tuple(BASE), group=group),
        bench.Row(
            "MLflow on (live server)", "trainer", (*BASE, f"log.mlflow.uri={uri}"), group=group
        ),
    ]


RATIOS = [("MLflow on / off", "MLflow on (live server)", "tracking off", 0.99)]


def serve(folder: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:port, up (its /health answers) when this returns."""
    if not SERVER_PYTHON.exists():
        raise SystemExit(
            f"no {SERVER_PYTHON}: run the tests once (pytest tests/test_tracking.py -m slow), "
            "which build it from tests/mlflow-server.txt"
        )
    cmd = [str(SERVER_PYTHON), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"]
    cmd += ["--artifacts-destination", str(folder / "artifacts")]
    log = open(folder / "server.log", "w")  # noqa: SIM115 (the server's own)
    # A session of its own: uvicorn and the job workers it starts are killed with it (stop).
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=folder, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                stop(proc)
                raise SystemExit(
                    f"mlflow server exited {proc.returncode}: {folder}/server.log"
                ) from None
            time.sleep(0.5)
    stop(proc)
    raise SystemExit("mlflow server did not answer in 300 s")


def stop(proc: subprocess.Popen) -> None:
    """SIGKILL to the server and every process it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(bench.ROOT / "bench" / "results"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--note")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        server = serve(Path(folder), port)
        try:
            uri = f"http://127.0.0.1:{port}"
            bench.SUITES["tracking"] = (lambda: rows(uri), RATIOS, BASE)
            report = bench.run_suite(
                "tracking", Path(args.out), args.reps, args.quick, note=args.note
            )
        finally:
            stop(server)
    print(report["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
