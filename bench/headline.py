"""The GPU headline numbers (issue 42), every one in a single run: GPU time comes in short loans.

    python bench/bench.py --suite headline          # on a CUDA machine: ~6 min on an H100
    python bench/bench.py --suite headline --quick  # the same rows at tiny sizes on the CPU
    make bench SUITE=headline

What it measures, each through `python -m trainer train` (bench/bench.py's run_row), with the
issue's targets printed beside the numbers:

- GPT-2-small (124M: 12 layers, 12 heads, width 768, 1024 tokens of context, a vocabulary of
  50,304) in bf16 with torch.compile; attention is F.scaled_dot_product_attention (flash kernels):
  tokens/s and MFU against the device's dense bf16 peak (trainer.perf.PEAK_FLOPS; a device
  missing from it gets MFU null with the reason). Target: MFU >= 40% on an H100.
- The checkpoint stall of the same model on the GPU: blocking saves against background saves
  (median stall of the scheduled saves). Target: background / blocking <= 0.10.
- repro.world_invariant against plain training at world 1 (both repro.deterministic, which
  world_invariant needs on CUDA), on the same model.
- ResNet-50 at 224 px (torchvision's, as a model.name plug-in) reading a folder of JPEGs through
  data.name=imagefolder with loader workers: images/s and the share of the step spent waiting
  for data (steady state: the median of the log windows). Target: data wait <= 5%.

Then what a GPU may show differently from the CPU this was built on (issue 57), each row beside
its reference row in the same run: the GPT with its loss outside the compiled graph
(train.compile_loss=false) and with AdamW's foreach kernels (optim.fused=false), against the
first row (loss in the graph, fused AdamW: the defaults on a GPU; run.json's fast_paths, kept
in each row's JSON, says which ran); the GPT built whole and built deferred (FSDP at world 1:
run.json's build_s), each with `trainer plan`'s expected memory against its measured
torch.cuda.max_memory_allocated; ResNet-50 with fewer loader workers. The image rows' workers
are as many as /dev/shm holds (loader_workers: a container's 64 MB default ends in a bus error).

The data are generated at start into a temporary folder: random token ids (train.bin, test.bin,
tokens.json) and JPEGs of ImageNet's typical size (500 x 375). A row that fails, or runs past its
time, is recorded with its error and the others still run; the JSON (bench/results/
headline-<device>.json) is rewritten after every row, so a run cut short keeps what it measured.

`--quick` (tiny sizes) runs every row on the CPU in about 20 s: a 2-block GPT of width 32 over
32 tokens (vocabulary 256) and torchvision's ResNet-18 at 16 px (the same plug-in path), without
torch.compile (on a CPU its compile alone takes minutes), each row in a process forked from this
one (no import per row). tests/test_headline.py runs it, so the script cannot rot between loans.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (the tests do): machinery.py is beside it
    sys.path.insert(0, str(HERE))
import machinery  # noqa: E402

bench = machinery.load()
ROOT = bench.ROOT
SUITE = "headline"


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU dry run."""

    layers: int
    heads: int
    width: int
    seq: int
    vocab: int
    batch: int  # sequences a step
    train_tokens: int
    steps: int  # the compiled GPT's throughput row
    every: int  # its log window
    ckpt_steps: int  # the checkpoint rows: a save every ckpt_every steps, the last one final
    ckpt_every: int
    wi_steps: int  # world_invariant / plain
    wi_every: int
    compile: bool
    images: int  # training JPEGs (val: images // 32, at least 2 per class)
    classes: int
    jpeg_hw: tuple[int, int]
    image_size: int
    image_model: str  # torchvision.models' factory
    image_batch: int
    image_steps: int
    image_every: int
    workers: int
    few_workers: int  # the worker-count row
    build_steps: int  # the build rows: a few steps after the build
    timeouts: dict  # row group -> seconds


GPU = Sizes(
    layers=12, heads=12, width=768, seq=1024, vocab=50304, batch=16, train_tokens=8_000_000,
    steps=120, every=10, ckpt_steps=320, ckpt_every=80, wi_steps=40, wi_every=5, compile=True,
    images=8192, classes=10, jpeg_hw=(375, 500), image_size=224, image_model="resnet50", image_batch=256,
    image_steps=96, image_every=8, workers=12, few_workers=4, build_steps=10,
    timeouts={"gpt": 240, "ckpt": 150, "invariant": 120, "resnet": 150, "build": 90},
)  # fmt: skip
TINY = Sizes(
    layers=2, heads=2, width=32, seq=32, vocab=256, batch=8, train_tokens=40_000,
    steps=6, every=2, ckpt_steps=8, ckpt_every=2, wi_steps=6, wi_every=2, compile=False,
    images=32, classes=2, jpeg_hw=(20, 24), image_size=16, image_model="resnet18", image_batch=4,
    image_steps=4, image_every=2, workers=2, few_workers=1, build_steps=2,
    timeouts={"gpt": 120, "ckpt": 120, "invariant": 120, "resnet": 120, "build": 120},
)  # fmt: skip

