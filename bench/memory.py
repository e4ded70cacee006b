"""Memory a rank, side by side in one run: a GPT's peak resident memory per rank under FSDP dp=2
and dp=4, pp=2 and tp=2 against world 1, the fixed per-process part (the same layout with a tiny
model) apart from the model's; and the build time of a deferred model against a whole one.

    python bench/bench.py --suite memory            # ~6 min on 2 CPU cores
    python bench/memory.py --quick                  # tiny sizes: checks the machinery

Every run goes through `python -m trainer train` under torchrun's variables (fresh processes,
one thread each); the peak is each rank's VmHWM from summary.json (measured after the final
save). Writes bench/results/memory-cpu.json and memory-cpu.png.
"""

from __future__ import annotations

import json
import os
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

SIZE = ["model.gpt.width=768", "model.gpt.layers=16", "model.gpt.heads=12"]
QUICK = ["model.gpt.width=64", "model.gpt.layers=4", "model.gpt.heads=4"]
TINY = ["model.gpt.width=32", "model.gpt.layers=4", "model.gpt.heads=2"]
RUN = [
    "--config", "stdlib-gpt", "optim.name=adamw", "train.max_steps=2", "train.micro_batch_size=2",
    "data.global_batch_size=8", "data.text.seq_len=64", "data.text.max_train_bytes=20000",
    "data.text.max_test_bytes=1024", "data.eval_batch_size=8", "log.progress=none",
    "log.tensorboard=false", "ckpt.every_steps=0", "ckpt.every_epochs=0", "ckpt.every_minutes=0",
]  # fmt: skip
LAYOUTS = [
    ("world 1", [], 1),
    ("fsdp dp=2", ["dist.strategy=fsdp"], 2),
    ("fsdp dp=4", ["dist.strategy=fsdp"], 4),
    ("pp=2", ["dist.mesh=pp=2"], 2),
    ("tp=2", ["dist.mesh=tp=2"], 2),
]


def _env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's variables, one thread a rank, no GPU."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
    out = {k: v for k, v in os.environ.items() if k not in drop}
    return {**out, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(args: list[str], nproc: int) -> list[dict]:
    """summary.json's memory, per rank, of a run on nproc ranks started here."""
    env = _env
    with tempfile.TemporaryDirectory() as folder:
        common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
        cmd = [sys.executable, "-m", "trainer", "train", *args, f"run_dir={folder}/run"]
        procs = [
            subprocess.Popen(cmd, env=env(**common, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(nproc)
        ]  # fmt: skip
        for p in procs:
            _, err = p.communicate(timeout=1800)
            if p.returncode:
                raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {err[-2000:]}")
        return json.loads(Path(folder, "run", "summary.json").read_text())["memory"]


def _build_times(size: list[str]) -> dict:
    """Seconds to build the model whole, and deferred then materialized whole (one process)."""
    code = f"""
import time, torch, json
from trainer import config, deferred
from trainer.gpt import GPT
cfg = config.load("stdlib-gpt", {size!r})
g = cfg.model.gpt
args = (256, 64, g.layers, g.width, g.heads)
t = time.perf_counter(); torch.manual_seed(0); GPT(*args); whole = time.perf_counter() - t
t = time.perf_counter(); torch.manual_seed(0); m, later = deferred.build(GPT, *args)
built = time.perf_counter() - t
later.materialize(m, "cpu"); both = time.perf_counter() - t
print(json.dumps({{"whole_s": whole, "deferred_build_s": built, "deferred_materialized_s": both}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> dict:
    size = QUICK if quick else SIZE
    rows = []
    for name, layout, nproc in LAYOUTS:
        big = _ranks([*RUN, *size, *layout], nproc)
        fixed = _ranks([*RUN, *TINY, *layout], nproc)
        peak = max(m["peak_rss_bytes"] for m in big)
        base = max(m["peak_rss_bytes"] for m in fixed)
        rows.append({"layout": name, "ranks": nproc, "peak_bytes": peak, "fixed_bytes": base,
                     "model_bytes": peak - base, "per_rank": big})  # fmt: skip
        print(f"{name:>10}: peak {peak / 2**20:,.0f} MiB = fixed {base / 2**20:,.0f} + model part "
              f"{(peak - base) / 2**20:,.0f} MiB", flush=True)  # fmt: skip
    one = rows[0]
    for row in rows:
        row["peak_vs_world_1"] = row["peak_bytes"] / one["peak_bytes"]
        row["model_part_vs_world_1"] = row["model_bytes"] / max(1, one["model_bytes"])
    return {"rows": rows, "build": _build_times(size), "size": size}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [r["layout"] for r in rows]
    fixed = [r["fixed_bytes"] / 2**20 for r in rows]
    model = [r["model_bytes"] / 2**20 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, fixed, label="fixed part (tiny model, same layout)", color="#bbbbbb")
    ax.bar(names, model, bottom=fixed, label="model part", color="#4477aa")
    for i, r in enumerate(rows):
        ax.text(i, fixed[i] + model[i], f"{r['model_part_vs_world_1']:.2f}x", ha="center",
                va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel("peak resident memory of the largest rank (MiB)")
    ax.set_title("GPT, AdamW, 2 steps: peak per rank (model part vs world 1 above each bar)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    report, path = machinery.suite_main(argv, __doc__, run, _plot, "memory-cpu", "memory-tiny-cpu")
    b = report["build"]
    print(f"build: whole {b['whole_s']:.2f} s, deferred {b['deferred_build_s']:.2f} s "
          f"+ materialized {b['deferred_materialized_s']:.2f} s; {path}.json, .png")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
