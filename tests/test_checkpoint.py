"""The checkpoint format: atomic, verified, weights_only, prefix- and device-tolerant."""

import errno
import os
import shutil
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import helpers
from tests.helpers import ROOT, tiny_model
from trainer import config
from trainer.checkpoint import store, weights
from trainer.checkpoint.manager import CheckpointWriteError
from trainer.checkpoint.resume import choose_resume, config_conflicts
from trainer.errors import UsageError
from trainer.optim import Schedule
from trainer.train import train

TINY = [
    *helpers.TINY,
    "train.epochs=4",
    "optim.name=sgd",
    "optim.lr=0.1",
    "log.progress=none",
    "ckpt.every_epochs=1",
    "ckpt.keep_last=10",
]


def _run(run_dir, *extra):
    return train(config.load(None, [*TINY, f"run_dir={run_dir}", *extra]))


@pytest.fixture
def trained(tmp_path):
    _run(tmp_path / "run")
    return tmp_path / "run"


def test_a_run_leaves_verified_checkpoints_with_everything(trained):
    ckpts = store.list_checkpoints(str(trained / "checkpoints"))
    assert [s for s, _ in ckpts] == [12, 9, 6, 3]
    path = ckpts[0][1]
    store.verify(path)
    assert sorted(os.listdir(path)) == sorted([*store.FILES, store.MANIFEST])
    payload = store.read(path)
    assert payload["meta"]["loop"] == {
        "epoch": 4,
        "step": 12,
        "step_in_epoch": 0,
        "samples_seen": 36,
    }
    assert {"scheduler", "scaler", "rng", "world_size"} <= payload["extra"].keys()
    assert len(payload["extra"]["rng"]) == 1 and "torch" in payload["extra"]["rng"][0]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in payload["model"])
    assert "optimizer" in payload and payload["config_yaml"].startswith("name:")


def test_keep_last_prunes_old_checkpoints(tmp_path):
    _run(tmp_path / "run", "ckpt.keep_last=2")
    assert [s for s, _ in store.list_checkpoints(str(tmp_path / "run" / "checkpoints"))] == [
        12,
        9,
    ]


def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


def _flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _replace(p, make):
    p.unlink()
    make(p)


def _to_zero(p):
    os.symlink("/dev/zero", p)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (
            lambda c: _truncate(c / "model.safetensors"),
            "model.safetensors does not match its sha256",
        ),
        (lambda c: _flip(c / "optimizer.pt"), "optimizer.pt does not match its sha256"),
        (lambda c: (c / "state.pt").unlink(), "state.pt is missing"),
        (lambda c: (c / store.MANIFEST).unlink(), "no readable MANIFEST.sha256"),
        (lambda c: (c / store.MANIFEST).write_text("garbage\n"), "malformed MANIFEST.sha256"),
        (lambda c: (c / "meta.json").write_text("{}"), "meta.json does not match its sha256"),
        # where the manifest belongs, a FIFO hung the read; a device had no end
        (lambda c: _replace(c / store.MANIFEST, os.mkfifo), "no readable MANIFEST.sha256"),
        (lambda c: _replace(c / store.MANIFEST, _to_zero), "no readable MANIFEST.sha256"),
    ],
)
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(trained, damage, reason):
    root = trained / "checkpoints"
    damage(root / "step-000000012")
    warnings = []
    assert store.latest_valid(str(root), warnings.append) == str(root / "step-000000009")
    assert (
        len(warnings) == 1 and "step-000000012 is corrupt" in warnings[0] and reason in warnings[0]
    )
    with pytest.raises(UsageError, match="corrupt checkpoint"):
        choose_resume(str(root / "step-000000012"), str(root), warnings.append)


def test_resume_auto_skips_a_corrupt_newest_and_says_so(trained, capsys):
    _truncate(trained / "checkpoints" / "step-000000012" / "model.safetensors")
    summary = _run(trained, "train.epochs=5")
    out = capsys.readouterr().out
    assert "step-000000012 is corrupt" in out and "resumed from" in out and "step-000000009" in out
    assert summary["steps"] == 15


