"""Sharded datasets: our reader (data.name=shards) against MosaicML `streaming` and `litdata`
reading the same images, and against our memory-mapped `arrays` path, side by side in one run;
then what the shard-aware order costs in accuracy against a full shuffle.

    make bench-shards                        # creates .venv-bench (streaming, litdata), ~6 min
    .venv-bench/bin/python bench/shards.py --quick

The images: IMAGES CIFAR-sized samples (3x32x32 uint8 and an int64 label), written once in each
reader's own format with shards of SHARD_MB (ours: `trainer data pack` of an arrays folder;
streaming: MDSWriter; litdata: optimize), each read from a local folder and from a real S3
server on loopback (SeaweedFS, tests/s3server.py), with a cold cache (emptied first) and a warm
one (the same run again), on 1 rank and on 2 (processes with RANK/WORLD_SIZE and a gloo group),
each rank through a torch DataLoader with 2 workers and batches of 256. A row is one epoch's
samples (all ranks) over the slowest rank's seconds, start of iteration to last batch. Then the
time to the first batch of a resume at 10% and at 90% of an epoch, for each reader (its own
resume: our start step, streaming's and litdata's state_dict). Every reader shuffles.

The order: digits (sklearn) written class by class, as an image folder lists them, packed in
that order (--keep-order: each shard one class) and packed shuffled (the default), trained with
`data.shards.window` 2 and 8 against 0 (a full shuffle), 3 seeds each: the test accuracy and loss.
Writes bench/results/shards-cpu.json and .png.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMAGES, SHARD_MB, BATCH, WORKERS = 60_000, 8, 256, 2
QUICK_IMAGES = 3_000
READERS = ("ours", "streaming", "litdata")


# --- the data in each format ---------------------------------------------------------------------


def write_sets(base: Path, n: int, s3) -> dict:
    """The same images as an arrays folder, our shards, MDS and litdata chunks; each format
    also uploaded to the bucket. Returns {reader: {"local": path, "s3": url}}."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, n, dtype=np.int64)
    arrays = base / "arrays"
    for split, (xs, ys) in {"train": (x, y), "test": (x[:512], y[:512])}.items():
        (arrays / split).mkdir(parents=True)
        np.save(arrays / split / "x.npy", xs)
        np.save(arrays / split / "y.npy", ys)
    sets = {"arrays": {"local": str(arrays)}}

    env = {**os.environ, **s3.env}
    subprocess.run(
        [sys.executable, "-m", "trainer", "data", "pack", str(arrays), "-o", str(base / "ours"),
         "--shard-mb", str(SHARD_MB)], check=True, cwd=ROOT, env=env, capture_output=True,
    )  # fmt: skip
    sets["ours"] = {"local": str(base / "ours")}

    from streaming import MDSWriter

    with MDSWriter(
        out=str(base / "streaming"), columns={"x": "ndarray:uint8:3,32,32", "y": "int64"},
        size_limit=f"{SHARD_MB}mb", compression=None,
    ) as w:  # fmt: skip
        for i in range(n):
            w.write({"x": x[i], "y": y[i]})
    sets["streaming"] = {"local": str(base / "streaming")}

    from litdata.streaming.writer import BinaryWriter

    w = BinaryWriter(str(base / "litdata"), chunk_bytes=f"{SHARD_MB}MB")
    for i in range(n):
        w.add_item(i, {"x": x[i], "y": int(y[i])})
    w.done()
    w.merge()
    sets["litdata"] = {"local": str(base / "litdata")}

    client = s3.client()
    s3.make_bucket("bench")
    for reader in READERS:
        folder = Path(sets[reader]["local"])
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                key = f"{reader}/{path.relative_to(folder)}"
                client.upload_file(str(path), "bench", key)
        sets[reader]["s3"] = f"s3://bench/{reader}"
    return sets


# --- one reader, one rank (a subprocess) ---------------------------------------------------------


