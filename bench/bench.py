"""Benchmarks: throughput ratios measured side by side in one run, on one machine.

    make bench                                   # the GPU suite on a CUDA machine, else the CPU suite
    python bench/bench.py --suite cpu --reps 3 --out bench/results
    python bench/bench.py --suite cpu --reps 1 --quick --only "trainer, 1"   # machinery check only
    python bench/bench.py --suite cpu --row "trainer, 1 process" --row "bare loop, 1 process"
    python bench/bench.py --suite ckpt           # checkpoint stall per save: background vs blocking
    python bench/bench.py --suite bucket         # the same to an S3 server vs disk, and restores
    python bench/bench.py --suite sweep          # GPT cost against width (4 sizes), world 1 and 2
    python bench/bench.py --suite headline       # GPT-2-small MFU and more on a GPU (headline.py)
    python bench/bench.py --suite parallel --reps 1   # pp=2, tp=2, FSDP: memory, bubble (parallel.py)
    python bench/bench.py --suite busy           # trainer / bare under a background load (busy.py)

Every row is a real run of `python -m trainer train` (under torchrun for 2 processes) or of the
hand-written loop in bench/bare.py, on the same machine, in the same invocation. Rows run
round-robin: one run of every row per repetition, --reps repetitions, so drift in a shared
machine's load spreads over all rows. A run's throughput is the steady state: the median of its
logged windows after the first two (warm-up, torch.compile); the bare loops time windows of the
same length the same way. Each row reports the median and the min-max over repetitions; the
ratios divide medians (with the range of the per-repetition ratios). Startup rows time
`trainer --help` (launch to exit) and launch to the end of the first training step.

The bare loops are the textbook PyTorch loop on the same model, optimizer and device-resident
data, at the same global batch (no sampler, logging, checkpoints or stop checks); at world 2,
torch.distributed + DistributedDataParallel with each rank slicing its share of the batch:
trainer / bare is the stack's overhead. The JSON records the machine, its load average before and
after, library versions and each run's full command and windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


GPU_BASE = [
    "data.name=synthetic",
    "data.synthetic.shape=[3,32,32]",
    "data.synthetic.num_classes=10",
    "data.synthetic.size=50000",
    "data.synthetic.test_size=1000",
    "model.name=resnet18",
    "data.global_batch_size=512",
    "optim.name=sgd",
    "optim.lr=0.1",
    "sched.name=none",
    "sched.warmup_steps=0",
    "train.epochs=100",
    "train.max_steps=300",
    "log.every_steps=20",
    "ckpt.every_epochs=0",
    "log.tensorboard=false",
    "log.progress=plain",
    "dist.device=cuda",
    "data.device_resident=true",
    # Full batches only, as the bare loop: an epoch's 336-sample tail made torch.compile build a
    # second graph inside a timed window (one window fell to 419 samples/s on an H100).
    "data.drop_last=true",
]
GPU_ROWS = [
    ("bare loop fp32", "bare", []),
    ("trainer fp32", "trainer", []),
    (
        "trainer fp32, host batches (pinned)",
        "trainer",
        ["data.device_resident=false", "data.pin_memory=true"],
    ),
    ("trainer bf16", "trainer", ["train.precision=bf16"]),
    (
        "trainer bf16 + channels_last",
        "trainer",
        ["train.precision=bf16", "train.channels_last=true"],
    ),
    (
        "trainer bf16 + channels_last + compile",
        "trainer",
        ["train.precision=bf16", "train.channels_last=true", "train.compile=true"],
    ),
    (
        "bare loop bf16 + channels_last + compile",
        "bare",
        ["train.precision=bf16", "train.channels_last=true", "train.compile=true"],
    ),
    ("trainer fp32, repro.deterministic", "trainer", ["repro.deterministic=true"]),
    (
        "trainer fp32, repro.deterministic + world_invariant",
        "trainer",
        ["repro.deterministic=true", "repro.world_invariant=true"],
    ),
]

# digits MLP: the step is microseconds of math, so the per-step costs of the stack (and of DDP's
# gradient exchange) show; data.device_resident=true feeds the trainer the same in-memory tensors
# the bare loops slice.
CPU_COMMON = [
    "train.epochs=100",
    "ckpt.every_epochs=0",
    "log.tensorboard=false",
    "log.progress=plain",
    "dist.device=cpu",
    "data.device_resident=true",
]
# Full batches only, as the bare loops run them: the digits epoch's 30-sample tail step costs
# about two thirds of a full one (AdamW's update does not shrink with the batch), 0.8% of the
# samples/s that is no cost of the stack's.
CPU_BASE = [
    "--config",
    "digits-mlp",
    *CPU_COMMON,
    "data.drop_last=true",
    "train.max_steps=600",
    "log.every_steps=50",
]
# The small GPT (2 blocks of width 128, 32 x 64 bytes a step): ~0.1 s of math a step on 2 cores,
# against a 1.6 MB gradient all-reduce, so world 2 / world 1 measures data parallelism, not the
# per-step overhead. The eval split is cut to 4 KiB: only the training windows are timed.
CPU_GPT = [
    "--config",
    "stdlib-gpt",
    *CPU_COMMON,
    "data.text.max_test_bytes=4096",
    "train.max_steps=100",
    "log.every_steps=10",
]
# Checkpoint stall: a GPT of 39M parameters (a 470 MB checkpoint with AdamW's state), sized so
# that a blocking save takes 2 s or more on this kind of disk (25M took 1.4 s); two ranks, a save every 2 steps
# (steps 2, 4 and 6 in the background or not; 8, the final one, always in place).
CKPT_BASE = [
    "--config",
    "stdlib-gpt",
    "model.gpt.width=640",
    "model.gpt.layers=8",
    "model.gpt.heads=8",
    "data.global_batch_size=4",
    "data.text.max_test_bytes=4096",
    "train.max_steps=8",
    "log.every_steps=2",
    "ckpt.every_steps=2",
    "ckpt.every_epochs=0",
    "ckpt.keep_last=2",
    "log.tensorboard=false",
    "log.progress=plain",
    "dist.device=cpu",
]
QUICK = {  # --quick: a smoke test of the machinery, not a measurement
    "train.max_steps=600": "train.max_steps=60",
    "log.every_steps=50": "log.every_steps=10",
    "train.max_steps=100": "train.max_steps=12",
    "log.every_steps=10": "log.every_steps=3",
    "train.max_steps=300": "train.max_steps=30",
    "log.every_steps=20": "log.every_steps=5",
    "model.gpt.width=640": "model.gpt.width=64",
    "train.max_steps=8": "train.max_steps=4",
    "train.max_steps=2000": "train.max_steps=60",
    "train.max_steps=200": "train.max_steps=12",
}
WI = ("repro.world_invariant=true",)


@dataclass(frozen=True)
class Row:
    """One benchmark row: how to launch it and which number to take from each run."""

    name: str
    kind: str  # "trainer" | "bare" | "help" | "interleaved" (bench/interleaved.py: trainer / bare)
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    threads: int | None = 1  # OMP_NUM_THREADS per process; None: 1 unless the user set it
    metric: str = "samples_per_s"  # | "first_step_s" (launch to first step) | "wall_s" | "ratio"
    # | "ckpt_stall_s" | "build_s" (run.json's: data, model, layout, optimizer)
    group: str = "throughput"
    load: str | None = None  # a background load that runs beside it (bench/busy.py LOADS)

    @property
    def unit(self) -> str:
        return {"samples_per_s": "samples/s", "ratio": "x"}.get(self.metric, "s")


def _first_step(base: list[str]) -> tuple[str, ...]:
    """`base` cut to one logged step: the first train record is written when step 1 ends."""
    keep = [a for a in base if not a.startswith(("train.max_steps=", "log.every_steps="))]
    return (*keep, "train.max_steps=1", "log.every_steps=1")


def cpu_rows() -> list[Row]:
    mlp, gpt, one = tuple(CPU_BASE), tuple(CPU_GPT), _first_step(CPU_BASE)
    g_mlp, g_gpt, g_start = "digits MLP", "small GPT, 2 cores", "startup"
    return [
        Row("bare loop, 1 process", "bare", mlp, group=g_mlp),
        Row("trainer, 1 process", "trainer", mlp, group=g_mlp),
        Row("bare DDP loop, 2 processes (gloo)", "bare", mlp, 2, group=g_mlp),
        Row("trainer, 2 processes (DDP, gloo)", "trainer", mlp, 2, group=g_mlp),
        Row(
            "trainer, 2 processes, default checkpoints",
            "trainer",
            tuple(a for a in mlp if a != "ckpt.every_epochs=0"),  # the preset's cadence
            2,
            group=g_mlp,
        ),
        Row(
            "trainer, 2 processes, a save every epoch",
            "trainer",
            (*mlp, "ckpt.every_epochs=1"),
            2,
            group=g_mlp,
        ),
        Row("GPT trainer, 1 process x 2 threads", "trainer", gpt, 1, threads=2, group=g_gpt),
        Row("GPT trainer, 2 processes x 1 thread", "trainer", gpt, 2, threads=1, group=g_gpt),
        *interleaved_rows(mlp, gpt),
        Row("trainer --help", "help", metric="wall_s", group=g_start),
        Row("bare loop, 1 process: to 1st step", "bare", one, metric="first_step_s", group=g_start),
        Row(
            "trainer, 1 process: to 1st step", "trainer", one, metric="first_step_s", group=g_start
        ),
        Row(
            "bare DDP, 2 processes: to 1st step",
            "bare",
            one,
            2,
            metric="first_step_s",
            group=g_start,
        ),
        Row(
            "trainer, 2 processes: to 1st step",
            "trainer",
            one,
            2,
            metric="first_step_s",
            group=g_start,
        ),
    ]


def interleaved_rows(mlp: tuple[str, ...], gpt: tuple[str, ...]) -> list[Row]:
    """trainer / bare with the two loops' windows alternating in one process (bench/interleaved.py):
    the per-step cost of the stack, each trainer window paired with the bare window right after
    it, so the machine's drift between and within runs leaves the ratio."""
    group = "trainer / bare, windows alternating in one process"
    return [
        Row(INTERLEAVED[0], "interleaved", mlp, 1, metric="ratio", group=group),
        Row(INTERLEAVED[1], "interleaved", mlp, 2, metric="ratio", group=group),
        Row(INTERLEAVED[2], "interleaved", gpt, 1, threads=2, metric="ratio", group=group),
        Row(INTERLEAVED[3], "interleaved", gpt, 2, threads=1, metric="ratio", group=group),
    ]


