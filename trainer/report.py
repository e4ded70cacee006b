"""`trainer report RUN_DIR [RUN_DIR ...]`: PNG plots of runs' metrics.jsonl, overlaid, and a
Markdown table (report.md) comparing them.

Reads only what a run leaves in its directory: metrics.jsonl (one JSON object per logged step,
"kind": "train", and per evaluation, "kind": "eval"), summary.json (written when a run finishes)
and run.json (written when it starts). A run still in progress, or killed, has no summary.json:
its world size and strategy come from run.json and its train time is left blank.

matplotlib is imported only when plots are drawn, so `trainer --help` stays instant.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field

from trainer.errors import UsageError

FIGSIZE = (8.0, 4.5)
DPI = 100
"""Every PNG is FIGSIZE * DPI = 800 x 450 pixels."""

_NOT_PLOTTED = ("kind", "step", "epoch", "time")
_EVAL_NOT_PLOTTED = ("eval.count",)

# Per-step fields with a known meaning: (title, y-axis label). Others are plotted under their name.
_KNOWN = {
    "loss": ("Train loss (global mean per step)", "loss"),
    "lr": ("Learning rate", "learning rate"),
    "samples_per_s": ("Throughput (samples/s, all ranks together)", "samples/s"),
    "tokens_per_s": ("Throughput (tokens/s, all ranks together)", "tokens/s"),
    "mfu": ("Model FLOPs utilisation", "MFU"),
}
_STYLES = ("-", "--", ":", "-.")
"""Line styles in turn: runs with identical curves (world_invariant) stay visible."""
_FILE = {"loss": "loss", "lr": "lr", "samples_per_s": "throughput"}


@dataclass
class RunMetrics:
    """What a run directory holds, as read from its files (its metrics, summary.json and
    run.json): one run as the report sees it, not trainer.run.Run, the run being trained."""

    path: str
    world_size: int | None
    strategy: str | None
    summary: dict | None
    train: list[dict]
    eval: list[dict]
    notes: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path)) or self.path

    def series(self, key: str, kind: str = "train") -> tuple[list[int], list[float]]:
        """(steps, values) of the records of `kind` that hold a finite number under `key`."""
        steps, values = [], []
        for r in self.train if kind == "train" else self.eval:
            v = r.get(key)
            if _number(v):
                steps.append(r["step"])
                values.append(float(v))
        return steps, values

    def median(self, key: str) -> float | None:
        values = self.series(key)[1]
        return statistics.median(values) if values else None

    def last(self, key: str, kind: str = "train") -> float | None:
        values = self.series(key, kind)[1]
        return values[-1] if values else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_json(path: str) -> dict | None:
    """A JSON object file, or None when it is missing or unreadable (an optional extra)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_metrics(path: str) -> tuple[list[dict], list[str]]:
    """The records of a metrics.jsonl, and notes about lines skipped.

    A last line cut short (a run killed mid-write) is skipped with a note; a bad line anywhere
    else means the file is damaged, and stops the report in one line.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path} ({e.strerror}): check its permissions") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    records, notes = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict) or not _number(record.get("step")):
                raise ValueError("not a record with a step")
        except ValueError:
            if n == len(lines):
                notes.append(
                    f"note: {path}: skipped line {n}, the last, which is cut short or not a "
                    "record (a run killed mid-write)"
                )
                continue
            raise UsageError(
                f"{path}: line {n} is not a metrics record (the file is damaged): delete that "
                "line, or leave this run out of the report"
            ) from None
        records.append(record)
    return records, notes


def _last_per_step(records: list[dict]) -> list[dict]:
    """One record per step (the last written wins: a resumed run rewrites its tail), by step."""
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def load_run(path: str) -> RunMetrics:
    """Read a run directory; UsageError (one line: the problem and the fix) if it is not one."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such directory: give the run_dir of a `trainer train` run")
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory: give the run_dir of a `trainer train` run")
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise UsageError(
            f"{path} has no metrics.jsonl: give a run_dir of `trainer train` (rank 0 writes "
            "metrics.jsonl from its first logged step)"
        )
    records, notes = read_metrics(metrics)
    train = _last_per_step([r for r in records if r.get("kind") == "train"])
    evals = _last_per_step([r for r in records if r.get("kind") == "eval"])
    if not train:
        raise UsageError(
            f"{metrics} holds no train records yet: wait for the run's first logged step "
            "(log.every_steps), or leave this run out"
        )
    summary = _read_json(os.path.join(path, "summary.json"))
    info = summary or _read_json(os.path.join(path, "run.json")) or {}
    world = info.get("world_size")
    return RunMetrics(
        path=path,
        world_size=world if isinstance(world, int) else None,
        strategy=info.get("strategy") if isinstance(info.get("strategy"), str) else None,
        summary=summary,
        train=train,
        eval=evals,
        notes=notes,
    )


