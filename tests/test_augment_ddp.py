"""Augmentation under the real torchrun: a 2-rank run with a loader worker per rank equals a
1-process run without workers, loss for loss and weight for weight. Each sample's crop and flip
depend on (seed, epoch, index) only, never on the rank, the batch slot or the worker."""

import pytest

from tests import fakes
from tests.helpers import ROOT, train_here, trainer
from tests.test_distributed import assert_same_run


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    # 45 training images at global batch 8: each epoch ends with a 5-image tail (2 + 3 per rank).
    return fakes.cifar_folder(tmp_path_factory.mktemp("data"), per_batch=9, n_test=10)


def _args(root, run_dir) -> list[str]:
    return [
        "train",
        "data.name=cifar10",
        f"data.root={root}",
        "data.verify_checksums=false",
        "data.augment=true",
        "data.global_batch_size=8",
        "data.eval_batch_size=8",
        "model.name=lenet",  # no BatchNorm: per-rank batch statistics would differ by design
        "model.activation=relu",
        "optim.name=sgd",
        "optim.lr=0.05",
        "sched.name=none",
        "train.epochs=3",
        "log.every_steps=1",
        "log.progress=none",
        f"run_dir={run_dir}",
    ]


@pytest.mark.slow
@pytest.mark.long  # 27 s: make test-long (make test stays in its 12 minutes)
def test_two_ranks_with_workers_match_one_process(tmp_path, cifar):
    train_here(*_args(cifar, tmp_path / "w1"))
    trainer(*_args(cifar, tmp_path / "w2"), "data.num_workers=1", nproc=2, torchrun=False)
    assert_same_run(tmp_path / "w2", tmp_path / "w1")  # 18 steps, 1e-5 relative


@pytest.mark.slow
def test_sync_bn_on_cpu_ranks_stops_in_one_line(tmp_path):
    # Synthetic data and VGG (plain torch): no sklearn or torchvision import, a quicker start.
    p = trainer(
        "train",
        "data.name=synthetic",
        "data.synthetic.shape=[3,8,8]",
        "model.name=vgg11",
        "model.sync_bn=true",
        f"run_dir={tmp_path}",
        nproc=2,
        torchrun=False,
        check=False,
    )
    assert p.returncode != 0
    assert "trainer: error: model.sync_bn=true needs CUDA devices" in p.stderr
    assert (
        f'File "{ROOT}/trainer/' not in p.stderr
    )  # torchrun reports the exit; no traceback of ours
