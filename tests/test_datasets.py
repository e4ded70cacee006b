"""Dataset factories: real readers on generated fakes of each on-disk format, and the errors
a user sees for a missing or broken folder (one line, naming the files and where to put them)."""

import gzip
from urllib.error import URLError

import numpy as np
import pytest
import torch

from tests import fakes
from trainer import data
from trainer.config import DataConfig, SyntheticConfig
from trainer.errors import RetryableError, UsageError


def _build(**kw) -> data.DataSpec:
    return data.build(DataConfig(**kw), seed=0)


@pytest.mark.parametrize("name, folder", [("fashion_mnist", "FashionMNIST"), ("mnist", "MNIST")])
def test_mnist_formats_are_read_by_torchvision_into_uint8_memory(tmp_path, name, folder):
    fakes.mnist_folder(tmp_path, folder, n_train=64, n_test=32)
    spec = _build(name=name, root=str(tmp_path))
    x_train, y_train = fakes.images(64, (28, 28), 10, seed=1)
    x_test, y_test = fakes.images(32, (28, 28), 10, seed=2)
    assert spec.in_shape == (1, 28, 28) and spec.num_classes == 10
    assert spec.train.x.dtype == torch.uint8 and spec.train.x.shape == (64, 1, 28, 28)
    np.testing.assert_array_equal(spec.train.x[:, 0].numpy(), x_train)  # pixel for pixel
    np.testing.assert_array_equal(spec.train.y.numpy(), y_train)
    np.testing.assert_array_equal(spec.test.x[:, 0].numpy(), x_test)
    np.testing.assert_array_equal(spec.test.y.numpy(), y_test)
    mean = {"fashion_mnist": 0.2860, "mnist": 0.1307}[name]
    assert spec.train.mean.tolist() == pytest.approx([mean])  # the standard normalisation


def test_a_missing_folder_says_what_to_put_where_and_how_to_mount_it(tmp_path):
    with pytest.raises(UsageError) as e:
        _build(name="fashion_mnist", root=str(tmp_path / "nowhere"))
    msg = str(e.value)
    assert "\n" not in msg
    for fragment in (
        f"{tmp_path}/nowhere/FashionMNIST/raw/ lacks train-images-idx3-ubyte, "
        "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte",
        "data.download=true",
        "mounted read-only at /workspace/data",
        "PVC or hostPath",
    ):
        assert fragment in msg
    fakes.mnist_folder(tmp_path, "FashionMNIST")
    (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(UsageError, match=r"lacks t10k-labels-idx1-ubyte\. Put the 4 IDX files"):
        _build(name="fashion_mnist", root=str(tmp_path))


def test_gzipped_idx_files_get_a_gunzip_hint(tmp_path):
    fakes.mnist_folder(tmp_path, "MNIST", gz=True)
    with pytest.raises(UsageError, match=r"torchvision reads them decompressed: run `gunzip -k "):
        _build(name="mnist", root=str(tmp_path))


def test_a_truncated_idx_file_is_a_usage_error(tmp_path):
    fakes.mnist_folder(tmp_path, "MNIST")
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UsageError, match=r"data.name=mnist: cannot read .*replace the files"):
        _build(name="mnist", root=str(tmp_path))


def test_cifar10_pickles_are_read_by_torchvision_into_nchw_uint8(tmp_path):
    fakes.cifar_folder(tmp_path, per_batch=16, n_test=32)
    spec = _build(name="cifar10", root=str(tmp_path), verify_checksums=False)
    assert spec.in_shape == (3, 32, 32) and len(spec.train) == 80 and len(spec.test) == 32
    x1, y1 = fakes.images(16, (3, 32, 32), 10, seed=11)  # data_batch_1 comes first
    np.testing.assert_array_equal(spec.train.x[:16].numpy(), x1)  # channels first, exact
    np.testing.assert_array_equal(spec.train.y[:16].numpy(), y1)
    assert spec.train.x.is_contiguous() and spec.train.x.dtype == torch.uint8
    assert spec.train.std.tolist() == pytest.approx([0.2470, 0.2435, 0.2616])