def label_runs(runs: list[RunMetrics]) -> None:
    """Short legend labels: the directory name and world size ("lr-0.1 w2"), made unique."""

    def label(run: RunMetrics, name: str) -> str:
        return f"{name} w{run.world_size}" if run.world_size is not None else name

    labels = [label(r, r.name) for r in runs]
    for i, run in enumerate(runs):
        if labels.count(labels[i]) > 1:  # same folder name under different parents
            parent = os.path.basename(os.path.dirname(os.path.abspath(run.path)))
            labels[i] = label(run, f"{parent}/{run.name}")
    seen: dict[str, int] = {}
    for i, text in enumerate(labels):
        seen[text] = seen.get(text, 0) + 1
        if labels.count(text) > 1:
            labels[i] = f"{text} ({seen[text]})"
    for run, text in zip(runs, labels, strict=True):
        run.label = text


def train_keys(runs: list[RunMetrics]) -> list[str]:
    """The numeric per-step train fields any run logged, known ones first."""
    found = []
    for run in runs:
        for r in run.train:
            for k, v in r.items():
                if k not in _NOT_PLOTTED and k not in found and _number(v):
                    found.append(k)
    return [k for k in _KNOWN if k in found] + [k for k in found if k not in _KNOWN]


def eval_keys(runs: list[RunMetrics]) -> list[str]:
    """The eval.* metrics any run logged, loss first."""
    found = []
    for run in runs:
        for r in run.eval:
            for k, v in r.items():
                fresh = k.startswith("eval.") and k not in _EVAL_NOT_PLOTTED and k not in found
                if fresh and _number(v):
                    found.append(k)
    return sorted(found, key=lambda k: (k != "eval.loss", found.index(k)))


def constant_evals(runs: list[RunMetrics]) -> dict[str, float]:
    """{eval key: its value} for the eval metrics with one same value at every evaluation of
    every run (two evaluations at least): a flat line says nothing, so they are not plotted;
    report.md's table keeps them (a summarize that returns a count, a setting)."""
    found = {}
    for key in eval_keys(runs):
        values = [v for run in runs for v in run.series(key, "eval")[1]]
        if len(values) > 1 and len(set(values)) == 1:
            found[key] = values[0]
    return found


def _unit_label(key: str) -> str:
    if key.endswith("_ms"):
        return f"{key} (ms)"
    if key.endswith("_per_s"):
        return f"{key} (per second)"
    if key.endswith("_s"):
        return f"{key} (s)"
    return key


def _file_name(key: str) -> str:
    if key in _FILE:
        return f"{_FILE[key]}.png"
    return re.sub(r"[^A-Za-z0-9_-]+", "_", key).strip("_") + ".png"


def _positive_and_wide(values: list[float]) -> bool:
    """Whether a log scale suits these values: all positive, spanning more than a factor of 10."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > 10


def figures(runs: list[RunMetrics]) -> dict[str, object]:
    """{file name: matplotlib Figure}: one figure per quantity, every run that has it overlaid."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter, StrMethodFormatter

    out = {}

    def draw(key: str, kind: str, title: str, ylabel: str):
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        ax = fig.add_subplot()
        every = []
        for i, run in enumerate(runs):
            steps, values = run.series(key, kind)
            if not steps:
                continue
            every += values
            marker = "os^D"[i % 4] if kind == "eval" or len(steps) < 3 else ""
            style = marker + _STYLES[i % len(_STYLES)]
            ax.plot(steps, values, style, label=run.label, markersize=4, linewidth=1.8)
        if not every:
            return
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        if ("loss" in key or key in ("eval.mse", "eval.perplexity")) and _positive_and_wide(every):
            ax.set_yscale("log")
            ax.set_ylabel(f"{ylabel} (log scale)")
        elif key == "mfu" and max(every) <= 1:
            ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
            ax.set_ylim(bottom=0)
        elif key in ("samples_per_s", "tokens_per_s"):
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
        elif key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(loc="best", fontsize="small", title="run (world size)")
        out[_file_name(key if kind == "train" else key.replace(".", "_"))] = fig

    for key in train_keys(runs):
        title, ylabel = _KNOWN.get(key, (key, _unit_label(key)))
        draw(key, "train", title, ylabel)
    flat = constant_evals(runs)
    for key in eval_keys(runs):
        if key not in flat:
            name = key.removeprefix("eval.")
            draw(key, "eval", f"Eval {name} (test split)", name)
    if panel := rank_panel(runs):
        out["ranks.png"] = panel
    return out