INTERLEAVED = (
    "MLP trainer / bare, 1 process, alternating",
    "MLP trainer / bare, 2 processes, alternating",
    "GPT trainer / bare, 1 process x 2 threads, alternating",
    "GPT trainer / bare, 2 processes x 1 thread, alternating",
)


# The busy suite: the alternating rows with a background load beside them (bench/busy.py). Longer
# runs than the CPU suite's (38 window pairs a run, not 10): a loaded core's windows scatter more.
BUSY_MLP = [a if a != "train.max_steps=600" else "train.max_steps=2000" for a in CPU_BASE]
BUSY_GPT = [a if a != "train.max_steps=100" else "train.max_steps=200" for a in CPU_GPT]
QUIET, SPINNING, BURSTY = "quiet", "a core spinning", "bursty half core"


def busy_rows() -> list[Row]:
    """trainer / bare, windows alternating in one process (as the CPU suite's rows), with a
    background load beside the run: none, a core spinning, a bursty half core."""
    group = "trainer / bare, windows alternating, beside a background load"
    mlp, gpt = tuple(BUSY_MLP), tuple(BUSY_GPT)
    rows = [
        Row(f"MLP, 2 processes, {label}", "interleaved", mlp, 2, metric="ratio", group=group,
            load=load)
        for load, label in ((None, QUIET), ("spin", SPINNING), ("bursty", BURSTY))
    ]  # fmt: skip
    return [
        *rows,
        Row(f"MLP, 1 process, {BURSTY}", "interleaved", mlp, 1, metric="ratio", group=group,
            load="bursty"),
        Row(f"GPT, 2 processes x 1 thread, {BURSTY}", "interleaved", gpt, 2, threads=1,
            metric="ratio", group=group, load="bursty"),
    ]  # fmt: skip


# (ratio, numerator row, denominator row, target): ratios of the rows' medians; a denominator of
# None: the numerator row is a ratio itself (an interleaved row: its window pairs' statistic).
def ckpt_rows() -> list[Row]:
    """The stall of each scheduled save (the final one, always in place, left out)."""
    base, group = tuple(CKPT_BASE), "checkpoint stall per save, GPT 39M, 2 processes"
    blocking = ("ckpt.async_save=false",)
    return [
        Row(
            "DDP, blocking saves", "trainer", base + blocking, 2, metric="ckpt_stall_s", group=group
        ),
        Row("DDP, background saves", "trainer", base, 2, metric="ckpt_stall_s", group=group),
        Row(
            "FSDP, blocking saves",
            "trainer",
            (*base, "dist.strategy=fsdp", *blocking),
            2,
            metric="ckpt_stall_s",
            group=group,
        ),
        Row(
            "FSDP, background saves",
            "trainer",
            (*base, "dist.strategy=fsdp"),
            2,
            metric="ckpt_stall_s",
            group=group,
        ),
    ]


