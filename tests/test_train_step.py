"""The train step against reference steps: accumulation, precision, clipping, schedules, compile."""

import copy
import json

import pytest
import torch

from tests import helpers
from tests.helpers import read_jsonl, train_here, trainer, weights
from trainer import config
from trainer.errors import UsageError
from trainer.optim import Schedule, build_optimizer, build_scheduler
from trainer.parallel.parts import whole
from trainer.step import TrainStep, make_scaler
from trainer.tasks import Classification


def _setup(prepare=None, task=None, wrap=None, **train):
    """A TrainStep of a small MLP (SGD, constant lr); `prepare(model)` runs before the
    optimizer is built (a tp plan replaces the parameters); `wrap(model)`: the module it runs
    as (DDP)."""
    cfg = config.load(
        None,
        [
            *(f"train.{k}={v}" for k, v in train.items()),
            "optim.name=sgd",
            "optim.lr=0.1",
            "optim.weight_decay=0",
            "sched.name=none",
            "sched.warmup_steps=0",
        ],
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
    )
    if prepare is not None:
        prepare(model)
    opt = build_optimizer(cfg.optim, model.parameters())
    sched = build_scheduler(cfg.sched, opt, 10, 100)
    step = TrainStep(
        cfg=cfg.train,
        parts=whole(model, wrap(model) if wrap else None),
        optimizer=opt,
        scheduler=sched,
        scaler=make_scaler(cfg.train, "cpu"),
        task=task or Classification(),
    )
    return step, model