def read_one(reader: str, source: str, cache: str, rank: int, world: int, resume_at: float) -> dict:
    """Run in its own process: one epoch of `reader` from `source` (folder or s3:// URL) as rank
    `rank` of `world`; or, with resume_at > 0, the time to the first batch from that fraction of
    the epoch on."""
    import torch

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    if reader in ("ours", "arrays"):
        from trainer import data as trainer_data
        from trainer.config import load
        from trainer.run import epoch_plan

        name = "shards" if reader == "ours" else "arrays"
        cfg = load(None, [f"data.name={name}", f"data.{name}.path={source}",
                          f"data.shards.cache_dir={cache}", f"data.num_workers={WORKERS}",
                          f"data.global_batch_size={BATCH * world}", "data.shards.cache_gb=2",
                          "data.persistent_workers=false"])  # fmt: skip
        spec = trainer_data.build(cfg.data, 0)
        plan = epoch_plan(cfg, len(spec.train), 0, spec.train)
        start = int(len(plan) * resume_at)
        batches = (b[0] for _, b, _ in trainer_data.train_batches(spec, plan, rank, world, start))
    elif reader == "streaming":
        from streaming import StreamingDataset

        kw = {"remote": source, "local": cache} if source.startswith("s3://") else {"local": source}
        ds = StreamingDataset(**kw, shuffle=True, batch_size=BATCH, shuffle_seed=1,
                              num_canonical_nodes=1)  # one node; set, as a resume needs it  # fmt: skip
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
        if resume_at:
            per_rank = len(ds)  # this rank's samples
            ds.load_state_dict({"epoch": 0, "sample_in_epoch": int(per_rank * world * resume_at),
                                "num_canonical_nodes": 1,
                                "shuffle_seed": 1, "initial_physical_nodes": None})  # fmt: skip
        batches = (b["x"] for b in loader)
    else:
        from litdata import StreamingDataLoader, StreamingDataset

        if source.startswith("s3://"):
            from litdata.streaming import downloader
            from litdata.streaming.resolver import Dir

            # its async client (obstore) refuses plain http, which the loopback server speaks
            downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

            opts = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
            ds = StreamingDataset(Dir(path=cache, url=source), shuffle=True, seed=1,
                                  storage_options=opts)  # fmt: skip
        else:
            ds = StreamingDataset(source, shuffle=True, seed=1)
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
        if resume_at:
            for i, _ in enumerate(loader):  # its state_dict is taken from a loader mid-epoch
                if i + 1 >= int(len(loader) * resume_at):
                    state = loader.state_dict()
                    break
            del loader
            if source.startswith("s3://"):  # a cold cache, as the other readers' resumes
                for chunk in Path(cache).rglob("chunk-*.bin"):  # (its state names the folder)
                    chunk.unlink()
            ds = StreamingDataset(ds.input_dir, shuffle=True, seed=1,
                                  storage_options=ds.storage_options)  # fmt: skip
            loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
            loader.load_state_dict(state)
        batches = (b["x"] for b in loader)
    return _timed(batches, resume_at)


def _timed(batches, resume_at: float) -> dict:
    """Iterate `batches` (each one's inputs) to the end, or, for a resume, to the first batch:
    samples, seconds, and the seconds to the first batch."""
    count, first = 0, None
    started = time.perf_counter()
    for x in batches:
        count += len(x)
        if first is None:
            first = time.perf_counter() - started
            if resume_at:
                break
    seconds = time.perf_counter() - started
    return {"samples": count, "seconds": seconds, "first_batch_s": first}