# Cost against size: the stdlib GPT (2 blocks, 64-byte context, 16 sequences a step) at four
# widths, 0.1M to 6.6M parameters (a 50x range), at world 1 (2 threads) and world 2 (2 x 1
# thread): the same cores, so world 2 / world 1 is what data parallelism costs at that size.
# Background saves every 6 steps: the stall per save grows with the state copied to host memory.
SWEEP_WIDTHS = (64, 128, 256, 512)
SWEEP_BASE = [
    "--config",
    "stdlib-gpt",
    "data.global_batch_size=16",
    "data.text.max_test_bytes=4096",
    "train.epochs=100",
    "train.max_steps=30",
    "log.every_steps=3",
    "ckpt.every_epochs=0",
    "ckpt.every_steps=6",
    "ckpt.keep_last=1",
    "log.tensorboard=false",
    "log.progress=plain",
    "dist.device=cpu",
]


def sweep_rows() -> list[Row]:
    rows = []
    for width in SWEEP_WIDTHS:
        size = (*SWEEP_BASE, f"model.gpt.width={width}", f"model.gpt.heads={max(2, width // 64)}")
        group = f"GPT width {width}"
        rows.append(Row(f"width {width}, world 1 x 2 threads", "trainer", size, 1, 2, group=group))
        rows.append(Row(f"width {width}, world 2 x 1 thread", "trainer", size, 2, 1, group=group))
    return rows


def sweep_ratios() -> list[tuple]:
    return [
        (
            f"width {w}: world 2 / world 1",
            f"width {w}, world 2 x 1 thread",
            f"width {w}, world 1 x 2 threads",
            None,
        )
        for w in SWEEP_WIDTHS
    ]


CKPT_RATIOS = [
    (
        "checkpoint stall, background / blocking, DDP",
        "DDP, background saves",
        "DDP, blocking saves",
        ("<=", 0.10),
    ),
    (
        "checkpoint stall, background / blocking, FSDP",
        "FSDP, background saves",
        "FSDP, blocking saves",
        ("<=", 0.10),
    ),
]

# trainer / bare is measured with the two loops' windows alternating in one process (the
# INTERLEAVED rows, target 0.97). Between two separate processes the same ratio also carries the
# machine's drift from one process to the next (a process's speed moved by up to 1.6x between
# runs on this repo's 2-core VM): the MLP's is kept, without a target, to show it.
CPU_RATIOS = [
    *((name, name, None, 0.97) for name in INTERLEAVED),
    (
        "trainer / bare, world 1, separate processes",
        "trainer, 1 process",
        "bare loop, 1 process",
        None,
    ),
    (
        "trainer / bare, world 2, separate processes",
        "trainer, 2 processes (DDP, gloo)",
        "bare DDP loop, 2 processes (gloo)",
        None,
    ),
    (
        "default checkpoints / none, world 2",
        "trainer, 2 processes, default checkpoints",
        "trainer, 2 processes (DDP, gloo)",
        0.97,
    ),
    (
        "a save every epoch / none, world 2",
        "trainer, 2 processes, a save every epoch",
        "trainer, 2 processes (DDP, gloo)",
        None,
    ),
    (
        "MLP world 2 / world 1, trainer",
        "trainer, 2 processes (DDP, gloo)",
        "trainer, 1 process",
        None,
    ),
    (
        "MLP world 2 / world 1, bare",
        "bare DDP loop, 2 processes (gloo)",
        "bare loop, 1 process",
        None,
    ),
    (
        "GPT world 2 (1 thread) / world 1 (2 threads)",
        "GPT trainer, 2 processes x 1 thread",
        "GPT trainer, 1 process x 2 threads",
        0.90,
    ),
]


def gpu_rows() -> list[Row]:
    rows = [
        Row(name, kind, (*GPU_BASE, *extra), threads=None, group="ResNet-18")
        for name, kind, extra in GPU_ROWS
    ]
    one = _first_step(GPU_BASE)
    return [
        *rows,
        Row("trainer --help", "help", metric="wall_s", threads=None, group="startup"),
        Row(
            "bare loop: to 1st step",
            "bare",
            one,
            metric="first_step_s",
            threads=None,
            group="startup",
        ),
        Row(
            "trainer: to 1st step",
            "trainer",
            one,
            metric="first_step_s",
            threads=None,
            group="startup",
        ),
    ]


GPU_RATIOS = [
    ("trainer / bare loop, fp32", "trainer fp32", "bare loop fp32", 0.97),
    (
        "trainer / bare loop, bf16+cl+compile",
        "trainer bf16 + channels_last + compile",
        "bare loop bf16 + channels_last + compile",
        0.97,
    ),
    (
        "device-resident / host batches, fp32",
        "trainer fp32",
        "trainer fp32, host batches (pinned)",
        None,
    ),
    ("bf16+cl+compile / fp32", "trainer bf16 + channels_last + compile", "trainer fp32", None),
    (
        "world_invariant / plain, deterministic fp32",
        "trainer fp32, repro.deterministic + world_invariant",
        "trainer fp32, repro.deterministic",
        None,
    ),
]


INVARIANT_ROWS = (
    "trainer, 1 process",
    "trainer, 2 processes (DDP, gloo)",
    "trainer, 1 process, world_invariant",
    "trainer, 2 processes, world_invariant",
    "trainer, 1 process, world_invariant, 2 shards",
    "trainer, 2 processes, world_invariant, 2 shards",
    "GPT trainer, 1 process x 1 thread",
    "GPT trainer, 1 process x 1 thread, world_invariant",
    "GPT trainer, 2 processes x 1 thread",
    "GPT trainer, 2 processes x 1 thread, world_invariant",
)
# repro.shards=2: the shard count of a run declared for at most 2 ranks (docs/training.md).
WI2 = (*WI, "repro.shards=2")


