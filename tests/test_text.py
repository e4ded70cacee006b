"""data.name=text: byte tokens from a file, a folder, or the Python standard library."""

import hashlib
import os

import pytest
import torch

from trainer import config, data, tasks
from trainer.datasets import text as text_data
from trainer.errors import UsageError


def _load(*overrides):
    cfg = config.load(None, ["data.name=text", "model.name=gpt", *overrides])
    return cfg, data.build(cfg.data, cfg.seed)


def test_a_file_is_split_by_position_into_next_byte_windows(tmp_path):
    corpus = bytes(range(256)) * 40  # 10,240 bytes
    (tmp_path / "a.txt").write_bytes(corpus)
    _, spec = _load(f"data.text.path={tmp_path / 'a.txt'}", "data.text.seq_len=16")
    assert spec.task == "lm" and spec.num_classes == 256 and spec.in_shape == (16,)
    task = tasks.build(config.TaskConfig(), spec)  # task.name=auto: the data's lm
    assert task.terms_per_sample == task.tokens_per_sample == 16 and task.byte_tokens
    cut = round(len(corpus) * 0.8)
    assert spec.source["train_bytes"] == cut and spec.source["test_bytes"] == len(corpus) - cut
    assert len(spec.train) == (cut - 1) // 16
    x, y = spec.train.take(torch.tensor([0, 2]))
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    assert x[0].tolist() == list(corpus[:16]) and y[0].tolist() == list(corpus[1:17])
    assert x[1].tolist() == list(corpus[32:48])  # windows do not overlap
    tx, _ = spec.test.span(0, 1)
    assert tx[0].tolist() == list(corpus[cut : cut + 16])


def test_a_folder_splits_by_file_skipping_hidden_ones(tmp_path):
    for i in range(40):
        (tmp_path / "docs" / f"{i:02d}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / f"{i:02d}" / "page.md").write_text(f"page {i} " * 50)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\0" * 5000)
    (tmp_path / ".DS_Store").write_bytes(b"\0" * 5000)
    _, spec = _load(f"data.text.path={tmp_path}", "data.text.seq_len=32")
    assert spec.source["files"] == 40
    test_files = [
        f"docs/{i:02d}/page.md"
        for i in range(40)
        if text_data.is_test_file(f"docs/{i:02d}/page.md", 0.2, 0)
    ]
    assert 0 < len(test_files) < 40
    test_bytes = sum(len(f"page {int(f[5:7])} " * 50) for f in test_files)
    assert spec.source["test_bytes"] == test_bytes
    assert 0 not in spec.train.tokens.tolist()  # nothing from .git or .DS_Store


def test_the_split_and_digest_are_stable_and_follow_the_content(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    _, one = _load(f"data.text.path={tmp_path}", "data.text.seq_len=8")
    _, two = _load(f"data.text.path={tmp_path}", "data.text.seq_len=8")
    assert one.source["sha256"] == two.source["sha256"]
    assert torch.equal(one.train.tokens, two.train.tokens)
    (tmp_path / "a.txt").write_text("hello world\n" * 99 + "hello earth\n")
    _, three = _load(f"data.text.path={tmp_path}", "data.text.seq_len=8")
    assert three.source["sha256"] != one.source["sha256"]


def test_the_default_corpus_is_the_standard_library_without_tests():
    root = text_data.stdlib_root()
    files = text_data.stdlib_files(root)
    assert "os.py" in files and "json/decoder.py" in files
    assert not any(f.startswith(("test/", "idle_test")) or "site-packages" in f for f in files)
    assert not any(os.path.basename(f).startswith("_sysconfigdata") for f in files)
    assert files == sorted(files)
    _, spec = _load("data.text.max_train_bytes=100000", "data.text.max_test_bytes=10000")
    assert spec.source["corpus"] == "python-stdlib" and spec.source["files"] == len(files)
    assert spec.source["train_bytes"] == 100000 and spec.source["test_bytes"] == 10000
    digest = hashlib.sha256()
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            digest.update(rel.encode() + b"\0" + f.read() + b"\0")
    assert spec.source["sha256"] == digest.hexdigest()
    train_files = [f for f in files if not text_data.is_test_file(f, 0.2, 0)]
    head = b""
    for rel in train_files[:5]:  # the training stream is the train files, concatenated in order
        with open(os.path.join(root, rel), "rb") as f:
            head += f.read()
    assert bytes(spec.train.tokens[: len(head)].tolist()) == head


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["data.text.path=/nonexistent/corpus"], "no such file or folder"),
        (["data.text.path={empty}"], "holds no files"),
        (["data.text.path={tiny}", "data.text.seq_len=64"], "not enough for one window"),
        (["data.text.seq_len=0"], "data.text.seq_len"),
        (["model.name=gpt", "data.name=digits"], "use data.name=text"),
        (["model.gpt.width=30", "model.gpt.heads=4"], "a multiple of heads"),
        (["model.name=mlp"], "use model.name=gpt"),
        (["model.name=gpt", "data.name=diabetes"], "use data.name=text"),
    ],
)
def test_bad_text_settings_say_what_to_fix(tmp_path, overrides, fragment):
    (tmp_path / "empty").mkdir()
    (tmp_path / "tiny.txt").write_text("x" * 50)
    overrides = [o.format(empty=tmp_path / "empty", tiny=tmp_path / "tiny.txt") for o in overrides]
    with pytest.raises(UsageError) as e:
        cfg, spec = _load("data.text.max_train_bytes=20000", *overrides)
        from trainer import models

        models.build(cfg.model, spec.in_shape, spec.num_classes, spec.task)
    assert fragment in str(e.value) and "\n" not in str(e.value)