def run_reader(python: str, reader: str, source: str, cache: str, world: int, s3,
               resume_at: float = 0.0) -> dict:  # fmt: skip
    """`reader` on `world` processes at once; samples/s over the slowest rank."""
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29600 + int(time.time() * 1000) % 300)}  # fmt: skip
    procs = []
    for rank in range(world):
        e = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip
        code = (f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import shards; "
                f"print(json.dumps(shards.read_one({reader!r}, {source!r}, {cache!r}, {rank}, "
                f"{world}, {resume_at})))")  # fmt: skip
        procs.append(subprocess.Popen([python, "-c", code], env=e, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"{reader} {source} world {world}: {err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    slowest = max(r["seconds"] for r in results)
    return {
        "samples": sum(r["samples"] for r in results),
        "seconds": slowest,
        "samples_per_s": sum(r["samples"] for r in results) / slowest,
        "first_batch_s": max(r["first_batch_s"] or 0 for r in results),
    }


# --- the order's cost ----------------------------------------------------------------------------


def order_cost(base: Path, seeds: int) -> list[dict]:
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    rng = np.random.default_rng(0)
    test = rng.permutation(len(y))[:360]
    train = np.setdiff1d(np.arange(len(y)), test)
    train = train[np.argsort(y[train], kind="stable")]  # class by class, as a folder packs
    folder = base / "digits-arrays"
    for split, rows in (("train", train), ("test", test)):
        (folder / split).mkdir(parents=True)
        np.save(folder / split / "x.npy", x[rows])
        np.save(folder / split / "y.npy", y[rows])
    rows = []
    for packing, flags, windows in (("class by class", ["--keep-order"], (0, 2, 8)),
                                    ("shuffled (default)", [], (2, 8))):  # fmt: skip
        packed = base / f"digits-shards-{len(flags)}"
        subprocess.run([sys.executable, "-m", "trainer", "data", "pack", str(folder), "-o",
                        str(packed), "--shard-mb", "0.1", *flags], check=True, cwd=ROOT,
                       capture_output=True)  # fmt: skip
        for window in windows:
            accs, losses = [], []
            for seed in range(seeds):
                run_dir = base / f"order-{len(flags)}-{window}-{seed}"
                subprocess.run(
                    [sys.executable, "-m", "trainer", "train", "--config", "digits-mlp",
                     "data.name=shards", f"data.shards.path={packed}",
                     f"data.shards.window={window}", f"seed={seed}", "train.epochs=10",
                     f"run_dir={run_dir}", "log.progress=none", "log.tensorboard=false"],
                    check=True, cwd=ROOT, capture_output=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )  # fmt: skip
                summary = json.loads((run_dir / "summary.json").read_text())
                result = summary["test"] if "test" in summary else summary["eval"]
                accs.append(result["accuracy"])
                losses.append(result["loss"])
            rows.append({"packed": packing, "window": window, "accuracy": accs,
                         "mean": statistics.mean(accs), "test_loss": losses,
                         "mean_loss": statistics.mean(losses)})  # fmt: skip
    return rows


# --- the run -------------------------------------------------------------------------------------


def run(quick: bool) -> dict:
    from tests.s3server import S3Server

    n = QUICK_IMAGES if quick else IMAGES
    python = sys.executable
    base = Path(tempfile.mkdtemp(prefix="bench-shards-"))
    rows, resumes = [], []
    try:
        with S3Server(str(base / "s3")) as s3:
            sets = write_sets(base, n, s3)
            for world in (1, 2):
                row = run_reader(
                    python, "arrays", sets["arrays"]["local"], str(base / "none"), world, s3
                )
                rows.append(
                    {"reader": "arrays", "source": "local", "cache": "-", "world": world, **row}
                )
                for reader in READERS:
                    local_cache = str(base / f"cache-{reader}-local-{world}")
                    row = run_reader(python, reader, sets[reader]["local"], local_cache, world, s3)
                    rows.append(
                        {"reader": reader, "source": "local", "cache": "-", "world": world, **row}
                    )
                    cache = str(base / f"cache-{reader}-{world}")
                    for state in ("cold", "warm"):
                        row = run_reader(python, reader, sets[reader]["s3"], cache, world, s3)
                        rows.append({"reader": reader, "source": "s3", "cache": state,
                                     "world": world, **row})  # fmt: skip
                    shutil.rmtree(cache, ignore_errors=True)
            for reader in READERS:
                for at in (0.1, 0.9):
                    cache = str(base / f"resume-{reader}-{at}")
                    row = run_reader(python, reader, sets[reader]["s3"], cache, 1, s3, resume_at=at)
                    resumes.append(
                        {"reader": reader, "at": at, "first_batch_s": row["first_batch_s"]}
                    )
        order = order_cost(base, 1 if quick else 3)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ratios = {}
    for source, cache in (("local", "-"), ("s3", "cold"), ("s3", "warm")):
        for world in (1, 2):
            got = {r["reader"]: r["samples_per_s"] for r in rows
                   if r["source"] == source and r["cache"] == cache and r["world"] == world}  # fmt: skip
            anchor = max(got["streaming"], got["litdata"])
            where = source if cache == "-" else f"{source} {cache}"
            ratios[f"{where} world {world}"] = got["ours"] / anchor
    return {"images": n, "shard_mb": SHARD_MB, "batch": BATCH, "workers": WORKERS, "rows": rows,
            "ours_over_faster_anchor": ratios, "resume": resumes, "order": order}  # fmt: skip


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    groups = sorted({(r["source"], r["cache"], r["world"]) for r in report["rows"]},
                    key=lambda g: (g[0], g[1], g[2]))  # fmt: skip
    readers = ["arrays", *READERS]
    width = 0.2
    for k, reader in enumerate(readers):
        values = [next((r["samples_per_s"] for r in report["rows"] if (r["source"], r["cache"],
                  r["world"]) == g and r["reader"] == reader), 0) for g in groups]  # fmt: skip
        ax.bar([i + (k - 1.5) * width for i in range(len(groups))], values, width, label=reader)
    ax.set_xticks(range(len(groups)), [f"{s} {c}\nworld {w}" for s, c, w in groups], fontsize=8)
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(f"{report['images']} images 3x32x32, shards of {report['shard_mb']} MB, "
                 f"{report['workers']} workers a rank")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import machinery

    report, path = machinery.suite_main(argv, __doc__, run, _plot, "shards-cpu", "shards-tiny-cpu")
    for r in report["rows"]:
        print(f"{r['reader']:>9} {r['source']:>5} {r['cache']:>4} world {r['world']}: "
              f"{r['samples_per_s']:10,.0f} samples/s")  # fmt: skip
    for k, v in report["ours_over_faster_anchor"].items():
        print(f"ours / faster of streaming, litdata ({k}): {v:.2f}")
    for r in report["resume"]:
        print(f"resume {r['reader']} at {r['at']:.0%}: first batch {r['first_batch_s']:.2f} s")
    for r in report["order"]:
        print(
            f"packed {r['packed']}, window {r['window']}: accuracy {r['mean']:.4f} "
            f"{r['accuracy']}, test loss {r['mean_loss']:.4f}"
        )
    print(f"{path}.json, .png ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
