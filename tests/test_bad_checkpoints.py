"""Bad checkpoints and bad output paths: one line, the right exit code, nothing written is lost.

Damaged contents are written the way a hand edit or another tool would leave them: the file is
re-written AND the manifest re-computed with store.write_manifest, so verification passes and
only the structural checks on loading stand between the bad content and a traceback.
"""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import helpers
from tests.test_checkpoint import TINY  # the same 4-epoch tiny run, a checkpoint per epoch
from trainer import cli, config
from trainer import train as train_mod
from trainer.checkpoint import store
from trainer.errors import UsageError
from trainer.train import train

NEWEST = "step-000000012"


def _run(run_dir, *extra):
    return train(config.load(None, [*TINY, f"run_dir={run_dir}", *extra]))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pristine") / "run"
    _run(run_dir)
    return run_dir


@pytest.fixture
def run(pristine, tmp_path):
    """A private copy of a finished 12-step run with checkpoints at steps 3, 6, 9 and 12."""
    shutil.copytree(pristine, tmp_path / "run")
    return tmp_path / "run"


def digest(folder) -> dict[str, str]:
    """sha256 of every file below `folder`, by relative path."""
    out = {}
    for rel in store.files_under(str(folder)):
        out[rel] = hashlib.sha256((folder / rel).read_bytes()).hexdigest()
    return out


def cli_run(*args):
    """The real CLI in a subprocess (no check: the exit code is the point)."""
    return helpers.trainer(*args, check=False)


def assert_one_line_error(p, code: int, *fragments: str) -> str:
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer: error: "), p.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def in_process(capsys, *args) -> tuple[int, str, str]:
    """cli.main in this process: (exit code, stdout, stderr); an uncaught exception fails."""
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- 1. a manifest that is not text ------------------------------------------------------------


def _garble_manifest(ckpt):
    (ckpt / store.MANIFEST).write_bytes(b"\xff\xfe\x00 not utf-8 \x80\x81  meta.json\n")


def test_a_non_utf8_manifest_is_a_corrupt_checkpoint_and_resume_falls_back(run, capsys):
    root = run / "checkpoints"
    _garble_manifest(root / NEWEST)
    with pytest.raises(store.CorruptCheckpoint, match="not text"):
        store.verify(str(root / NEWEST))
    older = {n: digest(root / n) for n in ("step-000000003", "step-000000006", "step-000000009")}
    code, out, err = in_process(capsys, "train", *TINY, "train.epochs=5", f"run_dir={run}")
    assert code == 0, err
    assert f"{NEWEST} is corrupt ({store.MANIFEST} is not text" in out
    assert "resumed from" in out and "step-000000009 (step 9" in out
    assert {n: digest(root / n) for n in older} == older


def test_when_every_checkpoint_is_damaged_auto_resume_exits_2_and_keeps_everything(run):
    for _, path in store.list_checkpoints(str(run / "checkpoints")):
        _garble_manifest(run / "checkpoints" / os.path.basename(path))
    before = digest(run)
    p = cli_run("train", *TINY, "train.epochs=5", f"run_dir={run}")
    assert_one_line_error(p, 2, "ckpt.resume=auto", "no checkpoint in", "verifies")
    assert digest(run) == before  # no fresh start over the old checkpoints and metrics


# --- 2. contents that verify but do not fit ----------------------------------------------------


def _edit_json(name, **changes):
    def edit(ckpt):
        data = json.loads((ckpt / name).read_text())
        data.update(changes)
        (ckpt / name).write_text(json.dumps(data))

    return edit


def _write(name, text):
    return lambda ckpt: (ckpt / name).write_text(text)


def _torch(name, value):
    return lambda ckpt: torch.save(value, ckpt / name)


def _edit_state(**changes):
    def edit(ckpt):
        state = torch.load(ckpt / "state.pt", weights_only=True)
        state.update(changes)
        torch.save(state, ckpt / "state.pt")

    return edit


def _edit_weights(change):
    def edit(ckpt):
        tensors = load_file(str(ckpt / "model.safetensors"))
        save_file(change(tensors), str(ckpt / "model.safetensors"))

    return edit


def _renamed(tensors):
    tensors["bogus.weight"] = tensors.pop("1.weight")
    return tensors


def _reshaped(tensors):
    tensors["1.weight"] = torch.zeros(5, 16)
    return tensors


