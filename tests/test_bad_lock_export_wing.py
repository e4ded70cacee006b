"""Issue 55, area C: the run lock and export's safety, through the real CLI, each one line and exit 2
(tests/badwing.py's harness: no traceback, no hang, the good run's files unchanged).

The tables, generated from small lists:

- what can stand where RUN/.job.lock belongs (a FIFO, a directory, links to a FIFO, to
  /dev/zero, to a huge file or to nothing, a socket; a file that is empty, not UTF-8, not JSON,
  JSON of another shape, a record with a field missing, of the wrong type or out of range)
  x `train`, `train --dry-run` and `train --resume`: refused in one line naming the file and the
  fix, never a hang, an unlocked run or a silent takeover. A dead holder's well-formed lock is
  still taken over (tests/test_runlock.py holds those rules; one case here runs);
- export sources inside a second tiny run (the target, its files checked after every case as
  the good run's are) x outputs inside and around it (the run, final/, checkpoints/, a step,
  diagnostics/, a new folder inside, a link into it, a path through a linked parent, the source
  itself, a file, a folder of other files, a folder that only looks like an earlier export): an
  export never writes into a run's own folders nor over what it did not write itself;
- sources that are FIFOs, devices or sockets, or run folders holding one where a file is read,
  x `eval` and `export`: one line, never a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.badwing import GOOD_ARGS, WingCase, check, good_run, snapshot
from trainer import runlock
from trainer.runlock import LOCK, BadLock, Holder, RunLock

TIMEOUT = 30.0
READ = ("data.name=tests.helpers:tiny", "model.name=tests.helpers:tiny_model")
"""What `eval` needs to build the tiny run's model when the source has no config.yaml to say."""


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return good_run(tmp_path_factory)


# --- the run lock: what stands where RUN/.job.lock belongs x the commands that take it ---------


def _record(**changes) -> dict:
    """A holder's record: on another machine, its heartbeat just now (a live one, if it were
    well-formed: what a malformed field must not turn into a takeover)."""
    holder = replace(Holder.here({}), machine="another-node", pid=4242, beat=time.time())
    return {**asdict(holder), **changes}


def _without(name: str) -> dict:
    record = _record()
    del record[name]
    return record


def _text(text: str):
    return lambda path: Path(path).write_text(text)


def _json(value):
    return _text(json.dumps(value))


def _fifo_link(path: str) -> None:
    os.mkfifo(f"{path}.fifo")
    os.symlink(f"{path}.fifo", path)


def _huge_link(path: str) -> None:
    with open(f"{path}.big", "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB that takes no disk
    os.symlink(f"{path}.big", path)


def _socket(path: str) -> None:
    """A unix socket at `path` (bound where its name is short enough, then moved there)."""
    short = tempfile.mkdtemp(prefix="lk", dir="/tmp")
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(short, "s"))
        os.rename(os.path.join(short, "s"), path)
    finally:
        shutil.rmtree(short, ignore_errors=True)


LOCKS = {
    "a FIFO": os.mkfifo,
    "a directory": os.mkdir,
    "a link to a FIFO": _fifo_link,
    "a link to /dev/zero": lambda p: os.symlink("/dev/zero", p),
    "a link to a huge file": _huge_link,
    "a dangling link": lambda p: os.symlink(f"{p}.gone", p),
    "a socket": _socket,
    "an empty file": _text(""),
    "blank lines": _text("\n \n"),
    "not UTF-8": lambda p: Path(p).write_bytes(b"\xff\xfe{\x00}"),
    "not JSON": _text("holder: me"),
    "half a record": _text(json.dumps(_record())[:40]),
    "100 KB": _text(" " * 100_000 + "{}"),
    "deep nesting": _text("[" * 50_000),
    "a JSON list": _json([1, 2]),
    "a JSON string": _json("holder"),
    "JSON null": _json(None),
    "no pid": _json(_without("pid")),
    "no heartbeat": _json(_without("beat")),
    "no token": _json(_without("token")),
    "a heartbeat that is a string": _json(_record(beat="soon")),
    "a heartbeat of NaN": _text(json.dumps(_record()).replace('"beat": ', '"beat": NaN, "x": ')),
    "a heartbeat of 1e300": _json(_record(beat=1e300)),
    "a negative start time": _json(_record(since=-5)),
    "a negative pid": _json(_record(pid=-5)),
    "a huge pid": _json(_record(pid=10**30)),
    "a pid that is a string": _json(_record(pid="4242")),
    "a pid that is true": _json(_record(pid=True)),
    "a pid of 1.5": _json(_record(pid=1.5)),
    "a host that is a number": _json(_record(host=7)),
    "a machine of null": _json(_record(machine=None)),
}
"""What may stand where RUN/.job.lock belongs, none of it a job's record: each one line, exit 2."""

