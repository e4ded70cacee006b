"""Model parallel, measured side by side on one machine (issue 36, item 7).

    python bench/bench.py --suite parallel              # the CPU measurement: ~15 min on 2 busy cores
    python bench/bench.py --suite parallel --reps 2     # two runs of every row, round-robin
    python bench/bench.py --suite parallel --quick      # every row at tiny sizes: the machinery only

Every row is `python -m trainer train` on the stdlib GPT (`--config stdlib-gpt`, 4 blocks of width
256, 4 heads, 32-byte context, 16 sequences a step: 3.2M parameters, so parameters, gradients
and AdamW's two moments are ~50 MB against activations of a few MB), one thread per process
(OMP_NUM_THREADS=1), 2-process rows under torchrun on gloo:

- layouts: world 1; dp=2 under DDP and under FSDP; pp=2 (1F1B, 4 micro-batches); tp=2. Memory
  per rank is summary.json's `memory` list (parameter, gradient and optimizer bytes this rank
  holds, and its process's peak RSS), compared with world 1's.
- the pipeline bubble: pp=2 under GPipe and 1F1B at m = 2, 4, 8 micro-batches of the same
  16-sequence global batch (train.micro_batch_size = 16 / m), and world 1 running the same
  micro-batches one after another (gradient accumulation, train.micro_batch_size = 16 / m).
  With T the steady-state step time (global batch / samples/s; samples/s the median of a run's
  log windows after the first two, as bench.py takes throughput) and p = 2 stages, each on its
  own core:

      bubble = 1 - (T_1 / p) / T_pp

  the share of a pipeline step that the stages do not spend on the work one process does. Two
  references for T_1: world 1 at the whole batch (`bubble_vs_world1`: what the pipeline loses
  against one process, micro-batching included) and world 1 over the same m micro-batches
  (`bubble`: the pipeline's own loss, which theory's (p - 1) / (m + p - 1) describes; the
  communication between stages and unequal stages add to it).
- throughput of every row, samples/s and its ratio to world 1.

The JSON (bench/results/parallel-<device>.json; --quick: parallel-tiny-<device>.json) records
the machine, its load average before and after and at each run, versions, and each run's
command, windows and memory; it is rewritten after every run, so a run cut short keeps what it
measured. The plot beside it (.png) draws memory per rank against layout (stacked parameter,
gradient and optimizer bytes, peak RSS marked), the bubble against theory and the throughput.
A row that fails is recorded with its error and the others still run.

`--quick` runs every row at tiny sizes (a 2-block GPT of width 32), each rank forked from this
process with torch and the trainer imported (torchrun's environment set by hand: RANK,
WORLD_SIZE, MASTER_ADDR, ...), so a 2-process row costs no interpreter start or torch import;
tests/test_parallel_bench.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (the tests do): machinery.py is beside it
    sys.path.insert(0, str(HERE))
import machinery  # noqa: E402

bench = machinery.load()
ROOT = bench.ROOT
SUITE = "parallel"
P = 2  # pipeline stages, tensor-parallel ranks, data-parallel ranks: every split is in two
MICRO = (2, 4, 8)  # micro-batches per step in the bubble rows
SCHEDULES = ("gpipe", "1f1b")
PP_LAYOUT_M = 4  # the pipeline row that stands for pp=2 in the memory table


@dataclass(frozen=True)
class Sizes:
    layers: int
    width: int
    heads: int
    seq: int
    batch: int  # sequences a step (global)
    steps: int
    every: int  # log window, steps
    train_bytes: int
    test_bytes: int
    timeout: float  # seconds a run may take


FULL = Sizes(layers=4, width=256, heads=4, seq=32, batch=16, steps=12, every=1,
             train_bytes=131072, test_bytes=2048, timeout=420)  # fmt: skip
TINY = Sizes(layers=2, width=32, heads=2, seq=16, batch=8, steps=4, every=1,
             train_bytes=16384, test_bytes=1024, timeout=120)  # fmt: skip

WORLD1, DDP, FSDP, TP = "world 1", "dp=2 DDP", "dp=2 FSDP", "tp=2"


def pp_row(schedule: str, m: int) -> str:
    return f"pp=2 {schedule}, m={m}"


def acc_row(m: int) -> str:
    return f"world 1, m={m} (same micro-batches)"


PP = pp_row("1f1b", PP_LAYOUT_M)
LAYOUTS = {WORLD1: "world 1", DDP: "dp=2 DDP", FSDP: "dp=2 FSDP", PP: "pp=2", TP: "tp=2"}
"""The memory table's layouts: row name -> label."""