CONTENT_DAMAGE = {
    "meta-empty": (_write("meta.json", "{}"), "meta.json: 'loop' is NoneType"),
    "meta-not-json": (_write("meta.json", "{nope"), "meta.json or config.yaml is unreadable"),
    "loop-string": (_edit_json("meta.json", loop="x"), "meta.json: 'loop' is str"),
    "loop-keys": (_edit_json("meta.json", loop={"step": -1}), "'loop' must hold"),
    "config-list": (_write("config.yaml", "- a\n- b\n"), "config.yaml holds a ListConfig"),
    "optimizer-empty": (_torch("optimizer.pt", {}), "optimizer.pt is not an optimizer"),
    "optimizer-groups": (
        _torch("optimizer.pt", {"state": {}, "param_groups": [{"params": [0]}]}),
        "optimizer.pt does not fit this optimizer",
    ),
    "state-empty": (_torch("state.pt", {}), "state.pt: 'scheduler' is missing"),
    "rng-size": (
        _edit_state(rng=[{"torch": torch.zeros(3, dtype=torch.uint8)}]),
        "state.pt: rank 0's RNG state 'torch' is not a torch.uint8 tensor of shape",
    ),
    "rng-type": (_edit_state(rng="x"), "state.pt: 'rng' is not a list"),
    "weights-keys": (_edit_weights(_renamed), "model.safetensors does not hold this model"),
    "weights-shape": (_edit_weights(_reshaped), "1.weight has shape (5, 16) there, (8, 16) here"),
}


@pytest.mark.parametrize("case", sorted(CONTENT_DAMAGE))
def test_contents_that_verify_but_do_not_fit_are_refused_in_one_line(run, case):
    damage, problem = CONTENT_DAMAGE[case]
    ckpt = run / "checkpoints" / NEWEST
    damage(ckpt)
    store.write_manifest(str(ckpt))
    store.verify(str(ckpt))  # it verifies: only the structure is wrong
    before = digest(run)
    with pytest.raises(UsageError) as e:
        _run(run, "train.epochs=5", f"ckpt.resume={ckpt}")
    assert f"ckpt.resume={ckpt}: damaged checkpoint" in str(e.value) and problem in str(e.value)
    assert len(str(e.value).splitlines()) == 1 and e.value.exit_code == 2
    assert digest(run) == before


@pytest.mark.parametrize("case", ["meta-empty", "rng-size", "weights-keys"])
def test_auto_resume_passes_over_a_damaged_checkpoint_like_a_corrupt_one(run, case, capsys):
    damage, problem = CONTENT_DAMAGE[case]
    root = run / "checkpoints"
    damage(root / NEWEST)
    store.write_manifest(str(root / NEWEST))
    older = {n: digest(root / n) for n in ("step-000000003", "step-000000006", "step-000000009")}
    summary = _run(run, "train.epochs=5")
    out = capsys.readouterr().out
    assert f"{NEWEST} is damaged ({problem}" in out and "falling back to an older one" in out
    assert "resumed from" in out and "step-000000009 (step 9" in out
    assert summary["steps"] == 15
    assert {n: digest(root / n) for n in older} == older


def test_a_damaged_checkpoint_named_on_the_command_line_exits_2_in_one_line(run):
    ckpt = run / "checkpoints" / NEWEST
    (ckpt / "meta.json").write_text("{}")
    store.write_manifest(str(ckpt))
    before = digest(run)
    p = cli_run("train", *TINY, "train.epochs=5", f"run_dir={run}", f"ckpt.resume={ckpt}")
    assert_one_line_error(p, 2, f"ckpt.resume={ckpt}: damaged checkpoint", "meta.json: 'loop'")
    assert digest(run) == before


# --- 3. weights of the wrong shape name the key, both shapes and the config key ----------------


def test_eval_of_weights_of_another_shape_names_the_config_key(run):
    p = cli_run("eval", run, "model.kwargs.width=16")
    assert_one_line_error(
        p,
        2,
        "1.weight has shape (8, 16) there, (16, 16) here",
        "likely config key model.kwargs.width",
    )


def test_init_weights_of_another_shape_names_the_config_key(run, tmp_path):
    with pytest.raises(UsageError) as e:
        _run(tmp_path / "warm", f"ckpt.init_weights={run}", "model.kwargs.width=16")
    assert "1.weight has shape (8, 16) there, (16, 16) here" in str(e.value)
    assert "model.kwargs.width (None in" in str(e.value) and "16 here)" in str(e.value)
    assert not (tmp_path / "warm").exists()