def test_resume_with_no_checkpoint_that_verifies_names_where_it_looked_and_the_ways_on(
    trained, tmp_path
):
    root = trained / "checkpoints"
    for _, path in store.list_checkpoints(str(root)):
        _truncate(os.path.join(path, "model.safetensors"))
    for given in (trained, root):  # a run directory, its checkpoints folder
        with pytest.raises(UsageError) as e:
            choose_resume(str(given), str(root), lambda _: None)
        assert str(e.value) == (
            f"ckpt.resume={given}: holds no checkpoint that verifies (4 in {root}, all damaged; "
            "`sha256sum -c MANIFEST.sha256` in a step folder, e.g. step-000000012, names its bad "
            "files): point ckpt.resume at another run or checkpoint, or start fresh with "
            "ckpt.resume=never or a new run_dir"
        )
    with pytest.raises(UsageError) as e:  # its sibling, for auto
        choose_resume("auto", str(root), lambda _: None)
    assert str(e.value).startswith(f"ckpt.resume=auto: no checkpoint in {root} verifies (4 found")
    assert "`sha256sum -c MANIFEST.sha256` in a step folder, e.g. step-000000012" in str(e.value)
    assert "ckpt.resume=PATH" in str(e.value) and "a new run_dir" in str(e.value)
    # the hint holds: the manifest names the damaged file
    check = subprocess.run(
        ["sha256sum", "-c", store.MANIFEST],
        cwd=root / "step-000000012",
        capture_output=True,
        text=True,
    )
    assert "model.safetensors: FAILED" in check.stdout and "meta.json: OK" in check.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError) as e:  # no checkpoint at all: the wrong folder
        choose_resume(str(empty), str(root), lambda _: None)
    assert str(e.value) == (
        f"ckpt.resume={empty}: no checkpoint (step-NNNNNNNNN folder) in it or in "
        f"{empty / 'checkpoints'}: point ckpt.resume at a run directory, its checkpoints folder "
        "or one step folder, or start fresh with ckpt.resume=never or a new run_dir"
    )


def test_stale_temporaries_are_cleaned_and_a_half_replaced_checkpoint_restored(trained):
    root = trained / "checkpoints"
    (root / ".step-000000015.tmp-999").mkdir()
    os.rename(root / "step-000000012", root / ".step-000000012.old-998")  # killed mid-replace
    store.remove_stale_temporaries(str(root))
    assert sorted(os.listdir(root)) == [
        "step-000000003",
        "step-000000006",
        "step-000000009",
        "step-000000012",
    ]
    store.verify(str(root / "step-000000012"))


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_a_malicious_pickle_is_refused_and_never_runs(tmp_path):
    _Evil.marker = tmp_path / "pwned"
    bad = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2), "payload": _Evil()}, bad)
    with pytest.raises(UsageError, match="refused to load .*weights_only"):
        weights.read_weights(str(bad))
    assert not _Evil.marker.exists()


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
@pytest.mark.parametrize("fmt", ["pt", "safetensors", "nested-pt"])
def test_wrapped_weights_load_into_a_plain_model(tmp_path, prefix, fmt):
    src = tiny_model(3, (1, 4, 4))
    state = {prefix + k: v for k, v in src.state_dict().items()}
    path = tmp_path / f"w.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    if fmt == "safetensors":
        save_file(state, path)
    else:
        torch.save({"state_dict": state, "epoch": 3} if fmt == "nested-pt" else state, path)
    dst = tiny_model(3, (1, 4, 4))
    weights.load_weights_into(dst, str(path))
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)


