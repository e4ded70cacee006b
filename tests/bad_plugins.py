"""Broken plug-ins, one mistake each, for tests/test_bad_input.py's plug-in cases.

Each object here breaks one rule of a plug-in contract: a data factory `(DataConfig, seed) ->
trainer.DataSpec` and its splits (`__len__`, `take(idx)`), a model factory, or a trainer.Task
(forward, loss, count / terms_per_sample, metrics, summarize). Everything else is right and
tiny: 9 training and 7 test samples of shape (1, 4, 4) in 3 classes (tests/helpers.py:tiny's
shapes) and tests.helpers:tiny_model, so a case costs a fraction of a second in-process.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.data import ArrayDataset, DataSpec
from trainer.errors import UsageError
from trainer.tasks import Task

# --- data --------------------------------------------------------------------------------------


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(16, 1, 4, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def _pair(x, y):
    return x, y


class Rows:
    """A Split (just __len__ and take) of tensors x, y whose take() returns `fn(x[idx], y[idx])`."""

    def __init__(self, x, y, fn=_pair):
        self.x, self.y, self.fn = x, y, fn

    def __len__(self) -> int:
        return len(self.x)

    def take(self, idx):
        idx = torch.as_tensor(np.asarray(idx), dtype=torch.int64)
        return self.fn(self.x[idx], self.y[idx])


def _spec(train_fn=_pair, test_fn=_pair, **kw) -> DataSpec:
    x, y = _xy()
    return DataSpec(
        train=Rows(x[:9], y[:9], train_fn),
        test=Rows(x[9:], y[9:], test_fn),
        **{"task": "classification", "in_shape": (1, 4, 4), "num_classes": 3, **kw},
    )


def good_data(cfg, seed):
    """The tiny data through a plain Split: the control every case varies."""
    return _spec()


# data factories that return something other than a DataSpec


def returns_none(cfg, seed):
    _spec()  # built, but the return was forgotten


def returns_dict(cfg, seed):
    x, y = _xy()
    return {"train": ArrayDataset(x[:9], y[:9]), "test": ArrayDataset(x[9:], y[9:])}


def returns_tuple(cfg, seed):
    x, y = _xy()
    return ArrayDataset(x[:9], y[:9]), ArrayDataset(x[9:], y[9:])


def returns_dataset(cfg, seed):
    x, y = _xy()
    return ArrayDataset(x, y)


def returns_dataspec_class(cfg, seed):
    return DataSpec


def data_without_arguments():
    """A data factory that does not take (DataConfig, seed)."""
    return _spec()


def raises_usage_error(cfg, seed):
    raise UsageError("raises_usage_error: /data/ratings.csv not found: run prepare.py first")


# splits that break the Split protocol


class TakeOnly:
    """take() but no __len__."""

    def take(self, idx):
        x, y = _xy()
        return x[idx], y[idx]


class LenOnly:
    """__len__ and __getitem__ (a map-style Dataset's) but no take()."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, i):
        x, y = _xy()
        return x[i], y[i]


class LenFloat(Rows):
    """__len__ returns a float."""

    def __len__(self):
        return 9.0


class LenNegative(Rows):
    def __len__(self):
        return -1


def split_without_take(cfg, seed):
    return DataSpec(train=LenOnly(), test=LenOnly(), task="classification", in_shape=(1, 4, 4))


def split_is_tensor_dataset(cfg, seed):
    x, y = _xy()
    split = torch.utils.data.TensorDataset(x, y)
    return DataSpec(train=split, test=split, task="classification", in_shape=(1, 4, 4))


def split_without_len(cfg, seed):
    return DataSpec(train=TakeOnly(), test=TakeOnly(), task="classification", in_shape=(1, 4, 4))


def split_len_float(cfg, seed):
    x, y = _xy()
    return DataSpec(train=LenFloat(x, y), test=Rows(x, y), in_shape=(1, 4, 4))


def split_len_negative(cfg, seed):
    x, y = _xy()
    return DataSpec(train=LenNegative(x, y), test=Rows(x, y), in_shape=(1, 4, 4))


def spec_task_not_a_name(cfg, seed):
    return _spec(task=5)


# take() returning something other than a batch of len(idx) rows


def take_numpy(cfg, seed):
    return _spec(lambda x, y: (x.numpy(), y.numpy()))


def take_lists(cfg, seed):
    return _spec(lambda x, y: (x.tolist(), y.tolist()))


def take_none(cfg, seed):
    return _spec(lambda x, y: None)


def take_dict_with_list(cfg, seed):
    return _spec(lambda x, y: {"x": x, "y": y.tolist()})


def take_dict_with_string(cfg, seed):
    return _spec(lambda x, y: {"x": x, "y": "labels"})


def take_different_lengths(cfg, seed):
    return _spec(lambda x, y: (x, torch.cat([y, y])))


def take_too_many_rows(cfg, seed):
    return _spec(lambda x, y: (torch.cat([x, x]), torch.cat([y, y])))


def take_scalar(cfg, seed):
    return _spec(lambda x, y: torch.tensor(1.0))


def take_numpy_in_test_split(cfg, seed):
    return _spec(test_fn=lambda x, y: (x.numpy(), y.numpy()))


# --- models ------------------------------------------------------------------------------------


def tiny_model(num_classes, in_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(in_shape)), num_classes))


