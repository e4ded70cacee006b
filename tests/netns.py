"""Linux network namespaces as "nodes": each its own IP and eth0, on a private switched network.

For multi-node tests without a cluster: every node sees an `eth0` with an address on 10.77.0.0/24,
the nodes reach each other through a bridge that lives in a namespace of its own (the host's
network is not touched: traffic stays on loopback and these veths), and names given in `hosts`
resolve inside every node (iproute2 bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for
commands it runs with `ip netns exec`). Needs root and iproute2: check `unavailable()` first.

    with Network(2, hosts={"node0": 0}) as net:
        proc = net.popen(1, ["python", "-c", "..."], env=env)   # runs in node 1
        pod = net.popen(0, ["trainer-launch"], own_pids=True)    # proc.kill(): all of it dies
        net.nodes[0].ip                                           # '10.77.0.1'
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SUBNET = "10.77.0"
_counter = itertools.count()


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (`ip`)"
    probe = f"trprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Node:
    namespace: str
    ip: str
    ifname: str = "eth0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """`n` namespaces ("nodes") on one switched /24. Always close() it (or use `with`)."""

    def __init__(self, n: int, *, hosts: Mapping[str, int] | None = None):
        if not 1 <= n <= 250:
            raise ValueError("1 to 250 nodes")
        prefix = f"tr{os.getpid()}x{next(_counter)}"  # unique per process and per network
        self.switch = f"{prefix}-sw"
        self.nodes = [Node(f"{prefix}-n{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        self._made: list[str] = []
        try:
            self._build(hosts or {})
        except BaseException:
            self.close()
            raise

    def _build(self, hosts: Mapping[str, int]) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{self.nodes[i].ip} {name}" for name, i in hosts.items()]
        for i, node in enumerate(self.nodes):
            _ip("netns", "add", node.namespace)
            self._made.append(node.namespace)
            # One veth pair per node: `eth0` inside the node, port p<i> on the switch's bridge.
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                f"p{i}",
                "type",
                "veth",
                "peer",
                "name",
                node.ifname,
                "netns",
                node.namespace,
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.ip}/24", "dev", node.ifname)
            _ip("-n", node.namespace, "link", "set", node.ifname, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            folder = f"/etc/netns/{node.namespace}"
            os.makedirs(folder, exist_ok=True)
            with open(f"{folder}/hosts", "w", encoding="ascii") as f:
                f.write("\n".join(lines) + "\n")

    def command(self, i: int, argv: Sequence[str], *, own_pids: bool = False) -> list[str]:
        """argv, run inside node i. own_pids: as PID 1 of a PID namespace of its own, like a
        container's entrypoint, under `unshare --kill-child` (util-linux): SIGKILL that process
        and every process started inside dies with it, as when a pod is lost."""
        if own_pids:
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--", *argv]
        return ["ip", "netns", "exec", self.nodes[i].namespace, *argv]

    def popen(
        self, i: int, argv: Sequence[str], own_pids: bool = False, **kwargs
    ) -> subprocess.Popen:
        # `ip netns exec` execs argv after setns(): the Popen's pid is argv's own process (or,
        # with own_pids, `unshare`'s, which exits with argv's code).
        return subprocess.Popen(self.command(i, argv, own_pids=own_pids), **kwargs)

    def run(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(i, argv), **kwargs)

    def close(self) -> None:
        """Delete the namespaces (their veths go with them) and their hosts files."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made.clear()
        with contextlib.suppress(OSError):
            os.rmdir("/etc/netns")  # only if no one else's namespaces live there

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