COMMANDS = {
    "train": ("train",),
    "dry-run": ("train", "--dry-run"),
    "resume": ("train", "--resume"),
}
RESUMED = ("a FIFO", "a directory", "a dangling link", "not JSON", "a heartbeat that is a string")
"""`train --resume RUN` goes the same way; a few kinds prove it."""


@pytest.fixture(scope="module")
def locks(tmp_path_factory, good) -> Path:
    """A run folder per (lock, command): the lock made, its time set a minute back (a lock just
    made may be one still being written, which is watched a second before it is refused)."""
    root = tmp_path_factory.mktemp("locks")
    for kind, make in LOCKS.items():
        for command in COMMANDS:
            if command == "resume" and kind not in RESUMED:
                continue
            folder = root / _slug(kind, command)
            folder.mkdir()
            if command == "resume":
                shutil.copyfile(good / "config.yaml", folder / "config.yaml")
            make(str(folder / LOCK))
            past = time.time() - 60
            os.utime(folder / LOCK, (past, past), follow_symlinks=False)
    return root


def _slug(*words: str) -> str:
    return "-".join(w.replace(" ", "_").replace("/", "_") for w in words)


def lock_cases(root: Path) -> list[WingCase]:
    cases = []
    for kind in LOCKS:
        for command, argv in COMMANDS.items():
            if command == "resume" and kind not in RESUMED:
                continue
            folder = root / _slug(kind, command)
            args = (*argv, str(folder)) if command == "resume" else (*argv, f"run_dir={folder}")
            lock = str(folder / LOCK)
            cases.append(WingCase(f"lock: {kind}", (*args, *GOOD_ARGS), lock, timeout=TIMEOUT))
    return cases


def test_a_lock_that_is_no_jobs_record_is_one_line_never_a_hang_nor_a_takeover(good, locks):
    assert check(lock_cases(locks), good) >= 60
    for kind in LOCKS:  # each lock left as it was: refused, not removed nor replaced
        folder = locks / _slug(kind, "train")
        assert os.path.lexists(folder / LOCK), kind
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(LOCK)) == [], kind


def test_a_dead_holders_well_formed_lock_is_still_taken_over(good, tmp_path):
    """The rule the refusals must not break: a lock whose holder is gone (a pid that is no
    process now, on this machine) never blocks the next job."""
    folder = tmp_path / "run"
    folder.mkdir()
    dead = replace(Holder.here({}), pid=runlock.PID_MAX, process_start="1")
    (folder / LOCK).write_text(json.dumps(asdict(dead)))
    case = WingCase(
        "lock: a dead holder's",
        ("train", "--dry-run", f"run_dir={folder}", *GOOD_ARGS),
        "",
        runs="a dead holder's well-formed lock is taken over, as before",
        timeout=TIMEOUT,
    )
    check([case], good)
    assert not (folder / LOCK).exists()  # taken over, then given back at the end


# --- the lock's reading, case by case: unit tests of runlock's pure parts ------------------------


@pytest.mark.parametrize(
    "kind", [k for k in LOCKS if k.startswith(("a heartbeat", "a pid", "no "))]
)
def test_a_record_of_the_wrong_shape_is_named_by_its_field(kind, tmp_path):
    path = tmp_path / LOCK
    LOCKS[kind](str(path))
    with pytest.raises(BadLock) as e:
        runlock._read(str(path))
    field = "beat" if "heartbeat" in kind else "pid" if "pid" in kind else kind.split()[-1]
    text = str(e.value)
    assert f"'{field}'" in text and "remove it if no job uses this folder" in text, text
    assert e.value.ident is not None  # a regular file: the one kind a writer may still fill


def test_an_unreadable_lock_is_one_line_not_no_lock(tmp_path, monkeypatch):
    """Root reads any file, so a lock this user may not read is an open that fails EACCES."""
    path = tmp_path / LOCK
    path.write_text(json.dumps(_record()))
    real_open = os.open

    def refuse(name, *args, **kwargs):
        if str(name) == str(path):
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(BadLock, match=r"cannot be read \(Permission denied\): remove it"):
        RunLock(tmp_path, {}).acquire()