def test_cifar10_checks_torchvisions_checksums_unless_told_not_to(tmp_path):
    fakes.cifar_folder(tmp_path)
    with pytest.raises(
        UsageError,
        match="do not match torchvision's published checksums.*data.verify_checksums=false",
    ):
        _build(name="cifar10", root=str(tmp_path))


def test_download_runs_torchvisions_downloader_and_reports_a_failure_in_one_line(
    tmp_path, monkeypatch
):
    import torchvision.datasets as tvd

    def offline(self):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(tvd.FashionMNIST, "download", offline)
    with pytest.raises(RetryableError) as e:
        _build(name="fashion_mnist", root=str(tmp_path), download=True)
    assert "\n" not in str(e.value)
    assert "could not download Fashion-MNIST" in str(e.value) and "name resolution" in str(e.value)

    def fake_download(self):  # what a successful download leaves behind
        fakes.mnist_folder(tmp_path, "FashionMNIST", n_train=8, n_test=4)

    monkeypatch.setattr(tvd.FashionMNIST, "download", fake_download)
    spec = _build(name="fashion_mnist", root=str(tmp_path), download=True)
    assert len(spec.train) == 8 and len(spec.test) == 4


def test_imagefolder_classes_are_sorted_folder_names_and_images_decode_to_size(tmp_path):
    fakes.image_folder(tmp_path, classes=("owl", "cat", "dog"), per_class=4, size=(20, 24))
    spec = _build(name="imagefolder", root=str(tmp_path), image_size=16)
    assert spec.num_classes == 3 and spec.in_shape == (3, 16, 16)
    assert len(spec.train) == 12 and len(spec.test) == 6 and spec.train.lazy
    # cat=0, dog=1, owl=2 whatever order the folders were made in
    assert [f.split("/")[-2] for f in spec.train.files[::4]] == ["cat", "dog", "owl"]
    assert spec.train.y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    x, y = spec.train.take(np.array([0, 5]))
    assert x.shape == (2, 3, 16, 16) and x.dtype == torch.uint8 and y.tolist() == [0, 1]
    empty, _ = spec.train.take(np.array([], dtype=np.int64))
    assert empty.shape == (0, 3, 16, 16)


def test_imagefolder_errors_name_the_layout(tmp_path):
    with pytest.raises(UsageError, match=r"train.*not found: put images in .*/train/<class>/"):
        _build(name="imagefolder", root=str(tmp_path))
    fakes.image_folder(tmp_path, classes=("a", "b"), per_class=2)
    (tmp_path / "val" / "zebra").mkdir()
    with pytest.raises(UsageError, match="classes zebra that .*train lacks"):
        _build(name="imagefolder", root=str(tmp_path))


def test_synthetic_is_deterministic_from_the_split_seed_and_any_shape():
    cfg = SyntheticConfig(shape=[2, 5, 7], num_classes=3, size=50, test_size=10)
    a, b = _build(name="synthetic", synthetic=cfg), _build(name="synthetic", synthetic=cfg)
    c = _build(name="synthetic", synthetic=cfg, split_seed=1)
    assert a.in_shape == (2, 5, 7) and a.num_classes == 3 and len(a.train) == 50
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.train.x, c.train.x)
    flat = _build(name="synthetic", synthetic=SyntheticConfig(shape=[20], num_classes=2, size=8))
    assert flat.in_shape == (20,) and flat.train.x.shape == (8, 20)
    # Learnable: a sample is nearer its own class's mean than any other class's.
    x, y = a.train.x.float().flatten(1), a.train.y
    means = torch.stack([x[y == k].mean(0) for k in range(3)])
    assert (torch.cdist(x, means).argmin(1) == y).float().mean() > 0.95