def invariant_rows() -> list[Row]:
    """The digits MLP with world_invariant (8 shards, the default; 2 shards: a run that will
    never use more than 2 ranks) and the CPU suite's plain rows they are divided by, and the
    small GPT with 8 shards against plain at one thread a process (world_invariant pins one
    intra-op thread)."""
    mlp, gpt, g_mlp, g_gpt = tuple(CPU_BASE), tuple(CPU_GPT), "digits MLP", "small GPT, 1 thread"
    extra = [
        Row("trainer, 1 process, world_invariant", "trainer", mlp + WI, group=g_mlp),
        Row("trainer, 2 processes, world_invariant", "trainer", mlp + WI, 2, group=g_mlp),
        Row("trainer, 1 process, world_invariant, 2 shards", "trainer", mlp + WI2, group=g_mlp),
        Row("trainer, 2 processes, world_invariant, 2 shards", "trainer", mlp + WI2, 2, group=g_mlp),
        Row("GPT trainer, 1 process x 1 thread", "trainer", gpt, 1, group=g_gpt),
        Row("GPT trainer, 1 process x 1 thread, world_invariant", "trainer", gpt + WI, group=g_gpt),
        Row("GPT trainer, 2 processes x 1 thread, world_invariant", "trainer", gpt + WI, 2,
            group=g_gpt),
    ]  # fmt: skip
    rows = {r.name: r for r in [*cpu_rows(), *extra]}
    return [rows[name] for name in INVARIANT_ROWS]


INVARIANT_RATIOS = [
    *(spec for spec in CPU_RATIOS if spec[0] == "MLP world 2 / world 1, trainer"),
    (
        "world_invariant / plain, world 1",
        "trainer, 1 process, world_invariant",
        "trainer, 1 process",
        0.8,
    ),
    (
        "world_invariant / plain, world 2",
        "trainer, 2 processes, world_invariant",
        "trainer, 2 processes (DDP, gloo)",
        0.8,
    ),
    (
        "world_invariant (2 shards) / plain, world 1",
        "trainer, 1 process, world_invariant, 2 shards",
        "trainer, 1 process",
        0.8,
    ),
    (
        "world_invariant (2 shards) / plain, world 2",
        "trainer, 2 processes, world_invariant, 2 shards",
        "trainer, 2 processes (DDP, gloo)",
        0.8,
    ),
    (
        "GPT world_invariant / plain, world 1",
        "GPT trainer, 1 process x 1 thread, world_invariant",
        "GPT trainer, 1 process x 1 thread",
        0.8,
    ),
    (
        "GPT world_invariant / plain, world 2",
        "GPT trainer, 2 processes x 1 thread, world_invariant",
        "GPT trainer, 2 processes x 1 thread",
        0.8,
    ),
]


SUITES = {  # suite -> (its rows, its ratios, the base overrides its FLOPs are counted on)
    "busy": (busy_rows, [(r.name, r.name, None, 0.97) for r in busy_rows()], CPU_BASE),
    "gpu": (gpu_rows, GPU_RATIOS, GPU_BASE),
    "cpu": (cpu_rows, CPU_RATIOS, CPU_BASE),
    "invariant": (invariant_rows, INVARIANT_RATIOS, CPU_BASE),
    "ckpt": (ckpt_rows, CKPT_RATIOS, CKPT_BASE),
    "sweep": (sweep_rows, sweep_ratios(), SWEEP_BASE),
}


def quick(row: Row) -> Row:
    return dataclasses.replace(row, overrides=tuple(QUICK.get(a, a) for a in row.overrides))


# --- the pure parts: windows, medians, alternation, ratios --------------------------------------

SKIP_WINDOWS = 2  # warm-up (allocator, first-touch, torch.compile): dropped from every run


def steady(windows: list[float], skip: int = SKIP_WINDOWS) -> float:
    """The steady-state rate of one run: the median of its windows after the first `skip`."""
    kept = windows[skip:] or windows[-1:]
    if not kept:
        raise ValueError("no throughput windows")
    return statistics.median(kept)


def train_windows(metrics_jsonl: str, key: str = "samples_per_s") -> list[float]:
    """`key` (samples/s) of each train record in a metrics.jsonl text, in order."""
    records = [json.loads(line) for line in metrics_jsonl.splitlines() if line.strip()]
    return [r[key] for r in records if r.get("kind") == "train" and key in r]


def checkpoint_stalls(metrics_jsonl: str) -> tuple[list[float], list[float]]:
    """(seconds the loop stalled for each scheduled save, seconds each background write took)
    in a metrics.jsonl text; the final save, always written in place, is left out."""
    records = [json.loads(line) for line in metrics_jsonl.splitlines() if line.strip()]
    stalls = [
        r["seconds"] for r in records if r.get("kind") == "checkpoint" and r["reason"] != "final"
    ]
    writes = [r["seconds"] for r in records if r.get("kind") == "checkpoint_written"]
    return stalls, writes


def first_step_time(metrics_jsonl: str) -> float | None:
    """The wall clock (time.time()) of the step-1 train record, None if step 1 was not logged."""
    for line in metrics_jsonl.splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("kind") == "train":
                return r["time"] if r.get("step") == 1 else None
    return None


def summarize(values: list[float]) -> dict:
    """Median and spread (min, max, interquartile range) of one row's repetitions."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "n": len(ordered),
        "values": list(values),
    }


def alternation(n_rows: int, reps: int) -> list[tuple[int, int]]:
    """(rep, row index) in run order: round-robin, every row once per repetition, so slow drift
    in the machine's load spreads over all rows instead of landing on the last ones."""
    return [(rep, i) for rep in range(reps) for i in range(n_rows)]


# One-sided 95% quantiles of Student's t by degrees of freedom (the normal's from 31 on): the
# ends of a two-sided 90% interval.
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771,
       1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706,
       1.703, 1.701, 1.699, 1.697)  # fmt: skip


def paired(per_rep: list[float]) -> dict:
    """The paired statistic of a ratio whose rows ran side by side in each repetition: the
    geometric mean of the per-repetition ratios and its 90% confidence interval (Student's t on
    their logarithms). Pairing takes out what a repetition's load did to both rows alike, which
    the range of the rows' own values keeps; the interval narrows as 1/sqrt(reps)."""
    if not per_rep:
        return {"paired": None, "ci90_lo": None, "ci90_hi": None}
    logs = [math.log(r) for r in per_rep]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return {"paired": math.exp(mean), "ci90_lo": None, "ci90_hi": None}
    df = len(logs) - 1
    t = T95[df - 1] if df <= len(T95) else 1.645
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return {
        "paired": math.exp(mean),
        "ci90_lo": math.exp(mean - half),
        "ci90_hi": math.exp(mean + half),
    }


