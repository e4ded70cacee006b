"""bench/headline.py (issue 42's GPU headline numbers): the pure parts, the full-size rows'
configs, and the whole script at tiny sizes on the CPU, so it cannot rot between GPU loans."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "headline_under_test", ROOT / "bench" / "headline.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


headline = _load()
ROW_NAMES = [
    headline.GPT_ROW,
    headline.BLOCKING,
    headline.BACKGROUND,
    headline.PLAIN,
    headline.INVARIANT,
    headline.RESNET,
    headline.LOSS_OUT,
    headline.FOREACH,
    headline.WHOLE_BUILD,
    headline.DEFERRED_BUILD,
    headline.FEW_WORKERS,
]


def test_mfu_is_against_the_devices_dense_bf16_peak_or_null_with_the_reason():
    rate, flops = 100.0, 1e12  # 1e14 FLOP/s achieved
    for device, peak in [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ]:
        value, reason = headline.mfu(rate, flops, device)
        assert value == pytest.approx(1e14 / peak) and reason is None, device
    value, reason = headline.mfu(rate, flops, "NVIDIA Imaginary X1")
    assert value is None and "'NVIDIA Imaginary X1' is not in trainer.perf.PEAK_FLOPS" in reason
    assert headline.mfu(rate, flops, None) == (None, headline.mfu(1.0, 1.0, None)[1])
    assert "no GPU" in headline.mfu(rate, flops, None)[1]
    assert "counted no FLOPs" in headline.mfu(rate, None, "NVIDIA H100 80GB HBM3")[1]
    assert "failed" in headline.mfu(None, flops, "NVIDIA H100 80GB HBM3")[1]


def test_the_gpu_rows_are_gpt2_small_and_resnet50_at_224_and_their_configs_load():
    from trainer import config

    s = headline.GPU
    assert (s.layers, s.heads, s.width, s.seq, s.vocab) == (12, 12, 768, 1024, 50304)
    total, counted = headline.gpt_params(s.layers, s.heads, s.width, s.seq, s.vocab)
    assert 123e6 < counted < 125e6 and total - counted == s.seq * s.width  # 124M, as GPT-2 small
    # nanoGPT's estimate: 6N + 12 L H Q T per token
    assert headline.nanogpt_flops_per_token(s) == 6 * counted + 12 * 12 * 12 * 64 * 1024
    rows = headline.rows(s, "/data/tokens", "/data/images", "cuda")
    assert [r.name for r in rows] == ROW_NAMES
    by = {r.name: r for r in rows}
    for row in rows:  # every full-size row's overrides still validate (no data is read)
        cfg = config.load(None, list(row.overrides))
        assert cfg.dist.device == "cuda" and cfg.train.precision == "bf16", row.name
        assert cfg.dist.stall_s == 0  # a first step that compiles for minutes is not a stall
    gpt = config.load(None, list(by[headline.GPT_ROW].overrides))
    assert gpt.train.compile and gpt.model.name == "gpt" and gpt.data.tokens.seq_len == 1024
    blocking = config.load(None, list(by[headline.BLOCKING].overrides))
    background = config.load(None, list(by[headline.BACKGROUND].overrides))
    assert not blocking.ckpt.async_save and background.ckpt.async_save
    assert blocking.ckpt.every_steps == s.ckpt_every and s.ckpt_steps == 4 * s.ckpt_every
    invariant = config.load(None, list(by[headline.INVARIANT].overrides))
    assert invariant.repro.world_invariant and invariant.repro.deterministic
    resnet = config.load(None, list(by[headline.RESNET].overrides))
    assert resnet.model.name == "torchvision.models:resnet50" and resnet.data.image_size == 224
    assert resnet.data.name == "imagefolder" and resnet.data.num_workers > 0
    assert set(s.timeouts) == set(headline.TIMEOUT_GROUP.values())
    assert max(s.timeouts.values()) < 560  # no row alone outlasts the run's deadline
    # Each of issue 57's rows differs from its reference row in one key only.
    for row, ref, key in [
        (headline.LOSS_OUT, headline.GPT_ROW, "train.compile_loss=false"),
        (headline.FOREACH, headline.GPT_ROW, "optim.fused=false"),
        (headline.DEFERRED_BUILD, headline.WHOLE_BUILD, "dist.strategy=fsdp"),
    ]:
        extra = set(by[row].overrides) - set(by[ref].overrides)
        assert extra == {key}, (row, extra)
    fast = config.load(None, list(by[headline.GPT_ROW].overrides))
    assert fast.train.compile_loss and fast.optim.fused is None  # null: fused on a GPU
    few = config.load(None, list(by[headline.FEW_WORKERS].overrides))
    assert 0 < few.data.num_workers < resnet.data.num_workers
    assert config.load(None, list(by[headline.WHOLE_BUILD].overrides)).dist.strategy == "none"


def test_the_image_rows_get_as_many_loader_workers_as_dev_shm_holds():
    batch = headline.image_batch_bytes(headline.GPU)
    assert batch == 256 * 3 * 224 * 224 * 4  # 154 MB: float32 images as the model takes them
    assert headline.loader_workers(12, None, batch) == (12, None)  # unknown: as asked
    assert headline.loader_workers(12, 16 * 2**30, batch) == (12, None)
    workers, why = headline.loader_workers(12, 64 * 2**20, batch)  # Docker's default
    assert workers == 1 and "/dev/shm holds 0.06 GiB" in why and "1 worker(s)" in why
    workers, why = headline.loader_workers(12, 2 * 2**30, batch)  # 3/4 of 2 GiB: 5 x 2 batches
    assert workers == 5 and "need 3.45 GiB" in why


def _ok(name: str, median: float, **run) -> dict:
    return {"name": name, "status": "ok", "median": median, "runs": [run]}


def test_the_headline_numbers_their_targets_and_the_reasons_for_missing_ones():
    s = headline.GPU
    fast = {"loss_compiled": False, "fused_optimizer": False}
    results = {
        headline.GPT_ROW: _ok(
            headline.GPT_ROW,
            400.0,
            flops_per_sample=1e12,
            fast_paths={"loss_compiled": True, "fused_optimizer": True},
        ),
        headline.BLOCKING: _ok(headline.BLOCKING, 4.0),
        headline.BACKGROUND: _ok(headline.BACKGROUND, 0.2, writes_waited_s=[0.0, 0.1]),
        headline.PLAIN: _ok(headline.PLAIN, 100.0),
        headline.INVARIANT: {"name": headline.INVARIANT, "status": "error", "error": "boom\nx"},
        headline.RESNET: _ok(headline.RESNET, 2500.0, data_wait_pct=7.5, data_wait_run_pct=9.0),
        headline.LOSS_OUT: _ok(
            headline.LOSS_OUT,
            320.0,
            peak_gpu_memory_gib=30.0,
            fast_paths={"loss_compiled": False, "fused_optimizer": True},
        ),
        headline.WHOLE_BUILD: {
            **_ok(headline.WHOLE_BUILD, 8.0, peak_gpu_memory_gib=4.0),
            "plan": {"device_bytes": 3 * 2**30},
        },
        headline.DEFERRED_BUILD: {
            **_ok(headline.DEFERRED_BUILD, 2.0, peak_gpu_memory_gib=5.0),
            "plan": {"error": "boom"},
        },
        headline.FEW_WORKERS: _ok(headline.FEW_WORKERS, 1500.0, data_wait_pct=30.0),
    }
    n = headline.headline(results, s, "NVIDIA H100 80GB HBM3")
    assert list(n) == list(headline.TARGETS)
    m = n["GPT-2-small MFU (bf16 dense peak)"]
    assert m["value"] == pytest.approx(400 * 1e12 / 989e12) and m["met"] is True  # 40.4%
    formula = 400 * s.seq * headline.nanogpt_flops_per_token(s) / 989e12
    assert m["mfu_nanogpt_formula"] == pytest.approx(formula)
    assert n["GPT-2-small tokens/s"]["value"] == 400 * 1024
    stall = n["checkpoint stall, background / blocking"]
    assert stall["value"] == pytest.approx(0.05) and stall["met"] and stall["at_most"]
    assert stall["background_writes_waited_s"] == [0.0, 0.1]
    wi = n["world_invariant / plain, world 1"]
    assert wi["value"] is None and wi["reason"] == f"{headline.INVARIANT!r} failed: boom"
    wait = n["ResNet-50 data wait (steady state)"]
    assert (wait["value"], wait["whole_run"], wait["met"]) == (0.075, 0.09, False)
    loss = n["loss in the compiled graph / outside it, tokens/s"]
    assert loss["value"] == 1.25 and loss["peak_gpu_memory_gib"] == {
        headline.GPT_ROW: None, headline.LOSS_OUT: 30.0,
    }  # fmt: skip
    fused = n["fused AdamW / foreach, tokens/s"]
    assert fused["value"] is None and fused["reason"] == f"{headline.FOREACH!r} was not run"
    # Rows that ran the same kernels compare nothing (a CPU dry run: no compile, no fusing).
    same = dict(results, **{headline.FOREACH: _ok(headline.FOREACH, 390.0, fast_paths=fast)})
    same[headline.GPT_ROW] = {**results[headline.GPT_ROW]}
    same[headline.GPT_ROW]["runs"] = [{**results[headline.GPT_ROW]["runs"][0], "fast_paths": fast}]
    got = headline.headline(same, s, "NVIDIA H100 80GB HBM3")["fused AdamW / foreach, tokens/s"]
    assert got["value"] is None and got["reason"].endswith("ran fused_optimizer False and False")
    assert n["deferred build / whole build, seconds"]["value"] == 0.25
    whole = n["trainer plan / measured peak GPU memory, whole"]
    assert whole["value"] == 0.75 and whole["planned_bytes"] == 3 * 2**30
    deferred = n["trainer plan / measured peak GPU memory, deferred"]
    assert deferred["value"] is None and deferred["reason"] == "trainer plan failed: boom"
    assert n["ResNet-50 data wait, fewer loader workers"]["value"] == 0.3
    table = headline.format_headline(n)
    assert re.search(r"GPT-2-small MFU \(bf16 dense peak\) +40\.4% +>= 40\.0% +yes", table)
    assert re.search(r"checkpoint stall, background / blocking +0\.050 +<= 0\.100 +yes", table)
    assert re.search(r"ResNet-50 data wait \(steady state\) +7\.5% +<= 5\.0% +NO", table)
    assert "n/a" in table and "boom" in table
    unknown = headline.headline(results, s, "NVIDIA Imaginary X1")
    assert unknown["GPT-2-small MFU (bf16 dense peak)"]["met"] is None
    assert "not in trainer.perf.PEAK_FLOPS" in headline.format_headline(unknown)


@pytest.mark.slow  # ~15-20 s on 2 cores: one process, each row forked from it
@pytest.mark.long
def test_the_whole_script_at_tiny_sizes_on_the_cpu(tmp_path):
    """What a GPU loan would run, end to end at tiny sizes (`--quick`), through bench.py's
    --suite: the data generated, every row run, the JSON written and parsed back."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench.py"), "--suite", "headline", "--quick"]
    p = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "headline-tiny-cpu.json").read_text())
    assert report["suite"] == "headline" and report["tiny"] is True
    assert report["machine"]["torch"] and report["machine"]["gpu"] is None
    assert [r["name"] for r in report["rows"]] == ROW_NAMES
    for row in report["rows"]:
        assert row["status"] == "ok", (row["name"], row.get("error"))
        assert row["n"] == 1 and row["median"] > 0 and row["runs"][0]["command"]
    by = {r["name"]: r for r in report["rows"]}
    assert len(by[headline.BACKGROUND]["runs"][0]["stalls_s"]) == 3  # the final save left out
    assert by[headline.RESNET]["runs"][0]["data_wait_pct"] is not None
    numbers = report["headline"]
    assert numbers == json.loads(json.dumps(headline.headline(by, headline.TINY, None)))
    mfu = numbers["GPT-2-small MFU (bf16 dense peak)"]
    assert mfu["value"] is None and "no GPU" in mfu["reason"] and mfu["target"] == 0.40
    for name in ("GPT-2-small tokens/s", "checkpoint stall, background / blocking",
                 "world_invariant / plain, world 1", "ResNet-50 images/s"):  # fmt: skip
        assert numbers[name]["value"] > 0, name
    assert 0 <= numbers["ResNet-50 data wait (steady state)"]["value"] <= 1
    # Issue 57's rows: the defaults against each switched off, the build and the plan.
    assert numbers["deferred build / whole build, seconds"]["value"] > 0
    for name in (
        "loss in the compiled graph / outside it, tokens/s",
        "fused AdamW / foreach, tokens/s",
    ):  # fmt: skip  (the rows ran the same)
        assert numbers[name]["value"] is None and " ran " in numbers[name]["reason"], name
    fast = {r["name"]: r["runs"][0]["fast_paths"] for r in report["rows"]}
    assert (
        fast[headline.FOREACH]
        == fast[headline.GPT_ROW]
        == {
            "loss_compiled": False,
            "fused_optimizer": False,
        }
    )  # fmt: skip  (tiny: no compile; on a CPU AdamW keeps foreach)
    for row in headline.PLANNED:
        plan = by[row]["plan"]
        assert plan["device_bytes"] > 0 and plan["rank0"]["param_bytes"] > 0, (row, plan)
        ratio = numbers[f"trainer plan / measured peak GPU memory, {row.split()[2]}"]
        assert ratio["value"] is None and "no GPU" in ratio["reason"], ratio
    assert by[headline.DEFERRED_BUILD]["runs"][0]["build_s"] > 0
    assert report["fixtures"]["loader_workers"] == headline.TINY.workers
    assert headline.format_headline(numbers) in p.stdout  # printed with the targets