def _batch(n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _max_rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def test_micro_batches_equal_the_unsplit_step():
    x, y = _batch()
    ref_step, ref = _setup()
    ref_loss = ref_step((x, y), len(x))
    for micro in (1, 5, 8, 23):
        step, model = _setup(micro_batch_size=micro)
        sizes = []  # the forwards really ran on micro-batches of at most `micro` samples
        model.register_forward_pre_hook(lambda _m, args, sizes=sizes: sizes.append(len(args[0])))
        loss = step((x, y), len(x))
        assert sizes == [len(c) for c in x.split(micro)], (micro, sizes)
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
        assert _max_rel(model.state_dict(), ref.state_dict()) <= 1e-6, micro


def test_micro_steps_all_reduce_once_per_step():
    """no_sync on all micro-steps but the last: as many DDP all-reduces as an unsplit step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.helpers import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        calls = {}
        for micro in (None, 1, 5):
            step, _ = _setup(wrap=DDP, **({"micro_batch_size": micro} if micro else {}))
            calls[micro] = 0

            def hook(_state, bucket, micro=micro):
                calls[micro] += 1
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            step.model.register_comm_hook(None, hook)
            step(_batch(), 24)
        assert calls[None] >= 1 and calls[1] == calls[5] == calls[None], calls
    finally:
        dist.destroy_process_group()


class _SquaredOutputs(Classification):
    """A loss a DTensor output keeps a DTensor: the sum of the squared outputs."""

    def loss(self, output, batch):
        return (output * output).sum()


def test_a_dtensor_loss_backpropagates_its_scaled_product():
    """A model's own tp plan with use_local_output=False makes the loss a DTensor, which a plain
    start gradient cannot begin backward from (mixed Tensor and DTensor): such a loss takes
    (loss x factor).backward(), and the step updates the weights as the plain model's does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    x, y = _batch()
    ref_step, ref = _setup(task=_SquaredOutputs())
    ref_loss = ref_step((x, y), len(x))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plan = ColwiseParallel(use_local_output=False)
        step, model = _setup(lambda m: parallelize_module(m[3], mesh, plan), _SquaredOutputs())
        loss = step((x, y), len(x))
        assert isinstance(model[3].weight, DTensor)
        weights = {k: v.full_tensor() if isinstance(v, DTensor) else v
                   for k, v in model.state_dict().items()}  # fmt: skip
    finally:
        dist.destroy_process_group()
    full = loss.full_tensor() if isinstance(loss, DTensor) else loss
    assert torch.allclose(full, ref_loss, rtol=1e-6)
    assert _max_rel(weights, ref.state_dict()) <= 1e-6


@pytest.mark.parametrize("precision, tol", [("bf16", 2e-2), ("fp16", 5e-3)])
def test_mixed_precision_step_matches_the_fp32_step(precision, tol):
    x, y = _batch()
    ref_step, ref = _setup()
    ref_loss = ref_step((x, y), len(x))
    step, model = _setup(precision=precision)
    dtypes = []  # the linear layers really computed in the low precision (autocast)
    model[1].register_forward_hook(lambda _m, _a, out: dtypes.append(out.dtype))
    loss = step((x, y), len(x))
    assert dtypes == [{"bf16": torch.bfloat16, "fp16": torch.float16}[precision]]
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    assert _max_rel(model.state_dict(), ref.state_dict()) <= tol
    assert step.skipped_steps == 0


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    x, y = _batch()
    step, model = _setup(precision="fp16", fp16_init_scale=2.0**60)
    before = copy.deepcopy(model.state_dict())
    step((x, y), len(x))
    assert step.skipped_steps == 1 and step.scaler.get_scale() == 2.0**59
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_clipping_bounds_the_update():
    x, y = _batch()
    step, model = _setup(clip_grad_norm=1e-3)
    before = copy.deepcopy(model.state_dict())
    step((x, y), len(x))
    # SGD lr 0.1 with a clipped gradient norm 1e-3: the whole update has norm <= 1e-4.
    moved = torch.sqrt(sum(((model.state_dict()[k] - before[k]) ** 2).sum() for k in before))
    assert 0 < moved.item() <= 1e-4 * (1 + 1e-4)


def test_onecycle_and_warmup_schedules():
    one = Schedule(name="onecycle", total_steps=100, steps_per_epoch=10, pct_start=0.3)
    assert (
        one(0) == pytest.approx(1 / 25)
        and one(30) == pytest.approx(1.0)
        and one(100) == pytest.approx(1e-4)
    )
    assert max(one(s) for s in range(100)) == pytest.approx(1.0)
    warm = Schedule(name="cosine", total_steps=100, steps_per_epoch=10, warmup_steps=10)
    assert (
        warm(0) == pytest.approx(0.1)
        and warm(9) == pytest.approx(1.0)
        and warm(100) == pytest.approx(0.0)
    )
    step = Schedule(name="step", total_steps=100, steps_per_epoch=10, step_size_epochs=2, gamma=0.5)
    assert (step(19), step(20), step(40)) == (1.0, 0.5, 0.25)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_the_schedule_sets_what_lambdalr_sets(tensor_lr):
    """ScheduleLR's own step: the same lrs on every group, last lrs and state dict as torch's
    LambdaLR, step by step through warm-up and decay (a tensor lr: torch's step, filled in
    place), and a state dict either loads."""

    def sgd():
        groups = [{"params": [torch.nn.Parameter(torch.ones(2))]}]
        groups.append({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.3})
        return torch.optim.SGD(groups, lr=torch.tensor(0.01) if tensor_lr else 0.01)

    cfg = config.load(None, ["sched.name=cosine", "sched.warmup_steps=5"])
    opt, ref_opt = sgd(), sgd()
    ours = build_scheduler(cfg.sched, opt, 10, 40)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, ours.lr_lambdas[0])
    assert type(ours).step is not type(ref).step
    for _ in range(40):
        ref_opt.step(), opt.step(), ref.step(), ours.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
        assert ours.get_last_lr() == ref.get_last_lr()
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    assert ours.last_epoch == ref.last_epoch == 40
    resumed_opt = sgd()  # a resume mid-schedule: the checkpoint's position, the same lrs on
    resumed = build_scheduler(cfg.sched, resumed_opt, 10, 40)
    resumed.load_state_dict(ours.state_dict())
    for _ in range(3):
        ref_opt.step(), resumed_opt.step(), ref.step(), resumed.step()
        assert [g["lr"] for g in resumed_opt.param_groups] == [
            g["lr"] for g in ref_opt.param_groups
        ]


def test_channels_last_conv_step_matches():
    """train.channels_last: build() lays the model out channels-last and the step its input
    (3 channels: with 1 the two layouts are the same strides); the numbers do not change."""
    from trainer.parallel.apply import parallelize
    from trainer.parallel.mesh import Mesh
    from trainer.ranks import World

    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 10, (8,))
    outs = []
    for cl in (False, True):
        cfg = config.load(None, ["model.name=lenet", f"train.channels_last={cl}", "optim.name=sgd"])
        torch.manual_seed(0)
        from trainer.models import build

        parts = parallelize(build(cfg.model, (3, 8, 8), 10), Mesh(), World(), cfg.train)
        model = parts.view
        seen = []
        model[0].register_forward_pre_hook(
            lambda _m, a, seen=seen: seen.append(
                a[0].is_contiguous(memory_format=torch.channels_last)
            )
        )
        opt = build_optimizer(cfg.optim, model.parameters())
        sched = build_scheduler(cfg.sched, opt, 1, 1)
        scaler = make_scaler(cfg.train, "cpu")
        step = TrainStep(
            cfg=cfg.train,
            parts=parts,
            optimizer=opt,
            scheduler=sched,
            scaler=scaler,
            task=Classification(),
        )
        outs.append((step((x, y), 8).item(), model))
        assert (
            seen == [cl] and model[3].weight.is_contiguous(memory_format=torch.channels_last) == cl
        )
    assert outs[0][0] == pytest.approx(outs[1][0], rel=1e-5)