def ratios(summaries: dict[str, dict], specs: list) -> dict[str, dict]:
    """Each ratio of medians, with the range of its per-repetition ratios (rows run side by side
    in each repetition) and their paired statistic (paired()); ratios whose rows were not run are
    left out."""
    out = {}
    for name, num, den, target in specs:
        if num not in summaries or (den is not None and den not in summaries):
            continue
        a = summaries[num]
        if den is None:  # a ratio row: its runs' ratios, its window pairs over all runs
            value, per_rep, pairs = a["median"], a["values"], a.get("pairs") or a["values"]
        else:
            b = summaries[den]
            value = a["median"] / b["median"]
            per_rep = [x / y for x, y in zip(a["values"], b["values"], strict=False) if y]
            pairs = per_rep
        at_most = isinstance(target, tuple)  # ("<=", x): lower is better
        if at_most:
            target = target[1]
        out[name] = {
            "value": value,
            "per_rep_min": min(per_rep) if per_rep else None,
            "per_rep_max": max(per_rep) if per_rep else None,
            "numerator": num,
            "denominator": den,
            "target": target,
            "at_most": at_most,
            **paired(pairs),
        }
    return out


def meets(ratio: dict) -> bool | None:
    """Whether a ratio meets its target (at least it, or at most it), None without one."""
    if ratio["target"] is None:
        return None
    if ratio.get("at_most"):
        return ratio["value"] <= ratio["target"]
    return ratio["value"] >= ratio["target"]


def clears(ratio: dict) -> bool | None:
    """Whether the paired 90% interval lies on the target's side (its lower end at least the
    target, or its upper end at most it): the repetitions say the target is met. None without a
    target or an interval."""
    if ratio["target"] is None or ratio.get("ci90_lo") is None:
        return None
    if ratio.get("at_most"):
        return ratio["ci90_hi"] <= ratio["target"]
    return ratio["ci90_lo"] >= ratio["target"]


def number(value: float, unit: str) -> str:
    """A row's value as the table, the progress lines and the plot print it."""
    return {"samples/s": f"{value:,.0f}", "x": f"{value:.3f}"}.get(unit, f"{value:.2f}")


def format_table(rows: list[Row], summaries: dict[str, dict], ratio_values: dict) -> str:
    lines = [f"  {'row':44} {'median':>10} {'min':>10} {'max':>10}  unit       n"]
    for row in rows:
        s = summaries.get(row.name)
        if s is None:
            continue
        cells = " ".join(f"{number(s[k], row.unit):>10}" for k in ("median", "min", "max"))
        lines.append(f"  {row.name:44} {cells}  {row.unit:9} {s['n']:2d}")
    lines.append(
        "ratios of medians (per-repetition range; paired: geometric mean of the per-repetition "
        "ratios [90% interval]; target):"
    )
    for name, r in ratio_values.items():
        rng = (
            f"[{r['per_rep_min']:.3f}-{r['per_rep_max']:.3f}]"
            if r["per_rep_min"] is not None
            else ""
        )
        pair = ""
        if r.get("ci90_lo") is not None:
            pair = f"{r['paired']:.3f} [{r['ci90_lo']:.3f}-{r['ci90_hi']:.3f}]"
        sign = "<=" if r.get("at_most") else ">="
        target = f"{sign} {r['target']:.2f}" if r["target"] is not None else ""
        lines.append(f"  {name:46} {r['value']:6.3f}  {rng:15} {pair:23} {target}")
    return "\n".join(lines)


# --- running the rows ---------------------------------------------------------------------------


def _env(threads: int | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if threads is None:
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env["OMP_NUM_THREADS"] = str(threads)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), "--standalone", f"--nproc-per-node={nproc}"]


def _override(overrides: tuple[str, ...], key: str) -> int:
    return int(next(a.split("=", 1)[1] for a in overrides if a.startswith(key + "=")))


def _run(
    cmd: list[str], threads: int | None, timeout: float | None = None
) -> tuple[float, float, subprocess.CompletedProcess]:
    launched = time.time()
    t = time.perf_counter()
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        what = f"timed out after {timeout:.0f} s: {' '.join(cmd)}"
        raise SystemExit(f"benchmark row {what}\n{tail}") from None
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(
            f"benchmark row failed: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        )
    return launched, wall, p


def run_row(row: Row, work: Path, timeout: float | None = None, launch=_run) -> dict:
    """Launch one run of `row`, beside its background load if it has one; {"value": its number,
    ...what else was measured}. `timeout` bounds the run (SystemExit past it); `launch(cmd,
    threads, timeout)` starts it (default: a subprocess; bench/headline.py's CPU dry run forks
    instead)."""
    if row.load is None:
        return _run_one(row, work, timeout, launch)
    if str(ROOT / "bench") not in sys.path:  # loaded by path (the tests do): busy.py is beside it
        sys.path.insert(0, str(ROOT / "bench"))
    import busy

    with busy.running(row.load):
        return _run_one(row, work, timeout, launch)


def _run_one(row: Row, work: Path, timeout: float | None, launch) -> dict:
    if row.kind == "help":
        cmd = [str(Path(sys.executable).with_name("trainer")), "--help"]
        _, wall, _ = launch(cmd, row.threads, timeout)
        return {"value": wall, "wall_s": wall, "command": " ".join(cmd)}
    if row.kind == "interleaved":
        return _run_interleaved(row, work, timeout, launch)
    if row.kind == "bare":
        steps = _override(row.overrides, "train.max_steps")
        every = _override(row.overrides, "log.every_steps")
        args = [str(ROOT / "bench" / "bare.py"), str(steps), str(every), *row.overrides]
        cmd = [*_launcher(row.nproc), *args]
        launched, wall, p = launch(cmd, row.threads, timeout)
        out = json.loads(p.stdout.strip().splitlines()[-1])
        windows, first = out.pop("windows"), out.pop("first_step_time")
    else:
        run_dir = work / f"run-{time.monotonic_ns()}"
        cmd = [*_launcher(row.nproc), "-m", "trainer", "train", *row.overrides]
        cmd.append(f"run_dir={run_dir}")
        launched, wall, _ = launch(cmd, row.threads, timeout)
        text = (run_dir / "metrics.jsonl").read_text()
        windows, first = train_windows(text), first_step_time(text)
        summary = json.loads((run_dir / "summary.json").read_text())
        out = {"peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"), "run_dir": str(run_dir)}
        out["build_s"], out["fast_paths"] = summary.get("build_s"), summary.get("fast_paths")
        out["flops_per_sample"] = summary.get("flops_per_sample")  # the trainer's count (GPUs)
        if tokens := train_windows(text, "tokens_per_s"):
            out["tokens_per_s"] = steady(tokens)
        if waits := train_windows(text, "data_wait_pct"):
            out["data_wait_pct"] = steady(waits)
        stalls, writes = checkpoint_stalls(text)
        if stalls:
            out.update(ckpt_stall_s=statistics.median(stalls), stalls_s=stalls, writes_s=writes)
    result = {
        **out,
        "windows": windows,
        "samples_per_s": steady(windows) if windows else None,
        "first_step_s": first - launched if first is not None else None,
        "wall_s": wall,
        "command": " ".join(cmd),
    }
    result["value"] = result.get(row.metric)
    if result["value"] is None:
        raise SystemExit(f"benchmark row {row.name!r} measured no {row.metric}")
    return result