def test_a_failed_row_is_recorded_and_the_others_still_run(tmp_path):
    """A row that raises (here: its launch) becomes status error with the text; run_one never
    raises, so the loop goes on to the next row."""

    def broken(cmd, threads, timeout=None):
        raise SystemExit("benchmark row failed: out of memory")

    row = headline.rows(headline.TINY, "/nowhere", "/nowhere", "cpu")[0]
    entry = headline.run_one(row, tmp_path, 10, broken)
    assert entry["status"] == "error" and "out of memory" in entry["error"]
    assert entry["name"] == headline.GPT_ROW and entry["overrides"] == list(row.overrides)
    assert headline._line(entry).strip().startswith(headline.GPT_ROW)


def test_the_docs_say_how_to_run_it_and_quote_every_committed_gpu_run():
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("## The GPU headline suite") :]
    assert "python bench/bench.py --suite headline" in section
    for name, target in headline.TARGETS.items():  # the targets table names every number
        if target is not None:
            assert name in section, name
    for path in sorted((ROOT / "bench" / "results").glob("headline-*.json")):
        report = json.loads(path.read_text())
        if report["tiny"] or path.stem.endswith("-rerun"):
            continue
        text = " ".join(section.split())
        for name, n in report["headline"].items():
            shown = headline._shown(n["value"], n["unit"])
            assert f"| {name} | {shown} |" in text, (path.name, name, shown)


def test_the_loan_script_refuses_a_wrong_word_and_a_missing_wheel_in_one_line(tmp_path):
    """bench/gpu_loan.sh, what a GPU loan runs: a word it does not know, or no omegaconf wheel
    to carry (the loan's machine has no package index), is one line and exit 2, before any
    work (here: a copy of the script in a tree without .whl/)."""
    script = ROOT / "bench" / "gpu_loan.sh"
    p = subprocess.run(["bash", str(script), "measure"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.startswith("usage: bash bench/gpu_loan.sh prepare|")
    (tmp_path / "bench").mkdir()
    copy = tmp_path / "bench" / "gpu_loan.sh"
    copy.write_text(script.read_text())
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    p = subprocess.run(["bash", str(copy), "headline"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "run 'bash bench/gpu_loan.sh prepare' here and carry .whl" in p.stderr
    assert not (tmp_path / "out").exists()  # nothing started