def test_a_gpu_saved_checkpoint_loads_on_cpu(tmp_path, monkeypatch):
    # Record the storage location as cuda:1, exactly as a GPU process would.
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
    torch.save({"w": torch.arange(4.0)}, tmp_path / "gpu.pt")
    monkeypatch.undo()
    raw = (tmp_path / "gpu.pt").read_bytes()
    assert b"cuda:1" in raw
    assert torch.equal(weights.read_weights(str(tmp_path / "gpu.pt"))["w"], torch.arange(4.0))


def test_mismatched_weights_name_the_fix(tmp_path):
    torch.save({"other.weight": torch.zeros(1)}, tmp_path / "w.pt")
    with pytest.raises(UsageError, match="do not fit model"):
        weights.load_weights_into(tiny_model(3, (1, 4, 4)), str(tmp_path / "w.pt"))


def test_a_failed_save_keeps_the_previous_checkpoint_intact(trained, monkeypatch, capsys):
    root = trained / "checkpoints"
    before = {
        p: (root / "step-000000012" / p).read_bytes() for p in os.listdir(root / "step-000000012")
    }

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_torch_save", disk_full)
    with pytest.raises(CheckpointWriteError) as e:
        _run(trained, "train.epochs=5")  # the final save must succeed, so the run fails (exit 4)
    assert "No space left on device" in str(e.value) and "step-000000012" in str(e.value)
    assert e.value.exit_code == 4
    assert [n for n in os.listdir(root) if n.startswith(".")] == []  # no half-written leftovers
    after = {
        p: (root / "step-000000012" / p).read_bytes() for p in os.listdir(root / "step-000000012")
    }
    assert before == after
    store.verify(str(root / "step-000000012"))


def test_a_failed_periodic_save_warns_and_training_goes_on(tmp_path, monkeypatch, capsys):
    real_write = store.write
    calls = []

    def flaky(root, step, **kw):
        calls.append(step)
        if step == 6:
            raise OSError(errno.EIO, "Input/output error")
        return real_write(root, step, **kw)

    monkeypatch.setattr(store, "write", flaky)
    summary = _run(tmp_path / "run")
    assert "WARNING: checkpoint at step 6 could not be written" in capsys.readouterr().out
    assert summary["steps"] == 12 and summary["checkpoint_failures"] == 1
    assert [s for s, _ in store.list_checkpoints(str(tmp_path / "run" / "checkpoints"))] == [
        12,
        9,
        3,
    ]


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a tmpfs"
)
def test_a_real_full_disk_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        _run(disk / "run", "train.epochs=1")  # one small checkpoint fits
        st = os.statvfs(disk)
        # Leave room for the run's small files (run.json, metrics) but not for a checkpoint.
        (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 12 * 1024))
        with pytest.raises(CheckpointWriteError) as e:
            _run(disk / "run", "train.epochs=2")
        assert "No space left on device" in str(e.value) and "step-000000003" in str(e.value)
        root = disk / "run" / "checkpoints"
        assert [s for s, _ in store.list_checkpoints(str(root))] == [3]
        store.verify(str(root / "step-000000003"))
        assert [n for n in os.listdir(root) if n.startswith(".")] == []
    finally:
        subprocess.run(["umount", str(disk)])