def test_a_lock_being_written_is_watched_a_moment_then_read(tmp_path):
    """Storage without hard links makes the lock with O_EXCL and writes its record after: an
    empty lock a moment old is watched, and taken over once its (dead) holder's record lands;
    one that stays empty is refused after a second, not taken over."""
    import threading

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK).write_text("")
    dead = replace(Holder.here({}), pid=runlock.PID_MAX, process_start="1")
    writer = threading.Timer(0.3, lambda: (folder / LOCK).write_text(json.dumps(asdict(dead))))
    writer.start()
    lock = RunLock(folder, {}).acquire()
    writer.join()
    assert lock is not None and json.loads((folder / LOCK).read_text())["token"] == lock.me.token
    lock.release()
    (folder / LOCK).write_text("")
    started = time.monotonic()
    with pytest.raises(BadLock, match="is not a job's record \\(empty\\)"):
        RunLock(folder, {}).acquire()
    assert 0.9 < time.monotonic() - started < 5
    assert (folder / LOCK).read_text() == ""


# --- export: sources inside a second run x outputs inside and around it -------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory, good) -> Path:
    """The target run (a copy of the good run) and what stands around it: links into it, a file,
    a folder of other files, folders that only look like an export, an earlier export, an empty
    folder, and a folder of sources that are no files."""
    root = tmp_path_factory.mktemp("world")
    target = root / "target"
    shutil.copytree(good, target, symlinks=True)
    (root / "link-final").symlink_to(target / "final")
    (root / "link-run").symlink_to(target)
    (root / "a-file").write_text("mine")
    (root / "others").mkdir()
    (root / "others" / "notes.txt").write_text("mine")
    shutil.copytree(target / "final", root / "copied-final")  # model.safetensors alone
    (root / "downloaded").mkdir()  # another model's folder: the names an export writes
    shutil.copyfile(target / "final" / "model.safetensors", root / "downloaded/model.safetensors")
    (root / "downloaded" / "config.json").write_text('{"model_type": "gpt2"}')
    (root / "empty").mkdir()
    from trainer.checkpoint.weights import export

    export(str(good), str(root / "earlier"))
    _sources(root / "sources", good)
    return root


def _sources(root: Path, good: Path) -> None:
    """Sources that are no file, and runs holding one where a file is read."""
    root.mkdir()
    os.mkfifo(root / "fifo.safetensors")
    os.mkfifo(root / "fifo.pt")
    (root / "zero.pt").symlink_to("/dev/zero")
    _socket(str(root / "socket.pt"))
    for name, rel in [
        ("final-fifo", "final/model.safetensors"),
        ("manifest-fifo", "checkpoints/step-000000006/MANIFEST.sha256"),
        ("weights-fifo", "checkpoints/step-000000006/model.safetensors"),
        ("config-fifo", "config.yaml"),
        ("weights-zero", "checkpoints/step-000000006/model.safetensors"),
    ]:
        shutil.copytree(good, root / name, symlinks=True)
        (root / name / rel).unlink()
        if name.endswith("zero"):
            (root / name / rel).symlink_to("/dev/zero")
        else:
            os.mkfifo(root / name / rel)


STEP = "checkpoints/step-000000003"
SOURCES = ("", STEP, "final/model.safetensors")
"""Export sources in the target run: the run, a checkpoint, final's weights file."""

INSIDE = [
    "",
    "final",
    "checkpoints",
    STEP,
    "checkpoints/step-000000006",
    "diagnostics",
    "new",
    "final/new",
    "checkpoints/new",
    f"{STEP}/new",
]
"""Outputs in the target run: the run itself, its own folders, new folders inside them."""

AROUND = [
    "link-final",  # a link into the run, as -o
    "link-run/final",  # a path through a linked parent
    "link-run/new",
    "a-file",
    "others",
    "copied-final",  # model.safetensors alone: a run's final/, not an export
    "downloaded",  # model.safetensors + config.json that no export wrote
]
"""Outputs around the run."""