def model_in_float64(num_classes, in_shape):
    """A model in float64 (`.double()`): the batches the data gives are float32."""
    return tiny_model(num_classes, in_shape).double()


def model_returns_none(num_classes, in_shape):
    tiny_model(num_classes, in_shape)


def model_returns_dict(num_classes, in_shape):
    return {"net": tiny_model(num_classes, in_shape)}


def model_returns_factory(num_classes, in_shape):
    return tiny_model  # the factory, not what it builds


def model_needs_vocab(vocab_size, in_shape):
    """Names an argument the trainer does not offer (and model.kwargs does not set)."""
    return tiny_model(vocab_size, in_shape)


def model_with_a_type_error_inside(num_classes, in_shape):
    """Accepts its arguments; its own body raises a TypeError (a bug in the user's code)."""
    return nn.Linear(in_shape, num_classes)  # a tuple where an int belongs


class NotAModule:
    """A model class that forgot to subclass nn.Module."""

    def __init__(self, num_classes, in_shape):
        self.net = tiny_model(num_classes, in_shape)

    def __call__(self, x):
        return self.net(x)


NOT_CALLABLE = 42


# --- tasks -------------------------------------------------------------------------------------


class Good(Task):
    """Cross-entropy with its sum and accuracy: the control every task case varies."""

    name = "good"

    def loss(self, output, batch):
        return F.cross_entropy(output, batch[1], reduction="sum")

    def metrics(self, output, batch):
        y = batch[1]
        return {
            "loss": (self.loss(output, batch), len(y)),
            "accuracy": ((output.argmax(-1) == y).sum(), len(y)),
        }


GOOD = Good()


def good_task():
    return Good()


# factories and objects that are not Tasks


class NotATask:
    """Has loss() and metrics() but does not subclass trainer.Task."""

    def loss(self, output, batch):
        return F.cross_entropy(output, batch[1], reduction="sum")


def task_returns_none():
    Good()


def task_returns_loss_function():
    return F.cross_entropy


LOSS_TABLE = {"loss": "cross_entropy"}


class NoLoss(Task):
    """Subclasses Task but defines no loss()."""

    def metrics(self, output, batch):
        return {"accuracy": ((output.argmax(-1) == batch[1]).sum(), len(batch[1]))}


NO_LOSS = NoLoss()


class TermsZero(Good):
    terms_per_sample = 0


class TermsNegative(Good):
    terms_per_sample = -1


class TermsFloat(Good):
    terms_per_sample = 1.5


class TermsTrue(Good):
    terms_per_sample = True


class TermsNoneNoCount(Good):
    terms_per_sample = None


TERMS_ZERO = TermsZero()
TERMS_NEGATIVE = TermsNegative()
TERMS_FLOAT = TermsFloat()
TERMS_TRUE = TermsTrue()
TERMS_NONE_NO_COUNT = TermsNoneNoCount()


# loss() returning something other than a 0-dim float sum that depends on the model


class LossFloat(Good):
    def loss(self, output, batch):
        return super().loss(output, batch).item()


class LossInt(Good):
    def loss(self, output, batch):
        return 3


class LossVector(Good):
    def loss(self, output, batch):
        return F.cross_entropy(output, batch[1], reduction="none")


class LossIntTensor(Good):
    def loss(self, output, batch):
        return (output.argmax(-1) != batch[1]).sum()


class LossDetached(Good):
    def loss(self, output, batch):
        return super().loss(output, batch).detach()


class LossNone(Good):
    def loss(self, output, batch):
        F.cross_entropy(output, batch[1], reduction="sum")


# count() returning something other than a non-negative int (terms_per_sample None)


class Counted(Good):
    terms_per_sample = None

    def count(self, batch):
        return len(batch[1])


class CountFloat(Counted):
    def count(self, batch):
        return float(len(batch[1]))


class CountNegative(Counted):
    def count(self, batch):
        return -1


class CountString(Counted):
    def count(self, batch):
        return str(len(batch[1]))


class CountFloatTensor(Counted):
    def count(self, batch):
        return torch.tensor(float(len(batch[1])))


class CountNone(Counted):
    def count(self, batch):
        len(batch[1])