def test_export_writes_plain_safetensors_from_a_run_and_from_wrapped_weights(trained, tmp_path):
    p = subprocess.run(
        [
            str(ROOT / ".venv/bin/trainer") if (ROOT / ".venv/bin/trainer").exists() else "trainer",
            "export",
            str(trained),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    saved = load_file(str(trained / "export" / "model.safetensors"))
    assert set(saved) == set(tiny_model(3, (1, 4, 4)).state_dict())
    assert (trained / "export" / "config.yaml").exists()
    wrapped = tmp_path / "dp.pth"
    torch.save({f"module.{k}": v for k, v in saved.items()}, wrapped)
    out = weights.export(str(wrapped))
    assert out == str(tmp_path / "dp-export" / "model.safetensors")
    assert set(load_file(out)) == set(saved)


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode",
    [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)],
    ids=["umask 022", "umask 077"],
)
def test_what_a_run_and_an_export_write_follows_the_umask(tmp_path, umask, file_mode, dir_mode):
    """A second user, or a pod of another uid on the shared volume, reads what a run writes
    when the umask says so (safetensors alone made its files 0600); 077 keeps it all private."""
    run = tmp_path / "run"
    before = os.umask(umask)
    try:
        train(config.load(None, [*helpers.TINY, "train.epochs=1", f"run_dir={run}"]))
        weights.export(str(run))
    finally:
        os.umask(before)
    paths = [run, *run.rglob("*")]
    names = {str(p.relative_to(run)) for p in paths}
    written = {"final/model.safetensors", "export/model.safetensors", "config.yaml", "summary.json"}
    assert written | {"metrics.jsonl", "run.json", "checkpoints"} <= names, sorted(names)
    assert [n for n in names if n.startswith("checkpoints/step-") and n.endswith(".safetensors")]
    wrong = {
        str(p.relative_to(run)): oct(p.stat().st_mode & 0o777)
        for p in paths
        if p.stat().st_mode & 0o777 != (dir_mode if p.is_dir() else file_mode)
    }
    assert not wrong, f"expected {oct(file_mode)} files and {oct(dir_mode)} folders: {wrong}"


def test_resume_refuses_a_config_change_that_breaks_exactness(trained):
    with pytest.raises(UsageError, match=r"cannot resume .*data.global_batch_size: 4 -> 8"):
        _run(trained, "train.epochs=5", "data.global_batch_size=8")


def test_which_config_changes_a_resume_accepts():
    saved = config.to_dict(config.load(None, []))
    ok = config.to_dict(
        config.load(None, ["train.epochs=99", "log.every_steps=1", "run_dir=x", "dist.timeout_s=9"])
    )
    assert config_conflicts(saved, ok) == []
    bad = config.to_dict(config.load(None, ["optim.lr=0.5", "seed=3"]))
    assert config_conflicts(saved, bad) == ["optim.lr: 0.001 -> 0.5", "seed: 0 -> 3"]


def test_resume_keeps_the_new_schedule(trained):
    summary = _run(trained, "train.epochs=8", "log.every_steps=1")
    assert summary["steps"] == 24
    # The preset's cosine (20 warm-up steps) now spans 24 steps: the saved schedule of 12 would
    # give lr 0 after the warm-up.
    cosine = Schedule("cosine", total_steps=24, steps_per_epoch=3, warmup_steps=20)
    lrs = {r["step"]: r["lr"] for r in helpers.read_jsonl(trained / "metrics.jsonl") if "lr" in r}
    assert sorted(s for s in lrs if s > 12) == list(range(13, 25))
    for s in range(13, 25):
        assert lrs[s] == pytest.approx(0.1 * cosine(s)), s


def test_init_weights_starts_from_foreign_weights(trained, tmp_path):
    saved = load_file(str(trained / "final" / "model.safetensors"))
    torch.save({f"module.{k}": v for k, v in saved.items()}, tmp_path / "dp.pt")
    _run(
        tmp_path / "warm",
        f"ckpt.init_weights={tmp_path / 'dp.pt'}",
        "optim.lr=1e-9",
        "train.epochs=1",
    )
    after = load_file(str(tmp_path / "warm" / "final" / "model.safetensors"))
    for k, v in saved.items():
        assert torch.allclose(after[k], v, atol=1e-6)


