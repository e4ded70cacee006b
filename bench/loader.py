"""The image-folder input pipeline: samples/s per loader worker, side by side in one run.

    python bench/bench.py --suite loader            # or: python bench/loader.py --reps 3
    python bench/loader.py --quick                  # a few small JPEGs: checks the machinery

Generates a folder of JPEGs of ImageNet's typical size (bench/headline.py's generator, 500 x
375, 256 distinct images repeated), then reads it round-robin, every row once per repetition:

- the trainer's data.name=imagefolder: the batches its DataLoader's workers deliver (uint8,
  decoded, cropped and resized; the trainer makes them normalised floats on the device), with
  its default decoder (torchvision.io for JPEGs) and with PIL's;
- the bare loader: torchvision.datasets.ImageFolder with Resize, CenterCrop and PILToTensor
  (the same uint8 batches), a DataLoader with the same batch size and workers; and the textbook
  one, ToTensor and Normalize in the worker instead (float batches, 4x the bytes).

Each run times `batches` batches after the first (the workers' start and first batch are left
out) and reports samples/s divided by the number of workers. The JSON (machine, load average,
every run) goes to bench/results/loader-<device>.json; ratios divide the rows' medians, with
the range of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import headline
import machinery

bench = machinery.load()  # bench.py's machinery: bench.py imports this suite to run it

TRAINER, TRAINER_PIL, BARE, TEXTBOOK = (
    "trainer image folder, torchvision.io decoder",
    "trainer image folder, PIL decoder",
    "bare torchvision ImageFolder + DataLoader (PIL), uint8",
    "bare torchvision ImageFolder + DataLoader (PIL), ToTensor + Normalize",
)
ROWS = (TRAINER, TRAINER_PIL, BARE, TEXTBOOK)
RATIOS = [
    ("image folder: trainer / bare loader, per worker", TRAINER, BARE, 1.0),
    ("image folder: torchvision.io / PIL decoder (trainer)", TRAINER, TRAINER_PIL, None),
    ("image folder: trainer / textbook loader, per worker", TRAINER, TEXTBOOK, None),
]
FULL = {"images": 2048, "hw": (375, 500), "size": 224, "batch": 64, "batches": 12, "workers": 1}
QUICK = {"images": 64, "hw": (40, 48), "size": 16, "batch": 8, "batches": 4, "workers": 1}


def _images(root: Path, s: dict) -> dict:
    sizes = dataclasses.replace(headline.TINY, images=s["images"], classes=8, jpeg_hw=s["hw"])
    return headline.write_images(root, sizes)


def _trainer_batches(root: Path, s: dict, decoder: str):
    from trainer import config, data, sampler
    from trainer.datasets.folder import FolderDataset

    FolderDataset.decoder = decoder  # the workers fork after this
    cfg = config.load(None, ["data.name=imagefolder", f"data.root={root}",
                             f"data.image_size={s['size']}", f"data.global_batch_size={s['batch']}",
                             f"data.num_workers={s['workers']}"])  # fmt: skip
    spec = data.build(cfg.data, 0, "cpu")
    plan = sampler.EpochPlan(len(spec.train), s["batch"], seed=0, epoch=0, drop_last=True)
    keys = [(0, 0, idx) for _, idx, _ in plan.rank_batches(0, 1)]
    return data._fetched(spec, "train", 0, 1, keys)  # what its workers deliver: uint8 batches


def _bare_batches(root: Path, s: dict, textbook: bool):
    import torch
    from torchvision import datasets, transforms

    from trainer.datasets.folder import IMAGENET_MEAN, IMAGENET_STD

    to_tensor = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    tf = transforms.Compose([transforms.Resize(s["size"]), transforms.CenterCrop(s["size"]),
                             *(to_tensor if textbook else [transforms.PILToTensor()])])  # fmt: skip
    folder = datasets.ImageFolder(str(root / "train"), transform=tf)
    return iter(
        torch.utils.data.DataLoader(
            folder, batch_size=s["batch"], shuffle=True, num_workers=s["workers"], drop_last=True
        )
    )


def measure(row: str, root: Path, s: dict) -> dict:
    """One run: samples/s per worker over `batches` batches after the first."""
    if row in (BARE, TEXTBOOK):
        stream = _bare_batches(root, s, textbook=row == TEXTBOOK)
    else:
        stream = _trainer_batches(root, s, "pil" if row == TRAINER_PIL else "auto")
    first = next(stream)  # the workers' start and first batch: left out
    assert first[0].shape[-1] == s["size"] and first[0].shape[0] == s["batch"], first[0].shape
    start = time.perf_counter()
    for _ in range(s["batches"]):
        next(stream)
    seconds = time.perf_counter() - start
    del stream
    rate = s["batches"] * s["batch"] / seconds
    return {"value": rate / s["workers"], "samples_per_s": rate, "seconds": seconds}


def run(reps: int, quick: bool, out: Path, note: str | None) -> dict:
    s = QUICK if quick else FULL
    info = bench.machine()
    info["load_avg_before"] = os.getloadavg()
    runs: dict[str, list[dict]] = {r: [] for r in ROWS}
    with tempfile.TemporaryDirectory() as work:
        images = _images(Path(work) / "images", s)
        for rep, i in bench.alternation(len(ROWS), reps):
            result = measure(ROWS[i], Path(work) / "images", s)
            result.update(rep=rep, load_avg_1m=os.getloadavg()[0])
            runs[ROWS[i]].append(result)
            print(f"  [{rep + 1}/{reps}] {ROWS[i]:50} {result['value']:8,.1f} samples/s/worker")
    info["load_avg_after"] = os.getloadavg()
    summaries = {r: bench.summarize([x["value"] for x in runs[r]]) for r in ROWS}
    report = {
        "suite": "loader", "quick": quick, "reps": reps, "note": note, "machine": info,
        "method": "rows round-robin; a run times `batches` batches after its first; value: "
        "samples/s divided by the loader workers; ratios divide medians",
        "sizes": {**s, "hw": list(s["hw"])}, "images": {k: v for k, v in images.items() if k != "path"},
        "rows": [{"name": r, "unit": "samples/s per worker", **summaries[r], "runs": runs[r]}
                 for r in ROWS],
        "ratios": bench.ratios(summaries, RATIOS),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    name = "loader-tiny-cpu.json" if quick else f"loader-{(info.get('gpu') or 'cpu').lower()}.json"
    (out / name).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(bench.ROOT / "bench" / "results"))
    parser.add_argument("--note")
    args = parser.parse_args(argv)
    report = run(args.reps, args.quick, Path(args.out), args.note)
    for r in report["rows"]:
        print(
            f"  {r['name']:50} {r['median']:8,.1f} [{r['min']:,.1f}-{r['max']:,.1f}] samples/s/worker"
        )
    for name, r in report["ratios"].items():
        target = f">= {r['target']:.2f}" if r["target"] else ""
        print(
            f"  {name:55} {r['value']:.3f} [{r['per_rep_min']:.3f}-{r['per_rep_max']:.3f}] {target}"
        )
    m = report["machine"]
    print("load average before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
        *m["load_avg_before"], *m["load_avg_after"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
