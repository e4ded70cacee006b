"""An etcd server (Debian's etcd-server, 3.4) in a network-namespace node: the rendezvous an elastic
job keeps outside its training nodes (RDZV_BACKEND=etcd), for tests/test_elastic.py.

Installed with apt when missing (root), as tests/slurm.py does Slurm; v2 API on (torchrun's etcd
rendezvous speaks it), no peers, data in a temp folder, listening on the node's own address only.

    with netns.Network(3) as net, Etcd(net, 2, tmp) as etcd:
        etcd.endpoint                                   # '10.77.0.3:2379'
"""

from __future__ import annotations

import functools
import subprocess
import time
from pathlib import Path

from tests import netns
from tests.helpers import apt_install

PACKAGES = ("etcd-server",)
PORT = 2379


@functools.cache
def unavailable() -> str | None:
    """Why an etcd server cannot be started here (after installing it if it can), or None."""
    if why := netns.unavailable():
        return why
    try:
        import etcd  # noqa: F401  (python-etcd: what torchrun's etcd rendezvous imports)
    except ImportError:
        return "needs python-etcd (make setup installs it from requirements.lock)"
    return apt_install(PACKAGES, ("etcd",), "Debian's etcd server")


class Etcd:
    """etcd in node `i` of `net`; stopped (by its PID) on close()."""

    def __init__(self, net: netns.Network, i: int, folder: Path):
        ip = net.nodes[i].ip
        self.endpoint = f"{ip}:{PORT}"
        self.log = folder / "etcd.log"
        argv = [
            "etcd",
            "--name=rdzv",
            f"--data-dir={folder / 'etcd-data'}",
            "--enable-v2",  # torchrun's etcd rendezvous uses the v2 API
            f"--listen-client-urls=http://{ip}:{PORT}",
            f"--advertise-client-urls=http://{ip}:{PORT}",
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=rdzv=http://127.0.0.1:2380",
        ]
        with open(self.log, "wb") as out:
            self.proc = net.popen(i, argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while b"ready to serve client requests" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"etcd did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