def test_without_a_saved_config_the_hint_is_the_model_familys_shape_key(tmp_path):
    from trainer.checkpoint.weights import load_weights_into
    from trainer.models import mlp

    torch.save(mlp((1, 4, 4), 3, hidden=[32]).state_dict(), tmp_path / "w.pt")
    cfg = config.load(None, ["model.hidden=[64]"])
    with pytest.raises(
        UsageError, match=r"\(32, 16\) there, \(64, 16\) here\): check model.hidden"
    ):
        load_weights_into(mlp((1, 4, 4), 3, hidden=[64]), str(tmp_path / "w.pt"), cfg.model)


# --- 4. a checkpoint directory is accepted by eval, export and ckpt.init_weights ---------------


def test_eval_export_and_init_weights_accept_a_checkpoint_directory(run, tmp_path, capsys):
    ckpt = run / "checkpoints" / "step-000000009"
    before = digest(run)
    p = cli_run("eval", ckpt)
    assert p.returncode == 0, p.stderr
    from_ckpt = json.loads(p.stdout.strip().splitlines()[-1])
    assert from_ckpt["count"] == 7 and "accuracy" in from_ckpt
    code, out, err = in_process(capsys, "eval", run / "checkpoints" / NEWEST)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(
        in_process(capsys, "eval", run)[1].strip().splitlines()[-1]
    )  # the run's newest checkpoint is step 12

    code, out, err = in_process(capsys, "export", ckpt, "-o", tmp_path / "out")
    assert code == 0, err
    saved = load_file(str(ckpt / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved.keys() == exported.keys() and all(
        torch.equal(saved[k], exported[k]) for k in saved
    )

    warm = tmp_path / "warm"
    code, out, err = in_process(
        capsys, "train", *TINY, f"run_dir={warm}", f"ckpt.init_weights={ckpt}", "optim.lr=1e-9"
    )
    assert code == 0, err
    assert f"initial weights from {ckpt}" in out
    final = load_file(str(warm / "final" / "model.safetensors"))
    assert all(torch.allclose(saved[k], final[k], atol=1e-6) for k in saved)  # lr 1e-9
    assert digest(run) == before


# --- 8. eval of weights holding NaN/inf --------------------------------------------------------


def test_eval_of_weights_with_nan_says_so_in_one_line(run, tmp_path):
    for folder in (run / "final", run / "checkpoints" / NEWEST):
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["3.bias"][0] = float("nan")
        tensors["1.weight"][0, 0] = float("inf")
        save_file(tensors, str(folder / "model.safetensors"))
    store.write_manifest(str(run / "checkpoints" / NEWEST))
    p = cli_run("eval", run)
    assert_one_line_error(p, 2, "NaN/inf values (1.weight and 1 more)", "diverged")
    assert "loss" not in p.stdout
    with pytest.raises(UsageError, match="NaN/inf"):
        _run(tmp_path / "warm", f"ckpt.init_weights={run / 'final' / 'model.safetensors'}")


def _poisoned_sources(pristine, folder, value: float) -> dict[str, str]:
    """Every kind of weights source, each holding `value` (NaN or an infinity) in one tensor:
    {label: path}. A checkpoint is re-sealed, so it verifies and only the values are wrong."""
    run = folder / "run"
    shutil.copytree(pristine, run)
    ckpt = run / "checkpoints" / NEWEST
    for where in (run / "final", ckpt):
        tensors = load_file(str(where / "model.safetensors"))
        tensors["3.bias"][1] = value
        save_file(tensors, str(where / "model.safetensors"))
    store.write_manifest(str(ckpt))
    plain = {k: v.clone() for k, v in tensors.items()}
    torch.save(plain, folder / "plain.pt")
    torch.save({"state_dict": {f"module.{k}": v for k, v in plain.items()}}, folder / "ddp.pth")
    return {
        "run dir": str(run),
        "checkpoint": str(ckpt),
        "safetensors": str(run / "final" / "model.safetensors"),
        "state_dict .pt": str(folder / "plain.pt"),
        "DDP-wrapped .pth": str(folder / "ddp.pth"),
    }


NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def test_generated_non_finite_weights_exit_2_at_every_entry_point(pristine, tmp_path, capsys):
    """Weights holding NaN/inf, from every kind of source, through every command that reads
    weights (eval, export, ckpt.init_weights, ckpt.resume): exit 2, one line naming the values,
    nothing written. export wrote them without a word before."""
    from tests.test_bad_input import Case, problems, run_in_process

    cases, failures = 0, []
    for label, value in NON_FINITE.items():
        folder = tmp_path / label
        sources = _poisoned_sources(pristine, folder, value)
        before = digest(folder)
        for kind, src in sources.items():
            out, warm = folder / "out", folder / "warm"
            entries = {
                "eval": ("eval", src),
                "export": ("export", src, "-o", str(out)),
                "init_weights": ("train", *TINY, f"run_dir={warm}", f"ckpt.init_weights={src}"),
            }
            if kind == "checkpoint":
                resume = ("train", *TINY, "train.epochs=5", f"run_dir={folder / 'run'}")
                entries["resume"] = (*resume, f"ckpt.resume={src}")
            for entry, argv in entries.items():
                cases += 1
                o = run_in_process(argv)
                found = problems(Case("weights", argv, "NaN/inf values (3.bias)"), o)
                if out.exists() or warm.exists():
                    found.append("wrote output")
                if found:
                    failures.append(f"{label} {kind} via {entry}: {'; '.join(found)}")
        changed = sorted(k for k, v in digest(folder).items() if before.get(k) != v)
        if changed:  # nothing that was there is changed, nothing new is written
            failures.append(f"{label}: files changed or written: {changed[:4]}")
    with capsys.disabled():
        print(f"\n{cases} generated non-finite-weights cases: {len(failures)} failed")
    assert cases >= 45
    assert not failures, "\n".join(failures)


def test_auto_resume_passes_over_a_checkpoint_holding_nan_like_a_damaged_one(run, capsys):
    root = run / "checkpoints"
    state = torch.load(root / NEWEST / "optimizer.pt", weights_only=True)
    first = next(iter(state["state"].values()))
    name = next(k for k, v in first.items() if torch.is_tensor(v) and v.is_floating_point())
    first[name].view(-1)[0] = float("inf")  # the optimizer's state, not the weights
    torch.save(state, root / NEWEST / "optimizer.pt")
    store.write_manifest(str(root / NEWEST))
    summary = _run(run, "train.epochs=5")
    out = capsys.readouterr().out
    damaged = "is damaged (its model or optimizer state holds NaN/inf values (optimizer state 0."
    assert f"{NEWEST} {damaged}" in out
    assert "resumed from" in out and "step-000000009 (step 9" in out
    assert summary["steps"] == 15


# --- 5. export -o to a path it cannot or must not write ----------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh tmpfs and a function that remounts it read-only (chmod does not stop root);
    skipped where mounting is not permitted."""
    import subprocess

    folder = tmp_path / "mnt"
    folder.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    mount = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")

    def read_only():
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)

    try:
        yield SimpleNamespace(path=folder, read_only=read_only)
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def readonly_dir(tmpfs):
    tmpfs.read_only()
    return tmpfs.path


def test_export_to_an_unwritable_place_exits_2_in_one_line(run):
    before = digest(run)
    p = cli_run("export", run, "-o", "/proc/trainer-export")
    assert_one_line_error(p, 2, "export -o /proc/trainer-export: No such file or directory")
    assert digest(run) == before


def test_export_to_a_read_only_mount_exits_2_and_leaves_nothing(run, readonly_dir, capsys):
    code, _, err = in_process(capsys, "export", run, "-o", readonly_dir / "out")
    assert code == 2 and "Read-only file system" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(readonly_dir) == []


def test_export_refuses_an_output_it_would_half_write_or_clobber(run, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    cases = {
        tmp_path / "missing" / "out": "does not exist: create it first",
        tmp_path / "file" / "out": "is a file, not a folder",
        tmp_path / "file": "is a file, not a directory",
        tmp_path / "busy": "holds other files (notes.txt)",
    }
    before = digest(tmp_path)
    for out, fragment in cases.items():
        code, _, err = in_process(capsys, "export", run, "-o", out)
        assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, (out, err)
    assert digest(tmp_path) == before  # the run, the file and the folder's notes are all intact
    assert not (tmp_path / "missing").exists()
    # An earlier export is what export may replace.
    assert in_process(capsys, "export", run, "-o", tmp_path / "again")[0] == 0
    assert in_process(capsys, "export", run, "-o", tmp_path / "again")[0] == 0


# --- 7. a ckpt.dir that can never be written is exit 2, found up front -------------------------


def test_dry_run_catches_a_ckpt_dir_under_proc_up_front(tmp_path):
    p = cli_run("train", "--dry-run", *TINY, f"run_dir={tmp_path / 'run'}", "ckpt.dir=/proc/ckpts")
    assert_one_line_error(p, 2, "ckpt.dir /proc/ckpts is not writable", "No such file or directory")
    assert "dry run ok" not in p.stdout and not (tmp_path / "run").exists()


def test_a_ckpt_dir_under_a_regular_file_exits_2_before_training(tmp_path):
    (tmp_path / "file").write_text("mine")
    p = cli_run(
        "train", *TINY, f"run_dir={tmp_path / 'run'}", f"ckpt.dir={tmp_path / 'file' / 'c'}"
    )
    assert_one_line_error(p, 2, f"ckpt.dir {tmp_path / 'file' / 'c'} is not writable")
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "run").exists()


def test_a_read_only_ckpt_dir_is_exit_2_for_the_dry_run_and_the_run(tmpfs, tmp_path, capsys):
    run_dir = tmpfs.path / "run"
    _run(run_dir, "train.epochs=2")
    capsys.readouterr()
    tmpfs.read_only()
    before = digest(tmpfs.path)
    for dry in (["--dry-run"], []):
        code, out, err = in_process(
            capsys, "train", *dry, *TINY, f"run_dir={run_dir}", "train.epochs=3"
        )
        assert code == 2, (dry, out, err)
        assert len(err.strip().splitlines()) == 1 and "Read-only file system" in err
        assert f"ckpt.dir {run_dir / 'checkpoints'} is not writable" in err
        assert "dry run ok" not in out and "checkpoint step" not in out
    assert digest(tmpfs.path) == before


def test_a_save_refused_for_good_mid_run_is_exit_2_naming_ckpt_dir(tmp_path, monkeypatch, capsys):
    real_write = store.write

    def write(root, step, **kw):
        if step == 6:
            raise OSError(errno.EROFS, "Read-only file system", root)
        return real_write(root, step, **kw)

    monkeypatch.setattr(store, "write", write)
    run_dir = tmp_path / "run"
    code, _, err = in_process(capsys, "train", *TINY, f"run_dir={run_dir}")
    assert code == 2, err  # a periodic save, but no later one can succeed either
    assert f"ckpt.dir {run_dir / 'checkpoints'}: checkpoint at step 6" in err
    assert "Read-only file system" in err and "step-000000003" in err
    assert len(err.strip().splitlines()) == 1
    store.verify(str(run_dir / "checkpoints" / "step-000000003"))


# --- 6. a disk that fills up under metrics.jsonl -----------------------------------------------


class _FillsUp:
    """metrics.jsonl's file object, on a disk that fills up after `lines` more lines: the next
    write gets half its line out and then ENOSPC, as a real full disk does."""

    def __init__(self, f, lines: int):
        self.f, self.left = f, lines

    def write(self, text):
        if self.left <= 0:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device", self.f.name)
        self.left -= 1
        return self.f.write(text)

    def flush(self):
        return self.f.flush()

    def close(self):
        return self.f.close()


def fill_disk_after(lines: int) -> None:
    """Make every RunLogger's metrics.jsonl run out of space after `lines` lines (this process)."""
    from trainer.metrics import RunLogger

    real_open = RunLogger.open

    def open_(self, *a, **k):
        real_open(self, *a, **k)
        if self._jsonl is not None:
            self._jsonl = _FillsUp(self._jsonl, lines)

    RunLogger.open = open_


def full_disk_model(num_classes, in_shape, lines=9):
    """A plug-in model factory that, as a side effect, fills the disk under metrics.jsonl: how
    the subprocess test gets the fault into the real CLI."""
    fill_disk_after(lines)
    return helpers.tiny_model(num_classes, in_shape)


def test_a_full_disk_under_metrics_saves_a_checkpoint_and_exits_4_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    p = cli_run(
        "train",
        *TINY,
        f"model.name={__name__}:full_disk_model",
        "model.kwargs.lines=10",
        "log.every_steps=1",
        f"run_dir={run_dir}",
    )
    # Step 8's record fails half-written; the ranks learn it from step 9's window all-reduce.
    assert_one_line_error(p, 4, "metrics.jsonl", "No space left on device", "step-000000009 saved")
    root = run_dir / "checkpoints"
    assert [s for s, _ in store.list_checkpoints(str(root))] == [9, 6, 3]
    for _, path in store.list_checkpoints(str(root)):
        store.verify(path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [(r["kind"], r["step"]) for r in map(json.loads, lines[:-1])]
    train = [("train", step) for step in range(1, 8)]
    saves = [("checkpoint", 3), ("checkpoint_written", 3), ("checkpoint", 6)]  # in background
    assert records == [*train[:3], saves[0], *train[3:6], *saves[1:], train[6]]  # 8: half a line


def test_after_a_full_disk_the_earlier_checkpoints_and_metrics_are_intact_and_a_rerun_resumes(
    run, monkeypatch, capsys
):
    root = run / "checkpoints"
    before = {p.name: digest(p) for p in root.iterdir()}
    metrics_before = (run / "metrics.jsonl").read_text()
    with monkeypatch.context() as m:
        from trainer.metrics import RunLogger

        m.setattr(RunLogger, "open", RunLogger.open)  # undone on leaving the block
        fill_disk_after(4)  # the restored and resume records (epochs 4 -> 6), two train records
        code, out, err = in_process(
            capsys, "train", *TINY, "train.epochs=6", "log.every_steps=1", f"run_dir={run}"
        )
    assert code == 4 and len(err.strip().splitlines()) == 1, err
    assert "No space left on device" in err and "step-000000016 saved" in err  # see above
    assert {n: digest(root / n) for n in before} == before
    assert (run / "metrics.jsonl").read_text().startswith(metrics_before)
    code, out, err = in_process(capsys, "train", *TINY, "train.epochs=6", f"run_dir={run}")
    assert code == 0, err
    assert "resumed from" in out and "step-000000016 (step 16" in out


# --- 7. a disk that fills up at the very end ---------------------------------------------------


def test_safetensors_write_failures_are_oserrors_with_the_os_errno(tmp_path):
    """safetensors reports a failed write only in its message; save_weights turns it into the
    OSError every caller handles (here: a 4 kB file-size limit, EFBIG)."""
    code = (
        "import errno, resource, signal, sys, torch\n"
        "from trainer.checkpoint.weights import save_weights\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    save_weights({{'a': torch.zeros(10000)}}, {str(tmp_path / 'w')!r})\n"
        "except OSError as e:\n"
        "    sys.exit(0 if e.errno == errno.EFBIG else f'errno {e.errno}')\n"
        "sys.exit('saved')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not (tmp_path / "w").exists()  # atomic: nothing half-written under the name


def test_a_disk_that_turns_read_only_under_a_whole_checkpoint_exits_2_naming_ckpt_dir(
    tmp_path, monkeypatch, capsys
):
    """safetensors' failed write of model.safetensors in a checkpoint is classed by its errno,
    as weights and export are: a read-only disk is the path's fault (exit 2, point ckpt.dir
    elsewhere), not a transient failure that a retry (exit 4) could cure."""
    import safetensors.torch
    from safetensors import SafetensorError

    def read_only(*args, **kwargs):
        raise SafetensorError(
            "Error while serializing: I/O error: Read-only file system (os error 30)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", read_only)
    run_dir = tmp_path / "run"
    code, _, err = in_process(capsys, "train", *TINY, f"run_dir={run_dir}", "ckpt.async_save=false")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Read-only file system" in err and "point ckpt.dir" in err
    assert store.list_checkpoints(str(run_dir / "checkpoints")) == []


def test_export_onto_a_full_disk_exits_4_in_one_line(tmp_path):
    src, out = tmp_path / "w.safetensors", tmp_path / "out"
    save_file({"a": torch.zeros(10000)}, str(src))
    code = (
        "import resource, signal, sys\n"
        "from trainer import cli\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        f"sys.exit(cli.main(['export', {str(src)!r}, '-o', {str(out)!r}]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert_one_line_error(p, 4, "export -o", "File too large")
    assert not out.exists()


def test_a_full_disk_when_writing_the_final_weights_exits_4_in_one_line_and_a_rerun_finishes(
    tmp_path, monkeypatch, capsys
):
    from trainer.checkpoint import weights as weights_mod

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(train_mod, "save_streamed", full)
        code, _, err = in_process(capsys, "train", *TINY, f"run_dir={run_dir}")
    assert code == 4 and len(err.strip().splitlines()) == 1, err
    assert "No space left on device" in err and "rerunning the same command" in err
    last = store.list_checkpoints(str(run_dir / "checkpoints"))[0]
    store.verify(last[1])
    assert not (run_dir / "summary.json").exists()
    code, _, err = in_process(capsys, "train", *TINY, f"run_dir={run_dir}")
    assert code == 0, err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == last[0]
    assert weights_mod.read_weights(str(run_dir / "final" / "model.safetensors"))
