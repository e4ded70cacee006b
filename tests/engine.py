"""A real Docker engine for the image tests, and what a build needs without any registry.

`Engine.start()`: the engine at $TRAINER_TEST_DOCKER_HOST if that is set, else a private dockerd
this process starts (installing Debian's docker.io with apt if needed: root only) and stops by its
PID. The private one keeps everything under build/image-test/ (its data-root: images, volumes,
build cache) and a short-lived /tmp folder (socket, exec-root); it pins its bridge and address
pool to BRIDGE/POOL and leaves the host's firewall and IP forwarding alone (--iptables=false
--ip-forward=false): containers reach each other and published ports on 127.0.0.1, nothing else.

`debian_base()`: a python3 base image from `debootstrap --variant=minbase` and `docker import`.
`Wheelhouse`: the lock's wheels (`pip download` with this machine's pip settings), served on
127.0.0.1 to a build on the host network, with a pip.conf to hand the build as a secret.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from tests.helpers import ROOT

WORK = ROOT / "build" / "image-test"
"""The private engine's data-root, the base image's tarball and the wheelhouse (git-ignored)."""
POOL = "10.213.0.0/16"
BRIDGE = "10.213.0.1/24"
"""docker0 and every network the engine makes come from this one private range."""
DEBIAN_MIRROR = os.environ.get("TRAINER_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DISK_NEEDED = 12e9
"""Free bytes a private engine's build needs under WORK: measured 10 GB at its peak (pip's copy of
the wheels inside the build, the venv layer, the base image), 3 GB more when the wheelhouse cannot
be hard-linked from the local index."""


class Unavailable(Exception):
    """No engine can be had here: the tests skip with this one line."""


def _run(cmd, *, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )


def _tail(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def _apt_install(*packages: str) -> None:
    if shutil.which("apt-get") is None:
        raise Unavailable(f"needs {', '.join(packages)} and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        p = _run(cmd, env=env, timeout=900)
        if p.returncode != 0:
            raise Unavailable(f"`{' '.join(cmd)}` failed: {_tail(p.stderr or p.stdout, 1)}")


class Engine:
    """One Docker engine and the client that matches it."""

    def __init__(self, host: str, docker: str, proc: subprocess.Popen | None = None, **owned):
        self.host = host
        self.docker_bin = docker
        self.proc = proc
        """The dockerd this process started (None: someone else's engine)."""
        self.owned = owned
        self.env = {**os.environ, "DOCKER_HOST": host, "DOCKER_BUILDKIT": "1"}

    @classmethod
    def start(cls) -> Engine:
        if external := os.environ.get("TRAINER_TEST_DOCKER_HOST"):
            engine = cls(external, _client())
            if reason := engine.unreachable():
                raise Unavailable(f"TRAINER_TEST_DOCKER_HOST={external}: {reason}")
            return engine
        if sys.platform != "linux" or os.geteuid() != 0:
            raise Unavailable("starting a Docker engine needs root on Linux")
        if shutil.which("dockerd") is None:
            _apt_install("docker.io")
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise Unavailable("no dockerd after installing docker.io")
        WORK.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(WORK).free  # a kept WORK (TRAINER_IMAGE_TEST_KEEP) earns no credit
        if free < DISK_NEEDED:
            raise Unavailable(
                f"the image build needs about {DISK_NEEDED / 1e9:.0f} GB of free disk under "
                f"{WORK}, there are {free / 1e9:.1f} GB: free some (a kept {WORK.name}/ too) and "
                "run `make test-image` again"
            )
        docker = _client()
        bridge_existed = Path("/sys/class/net/docker0").exists()
        run = Path(tempfile.mkdtemp(prefix="trn-dockerd-"))  # short: unix socket paths
        data = WORK / "docker"
        data.mkdir(parents=True, exist_ok=True)
        log = open(run / "dockerd.log", "w")  # noqa: SIM115
        cmd = [
            dockerd,
            f"--host=unix://{run}/docker.sock",
            f"--data-root={data}",
            f"--exec-root={run}/exec",
            f"--pidfile={run}/dockerd.pid",
            "--storage-driver=overlay2",
            "--exec-opt=native.cgroupdriver=cgroupfs",
            f"--bip={BRIDGE}",
            f"--default-address-pool=base={POOL},size=24",
            "--iptables=false",
            "--ip-forward=false",
        ]
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        log.close()
        engine = cls(
            f"unix://{run}/docker.sock",
            docker,
            proc,
            run=run,
            data=data,
            bridge_existed=bridge_existed,
        )
        deadline = time.monotonic() + 60
        while (reason := engine.unreachable()) and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
        if reason:
            last = _tail((run / "dockerd.log").read_text(errors="replace"), 1)
            engine.stop(keep=True)
            raise Unavailable(f"dockerd did not start ({reason}): {last}")
        return engine

    def unreachable(self) -> str | None:
        try:
            p = self.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        return None if p.returncode == 0 else _tail(p.stderr, 1) or "no answer"

    def version(self) -> str:
        return self.docker("version", "--format", "{{.Server.Version}}").stdout.strip()

    def docker(self, *args, check=True, timeout=600, **kw) -> subprocess.CompletedProcess:
        p = _run([self.docker_bin, *args], env=self.env, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"docker {' '.join(map(str, args))}: {p.stdout[-2000:]}{p.stderr}")
        return p

    def stop(self, keep: bool = False) -> None:
        """Stop the dockerd we started (by its PID) and remove what it left, unless `keep`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # dockerd stops its containers and its containerd
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if not self.owned["bridge_existed"] and Path("/sys/class/net/docker0").exists():
            _run(["ip", "link", "delete", "docker0"])
        shutil.rmtree(self.owned["run"], ignore_errors=True)
        if not keep:
            remove_tree(self.owned["data"])


def _client() -> str:
    """$TRAINER_TEST_DOCKER, else the `docker` of dockerd's own version, else `docker` on PATH.

    Of the same version: another `docker` earlier on PATH may lack what this engine's builds need
    (a newer CLI without its buildx plugin refuses DOCKER_BUILDKIT=1 builds; Debian's docker.io
    puts its client in /usr/bin and dockerd in /usr/sbin).
    """
    if chosen := os.environ.get("TRAINER_TEST_DOCKER"):
        return chosen
    dockerd = shutil.which("dockerd")
    path = os.environ.get("PATH", os.defpath).split(os.pathsep)
    candidates = [str(Path(dockerd).with_name("docker"))] if dockerd else []
    candidates += [str(Path(d) / "docker") for d in [*path, "/usr/bin", "/usr/local/bin"]]
    candidates = [c for c in dict.fromkeys(candidates) if os.access(c, os.X_OK)]
    want = _version(dockerd) if dockerd else None
    for c in candidates:
        if want and _version(c) == want:
            return c
    return candidates[0] if candidates else "docker"


def _version(binary: str) -> str | None:
    """'20.10.24+dfsg1' from `docker --version` / `dockerd --version`."""
    try:
        out = _run([binary, "--version"], timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version (\S+?),", out)
    return m.group(1) if m else None


def _die_with_parent() -> None:
    # If the test process dies without cleaning up, its dockerd gets SIGTERM and stops too.
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def remove_tree(path: Path) -> None:
    """rm -r, after unmounting anything an engine left mounted below `path`."""
    if not path.exists():
        return
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{path}/")), reverse=True):
        _run(["umount", "-l", mount])
    shutil.rmtree(path, ignore_errors=True)


def debian_base(engine: Engine, tag: str) -> str:
    """A bookworm image with python3, python3-venv and ca-certificates, from no registry.

    Deliberately no python-is-python3: the Dockerfile must not need `python` before its venv.
    The root file system is cached as a tarball in WORK (debootstrap takes a minute or two).
    """
    tarball = WORK / "base-bookworm.tar"
    if not tarball.exists():
        if shutil.which("debootstrap") is None:
            _apt_install("debootstrap")
        rootfs = WORK / "rootfs"
        remove_tree(rootfs)
        include = "--include=python3,python3-venv,ca-certificates"
        cmd = ["debootstrap", "--variant=minbase", include, "bookworm", rootfs, DEBIAN_MIRROR]
        p = _run(cmd, timeout=1200)
        assert p.returncode == 0, f"{' '.join(map(str, cmd))}: {p.stdout[-3000:]}{p.stderr}"
        for junk in ("var/lib/apt/lists", "var/cache/apt"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
        p = _run(["tar", "-C", rootfs, "-cf", f"{tarball}.tmp", "."])
        assert p.returncode == 0, p.stderr
        os.replace(f"{tarball}.tmp", tarball)
        remove_tree(rootfs)
    with open(tarball, "rb") as f:
        engine.docker(
            "import",
            "--change",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            'CMD ["/bin/bash"]',
            "-",
            tag,
            stdin=f,
        )
    return tag


def image_requirements() -> list[str]:
    """What docker/Dockerfile pip-installs (dependencies + tensorboard), plus the build backend."""
    import tomllib  # Python 3.11+, like the image; imported here so 3.10 can still collect

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = (
        project["project"]["dependencies"]
        + project["project"]["optional-dependencies"]["tensorboard"]
    )
    return [*deps, *project["build-system"]["requires"]]


class Wheelhouse:
    """The wheels the image needs (or `requirements`), from this machine's package index, on
    http://127.0.0.1:PORT/."""

    def __init__(self, python_version: str, requirements: list[str] | None = None, name="wheels"):
        self.folder = WORK / name
        self.folder.mkdir(parents=True, exist_ok=True)
        reqs = WORK / ("image-requirements.txt" if requirements is None else f"{name}.txt")
        reqs.write_text("\n".join(requirements or image_requirements()) + "\n")
        _build_sdist_only(self.folder, reqs)
        _link_local_wheels(self.folder, reqs, python_version)
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-cache-dir",
            "--only-binary=:all:", f"--python-version={python_version}", "--find-links",
            self.folder, "-d", self.folder, "-c", ROOT / "requirements.lock", "-r", reqs,
        ]  # fmt: skip
        p = _run(cmd, timeout=1800)
        assert p.returncode == 0, f"pip download: {p.stderr[-3000:]}"
        handler = functools.partial(_QuietHandler, directory=str(self.folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.pip_conf = WORK / ("pip.conf" if requirements is None else f"{name}.pip.conf")
        self.pip_conf.write_text(f"[global]\nno-index = true\nfind-links = {self.url}\n")
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.folder.iterdir())

    def close(self, keep: bool = False) -> None:
        self.server.shutdown()
        self.server.server_close()
        with contextlib.suppress(OSError):
            self.pip_conf.unlink()
        if not keep:
            shutil.rmtree(self.folder, ignore_errors=True)


SDIST_ONLY = ("python-etcd",)
"""Pure-Python requirements published as sdists only: built into wheels here (any Python), so that
the wheels-only download finds them in the folder and the image installs them without building."""


def _build_sdist_only(folder: Path, reqs: Path) -> None:
    wanted = [n for n in SDIST_ONLY if re.search(rf"(?m)^{re.escape(n)}\b", reqs.read_text())]
    if wanted:
        cmd = [
            sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", folder,
            "-c", ROOT / "requirements.lock", *wanted,
        ]  # fmt: skip
        p = _run(cmd, timeout=600)
        assert p.returncode == 0, f"pip wheel {' '.join(wanted)}: {p.stderr[-3000:]}"


def _link_local_wheels(folder: Path, reqs: Path, python_version: str) -> None:
    """Hard links in `folder` to the wheels that pip would take from this machine's own disk (its
    index's file:// URLs), so that `pip download` finds them there and copies only the rest: the
    CUDA wheels' 3 GB are not written twice at the build's peak. Best effort: what cannot be
    linked is downloaded as before."""
    with tempfile.TemporaryDirectory() as target:
        cmd = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--only-binary=:all:", f"--python-version={python_version}", "--target", target,
            "--find-links", folder, "--report", "-", "-c", ROOT / "requirements.lock", "-r", reqs,
        ]  # fmt: skip
        p = _run(cmd, timeout=1800)
    try:
        report = json.loads(p.stdout) if p.returncode == 0 else {}
    except ValueError:
        return
    for item in report.get("install", []):
        url = urllib.parse.urlparse(item.get("download_info", {}).get("url", ""))
        if url.scheme != "file":
            continue
        src = Path(urllib.parse.unquote(url.path))
        with contextlib.suppress(OSError):  # another filesystem, or already there
            os.link(src, folder / src.name)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def disk_used(path: Path) -> int:
    """Bytes under `path` (du -sb), 0 if absent."""
    p = _run(["du", "-sb", path], timeout=300)
    return int(p.stdout.split()[0]) if p.returncode == 0 and p.stdout else 0
