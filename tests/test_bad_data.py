"""Bad data never ends in a traceback, and data files never run code.

Each kind of bad input (a crafted or damaged CIFAR pickle, IDX files that disagree, an image
bomb or a broken image, a download into a root that cannot be written, a model that does not
fit the data, a synthetic set larger than memory) stops the run with one line naming the file
or key and the fix, exit code 2. Each kind is run once through the real CLI."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess

import numpy as np
import pytest
import torch

from tests import fakes
from tests.helpers import ROOT, env, trainer_argv
from trainer import data, models
from trainer.config import DataConfig, ModelConfig, SyntheticConfig
from trainer.datasets import synthetic
from trainer.errors import UsageError


def _build(**kw) -> data.DataSpec:
    return data.build(DataConfig(**kw), seed=0)


def _cli_fails(tmp_path, *args) -> str:
    """Run `trainer train ARGS`; assert exit 2 with one line and no traceback; return the line."""
    p = subprocess.run(
        trainer_argv("train", f"run_dir={tmp_path / 'run'}", "train.epochs=1", *args),
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


# --- CIFAR-10 batches: read without running code -------------------------------------------


def py2_pickle(obj) -> bytes:
    """What Python 2's cPickle.dump(obj, f, 2) writes, as the real CIFAR batches were made: str
    keys and an array's raw bytes are Python 2 str (SHORT_BINSTRING/BINSTRING), an array is
    numpy.core.multiarray._reconstruct + BUILD, its dtype numpy.dtype('u1') + BUILD."""
    out = bytearray(b"\x80\x02")

    def string(b: bytes) -> None:
        short = len(b) < 256
        out.extend((b"U" + bytes([len(b)])) if short else (b"T" + struct.pack("<I", len(b))))
        out.extend(b)

    def save(o) -> None:
        if isinstance(o, dict):
            out.extend(b"}(")
            for k, v in o.items():
                save(k)
                save(v)
            out.extend(b"u")
        elif isinstance(o, list):
            out.extend(b"](")
            for v in o:
                save(v)
            out.extend(b"e")
        elif isinstance(o, int):
            out.extend(b"K" + bytes([o]) if 0 <= o < 256 else b"J" + struct.pack("<i", o))
        elif isinstance(o, str):
            string(o.encode("latin1"))
        elif isinstance(o, np.ndarray):
            out.extend(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85")
            string(b"b")
            out.extend(b"\x87R(K\x01(")  # _reconstruct(ndarray, (0,), 'b'); state: version 1
            for d in o.shape:
                save(d)
            out.extend(b"tcnumpy\ndtype\n")
            string(o.dtype.str[1:].encode())  # 'u1'
            out.extend(b"K\x00K\x01\x87R(K\x03")
            string(o.dtype.str[:1].encode())  # '|'
            out.extend(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89")  # dtype; C order
            string(np.ascontiguousarray(o).tobytes())
            out.extend(b"tb")
        else:
            raise TypeError(type(o))

    save(obj)
    return bytes(out + b".")


def _cifar_batch(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    x, y = fakes.images(n, (3, 32, 32), 10, seed)
    return x.reshape(n, 3072), [int(v) for v in y]


class _Marker:
    """Unpickling this runs a shell command that leaves a file behind."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_cifar_batch_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    fakes.cifar_folder(tmp_path, per_batch=4, n_test=4)
    marker = tmp_path / "pwned"
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(pickle.dumps({"data": _Marker(marker), "labels": [0]}, protocol=2))
    line = _cli_fails(
        tmp_path, "data.name=cifar10", f"data.root={tmp_path}", "data.verify_checksums=false"
    )
    assert not marker.exists()
    assert f"cannot read {batch}: " in line and "posix.system" in line
    assert "replace the files with the 7 files of cifar-10-python.tar.gz" in line


def test_python2_cifar_batches_are_read_as_before(tmp_path):
    folder = fakes.cifar_folder(tmp_path, per_batch=4, n_test=4) / "cifar-10-batches-py"
    x1, y1 = _cifar_batch(4, seed=1)
    meta = {"label_names": ["airplane"] * 10, "num_cases_per_batch": 4, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(py2_pickle(meta))
    batch = {"batch_label": "training batch 1 of 5", "labels": y1, "data": x1}
    (folder / "data_batch_1").write_bytes(py2_pickle({**batch, "filenames": ["a.png"] * 4}))
    # Python 3, protocol 2, bytes keys: bytes are pickled as _codecs.encode(str, 'latin1').
    x2, y2 = _cifar_batch(4, seed=2)
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": x2, b"labels": y2}, protocol=2))
    spec = _build(name="cifar10", root=str(tmp_path), verify_checksums=False)
    assert len(spec.train) == 20 and spec.train.x.dtype == torch.uint8
    np.testing.assert_array_equal(spec.train.x[:4].numpy(), x1.reshape(4, 3, 32, 32))
    np.testing.assert_array_equal(spec.train.x[4:8].numpy(), x2.reshape(4, 3, 32, 32))
    assert spec.train.y[:8].tolist() == y1 + y2


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1, 2, 10]}, "label 10 is not"),
        ({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1]}, "2 labels for 4 images"),
        ({"data": np.zeros((4, 3072), np.float32), "labels": [0] * 4}, "not N x 3072 uint8"),
        ({"data": np.zeros((4, 3072), object), "labels": [0] * 4}, "is object (4, 3072)"),
        ([1, 2, 3], "holds a list"),
    ],
)
def test_a_cifar_batch_with_the_wrong_contents_names_the_file(tmp_path, entry, fragment):
    folder = fakes.cifar_folder(tmp_path, per_batch=4, n_test=4) / "cifar-10-batches-py"
    (folder / "test_batch").write_bytes(pickle.dumps(entry))
    with pytest.raises(UsageError) as e:
        _build(name="cifar10", root=str(tmp_path), verify_checksums=False)
    assert f"cannot read {folder / 'test_batch'}: " in _one_line(e) and fragment in str(e.value)