def test_ckpt_dir_moves_checkpoints_and_resume_never_starts_over(tmp_path, capsys):
    shared = tmp_path / "shared-ckpts"
    _run(tmp_path / "a", f"ckpt.dir={shared}")
    assert not (tmp_path / "a" / "checkpoints").exists()
    assert [s for s, _ in store.list_checkpoints(str(shared))] == [12, 9, 6, 3]
    capsys.readouterr()
    # another run directory, same ckpt.dir: auto resumes from it and trains one more epoch
    summary = _run(tmp_path / "b", f"ckpt.dir={shared}", "train.epochs=5")
    assert f"resumed from {shared / 'step-000000012'} " in capsys.readouterr().out
    assert summary["steps"] == 15 and store.list_checkpoints(str(shared))[0][0] == 15
    # never: from scratch, whatever the folder holds (same config, same numbers as run a)
    summary = _run(tmp_path / "c", f"ckpt.dir={shared}", "ckpt.resume=never")
    out = capsys.readouterr().out
    assert "resumed from" not in out and summary["steps"] == 12
    # said, never silent: the earlier run's checkpoints stay beside this one's
    assert (
        f"ckpt.resume=never: {shared} holds 5 checkpoint(s) of an earlier run (newest: step 15)"
        in out
    )
    a, c = (load_file(str(tmp_path / r / "final" / "model.safetensors")) for r in "ac")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_non_tensor_items_in_shards_load_without_running_code(tmp_path):
    """The optimizer's hyperparameters travel as pickled bytes inside the shards."""
    import io
    import os
    import pickle

    from trainer.checkpoint.sharded import SafeLoadPlanner

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"lr": Payload()}, buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, buf)
    assert not marker.exists()


def _dcp_state(model, opt) -> dict:
    """What the checkpointer hands DCP: the model's and optimizer's state in DCP's form."""
    from trainer.parallel.mesh import Mesh
    from trainer.parallel.parts import whole
    from trainer.state import ModelState

    return ModelState(whole(model), opt, Mesh()).state_dict()


def test_a_failed_shard_write_is_an_ordinary_exception_the_checkpointer_recovers_from(tmp_path):
    """DCP raises CheckpointException, a BaseException: `except Exception` would let it crash."""
    import pytest as _pytest

    from trainer.checkpoint import sharded

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    (tmp_path / "dcp").write_text("a file where the shard folder goes")
    with _pytest.raises(sharded.ShardWriteError) as e:
        sharded.save(_dcp_state(model, opt), str(tmp_path))
    assert isinstance(e.value, Exception) and "\n" not in str(e.value)
    (tmp_path / "dcp").unlink()
    sharded.save(_dcp_state(model, opt), str(tmp_path))  # and a healthy folder round-trips
    assert sharded.read_model(str(tmp_path)).keys() == {"weight", "bias"}


def _contents(path) -> dict:
    """What a checkpoint holds, less wall-clock times and the config (run_dir differs)."""
    payload = store.read(str(path))
    del payload["meta"]["time"], payload["config_yaml"]
    del payload["meta"]["results"]["train_time_s"], payload["meta"]["results"]["data_wait_s"]
    return payload


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_background_save_holds_its_steps_state_while_training_goes_on(tmp_path, monkeypatch):
    real = store._torch_save

    def slow(obj, path):  # each write takes 0.5 s longer than 3 tiny steps
        if path.endswith("optimizer.pt"):
            time.sleep(0.5)
        real(obj, path)

    monkeypatch.setattr(store, "_torch_save", slow)
    adam = ["optim.name=adamw", "optim.lr=0.01"]  # optimizer state, updated in place each step
    _run(tmp_path / "async", *adam)
    _run(tmp_path / "blocking", *adam, "ckpt.async_save=false")
    records = helpers.read_jsonl(tmp_path / "async" / "metrics.jsonl")
    saves = [(r["step"], r["background"]) for r in records if r["kind"] == "checkpoint"]
    assert saves == [(3, True), (6, True), (9, True), (12, False)]  # final: written in place
    written = {r["step"]: r for r in records if r["kind"] == "checkpoint_written"}
    assert sorted(written) == [3, 6, 9]
    # Training reached the next save while the previous write still ran: it waited there.
    assert all(written[s]["waited"] > 0.2 for s in (3, 6)), written
    for step in (3, 6, 9, 12):
        name = store.step_dir("checkpoints", step)
        assert _same(
            _contents(tmp_path / "async" / name), _contents(tmp_path / "blocking" / name)
        ), f"step {step}: the background checkpoint differs from the blocking one"


