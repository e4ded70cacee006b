"""sklearn's bundled datasets: real data that ships with scikit-learn, so nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data import ArrayDataset, DataSpec


def split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A stratified train/test split, fixed by `seed`: each class keeps its share in both.

    Regression passes one label for all samples: a plain random split.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = round(len(idx) * test_fraction)
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def standardize(x: np.ndarray, train_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column zero mean, unit variance, with statistics from the train split only.

    Returns (standardised x, mean, std); a constant column keeps std 1 instead of dividing by 0.
    """
    mean = x[train_idx].mean(axis=0)
    std = x[train_idx].std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return (x - mean) / std, mean, std


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(1797x64 pixels, labels), read from the CSV that scikit-learn ships.

    Reading the file directly skips `import sklearn.datasets` (which pulls in scipy): about 1 s
    saved per process, per rank. sklearn's own loader is the fallback if the file ever moves.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    path = (
        os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
        if spec
        else ""
    )
    if not os.path.isfile(path):
        from sklearn.datasets import load_digits as sklearn_load_digits

        return sklearn_load_digits(return_X_y=True)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def digits(cfg: DataConfig, seed: int) -> DataSpec:
    """sklearn's handwritten digits: 1,797 real 8x8 grey images, 10 classes, shipped with sklearn."""
    x, y = load_digits()
    y_np = y.astype(np.int64)
    tr, te = split(y_np, cfg.test_fraction, cfg.split_seed)
    x = standardize(x, tr)[0].astype(np.float32).reshape(-1, 1, 8, 8)
    x = torch.from_numpy(x)
    y = torch.from_numpy(y_np)
    return DataSpec(
        train=ArrayDataset(x[tr], y[tr]),
        test=ArrayDataset(x[te], y[te]),
        task="classification",
        in_shape=(1, 8, 8),
        num_classes=10,
    )


def diabetes(cfg: DataConfig, seed: int) -> DataSpec:
    """sklearn's diabetes regression: 442 patients, 10 features, one target (disease progression).

    The shape of the housing tutorials (a small table, an MLP regressor trained with MSE). The
    features and the target are standardised with train-split statistics, so one learning rate
    suits any table; evaluation reports MSE and MAE back in the target's own units.
    """
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True, scaled=False)
    tr, te = split(np.zeros(len(y), dtype=np.int64), cfg.test_fraction, cfg.split_seed)
    x = standardize(x, tr)[0].astype(np.float32)
    y, _, y_std = standardize(y[:, None], tr)
    x, y = torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))  # y: (N, 1)
    return DataSpec(
        train=ArrayDataset(x[tr], y[tr]),
        test=ArrayDataset(x[te], y[te]),
        task="regression",
        in_shape=(x.shape[1],),
        num_classes=1,
        target_scale=float(y_std[0]),
    )
