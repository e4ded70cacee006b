"""Benchmarks: throughput ratios measured side by side in one run, on one machine.

    make bench                                   # the GPU suite on a CUDA machine, else the CPU suite
    python bench/bench.py --suite cpu --out bench/results

Every row is a real run of `python -m trainer train` (or of the bare loop below) on the same
machine, in the same invocation; the table prints ratios against a baseline row, and the JSON
beside it records the machine, library versions and each row's full command. Throughput is the
steady state: the median of the logged windows after the first two (warm-up, torch.compile).

The bare loop is the textbook PyTorch loop on the same model and the same device-resident data
(no sampler, no logging, no checkpoints, no stop checks): trainer / bare is the stack's overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Dense bf16 tensor-core peaks (FLOP/s) for MFU; unknown devices get no MFU column.
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}

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

CPU_BASE = [
    "--config",
    "digits-mlp",
    "train.epochs=100",
    "train.max_steps=600",
    "log.every_steps=50",
    "ckpt.every_epochs=0",
    "log.tensorboard=false",
    "log.progress=plain",
    "dist.device=cpu",
]
CPU_ROWS = [
    ("bare loop, 1 process", "bare", []),
    ("trainer, 1 process", "trainer", []),
    ("trainer, 2 processes (DDP, gloo), same global batch", "trainer2", []),
    ("trainer, 1 process, repro.world_invariant", "trainer", ["repro.world_invariant=true"]),
    ("trainer, 2 processes, repro.world_invariant", "trainer2", ["repro.world_invariant=true"]),
]


# --- the bare loop ----------------------------------------------------------------------------


def bare_loop(overrides: list[str], steps: int, warmup: int) -> dict:
    """The textbook loop on the trainer's own model and data: samples/s over `steps` timed steps."""
    import torch
    import torch.nn.functional as F

    from trainer import config, data, models, optim

    cfg = config.load(None, overrides)
    device = "cuda" if cfg.dist.device != "cpu" and torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    spec = data.build(cfg.data, cfg.seed, "cpu")
    ds = spec.train
    x = data.pixels_to_float(ds.x, ds.mean, ds.std).to(device)
    y = ds.y.to(device)
    model = models.build(cfg.model, spec.in_shape, spec.num_classes).to(device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = optim.build_optimizer(cfg.optim, model.parameters())
    net = torch.compile(model) if cfg.train.compile else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    batch, n = cfg.data.global_batch_size, len(x)
    perm = torch.randperm(n, device=device)

    def step(i: int) -> None:
        start = (i * batch) % (n - batch)
        idx = perm[start : start + batch]
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup):
        step(i)
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(steps):
            step(warmup + i)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        t = time.perf_counter()
        for i in range(steps):
            step(warmup + i)
        seconds = time.perf_counter() - t
    out = {"samples_per_s": steps * batch / seconds}
    if device == "cuda":
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


# --- rows ---------------------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def run_trainer(overrides: list[str], nproc: int, work: Path) -> dict:
    run_dir = work / f"run-{time.monotonic_ns()}"
    args = ["-m", "trainer", "train", *overrides, f"run_dir={run_dir}"]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", f"--nproc-per-node={nproc}", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(
            f"benchmark row failed: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r["samples_per_s"] for r in records if r["kind"] == "train"][2:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "samples_per_s": statistics.median(windows),
        "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
        "command": " ".join(cmd),
    }


def run_bare(overrides: list[str], steps: int, warmup: int) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import bench; "
        f"print(json.dumps(bench.bare_loop({overrides!r}, {steps}, {warmup})))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    if p.returncode != 0:
        raise SystemExit(f"bare loop failed:\n{p.stderr[-3000:]}")
    return {
        **json.loads(p.stdout.strip().splitlines()[-1]),
        "command": f"bench.bare_loop({overrides})",
    }


