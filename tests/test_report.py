"""`trainer report`: PNGs and report.md from run directories, and its one-line refusals."""

import json
import struct
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TINY, env, read_jsonl, trainer
from trainer import cli, report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_run(
    root,
    name,
    *,
    world,
    strategy="ddp",
    steps=(10, 20, 30, 40),
    losses=(2.0, 1.0, 0.5, 0.25),
    samples_per_s=(900.0, 1000.0, 1100.0, 1200.0),
    evals=((20, 0.9, 0.80), (40, 0.6, 0.85)),
    extra=None,
    finished=True,
):
    """A run directory in the format trainer.train and trainer.metrics write."""
    run = root / name
    run.mkdir()
    lines = []
    for i, step in enumerate(steps):
        record = {"kind": "train", "step": step, "epoch": 0, "loss": losses[i]}
        record["lr"] = 0.1 * (1 - i / len(steps))
        record["samples_per_s"] = samples_per_s[i]
        for key, values in (extra or {}).items():
            record[key] = values[i]
        lines.append({**record, "time": 1.0e9 + step})
        for e_step, e_loss, e_acc in evals:
            if e_step == step:
                lines.append(
                    {
                        "kind": "eval",
                        "step": step,
                        "epoch": 0,
                        "eval.loss": e_loss,
                        "eval.count": 359,
                        "eval.accuracy": e_acc,
                        "time": 1.0e9 + step,
                    }
                )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    info = {"name": "digits-mlp", "world_size": world, "strategy": strategy, "device": "cpu"}
    (run / "run.json").write_text(json.dumps({**info, "started": 1.0e9}))
    if finished:
        summary = {**info, "steps": steps[-1], "train_time_s": 12.5, "samples_per_s": 1000.0}
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def table(md: str) -> dict[str, dict[str, str]]:
    """report.md's table: {run label: {column: cell}}."""
    rows = [line.strip("| ").split(" | ") for line in md.splitlines() if line.startswith("| ")]
    head, body = rows[0], rows[2:]
    return {row[0]: dict(zip(head, row, strict=True)) for row in body}


def run_report(capsys, *args):
    code = cli.main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_three_runs_are_overlaid_labelled_by_world_size_and_tabulated(tmp_path, capsys):
    a = fake_run(tmp_path, "a", world=1, strategy="none")
    b = fake_run(tmp_path, "b", world=2, samples_per_s=(1800.0, 2000.0, 2200.0, 2400.0))
    c = fake_run(tmp_path, "c", world=4, samples_per_s=(3600.0, 4000.0, 4400.0, 4800.0))
    out = tmp_path / "out"
    code, stdout, err = run_report(capsys, a, b, c, "-o", out)
    assert code == 0, err
    written = stdout.split()
    names = {"loss.png", "lr.png", "throughput.png", "eval_loss.png", "eval_accuracy.png"}
    assert {p.rsplit("/", 1)[1] for p in written} == names | {"report.md"}
    for name in names:
        png = out / name
        assert str(png) in written and png.stat().st_size > 1000
        assert png_size(png) == (800, 450)

    runs = [report.load_run(str(p)) for p in (a, b, c)]
    report.label_runs(runs)
    for name, fig in report.figures(runs).items():
        legend = fig.axes[0].get_legend()
        assert [t.get_text() for t in legend.get_texts()] == ["a w1", "b w2", "c w4"], name
    assert fig.axes[0].get_title() == "Eval accuracy (test split)"

    rows = table((out / "report.md").read_text())
    assert list(rows) == ["a w1", "b w2", "c w4"]
    assert rows["a w1"]["world size"] == "1" and rows["a w1"]["strategy"] == "none"
    assert rows["c w4"]["strategy"] == "ddp" and rows["c w4"]["steps"] == "40"
    assert rows["b w2"]["final train loss"] == "0.25"
    assert rows["b w2"]["final eval loss"] == "0.6"
    assert rows["b w2"]["final eval accuracy"] == "0.85"
    assert rows["a w1"]["median samples/s"] == "1,050"
    assert rows["c w4"]["median samples/s"] == "4,200"
    assert [rows[k]["vs first"] for k in rows] == ["1.00x", "2.00x", "4.00x"]
    assert rows["a w1"]["train time (s)"] == "12.5"
    assert "median MFU" not in rows["a w1"] and "median tokens/s" not in rows["a w1"]


