"""A real Slurm cluster on this machine: munged, slurmctld and one slurmd per "node", each node a
Linux network namespace with its own address (tests/netns.py), all private to one test run.

    with Cluster(tmp, nodes=2) as c:
        c.sbatch(["slurm/train.sbatch", "train.epochs=2"], env=...)   # -> job id
        c.wait(job_id)                                                  # -> final state
        c.run(["scontrol", "show", "job", job_id])                      # any client command

Debian's packages (slurmctld slurmd slurm-client munge; Slurm 22.05) are installed with apt when
missing (root only, as CI does for docker.io); without root, namespaces or packages, `unavailable()`
says why in one line and the tests skip. Everything lives under the test's temporary folder: its
own munge key and socket, slurm.conf (SLURM_CONF), state and logs; the daemons are this process's
children, stopped by PID. slurmd runs under `nsenter --net` (not `ip netns exec`, which remounts
/sys and fails slurmd's cgroup check). Jobs run as root, with task/none and proctrack/linuxproc:
a signal to a step reaches every process in it, as with proctrack/cgroup on a real cluster.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests import netns
from tests.helpers import apt_install

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "nsenter")


@functools.cache
def unavailable() -> str | None:
    """Why a cluster cannot be started here (None: it can), installing the packages if needed."""
    if reason := netns.unavailable():
        return reason
    return apt_install(PACKAGES, BINARIES, "Slurm and munge")


CONF = """\
ClusterName=trtest
SlurmctldHost={host}({ctl_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=15
MinJobAge=600
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """`nodes` Slurm nodes n0, n1, ... (2 CPUs each), slurmctld beside slurmd on n0."""

    def __init__(self, tmp: Path, nodes: int = 2):
        self.dir = Path(tmp)
        self.net = netns.Network(nodes)
        self.procs: list[subprocess.Popen] = []
        self.names = [f"n{i}" for i in range(nodes)]
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def env(self) -> dict[str, str]:
        """What a client command needs: this cluster's slurm.conf."""
        return {"SLURM_CONF": str(self.dir / "slurm.conf")}

    def _start(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self._daemon(
            None,
            [
                "munged",
                "-F",
                "-f",
                f"--socket={d}/munge.sock",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log",
                f"--seed-file={d}/munged.seed",
            ],
            "munged",
        )
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={node.ip} CPUs=2 State=UNKNOWN"
            for name, node in zip(self.names, self.net.nodes, strict=True)
        )
        (d / "slurm.conf").write_text(
            CONF.format(
                host=socket.gethostname(),
                ctl_ip=self.net.nodes[0].ip,
                dir=d,
                nodes=nodes,
                names=",".join(self.names),
            )
        )
        self._wait_for(lambda: (d / "munge.sock").exists(), "munged's socket")
        self._daemon(0, ["slurmctld", "-D", "-i"], "slurmctld")
        # Each node is a host of its own, as on a real cluster: its slurmd (and so each job step
        # there) runs with the node's name as hostname (a UTS namespace) and a hosts file where
        # every node's name resolves (bind-mounted in a private mount namespace).
        hosts = d / "hosts"
        hosts.write_text(
            "127.0.0.1 localhost\n"
            + "".join(
                f"{n.ip} {name}\n" for name, n in zip(self.names, self.net.nodes, strict=True)
            )
        )
        for i, name in enumerate(self.names):
            slurmd = (
                f"hostname {name} && mount --bind {hosts} /etc/hosts && exec slurmd -D -N {name}"
            )
            argv = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", slurmd]
            self._daemon(i, argv, f"slurmd-{name}")
        self._wait_for(self._all_idle, "every node idle in sinfo", timeout=60)

    def _daemon(self, node: int | None, argv: list[str], log: str) -> None:
        cmd = argv if node is None else self.command(node, argv)
        with open(self.dir / f"{log}.out", "wb") as out:
            proc = subprocess.Popen(
                cmd, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)

    def _all_idle(self) -> bool:
        p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.names)

    def _wait_for(self, ok, what: str, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while not ok():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[-1]} exited {p.returncode}: {self._logs()}")
            if time.monotonic() > end:
                raise RuntimeError(f"no {what} after {timeout} s: {self._logs()}")
            time.sleep(0.2)

    def _logs(self) -> str:
        out = []
        for f in sorted(self.dir.glob("*.out")) + sorted(self.dir.glob("*.log")):
            out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-1500:])
        return "\n".join(out)

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/var/run/netns/{self.net.nodes[node].namespace}", *argv]

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check=True, **kw
    ) -> subprocess.CompletedProcess:
        """A client command (sbatch, squeue, scontrol, ...) on n0, where slurmctld listens."""
        full = {**(env or os.environ), **self.env}
        p = subprocess.run(
            self.command(0, argv), env=full, capture_output=True, text=True, timeout=120, **kw
        )
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
        return p

    def sbatch(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> str:
        p = self.run(["sbatch", "--parsable", *argv], env=env, cwd=cwd)
        return p.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        fields = {}
        for item in out.split():
            key, eq, value = item.partition("=")
            if eq:
                fields.setdefault(key, value)
        return fields

    def wait(self, job_id: str, timeout: float = 240, until=("COMPLETED", "FAILED", "CANCELLED")):
        """Wait for the job to reach one of the states `until` (default: an end state)."""
        end = time.monotonic() + timeout
        while True:
            state = self.job(job_id).get("JobState", "")
            if state in until:
                return state
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                raise AssertionError(f"job {job_id} ended {state}, waiting for {until}")
            if time.monotonic() > end:
                raise AssertionError(f"job {job_id} still {state} after {timeout} s")
            time.sleep(0.5)

    def cancel_all(self) -> None:
        """Cancel every job and wait for their processes to end (KillWait, then SIGKILL)."""
        subprocess.run(
            self.command(0, ["scancel", "--full", "--user=root"]),
            env={**os.environ, **self.env},
            capture_output=True,
            timeout=60,
        )
        end = time.monotonic() + 40
        while time.monotonic() < end and self._ours(jobs_only=True):
            time.sleep(0.5)

    def close(self) -> None:
        """Cancel what still runs, stop the daemons (by PID), delete the namespaces."""
        if self.procs:
            self.cancel_all()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        for pid in self._ours():  # slurmstepd and what it ran, left after the daemons stopped
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.net.close()

    def _ours(self, jobs_only: bool = False) -> list[int]:
        """PIDs of processes with this cluster's SLURM_CONF that are not its daemons (the steps'
        slurmstepd and their tasks; jobs_only: the tasks, which carry SLURM_JOB_ID)."""
        mark = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        daemons = {p.pid for p in self.procs}
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in daemons and int(entry) != os.getpid():
                try:
                    environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if mark in environ and (
                    not jobs_only or any(v.startswith(b"SLURM_JOB_ID=") for v in environ)
                ):
                    found.append(int(entry))
        return found

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tests.slurm [FOLDER]`: a two-node cluster to try docs/slurm.md on, until Ctrl-C."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m tests.slurm", description=main.__doc__)
    parser.add_argument("folder", nargs="?", help="its files (default: a new temp folder)")
    parser.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args(argv)
    if reason := unavailable():
        print(f"tests.slurm: cannot start a cluster here: {reason}")
        return 2
    folder = Path(args.folder or tempfile.mkdtemp(prefix="slurm-"))
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with Cluster(folder, nodes=args.nodes) as c:
        nodes = ", ".join(f"{n} {node.ip}" for n, node in zip(c.names, c.net.nodes, strict=True))
        print(
            f"Slurm cluster up: {nodes}. In another terminal (as root), a shell on n0:\n"
            f"  export SLURM_CONF={c.env['SLURM_CONF']}\n"
            f"  nsenter --net=/var/run/netns/{c.net.nodes[0].namespace} bash\n"
            "Ctrl-C here cancels every job and stops the cluster.",
            flush=True,
        )
        try:
            while not stop:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
