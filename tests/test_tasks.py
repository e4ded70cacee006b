"""The Task contract (trainer/tasks.py) and trainer.fit (trainer/script.py).

The built-in tasks are instances of the contract; a loss whose number of terms varies per batch
is normalised by the global count on any world size and micro-batching; a model that returns its
own mean loss trains through the model_loss adapter (exact when every sample has the same number
of terms, and not otherwise, as docs/extending.md says); trainer.fit runs twice in one process
with the same numbers and leaves nothing global behind.
"""

import json
import re
import signal

import pytest
import torch

from tests import helpers, plugins
from tests.helpers import ROOT, read_jsonl, train_here, trainer, weights
from trainer import config, data, tasks
from trainer.config import TaskConfig
from trainer.errors import UsageError
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel.parts import whole
from trainer.step import TrainStep, make_scaler
from trainer.tasks import Classification, LanguageModel, ModelLoss, Regression, Task

# --- the built-ins ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, kind",
    [
        ([], Classification),
        (["data.name=diabetes"], Regression),
        (["data.name=text", "data.text.max_train_bytes=20000", "data.text.max_test_bytes=2000"], LanguageModel),
        (["data.name=diabetes", "task.name=model_loss"], ModelLoss),
    ],
)  # fmt: skip
def test_the_built_in_tasks_are_instances_of_the_contract(overrides, kind):
    cfg = config.load(None, overrides)
    spec = data.build(cfg.data, cfg.seed)
    task = tasks.build(cfg.task, spec)
    assert type(task) is kind and isinstance(task, Task)
    if kind is Regression:  # the dataset's standardisation, to report MSE in the target's units
        assert task.target_scale == spec.target_scale != 1.0
    if kind is LanguageModel:
        assert task.terms_per_sample == task.tokens_per_sample == cfg.data.text.seq_len


def test_step_and_evaluation_hold_no_case_of_their_own_for_a_task():
    """The built-ins go through the contract like any other task: no task name and no loss
    function of their own in either file."""
    for name in ("step.py", "evaluate.py"):
        source = (ROOT / "trainer" / name).read_text()
        assert not re.search(r"[\"'](classification|regression|lm)[\"']", source), name
        assert not re.search(r"cross_entropy|mse_loss|argmax", source), name


def test_task_name_auto_needs_a_task_from_data_that_names_none():
    spec = plugins.masked(None, 0)
    spec = data.DataSpec(train=spec.train, test=spec.test)  # task=None
    with pytest.raises(UsageError, match="set task.name"):
        tasks.build(TaskConfig(), spec)
    assert isinstance(tasks.build(TaskConfig(name="tests.plugins:MaskedMSE"), spec), Task)


# --- a term count that varies per batch ---------------------------------------------------------

FLAT = ["sched.name=none", "sched.warmup_steps=0"]  # the step's lr is optim.lr


def _step(task, micro=None, model=plugins.linear, lr=0.1):
    """A TrainStep of SGD (no momentum effect on one step, flat lr) on model() seeded alike."""
    cfg = config.load(None, ["optim.name=sgd", f"optim.lr={lr}", "optim.weight_decay=0", *FLAT])
    if micro:
        cfg.train.micro_batch_size = micro
    torch.manual_seed(0)
    model = model()
    opt = build_optimizer(cfg.optim, model.parameters())
    step = TrainStep(
        cfg=cfg.train,
        parts=whole(model),
        optimizer=opt,
        scheduler=build_scheduler(cfg.sched, opt, 10, 100),
        scaler=make_scaler(cfg.train, "cpu"),
        task=task,
    )
    return step, model