def test_a_truncated_cifar_batch_names_the_file(tmp_path):
    folder = fakes.cifar_folder(tmp_path, per_batch=4, n_test=4) / "cifar-10-batches-py"
    path = folder / "data_batch_3"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(UsageError, match=f"cannot read {path}: not a CIFAR batch pickle"):
        _build(name="cifar10", root=str(tmp_path), verify_checksums=False)


# --- MNIST-format IDX files ----------------------------------------------------------------


def _raw(tmp_path):
    return fakes.mnist_folder(tmp_path, "MNIST", n_train=8, n_test=4) / "MNIST" / "raw"


def test_idx_labels_that_are_not_classes_stop_the_run_before_training(tmp_path):
    labels = _raw(tmp_path) / "train-labels-idx1-ubyte"
    fakes.write_idx(labels, np.array([0, 1, 2, 12, 4, 5, 6, 7], np.uint8))
    line = _cli_fails(tmp_path, "data.name=mnist", f"data.root={tmp_path}", "model.name=mlp")
    assert f"cannot read {labels}: label 12 (sample 3) is not a class 0..9" in line
    assert "replace the files with the 4 IDX files" in line


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("train-labels-idx1-ubyte", "6 labels", "6 labels for the 8 images of train-images"),
        ("t10k-images-idx3-ubyte", "3 images", "4 labels for the 3 images of t10k-images"),
        ("train-images-idx3-ubyte", b"garbage, not IDX", "not an IDX file of uint8 with 3"),
        ("t10k-labels-idx1-ubyte", b"\x00\x00\x08\x01\x00", "the header is cut short"),
        ("t10k-labels-idx1-ubyte", b"", "header empty"),
        ("train-images-idx3-ubyte", "truncated", "so 6288 bytes in all, but the file has 3000"),
        ("train-labels-idx1-ubyte", "a 2-d file", "not an IDX file of uint8 with 1 dimension"),
    ],
)
def test_idx_files_that_disagree_or_are_not_idx_name_the_file(tmp_path, name, content, fragment):
    path = _raw(tmp_path) / name
    if content == "6 labels":
        fakes.write_idx(path, np.zeros(6, np.uint8))
    elif content == "3 images":
        fakes.write_idx(path, np.zeros((3, 28, 28), np.uint8))
    elif content == "truncated":
        path.write_bytes(path.read_bytes()[:3000])
    elif content == "a 2-d file":
        fakes.write_idx(path, np.zeros((8, 1), np.uint8))
    else:
        path.write_bytes(content)
    with pytest.raises(UsageError) as e:
        _build(name="mnist", root=str(tmp_path))
    line = _one_line(e)
    assert line.startswith(f"data.name=mnist: cannot read {path.parent}/"), line
    assert fragment in line and "replace the files with the 4 IDX files" in line


# --- image folders: bombs and broken files -------------------------------------------------


def test_a_decompression_bomb_in_an_image_folder_is_refused_in_one_line(tmp_path):
    from PIL import Image

    fakes.image_folder(tmp_path, classes=("a", "b"), per_class=2)
    bomb = tmp_path / "train" / "a" / "img000.png"
    Image.new("1", (20000, 20000)).save(bomb)  # 400 Mpx in 48 KB: over PIL's 179 Mpx limit
    line = _cli_fails(
        tmp_path, "data.name=imagefolder", f"data.root={tmp_path}", "data.global_batch_size=4"
    )
    assert f"data.name=imagefolder: {bomb} is too large to decode safely" in line
    assert "remove it or shrink it" in line


@pytest.mark.parametrize("pixels", [1601, 2401])  # PIL warns above its limit, raises above 2x
def test_an_image_over_pils_pixel_limit_is_an_error_even_where_pil_only_warns(
    tmp_path, monkeypatch, pixels
):
    from PIL import Image

    fakes.image_folder(tmp_path, classes=("a", "b"), per_class=2)
    big = tmp_path / "train" / "a" / "img001.png"
    Image.new("RGB", (pixels, 1)).save(big)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    spec = _build(name="imagefolder", root=str(tmp_path))
    with pytest.raises(UsageError) as e:
        spec.train.take(np.arange(len(spec.train)))
    assert f"{big} is too large to decode safely (Image size ({pixels} pixels)" in _one_line(e)


