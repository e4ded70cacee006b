"""Data larger than memory: token files (data.name=tokens, `trainer data tokenize`) and .npy
fields (data.name=arrays), read per batch through memory maps, never whole on any rank."""

import json
import os
import pickle
import resource
import shutil
import sysconfig

import numpy as np
import pytest
import torch

from tests.helpers import TINY_GPT, train_here, weights
from trainer import cli, config, data, tasks
from trainer.errors import UsageError

GPT = [*[a for a in TINY_GPT if not a.startswith("data.")], "train.max_steps=4"]


def _text_folder(tmp_path, files: int):
    """A few of the standard library's json sources: real text, per-file split."""
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    folder = tmp_path / "text"
    folder.mkdir()
    for name in sorted(n for n in os.listdir(src) if n.endswith(".py"))[:files]:
        shutil.copy(os.path.join(src, name), folder / name)
    return folder


@pytest.mark.parametrize("files", [1, 5])
def test_tokenized_text_trains_bit_for_bit_like_the_text_it_came_from(tmp_path, files, capsys):
    """`trainer data tokenize` (bytes) keeps data.name=text's split and windows: the same run
    from the token files (one file: split by position; five: by the per-file coin)."""
    folder = _text_folder(tmp_path, files)
    src = folder / os.listdir(folder)[0] if files == 1 else folder
    assert cli.main(["data", "tokenize", str(src), "-o", str(tmp_path / "tok")]) == 0
    assert "wrote" in capsys.readouterr().out
    meta = json.loads((tmp_path / "tok" / "tokens.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes"
    seq = ["data.text.seq_len=32", "data.tokens.seq_len=32"]
    text = train_here(
        "train", *GPT, *seq, "data.name=text", f"data.text.path={src}", f"run_dir={tmp_path / 'a'}"
    )  # fmt: skip
    toks = train_here(
        "train", *GPT, *seq, "data.name=tokens", f"data.tokens.path={tmp_path / 'tok'}",
        f"run_dir={tmp_path / 'b'}",
    )  # fmt: skip
    assert toks["eval"] == text["eval"] and "bits_per_byte" in toks["eval"]
    assert meta["train_tokens"] == text["data"]["train_bytes"]
    assert meta["test_tokens"] == text["data"]["test_bytes"]
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _token_folder(folder, train: int, test: int, meta: dict | None, dtype=np.uint16, val=False):
    """Sparse token files (all zeros) of the given lengths: no disk, no time."""
    folder.mkdir()
    for name, n in (("train", train), ("val" if val else "test", test)):
        with open(folder / f"{name}.bin", "wb") as f:
            f.truncate(n * np.dtype(dtype).itemsize)
    if meta is not None:
        (folder / "tokens.json").write_text(json.dumps(meta))
    return folder


def test_a_token_file_of_8_gib_is_read_per_batch_never_whole(tmp_path):
    folder = _token_folder(
        tmp_path / "big", 4 * 2**30, 2**20, {"dtype": "uint16", "vocab_size": 50257}
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = config.load(
        None, ["data.name=tokens", f"data.tokens.path={folder}", "data.tokens.seq_len=1024"]
    )
    spec = data.build(cfg.data, 0)
    assert len(spec.train) == (4 * 2**30 - 1) // 1024 and spec.num_classes == 50257
    x, y = spec.train.take(np.array([0, len(spec.train) - 1, 12345]))
    assert x.shape == y.shape == (3, 1024) and x.dtype == torch.int64
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < 64 * 2**20, f"peak RSS grew {grown / 2**20:.0f} MiB"
    # A loader worker gets the split by pickle: a path and a few numbers, not the tokens.
    assert len(pickle.dumps(spec.train)) < 20_000
    task = tasks.build(cfg.task, spec)
    assert task.terms_per_sample == 1024 and not task.byte_tokens  # bits per token, not byte


def test_nanogpt_folders_train_with_the_dtype_given(tmp_path):
    """nanoGPT writes train.bin, val.bin and a meta.pkl (never read: unpickling runs code)."""
    folder = _token_folder(tmp_path / "nano", 5000, 700, None, val=True)
    (folder / "meta.pkl").write_bytes(b"\x80\x04not read")
    base = ["data.name=tokens", f"data.tokens.path={folder}", "data.tokens.seq_len=32"]
    with pytest.raises(UsageError, match="set data.tokens.dtype=uint16") as e:
        data.build(config.load(None, base).data, 0)
    assert "meta.pkl" in str(e.value)
    spec = data.build(
        config.load(None, [*base, "data.tokens.dtype=uint16", "data.tokens.vocab_size=65"]).data, 0
    )
    assert len(spec.test) == 699 // 32 and spec.num_classes == 65


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("odd size", "not a whole number of uint32"),
        ("id too large", "token id 300, not below the vocabulary size 256"),
        ("bad meta", "must say the dtype"),
        ("no test", "no test.bin or val.bin"),
        ("too short", "not enough for one window"),
    ],
)
def test_bad_token_files_are_one_line(tmp_path, case, fragment):
    meta = {"dtype": "uint32" if case == "odd size" else "uint16", "vocab_size": 256}
    folder = _token_folder(tmp_path / "t", 400, 10 if case == "too short" else 200, meta)
    if case == "odd size":
        with open(folder / "train.bin", "ab") as f:
            f.write(b"\0\0")
    if case == "id too large":
        np.full(400, 300, dtype=np.uint16).tofile(folder / "train.bin")
    if case == "bad meta":
        (folder / "tokens.json").write_text('{"dtype": "int8", "vocab_size": 256}')
    if case == "no test":
        (folder / "test.bin").unlink()
    cfg = config.load(
        None, ["data.name=tokens", f"data.tokens.path={folder}", "data.tokens.seq_len=16"]
    )
    with pytest.raises(UsageError, match=fragment) as e:
        spec = data.build(cfg.data, 0)
        spec.train.take(np.arange(4))
    assert "\n" not in str(e.value)


def test_a_tokenizer_plug_in_writes_its_ids_and_vocabulary(tmp_path):
    folder = _text_folder(tmp_path, 3)
    out = tmp_path / "tok"
    code = cli.main(
        [
            "data",
            "tokenize",
            str(folder),
            "-o",
            str(out),
            "--tokenizer",
            "tests.test_token_files:halves",
        ]
    )
    assert code == 0
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["vocab_size"] == 128 and meta["tokenizer"] == "tests.test_token_files:halves"
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert len(ids) == meta["train_tokens"] and ids.max() < 128
    raw = b"".join((folder / n).read_bytes() for n in sorted(os.listdir(folder)))
    assert meta["train_tokens"] + meta["test_tokens"] == len(raw)


def halves(text: bytes):
    """A test tokenizer: each byte's upper seven bits (a vocabulary of 128)."""
    return np.frombuffer(text, dtype=np.uint8) >> 1


halves.vocab_size = 128


# --- .npy fields --------------------------------------------------------------------------------


def _arrays(root, **fields):
    for split, n in (("train", 30), ("test", 10)):
        (root / split).mkdir(parents=True)
        for name, make in fields.items():
            np.save(root / split / f"{name}.npy", make(n))
    return root


def test_x_and_y_arrays_train_the_built_in_tasks(tmp_path):
    rng = np.random.default_rng(0)
    root = _arrays(
        tmp_path / "a",
        x=lambda n: rng.integers(0, 256, (n, 1, 6, 6), dtype=np.uint8),
        y=lambda n: rng.integers(0, 5, n).astype(np.int32),
    )
    cfg = config.load(None, ["data.name=arrays", f"data.arrays.path={root}"])
    spec = data.build(cfg.data, 0)
    assert spec.task == "classification" and spec.in_shape == (1, 6, 6) and spec.num_classes == 5
    (x, y) = next(data.eval_batches(spec, 64, 0, 1))
    assert x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1 and y.dtype == torch.int64
    summary = train_here(
        "train", "data.name=arrays", f"data.arrays.path={root}", "data.global_batch_size=8",
        "train.epochs=1", "log.progress=none", "log.tensorboard=false", f"run_dir={tmp_path / 'r'}",
    )  # fmt: skip
    assert summary["eval"]["count"] == 10 and "accuracy" in summary["eval"]


def test_other_fields_are_dict_batches_for_a_task_of_yours(tmp_path):
    rng = np.random.default_rng(1)
    root = _arrays(
        tmp_path / "m",
        x=lambda n: rng.normal(size=(n, 4)),
        y=lambda n: rng.normal(size=(n, 3)).astype(np.float32),
        mask=lambda n: rng.random((n, 3)) < 0.5,
    )
    args = ["data.name=arrays", f"data.arrays.path={root}", "model.name=tests.plugins:linear"]
    with pytest.raises(UsageError, match="set task.name"):
        train_here("train", *args, f"run_dir={tmp_path / 'r0'}")
    summary = train_here(
        "train", *args, "task.name=tests.plugins:MaskedMSE", "data.global_batch_size=8",
        "train.epochs=1", "log.progress=none", "log.tensorboard=false", f"run_dir={tmp_path / 'r'}",
    )  # fmt: skip
    assert summary["steps"] == 4 and summary["eval"]["loss"] > 0


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("objects", "holds Python objects"),
        ("lengths", "differ in length"),
        ("not npy", "not a .npy file"),
        ("fields", "give both splits the same .npy files"),
    ],
)
def test_bad_arrays_are_one_line(tmp_path, case, fragment):
    root = _arrays(tmp_path / "b", x=lambda n: np.zeros((n, 2)), y=lambda n: np.zeros(n, np.int64))
    if case == "objects":
        np.save(root / "train" / "x.npy", np.array([{"a": 1}] * 30, dtype=object))
    if case == "lengths":
        np.save(root / "train" / "y.npy", np.zeros(29, np.int64))
    if case == "not npy":
        (root / "test" / "x.npy").write_text("x,y\n1,2\n")
    if case == "fields":
        np.save(root / "test" / "z.npy", np.zeros(10))
    with pytest.raises(UsageError, match=fragment) as e:
        data.build(config.load(None, ["data.name=arrays", f"data.arrays.path={root}"]).data, 0)
    assert "\n" not in str(e.value)