def test_a_varying_term_count_is_normalised_by_the_whole_batchs_count():
    """Micro-batches hold different numbers of kept targets; the step's gradient is still the
    mean over every kept target of the batch, as one computation over the whole batch gives."""
    batch = plugins.masked(None, 0).train.take(torch.arange(16))
    counts = [int(batch["mask"][i : i + 5].sum()) for i in range(0, 16, 5)]
    assert len(set(counts)) > 1  # the micro-batches really differ
    torch.manual_seed(0)
    ref = plugins.linear()
    pred = ref(batch["x"])
    mean = ((pred - batch["y"]) ** 2 * batch["mask"]).sum() / batch["mask"].sum()
    mean.backward()
    with torch.no_grad():
        expected = {k: p - 0.1 * p.grad for k, p in ref.named_parameters()}
    for micro in (None, 5, 1):
        step, model = _step(plugins.MaskedMSE(), micro)
        loss = step(batch, 16)
        assert loss.item() == pytest.approx(mean.item(), rel=1e-6), micro
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[k], rtol=1e-6, atol=1e-7)


def test_a_varying_term_count_gives_the_same_bits_on_one_and_two_ranks(tmp_path):
    """The ranks add their counts in one all-reduce a step: world 2 equals world 1, bitwise
    under repro.world_invariant (a local count would weigh each rank's half alike)."""
    args = [
        "data.name=tests.plugins:masked",
        "model.name=tests.plugins:linear",
        "data.global_batch_size=8",
        "train.epochs=3",
        "repro.world_invariant=true",
        "log.every_steps=1",
        "log.progress=none",
        "log.tensorboard=false",
    ]
    one = train_here("train", *args, f"run_dir={tmp_path / 'one'}")
    trainer("train", *args, f"run_dir={tmp_path / 'two'}", nproc=2, torchrun=False)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["eval"] == one["eval"] and two["steps"] == one["steps"] == 15
    losses = [helpers.train_losses(tmp_path / w) for w in ("one", "two")]
    assert losses[0] == losses[1]
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


# --- a model that computes its own loss ---------------------------------------------------------


HF = ["data.name=tests.plugins:hf_tiny", "model.name=tests.plugins:hf_style", *helpers.TINY[2:]]


@pytest.mark.parametrize("as_dict", [False, True])
def test_model_loss_trains_a_model_that_returns_its_mean_loss(tmp_path, as_dict):
    """task.name=model_loss (the data's own here) against the exact sum-and-count task: with one
    term per sample they are the same run."""
    common = [*HF, f"model.kwargs.as_dict={as_dict}", "train.epochs=2", "log.every_steps=1"]
    common += ["log.progress=none", "log.tensorboard=false"]
    adapter = train_here("train", *common, f"run_dir={tmp_path / 'adapter'}")
    exact = train_here(
        "train", *common, "task.name=tests.plugins:SummedCrossEntropy", f"run_dir={tmp_path / 'exact'}"
    )  # fmt: skip
    assert adapter["steps"] == exact["steps"] == 6
    assert adapter["eval"]["loss"] == pytest.approx(exact["eval"]["loss"], rel=1e-6)
    a, b = (helpers.train_losses(tmp_path / n) for n in ("adapter", "exact"))
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)


