"""Elastic jobs (NNODES=MIN:MAX) on network-namespace nodes: a node lost, a node back, a node
drained, and the job goes on at each new world size, ending on the one-process run's bits.

Each node is a network namespace with its own IP running `trainer-launch` as a pod's entrypoint
(PID 1 of its own PID namespace: SIGKILL of it is the whole node lost); the rendezvous is an etcd
server in a namespace of its own (tests/etcd.py), as an elastic job keeps it on Kubernetes (its
own Deployment and Service), so that no training node holds it. The run folder is one folder all
nodes see (shared storage). make test-elastic; ~3 min.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests import etcd as etcd_server
from tests import netns
from tests.helpers import (
    ROOT,
    alive,
    checkpoints,
    children,
    env,
    read_jsonl,
    train_here,
    wait_for,
    weights,
)
from trainer.errors import ExitCode

pytestmark = [
    pytest.mark.elastic,
    pytest.mark.netns,
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _etcd_here():
    """Skip, saying why, where no etcd can run; asked at run time, not at collection (it may
    apt-get install etcd-server, which `make test`, deselecting these tests, must not do)."""
    if why := etcd_server.unavailable():
        pytest.skip(why)


LAUNCH = str(ROOT / ".venv" / "bin" / "trainer-launch")
PHASE = 150  # seconds for any one phase to happen

# 90 steps of the digits MLP; 6 shards a global batch: the same bits on 1, 2, 3 and 6 ranks. The
# sleep in each shard's forward ($TEST_STEP_DELAY: paced_mlp) gives the test time to act mid-run;
# it changes no number, and is no config value (a paced run resumes unpaced).
ARGS = [
    "model.name=tests.launch_plugins:paced_mlp",
    "model.hidden=[32]",
    "model.dropout=0.1",
    "data.global_batch_size=48",
    "train.epochs=3",
    "log.every_steps=1",
    "log.progress=plain",
    "ckpt.every_steps=5",
    "ckpt.keep_last=100",
    "repro.world_invariant=true",
    "repro.shards=6",
    "train.clip_grad_norm=0.5",
]


class Node:
    """One node's trainer-launch, with every line it prints timestamped as it arrives."""

    def __init__(self, net: netns.Network, i: int, environ: dict, cwd: Path, args: list[str]):
        self.i = i
        self.lines: list[tuple[float, str]] = []
        self.proc = net.popen(
            i,
            [LAUNCH, *args],
            own_pids=True,
            env=environ,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        for stamp, line in list(self.lines):
            if stamp >= after and re.search(pattern, line):
                return stamp, line
        return None

    def wait(self, timeout: float = PHASE) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=10)
        return rc

    def terminate(self) -> None:
        """SIGTERM to the node's entrypoint, as the kubelet sends it (`unshare` itself, the
        process we started, ignores SIGTERM while it waits for its child)."""
        (entrypoint,) = children(self.proc.pid)
        os.kill(entrypoint, signal.SIGTERM)

    def workers(self) -> list[int]:
        """The node's trainer processes: unshare -> trainer-launch -> torchrun -> workers."""
        level = [self.proc.pid]
        for _ in range(3):
            level = [kid for pid in level for kid in children(pid)]
        return level

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # unshare --kill-child: everything in the node dies with it
        self.wait()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def first(nodes, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
    hits = [hit for node in nodes if (hit := node.first(pattern, after))]
    return min(hits) if hits else None


def resumes(nodes, after: float) -> list[tuple[float, int, str]]:
    """(when, from step, world change) of every resume any node's rank 0 printed since `after`."""
    found = set()
    for node in nodes:
        for stamp, line in list(node.lines):
            m = re.search(r"resumed from .*\(step (\d+),.*world size (\d+ -> \d+)", line)
            if m and stamp >= after:
                found.add((stamp, int(m.group(1)), m.group(2)))
    return sorted(found)


def job_env(etcd, rdzv_id: str, nnodes: str, **extra: str) -> dict[str, str]:
    """Every node's environment: one process each, the rendezvous in `etcd`, paced steps."""
    return env(
        NNODES=nnodes,
        NPROC_PER_NODE="1",
        RDZV_BACKEND="etcd",
        RDZV_ENDPOINT=etcd.endpoint,
        RDZV_ID=rdzv_id,
        TEST_STEP_DELAY="0.08",
        **extra,
    )


def formed(nodes: list[Node], run: Path, world: int, at_least: int = 0) -> None:
    """Wait for the group of `world` nodes, then for a checkpoint it saved (and >= at_least)."""
    wait_for(lambda: first(nodes, rf"world {world} x cpu"), PHASE, f"world {world}", nodes[0].proc)
    at = newest_step(run)
    wait_for(lambda: newest_step(run) >= max(at_least, at + 5), PHASE, f"a checkpoint at {world}")


def newest_step(run: Path) -> int:
    names = checkpoints(run)
    return int(names[-1].removeprefix("step-")) if names else -1


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted one-process run (in this process, no sleep: the same numbers)."""
    folder = tmp_path_factory.mktemp("elastic-reference")
    train_here("train", *ARGS, f"run_dir={folder / 'run'}")
    return {"weights": weights(folder / "run"), "run": folder / "run"}


def test_a_node_lost_back_and_drained_ends_on_the_one_process_bits(tmp_path, reference):
    """3 nodes x 1 process (NNODES=2:3, MAX_RESTARTS=3), etcd's rendezvous in a namespace of its
    own. At step >= 10 node 0 is SIGKILLed whole (it hosted rank 0 and the process group's store):
    the others go on at world 2 from the last checkpoint. Later node 0 starts again and is taken in
    at the next rendezvous (the running ranks save first: nothing is lost). Then node 2 is drained
    with SIGTERM: the group saves, node 2 leaves, the rest go on. The final weights and every
    step's loss equal the one-process run's, bit for bit; the recovery times are printed."""
    run = tmp_path / "run"
    with netns.Network(4) as net, etcd_server.Etcd(net, 3, tmp_path) as etcd:
        environ = job_env(etcd, "elastic-test", "2:3", MAX_RESTARTS="3", RDZV_LAST_CALL_TIMEOUT="5")
        args = [*ARGS, f"run_dir={run}"]
        nodes = [Node(net, i, environ, tmp_path, args) for i in range(3)]
        try:
            # 0. All three in one group (a node that missed the first round's last call is
            # taken in at the next one), and a checkpoint since.
            formed(nodes, run, world=3, at_least=10)
            # 1. A node lost: SIGKILL of node 0, with rank 0 and the process group's store on it.
            saved = newest_step(run)
            survivors = nodes[1].workers()
            assert survivors, "no worker found on node 1"
            lost_at = time.monotonic()
            nodes[0].kill()
            wait_for(lambda: not any(map(alive, survivors)), PHASE, "node 1's worker to fail")
            detected = time.monotonic()
            wait_for(lambda: resumes(nodes, lost_at), PHASE, "a resume at world 2", nodes[1].proc)
            when, step, change = resumes(nodes, lost_at)[0]
            assert (step, change) == (saved, "3 -> 2"), resumes(nodes, 0)
            again = wait_for(
                lambda: first(nodes[1:], rf"^step {step + 1}/", when), PHASE, "a step after it"
            )
            # 2. The node back: taken in at the next rendezvous; the running ranks save first.
            wait_for(lambda: newest_step(run) >= step + 10, PHASE, "10 more steps at world 2")
            back_at = time.monotonic()
            nodes[0] = Node(net, 0, environ, tmp_path, args)
            wait_for(lambda: resumes(nodes, back_at), PHASE, "a resume at 3", nodes[1].proc)
            joined_at, joined_step, change = resumes(nodes, back_at)[0]
            assert change == "2 -> 3", resumes(nodes, 0)
            stop = first(nodes, rf"checkpoint step-0*{joined_step} \(signal SIGTERM", back_at)
            assert stop, "the ranks did not save when the node joined:\n" + nodes[1].text()
            # 3. A node drained (SIGTERM, as kubectl drain or a spot notice): it saves and leaves.
            wait_for(lambda: newest_step(run) >= joined_step + 10, PHASE, "10 steps at world 3")
            drain_at = time.monotonic()
            nodes[2].terminate()
            wait_for(lambda: resumes(nodes, drain_at), PHASE, "a resume after the drain")
            _, drained_step, change = resumes(nodes, drain_at)[0]
            assert change == "3 -> 2", resumes(nodes, 0)
            codes = [node.wait(timeout=PHASE * 2) for node in nodes]
        finally:
            for node in nodes:
                node.kill()
                (tmp_path / f"node{node.i}.log").write_text(node.text())  # kept on a failure
        output = "\n\n".join(f"node {n.i}:\n{n.text()}" for n in nodes)
        assert codes == [ExitCode.OK, ExitCode.OK, ExitCode.PREEMPTED], output
        assert first(nodes, rf"checkpoint step-0*{drained_step} \(signal SIGTERM", drain_at), output
    got = weights(run)
    assert got.keys() == reference["weights"].keys()
    for name, tensor in reference["weights"].items():
        assert torch.equal(got[name], tensor), name
    ref_losses = [(r["step"], r["loss"]) for r in read_jsonl(reference["run"] / "metrics.jsonl")
                  if r["kind"] == "train"]  # fmt: skip
    got_losses = [(r["step"], r["loss"]) for r in read_jsonl(run / "metrics.jsonl")
                  if r["kind"] == "train"]  # fmt: skip
    assert got_losses == ref_losses
    print(
        f"\nelastic: node lost at step >= {saved}: a survivor's rank failed after "
        f"{detected - lost_at:.1f} s, resumed at world 2 after "
        f"{when - lost_at:.1f} s, training again after {again[0] - lost_at:.1f} s "
        f"(steps redone: those after {saved}); node back: resumed at world 3 "
        f"{joined_at - back_at:.1f} s after it started, from step {joined_step} "
        f"(nothing redone); drained at step {drained_step} (nothing redone)"
    )


def test_a_silent_node_is_dropped_after_the_timeout_and_past_the_budget_the_job_stops(
    tmp_path, reference
):
    """2 nodes x 1 process (NNODES=1:2, MAX_RESTARTS=1, dist.timeout_s=10). Node 1's link goes
    down (no reset reaches node 0: its collective waits): node 0's rank gives up after the
    timeout and node 0 goes on alone from the last checkpoint. Node 1 comes back and is taken in.
    Then node 1 is lost again: the restart budget is spent, so node 0 ends with exit 4 in one
    line, and the newest checkpoint, resumed by one process, still ends on the reference bits."""
    run = tmp_path / "run"
    with netns.Network(3) as net, etcd_server.Etcd(net, 2, tmp_path) as etcd:
        environ = job_env(
            etcd,
            "elastic-budget",
            "1:2",
            MAX_RESTARTS="1",
            RDZV_LAST_CALL_TIMEOUT="3",
            TRAIN_ARGS="dist.timeout_s=10",
        )
        args = [*ARGS, f"run_dir={run}"]
        nodes = [Node(net, i, environ, tmp_path, args) for i in range(2)]
        try:
            formed(nodes, run, world=2)
            # 1. Node 1 goes silent: its link down, its processes still running.
            survivors = nodes[0].workers()
            cut_at = time.monotonic()
            subprocess.run(
                ["ip", "-n", net.nodes[1].namespace, "link", "set", "eth0", "down"], check=True
            )
            wait_for(lambda: not any(map(alive, survivors)), PHASE, "node 0's rank to give up")
            gave_up = time.monotonic() - cut_at
            # About dist.timeout_s=10 after its last collective began (just before the cut, or
            # up to a step before it: 8.98 s once), not at once (no reset reached it), nor never.
            assert 5 <= gave_up <= 40, gave_up
            wait_for(lambda: resumes(nodes, cut_at), PHASE, "a resume at world 1", nodes[0].proc)
            _, _, change = resumes(nodes, cut_at)[0]
            assert change == "2 -> 1", resumes(nodes, 0)
            # 2. Node 1 back (restarted, its link up again): taken in, no restart used.
            nodes[1].kill()
            subprocess.run(
                ["ip", "-n", net.nodes[1].namespace, "link", "set", "eth0", "up"], check=True
            )
            back_at = time.monotonic()
            nodes[1] = Node(net, 1, environ, tmp_path, args)
            wait_for(lambda: resumes(nodes, back_at), PHASE, "a resume at world 2", nodes[0].proc)
            assert resumes(nodes, back_at)[0][2] == "1 -> 2", resumes(nodes, 0)
            # 3. Node 1 lost again: node 0's one restart is spent, so it stops.
            wait_for(
                lambda: newest_step(run) >= resumes(nodes, back_at)[0][1] + 5, PHASE, "5 steps"
            )
            nodes[1].kill()
            code = nodes[0].wait()
        finally:
            for node in nodes:
                node.kill()
                (tmp_path / f"budget-node{node.i}.log").write_text(node.text())
        out = nodes[0].text()
        assert code == ExitCode.RETRYABLE, out
        assert out.splitlines()[-1].startswith("trainer: error: "), out
        assert "Traceback" not in out, out
    # The newest checkpoint is whole: one process resumes it and ends on the reference bits.
    train_here("train", *ARGS, "dist.timeout_s=10", f"run_dir={run}")
    got = weights(run)
    for name, tensor in reference["weights"].items():
        assert torch.equal(got[name], tensor), name
    print(f"\nelastic: a silent node (link down) was given up on after {gave_up:.1f} s")