GPT_ROW = "GPT-2-small, bf16 + compile"
BLOCKING, BACKGROUND = "GPT-2-small, blocking saves", "GPT-2-small, background saves"
PLAIN, INVARIANT = "GPT-2-small, deterministic", "GPT-2-small, deterministic + world_invariant"
RESNET = "ResNet-50 224 px, image folder, bf16 + channels_last"
# What a GPU may show differently (issue 57's list), each beside its reference row in one run:
LOSS_OUT = "GPT-2-small, bf16 + compile, loss outside the graph"
FOREACH = "GPT-2-small, bf16 + compile, AdamW foreach (not fused)"
WHOLE_BUILD = "GPT-2-small, built whole (one process)"
DEFERRED_BUILD = "GPT-2-small, built deferred (FSDP at world 1)"
FEW_WORKERS = "ResNet-50 224 px, image folder, fewer loader workers"

# (headline, what it reads, target): ("<=", x) is met at or below x, a number at or above it.
TARGETS = {
    "GPT-2-small MFU (bf16 dense peak)": 0.40,
    "GPT-2-small tokens/s": None,
    "checkpoint stall, background / blocking": ("<=", 0.10),
    "world_invariant / plain, world 1": None,
    "ResNet-50 data wait (steady state)": ("<=", 0.05),
    "ResNet-50 images/s": None,
    "loss in the compiled graph / outside it, tokens/s": None,
    "fused AdamW / foreach, tokens/s": None,
    "deferred build / whole build, seconds": None,
    "trainer plan / measured peak GPU memory, whole": None,
    "trainer plan / measured peak GPU memory, deferred": None,
    "ResNet-50 data wait, fewer loader workers": None,
}


# --- the data: generated at start ---------------------------------------------------------------