TINY = [
    *helpers.TINY,
    "train.epochs=4",
    "optim.name=sgd",
    "optim.lr=0.1",
    "log.every_steps=1",
    "log.progress=none",
]


@pytest.mark.slow
def test_accumulation_under_ddp_matches_the_unsplit_single_process_run(tmp_path):
    # Global batch 4 over 2 ranks = 2 per rank, micro 1: two micro-steps, no_sync on the first.
    # The 9-sample epoch ends with a 1-sample batch: one rank has nothing, the other one micro-step.
    train_here("train", *TINY, f"run_dir={tmp_path / 'ref'}")
    acc = tmp_path / "acc"
    trainer("train", *TINY, "train.micro_batch_size=1", f"run_dir={acc}", nproc=2, torchrun=False)
    a, b = weights(tmp_path / "acc"), weights(tmp_path / "ref")
    assert _max_rel(a, b) <= 1e-5


@pytest.mark.slow
def test_fp16_overflow_is_skipped_by_every_rank_together(tmp_path):
    trainer(
        "train",
        *TINY,
        "train.precision=fp16",
        "train.fp16_init_scale=1e30",
        f"run_dir={tmp_path}",
        nproc=2,
        torchrun=False,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    skipped = summary["skipped_steps"]
    assert len(skipped) == 2 and skipped[0] == skipped[1] > 0


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer("train", *TINY, f"run_dir={tmp_path}")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"} <= tags
    jsonl = {
        r["step"]: r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"
    }
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert tb.keys() == jsonl.keys() and all(abs(tb[s] - jsonl[s]) < 1e-6 for s in tb)


@pytest.mark.slow
def test_compiled_model_trains_and_saves_plain_weights(tmp_path, monkeypatch):
    """In this process (no startup twice): train.compile=true compiles the model, and the step's
    forward with the task's loss as one function, whose graph holds the loss (traced while
    compiling); train.compile_loss=false compiles the model alone and runs the loss eagerly. The
    weights each saves are the eager run's, under plain names."""
    from trainer import tasks
    from trainer.train import train

    compiled, real = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, *a, **k: compiled.append(m) or real(m, *a, **k))
    traced, loss = [], tasks.Classification.loss

    def spied(self, output, batch):
        traced.append(torch.compiler.is_compiling())
        return loss(self, output, batch)

    monkeypatch.setattr(tasks.Classification, "loss", spied)
    one_shape = ["data.global_batch_size=3"]  # 9 samples: no tail batch, so one compiled graph
    runs = {"c": ["train.compile=true"], "m": ["train.compile=true", "train.compile_loss=false"]}
    made = {}
    for name, how in {**runs, "e": []}.items():
        before, traced[:] = len(compiled), []
        train(config.load(None, [*TINY, *one_shape, *how, f"run_dir={tmp_path / name}"]))
        recorded = json.loads((tmp_path / name / "run.json").read_text())["fast_paths"]
        made[name] = (len(compiled) - before, any(traced), recorded["loss_compiled"])
    assert made == {"c": (2, True, True), "m": (1, False, False), "e": (0, False, False)}
    e = weights(tmp_path / "e")
    for name in runs:
        c = weights(tmp_path / name)
        assert c.keys() == e.keys() and not any("_orig_mod" in k for k in c)
        assert _max_rel(c, e) <= 1e-4


@pytest.mark.parametrize(
    "every, steps",
    [
        (["train.eval_every_steps=5"], [5, 10, 12]),
        (["train.eval_every_epochs=2"], [6, 12]),
        (["train.eval_every_epochs=1"], [3, 6, 9, 12]),
    ],
)
def test_evaluation_every_n_steps_or_epochs_and_always_at_the_end(tmp_path, every, steps):
    from trainer.train import train

    train(config.load(None, [*TINY, *every, f"run_dir={tmp_path}"]))
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == steps
    assert all(r["eval.count"] == 7 for r in evals)  # every test sample, each time