def test_model_loss_is_exact_only_when_every_sample_has_as_many_terms():
    """Labels of -100 are ignored, so slices hold different numbers of terms: split in
    micro-batches (as ranks split a batch), the adapter's step moves; the sum-and-count task's
    does not. Without ignored labels the two agree."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 1, 4, 4, generator=g), torch.randint(0, 3, (12,), generator=g)
    for ignored, adapter_moves in ((False, False), (True, True)):
        labels = y.clone()
        if ignored:
            labels[
                [0, 1, 2, 7]
            ] = -100  # 1 of 4 kept in the first micro-batch, 3 of 4 in the second
        batch = {"input": x, "labels": labels}
        results = {}
        for name, task in (("adapter", ModelLoss()), ("exact", plugins.SummedCrossEntropy())):
            for micro in (None, 4):
                step, model = _step(task, micro, lambda: plugins.hf_style((1, 4, 4), 3), lr=0.5)
                step(batch, 12)
                results[name, micro] = model.head.weight.detach().clone()
        exact_gap = (results["exact", None] - results["exact", 4]).abs().max().item()
        adapter_gap = (results["adapter", None] - results["adapter", 4]).abs().max().item()
        assert exact_gap < 1e-6
        assert (adapter_gap > 1e-3) == adapter_moves, (ignored, adapter_gap)


# --- trainer.fit --------------------------------------------------------------------------------


def _globals():
    return (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_rng_state(),
        signal.getsignal(signal.SIGTERM),
        signal.getsignal(signal.SIGINT),
    )


def test_fit_twice_in_one_process_gives_the_same_run_and_leaves_nothing_behind(tmp_path):
    import trainer as api
    from tests.helpers import tiny, tiny_model

    settings = {"data": {"global_batch_size": 4}, "train": {"epochs": 2}}
    settings["log"] = {"progress": "none", "tensorboard": False}
    torch.manual_seed(123)
    before = _globals()
    runs = [
        api.fit(
            settings,
            [f"run_dir={tmp_path / str(i)}", "repro.deterministic=true", "dist.device=cpu"],
            model=tiny_model,
            data=tiny,
            task=Classification(),
        )
        for i in range(2)
    ]
    after = _globals()
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and before[3:] == after[3:]
    assert runs[0]["eval"] == runs[1]["eval"] and runs[0]["steps"] == 6
    w0, w1 = weights(tmp_path / "0"), weights(tmp_path / "1")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # The objects are recorded by importable name (trainer eval can rebuild them) or <fit>:.
    cfg = runs[0]["config"]
    assert cfg["model"]["name"] == "tests.helpers:tiny_model"
    assert cfg["data"]["name"] == "tests.helpers:tiny"
    assert cfg["task"]["name"] == "<fit>:Classification"
    records = read_jsonl(tmp_path / "0" / "metrics.jsonl")
    assert any(r["kind"] == "eval" for r in records)


def test_fit_ends_the_process_as_trainer_train_does(tmp_path, capsys):
    import trainer as api
    from tests.helpers import tiny

    with pytest.raises(SystemExit) as stop:
        api.fit(None, ["optim.lrr=0.1"], data=tiny)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown key 'optim.lrr'" in err[0] and "Traceback" not in err[0]
    with pytest.raises(UsageError, match="optim.lrr"):
        api.fit(None, ["optim.lrr=0.1"], data=tiny, exit_on_error=False)


def test_a_name_fit_recorded_for_an_object_is_one_line_from_the_command_line(capsys):
    from trainer import cli

    assert cli.main(["train", "--dry-run", "task.name=<fit>:Classification"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "handed to trainer.fit" in err[-1] and not any("Traceback" in e for e in err)


def test_a_scripts_dry_run_checks_the_contract_and_keeps_nothing(tmp_path, monkeypatch):
    """`python train.py --dry-run`: trainer.fit takes --dry-run among the overrides."""
    import trainer as api
    from tests.helpers import tiny, tiny_model

    monkeypatch.chdir(tmp_path)
    report = api.fit(
        {"data": {"global_batch_size": 4}, "log": {"progress": "none"}},
        ["--dry-run", "dist.device=cpu"],
        model=tiny_model,
        data=tiny,
        task=Classification(),
        exit_on_error=False,
    )
    assert report["dry_run"] and report["last_batch"]["global_samples"] == 1
    assert report["eval_batch"]["global_samples"] == 7 and report["checkpoint"]["bytes"] > 0
    assert not (tmp_path / "runs").exists()  # no run folder left behind


@pytest.mark.parametrize(
    "message, says",
    [
        # torch's conv words a device mismatch on a GPU like a dtype one: told apart by the types
        (
            "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be "
            "the same or input should be a MKLDNN tensor and weight is a dense tensor",
            "tensors on different devices",
        ),
        (
            "Input type (torch.cuda.DoubleTensor) and weight type (torch.cuda.FloatTensor) "
            "should be the same",
            "the batch and the model have different dtypes",
        ),
        ("mat1 and mat2 must have the same dtype, but got Double and Float", "different dtypes"),
    ],
)
def test_forward_errors_name_a_device_or_a_dtype_mismatch_in_one_line(message, says):
    class Raises(tasks.Classification):
        def forward(self, model, batch):
            raise RuntimeError(message)

    model = torch.nn.Linear(4, 2)
    with pytest.raises(UsageError, match=says) as e:
        tasks.forward(Raises(), model, (torch.ones(3, 4), torch.zeros(3, dtype=torch.long)))
    assert "\n" not in str(e.value)