class CountedWithFixedTerms(Good):
    """count() defined, terms_per_sample left at 1: the step would ignore count()."""

    def count(self, batch):
        return len(batch[1])


class CountZero(Counted):
    """Every label masked: no loss terms in the whole global batch."""

    def count(self, batch):
        return 0


# metrics() returning something other than {name: (sum, count)}


class MetricsList(Good):
    def metrics(self, output, batch):
        return [self.loss(output, batch), len(batch[1])]


class MetricsEmpty(Good):
    def metrics(self, output, batch):
        return {}


class MetricsMean(Good):
    def metrics(self, output, batch):
        return {"loss": self.loss(output, batch).item() / len(batch[1])}


class MetricsTriple(Good):
    def metrics(self, output, batch):
        return {"loss": (self.loss(output, batch), len(batch[1]), "nats")}


class MetricsVectorSum(Good):
    def metrics(self, output, batch):
        return {"loss": (F.cross_entropy(output, batch[1], reduction="none"), len(batch[1]))}


class MetricsString(Good):
    def metrics(self, output, batch):
        return "loss"


class MetricsNonStringName(Good):
    def metrics(self, output, batch):
        return {0: (self.loss(output, batch), len(batch[1]))}


class MetricsStringCount(Good):
    def metrics(self, output, batch):
        return {"loss": (self.loss(output, batch), "all")}


class MetricsNamesVary(Good):
    """A batch of 4 reports `accuracy`, any other size `acc`."""

    def metrics(self, output, batch):
        out = super().metrics(output, batch)
        out["accuracy" if len(batch[1]) == 4 else "acc"] = out.pop("accuracy")
        return out


class MetricsNegativeCount(Good):
    def metrics(self, output, batch):
        return {"loss": (self.loss(output, batch), -len(batch[1]))}


class MetricsWithoutLoss(Good):
    """Only an accuracy: no metric named `loss`."""

    def metrics(self, output, batch):
        return {"accuracy": ((output.argmax(-1) == batch[1]).sum(), len(batch[1]))}


# summarize() returning something other than {name: number}


class SummarizeList(Good):
    def summarize(self, totals):
        return [s / c for s, c in totals.values()]


class SummarizeStringValue(Good):
    def summarize(self, totals):
        out = super().summarize(totals)
        out["accuracy"] = f"{100 * out['accuracy']:.1f}%"
        return out


class SummarizeNone(Good):
    def summarize(self, totals):
        super().summarize(totals)


class SummarizeTensorValue(Good):
    def summarize(self, totals):
        return {name: torch.tensor(s / c) for name, (s, c) in totals.items()}


# forward() that moves the batch off the run's device


class ForwardToMeta(Good):
    """Moves the inputs to another device (`meta` stands in for a GPU on a CPU machine)."""

    def forward(self, model, batch):
        return model(batch[0].to("meta"))


class ForwardInFloat64(Good):
    """Turns the inputs into float64 before the (float32) model sees them."""

    def forward(self, model, batch):
        return model(batch[0].double())


class ForwardNewTensorOnMeta(Good):
    """Makes a new tensor on another device than the batch's and adds it to the output."""

    def forward(self, model, batch):
        out = model(batch[0])
        return out + torch.zeros(out.shape[-1], device="meta")


# --- modules that fail to import (written to a folder on sys.path by the test) -----------------

BROKEN_MODULES = {
    "broken_plugin_import_name.py": "import torch\nfrom json import no_such_name\n",
    "broken_plugin_missing_dep.py": "import torch\nimport no_such_dependency_xyz\n",
    # The missing module's name is a prefix of the plug-in's own: still a missing dependency
    "broken_plugin_v2.py": "import torch\nimport broken_plugin\n",
    "broken_plugin_syntax.py": "import torch\n\ndef data(cfg, seed:\n    pass\n",
    "broken_plugin_indent.py": "def model(num_classes):\nreturn None\n",
    "broken_plugin_name_error.py": "import torch\n\nWIDTH = widht * 2\n",
    "broken_plugin_runtime.py": "import torch\n\nraise RuntimeError('this module needs a GPU')\n",
    # raised inside the standard library by a line of the plug-in's own
    "broken_plugin_json.py": "import json\n\nSETTINGS = json.loads('{')\n",
    "broken_plugin_pkg/__init__.py": "from .helpers import no_such_helper\n",
    "broken_plugin_pkg/helpers.py": "HELPER = 1\n",
    "broken_plugin_pkg/tasks.py": "from trainer.tasks import Classification as Task\n",
}
"""path -> source of a plug-in module that fails to import, each in its own way."""


def write_broken_modules(folder) -> None:
    import os

    for path, source in BROKEN_MODULES.items():
        full = os.path.join(folder, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(source)
