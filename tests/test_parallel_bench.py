"""bench/parallel.py (issue 36, item 7: model parallel measured): the pure parts (bubble, memory
and throughput tables), the rows' configs, a failed row recorded, the script end to end at tiny
sizes, and the docs' tables against the committed JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "parallel_under_test", ROOT / "bench" / "parallel.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


parallel = _load()
RESULTS = ROOT / "bench" / "results" / "parallel-cpu.json"


def test_the_bubble_and_its_theory():
    assert parallel.theory(2) == pytest.approx(1 / 3)
    assert parallel.theory(4) == pytest.approx(1 / 5)
    assert parallel.theory(8) == pytest.approx(1 / 9)
    assert parallel.theory(4, p=4) == pytest.approx(3 / 7)
    # a pipeline of 2 stages whose step is half of one process's loses nothing ...
    assert parallel.bubble(t1=1.0, tpp=0.5) == 0
    # ... and one that takes as long as one process idles half the time
    assert parallel.bubble(t1=1.0, tpp=1.0) == 0.5
    assert parallel.bubble(t1=1.0, tpp=0.75) == pytest.approx(1 / 3)  # theory at m = 2


def _mem(total: int, rss: int) -> dict:
    third = total // 4
    return {"param_bytes": third, "grad_bytes": third, "optimizer_bytes": total - 2 * third,
            "total_bytes": total, "peak_rss_bytes": rss}  # fmt: skip


def _ok(name: str, rate: float, processes: int, memory: list[dict] | None = None) -> dict:
    return {"name": name, "status": "ok", "processes": processes, "median": rate,
            "min": rate, "max": rate, "runs": [{"memory": memory or []}]}  # fmt: skip


TP_ERROR = "benchmark row failed: tp\nmore"


def test_the_tables_from_the_rows_and_a_failed_row_says_so():
    batch = 16
    results = {
        parallel.WORLD1: _ok(parallel.WORLD1, 16.0, 1, [_mem(400, 1000)]),
        parallel.FSDP: _ok(parallel.FSDP, 20.0, 2, [_mem(200, 1010), _mem(200, 1020)]),
        parallel.PP: _ok(parallel.PP, 24.0, 2, [_mem(210, 990), _mem(190, 980)]),
        parallel.TP: {"name": parallel.TP, "status": "error", "processes": 2, "error": TP_ERROR},
        parallel.acc_row(4): _ok(parallel.acc_row(4), 12.0, 1),
    }
    a = parallel.analyse(results, batch)
    mem = {t["layout"]: t for t in a["memory"]}
    assert mem["world 1"]["total_vs_world1"] == 1.0
    assert mem["dp=2 FSDP"]["total_vs_world1"] == 0.5
    assert mem["pp=2"]["total_vs_world1"] == 210 / 400  # the most any rank holds
    assert mem["pp=2"]["peak_rss_vs_world1"] == 0.99
    assert "tp" in mem["tp=2"]["error"] and mem["dp=2 DDP"]["error"] == "not run"
    b = {(x["schedule"], x["m"]): x for x in a["bubble"]}
    one = b[("1f1b", 4)]  # T_pp = 16/24 s; T_1 = 16/12 s (same micro-batches), 16/16 s (whole)
    assert one["theory"] == pytest.approx(0.2) and one["micro_batch_size"] == 4
    assert one["bubble"] == pytest.approx(1 - (16 / 12 / 2) / (16 / 24))  # 0: a perfect pipe
    assert one["bubble_vs_world1"] == pytest.approx(1 - (1 / 2) / (16 / 24))  # 0.25
    assert b[("gpipe", 2)]["bubble"] is None and b[("gpipe", 2)]["step_s"] is None
    thr = {t["row"]: t for t in a["throughput"]}
    assert thr[parallel.FSDP]["vs_world1"] == 1.25 and thr[parallel.TP]["samples_per_s"] is None
    assert thr[parallel.TP]["error"] == "benchmark row failed: tp"
    lines = parallel.markdown(a)
    assert "| dp=2 FSDP | 2 | 0.0 / 0.0 | 0.500 | 0 / 0 | 1.020 |" in lines
    assert "| 1f1b | 4 | 4 | 0.200 | 0.000 | 0.250 | 0.667 s |" in lines
    assert "| gpipe | 2 | 8 | 0.333 | n/a | n/a | n/a |" in lines
    assert "| tp=2 | 2 | failed | | |" in lines and "| tp=2 | | failed | | | |" in lines


def test_the_rows_configs_load_and_split_the_same_global_batch():
    from trainer import config

    rows = parallel.rows(parallel.FULL)
    names = [r.name for r in rows]
    assert len(names) == len(set(names)) == 4 + 2 * 3 + 3
    assert set(parallel.LAYOUTS) <= set(names)
    for row in rows:
        cfg = config.load(row.overrides[1], list(row.overrides[2:]))
        assert cfg.data.global_batch_size == parallel.FULL.batch, row.name
        assert row.threads == 1 and row.nproc == (1 if row.name.startswith("world 1") else 2)
    by = {r.name: r for r in rows}
    for schedule in parallel.SCHEDULES:
        for m in parallel.MICRO:
            cfg = config.load("stdlib-gpt", list(by[parallel.pp_row(schedule, m)].overrides[2:]))
            assert cfg.dist.mesh == "pp=2" and cfg.dist.pp_schedule == schedule
            assert cfg.train.micro_batch_size * m == parallel.FULL.batch
            acc = config.load("stdlib-gpt", list(by[parallel.acc_row(m)].overrides[2:]))
            assert acc.train.micro_batch_size == cfg.train.micro_batch_size and not acc.dist.mesh
    tp = config.load("stdlib-gpt", list(by[parallel.TP].overrides[2:]))
    assert tp.dist.mesh == "tp=2" and tp.dist.strategy == "none"
    fsdp = config.load("stdlib-gpt", list(by[parallel.FSDP].overrides[2:]))
    assert fsdp.dist.strategy == "fsdp" and fsdp.model.gpt.width == 256


def test_a_failed_run_is_recorded_and_the_others_still_run(tmp_path):
    def broken(cmd, threads, timeout=None):
        raise SystemExit("benchmark row failed: tp=2 is not built yet")

    row = parallel.rows(parallel.TINY)[3]
    result = parallel.run_one(row, tmp_path, 10, broken)
    assert "not built yet" in result["error"]
    entry = parallel._entry(row)
    entry["errors"].append(result["error"])
    parallel._finish(entry)
    assert entry["status"] == "error" and "not built yet" in entry["error"]


@pytest.mark.slow  # four rows, each rank forked: 29 s on 2 cores at load 1-3
@pytest.mark.long
def test_the_script_end_to_end_at_tiny_sizes(tmp_path):
    """Through bench.py's --suite: world 1, FSDP, pp=2 and world 1 on the same micro-batches,
    the JSON written and parsed back, the plot beside it."""
    names = [parallel.WORLD1, parallel.FSDP, parallel.PP, parallel.acc_row(parallel.PP_LAYOUT_M)]
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--suite", "parallel", "--quick"]
    cmd += ["--reps", "1", "--out", str(tmp_path)]
    cmd += [a for n in names for a in ("--row", n)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "parallel-tiny-cpu-rerun.json").read_text())
    assert report["suite"] == "parallel" and report["tiny"] is True
    assert report["machine"]["load_avg_before"] and report["machine"]["load_avg_after"]
    assert [r["name"] for r in report["rows"]] == names
    for row in report["rows"]:
        assert row["status"] == "ok", (row["name"], row.get("error"))
        run = row["runs"][0]
        assert run["command"] and len(run["memory"]) == row["processes"]
    mem = {t["layout"]: t for t in report["analysis"]["memory"]}
    assert mem["dp=2 FSDP"]["total_vs_world1"] == pytest.approx(0.5, abs=0.01)
    assert 0.5 <= mem["pp=2"]["total_vs_world1"] < 0.8  # tiny: the tied embedding on each stage
    one = next(b for b in report["analysis"]["bubble"] if b["schedule"] == "1f1b" and b["m"] == 4)
    assert one["bubble"] is not None and one["step_s"] > 0
    assert (tmp_path / "parallel-tiny-cpu-rerun.png").stat().st_size > 10_000
    assert "| pp=2 | 2 |" in p.stdout


def _section(text: str) -> str:
    start = text.index("## Model parallel")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed parallel-cpu.json yet")
def test_the_docs_quote_the_committed_tables():
    """docs/benchmarks.md's "Model parallel" section holds every line of the tables the committed
    JSON gives (parallel.markdown), so a rerun without a docs update fails here."""
    report = json.loads(RESULTS.read_text())
    assert not report["tiny"]
    section = _section((ROOT / "docs" / "benchmarks.md").read_text())
    for line in parallel.markdown(report["analysis"]):
        if line:
            assert line in section, line
    m = report["machine"]
    load = f"{m['load_avg_before'][0]:.1f} before, {m['load_avg_after'][0]:.1f} after"
    assert load in section