def base(s: Sizes) -> tuple[str, ...]:
    return (
        "--config", "stdlib-gpt", f"model.gpt.layers={s.layers}", f"model.gpt.width={s.width}",
        f"model.gpt.heads={s.heads}", f"data.text.seq_len={s.seq}",
        f"data.global_batch_size={s.batch}", f"data.text.max_train_bytes={s.train_bytes}",
        f"data.text.max_test_bytes={s.test_bytes}", f"train.max_steps={s.steps}",
        f"log.every_steps={s.every}", "train.epochs=1000", "sched.warmup_steps=0",
        "ckpt.every_epochs=0", "log.tensorboard=false", "log.progress=plain",
        "dist.device=cpu", "dist.stall_s=0",
    )  # fmt: skip


def rows(s: Sizes) -> list:
    """Layouts first (the memory table), then the bubble rows."""
    b, Row = base(s), bench.Row
    out = [
        Row(WORLD1, "trainer", b, 1, 1, group="layout"),
        Row(DDP, "trainer", (*b, "dist.strategy=ddp"), 2, 1, group="layout"),
        Row(FSDP, "trainer", (*b, "dist.strategy=fsdp"), 2, 1, group="layout"),
        Row(TP, "trainer", (*b, "dist.mesh=tp=2", "dist.strategy=none"), 2, 1, group="layout"),
    ]
    for schedule in reversed(SCHEDULES):  # 1f1b first: its m=4 row is the layout table's pp=2
        for m in MICRO:
            pp = ("dist.mesh=pp=2", f"dist.pp_schedule={schedule}")
            pp += (f"train.micro_batch_size={s.batch // m}",)
            group = "layout" if pp_row(schedule, m) == PP else "pipeline"
            out.append(Row(pp_row(schedule, m), "trainer", (*b, *pp), 2, 1, group=group))
    for m in MICRO:
        acc = (*b, f"train.micro_batch_size={s.batch // m}")
        out.append(Row(acc_row(m), "trainer", acc, 1, 1, group="accumulation"))
    return out


# --- the numbers: pure ----------------------------------------------------------------------------


def theory(m: int, p: int = P) -> float:
    """The pipeline bubble of GPipe and 1F1B alike: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def bubble(t1: float, tpp: float, p: int = P) -> float:
    """1 - (T_1 / p) / T_pp: the share of a p-stage step not spent on one process's work."""
    return 1 - (t1 / p) / tpp


def _ok(results: dict, name: str) -> dict | None:
    r = results.get(name)
    return r if r and r.get("status") == "ok" else None


def _step_s(entry: dict | None, batch: int) -> float | None:
    return batch / entry["median"] if entry and entry["median"] else None


def memory_table(results: dict) -> list[dict]:
    """Per layout: each rank's bytes, the most any rank holds (parameters + gradients + optimizer
    state, and peak RSS), and those against world 1's."""
    ref = _ok(results, WORLD1)
    ref_mem = ref["runs"][0]["memory"][0] if ref else None
    table = []
    for name, label in LAYOUTS.items():
        entry = _ok(results, name)
        if entry is None:
            r = results.get(name)
            table.append({"layout": label, "row": name, "error": (r or {}).get("error", "not run")})
            continue
        mem = entry["runs"][0]["memory"]
        total = max(r["total_bytes"] for r in mem)
        rss = max(r["peak_rss_bytes"] for r in mem)
        table.append({
            "layout": label, "row": name, "ranks": mem, "max_total_bytes": total,
            "max_peak_rss_bytes": rss,
            "total_vs_world1": total / ref_mem["total_bytes"] if ref_mem else None,
            "peak_rss_vs_world1": rss / ref_mem["peak_rss_bytes"] if ref_mem else None,
        })  # fmt: skip
    return table


def bubble_table(results: dict, batch: int) -> list[dict]:
    """Per schedule and m: the measured bubble (against world 1 on the same micro-batches, and
    against world 1 on the whole batch) beside theory."""
    t_whole = _step_s(_ok(results, WORLD1), batch)
    table = []
    for schedule in SCHEDULES:
        for m in MICRO:
            tpp = _step_s(_ok(results, pp_row(schedule, m)), batch)
            t_same = _step_s(_ok(results, acc_row(m)), batch)
            table.append({
                "schedule": schedule, "m": m, "micro_batch_size": batch // m,
                "theory": theory(m), "step_s": tpp, "world1_same_micro_step_s": t_same,
                "world1_step_s": t_whole,
                "bubble": bubble(t_same, tpp) if tpp and t_same else None,
                "bubble_vs_world1": bubble(t_whole, tpp) if tpp and t_whole else None,
            })  # fmt: skip
    return table