def test_diabetes_is_standardised_with_train_statistics():
    spec = _build(name="diabetes")
    assert spec.task == "regression" and spec.num_classes == 1 and spec.in_shape == (10,)
    assert len(spec.train) == 354 and len(spec.test) == 88
    x, y = spec.train.x, spec.train.y
    assert y.shape == (354, 1)
    torch.testing.assert_close(x.mean(0), torch.zeros(10), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std(0, unbiased=False), torch.ones(10), atol=1e-5, rtol=0)
    assert abs(y.mean().item()) < 1e-5 and abs(y.std(unbiased=False).item() - 1) < 1e-5
    assert abs(spec.test.y.mean().item()) > 1e-3  # the test split was not used for the stats
    from sklearn.datasets import load_diabetes

    target = load_diabetes().target
    assert 60 < spec.target_scale < 90 and spec.target_scale != pytest.approx(target.std())


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"name": "diabetes", "augment": True}, "data.augment=true crops and flips images"),
        ({"name": "imagefolder", "device_resident": True}, "decodes files per sample"),
    ],
)
def test_options_that_do_not_fit_the_dataset_are_usage_errors(tmp_path, kw, fragment):
    fakes.image_folder(tmp_path, classes=("a", "b"), per_class=2)
    with pytest.raises(UsageError, match=fragment):
        _build(root=str(tmp_path), **kw)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        ({"persistent_workers": True}, "needs worker processes: set data.num_workers >= 1"),
        ({"device_resident": True, "num_workers": 2}, "set data.num_workers=0"),
        ({"synthetic": {"shape": [3, 0]}}, "data.synthetic.shape"),
        ({"num_workers": -1}, "data.num_workers"),
    ],
)
def test_data_config_validation_names_the_fix(kw, fragment):
    from trainer import config

    overrides = []
    for k, v in kw.items():
        if isinstance(v, dict):
            overrides += [f"data.{k}.{kk}={vv}".replace(" ", "") for kk, vv in v.items()]
        else:
            overrides.append(f"data.{k}={str(v).lower()}")
    with pytest.raises(UsageError, match=fragment):
        config.load(None, overrides)


def test_gzip_fixture_really_is_gzip(tmp_path):
    fakes.mnist_folder(tmp_path, "MNIST", gz=True, n_train=4, n_test=2)
    raw = tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz"
    assert gzip.decompress(raw.read_bytes())[:4] == b"\x00\x00\x08\x01"


def test_digits_read_from_the_shipped_csv_equal_sklearns_loader():
    from sklearn.datasets import load_digits as reference

    from trainer.datasets.tabular import load_digits

    x, y = load_digits()
    rx, ry = reference(return_X_y=True)
    assert x.shape == (1797, 64) and (x == rx).all() and (y == ry).all()


def test_imagefolder_decodes_jpegs_with_torchvision_io_and_others_with_pil(tmp_path, monkeypatch):
    """JPEGs go through torchvision.io (docs/benchmarks.md: 1.5x PIL here at 224 px), PIL's draft
    mode when at least twice the size asked for; PNG and the "pil" decoder through PIL. Every
    path gives the same picture (the test image is smooth: a few grey levels apart at most)."""
    from PIL import Image

    from trainer.datasets.folder import FolderDataset

    smooth = np.asarray(Image.linear_gradient("L").resize((48, 40)).convert("RGB"))
    for name, mode in (("a.jpg", "RGB"), ("b.png", "RGB"), ("c.jpg", "CMYK")):
        Image.fromarray(smooth).convert(mode).save(tmp_path / name, quality=95)
    calls = []
    original = FolderDataset._torchvision
    monkeypatch.setattr(
        FolderDataset, "_torchvision", lambda s, d: calls.append(1) or original(s, d)
    )

    def decoded(name, size, decoder="auto"):
        ds = FolderDataset([str(tmp_path / name)], [0], size, None, None)
        ds.decoder = decoder
        calls.clear()
        x = ds.decode(0)
        assert x.shape == (3, size, size) and x.dtype == torch.uint8
        return x.float(), len(calls)

    pil, used = decoded("a.jpg", 24, "pil")
    assert used == 0
    for name, size, tv in (("a.jpg", 24, 1), ("a.jpg", 16, 0), ("b.png", 24, 0), ("c.jpg", 24, 1)):
        x, used = decoded(name, size)
        assert used == tv, (name, size)
        if size == 24:
            assert (x - pil).abs().mean() < 4, name
