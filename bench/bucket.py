"""Checkpoints in a bucket against checkpoints on local disk, side by side in one run: the 39M
GPT of the ckpt suite on 2 processes, DDP (whole files) and FSDP (DCP shards), each saved every
2 steps to a local folder and to a real S3 server on loopback (SeaweedFS, tests/s3server.py),
blocking and in the background; then each resumed once from where it was saved (a new run
folder: for the bucket, an empty local disk).

    python bench/bench.py --suite bucket            # ~4 min on 2 CPU cores
    python bench/bucket.py --quick                  # a tiny GPT: checks the machinery

Per row: the stall per scheduled save (the loop's wait; for a blocking save the save itself),
its own part (less the wait at its start for the previous background write to land: with one
write in flight, an upload slower than the save interval makes the next save wait), and the
restore (metrics.jsonl's "restored": listing, download, verification, load). Ratios: bucket /
disk for a blocking save and for a restore, and a background save's stall, whole and its own
part, against a blocking save to the bucket (target <= 0.10 for its own part). Both servers and disks are
this machine's: the bucket's cost here is the protocol's and the client's (hashing, HTTP,
the local copy), not a network's. Writes bench/results/bucket-cpu.json and .png.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (the tests do): machinery.py is beside it
    sys.path.insert(0, str(HERE))
import machinery  # noqa: E402

bench = machinery.load()
ROOT = bench.ROOT
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.s3server import S3Server  # noqa: E402

QUICK_SIZE = ["model.gpt.width=64", "model.gpt.layers=2", "model.gpt.heads=2"]
LAYOUTS = [("DDP", []), ("FSDP", ["dist.strategy=fsdp"])]


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
    out = {k: v for k, v in os.environ.items() if k not in drop}
    return {**out, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def _train(args: list[str], run_dir: Path, env: dict) -> list[dict]:
    """A 2-process run under torchrun; its metrics.jsonl records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "trainer", "train", *args, f"run_dir={run_dir}"]  # fmt: skip
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _row(base: list[str], where: str, background: bool, work: Path, env: dict) -> dict:
    name = f"{where}, {'background' if background else 'blocking'}"
    folder = work / name.replace(", ", "-").replace(" ", "_")
    args = [*base, f"ckpt.dir={where_dir(where, folder)}", f"ckpt.async_save={background}".lower()]
    records = _train(args, folder / "run", env)
    stalls, writes = bench.checkpoint_stalls("\n".join(json.dumps(r) for r in records))
    copies = _copy_stalls(records)
    again = _train([*args, "train.max_steps=9"], folder / "resumed", env)
    [restored] = [r for r in again if r.get("kind") == "restored"]
    return {
        "row": name,
        "stall_per_save_s": statistics.median(stalls),
        "stalls_s": stalls,
        "copy_stall_per_save_s": statistics.median(copies),
        "copy_stalls_s": copies,
        "writes_s": writes,
        "restore_s": restored["seconds"],
    }


def _copy_stalls(records: list[dict]) -> list[float]:
    """Each scheduled save's stall less the wait, at its start, for the previous background write
    to land (`waited` of that write's checkpoint_written record, logged just before it): what the
    save itself costs the loop, whatever the cadence."""
    out, waited = [], 0.0
    for r in records:
        if r.get("kind") == "checkpoint_written":
            waited = r.get("waited", 0.0)
        elif r.get("kind") == "checkpoint":
            if r["reason"] != "final":
                out.append(r["seconds"] - waited)
            waited = 0.0
    return out


def where_dir(where: str, folder: Path) -> str:
    if where == "bucket":
        return f"s3://bench/{folder.parent.name.lower()}/{folder.name}"
    return str(folder / "checkpoints")


def run(quick: bool) -> dict:
    base = list(bench.CKPT_BASE) + (QUICK_SIZE if quick else [])
    out = {"layouts": {}}
    with tempfile.TemporaryDirectory() as tmp, S3Server(tmp) as s3:
        s3.make_bucket("bench")
        env = _env(**s3.env)
        for layout, extra in LAYOUTS:
            rows = []
            for where in ("disk", "bucket"):
                for background in (False, True):
                    row = _row([*base, *extra], where, background, Path(tmp) / layout, env)
                    rows.append(row)
                    print(f"{layout:>5} {row['row']:<20} stall/save {row['stall_per_save_s']:.3f} s"
                          f" (own {row['copy_stall_per_save_s']:.3f} s)  restore "
                          f"{row['restore_s']:.3f} s", flush=True)  # fmt: skip
            by = {r["row"]: r for r in rows}
            ratios = {
                "blocking save, bucket / disk": by["bucket, blocking"]["stall_per_save_s"]
                / by["disk, blocking"]["stall_per_save_s"],
                "restore, bucket / disk": by["bucket, blocking"]["restore_s"]
                / by["disk, blocking"]["restore_s"],
                "background stall / blocking save, bucket": by["bucket, background"][
                    "stall_per_save_s"
                ]
                / by["bucket, blocking"]["stall_per_save_s"],
                "background save's own stall / blocking save, bucket (target <= 0.10)": by[
                    "bucket, background"
                ]["copy_stall_per_save_s"]
                / by["bucket, blocking"]["stall_per_save_s"],
                "background stall / blocking save, disk": by["disk, background"]["stall_per_save_s"]
                / by["disk, blocking"]["stall_per_save_s"],
            }
            out["layouts"][layout] = {"rows": rows, "ratios": ratios}
            for k, v in ratios.items():
                print(f"{layout:>5} {k}: {v:.3f}", flush=True)
    out["base"] = base
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (layout, data) in zip(axes, report["layouts"].items(), strict=True):
        names = [r["row"] for r in data["rows"]]
        stalls = [r["stall_per_save_s"] for r in data["rows"]]
        restores = [r["restore_s"] for r in data["rows"]]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], stalls, width=0.4, label="stall per save (s)")
        ax.bar([i + 0.2 for i in x], restores, width=0.4, label="restore (s)")
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
        ax.set_title(f"GPT 39M, 2 processes, {layout}")
        ax.legend(fontsize=8)
    fig.suptitle("checkpoints: local disk against a bucket (SeaweedFS on loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    report, path = machinery.suite_main(argv, __doc__, run, _plot, "bucket-cpu", "bucket-tiny-cpu")
    print(f"{path}.json, .png ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