def test_optional_per_step_fields_get_their_own_plots_and_columns(tmp_path, capsys):
    extra = {
        "tokens_per_s": (1e5, 2e5, 3e5, 4e5),
        "mfu": (0.40, 0.41, 0.43, 0.44),
        "data_s": (0.01, 0.02, 0.01, 0.02),
    }
    a = fake_run(tmp_path, "a", world=1, extra=extra)
    b = fake_run(tmp_path, "b", world=2)  # an older run without them
    code, stdout, err = run_report(capsys, a, b, "-o", tmp_path / "out")
    assert code == 0, err
    for name in ("tokens_per_s.png", "mfu.png", "data_s.png"):
        assert png_size(tmp_path / "out" / name) == (800, 450)
        assert str(tmp_path / "out" / name) in stdout.split()
    rows = table((tmp_path / "out" / "report.md").read_text())
    assert rows["a w1"]["median MFU"] == "42.0%" and rows["b w2"]["median MFU"] == "–"
    assert rows["a w1"]["median tokens/s"] == "250,000"


def test_a_metric_constant_at_every_evaluation_is_tabulated_not_plotted(tmp_path, capsys):
    # "labelled": the same at every evaluation of every run, a flat line; "half": constant in
    # each run but different between them, which a plot does compare.
    runs = [fake_run(tmp_path, "a", world=1), fake_run(tmp_path, "b", world=2)]
    for run, half in zip(runs, (1.0, 2.0), strict=True):
        records = read_jsonl(run / "metrics.jsonl")
        for r in records:
            if r["kind"] == "eval":
                r.update({"eval.labelled": 300, "eval.half": half})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    code, stdout, err = run_report(capsys, *runs, "-o", out)
    assert code == 0, err
    plotted = {p.rsplit("/", 1)[1] for p in stdout.split()}
    assert {"eval_loss.png", "eval_accuracy.png", "eval_half.png"} <= plotted
    assert "eval_labelled.png" not in plotted and not (out / "eval_labelled.png").exists()
    md = (out / "report.md").read_text()
    assert table(md)["b w2"]["final eval labelled"] == "300"
    assert "- labelled is 300 at every evaluation: not plotted" in md


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_the_rank_panels_legend_covers_no_bar_and_no_label(tmp_path):
    # The tallest bar is rank 0's, a straggler, labelled above it: where a legend inside the
    # axes' upper left corner sat.
    run = fake_run(tmp_path, "a", world=4)
    summary = json.loads((run / "summary.json").read_text())
    times = [(9.0, 3.0), (5.0, 2.5), (5.2, 2.0), (4.9, 8.0)]
    summary["ranks"] = [
        {"rank": i, "forward_ms_per_step": f, "data_wait_ms_per_step": w, "straggler": []}
        for i, (f, w) in enumerate(times)
    ]
    summary["ranks"][0]["straggler"] = ["compute"]
    (run / "summary.json").write_text(json.dumps(summary))
    runs = [report.load_run(str(run))]
    report.label_runs(runs)
    fig = report.rank_panel(runs)
    fig.draw_without_rendering()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert [t.get_text() for t in legends[0].get_texts()] == ["forward", "data wait"]
    drawn = [a for ax in fig.axes for a in (*ax.patches, *ax.texts)]
    assert len(drawn) == 9  # 8 bars and the straggler's label
    for legend in legends:
        box = legend.get_window_extent()
        assert not [a for a in drawn if _overlap(box, a.get_window_extent())]


