"""Every dataset and model trains: a few steps in-process on tiny data, and the loss falls."""

import io
from contextlib import redirect_stdout

import pytest
import torch

from tests import fakes
from tests.helpers import read_jsonl
from trainer import config
from trainer.train import train


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny convolutions on 2 busy cores run several times faster so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fit(tmp_path, *overrides: str) -> tuple[list[float], dict]:
    cfg = config.load(
        None,
        [
            "log.every_steps=1",
            "log.progress=none",
            "sched.name=none",
            "sched.warmup_steps=0",
            "optim.name=adam",
            "optim.weight_decay=0",
            f"run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )
    with redirect_stdout(io.StringIO()):
        summary = train(cfg)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    return [r["loss"] for r in records if r["kind"] == "train"], summary


def _falls(losses: list[float], factor: float = 0.7) -> bool:
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return last < factor * first


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    """One tiny copy of each on-disk format, shared by the tests below."""
    root = tmp_path_factory.mktemp("data")
    fakes.mnist_folder(root, "MNIST", n_train=48, n_test=16)
    fakes.mnist_folder(root, "FashionMNIST", n_train=48, n_test=16)
    fakes.cifar_folder(root, per_batch=8, n_test=16)
    fakes.image_folder(root / "folder", classes=("a", "b", "c"), per_class=8)
    return root


SYNTHETIC_8PX = [
    "data.name=synthetic",
    "data.synthetic.shape=[3,8,8]",
    "data.synthetic.size=32",
    "data.synthetic.test_size=16",
    "data.global_batch_size=16",
    "optim.lr=0.001",
    "train.epochs=6",
]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["model.name=mlp", "train.max_steps=30"], id="digits-mlp"),
        pytest.param(["model.name=lenet", "train.max_steps=30"], id="digits-lenet"),
        pytest.param([*SYNTHETIC_8PX, "model.name=resnet18"], id="synthetic-resnet18"),
        pytest.param([*SYNTHETIC_8PX, "model.name=vgg11"], id="synthetic-vgg11"),
    ],
)
def test_embedded_and_synthetic_data_train(tmp_path, overrides):
    losses, summary = _fit(tmp_path, "optim.lr=0.003", *overrides)
    assert _falls(losses), losses
    assert summary["eval"]["count"] in (359, 16)


def test_diabetes_regression_trains_and_reports_mse_and_mae(tmp_path):
    losses, summary = _fit(
        tmp_path,
        "data.name=diabetes",
        "data.global_batch_size=128",
        "optim.lr=0.01",
        "model.hidden=[32]",
        "train.epochs=10",
    )
    assert _falls(losses), losses
    ev = summary["eval"]
    assert "accuracy" not in ev and ev["count"] == 88
    scale = 77.0  # about the train split's target std: MSE is in the target's squared units
    assert ev["mse"] == pytest.approx(ev["loss"] * scale**2, rel=0.05)
    assert 2000 < ev["mse"] < 5954  # better than predicting the mean (5954 on this split)
    assert 30 < ev["mae"] < 65


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["data.name=mnist", "model.name=lenet"], id="mnist-lenet"),
        pytest.param(
            [
                "data.name=fashion_mnist",
                "model.name=lenet",
                "model.activation=sigmoid",
                "model.kwargs.init=xavier",
                "data.normalize=false",
                "optim.name=sgd",
                "optim.lr=0.9",
                "optim.momentum=0",
            ],
            id="fashion_mnist-lenet-d2l",
        ),
        pytest.param(
            ["data.name=mnist", "model.name=vgg11", "optim.lr=0.001", "train.epochs=4"],
            id="mnist-vgg11",
        ),
        pytest.param(
            [
                "data.name=cifar10",
                "data.verify_checksums=false",
                "model.name=lenet",
                "data.augment=true",
                "data.num_workers=2",
                "data.persistent_workers=true",
            ],
            id="cifar10-lenet-augment-workers",
        ),
        pytest.param(
            [
                "data.name=imagefolder",
                "data.root={root}/folder",
                "data.image_size=16",
                "model.name=lenet",
                "data.augment=true",
                "data.crop_padding=2",
                "data.num_workers=1",
                "train.epochs=12",
            ],
            id="imagefolder-lenet-augment-worker",
        ),
    ],
)
def test_on_disk_formats_train(tmp_path, disk, overrides):
    overrides = [o.format(root=disk) for o in overrides]
    losses, summary = _fit(
        tmp_path,
        f"data.root={disk}",
        "data.global_batch_size=16",
        "data.eval_batch_size=16",
        "train.epochs=8",
        "optim.lr=0.003",
        *overrides,
    )
    assert _falls(losses), losses
    assert summary["eval"]["count"] in (12, 16)  # the whole test split, once
