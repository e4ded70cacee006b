"""Model registry, plug-ins, and the built-in networks' shapes."""

import pytest
import torch

from trainer import registry
from trainer.config import ModelConfig
from trainer.errors import UsageError
from trainer.models import build, lenet


@pytest.mark.parametrize("name", sorted(registry.MODELS))
def test_every_registered_model_builds_and_runs(name):
    model = build(ModelConfig(name=name), (1, 8, 8), 10)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert model(torch.zeros(0, 1, 8, 8)).shape == (0, 10)  # an empty rank slice


@pytest.mark.parametrize("name", sorted(registry.DATASETS))
def test_every_registered_dataset_resolves(name):
    assert callable(registry.resolve("data.name", name))


def test_lenet_at_28px_is_d2l_lenet():
    net = lenet((1, 28, 28), 10)
    assert sum(p.numel() for p in net.parameters()) == 61_706  # d2l's LeNet-5
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_plugin_factory_gets_what_it_asks_for():
    cfg = ModelConfig(name="tests.helpers:tiny_model", kwargs={"width": 5}, num_classes=7)
    model = build(cfg, (1, 4, 4), 3)
    assert model[1].out_features == 5 and model[-1].out_features == 7


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("no_such_pkg.mod:f", "cannot import 'no_such_pkg.mod'"),
        ("tests.helpers:missing", "has no callable 'missing'"),
        ("tests.helpers:ROOT", "has no callable 'ROOT'"),
    ],
)
def test_bad_plugins_are_usage_errors(name, fragment):
    with pytest.raises(UsageError, match=fragment):
        build(ModelConfig(name=name), (1, 4, 4), 3)


def test_plugin_rejecting_kwargs_is_a_usage_error():
    with pytest.raises(UsageError, match="adjust model.kwargs"):
        build(ModelConfig(name="tests.helpers:tiny_model", kwargs={"nope": 1}), (1, 4, 4), 3)