def throughput_table(results: dict) -> list[dict]:
    ref = _ok(results, WORLD1)
    out = []
    for name, r in results.items():
        ok = r.get("status") == "ok"
        out.append({
            "row": name, "processes": r["processes"],
            "samples_per_s": r["median"] if ok else None,
            "min": r["min"] if ok else None, "max": r["max"] if ok else None,
            "vs_world1": r["median"] / ref["median"] if ok and ref else None,
            "error": None if ok else r.get("error", "?").strip().splitlines()[0][:300],
        })  # fmt: skip
    return out


def analyse(results: dict, batch: int) -> dict:
    return {
        "memory": memory_table(results),
        "bubble": bubble_table(results, batch),
        "throughput": throughput_table(results),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def markdown(analysis: dict) -> list[str]:
    """The tables docs/benchmarks.md quotes, line by line (tests/test_parallel_bench.py checks
    that the docs hold each line of the committed JSON's tables)."""
    lines = [
        "| layout | ranks | params + grads + optimizer per rank, MiB | max / world 1 "
        "| peak RSS per rank, MiB | max / world 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in analysis["memory"]:
        if "error" in t:
            lines.append(f"| {t['layout']} | | failed | | | |")
            continue
        per = " / ".join(_mib(r["total_bytes"]) for r in t["ranks"])
        rss = " / ".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in t["ranks"])
        lines.append(
            f"| {t['layout']} | {len(t['ranks'])} | {per} | {_x(t['total_vs_world1'])} "
            f"| {rss} | {_x(t['peak_rss_vs_world1'])} |"
        )
    lines += [
        "",
        "| schedule | m | micro-batch | theory (p-1)/(m+p-1) | bubble (same micro-batches) "
        "| bubble vs world 1 | pipeline step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in analysis["bubble"]:
        step = "n/a" if b["step_s"] is None else f"{b['step_s']:.3f} s"
        lines.append(
            f"| {b['schedule']} | {b['m']} | {b['micro_batch_size']} | {b['theory']:.3f} "
            f"| {_x(b['bubble'])} | {_x(b['bubble_vs_world1'])} | {step} |"
        )
    lines += [
        "",
        "| row | processes | samples/s | min-max | / world 1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in analysis["throughput"]:
        if t["samples_per_s"] is None:
            lines.append(f"| {t['row']} | {t['processes']} | failed | | |")
            continue
        lines.append(
            f"| {t['row']} | {t['processes']} | {t['samples_per_s']:.1f} "
            f"| {t['min']:.1f}-{t['max']:.1f} | {_x(t['vs_world1'])} |"
        )
    return lines


# --- running --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forked(cmd: list[str], threads: int | None, timeout: float | None = None):
    """bench.run_row's launcher for --quick: each rank of `[torchrun ...] -m trainer ARGS` as
    cli.main(ARGS) in a child forked from this process (torch and the trainer imported once),
    with the environment torchrun would give it."""
    at = next(i for i in range(len(cmd) - 1) if cmd[i : i + 2] == ["-m", "trainer"])
    args = cmd[at + 2 :]
    nproc = next((int(a.split("=")[1]) for a in cmd[:at] if a.startswith("--nproc-per-node=")), 1)
    env = {}
    if nproc > 1:
        env = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    launched, t = time.time(), time.perf_counter()
    children = {}
    for rank in range(nproc):
        fd, log = tempfile.mkstemp(prefix=f"parallel-rank{rank}-", suffix=".log")
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                if nproc > 1:
                    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
                import torch

                torch.set_num_threads(threads or 1)
                from trainer import cli

                code = cli.main(args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(fd)
        children[pid] = log
    status = {}
    while len(status) < len(children):
        for pid in children.keys() - status.keys():
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = os.waitstatus_to_exitcode(raw)
                if status[pid] != 0:  # torchrun ends the other ranks when one fails
                    for other in children.keys() - status.keys():
                        os.kill(other, signal.SIGKILL)
        if timeout is not None and time.perf_counter() - t > timeout:
            for pid in children.keys() - status.keys():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status[pid] = "timeout"
        time.sleep(0.02)
    wall = time.perf_counter() - t
    text = ""
    for log in children.values():
        text += Path(log).read_text(errors="replace")
        os.unlink(log)
    if bad := [s for s in status.values() if s != 0]:
        what = f"timed out after {timeout:.0f} s" if "timeout" in bad else f"exit {bad[0]}"
        raise SystemExit(f"benchmark row {what}: {' '.join(cmd)}\n{text[-3000:]}")
    return launched, wall, SimpleNamespace(stdout=text, stderr="", returncode=0)


def _entry(row) -> dict:
    return {"name": row.name, "group": row.group, "processes": row.nproc,
            "threads_per_process": row.threads, "unit": row.unit,
            "overrides": list(row.overrides), "runs": [], "errors": []}  # fmt: skip


def run_one(row, work: Path, timeout: float, launch) -> dict:
    """One run of `row`: bench.run_row's result with summary.json's memory list, or
    {"error": ...} (a failed run does not stop the others)."""
    t = time.perf_counter()
    try:
        result = bench.run_row(row, work, timeout=timeout, launch=launch)
        summary = json.loads((Path(result["run_dir"]) / "summary.json").read_text())
        result["memory"] = summary["memory"]
        result["train_time_s"] = summary.get("train_time_s")
    except (SystemExit, Exception) as e:
        text = str(e) if isinstance(e, SystemExit) else traceback.format_exc()
        return {"error": text[-4000:], "seconds": time.perf_counter() - t}
    result["seconds"] = time.perf_counter() - t
    return result


def _finish(entry: dict) -> None:
    """A row's status and its median and spread over its successful runs."""
    values = [r["value"] for r in entry["runs"]]
    for k in ("median", "min", "max", "q1", "q3", "n", "values"):
        entry.pop(k, None)
    if values:
        entry.update(status="ok", **bench.summarize(values))
        entry.pop("error", None)
    else:
        entry.update(status="error", error=entry["errors"][-1] if entry["errors"] else "not run")


def run(
    out: Path, tiny: bool = False, reps: int = 1, names: list[str] | None = None,
    note: str | None = None,
) -> dict:  # fmt: skip
    sizes = TINY if tiny else FULL
    todo = rows(sizes)
    if names:
        todo = [r for r in todo if r.name in names]
    launch = forked if tiny else bench._run
    if launch is forked:  # what every rank imports, imported once before the forks
        import trainer.train  # noqa: F401
    start = time.perf_counter()
    info = bench.machine()
    info["load_avg_before"] = os.getloadavg()
    slug = (info.get("gpu") or "cpu").replace(" ", "-").lower()
    path = out / f"{SUITE}-{'tiny-' if tiny else ''}{slug}{'-rerun' if names else ''}.json"
    out.mkdir(parents=True, exist_ok=True)
    entries = {r.name: _entry(r) for r in todo}
    report = {"suite": SUITE, "tiny": tiny, "reps": reps, "note": note, "machine": info,
              "sizes": {k: v for k, v in vars(sizes).items()}, "stages": P,
              "micro_batches": list(MICRO), "method": METHOD, "rows": list(entries.values())}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="parallel-") as work:
        for rep, i in bench.alternation(len(todo), reps):
            row = todo[i]
            result = run_one(row, Path(work), sizes.timeout, launch)
            result["rep"], result["load_avg_1m"] = rep, os.getloadavg()[0]
            entry = entries[row.name]
            if "error" in result:
                entry["errors"].append(result["error"])
                line = "ERROR: " + result["error"].strip().splitlines()[0][:200]
            else:
                entry["runs"].append(result)
                line = f"{result['value']:10.2f} samples/s ({result['seconds']:.0f} s)"
            _finish(entry)
            print(f"  [{rep + 1}/{reps}] {row.name:36} {line}", flush=True)
            _write(path, report, entries, sizes, start)
    report = _write(path, report, entries, sizes, start)
    _plot(report, path.with_suffix(".png"))
    return report


def _write(path: Path, report: dict, entries: dict, sizes: Sizes, start: float) -> dict:
    report["machine"]["load_avg_after"] = os.getloadavg()
    try:
        report["analysis"] = analyse(entries, sizes.batch)
    except Exception:  # the rows are written whatever happens here
        report["analysis"] = {"error": traceback.format_exc()}
    report["elapsed_s"] = time.perf_counter() - start
    path.write_text(json.dumps(report, indent=2) + "\n")
    return {**report, "path": str(path)}


METHOD = (
    "rows run round-robin, one run of every row per repetition, each `python -m trainer train` "
    "(torchrun --standalone for 2 processes; --quick: ranks forked from the script) with "
    "OMP_NUM_THREADS=1 per process; throughput: the median of a run's logged windows after the "
    f"first {bench.SKIP_WINDOWS}, then the median over repetitions; step time T = global batch / "
    "samples/s; bubble = 1 - (T_1 / p) / T_pp with T_1 world 1 over the same micro-batches "
    "(gradient accumulation), bubble_vs_world1 the same with world 1 over the whole batch; "
    "theory (p - 1) / (m + p - 1); memory: summary.json's per-rank memory of the first run "
    "(parameter, gradient, optimizer bytes held by the rank; peak RSS of its process)."
)


# --- the plot -------------------------------------------------------------------------------------

PARTS = (("param_bytes", "parameters", "#4878a8"), ("grad_bytes", "gradients", "#d9822b"),
         ("optimizer_bytes", "optimizer (AdamW moments)", "#3a8a3a"))  # fmt: skip


def _plot(report: dict, path: Path) -> None:
    plt = bench._pyplot(path)
    analysis = report.get("analysis", {})
    if plt is None or "memory" not in analysis:
        return
    fig, (ax_mem, ax_bub, ax_thr) = plt.subplots(
        1, 3, figsize=(16, 5.2), gridspec_kw={"width_ratios": [1.5, 1, 1.2]}
    )
    # memory per rank, stacked; peak RSS on its own axis
    labels, groups, x, ref = [], [], 0, None
    for t in analysis["memory"]:
        if "error" in t:
            labels.append((x, "failed"))
            groups.append((x, t["layout"]))
            x += 1.4
            continue
        groups.append((x + (len(t["ranks"]) - 1) / 2, t["layout"]))
        for rank, r in enumerate(t["ranks"]):
            bottom = 0.0
            for key, what, color in PARTS:
                mib = r[key] / 2**20
                ax_mem.bar(x, mib, bottom=bottom, color=color, width=0.7,
                           label=what if x == 0 else None)  # fmt: skip
                bottom += mib
            ax_mem.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
            labels.append((x, f"rank {rank}"))
            if t["row"] == WORLD1:
                ref = bottom
            x += 1
        x += 0.4
    if ref:
        ax_mem.axhline(ref / 2, color="#777777", linestyle=":", linewidth=1,
                       label="half of world 1")  # fmt: skip
    ax_mem.set_xticks([p for p, _ in labels], [n for _, n in labels], fontsize=7)
    for at, layout in groups:  # the layout's name under its ranks' bars
        ax_mem.text(at, -0.11, layout, ha="center", va="top", fontsize=8, fontweight="bold",
                    transform=ax_mem.get_xaxis_transform())  # fmt: skip
    ax_mem.set_ylabel("MiB held by the rank", fontsize=9)
    ax_mem.set_title("memory per rank: parameters + gradients + optimizer state", fontsize=9,
                     loc="left")  # fmt: skip
    rss = ax_mem.twinx()
    xs = [p for p, _ in labels]
    rss_values = [r["peak_rss_bytes"] / 2**20 for t in analysis["memory"] if "error" not in t
                  for r in t["ranks"]]  # fmt: skip
    ok_xs = [p for p, n in labels if n != "failed"]
    if rss_values:
        rss.plot(ok_xs, rss_values, "kD", markersize=5, label="peak RSS (right axis)")
        rss.set_ylim(0, max(rss_values) * 1.9)  # the markers below the legend
    rss.set_ylabel("peak RSS of the process, MiB", fontsize=9)
    rss.tick_params(labelsize=8)
    handles = ax_mem.get_legend_handles_labels()
    more = rss.get_legend_handles_labels()
    ax_mem.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7, loc="upper center",
                  ncol=3)  # fmt: skip
    top = max((b.get_height() + b.get_y() for b in ax_mem.patches), default=1)
    ax_mem.set_ylim(0, top * 1.6)
    ax_mem.set_xlim(min(xs, default=0) - 0.6, max(xs, default=0) + 0.6)
    ax_mem.tick_params(axis="y", labelsize=8)
    # the bubble against theory
    ms = list(MICRO)
    ax_bub.plot(ms, [theory(m) for m in ms], "k--", marker="o", label="theory (p-1)/(m+p-1)")
    styles = {"gpipe": ("#4878a8", "s"), "1f1b": ("#d9822b", "^")}
    for schedule in SCHEDULES:
        color, marker = styles[schedule]
        pts = [(b["m"], b["bubble"]) for b in analysis["bubble"]
               if b["schedule"] == schedule and b["bubble"] is not None]  # fmt: skip
        if pts:
            ax_bub.plot(*zip(*pts, strict=True), color=color, marker=marker,
                        label=f"{schedule}, vs world 1 on the same micro-batches")  # fmt: skip
        pts = [(b["m"], b["bubble_vs_world1"]) for b in analysis["bubble"]
               if b["schedule"] == schedule and b["bubble_vs_world1"] is not None]  # fmt: skip
        if pts:
            ax_bub.plot(*zip(*pts, strict=True), color=color, marker=marker, linestyle=":",
                        alpha=0.6, label=f"{schedule}, vs world 1 on the whole batch")  # fmt: skip
    ax_bub.set_xscale("log", base=2)
    ax_bub.set_xticks(ms, [str(m) for m in ms])
    ax_bub.axhline(0, color="#999999", linewidth=0.8)
    ax_bub.set_xlabel("micro-batches per step (m), p = 2 stages", fontsize=9)
    ax_bub.set_ylabel("bubble = 1 - (T_1 / p) / T_pp", fontsize=9)
    ax_bub.set_title("pipeline bubble: measured against theory", fontsize=9, loc="left")
    ax_bub.legend(fontsize=7, loc="upper center")
    ax_bub.set_ylim(min(-0.05, *(b[k] for b in analysis["bubble"] for k in ("bubble",
                    "bubble_vs_world1") if b[k] is not None)) - 0.05, 1.6)  # fmt: skip
    ax_bub.set_yticks([i / 5 for i in range(6)])
    ax_bub.grid(True, linestyle=":", linewidth=0.5)
    ax_bub.tick_params(labelsize=8)
    # throughput
    thr = [t for t in analysis["throughput"]][::-1]
    names = [t["row"] for t in thr]
    values = [t["samples_per_s"] or 0 for t in thr]
    colors = ["#9a9a9a" if t["row"].startswith("world 1") else "#4878a8" for t in thr]
    ax_thr.barh(names, values, color=colors, height=0.6)
    for y, t in enumerate(thr):
        text = "failed" if t["samples_per_s"] is None else (
            f"  {t['samples_per_s']:.1f} ({_x(t['vs_world1'])}x)")  # fmt: skip
        ax_thr.text(t["samples_per_s"] or 0, y, text, va="center", fontsize=7)
    ax_thr.set_xlim(0, max([*values, 1]) * 1.4)
    ax_thr.set_title("throughput, samples/s (x world 1)", fontsize=9, loc="left")
    ax_thr.tick_params(labelsize=7)
    m = report["machine"]
    load = " / ".join(f"{m[k][0]:.1f}" for k in ("load_avg_before", "load_avg_after") if k in m)
    s = report["sizes"]
    title = (
        f"model parallel on {bench._device(m)}, torch {m['torch']}, gloo, 1 thread per process: "
        f"GPT {s['layers']} blocks x width {s['width']}, batch {s['batch']} x {s['seq']} tokens, "
        f"{report['reps']} repetition(s)"
        f"{' (--quick: tiny sizes, not a measurement)' if report['tiny'] else ''}\n"
        f"1-min load average before / after: {load}"
    )
    bench._save(plt, fig, title, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, ranks forked")
    parser.add_argument("--reps", type=int, default=1, help="runs of every row (default 1)")
    parser.add_argument("--row", action="append", metavar="NAME", help="only the row NAME")
    parser.add_argument("--note", help="a line for the JSON (e.g. what else ran)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    known = [r.name for r in rows(TINY)]
    if unknown := [n for n in args.row or () if n not in known]:
        parser.error(f"--row {unknown[0]!r} is not a row of the parallel suite: {known}")
    print(f"parallel suite, {args.reps} repetition(s), rows round-robin:", flush=True)
    report = run(Path(args.out), args.quick, args.reps, args.row, args.note)
    analysis = report["analysis"]
    if "error" in analysis:
        print(analysis["error"])
    else:
        print("\n".join(markdown(analysis)))
    m = report["machine"]
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}"
          .format(*m["load_avg_before"], *m["load_avg_after"]))  # fmt: skip
    failed = [r["name"] for r in report["rows"] if r["status"] != "ok"]
    print(f"wrote {report['path']} in {report['elapsed_s']:.0f} s", end="")
    print(f"; {len(failed)} row(s) failed: {failed}" if failed else "", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