def test_a_background_shard_write_holds_the_state_of_when_it_began(tmp_path):
    """DCP's async save copies each rank's shards to host memory before it returns: changing
    the weights and optimizer state right after does not reach the files."""
    from trainer.checkpoint import sharded

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    stager = sharded.HostCopy()
    for name in ("first", "second"):  # the second save reuses the first one's host buffers
        before = {k: v.clone() for k, v in model.state_dict().items()}
        written = sharded.save_in_background(
            _dcp_state(model, opt), str(tmp_path / name), None, stager
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        written.result()
        saved = sharded.read_model(str(tmp_path / name))
        assert saved.keys() == before.keys()
        assert all(torch.equal(saved[k], before[k]) for k in before), name
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "dcp").write_text("a file where the shard folder goes")
    with pytest.raises(sharded.ShardWriteError) as e:
        sharded.save_in_background(_dcp_state(model, opt), str(tmp_path / "bad"), None).result()
    assert "\n" not in str(e.value)


def test_the_wall_time_cadence_is_due_after_its_minutes_and_off_at_0():
    from trainer.checkpoint.manager import save_due

    ckpt = config.load(None, ["ckpt.every_minutes=2"]).ckpt
    assert not save_due(ckpt, last_save=100.0, now=219.0)
    assert save_due(ckpt, last_save=100.0, now=220.0)
    off = config.load(None, ["ckpt.every_minutes=0"]).ckpt
    assert not save_due(off, last_save=0.0, now=1e9)
    assert config.load(None, []).ckpt.every_minutes == 30  # on by default, beside every_epochs


def _saves(run_dir) -> list[tuple[int, str]]:
    records = helpers.read_jsonl(run_dir / "metrics.jsonl")
    return [(r["step"], r["reason"]) for r in records if r["kind"] == "checkpoint"]


def test_a_wall_time_save_lands_at_a_log_window_and_an_epoch_end_does_not_repeat_it(tmp_path):
    # 12 steps, 3 an epoch, a log window every 2 steps and a cadence of 60 microseconds: every
    # window saves (but the last step's: the final save covers it); the epoch ends at 6 and 12
    # find that step saved already, the one at 3 and 9 saves.
    _run(tmp_path / "run", "log.every_steps=2", "ckpt.every_minutes=0.000001")
    assert _saves(tmp_path / "run") == [
        (2, "every_minutes"),
        (3, "every_epochs"),
        (4, "every_minutes"),
        (6, "every_minutes"),
        (8, "every_minutes"),
        (9, "every_epochs"),
        (10, "every_minutes"),
        (12, "final"),
    ]


@pytest.mark.slow
def test_rank_0s_clock_decides_a_wall_time_save_for_every_rank(tmp_path):
    """Two ranks: a save is a collective, so ranks that disagreed would deadlock (or time out)."""
    run_dir = tmp_path / "run"
    helpers.trainer(
        "train", *TINY, "ckpt.every_epochs=0", "log.every_steps=2", "ckpt.every_minutes=0.000001",
        "dist.timeout_s=30", f"run_dir={run_dir}", nproc=2, torchrun=False,
    )  # fmt: skip
    assert _saves(run_dir) == [(s, "every_minutes") for s in (2, 4, 6, 8, 10)] + [(12, "final")]


def test_a_failed_save_does_not_count_and_the_epoch_end_at_its_step_saves(tmp_path, monkeypatch):
    real_write, failed = store.write, []

    def flaky(root, step, **kw):
        if step == 6 and not failed:  # the wall-time save at step 6 fails, once
            failed.append(step)
            raise OSError(errno.EIO, "Input/output error")
        return real_write(root, step, **kw)

    monkeypatch.setattr(store, "write", flaky)
    run = tmp_path / "run"
    _run(run, "ckpt.async_save=false", "log.every_steps=2", "ckpt.every_minutes=0.000001")
    assert failed == [6]
    assert (6, "every_epochs") in _saves(run)  # the epoch end tried again, and it held
    assert 6 in [s for s, _ in store.list_checkpoints(str(run / "checkpoints"))]