def test_a_run_cut_short_mid_write_is_reported_with_a_note(tmp_path, capsys):
    run = fake_run(tmp_path, "killed", world=2, finished=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 50, "epoch": 0, "lo')  # killed mid-line
    code, stdout, err = run_report(capsys, run)
    assert code == 0, err
    assert "skipped line 7, the last, which is cut short" in err
    md = (run / "report" / "report.md").read_text()  # the default output folder
    row = table(md)["killed w2"]  # world size from run.json: no summary.json yet
    assert row["steps"] == "40" and row["final train loss"] == "0.25"
    assert row["train time (s)"] == "– (unfinished)"
    assert "skipped line 7" in md
    assert str(run / "report" / "loss.png") in stdout.split()


def bad_cases(tmp_path):
    good = fake_run(tmp_path, "good", world=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    damaged = fake_run(tmp_path, "damaged", world=1)
    lines = (damaged / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "garbage\n"
    (damaged / "metrics.jsonl").write_text("".join(lines))
    no_train = fake_run(tmp_path, "no-train", world=1)
    (no_train / "metrics.jsonl").write_text("")
    return {
        "missing": ([good, tmp_path / "nope"], "nope: no such directory"),
        "not a dir": ([tmp_path / "file"], "file is not a directory"),
        "no metrics": ([tmp_path / "empty"], "empty has no metrics.jsonl"),
        "damaged": ([damaged], "line 3 is not a metrics record (the file is damaged)"),
        "no train records": ([no_train], "holds no train records yet"),
        "unwritable -o": ([good, "-o", tmp_path / "file" / "out"], "pass -o a writable folder"),
    }


@pytest.mark.parametrize(
    "case", ["missing", "not a dir", "no metrics", "damaged", "no train records", "unwritable -o"]
)
def test_bad_input_exits_2_in_one_line(tmp_path, capsys, case):
    args, fragment = bad_cases(tmp_path)[case]
    code, stdout, err = run_report(capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("trainer: error: ") and fragment in err, err
    assert stdout == ""


def test_bad_input_through_the_real_command_has_no_traceback(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "trainer", "report", str(tmp_path / "nope")],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 2
    assert p.stderr.splitlines() == [
        f"trainer: error: {tmp_path / 'nope'}: no such directory: give the run_dir of a "
        "`trainer train` run"
    ]


def test_a_real_run(tmp_path, capsys):
    run = tmp_path / "tiny"
    trainer("train", *TINY, "train.epochs=2", "log.every_steps=1", f"run_dir={run}")
    code, stdout, err = run_report(capsys, run)
    assert code == 0, err
    records = read_jsonl(run / "metrics.jsonl")
    last_train = [r for r in records if r["kind"] == "train"][-1]
    last_eval = [r for r in records if r["kind"] == "eval"][-1]
    row = table((run / "report" / "report.md").read_text())["tiny w1"]
    assert row["steps"] == str(last_train["step"]) == "6"
    assert row["final train loss"] == f"{last_train['loss']:.4g}"
    assert row["final eval accuracy"] == f"{last_eval['eval.accuracy']:.4g}"
    assert row["strategy"] == "none" and row["vs first"] == "1.00x"
    for name in ("loss.png", "lr.png", "throughput.png", "eval_loss.png", "eval_accuracy.png"):
        assert png_size(run / "report" / name) == (800, 450)
        assert str(run / "report" / name) in stdout.split()


def test_without_matplotlib_it_says_how_to_get_it_in_one_line(tmp_path, capsys, monkeypatch):
    # A dependency since users met a traceback where it was an extra (the image); an install
    # without it (pip --no-deps) gets one line, and nothing is written.
    fake_run(tmp_path, "a", world=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["report", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "trainer: error: trainer report draws with matplotlib, which is not installed here: "
        "pip install matplotlib"
    ]
    assert not (tmp_path / "a" / "report").exists()


def test_matplotlib_is_a_dependency_not_an_extra():
    from importlib import metadata

    required = metadata.requires("repro-trainer") or []
    assert any(r.startswith("matplotlib") and "extra ==" not in r for r in required), required