def window_pairs(trainer: list[dict], bare: list[list], skip: int = SKIP_WINDOWS) -> list[float]:
    """trainer / bare of each trainer window (a train record: step, samples_per_s) and the bare
    window run right after it (bench/interleaved.py: [step, samples_per_s]), the first `skip`
    pairs (warm-up) left out."""
    after = {int(step): rate for step, rate in bare}
    pairs = [r["samples_per_s"] / after[r["step"]] for r in trainer if r["step"] in after]
    return pairs[skip:] if len(pairs) > skip else pairs[-1:]


def _run_interleaved(row: Row, work: Path, timeout: float | None, launch) -> dict:
    run_dir, out = work / f"run-{time.monotonic_ns()}", work / f"bare-{time.monotonic_ns()}.json"
    script = str(ROOT / "bench" / "interleaved.py")
    cmd = [*_launcher(row.nproc), script, str(out), "train", *row.overrides, f"run_dir={run_dir}"]
    _, wall, _ = launch(cmd, row.threads, timeout)
    text = (run_dir / "metrics.jsonl").read_text()
    records = [r for r in map(json.loads, text.splitlines()) if r.get("kind") == "train"]
    bare = json.loads(out.read_text())["bare"]
    pairs = window_pairs(records, bare)
    if not pairs:
        raise SystemExit(
            f"benchmark row {row.name!r}: no trainer window was followed by a bare one"
        )
    return {
        "value": math.exp(statistics.fmean(math.log(p) for p in pairs)),
        "pairs": pairs,
        "windows": [r["samples_per_s"] for r in records],
        "bare_windows": bare,
        "wall_s": wall,
        "command": " ".join(cmd),
    }


def flops_per_sample(overrides: list[str]) -> float | None:
    """Forward + backward FLOPs of one sample of the config's model (trainer.perf counts them)."""
    from trainer import config, data, models, perf

    cfg = config.load(None, overrides)
    spec = data.build(cfg.data, cfg.seed, "cpu")
    model = models.build(cfg.model, spec.in_shape, spec.num_classes, spec.task)
    return perf.flops_per_sample(model, spec.in_shape, spec.task, "cpu")