def rank_tables(runs: list[RunMetrics]) -> list[tuple[RunMetrics, list[dict]]]:
    """(run, summary.json's per-rank rows) for the runs of more than one rank that have them."""
    found = []
    for run in runs:
        rows = (run.summary or {}).get("ranks")
        if isinstance(rows, list) and len(rows) > 1 and all(isinstance(r, dict) for r in rows):
            found.append((run, rows))
    return found


def rank_panel(runs: list[RunMetrics]):
    """Per rank, mean forward and data-wait milliseconds a step, one panel per run; a rank named
    a straggler has its bar outlined in red and labelled. None if no run has several ranks."""
    from matplotlib.figure import Figure

    tables = rank_tables(runs)
    if not tables:
        return None
    fig = Figure(figsize=(FIGSIZE[0], 2.6 * len(tables) + 0.6), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(tables), 1, squeeze=False)[:, 0]
    for ax, (run, rows) in zip(axes, tables, strict=True):
        ranks = [r.get("rank", i) for i, r in enumerate(rows)]
        fwd = [float(r.get("forward_ms_per_step") or 0) for r in rows]
        wait = [float(r.get("data_wait_ms_per_step") or 0) for r in rows]
        x = range(len(rows))
        bars = {
            "compute": ax.bar([i - 0.2 for i in x], fwd, 0.4, label="forward"),
            "data": ax.bar([i + 0.2 for i in x], wait, 0.4, label="data wait"),
        }
        if ax is axes[0]:  # one legend, beside the panels: inside, it covered bars and labels
            fig.legend(  # made before the outlines: plain swatches
                handles=list(bars.values()), loc="outside right upper", fontsize="small"
            )
        for i, r in enumerate(rows):
            for kind in r.get("straggler") or []:
                bar = bars[kind][i] if kind in bars else None
                if bar is None:
                    continue
                bar.set_edgecolor("red")
                bar.set_linewidth(2)
                ax.annotate(
                    f"straggler ({kind})",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    color="red",
                    fontsize="small",
                )
        ax.set_ylim(0, 1.25 * max([*fwd, *wait, 1e-3]))
        ax.set_xticks(list(x), [str(r) for r in ranks])
        ax.set_xlabel("rank")
        ax.set_ylabel("ms per step")
        ax.set_title(f"Per rank: {run.label}")
        ax.grid(True, axis="y", alpha=0.3)
    return fig


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "–"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


@dataclass(frozen=True)
class _Columns:
    """The columns of report.md's table of runs: the optional ones only when some run logged
    them, and the first run's median throughput, which the "vs first" ratios divide by."""

    evals: list[str]
    tokens: bool
    mfu: bool
    base: float | None

    @classmethod
    def of(cls, runs: list[RunMetrics]) -> _Columns:
        return cls(
            evals=eval_keys(runs),
            tokens=any(r.median("tokens_per_s") is not None for r in runs),
            mfu=any(r.median("mfu") is not None for r in runs),
            base=runs[0].median("samples_per_s"),
        )

    def head(self) -> list[str]:
        head = ["run", "world size", "strategy", "steps", "final train loss"]
        head += [f"final eval {k.removeprefix('eval.')}" for k in self.evals]
        head += ["median samples/s", "vs first"]
        head += ["median tokens/s"] if self.tokens else []
        head += ["train time (s)"]
        head += ["median MFU"] if self.mfu else []
        return head

    def row(self, run: RunMetrics) -> list[str]:
        median = run.median("samples_per_s")
        ratio = f"{median / self.base:.2f}x" if median is not None and self.base else "–"
        steps = run.summary.get("steps") if run.summary else None
        steps = steps if isinstance(steps, int) else run.train[-1]["step"]
        train_time = run.summary.get("train_time_s") if run.summary else None
        row = [
            run.label,
            str(run.world_size) if run.world_size is not None else "?",
            run.strategy or "?",
            str(steps),
            _fmt(run.last("loss")),
        ]
        row += [_fmt(run.last(k, "eval")) for k in self.evals]
        row += [_fmt(median), ratio]
        row += [_fmt(run.median("tokens_per_s"))] if self.tokens else []
        row += [f"{train_time:.1f}" if _number(train_time) else "– (unfinished)"]
        if self.mfu:
            mfu = run.median("mfu")
            row += ["–" if mfu is None else f"{mfu:.1%}" if mfu <= 1 else _fmt(mfu)]
        return row