def write_tokens(folder: Path, sizes: Sizes, seed: int = 0) -> dict:
    """train.bin / test.bin of random token ids below GPT-2's 50,257 (or the tiny vocabulary),
    tokens.json saying the model's vocabulary (50,304: GPT-2's padded to a multiple of 64)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    top = min(sizes.vocab, 50257)
    test_tokens = sizes.batch * sizes.seq + 1  # one evaluation batch
    for name, n in (("train.bin", sizes.train_tokens), ("test.bin", test_tokens)):
        rng.integers(0, top, size=n, dtype=np.uint16).tofile(folder / name)
    meta = {"dtype": "uint16", "vocab_size": sizes.vocab, "tokenizer": "random ids"}
    (folder / "tokens.json").write_text(json.dumps(meta) + "\n")
    return {"path": str(folder), "train_tokens": sizes.train_tokens, "test_tokens": test_tokens,
            "vocab_size": sizes.vocab, "ids_below": top}  # fmt: skip


UNIQUE_JPEGS = 256
"""Distinct images; the files repeat them (decoding costs the same, writing them is quick)."""


def _jpeg(args: tuple[int, int, int]) -> bytes:
    """One JPEG: smooth colour fields (a bicubic upsampling of random pixels) plus grain."""
    import io

    import numpy as np
    from PIL import Image

    h, w, seed = args
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    smooth = np.asarray(small.resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, (h, w, 1), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_images(root: Path, sizes: Sizes) -> dict:
    """root/train/<class>/*.jpg and root/val/<class>/*.jpg (data.name=imagefolder's layout)."""
    h, w = sizes.jpeg_hw
    val = max(2 * sizes.classes, sizes.images // 32)
    unique = min(UNIQUE_JPEGS, sizes.images + val)
    # Threads: PIL encodes and numpy fills arrays with the GIL released, and no process pool
    # re-imports this script (or forks a parent that holds a CUDA context).
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1) if unique > 32 else 1) as pool:
        blobs = list(pool.map(_jpeg, [(h, w, seed) for seed in range(unique)]))
    written = 0
    for split, count in (("train", sizes.images), ("val", val)):
        for c in range(sizes.classes):
            (root / split / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            blob = blobs[written % unique]
            (root / split / f"class{i % sizes.classes:02d}" / f"{i:06d}.jpg").write_bytes(blob)
            written += 1
    return {"path": str(root), "train_images": sizes.images, "val_images": val,
            "distinct_images": unique, "classes": sizes.classes, "jpeg_height_width": [h, w],
            "mean_jpeg_bytes": round(sum(map(len, blobs)) / unique)}  # fmt: skip


# --- the rows ------------------------------------------------------------------------------------


def gpt_base(sizes: Sizes, tokens: str, device: str) -> tuple[str, ...]:
    s = sizes
    return (
        "data.name=tokens", f"data.tokens.path={tokens}", f"data.tokens.seq_len={s.seq}",
        "model.name=gpt", f"model.gpt.layers={s.layers}", f"model.gpt.heads={s.heads}",
        f"model.gpt.width={s.width}", f"data.global_batch_size={s.batch}",
        f"data.eval_batch_size={s.batch}", "train.precision=bf16", "optim.name=adamw",
        "optim.lr=6e-4", "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]",
        "train.clip_grad_norm=1.0", "sched.name=none", "train.epochs=1000",
        "ckpt.every_epochs=0", "log.tensorboard=false", "log.progress=plain",
        f"dist.device={device}", "dist.stall_s=0",
    )  # fmt: skip


def _steps(steps: int, every: int) -> tuple[str, ...]:
    return (f"train.max_steps={steps}", f"log.every_steps={every}")


def rows(
    sizes: Sizes, tokens: str, images: str, device: str, workers: int | None = None
) -> list[bench.Row]:
    """The suite's rows, most wanted first (a run cut short keeps the first ones): issue 42's
    headline rows, then what a GPU may show differently, each beside its reference row.
    `workers`: the loader workers /dev/shm has room for (loader_workers), else sizes.workers."""
    s, gpt = sizes, gpt_base(sizes, tokens, device)
    workers = s.workers if workers is None else workers
    compiled = ("train.compile=true",) if s.compile else ()
    fast = (*gpt, *_steps(s.steps, s.every), *compiled)
    ckpt = (*gpt, *_steps(s.ckpt_steps, s.ckpt_every), f"ckpt.every_steps={s.ckpt_every}")
    ckpt += ("ckpt.keep_last=2",)
    det = (*gpt, *_steps(s.wi_steps, s.wi_every), "repro.deterministic=true")
    resnet = (
        "data.name=imagefolder", f"data.root={images}", f"data.image_size={s.image_size}",
        "data.persistent_workers=true", "data.pin_memory=true",
        f"data.global_batch_size={s.image_batch}", f"data.eval_batch_size={s.image_batch}",
        "data.drop_last=true", f"model.name=torchvision.models:{s.image_model}",
        f"model.kwargs.num_classes={s.classes}", "train.precision=bf16",
        "train.channels_last=true", "optim.name=sgd", "optim.lr=0.1", "sched.name=none",
        "train.epochs=1000", "train.eval_every_epochs=1000", "ckpt.every_epochs=0",
        "log.tensorboard=false", "log.progress=plain", f"dist.device={device}",
        "dist.stall_s=0", *_steps(s.image_steps, s.image_every),
    )  # fmt: skip
    few = min(s.few_workers, workers)
    build = (*gpt, *_steps(s.build_steps, s.build_steps))
    g, c, i = "GPT-2-small throughput", "checkpoint stall per save", "world_invariant cost"
    r, b = "ResNet-50, JPEG folder", "GPT-2-small build and plan"
    return [
        bench.Row(GPT_ROW, "trainer", fast, threads=None, group=g),
        bench.Row(BLOCKING, "trainer", (*ckpt, "ckpt.async_save=false"), threads=None,
                  metric="ckpt_stall_s", group=c),
        bench.Row(BACKGROUND, "trainer", ckpt, threads=None, metric="ckpt_stall_s", group=c),
        bench.Row(PLAIN, "trainer", det, threads=None, group=i),
        bench.Row(INVARIANT, "trainer", (*det, "repro.world_invariant=true"), threads=None,
                  group=i),
        bench.Row(RESNET, "trainer", (*resnet, f"data.num_workers={workers}"), threads=None,
                  group=r),
        bench.Row(LOSS_OUT, "trainer", (*fast, "train.compile_loss=false"), threads=None, group=g),
        bench.Row(FOREACH, "trainer", (*fast, "optim.fused=false"), threads=None, group=g),
        bench.Row(WHOLE_BUILD, "trainer", (*build, "dist.strategy=none"), threads=None,
                  metric="build_s", group=b),
        bench.Row(DEFERRED_BUILD, "trainer", (*build, "dist.strategy=fsdp"), threads=None,
                  metric="build_s", group=b),
        bench.Row(FEW_WORKERS, "trainer", (*resnet, f"data.num_workers={few}"), threads=None,
                  group=r),
    ]  # fmt: skip


PLANNED = (WHOLE_BUILD, DEFERRED_BUILD)
"""The rows `trainer plan` predicts the memory of (run_one): uncompiled, one process."""

SHM_BATCHES = 2
"""Batches a loader worker holds in /dev/shm at once (torch's DataLoader prefetch_factor)."""


def loader_workers(wanted: int, shm_bytes: int | None, batch_bytes: int) -> tuple[int, str | None]:
    """(loader workers for the image rows, why fewer than `wanted` or None): each worker's
    batches pass through /dev/shm, so a container's small one (Docker's default is 64 MB) ends
    the row in a bus error. As many as /dev/shm holds with a quarter spare, at least one."""
    need = wanted * SHM_BATCHES * batch_bytes
    if shm_bytes is None or shm_bytes * 3 // 4 >= need:
        return wanted, None
    fit = max(1, shm_bytes * 3 // 4 // (SHM_BATCHES * batch_bytes))
    return min(fit, wanted), (
        f"/dev/shm holds {shm_bytes / 2**30:.2f} GiB, and {wanted} workers x {SHM_BATCHES} "
        f"batches of {batch_bytes / 2**20:.0f} MiB need {need / 2**30:.2f} GiB: "
        f"{min(fit, wanted)} worker(s)"
    )


def image_batch_bytes(sizes: Sizes) -> int:
    """One loader batch of float32 images (the upper bound: a batch as the model takes it)."""
    return sizes.image_batch * 3 * sizes.image_size**2 * 4


TIMEOUT_GROUP = {GPT_ROW: "gpt", BLOCKING: "ckpt", BACKGROUND: "ckpt", PLAIN: "invariant",
                 INVARIANT: "invariant", RESNET: "resnet", LOSS_OUT: "gpt", FOREACH: "gpt",
                 WHOLE_BUILD: "build", DEFERRED_BUILD: "build", FEW_WORKERS: "resnet"}  # fmt: skip


# --- the numbers from the rows: pure ------------------------------------------------------------


def mfu(samples_per_s: float | None, flops: float | None, device: str | None) -> tuple:
    """(MFU against the device's dense bf16 peak, None) or (None, why not)."""
    from trainer.perf import peak_flops  # the trainer's table of dense peaks: one source

    if samples_per_s is None:
        return None, "no throughput measured (the row failed)"
    if not device:
        return None, "no GPU: a CPU has no dense bf16 peak in trainer.perf.PEAK_FLOPS"
    peak = peak_flops(device, "bf16")
    if peak is None:
        return None, f"{device!r} is not in trainer.perf.PEAK_FLOPS: its dense bf16 peak is unknown"
    if not flops:
        return None, "the trainer counted no FLOPs per sample (summary.json flops_per_sample)"
    return samples_per_s * flops / peak, None


@functools.cache
def gpt_params(layers: int, heads: int, width: int, seq: int, vocab: int) -> tuple[int, int]:
    """(all parameters, those nanoGPT counts: without the position embedding) of the GPT,
    built on the meta device (no memory, no compute)."""
    import torch

    from trainer.gpt import GPT

    with torch.device("meta"):
        model = GPT(vocab, seq, layers, width, heads)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.pos.weight.numel()


def nanogpt_flops_per_token(sizes: Sizes) -> float:
    """nanoGPT's estimate_mfu: 6N + 12 L H Q T per token (N without the position embedding)."""
    s = sizes
    _, n = gpt_params(s.layers, s.heads, s.width, s.seq, s.vocab)
    return 6 * n + 12 * s.layers * s.heads * (s.width // s.heads) * s.seq


def _number(name: str, value, unit: str, rows: list[str], **extra) -> dict:
    target = TARGETS[name]
    at_most = isinstance(target, tuple)
    limit = target[1] if at_most else target
    met = None
    if value is not None and limit is not None:
        met = value <= limit if at_most else value >= limit
    return {"value": value, "unit": unit, "target": limit, "at_most": at_most, "met": met,
            "rows": rows, **extra}  # fmt: skip


def _ok(results: dict, name: str) -> dict | None:
    r = results.get(name)
    return r if r and r.get("status") == "ok" else None


def _why(results: dict, *names: str) -> str | None:
    for n in names:
        r = results.get(n)
        if r is None:
            return f"{n!r} was not run"
        if r.get("status") != "ok":
            return f"{n!r} failed: {r.get('error', '?').splitlines()[0]}"
    return None


def headline(results: dict, sizes: Sizes, device: str | None) -> dict:
    """The headline numbers from the rows' results ({row name: its JSON entry}), each with its
    target and whether it is met; a number that cannot be had is None with the reason."""
    out = {}
    gpt = _ok(results, GPT_ROW)
    rate = gpt["median"] if gpt else None
    flops = gpt["runs"][0].get("flops_per_sample") if gpt else None
    value, reason = mfu(rate, flops, device)
    if gpt is None:
        reason = _why(results, GPT_ROW)
    per_token = nanogpt_flops_per_token(sizes)
    formula, _ = mfu(rate, per_token * sizes.seq, device)
    out["GPT-2-small MFU (bf16 dense peak)"] = _number(
        "GPT-2-small MFU (bf16 dense peak)", value, "fraction", [GPT_ROW], reason=reason,
        flops_per_sample=flops, mfu_nanogpt_formula=formula,
        nanogpt_flops_per_token=per_token,
    )  # fmt: skip
    tokens = rate * sizes.seq if rate is not None else None
    out["GPT-2-small tokens/s"] = _number(
        "GPT-2-small tokens/s", tokens, "tokens/s", [GPT_ROW], reason=_why(results, GPT_ROW)
    )
    block, bg = _ok(results, BLOCKING), _ok(results, BACKGROUND)
    ratio = bg["median"] / block["median"] if block and bg and block["median"] else None
    waited = [w for r in (bg["runs"] if bg else []) for w in r.get("writes_waited_s", [])]
    out["checkpoint stall, background / blocking"] = _number(
        "checkpoint stall, background / blocking", ratio, "ratio", [BACKGROUND, BLOCKING],
        reason=_why(results, BACKGROUND, BLOCKING),
        blocking_s=block["median"] if block else None, background_s=bg["median"] if bg else None,
        background_writes_waited_s=waited,
    )  # fmt: skip
    plain, inv = _ok(results, PLAIN), _ok(results, INVARIANT)
    ratio = inv["median"] / plain["median"] if plain and inv and plain["median"] else None
    out["world_invariant / plain, world 1"] = _number(
        "world_invariant / plain, world 1", ratio, "ratio", [INVARIANT, PLAIN],
        reason=_why(results, INVARIANT, PLAIN),
    )  # fmt: skip
    res = _ok(results, RESNET)
    run = res["runs"][0] if res else {}
    wait, whole = run.get("data_wait_pct"), run.get("data_wait_run_pct")
    out["ResNet-50 data wait (steady state)"] = _number(
        "ResNet-50 data wait (steady state)", wait / 100 if wait is not None else None,
        "fraction", [RESNET], reason=_why(results, RESNET),
        whole_run=whole / 100 if whole is not None else None,
    )  # fmt: skip
    out["ResNet-50 images/s"] = _number(
        "ResNet-50 images/s", res["median"] if res else None, "images/s", [RESNET],
        reason=_why(results, RESNET),
    )  # fmt: skip
    return {**out, **_differences(results)}


def _differences(results: dict) -> dict:
    """What a GPU may show differently (issue 57): each row against its reference row."""
    out = {}
    name = "loss in the compiled graph / outside it, tokens/s"
    peaks = {n: _peak(results, n) for n in (GPT_ROW, LOSS_OUT)}
    out[name] = _against(
        results, name, GPT_ROW, LOSS_OUT, "loss_compiled", peak_gpu_memory_gib=peaks
    )
    name = "fused AdamW / foreach, tokens/s"
    out[name] = _against(results, name, GPT_ROW, FOREACH, "fused_optimizer")
    name = "deferred build / whole build, seconds"
    out[name] = _against(results, name, DEFERRED_BUILD, WHOLE_BUILD)
    for row, kind in ((WHOLE_BUILD, "whole"), (DEFERRED_BUILD, "deferred")):
        name = f"trainer plan / measured peak GPU memory, {kind}"
        value, reason, planned = _plan_against_peak(results, row)
        out[name] = _number(name, value, "ratio", [row], reason=reason, planned_bytes=planned,
                            measured_gib=_peak(results, row))  # fmt: skip
    few = _ok(results, FEW_WORKERS)
    wait = few["runs"][0].get("data_wait_pct") if few else None
    name = "ResNet-50 data wait, fewer loader workers"
    out[name] = _number(
        name, wait / 100 if wait is not None else None, "fraction", [FEW_WORKERS],
        reason=_why(results, FEW_WORKERS), images_per_s=few["median"] if few else None,
    )  # fmt: skip
    return out


def _peak(results: dict, name: str) -> float | None:
    r = _ok(results, name)
    return r["runs"][0].get("peak_gpu_memory_gib") if r else None


def _against(
    results: dict, name: str, top: str, bottom: str, path: str | None = None, **extra
) -> dict:
    """`top`'s median over `bottom`'s (their metric: samples/s, or seconds for build rows).
    `path`: the fast path (run.json's fast_paths) that `top` runs and `bottom` does not; rows
    that ran the same (a GPU without it, a CPU dry run) compare nothing: None, and why."""
    a, b = _ok(results, top), _ok(results, bottom)
    value = a["median"] / b["median"] if a and b and b["median"] else None
    reason = _why(results, top, bottom)
    if value is not None and path is not None:
        ran = [(r["runs"][0].get("fast_paths") or {}).get(path) for r in (a, b)]
        if ran != [True, False]:
            value, reason = None, f"{top!r} and {bottom!r} ran {path} {ran[0]} and {ran[1]}"
    return _number(name, value, "ratio", [top, bottom], reason=reason, **extra)


def _plan_against_peak(results: dict, row: str) -> tuple:
    """(`trainer plan`'s device bytes for the row's config / the run's peak allocated GPU
    bytes, why None, the planned bytes)."""
    if reason := _why(results, row):
        return None, reason, None
    plan, peak = results[row].get("plan") or {}, _peak(results, row)
    if "device_bytes" not in plan:
        return None, f"trainer plan failed: {plan.get('error', 'not run')}", None
    if peak is None:
        return (
            None,
            "no GPU: torch.cuda.max_memory_allocated measured nothing",
            plan["device_bytes"],
        )
    return plan["device_bytes"] / (peak * 2**30), None, plan["device_bytes"]


def _shown(value, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "fraction":
        return f"{value:.1%}"
    if unit == "ratio":
        return f"{value:.3f}"
    return f"{value:,.0f}"


def format_headline(numbers: dict) -> str:
    """The headline table: each number beside its target and whether it is met."""
    lines = [f"  {'headline':52} {'value':>12}  {'target':10} met"]
    for name, n in numbers.items():
        target = ""
        if n["target"] is not None:
            target = ("<= " if n["at_most"] else ">= ") + _shown(n["target"], n["unit"])
        met = {None: "", True: "yes", False: "NO"}[n["met"]]
        line = f"  {name:52} {_shown(n['value'], n['unit']):>12}  {target:10} {met}"
        if n["value"] is None and n.get("reason"):
            line += f"  ({n['reason']})"
        lines.append(line.rstrip())
    return "\n".join(lines)


# --- running -----------------------------------------------------------------------------------


def forked(cmd: list[str], threads: int | None, timeout: float | None = None):
    """bench.run_row's launcher for the CPU dry run: `python -m trainer ARGS` as cli.main(ARGS)
    in a child forked from this process, which has torch and the trainer imported already (a
    new process would spend ~5 s importing them, per row). Not for CUDA: a forked child cannot
    use a CUDA context its parent made."""
    prefix = [sys.executable, "-m", "trainer"]
    if cmd[:3] != prefix:
        raise SystemExit(f"forked() runs trainer commands only, not {cmd[:3]}")
    fd, log = tempfile.mkstemp(prefix="headline-row-", suffix=".log")
    sys.stdout.flush()
    sys.stderr.flush()
    launched, t = time.time(), time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import torch

            torch.set_num_threads(threads or 1)
            from trainer import cli

            code = cli.main(cmd[3:])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif timeout is not None and time.perf_counter() - t > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.02)
    wall = time.perf_counter() - t
    os.close(fd)
    text = Path(log).read_text(errors="replace")
    os.unlink(log)
    if status != 0:
        what = f"timed out after {timeout:.0f} s" if status == "timeout" else f"exit {status}"
        raise SystemExit(f"benchmark row {what}: {' '.join(cmd)}\n{text[-2000:]}")
    return launched, wall, SimpleNamespace(stdout=text, stderr="", returncode=0)


def extras(result: dict) -> dict:
    """What the headline numbers need beyond bench.run_row's result, read from the run folder:
    the whole run's data wait, and how long each background save waited for the write before."""
    run_dir = Path(result["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    waited = [r.get("waited") for r in records if r.get("kind") == "checkpoint_written"]
    return {"data_wait_run_pct": summary.get("data_wait_pct"),
            "writes_waited_s": [w for w in waited if w is not None]}  # fmt: skip


def _entry(row: bench.Row) -> dict:
    return {"name": row.name, "group": row.group, "kind": row.kind, "metric": row.metric,
            "unit": row.unit, "processes": row.nproc, "overrides": list(row.overrides)}  # fmt: skip


def run_one(row: bench.Row, work: Path, timeout: float, launch) -> dict:
    """One row's JSON entry: status ok with its number, or status error with the error's text
    (a failed or timed-out row does not stop the others)."""
    entry = _entry(row)
    t = time.perf_counter()
    try:
        result = bench.run_row(row, work, timeout=timeout, launch=launch)
        result.update(extras(result))
    except (SystemExit, Exception) as e:
        text = str(e) if isinstance(e, SystemExit) else traceback.format_exc()
        entry.update(status="error", error=text[-4000:], seconds=time.perf_counter() - t)
        return entry
    entry.update(status="ok", **bench.summarize([result["value"]]), runs=[result])
    if row.name in PLANNED:
        entry["plan"] = planned(row, launch, timeout)
    entry["seconds"] = time.perf_counter() - t
    return entry


def planned(row: bench.Row, launch, timeout: float) -> dict:
    """`trainer plan --json` for the row's config on one rank: rank 0's expected peak, and its
    part on the device (the peak less the planning process's own fixed bytes), or the error."""
    cmd = [sys.executable, "-m", "trainer", "plan", "--json", "--world-size", "1", *row.overrides]
    try:  # a minute or less: the model on the meta device (bounded, so the deadline holds)
        _, _, p = launch(cmd, row.threads, min(timeout, 90))
        lines = [x for x in p.stdout.splitlines() if x.startswith("[")]
        rank0 = json.loads(lines[-1])[0]
    except (SystemExit, Exception) as e:
        from trainer.errors import first_line

        return {"error": first_line(e)[:300]}
    device = rank0["peak_bytes"] - rank0["fixed_bytes"]
    return {"peak_bytes": rank0["peak_bytes"], "fixed_bytes": rank0["fixed_bytes"],
            "device_bytes": device, "rank0": rank0}  # fmt: skip


def _line(entry: dict) -> str:
    if entry["status"] != "ok":
        return f"  {entry['name']:56} ERROR: {entry['error'].strip().splitlines()[0][:200]}"
    fmt = "{:12,.0f}" if entry["unit"] == "samples/s" else "{:12.3f}"
    value = fmt.format(entry["median"])
    return f"  {entry['name']:56} {value} {entry['unit']:9} ({entry['seconds']:.0f} s)"


def run(
    out: Path, tiny: bool = False, names: list[str] | None = None, note: str | None = None,
    deadline_s: float = 560.0,
) -> dict:  # fmt: skip
    """Every row (or those in `names`), then the headline numbers; the JSON after every row."""
    import torch

    start = time.perf_counter()
    sizes, have_gpu = (TINY if tiny else GPU), torch.cuda.is_available()
    if not tiny and not have_gpu:
        raise SystemExit("the headline suite needs a CUDA GPU: --quick runs it at tiny sizes here")
    device = "cpu" if tiny else "cuda"
    info = bench.machine()  # on a GPU machine this makes a CUDA context: no forked rows then
    with contextlib.suppress(OSError):  # loader workers pass batches through it
        info["dev_shm_bytes"] = shutil.disk_usage("/dev/shm").total
    if tiny:
        info["gpu_present"], info["gpu"] = info.get("gpu"), None
    launch = bench._run if have_gpu else forked
    if launch is forked:  # what every row imports, imported once
        import torchvision.models  # noqa: F401

        import trainer.train  # noqa: F401
    info["load_avg_before"] = os.getloadavg()
    slug = (info.get("gpu") or "cpu").replace(" ", "-").lower()
    name = f"{SUITE}-tiny-{slug}" if tiny else f"{SUITE}-{slug}"
    path = out / f"{name}{'-rerun' if names else ''}.json"  # --row: the full run's JSON stays
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="headline-") as work:
        work = Path(work)
        made = time.perf_counter()
        fixtures = {}
        for key, write in (("tokens", write_tokens), ("images", write_images)):
            try:  # without its data a row fails, and is recorded; the others still run
                fixtures[key] = write(work / key, sizes)
            except Exception as e:
                fixtures[key] = {"error": f"{type(e).__name__}: {e}"}
        fixtures["seconds"] = time.perf_counter() - made
        print(f"data written in {fixtures['seconds']:.1f} s: {fixtures['images']}", flush=True)
        shm = info.get("dev_shm_bytes")
        workers, why = loader_workers(sizes.workers, shm, image_batch_bytes(sizes))
        fixtures["loader_workers"], fixtures["loader_workers_why"] = workers, why
        if why:
            print(f"note: {why}", flush=True)
        todo = rows(sizes, str(work / "tokens"), str(work / "images"), device, workers)
        if names:
            todo = [r for r in todo if r.name in names]
        report = {"suite": SUITE, "tiny": tiny, "note": note, "machine": info,
                  "sizes": {k: v for k, v in vars(sizes).items() if k != "timeouts"},
                  "fixtures": fixtures, "method": METHOD, "rows": []}  # fmt: skip
        results = {}
        for row in todo:
            left = deadline_s - (time.perf_counter() - start)
            if left < 20:
                entry = {**_entry(row), "status": "error",
                         "error": f"skipped: the run's {deadline_s:.0f} s were spent"}  # fmt: skip
            else:
                limit = min(sizes.timeouts[TIMEOUT_GROUP[row.name]], left)
                entry = run_one(row, work, limit, launch)
            results[row.name] = entry
            report["rows"].append(entry)
            print(_line(entry), flush=True)
            _write(path, report, results, sizes, info, start)
    return _write(path, report, results, sizes, info, start)


def _write(path: Path, report: dict, results: dict, sizes: Sizes, info: dict, start) -> dict:
    report["machine"]["load_avg_after"] = os.getloadavg()
    try:
        report["headline"] = headline(results, sizes, info.get("gpu"))
    except Exception:  # the rows' numbers are written whatever happens here
        report["headline"] = {"error": traceback.format_exc()}
    report["elapsed_s"] = time.perf_counter() - start
    path.write_text(json.dumps(report, indent=2) + "\n")
    return {**report, "path": str(path)}


METHOD = (
    "one run per row, in the order listed, each `python -m trainer train` (bench/bench.py "
    "run_row); throughput: the median of a run's logged windows after the first "
    f"{bench.SKIP_WINDOWS} (warm-up, torch.compile); checkpoint stall: the median of the "
    "scheduled saves' `checkpoint` seconds (the final save left out); MFU: samples/s x the "
    "trainer's FLOPs per sample (FlopCounterMode, forward + backward) / the device's dense "
    "bf16 peak (trainer.perf.PEAK_FLOPS); mfu_nanogpt_formula: the same with nanoGPT's "
    "6N + 12LHQT FLOPs per token; data wait: the median of the windows' data_wait_pct "
    "(whole_run: summary.json's); build: run.json's build_s (data, model on its device, layout, "
    "optimizer); trainer plan: `trainer plan --json --world-size 1` of the row's config, its "
    "peak less the planning process's fixed bytes, against the row's peak_gpu_memory_gib."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--row", action="append", metavar="NAME", help="only the row NAME")
    parser.add_argument("--note", help="a line for the JSON")
    parser.add_argument(
        "--deadline-s", type=float, default=560.0,
        help="rows not started by then are recorded as skipped (default 560: a 10-minute loan "
        "call less the start; --row reruns those)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    known = {r.name for r in rows(TINY, "", "", "cpu")}
    if unknown := [n for n in args.row or () if n not in known]:
        parser.error(f"--row {unknown[0]!r} is not a row of the headline suite: {sorted(known)}")
    report = run(Path(args.out), args.quick, args.row, args.note, args.deadline_s)
    print("headline numbers (targets from issue 42):")
    numbers = report["headline"]
    print(numbers["error"] if "error" in numbers else format_headline(numbers))
    failed = [r["name"] for r in report["rows"] if r["status"] != "ok"]
    print(f"wrote {report['path']} in {report['elapsed_s']:.0f} s", end="")
    print(f"; {len(failed)} row(s) failed: {failed}" if failed else "", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