def _output(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


def machine() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["driver"] = _output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        )
    info["commit"] = _output(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    return info


def run_suite(
    suite: str,
    out: Path,
    reps: int = 3,
    fast: bool = False,
    only: list[str] | None = None,
    note: str | None = None,
    rows: list[str] | None = None,
) -> dict:
    make_rows, specs, base = SUITES[suite]
    names, rows = rows, make_rows()
    if fast:
        rows = [quick(r) for r in rows]
    if only or names:  # a row named exactly (--row) or by the start of its name (--only)
        prefixes = tuple(only or ())
        rows = [
            r for r in rows if r.name in (names or ()) or (prefixes and r.name.startswith(prefixes))
        ]
    if not rows:
        raise SystemExit(f"no row of the {suite} suite matches --only {only} --row {names}")
    info = machine()
    info["load_avg_before"] = os.getloadavg()
    runs: dict[str, list[dict]] = {r.name: [] for r in rows}
    with tempfile.TemporaryDirectory() as work:
        for rep, i in alternation(len(rows), reps):
            row = rows[i]
            result = run_row(row, Path(work))
            result["rep"] = rep
            result["load_avg_1m"] = os.getloadavg()[0]
            runs[row.name].append(result)
            value = number(result["value"], row.unit)
            print(f"  [{rep + 1}/{reps}] {row.name:44} {value:>12} {row.unit}", flush=True)
    info["load_avg_after"] = os.getloadavg()
    summaries = {name: summarize([r["value"] for r in rs]) for name, rs in runs.items()}
    for name, rs in runs.items():  # interleaved rows: every window pair of every repetition
        if any("pairs" in r for r in rs):
            summaries[name]["pairs"] = [p for r in rs for p in r["pairs"]]
    ratio_values = ratios(summaries, specs)
    try:
        fps = flops_per_sample([a for a in base if a not in ("--config", "digits-mlp")])
    except Exception:  # MFU is optional
        fps = None
    from trainer.perf import peak_flops  # the trainer's table of dense peaks: one source

    peak = peak_flops(info.get("gpu"), "bf16")
    results = []
    for row in rows:
        entry = {
            "name": row.name,
            "group": row.group,
            "kind": row.kind,
            "processes": row.nproc,
            "threads_per_process": row.threads,
            "metric": row.metric,
            "unit": row.unit,
            "overrides": list(row.overrides),
            "load": row.load,
            **summaries[row.name],
            "runs": runs[row.name],
        }
        if peak and fps and "bf16" in row.name and row.metric == "samples_per_s":
            entry["mfu_bf16"] = entry["median"] * fps / peak
        results.append(entry)
    report = {
        "suite": suite,
        "quick": fast,
        "reps": reps,
        "note": note,
        "machine": info,
        "method": (
            "rows run round-robin, one run of every row per repetition; a run's throughput is the "
            f"median of its logged windows after the first {SKIP_WINDOWS}; each row reports the "
            "median and range over repetitions; ratios divide medians. first_step_s: from just "
            "before the launch (time.time()) to the step-1 record (trainer: metrics.jsonl; bare: "
            "the loop's own clock). OMP_NUM_THREADS is set per row (threads_per_process)."
        ),
        "flops_per_sample": fps,
        "rows": results,
        "ratios": ratio_values,
    }
    if suite == "sweep":
        report["sizes"] = sweep_sizes(results)
    out.mkdir(parents=True, exist_ok=True)
    slug = (info.get("gpu") or "cpu").replace(" ", "-").lower()
    (out / f"{suite}-{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
    if suite == "sweep":
        _plot_sweep(report, out / f"{suite}-{slug}.png")
        report["table"] = format_sweep(report["sizes"])
    else:
        _plot(report, out / f"{suite}-{slug}.png")
        report["table"] = format_table(rows, summaries, ratio_values)
    return report


def _median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


@functools.cache
def gpt_shape(overrides: tuple[str, ...]) -> tuple[int, int]:
    """(parameters, sequence length) of the GPT the overrides configure (built on the meta
    device: no memory, no time)."""
    import torch

    from trainer import config, models

    cfg = config.load(overrides[1], overrides[2:])  # ["--config", name, *overrides]
    seq = cfg.data.text.seq_len
    with torch.device("meta"):
        model = models.build(cfg.model, (seq,), 256, "lm")
    return sum(p.numel() for p in model.parameters()), seq


def sweep_sizes(results: list[dict]) -> list[dict]:
    """One entry per GPT width: parameters, and per world size the median tokens/s, the step
    time split into data wait and the rest (compute and, at world 2, the gradient all-reduce),
    and the stall per background save."""
    sizes: dict[int, dict] = {}
    for entry in results:
        overrides = entry["overrides"]
        width = _override(tuple(overrides), "model.gpt.width")
        batch = _override(tuple(overrides), "data.global_batch_size")
        params, seq = gpt_shape(tuple(overrides))
        size = sizes.setdefault(width, {"width": width, "params": params})
        rate = entry["median"]  # sequences/s
        step_s = batch / rate
        wait = _median_of(entry["runs"], "data_wait_pct") or 0.0
        writes = [statistics.median(r["writes_s"]) for r in entry["runs"] if r.get("writes_s")]
        size[f"world_{entry['processes']}"] = {
            "tokens_per_s": rate * seq,
            "step_s": step_s,
            "data_wait_s": step_s * wait / 100,
            "compute_comm_s": step_s * (1 - wait / 100),
            "stall_per_save_s": _median_of(entry["runs"], "ckpt_stall_s"),
            "write_s": statistics.median(writes) if writes else None,
        }
    return [sizes[w] for w in sorted(sizes)]


def format_sweep(sizes: list[dict]) -> str:
    head = f"  {'width':>5} {'params':>10} {'world':>5} {'tokens/s':>10} {'step s':>8} "
    lines = [head + f"{'data s':>8} {'stall/save s':>12} {'write s':>8}"]
    for size in sizes:
        for world in (1, 2):
            w = size.get(f"world_{world}")
            if not w:
                continue
            stall = w["stall_per_save_s"]
            write = w["write_s"]
            lines.append(
                f"  {size['width']:>5} {size['params']:>10,} {world:>5} {w['tokens_per_s']:>10,.0f} "
                f"{w['step_s']:>8.3f} {w['data_wait_s']:>8.4f} "
                f"{stall if stall is not None else float('nan'):>12.3f} "
                f"{write if write is not None else float('nan'):>8.3f}"
            )
    return "\n".join(lines)


MET, MISSED, NO_TARGET = "#3a8a3a", "#c0392b", "#4878a8"


def ratio_bars(report: dict) -> list[dict]:
    """What the ratio panel draws, top to bottom: each ratio's median, its per-repetition range,
    its paired 90% interval (None without one), its target, and a colour saying whether the
    median meets the target."""
    bars = []
    for name, r in report["ratios"].items():
        target, met = r["target"], meets(r)
        color = NO_TARGET if met is None else MET if met else MISSED
        lo = r["value"] if r["per_rep_min"] is None else r["per_rep_min"]
        hi = r["value"] if r["per_rep_max"] is None else r["per_rep_max"]
        ci = None if r.get("ci90_lo") is None else (r["ci90_lo"], r["ci90_hi"])
        bars.append({"name": name, "value": r["value"], "lo": lo, "hi": hi, "target": target,
                     "color": color, "ci": ci})  # fmt: skip
    return bars


def _plot_ratios(ax, bars: list[dict]) -> None:
    bars = bars[::-1]
    ys = range(len(bars))
    ax.barh(
        [b["name"] for b in bars],
        [b["value"] for b in bars],
        xerr=[[b["value"] - b["lo"] for b in bars], [b["hi"] - b["value"] for b in bars]],
        color=[b["color"] for b in bars],
        capsize=3,
        height=0.6,
    )
    for y, b in zip(ys, bars, strict=True):
        if b.get("ci") is not None:
            ax.plot(b["ci"], [y + 0.3] * 2, color="#ffb000", linewidth=4, solid_capstyle="butt")
        if b["target"] is not None:
            ax.plot([b["target"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        right = max(b["hi"], b["ci"][1] if b.get("ci") else b["hi"])
        ax.text(right, y, f"  {b['value']:.3f}", va="center", fontsize=8)
    ax.axvline(1.0, color="#777777", linestyle=":", linewidth=1)
    top = max(max(b["hi"], b["ci"][1] if b.get("ci") else 0.0) for b in bars)
    ax.set_xlim(0, max(1.1, top * 1.15))
    ax.set_title(
        "ratios of medians (whiskers: per-rep range; orange: paired 90% interval;\n"
        "tick: target; green: met, red: missed)",
        fontsize=9,
        loc="left",
    )
    ax.tick_params(axis="both", labelsize=8)


def _pyplot(path: Path):
    """matplotlib's pyplot on the Agg backend, or None (saying so) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"  (matplotlib not installed: no {path.name})")
        return None
    return plt


def _device(machine: dict) -> str:
    return machine.get("gpu") or f"CPU x{machine['cpu_count']}"


def _save(plt, fig, title: str, path: Path) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))  # room for the 2-line title
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(report: dict, path: Path) -> None:
    plt = _pyplot(path)
    if plt is None:
        return
    groups: dict[str, list[dict]] = {}
    for r in report["rows"]:
        groups.setdefault(r["group"], []).append(r)
    bars = ratio_bars(report)
    heights = ([len(bars)] if bars else []) + [len(rs) for rs in groups.values()]
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(9.5, 0.42 * sum(heights) + 1.0 * len(heights) + 0.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    row_axes = axes[:, 0]
    if bars:
        _plot_ratios(row_axes[0], bars)
        row_axes = row_axes[1:]
    for ax, (group, rs) in zip(row_axes, groups.items(), strict=True):
        rs = rs[::-1]
        med = [r["median"] for r in rs]
        err = [[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]]
        colors = ["#9a9a9a" if r["kind"] == "bare" else "#4878a8" for r in rs]
        ax.barh([r["name"] for r in rs], med, xerr=err, color=colors, capsize=3, height=0.6)
        unit = rs[0]["unit"]
        for y, r in enumerate(rs):
            label = number(r["median"], unit) + (" s" if unit == "s" else "")
            ax.text(r["max"], y, "  " + label, va="center", fontsize=8)
        ax.set_xlim(0, max(r["max"] for r in rs) * 1.18)
        what = {"samples/s": "steady-state samples/s", "x": "ratio"}.get(unit, "seconds")
        ax.set_title(f"{group}: {what} (bar: median, whiskers: min-max)", fontsize=9, loc="left")
        ax.tick_params(axis="y", labelsize=8)
        ax.tick_params(axis="x", labelsize=8)
    m = report["machine"]
    load = " / ".join(f"{m[k][0]:.1f}" for k in ("load_avg_before", "load_avg_after") if k in m)
    title = f"{report['suite']} suite, {_device(m)}, torch {m['torch']}, {report['reps']} "
    title += f"repetitions (grey: hand-written loop)\n1-min load average before / after: {load}"
    _save(plt, fig, title, path)


def _plot_sweep(report: dict, path: Path) -> None:
    """Cost against model size, log-log: step time (dotted: its data wait), tokens/s, and the
    stall per background save (dotted: the write behind it), each at world 1 and world 2."""
    plt = _pyplot(path)
    if plt is None:
        return
    sizes = report["sizes"]
    params = [s["params"] / 1e6 for s in sizes]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    styles = {1: ("#4878a8", "o", "world 1 (2 threads)"), 2: ("#d9822b", "s", "world 2 (2 x 1)")}
    panels = [
        ("step_s", "seconds per step", "step time"),
        ("tokens_per_s", "tokens/s", "throughput"),
        ("stall_per_save_s", "seconds", "checkpoint: stall per save, background write"),
    ]
    for ax, (key, unit, title) in zip(axes, panels, strict=True):
        for world, (color, marker, label) in styles.items():
            pts = [
                (p, s[f"world_{world}"][key])
                for p, s in zip(params, sizes, strict=True)
                if s.get(f"world_{world}") and s[f"world_{world}"].get(key) is not None
            ]
            if not pts:
                continue
            ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=label)
            dotted = {
                "step_s": ("data_wait_s", "data wait"),
                "stall_per_save_s": ("write_s", "write"),
            }
            if key in dotted:
                part, what = dotted[key]
                sub = [
                    (p, s[f"world_{world}"][part])
                    for p, s in zip(params, sizes, strict=True)
                    if s.get(f"world_{world}") and s[f"world_{world}"].get(part) is not None
                ]
                if sub:
                    ax.plot(
                        *zip(*sub, strict=True),
                        linestyle=":",
                        marker=marker,
                        color=color,
                        label=f"{label}: {what}",
                    )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (millions)", fontsize=9)
        ax.set_ylabel(unit, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", linestyle=":", linewidth=0.5)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    m = report["machine"]
    widths = ", ".join(str(s["width"]) for s in sizes)
    title = f"GPT cost against size (widths {widths}), {_device(m)}, torch {m['torch']}, "
    _save(plt, fig, title + f"median of {report['reps']} repetitions", path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--suite",
        choices=(
            "auto",
            "cpu",
            "gpu",
            "busy",
            "ckpt",
            "sweep",
            "headline",
            "parallel",
            "invariant",
            "loader",
            "memory",
            "bucket",
        ),
        default="auto",
        help="auto: gpu on a CUDA machine, else cpu; busy: the alternating trainer / bare rows "
        "beside a background load, a core spinning or a bursty half core (bench/busy.py); "
        "ckpt: checkpoint stall (GPT, 2 processes); "
        "sweep: GPT cost against width at world 1 and 2; headline: GPT-2-small MFU, checkpoint "
        "stall, world_invariant and ResNet-50's data wait on one GPU, once each "
        "(bench/headline.py; --quick: tiny sizes on the CPU); parallel: memory per rank, "
        "pipeline bubble and throughput of pp=2, tp=2 and dp=2 against world 1 (bench/parallel.py); "
        "invariant: world_invariant against plain, the MLP with 8 and 2 shards and the small GPT, "
        "at 1 and 2 processes; loader: the "
        "image-folder loader against a bare torchvision ImageFolder + DataLoader (bench/loader.py); "
        "memory: peak memory a rank under fsdp, pp and tp against world 1, and a deferred build's "
        "time (bench/memory.py); bucket: checkpoint save, restore and background stall to an S3 "
        "server on loopback against local disk (bench/bucket.py)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every row (default 3)")
    parser.add_argument(
        "--quick", action="store_true", help="a few steps a row: checks the machinery, no numbers"
    )
    parser.add_argument("--note", help="a line for the JSON (e.g. what else ran on the machine)")
    parser.add_argument(
        "--only", action="append", metavar="TEXT", help="run only rows whose name starts with TEXT"
    )
    parser.add_argument(
        "--row", action="append", metavar="NAME", help="run only the row named NAME (exactly)"
    )
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.suite == "headline":  # one run per row, its own rows: bench/headline.py
        if args.only:
            parser.error("--only: the headline suite takes --row NAME")
        import headline

        extra = ["--quick"] if args.quick else []
        extra += [a for name in args.row or () for a in ("--row", name)]
        extra += ["--note", args.note] if args.note else []
        return headline.main(["--out", args.out, *extra])
    if args.suite == "parallel":  # model parallel, its own rows: bench/parallel.py
        if args.only:
            parser.error("--only: the parallel suite takes --row NAME")
        import parallel

        extra = ["--quick"] if args.quick else []
        extra += [a for name in args.row or () for a in ("--row", name)]
        extra += ["--note", args.note] if args.note else []
        return parallel.main(["--out", args.out, "--reps", str(args.reps), *extra])
    if args.suite == "loader":  # in-process DataLoaders, its own rows: bench/loader.py
        import loader

        extra = ["--quick"] if args.quick else []
        extra += ["--note", args.note] if args.note else []
        return loader.main(["--out", args.out, "--reps", str(args.reps), *extra])
    if args.suite == "bucket":  # its own runs and S3 server: bench/bucket.py
        import bucket

        extra = ["--quick"] if args.quick else []
        extra += ["--note", args.note] if args.note else []
        return bucket.main(["--out", args.out, *extra])
    if args.suite == "memory":  # its own runs: bench/memory.py
        import memory

        extra = ["--quick"] if args.quick else []
        extra += ["--note", args.note] if args.note else []
        return memory.main(["--out", args.out, *extra])
    if args.row and args.suite != "auto":  # a mistyped name must not write an empty result
        names = {r.name for r in SUITES[args.suite][0]()}
        if unknown := [n for n in args.row if n not in names]:
            parser.error(
                f"--row {unknown[0]!r} is not a row of the {args.suite} suite: {sorted(names)}"
            )
    suite = args.suite
    if suite == "auto":
        import torch

        suite = "gpu" if torch.cuda.is_available() else "cpu"
    print(f"{suite} suite, {args.reps} repetitions, rows round-robin:", flush=True)
    report = run_suite(
        suite, Path(args.out), args.reps, args.quick, args.only, args.note, rows=args.row
    )
    print(report["table"])
    for r in report["rows"]:
        if "mfu_bf16" in r:
            print(f"  MFU (bf16 dense peak) {r['name']:38} {r['mfu_bf16']:6.1%}")
    m = report["machine"]
    print(
        "load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
            *m["load_avg_before"], *m["load_avg_after"]
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
