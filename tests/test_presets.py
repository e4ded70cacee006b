"""`trainer train --config PRESET` through the CLI: the embedded-data presets reach their
documented numbers; the on-disk ones run on fake data and fail in one line without it.

Most runs call `trainer.cli.main` (what the `trainer` command runs) in this process, which
saves a process start per case; one case goes through the installed command end to end.
"""

import json

import pytest
import torch

from tests import fakes
from tests.helpers import trainer
from trainer import cli


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in the subprocess runs
    yield
    torch.set_num_threads(before)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_preset_is_listed():
    p = trainer("config", "list")
    assert p.stdout.split() == [
        "cifar10-resnet18",
        "diabetes-mlp",
        "digits-lenet",
        "digits-mlp",
        "fashion-lenet",
        "gpt-124m",
        "stdlib-gpt",
    ]


@pytest.mark.parametrize(
    "preset, metric, bound",
    [
        ("digits-mlp", "accuracy", 0.975),  # the preset comments' numbers, seed 0
        ("digits-lenet", "accuracy", 0.965),
        ("diabetes-mlp", "mse", 2900.0),
        pytest.param(
            "stdlib-gpt", "bits_per_byte", 3.1, marks=[pytest.mark.slow, pytest.mark.long]
        ),  # 3.013
    ],
)
def test_embedded_presets_train_to_their_documented_numbers(
    tmp_path, capsys, preset, metric, bound
):
    code, _, err = _cli(
        capsys, "train", "--config", preset, "log.progress=none", f"run_dir={tmp_path}"
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    value = summary["eval"][metric]
    assert value >= bound if metric == "accuracy" else value <= bound, summary["eval"]
    if preset == "stdlib-gpt":
        assert summary["data"]["corpus"] == "python-stdlib" and summary["steps"] == 300
    if preset == "diabetes-mlp":
        assert summary["eval"]["mae"] < 46 and "accuracy" not in summary["eval"]


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    fakes.mnist_folder(root, "FashionMNIST", n_train=64, n_test=32)
    fakes.cifar_folder(root, per_batch=8, n_test=16)
    return root


@pytest.mark.parametrize(
    "preset, extra, steps, count",
    [
        ("fashion-lenet", ["train.epochs=2"], 2, 32),  # 64 samples at batch 256: a step an epoch
        (
            "cifar10-resnet18",
            ["data.verify_checksums=false", "data.global_batch_size=8", "train.max_steps=2"],
            2,
            16,
        ),
    ],
)
def test_on_disk_presets_run_on_fake_data(tmp_path, capsys, fake_root, preset, extra, steps, count):
    code, out, err = _cli(
        capsys,
        "train",
        "--config",
        preset,
        f"data.root={fake_root}",
        *extra,
        "log.progress=none",
        f"run_dir={tmp_path}",
    )
    assert code == 0, err
    assert f"done: {steps} steps" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval"]["count"] == count and summary["steps"] == steps


@pytest.mark.parametrize(
    "preset, fragment",
    [
        ("fashion-lenet", "FashionMNIST/raw/ lacks train-images-idx3-ubyte"),
        ("cifar10-resnet18", "cifar-10-batches-py/ lacks data_batch_1"),
    ],
)
def test_on_disk_presets_without_data_fail_in_one_line(tmp_path, preset, fragment):
    p = trainer(
        "train",
        "--config",
        preset,
        f"data.root={tmp_path}/empty",
        f"run_dir={tmp_path}/run",
        check=False,
    )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer: error: data.name=")
    assert fragment in lines[0] and "mounted read-only at /workspace/data" in lines[0]
    assert "Traceback" not in p.stderr and not (tmp_path / "run").exists()


def test_gpt_124m_is_gpt2_small_shaped_and_sharded():
    from trainer import config
    from trainer.gpt import GPT

    cfg = config.load("gpt-124m", [])
    g = cfg.model.gpt
    assert (g.layers, g.width, g.heads, cfg.data.text.seq_len) == (12, 768, 12, 1024)
    assert cfg.dist.strategy == "fsdp" and cfg.train.precision == "bf16"
    with torch.device("meta"):
        model = GPT(256, cfg.data.text.seq_len, g.layers, g.width, g.heads)
    # GPT-2 small's 124M include 39M of embedding for 50k tokens; bytes need 256 rows.
    assert sum(p.numel() for p in model.parameters()) == 86_039_040
