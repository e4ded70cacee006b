"""bench/bench.py: the pure parts (windows, medians, alternation, ratios) and a tiny end-to-end run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import children

ROOT = Path(__file__).resolve().parents[1]


def _load(script: str):
    """bench/<script>.py as a module of its own (the bench scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"{script}_under_test", ROOT / "bench" / f"{script}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


bench = _load("bench")


def test_steady_drops_the_warm_up_windows_and_takes_the_median():
    assert bench.steady([1.0, 2.0, 10.0, 30.0, 20.0]) == 20.0
    assert bench.steady([1.0, 2.0, 10.0, 30.0]) == 20.0  # even count: the mean of the middle two
    assert bench.steady([5.0, 7.0]) == 7.0  # too short to drop both: the last window
    with pytest.raises(ValueError):
        bench.steady([])


def test_summarize_median_and_spread():
    s = bench.summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5
    assert (s["min"], s["max"]) == (1.0, 10.0)
    assert s["q1"] == 1.75 and s["q3"] == 4.75  # inclusive quartiles
    assert s["n"] == 4 and s["values"] == [3.0, 1.0, 2.0, 10.0]  # run order kept
    one = bench.summarize([4.0])
    assert one["median"] == one["min"] == one["max"] == one["q1"] == one["q3"] == 4.0


def test_alternation_is_round_robin():
    assert bench.alternation(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    order = bench.alternation(13, 3)
    assert len(order) == 39 and len(set(order)) == 39
    # every row runs once per repetition before any row runs again
    assert [i for _, i in order[:13]] == list(range(13))


def test_ratios_of_medians_with_per_rep_range_and_missing_rows_left_out():
    summaries = {
        "a": bench.summarize([90.0, 100.0, 80.0]),
        "b": bench.summarize([100.0, 100.0, 100.0]),
    }
    specs = [("a / b", "a", "b", 0.97), ("a / missing", "a", "c", None)]
    r = bench.ratios(summaries, specs)
    assert list(r) == ["a / b"]
    assert r["a / b"]["value"] == pytest.approx(0.9)
    assert (r["a / b"]["per_rep_min"], r["a / b"]["per_rep_max"]) == (0.8, 1.0)
    assert r["a / b"]["target"] == 0.97
    table = bench.format_table([bench.Row("a", "trainer"), bench.Row("b", "bare")], summaries, r)
    assert "a / b" in table and "0.900" in table and "[0.800-1.000]" in table and ">= 0.97" in table


def test_the_paired_statistic_is_the_geometric_mean_of_the_per_rep_ratios_with_a_t_interval():
    summaries = {
        "a": bench.summarize([99.0, 90.0, 110.0, 101.0]),
        "b": bench.summarize([100.0, 90.0, 112.0, 100.0]),
    }
    r = bench.ratios(summaries, [("a / b", "a", "b", 0.97)])["a / b"]
    per_rep = [0.99, 1.0, 110.0 / 112.0, 1.01]
    logs = [math.log(x) for x in per_rep]
    half = 2.353 * statistics.stdev(logs) / math.sqrt(4)  # t(0.95, 3 degrees of freedom)
    assert r["paired"] == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (r["ci90_lo"], r["ci90_hi"]) == pytest.approx(
        (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    )
    # Per-repetition noise that hits both rows alike leaves a narrow interval, wider than the
    # rows' own spread would say: 0.970 <= it, so the repetitions clear the target.
    assert 0.97 < r["ci90_lo"] < r["paired"] < r["ci90_hi"] < 1.02 and bench.clears(r)
    assert not bench.clears({**r, "target": 0.99})
    assert bench.clears({**r, "target": None}) is None
    assert bench.clears({**r, "at_most": True, "target": 1.05})
    one = bench.paired([0.9])
    assert one["paired"] == pytest.approx(0.9) and one["ci90_lo"] is None
    rows = [bench.Row("a", "trainer"), bench.Row("b", "bare")]
    table = bench.format_table(rows, summaries, {"a / b": r})
    assert f"{r['paired']:.3f} [{r['ci90_lo']:.3f}-{r['ci90_hi']:.3f}]" in table


def test_metrics_jsonl_windows_and_first_step():
    lines = [
        {"kind": "train", "step": 1, "samples_per_s": 10.0, "time": 100.5},
        {"kind": "eval", "step": 1, "eval.loss": 1.0, "time": 101.0},
        {"kind": "train", "step": 2, "samples_per_s": 20.0, "time": 102.0},
    ]
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    assert bench.train_windows(text) == [10.0, 20.0]
    assert bench.first_step_time(text) == 100.5
    later = "\n".join(json.dumps(r) for r in lines[2:])
    assert bench.first_step_time(later) is None  # first record is not step 1: no startup number


def test_every_ratio_names_rows_of_its_suite_and_quick_shortens_runs():
    suites = (
        (bench.cpu_rows(), bench.CPU_RATIOS),
        (bench.gpu_rows(), bench.GPU_RATIOS),
        (bench.ckpt_rows(), bench.CKPT_RATIOS),
        (bench.sweep_rows(), bench.sweep_ratios()),
    )
    for rows, specs in suites:
        names = {r.name for r in rows}
        assert len(names) == len(rows)
        for _, num, den, _ in specs:
            assert num in names and (den in names or den is None)
    for row in bench.cpu_rows():
        q = bench.quick(row)
        if row.kind != "help":
            assert bench._override(q.overrides, "train.max_steps") <= 60
    gpt = {r.name: r for r in bench.cpu_rows()}
    for world, threads in ((1, 2), (2, 1)):  # trainer / bare alternating, as the trainer runs
        rows = [r for r in bench.cpu_rows() if r.name.startswith("GPT") and r.nproc == world]
        ours, both = rows
        assert (ours.kind, both.kind) == ("trainer", "interleaved")
        assert ours.overrides == both.overrides and ours.threads == both.threads == threads
    assert gpt["GPT trainer, 1 process x 2 threads"].threads == 2
    assert gpt["GPT trainer, 2 processes x 1 thread"].nproc == 2
    assert gpt["GPT trainer, 2 processes x 1 thread"].threads == 1
    first = gpt["trainer, 1 process: to 1st step"].overrides
    assert "train.max_steps=1" in first and "log.every_steps=1" in first
    assert not any(a in first for a in ("train.max_steps=600", "log.every_steps=50"))


def test_checkpoint_stalls_leave_out_the_final_save_and_an_at_most_target_is_met_below():
    lines = [
        {"kind": "checkpoint", "step": 2, "reason": "every_steps", "seconds": 0.2},
        {"kind": "checkpoint_written", "step": 2, "seconds": 3.0, "waited": 0.0},
        {"kind": "train", "step": 3, "samples_per_s": 5.0},
        {"kind": "checkpoint", "step": 4, "reason": "every_steps", "seconds": 0.4},
        {"kind": "checkpoint", "step": 6, "reason": "final", "seconds": 3.5},
    ]
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    assert bench.checkpoint_stalls(text) == ([0.2, 0.4], [3.0])
    summaries = {"bg": bench.summarize([0.3, 0.2]), "block": bench.summarize([3.0, 2.0])}
    specs = [("bg / block", "bg", "block", ("<=", 0.10)), ("block / bg", "block", "bg", 0.5)]
    r = bench.ratios(summaries, specs)
    assert r["bg / block"]["value"] == pytest.approx(0.1) and r["bg / block"]["at_most"]
    assert bench.meets(r["bg / block"]) and bench.meets(r["block / bg"])
    r["bg / block"]["value"] = 0.11
    assert not bench.meets(r["bg / block"])
    rows = [bench.Row("bg", "trainer", metric="ckpt_stall_s"), bench.Row("block", "trainer")]
    assert "<= 0.10" in bench.format_table(rows, summaries, r)


@pytest.mark.slow
def test_the_ratio_panel_colours_each_ratio_by_its_target():
    summaries = {n: bench.summarize(v) for n, v in
                 {"a": [90.0, 100.0], "b": [100.0, 100.0], "c": [99.0, 98.0]}.items()}  # fmt: skip
    specs = [("a / b", "a", "b", 0.97), ("c / b", "c", "b", 0.97), ("b / a", "b", "a", None)]
    bars = bench.ratio_bars({"ratios": bench.ratios(summaries, specs)})
    assert [(b["name"], b["color"], b["target"]) for b in bars] == [
        ("a / b", bench.MISSED, 0.97),
        ("c / b", bench.MET, 0.97),
        ("b / a", bench.NO_TARGET, None),
    ]
    assert (bars[0]["lo"], bars[0]["value"], bars[0]["hi"]) == pytest.approx((0.9, 0.95, 1.0))


@pytest.mark.slow  # ~25 s of processes; bench/ is not trainer code (make test-quick skips it)
@pytest.mark.long
def test_quick_suite_end_to_end(tmp_path):
    """One repetition of the 1-process rows with a few steps each, and the interleaved row at
    world 2 (the bare DDP loop in the trainer's process group): JSON, PNG and table."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--suite", "cpu", "--reps", "1"]
    cmd += ["--quick", "--out", str(tmp_path), "--row", "bare loop, 1 process", "--row"]
    cmd += ["trainer, 1 process", "--only", "trainer --", "--row", bench.INTERLEAVED[1]]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "cpu-cpu.json").read_text())
    names = [r["name"] for r in report["rows"]]
    assert names == [
        "bare loop, 1 process",
        "trainer, 1 process",
        bench.INTERLEAVED[1],
        "trainer --help",
    ]
    for row in report["rows"]:
        assert row["n"] == 1 and row["median"] > 0
    (run,) = report["rows"][2]["runs"]  # 60 steps: 6 windows of 10, the first 2 left out
    assert len(run["bare_windows"]) == 6 and len(run["pairs"]) == 4
    separate = "trainer / bare, world 1, separate processes"
    assert list(report["ratios"]) == [bench.INTERLEAVED[1], separate]
    assert (tmp_path / "cpu-cpu.png").stat().st_size > 0
    assert "trainer / bare, world 1" in p.stdout


def test_the_sweep_spans_ten_times_the_parameters_and_splits_each_step(tmp_path):
    rows = bench.sweep_rows()
    assert len(rows) == 2 * len(bench.SWEEP_WIDTHS) >= 6
    results = []
    for i, row in enumerate(rows):  # made-up measurements: 100 + i sequences/s, 10% data wait
        run = {"data_wait_pct": 10.0, "ckpt_stall_s": 0.01 * (i + 1), "writes_s": [0.5, 0.7]}
        results.append({"overrides": list(row.overrides), "processes": row.nproc,
                        "median": 100.0 + i, "runs": [run]})  # fmt: skip
    sizes = bench.sweep_sizes(results)
    params = [s["params"] for s in sizes]
    assert params == sorted(params) and params[-1] >= 10 * params[0]
    first = sizes[0]["world_1"]
    assert first["tokens_per_s"] == pytest.approx(100.0 * 64)  # sequences of 64 bytes
    assert first["step_s"] == pytest.approx(16 / 100.0)  # 16 sequences a step
    assert first["data_wait_s"] == pytest.approx(0.1 * first["step_s"])
    assert first["data_wait_s"] + first["compute_comm_s"] == pytest.approx(first["step_s"])
    assert (first["stall_per_save_s"], first["write_s"]) == pytest.approx((0.01, 0.6))
    assert sizes[0]["world_2"]["tokens_per_s"] == pytest.approx(101.0 * 64)
    table = bench.format_sweep(sizes)
    assert len(table.splitlines()) == 1 + len(rows) and f"{params[-1]:,}" in table
    machine = {"cpu_count": 2, "torch": "x"}
    bench._plot_sweep({"sizes": sizes, "machine": machine, "reps": 1}, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_the_bare_loop_trains_the_gpt_the_nanogpt_way(capsys):
    """bench/bare.py on the GPT, in this process (world 1): random windows of the token stream,
    the schedule's lr set by hand, clipping; it reports its windows like the trainer."""
    bare = _load("bare")
    args = ["4", "2", "--config", "stdlib-gpt", "model.gpt.width=32", "model.gpt.heads=2"]
    args += ["data.text.max_train_bytes=20000", "data.text.max_test_bytes=4096", "dist.device=cpu"]
    assert bare.main([*args, "train.max_steps=4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["windows"]) == 2 and all(w > 0 for w in out["windows"])
    assert out["world_size"] == 1 and out["first_step_time"] > 0


def test_the_invariant_suite_is_the_cpu_suites_world_invariant_rows_and_their_ratios():
    names = [r.name for r in bench.SUITES["invariant"][0]()]
    assert names == list(bench.INVARIANT_ROWS)
    summaries = {n: bench.summarize([1.0]) for n in names}
    assert set(bench.ratios(summaries, bench.SUITES["invariant"][1])) == {
        "world_invariant / plain, world 1",
        "world_invariant / plain, world 2",
        "MLP world 2 / world 1, trainer",
        "world_invariant (2 shards) / plain, world 1",
        "world_invariant (2 shards) / plain, world 2",
        "GPT world_invariant / plain, world 1",
        "GPT world_invariant / plain, world 2",
    }


def test_the_loader_suite_end_to_end_quick(tmp_path):
    """bench/loader.py at tiny sizes: every row measured, both ratios, the JSON written."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--suite", "loader", "--quick"]
    p = subprocess.run(
        [*cmd, "--reps", "1", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "loader-tiny-cpu.json").read_text())
    assert [r["name"] for r in report["rows"]] == [
        "trainer image folder, torchvision.io decoder",
        "trainer image folder, PIL decoder",
        "bare torchvision ImageFolder + DataLoader (PIL), uint8",
        "bare torchvision ImageFolder + DataLoader (PIL), ToTensor + Normalize",
    ]
    assert all(r["median"] > 0 for r in report["rows"])
    assert report["ratios"]["image folder: trainer / bare loader, per worker"]["target"] == 1.0


def _quoted(section: str) -> dict[str, list[str]]:
    """The first cell -> the other cells of each table row in a docs/benchmarks.md section."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index(section)
    end = text.find("\n#", start + len(section))
    rows = [line.strip("|").split("|") for line in text[start:end].splitlines()]
    return {c[0].strip().strip("`"): [x.strip() for x in c[1:]] for c in rows if len(c) >= 2}


@pytest.mark.parametrize(
    "section, result",
    [
        ("### world_invariant, measured here", "invariant-cpu.json"),
        ("### The image-folder loader, measured here", "loader-cpu.json"),
    ],
)
def test_the_docs_quote_the_committed_invariant_and_loader_results(section, result):
    report = json.loads((ROOT / "bench" / "results" / result).read_text())
    quoted = _quoted(section)
    checked = 0
    for r in report["rows"]:
        fmt = "{:,.0f}" if r["median"] >= 100 else "{:,.1f}"
        spread = f"{fmt.format(r['min'])}-{fmt.format(r['max'])}"
        assert quoted[r["name"]][:2] == [fmt.format(r["median"]), spread], r["name"]
        checked += 1
    for name, r in report["ratios"].items():
        spread = f"{r['per_rep_min']:.3f}-{r['per_rep_max']:.3f}"
        assert quoted[name][:2] == [f"{r['value']:.3f}", spread], name
        checked += 1
    assert checked == len(report["rows"]) + len(report["ratios"])


def test_the_interleaved_bare_windows_leave_the_trainers_run_bit_for_bit(
    reference_runs, tmp_path, monkeypatch
):
    """bench/interleaved.py in this process: a bare window (as many steps) after each trainer
    window, and the trainer's losses and weights equal a plain run's with dropout: the bare loop's
    model init and permutation draw from an RNG of their own."""
    from tests.helpers import REFERENCE, train_here, train_losses, weights
    from trainer import loop

    dropout = "model.dropout=0.1"
    reference = reference_runs(1, dropout)  # made (in this process, maybe) before the wrapping
    monkeypatch.setattr(loop, "_log_train", loop._log_train)  # put back after the test
    windows: list = []
    _load("interleaved").interleave(loop, windows)
    train_here("train", *REFERENCE, "model.kwargs.delay=0", dropout, f"run_dir={tmp_path}")
    losses = train_losses(tmp_path)
    assert [step for step, _ in windows] == sorted(losses) and len(windows) == 69
    assert all(rate > 0 for _, rate in windows)
    assert losses == train_losses(reference)
    mine, theirs = weights(tmp_path), weights(reference)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_window_pair_is_a_trainer_window_over_the_bare_window_after_it():
    trainer = [{"step": s, "samples_per_s": r} for s, r in ((10, 50.0), (20, 90.0), (30, 99.0))]
    trainer += [{"step": 40, "samples_per_s": 80.0}, {"step": 45, "samples_per_s": 1.0}]
    bare = [[10, 100.0], [20, 100.0], [30, 100.0], [40, 100.0]]  # none after the last record
    assert bench.window_pairs(trainer, bare, skip=1) == [0.9, 0.99, 0.8]
    assert bench.window_pairs(trainer[:1], bare, skip=2) == [0.5]  # too short to skip: the last
    summaries = {"r": {**bench.summarize([0.9, 1.0]), "pairs": [0.9, 0.9, 1.0, 1.0]}}
    (ratio,) = bench.ratios(summaries, [("r", "r", None, 0.97)]).values()
    assert ratio["value"] == pytest.approx(0.95) and ratio["target"] == 0.97
    assert ratio["paired"] == pytest.approx(math.sqrt(0.9)) and ratio["ci90_lo"] < ratio["paired"]
    rows = [r for r in bench.cpu_rows() if r.kind == "interleaved"]
    assert [r.name for r in rows] == list(bench.INTERLEAVED) and {r.unit for r in rows} == {"x"}
    assert {name for name, _, den, _ in bench.CPU_RATIOS if den is None} == set(bench.INTERLEAVED)


def test_the_busy_suite_runs_each_row_beside_its_background_load(tmp_path, monkeypatch):
    """bench/busy.py: the load runs for the row's run and is gone after it; rows without one
    start none. Each busy row is an alternating trainer / bare row with a ratio and a target."""
    busy = _load("busy")
    monkeypatch.setitem(sys.modules, "busy", busy)
    seen = []

    def launch(row, work, timeout, _launch):
        seen.append((row.name, len(children(os.getpid()))))
        return {"value": 1.0}

    monkeypatch.setattr(bench, "_run_one", launch)
    before = len(children(os.getpid()))  # whatever this test process runs already
    rows = {r.load: r for r in bench.busy_rows()}
    assert set(rows) == {None, "spin", "bursty"} and set(busy.LOADS) == {"spin", "bursty"}
    for load in (None, "spin", "bursty"):
        bench.run_row(rows[load], tmp_path)
    assert [n - before for _, n in seen] == [0, 1, 1] and len(children(os.getpid())) == before, seen
    names = [r.name for r in bench.busy_rows()]
    specs = bench.SUITES["busy"][1]
    assert [(s[0], s[2], s[3]) for s in specs] == [(n, None, 0.97) for n in names]
    assert all(r.kind == "interleaved" and r.metric == "ratio" for r in bench.busy_rows())
    with pytest.raises(ValueError, match="unknown background load 'x'"), busy.running("x"):
        pass


@pytest.mark.long  # ten small runs, 1 to 4 ranks: ~1 min
def test_the_memory_suite_end_to_end_quick(tmp_path):
    """bench/memory.py at tiny sizes: every layout's peak split into fixed and model parts, the
    deferred build timed, the JSON and the PNG written."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--suite", "memory", "--quick"]
    p = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "memory-tiny-cpu.json").read_text())
    assert [r["layout"] for r in report["rows"]] == [
        "world 1", "fsdp dp=2", "fsdp dp=4", "pp=2", "tp=2",
    ]  # fmt: skip
    assert all(r["fixed_bytes"] > 0 and len(r["per_rank"]) == r["ranks"] for r in report["rows"])
    assert set(report["build"]) == {"whole_s", "deferred_build_s", "deferred_materialized_s"}
    assert (tmp_path / "memory-tiny-cpu.png").stat().st_size > 0


def test_the_docs_quote_the_committed_memory_results():
    report = json.loads((ROOT / "bench" / "results" / "memory-cpu.json").read_text())
    quoted = _quoted("### Memory a rank, measured here")
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    for r in report["rows"]:
        held = max(m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"] for m in r["per_rank"])
        want = [str(r["ranks"]), mib(held), mib(r["peak_bytes"]), mib(r["fixed_bytes"])]
        want += [mib(r["model_bytes"]), f"{r['model_part_vs_world_1']:.2f}"]
        assert quoted[r["layout"]] == want, r["layout"]
    assert len(report["rows"]) == 5


@pytest.mark.s3  # eight small 2-process runs, their resumes and an S3 server: make test-s3
def test_the_bucket_suite_end_to_end_quick(tmp_path):
    """bench/bucket.py with a tiny GPT: disk and bucket rows for DDP and FSDP, each with its
    stall, own stall and restore, the ratios, the JSON and the PNG."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--suite", "bucket", "--quick"]
    p = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "bucket-tiny-cpu.json").read_text())
    for layout in ("DDP", "FSDP"):
        rows = report["layouts"][layout]["rows"]
        assert [r["row"] for r in rows] == [
            "disk, blocking", "disk, background", "bucket, blocking", "bucket, background",
        ]  # fmt: skip
        assert all(r["restore_s"] > 0 and len(r["stalls_s"]) == 3 for r in rows)
        assert len(report["layouts"][layout]["ratios"]) == 5
    assert (tmp_path / "bucket-tiny-cpu.png").stat().st_size > 0


def test_the_docs_quote_the_committed_bucket_results():
    report = json.loads((ROOT / "bench" / "results" / "bucket-cpu.json").read_text())
    quoted = _quoted("### Checkpoints in a bucket, measured here")
    for layout, data in report["layouts"].items():
        for r in data["rows"]:
            want = [f"{r['stall_per_save_s']:.2f} s", f"{r['copy_stall_per_save_s']:.2f} s"]
            assert quoted[f"{layout}, {r['row']}"] == [*want, f"{r['restore_s']:.2f} s"]
        for name, value in data["ratios"].items():
            assert quoted[f"{layout}: {name}"][0] == f"{value:.3f}"


def shard_rows(report: dict) -> dict[str, list[str]]:
    """The rows docs/benchmarks.md's shards tables hold, from bench/shards.py's report."""
    rows = {}
    for r in report["rows"]:
        where = r["source"] if r["cache"] == "-" else f"{r['source']} {r['cache']}"
        rows[f"{r['reader']}, {where}, world {r['world']}"] = [f"{r['samples_per_s']:,.0f}"]
    for name, value in report["ours_over_faster_anchor"].items():
        name = name.replace(" - ", " ")  # (a local folder has no cache)
        rows[f"ours / faster of streaming and litdata, {name}"] = [f"{value:.2f}", ">= 1"]
    for r in report["resume"]:
        rows[f"{r['reader']}, resumed at {r['at']:.0%}"] = [f"{r['first_batch_s']:.2f} s"]
    for r in report["order"]:
        rows[f"packed {r['packed']}, window {r['window']}"] = [
            f"{r['mean']:.4f}",
            f"{r['mean_loss']:.4f}",
        ]
    return rows


def test_the_docs_quote_the_committed_shard_results():
    report = json.loads((ROOT / "bench" / "results" / "shards-cpu.json").read_text())
    quoted = _quoted("### Shards, measured here")
    for name, cells in shard_rows(report).items():
        assert quoted.get(name) == cells, name