class _DoubledInPlace(torch.autograd.Function):
    """Identity forward; its backward doubles the incoming gradient in place (allowed, if rude)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)


class _Doubled(Classification):
    def __init__(self, in_place: bool):
        self.in_place = in_place

    def loss(self, output, batch):
        summed = super().loss(output, batch)
        return _DoubledInPlace.apply(summed) if self.in_place else summed * 2


def test_backward_starts_from_the_loss_factor_and_survives_a_backward_that_changes_it():
    """The step's backward starts from the factor (world / terms) itself, kept between steps:
    a loss whose backward doubles that gradient in place trains exactly as loss x 2 does, step
    after step (the kept factor is made again once changed)."""
    x, y = _batch()
    ref_step, ref = _setup()
    ref_step.task = _Doubled(in_place=False)
    step, model = _setup()
    step.task = _Doubled(in_place=True)
    for i in range(3):
        batch = (x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
        step(batch, 8), ref_step(batch, 8)
        mine, theirs = model.state_dict(), ref.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), f"step {i + 1}"


# --- optim.fused: Adam/AdamW's fused kernel -------------------------------------------------------


def test_adamw_is_fused_where_every_parameter_is_on_a_gpu_unless_the_config_says():
    from types import SimpleNamespace

    from trainer.optim import uses_fused

    cpu, gpu = torch.zeros(2), SimpleNamespace(device=torch.device("cuda", 0))
    assert [uses_fused(None, p) for p in ([cpu], [gpu, gpu], [gpu, cpu], [])] == [
        False, True, False, False,
    ]  # fmt: skip
    assert uses_fused(None, [{"params": [gpu]}, {"params": [gpu]}])  # parameter groups
    assert uses_fused(True, [cpu]) and not uses_fused(False, [gpu])
    fused = config.load(None, ["optim.fused=true"]).optim
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(UsageError, match="no fused AdamW for a torch.float32 parameter on meta"):
        build_optimizer(fused, [meta])  # one line at the build, not a traceback at step 1
    for choice, fused in ((None, None), (True, True), (False, None)):
        cfg = config.load(None, [f"optim.fused={'null' if choice is None else choice}"]).optim
        opt = build_optimizer(cfg, torch.nn.Linear(2, 2).parameters())
        assert opt.param_groups[0]["fused"] is fused  # None: torch's default, as before


def test_a_loaded_optimizer_state_keeps_this_runs_kernels():
    """torch's load_state_dict takes param_groups' fused/foreach from the checkpoint: a resume
    with optim.fused changed would run the saving run's kernel. Loaded within own_kernels, the
    groups keep this optimizer's, and the state (moments, step) is the checkpoint's."""
    from trainer.namedstate import own_kernels

    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    saver = torch.optim.AdamW(model.parameters(), fused=True)
    saver.step()
    saved = saver.state_dict()
    for fused in (None, False):
        loader = torch.optim.AdamW(model.parameters(), fused=fused)
        with own_kernels(loader):
            loader.load_state_dict(saved)
        assert loader.param_groups[0]["fused"] is fused
        got = loader.state_dict()["state"][0]
        assert all(torch.equal(got[k], saved["state"][0][k]) for k in ("exp_avg", "step"))
    plain = torch.optim.AdamW(model.parameters())
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["fused"] is True  # what own_kernels undoes


def test_a_mistake_in_a_compiled_loss_raises_as_it_does_eagerly():
    """Under train.compile the step's forward and loss run compiled, and dynamo wraps a
    mistake in them (here: float labels for a cross-entropy) in a long TorchRuntimeError.
    The step runs the two again eagerly and raises the mistake as an uncompiled run does."""
    import torch._dynamo

    x, y = _batch()
    eager, _ = _setup(compile=True)
    with pytest.raises(RuntimeError) as plain:
        eager.task.loss(eager.model(x), (x, y.float()))
    step, _ = _setup(compile=True, wrap=torch.compile)
    assert step._compiled_loss is not None
    with pytest.raises(RuntimeError) as got:
        step((x, y.float()), global_count=len(y))
    assert not isinstance(got.value, torch._dynamo.exc.TorchRuntimeError)
    assert str(got.value) == str(plain.value) and got.value.__suppress_context__