def test_the_presets_with_short_epochs_save_when_they_evaluate():
    """digits and diabetes epochs take a fraction of a second: a save per epoch cost 10% of the
    default run (bench: default checkpoints / none). They save every 5 epochs, with the eval."""
    from trainer.loop import should_save

    for preset in ("digits-mlp", "digits-lenet", "diabetes-mlp"):
        cfg = config.load(preset, [])
        assert cfg.ckpt.every_epochs == cfg.train.eval_every_epochs == 5, preset
        epochs, per_epoch = cfg.train.epochs, 23
        total = epochs * per_epoch
        saved = [
            e
            for e in range(1, epochs + 1)
            if should_save(cfg.ckpt, step=e * per_epoch, total_steps=total, epoch_done=e)
        ]
        assert saved == list(range(5, epochs, 5)), preset  # the last epoch: the final save
    assert config.load(None, []).ckpt.every_epochs == 5  # digits-mlp is the default config


def test_a_streamed_safetensors_file_loads_with_safetensors_alone(tmp_path):
    """trainer/checkpoint/streamed.py writes the header first, then each tensor as it comes:
    plain safetensors (every dtype a model's state holds, an empty tensor, metadata); a tensor
    out of order or a stream cut short leaves no file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from trainer.checkpoint.streamed import StreamWriter

    state = {
        "w": torch.randn(3, 5),
        "h": torch.randn(4, 2).to(torch.bfloat16),
        "n": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "t": torch.randn(6, 3).t(),  # not contiguous
    }
    layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    path = tmp_path / "model.safetensors"
    writer = StreamWriter(str(path), layout, {"config": "a: 1"})
    for k, v in state.items():
        writer.write(k, v)
    writer.close()
    back = load_file(str(path))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"config": "a: 1"}
    cut = tmp_path / "cut.safetensors"
    writer = StreamWriter(str(cut), layout)
    writer.write("w", state["w"])
    with pytest.raises(ValueError, match="expected h"):
        writer.write("n", state["n"])
    writer.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_the_weights_digest_is_the_tensors_alone(tmp_path):
    """checkpoint/digest.py: the same tensors in another order, with other metadata, digest
    alike (the files differ); one changed bit, a renamed key or another dtype do not."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    from trainer.checkpoint.digest import file_digest

    t = {"b.weight": torch.randn(3, 4), "a.bias": torch.arange(5.0), "s": torch.tensor(2.0)}
    save_file(t, tmp_path / "1.safetensors", metadata={"config": "run_dir: runs/one"})
    save_file(dict(reversed(t.items())), tmp_path / "2.safetensors", metadata={"x": "y"})
    flipped = {**t, "s": torch.tensor(2.0).view(torch.int32).add(1).view(torch.float32)}
    save_file(flipped, tmp_path / "3.safetensors")
    renamed = {("s2" if k == "s" else k): v for k, v in t.items()}
    save_file(renamed, tmp_path / "4.safetensors")
    save_file({**t, "s": torch.tensor(2.0, dtype=torch.float64)}, tmp_path / "5.safetensors")
    files = [tmp_path / f"{i}.safetensors" for i in range(1, 6)]
    assert files[0].read_bytes() != files[1].read_bytes()
    digests = [file_digest(str(f)) for f in files]
    assert digests[0] == digests[1] and len(set(digests[1:])) == 4
    out = subprocess.run(
        [sys.executable, "-m", "trainer.checkpoint.digest", *map(str, files[:2])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert [line.split()[0] for line in out if line] == digests[:2]