def flops_per_sample(overrides: list[str]) -> float | None:
    """Forward + backward FLOPs of one sample, counted by torch's FlopCounterMode."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from trainer import config, data, models

    cfg = config.load(None, overrides)
    spec = data.build(cfg.data, cfg.seed, "cpu")
    model = models.build(cfg.model, spec.in_shape, spec.num_classes)
    x = torch.zeros(8, *spec.in_shape)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() / 8


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


def run_suite(suite: str, out: Path) -> dict:
    base, rows = (GPU_BASE, GPU_ROWS) if suite == "gpu" else (CPU_BASE, CPU_ROWS)
    info = machine()
    steps = next(int(a.split("=")[1]) for a in base if a.startswith("train.max_steps="))
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name, kind, extra in rows:
            overrides = [*base, *extra]
            clean = [a for a in overrides if a not in ("--config", "digits-mlp")]
            if kind == "bare":
                row = run_bare(clean, steps=steps - 40, warmup=40)
            else:
                row = run_trainer(overrides, 2 if kind == "trainer2" else 1, Path(work))
            results.append({"name": name, "overrides": overrides, **row})
            print(f"  {name:48} {row['samples_per_s']:12,.0f} samples/s", flush=True)
    fps = flops_per_sample([a for a in base if a not in ("--config", "digits-mlp")])
    peak = next((v for k, v in BF16_PEAK.items() if k in info.get("gpu", "")), None)
    baseline = results[1]["samples_per_s"]  # "trainer fp32" / "trainer, 1 process"
    for r in results:
        r["vs_trainer_baseline"] = r["samples_per_s"] / baseline
        if peak and fps and "bf16" in r["name"]:
            r["mfu_bf16"] = r["samples_per_s"] * fps / peak
    by_name = {r["name"]: r for r in results}
    ratios = {}
    if suite == "gpu":
        ratios["trainer / bare loop, fp32"] = (
            by_name["trainer fp32"]["samples_per_s"] / by_name["bare loop fp32"]["samples_per_s"]
        )
        ratios["trainer / bare loop, bf16+cl+compile"] = (
            by_name["trainer bf16 + channels_last + compile"]["samples_per_s"]
            / by_name["bare loop bf16 + channels_last + compile"]["samples_per_s"]
        )
        ratios["device-resident / host batches, fp32"] = (
            by_name["trainer fp32"]["samples_per_s"]
            / by_name["trainer fp32, host batches (pinned)"]["samples_per_s"]
        )
        ratios["bf16+cl+compile / fp32"] = (
            by_name["trainer bf16 + channels_last + compile"]["samples_per_s"] / baseline
        )
        ratios["world_invariant / plain, deterministic fp32"] = (
            by_name["trainer fp32, repro.deterministic + world_invariant"]["samples_per_s"]
            / by_name["trainer fp32, repro.deterministic"]["samples_per_s"]
        )
    else:
        ratios["trainer / bare loop"] = (
            by_name["trainer, 1 process"]["samples_per_s"]
            / by_name["bare loop, 1 process"]["samples_per_s"]
        )
        ratios["2 processes / 1 process"] = results[2]["samples_per_s"] / baseline
        ratios["world_invariant / plain, 1 process"] = results[3]["samples_per_s"] / baseline
        ratios["world_invariant / plain, 2 processes"] = (
            results[4]["samples_per_s"] / results[2]["samples_per_s"]
        )
    report = {
        "suite": suite,
        "machine": info,
        "flops_per_sample": fps,
        "rows": results,
        "ratios": ratios,
    }
    out.mkdir(parents=True, exist_ok=True)
    slug = (info.get("gpu") or "cpu").replace(" ", "-").lower()
    (out / f"{suite}-{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out / f"{suite}-{slug}.png")
    return report


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"  (matplotlib not installed: no {path.name})")
        return
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ax.barh(
        [r["name"] for r in rows][::-1], [r["samples_per_s"] for r in rows][::-1], color="#4878a8"
    )
    ax.set_xlabel("samples/s (steady state)")
    m = report["machine"]
    ax.set_title(
        f"{report['suite']} suite: {m.get('gpu') or 'CPU x' + str(m['cpu_count'])}, torch {m['torch']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    suite = args.suite
    if suite == "auto":
        import torch

        suite = "gpu" if torch.cuda.is_available() else "cpu"
    print(f"{suite} suite:")
    report = run_suite(suite, Path(args.out))
    print("ratios (measured side by side in this run):")
    for name, value in report["ratios"].items():
        print(f"  {name:42} {value:6.3f}")
    for r in report["rows"]:
        if "mfu_bf16" in r:
            print(f"  MFU (bf16 dense peak) {r['name']:38} {r['mfu_bf16']:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
