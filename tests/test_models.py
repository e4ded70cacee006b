"""Model registry, plug-ins, and the built-in networks' shapes."""

import pytest
import torch

from trainer import registry
from trainer.config import ModelConfig
from trainer.errors import UsageError
from trainer.models import build, lenet


@pytest.mark.parametrize("name", sorted(set(registry.MODELS) - {"gpt"}))
def test_every_registered_model_builds_and_runs(name):
    model = build(ModelConfig(name=name), (1, 8, 8), 10)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert model(torch.zeros(0, 1, 8, 8)).shape == (0, 10)  # an empty rank slice


def test_gpt_is_causal_tied_and_sized_by_its_config():
    from trainer.config import GPTConfig

    cfg = ModelConfig(name="gpt", gpt=GPTConfig(layers=3, width=48, heads=4))
    model = build(cfg, (16,), 256)
    assert len(model.shard_units()) == 3
    assert model.head.weight is model.tok.weight  # tied embeddings
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    assert model(torch.zeros(0, 16, dtype=torch.long)).shape == (0, 16, 256)
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change the future: the past's predictions stay put
    assert torch.allclose(model(y)[:, :10], logits[:, :10], atol=1e-6)
    assert not torch.allclose(model(y)[:, 10:], logits[:, 10:])
    # 12 parameters per block (2 LayerNorms, qkv, proj, 2 MLP linears; weight + bias each)
    n = sum(p.numel() for p in model.parameters())
    per_block = 2 * 2 * 48 + (48 * 144 + 144) + (48 * 48 + 48) + (48 * 192 + 192) + (192 * 48 + 48)
    assert n == 256 * 48 + 16 * 48 + 3 * per_block + 2 * 48


@pytest.mark.parametrize("name", sorted(registry.DATASETS))
def test_every_registered_dataset_resolves(name):
    assert callable(registry.factory("data.name", name))


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


def _params(net) -> int:
    return sum(p.numel() for p in net.parameters())


def test_resnet18_is_torchvisions_with_the_small_image_stem():
    import torchvision

    net = build(ModelConfig(name="resnet18"), (3, 32, 32), 10)
    reference = torchvision.models.resnet18(weights=None, num_classes=10)
    # Only the stem differs: a 3x3 stride-1 conv (1,728 weights instead of 9,408), no max-pool.
    assert _params(reference) - _params(net) == 64 * 3 * (7 * 7 - 3 * 3)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, torch.nn.Identity)
    names = {k for k in net.state_dict()}
    assert names == set(reference.state_dict())  # torchvision's module tree, loadable by name
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_resnet18_takes_channels_and_classes_from_the_dataset_unless_set():
    grey = build(ModelConfig(name="resnet18"), (1, 28, 28), 10)
    assert grey.conv1.in_channels == 1 and grey(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    big = build(ModelConfig(name="resnet18", num_classes=5), (3, 96, 96), 10)
    assert big.conv1.kernel_size == (7, 7) and big.fc.out_features == 5  # the ImageNet stem
    forced = build(ModelConfig(name="resnet18", kwargs={"stem": "small"}), (3, 96, 96), 10)
    assert forced.conv1.kernel_size == (3, 3)
    with pytest.raises(UsageError, match="model.kwargs.stem"):
        build(ModelConfig(name="resnet18", kwargs={"stem": "tiny"}), (3, 32, 32), 10)


@pytest.mark.parametrize("shape, pools", [((3, 32, 32), 5), ((1, 28, 28), 4), ((1, 8, 8), 3)])
def test_vgg11_fits_small_images(shape, pools):
    net = build(ModelConfig(name="vgg11"), shape, 10)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 128, 256, 256, 512, 512, 512, 512]
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == 8
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in net.modules()) == pools
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(512, 512), (512, 512), (512, 10)]
    assert net(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("name", ["lenet", "resnet18", "vgg11"])
def test_image_models_reject_feature_vectors_in_one_line(name):
    with pytest.raises(
        UsageError, match=f"model.name={name} needs image inputs.*use model.name=mlp"
    ):
        build(ModelConfig(name=name), (10,), 1)


def test_lenet_xavier_init_is_d2ls():
    net = build(
        ModelConfig(name="lenet", activation="sigmoid", kwargs={"init": "xavier"}), (1, 28, 28), 10
    )
    # Xavier-uniform bound sqrt(6 / (fan_in + fan_out)); torch's default is 1/sqrt(fan_in),
    # which for Linear(400, 120) is 0.05, half of Xavier's 0.107.
    fc = net[7]
    assert (fc.in_features, fc.out_features) == (400, 120)
    bound = (6 / 520) ** 0.5
    assert 0.9 * bound < fc.weight.abs().max() <= bound
    assert isinstance(net[1], torch.nn.Sigmoid)


def test_sync_bn_converts_every_batchnorm_and_keeps_its_state():
    from trainer.strategy import convert_sync_bn

    net = build(ModelConfig(name="vgg11"), (3, 8, 8), 10)
    net[1].running_mean.fill_(0.5)
    synced = convert_sync_bn(net, "cuda:0")  # conversion itself needs no GPU, only its use
    kinds = [type(m) for m in synced.modules()]
    assert torch.nn.SyncBatchNorm in kinds and torch.nn.BatchNorm2d not in kinds
    assert kinds.count(torch.nn.SyncBatchNorm) == 8
    assert torch.equal(synced[1].running_mean, torch.full((64,), 0.5))
    mlp = build(ModelConfig(name="mlp"), (1, 8, 8), 10)
    assert convert_sync_bn(mlp, "cpu") is mlp  # nothing to convert: fine anywhere


def test_sync_bn_on_cpu_is_a_one_line_usage_error_and_world_1_leaves_bn_alone():
    from trainer import config, strategy
    from trainer.parallel.dims import describe
    from trainer.ranks import World

    net = build(ModelConfig(name="resnet18"), (3, 8, 8), 10)
    cfg = config.load(None, ["model.sync_bn=true"])
    one = describe(cfg, 1)
    assert (
        one.name == "none"
        and strategy.replicate(strategy.shard(net, one, World()), one, World()) is net
    )
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in net.modules())
    two = World(rank=0, size=2, local_size=2, master_addr="x", master_port=1)
    ddp = describe(cfg, 2)
    with pytest.raises(
        UsageError, match="model.sync_bn=true needs CUDA devices.*model.sync_bn=false"
    ):
        strategy.replicate(net, ddp, two)