def export_cases(world: Path) -> list[WingCase]:
    target = world / "target"
    cases = []
    for src in SOURCES:
        source = str(target / src) if src else str(target)
        for out in INSIDE:
            path = str(target / out) if out else str(target)
            cases.append(_export(f"-o {out or 'RUN'}", source, path, f"export -o {path}"))
        for out in AROUND:
            path = str(world / out)
            cases.append(_export(f"-o {out}", source, path, f"export -o {path}"))
    for src in (STEP, "final", "final/model.safetensors"):  # no -o: the default is inside
        cases.append(_export("default -o", str(target / src), None, "name the output with -o"))
    runs = "a new folder, an empty one or an earlier export: written, the run untouched"
    for out in ("fresh", "empty", "earlier"):
        cases.append(_export(f"-o {out}", str(target / STEP), str(world / out), "", runs))
    return cases


def _export(area, src, out, names, runs=""):
    argv = ("export", src) if out is None else ("export", src, "-o", out)
    return WingCase(f"export {area}", argv, names, runs=runs, timeout=TIMEOUT)


def test_an_export_never_writes_into_a_run_nor_over_what_it_did_not_write(good, world):
    target = world / "target"
    cases = export_cases(world)
    failures = []
    for case in cases:  # the target checked after each case, the good run by check() itself
        ahead = snapshot(target)
        try:
            check([case], good)
        except AssertionError as e:
            failures.append(str(e).split("\n", 1)[-1])
        if (after := snapshot(target)) != ahead:
            changed = sorted(k for k in ahead.keys() | after.keys() if ahead.get(k) != after.get(k))
            failures.append(f"[{case.area}] {case}: changed the target run: {changed[:3]}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    assert len(cases) >= 50
    assert (world / "fresh" / "model.safetensors").is_file()
    assert sorted(os.listdir(world / "others")) == ["notes.txt"]
    assert sorted(os.listdir(world / "downloaded")) == ["config.json", "model.safetensors"]


def test_a_project_folder_with_a_config_and_checkpoints_is_no_run(tmp_path, good):
    """A project's root may hold a config.yaml and a checkpoints/ folder of its own: a run is a
    folder with what only `trainer train` writes there (rundir.is_run), so an export below such
    a root goes ahead (found in review: any ancestor with those two refused it)."""
    from trainer.checkpoint.weights import export

    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.yaml").write_text("name: mine\n")
    out = project / "exports" / "mine"
    out.parent.mkdir()
    assert export(str(good), str(out)) == str(out / "model.safetensors")
    # a folder that is no run (a download) exports beside itself by default, not inside
    shutil.copytree(out, tmp_path / "download")
    got = export(str(tmp_path / "download"))
    assert got == str(tmp_path / "download-export" / "model.safetensors")


def test_a_runs_own_export_folder_is_the_default_and_may_be_replaced(tmp_path, good):
    """`trainer export RUN` writes RUN/export (the one folder inside a run an export may
    write), and again over its own earlier export; the run's own files stay as they were."""
    from trainer.checkpoint.weights import _is_export, export
    from trainer.errors import UsageError

    run = tmp_path / "run"
    shutil.copytree(good, run, symlinks=True)
    before = snapshot(run)
    for _ in range(2):
        assert export(str(run)) == str(run / "export" / "model.safetensors")
    after = snapshot(run)
    assert {k: v for k, v in after.items() if not k.startswith("export/")} == before
    assert _is_export(str(run / "export")) and not _is_export(str(run / "final"))
    # An export of the versions before the mark ({"format": "pt"} alone) is replaced there,
    # where nothing else can be; elsewhere such a folder may be any model's download.
    from safetensors.torch import load_file, save_file

    legacy = load_file(str(run / "export" / "model.safetensors"))
    save_file(legacy, str(run / "export" / "model.safetensors"), {"format": "pt"})
    shutil.copytree(run / "export", tmp_path / "legacy")
    assert export(str(run)) == str(run / "export" / "model.safetensors")
    with pytest.raises(UsageError, match="holds files no export wrote"):
        export(str(run), str(tmp_path / "legacy"))


def test_an_earlier_export_is_known_by_its_own_mark_never_by_file_names(tmp_path, good):
    from trainer.checkpoint.weights import _is_export, export

    export(str(good), str(tmp_path / "export"))
    assert _is_export(str(tmp_path / "export"))
    fakes = {
        "a run's final/": lambda f: shutil.copytree(good / "final", f),
        "a link to an export": lambda f: f.symlink_to(tmp_path / "export"),
        "a FIFO for config.yaml": lambda f: (
            shutil.copytree(tmp_path / "export", f),
            (f / "config.yaml").unlink(),
            os.mkfifo(f / "config.yaml"),
        ),
        "a FIFO for the weights": lambda f: (f.mkdir(), os.mkfifo(f / "model.safetensors")),
        "no weights": lambda f: (f.mkdir(), (f / "config.yaml").write_text("a: 1\n")),
        "a truncated header": lambda f: (
            f.mkdir(),
            (f / "model.safetensors").write_bytes(b"\xff" * 8),
        ),
    }
    for name, make in fakes.items():
        folder = tmp_path / name.replace(" ", "-").replace("/", "")
        make(folder)
        assert not _is_export(str(folder)), name


# --- sources that are no file, and runs holding one: eval and export -----------------------------

SOURCE_FILES = {
    "fifo.safetensors": "fifo.safetensors: is a FIFO",
    "fifo.pt": "fifo.pt: is a FIFO",
    "zero.pt": "zero.pt: is a character device",
    "socket.pt": "socket.pt: is a socket",
    "final-fifo": "final/model.safetensors is a FIFO",
    "manifest-fifo": "MANIFEST.sha256 is a FIFO",
    "weights-fifo": "model.safetensors is a FIFO",
    "config-fifo": "config.yaml is a FIFO",
    "weights-zero": "model.safetensors is a character device",
    "weights-fifo/checkpoints/step-000000006": "model.safetensors is a FIFO",
    "final-fifo/final/model.safetensors": "final/model.safetensors: is a FIFO",
}
"""Sources (in world/sources) and what the line must say: the file a read would hang on (or
never finish), and what it is."""


def source_cases(world: Path) -> list[WingCase]:
    cases = []
    for src, names in SOURCE_FILES.items():
        path = str(world / "sources" / src)
        out = str(world / "sources" / f"out-{_slug(src)}")
        for argv in (("eval", path, *READ), ("export", path, "-o", out)):
            cases.append(WingCase(f"source: {src}", argv, names, timeout=TIMEOUT))
    return cases


def test_a_source_that_is_no_file_is_one_line_never_a_hang(good, world):
    assert check(source_cases(world), good) >= 20
    assert not [p for p in os.listdir(world / "sources") if p.startswith("out-")]


def test_a_fifo_swapped_in_after_the_look_neither_blocks_nor_is_read(tmp_path, monkeypatch):
    """The lock is looked at (lstat) before it is opened; a FIFO put in its place between the
    two is opened without blocking and refused by what was opened (fstat)."""
    import threading

    path, regular = tmp_path / LOCK, tmp_path / "regular"
    os.mkfifo(path)
    regular.write_text(json.dumps(_record()))
    lstat = os.lstat
    monkeypatch.setattr(
        os, "lstat", lambda p, *a, **k: lstat(regular if str(p) == str(path) else p, *a, **k)
    )
    box = []

    def read():
        try:
            runlock._read(str(path))
        except BadLock as e:
            box.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert box and "is not a regular file but a FIFO" in box[0], box


def test_an_export_prefix_in_a_bucket_is_known_by_the_mark_in_its_weights(monkeypatch, tmp_path):
    """`export -o s3://...` over a prefix holding only the names an export writes: replaced when
    its model.safetensors carries the export's mark (read from the header alone, by ranged
    reads), refused when it is another model's weights."""
    import io

    from safetensors.torch import save_file

    from trainer import storage
    from trainer.checkpoint import weights
    from trainer.errors import UsageError

    objects = {}

    class Client:
        def get_object(self, Bucket, Key, Range):
            start, end = map(int, Range.removeprefix("bytes=").split("-"))
            return {"Body": io.BytesIO(objects[Key][start : end + 1])}

    def walk(url):
        prefix = storage.split(url)[1] + "/"
        return [(key.removeprefix(prefix), None) for key in objects if key.startswith(prefix)]

    monkeypatch.setattr(storage, "client", Client)
    monkeypatch.setattr(storage, "walk", walk)
    import torch

    for name, meta in (("mine", weights.EXPORT_METADATA), ("theirs", {"format": "pt"})):
        save_file({"w": torch.zeros(3)}, tmp_path / name, meta)
        objects[f"{name}/model.safetensors"] = (tmp_path / name).read_bytes()
        objects[f"{name}/config.json"] = b"{}"
    objects["cut-short/config.yaml"] = b"a: 1\n"  # model.safetensors goes up last
    weights.check_bucket_out("s3://b/mine")
    weights.check_bucket_out("s3://b/cut-short")
    with pytest.raises(UsageError, match="holds a model.safetensors no export wrote"):
        weights.check_bucket_out("s3://b/theirs")