def _table_line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _runs_table(runs: list[RunMetrics]) -> list[str]:
    """The table of runs (a row per run), what its columns mean, and each run's folder."""
    columns = _Columns.of(runs)
    head = columns.head()
    return [
        _table_line(head),
        _table_line("---" if i < 3 else "---:" for i in range(len(head))),
        *(_table_line(columns.row(run)) for run in runs),
        "",
        "Final train loss: the last train record (mean over its logging window). Final eval: the "
        "last evaluation. Medians are over the logged windows (the first includes warm-up). "
        f'"vs first": median samples/s over {runs[0].label}\'s. Train time excludes eval and '
        "checkpoints (summary.json; blank while a run has not finished).",
        "",
        "Runs:",
        "",
        *(f"- {run.label}: `{run.path}`" for run in runs),
    ]


def _rank_table(run: RunMetrics, rows: list[dict]) -> list[str]:
    """One run's per-rank table (summary.json's ranks), a straggler named in its own column."""
    lines = [
        "",
        f"Per rank, {run.label} (mean ms a step; a straggler is slow for several windows):",
        "",
        "| rank | node | host | forward | data wait | straggler |",
        "| ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        cells = [r.get("rank"), r.get("node", "–"), r.get("host", "–")]
        cells += [
            _fmt(r.get("forward_ms_per_step"), 3),
            _fmt(r.get("data_wait_ms_per_step"), 3),
        ]
        cells.append(", ".join(r.get("straggler") or []) or "–")
        lines.append(_table_line(cells))
    return lines


def markdown(runs: list[RunMetrics], images: list[str]) -> str:
    """report.md: a table row per run, ratios of median throughput to the first run's, the plots."""
    lines = ["# Training report", "", *_runs_table(runs)]
    for run, rows in rank_tables(runs):
        lines += _rank_table(run, rows)
    notes = [n for run in runs for n in run.notes]
    notes += [
        f"{key.removeprefix('eval.')} is {_fmt(value)} at every evaluation: not plotted"
        for key, value in constant_evals(runs).items()
    ]
    if notes:
        lines += ["", "Notes:", "", *(f"- {n.removeprefix('note: ')}" for n in notes)]
    lines += ["", *(f"![{os.path.splitext(p)[0]}]({p})" for p in images)]
    return "\n".join(lines) + "\n"


def default_out(run_dirs: list[str]) -> str:
    return os.path.join(run_dirs[0], "report")


def write_report(run_dirs: list[str], out: str | None = None, note=print) -> list[str]:
    """Read the runs, write OUT/*.png and OUT/report.md; the paths written (report.md last)."""
    try:
        import matplotlib  # noqa: F401  (a dependency; a --no-deps install may lack it)
    except ImportError:
        raise UsageError(
            "trainer report draws with matplotlib, which is not installed here: "
            "pip install matplotlib"
        ) from None
    runs = [load_run(p) for p in run_dirs]
    for run in runs:
        for n in run.notes:
            note(n)
    label_runs(runs)
    out = out or default_out(run_dirs)
    _writable(out)
    figs = figures(runs)
    written = []
    try:
        for name, fig in figs.items():
            path = os.path.join(out, name)
            fig.savefig(path, dpi=DPI)
            written.append(path)
        path = os.path.join(out, "report.md")
        with open(path, "w", encoding="utf-8") as f:
            f.write(markdown(runs, list(figs)))
        written.append(path)
    except OSError as e:
        raise UsageError(
            f"cannot write the report in {out} ({e.strerror}): free space, or pass -o a "
            "writable folder"
        ) from None
    return written


def _writable(out: str) -> None:
    """Create `out`, or raise UsageError naming it and the fix (-o)."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UsageError(
            f"cannot write the report in {out} ({why}): pass -o a writable folder"
        ) from None