@pytest.mark.parametrize(
    "content", [b"\x89PNG\r\n\x1a\nnot really", b"", "truncated", b"GIF89a" + b"\0" * 7]
)
def test_a_broken_image_names_the_file(tmp_path, content):
    fakes.image_folder(tmp_path, classes=("a", "b"), per_class=2, size=(64, 64))
    path = tmp_path / "val" / "b" / "img001.png"
    if content == "truncated":
        content = path.read_bytes()[:200]
    path.write_bytes(content)
    spec = _build(name="imagefolder", root=str(tmp_path))
    with pytest.raises(UsageError) as e:
        spec.test.take(np.arange(len(spec.test)))
    line = _one_line(e)
    assert line.startswith(f"data.name=imagefolder: cannot decode {path} (")
    assert line.endswith("): remove or replace the file")
    assert "BytesIO" not in line and " at 0x" not in line  # PIL's name for its buffer


# --- downloads -----------------------------------------------------------------------------


def test_download_into_a_root_that_cannot_be_written_is_a_usage_error_not_a_retry(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    root = tmp_path / "a-file" / "data"  # unwritable for everyone, root included
    line = _cli_fails(tmp_path, "data.name=mnist", f"data.root={root}", "data.download=true")
    assert f"data.download=true: cannot write into data.root={root} (" in line
    assert "set data.root to a writable folder" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_download_into_a_read_only_root_is_a_usage_error(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(UsageError, match=f"cannot write into data.root={root} .Permission"):
            _build(name="cifar10", root=str(root), download=True)
    finally:
        root.chmod(0o755)


def test_download_with_the_files_present_does_not_need_a_writable_root(tmp_path, monkeypatch):
    from trainer.datasets import vision

    fakes.mnist_folder(tmp_path, "MNIST", n_train=8, n_test=4)

    def unwritable(cfg, source):
        raise AssertionError("probed a root that needs no download")

    monkeypatch.setattr(vision, "_check_writable", unwritable)
    assert len(_build(name="mnist", root=str(tmp_path), download=True).train) == 8


# --- a model that does not fit the data ----------------------------------------------------


def test_model_in_channels_that_differ_from_the_data_name_the_key(tmp_path):
    line = _cli_fails(tmp_path, "model.name=lenet", "model.in_channels=3")
    assert line == (
        "trainer: error: model.in_channels=3, but the dataset's samples have 1 channel(s) "
        "(shape (1, 8, 8)): set model.in_channels=1 or leave it unset (null: taken from the data)"
    )


@pytest.mark.parametrize(
    "cfg, shape, classes, task, fragment",
    [
        (dict(name="resnet18", in_channels=1), (3, 32, 32), 10, None, "model.in_channels=3"),
        (dict(name="mlp", num_classes=5), (1, 8, 8), 10, "classification", "classes 0 to 9"),
        (dict(name="mlp", num_classes=2), (10,), 1, "regression", "model.num_classes=1 or"),
        (dict(name="gpt", num_classes=100), (16,), 256, "lm", "a vocabulary of 256"),
    ],
)
def test_model_keys_that_do_not_fit_the_data_are_usage_errors(cfg, shape, classes, task, fragment):
    with pytest.raises(UsageError) as e:
        models.build(ModelConfig(**cfg), shape, classes, task)
    assert fragment in _one_line(e)


def test_model_keys_that_fit_the_data_still_build():
    assert models.build(ModelConfig(name="lenet", in_channels=1), (1, 8, 8), 10, "classification")
    wide = models.build(ModelConfig(name="mlp", num_classes=12), (1, 8, 8), 10, "classification")
    assert wide[-1].out_features == 12  # more outputs than classes: unused logits, no error


# --- synthetic data larger than memory -----------------------------------------------------


def test_a_synthetic_set_larger_than_memory_is_refused_before_allocating(tmp_path):
    line = _cli_fails(
        tmp_path,
        "data.name=synthetic",
        "data.synthetic.shape=[3,4096,4096]",
        "data.synthetic.size=100000",
    )
    assert "data.synthetic: 100000 + 256 samples of shape [3, 4096, 4096] need about " in line
    assert "lower data.synthetic.size, test_size or shape" in line


def test_synthetic_peak_memory_estimate_matches_what_is_allocated(monkeypatch):
    sc = SyntheticConfig(shape=[3, 8, 8], num_classes=4, size=100, test_size=10)
    assert synthetic.peak_bytes(sc) == 192 * (300 + 4)
    monkeypatch.setattr(synthetic, "available_memory", lambda: 192 * 303)
    with pytest.raises(UsageError, match=r"about 0\.0 GiB of memory to generate, more than"):
        _build(name="synthetic", synthetic=sc)
    monkeypatch.setattr(synthetic, "available_memory", lambda: 192 * 304)
    assert len(_build(name="synthetic", synthetic=sc).train) == 100
