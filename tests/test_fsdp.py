"""dist.strategy=fsdp (FSDP2 on CPU/gloo) and dp: same numbers as DDP, sharded checkpoints that
load on any world size and under any strategy, and less memory per rank."""

import contextlib
import io
import json
import os
import pickle
import shutil

import pytest
import torch

from tests import helpers
from tests.helpers import (
    TINY_GPT,
    checkpoints,
    read_jsonl,
    shared_run,
    spawn,
    train_here,
    train_losses,
    trainer,
    wait_for,
    weights,
)
from trainer import cli

pytestmark = pytest.mark.slow  # real torchrun jobs: 6-60 s each (make test-quick skips them)

GPT = [
    *TINY_GPT,
    "data.global_batch_size=8",
    "train.max_steps=12",
    "ckpt.every_steps=6",
    "ckpt.keep_last=10",
]
BN_STATS = ("running_mean", "running_var", "num_batches_tracked")
# A ResNet, sharded per residual stage, on digits (SGD: weights comparable to 1e-5).
RESNET = [
    "model.name=resnet18",
    # 3-channel images (a real stem), 16 test samples: the evaluation is a small part of the run
    "data.name=synthetic",
    "data.synthetic.shape=[3,8,8]",
    "data.synthetic.size=64",
    "data.synthetic.test_size=16",
    "optim.name=sgd",
    "optim.lr=0.05",
    "data.global_batch_size=16",
    "train.max_steps=2",  # the second step runs on the first's optimizer state
    "log.every_steps=1",
    "log.progress=plain",
    "log.tensorboard=false",
    "train.micro_batch_size=4",
    "train.clip_grad_norm=1.0",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(world, strategy, *args) -> the run dir of that uninterrupted run, made once per
    session (helpers.shared_run: by the first worker that asks)."""

    def get(world: int, strategy: str, *args: str):
        def make(folder) -> None:
            run_dir = folder / "run"
            argv = ("train", *args, f"dist.strategy={strategy}", f"run_dir={run_dir}")
            if (world, strategy) == (1, "none"):  # a plain process: in this one, one thread
                train_here(*argv)
            else:  # the numbers are the point here, not the launcher: no torchrun
                p = trainer(*argv, nproc=None if world == 1 else world, torchrun=False)
                (folder / "stdout.txt").write_text(p.stdout)

        return shared_run(tmp_path_factory, f"fsdp {world} {strategy} {args!r}", make) / "run"

    return get


def _close(got: dict, ref: dict, rel: float = 1e-5) -> None:
    assert got, "no steps"
    for step, loss in got.items():
        assert abs(loss - ref[step]) <= rel * abs(ref[step]), (step, loss, ref[step])


def _weights_close(a, b, rel: float = 1e-5) -> None:
    """Final weights agree within `rel` of the model's largest weight (a zero-initialised bias
    that barely moved has no scale of its own)."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    learned = [k for k in wb if not k.endswith(BN_STATS)]  # BatchNorm statistics: per rank
    scale = max(wb[k].abs().max().item() for k in learned)
    for name in learned:
        assert (wa[name] - wb[name]).abs().max().item() <= rel * scale, name


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(GPT, id="gpt"),
        # Micro-steps and a clip that binds (the global norm is over all shards) on the ResNet:
        # on the GPT as well cost a minute of suite time for the same code path.
        pytest.param(RESNET, id="resnet18-accum-clip", marks=pytest.mark.long),  # 40 s
    ],
)
def test_fsdp_matches_ddp_and_one_process_on_the_same_global_batch(runs, args):
    fsdp, ddp, one = runs(2, "fsdp", *args), runs(2, "ddp", *args), runs(1, "none", *args)
    ref = train_losses(one)
    assert len(ref) == int(next(a for a in args if "max_steps" in a).split("=")[1])
    _close(train_losses(fsdp), ref)
    _close(train_losses(ddp), ref)
    # AdamW divides by sqrt(v): an element whose gradient is ~0 moves a whole lr step either
    # way on a last-bit difference in the reduction order, so its weights agree less closely.
    _weights_close(fsdp, one, rel=1e-5 if "optim.name=sgd" in args else 1e-4)
    # plain names: no FSDP or DDP wrapper prefix in what a user loads
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights(fsdp))
    summary = json.loads((fsdp / "summary.json").read_text())
    assert summary["config"]["dist"]["strategy"] == "fsdp" and summary["world_size"] == 2


def test_fsdp_shards_parameters_gradients_and_optimizer_state(runs):
    fsdp = json.loads((runs(2, "fsdp", *GPT) / "summary.json").read_text())["memory"]
    ddp = json.loads((runs(2, "ddp", *GPT) / "summary.json").read_text())["memory"]
    assert len(fsdp) == len(ddp) == 2
    for f, d in zip(fsdp, ddp, strict=True):
        assert f["param_bytes"] + f["optimizer_bytes"] <= 0.55 * (
            d["param_bytes"] + d["optimizer_bytes"]
        )
        assert f["grad_bytes"] <= 0.55 * d["grad_bytes"]
    # DDP holds the whole model: 4 bytes per fp32 parameter, Adam's two moments twice that.
    n = sum(t.numel() for k, t in weights(runs(2, "ddp", *GPT)).items() if k != "head.weight")
    assert ddp[0]["param_bytes"] == 4 * n
    assert 8 * n <= ddp[0]["optimizer_bytes"] <= 8 * n + 1024  # plus the step counters


def test_a_sharded_checkpoint_is_one_atomic_step_directory_with_a_manifest(runs):
    step = runs(2, "fsdp", *GPT) / "checkpoints" / "step-000000006"
    files = sorted(str(p.relative_to(step)) for p in step.rglob("*") if p.is_file())
    assert files == [
        "MANIFEST.sha256",
        "config.yaml",
        "dcp/.metadata",
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
        "meta.json",
        "state.pt",
    ]
    listed = {line.split()[1] for line in (step / "MANIFEST.sha256").read_text().splitlines()}
    assert listed == set(files) - {"MANIFEST.sha256"}
    meta = json.loads((step / "meta.json").read_text())
    assert meta["format"] == "sharded" and meta["strategy"] == "fsdp" and meta["world_size"] == 2


def _resume_continues_the_curve(ref, tmp_path, strategy: str, world: int) -> str:
    """Resume `ref`'s step-6 checkpoint under `strategy` on `world` ranks: steps 7-12 follow
    ref's curve and end at its weights. Returns the run's output."""
    run_dir = tmp_path / "run"
    argv = (
        "train",
        *GPT,
        f"dist.strategy={strategy}",
        f"run_dir={run_dir}",
        f"ckpt.resume={ref / 'checkpoints' / 'step-000000006'}",
    )
    if (world, strategy) == (1, "none"):  # a plain process: this one (as runs() makes its run)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            train_here(*argv)
        stdout = out.getvalue()
    else:
        stdout = trainer(*argv, nproc=None if world == 1 else world, torchrun=False).stdout
    assert "resumed from" in stdout
    got = train_losses(run_dir)
    assert sorted(got) == list(range(7, 13))
    _close(got, train_losses(ref))
    _weights_close(run_dir, ref)
    return stdout


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.long)])  # 4: 30 s
def test_a_sharded_checkpoint_resumes_on_another_world_size(runs, tmp_path, world):
    out = _resume_continues_the_curve(runs(2, "fsdp", *GPT), tmp_path, "fsdp", world)
    assert f"world size 2 -> {world}" in out


@pytest.mark.parametrize(
    "saved_by, resumed_by",
    [(("fsdp", 2), ("ddp", 2)), (("ddp", 2), ("fsdp", 2)), (("fsdp", 2), ("none", 1))],
    ids=["fsdp-to-ddp", "ddp-to-fsdp", "fsdp-to-one-process"],
)
def test_checkpoints_cross_between_strategies(runs, tmp_path, saved_by, resumed_by):
    _resume_continues_the_curve(runs(saved_by[1], saved_by[0], *GPT), tmp_path, *resumed_by)


def test_a_corrupt_shard_falls_back_to_the_previous_checkpoint(runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs(2, "fsdp", *GPT) / "checkpoints", run_dir / "checkpoints")
    shard = run_dir / "checkpoints" / "step-000000012" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])  # a truncated write from rank 1
    p = trainer("train", *GPT, "dist.strategy=fsdp", f"run_dir={run_dir}", nproc=2, torchrun=False)
    assert "step-000000012 is corrupt (dcp/__1_0.distcp does not match its sha256" in p.stdout
    assert "resumed from" in p.stdout and "step-000000006" in p.stdout
    assert sorted(train_losses(run_dir)) == list(range(7, 13))  # continued after step 6
    assert "step-000000006" in checkpoints(run_dir)


def test_damaged_shards_in_every_checkpoint_stop_the_run_and_keep_them(runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs(2, "fsdp", *GPT) / "checkpoints", run_dir / "checkpoints")
    for step in ("step-000000006", "step-000000012"):
        shard = run_dir / "checkpoints" / step / "dcp" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-10])
    before = {f: f.read_bytes() for f in (run_dir / "checkpoints").rglob("*") if f.is_file()}
    status = tmp_path / "status"
    status.mkdir()
    p = trainer(
        "train",
        *GPT,
        "dist.strategy=fsdp",
        f"run_dir={run_dir}",
        nproc=2,
        torchrun=False,
        check=False,
        extra_env={"TRAINER_STATUS_DIR": str(status)},
    )
    assert p.returncode != 0 and "no checkpoint in" in p.stderr and "verifies" in p.stderr
    assert {f.read_text().strip() for f in status.glob("*.exit")} == {"2"}  # every rank: exit 2
    assert before == {
        f: f.read_bytes() for f in (run_dir / "checkpoints").rglob("*") if f.is_file()
    }


def test_export_of_a_sharded_checkpoint_loads_with_safetensors_alone(runs, tmp_path):
    ref = runs(2, "fsdp", *GPT)
    # cli.main, what the `trainer` command runs, in this process: no torch import of its own
    step = ref / "checkpoints" / "step-000000012"
    assert cli.main(["export", str(step), "-o", str(tmp_path / "out")]) == 0
    from safetensors.torch import load_file

    from trainer.gpt import GPT as Model

    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    final = weights(ref)
    assert state.keys() == final.keys()
    assert all(torch.equal(state[k], final[k]) for k in state)
    model = Model(vocab=256, seq_len=32, layers=2, width=32, heads=2)
    model.load_state_dict(state)  # strict: every name and shape of the plain model
    assert model(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, 256)


def test_a_sharded_checkpoint_can_be_evaluated_and_seed_weights(runs, tmp_path, capsys):
    ref = runs(2, "fsdp", *GPT)
    step = ref / "checkpoints" / "step-000000012"
    # cli.main in this process, on the CPU as the subprocess runs are (helpers.env hides GPUs)
    assert cli.main(["eval", str(step), *GPT, "dist.device=cpu"]) == 0
    final_eval = json.loads((ref / "summary.json").read_text())["eval"]
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(got["loss"] - final_eval["loss"]) <= 1e-6 * final_eval["loss"]
    assert got["bits_per_byte"] == pytest.approx(final_eval["bits_per_byte"], rel=1e-6)
    # ckpt.init_weights: a fresh run (new optimizer, step 0) starting from those weights; its
    # first loss is the saved model's loss on the first batch, far below a random start's.
    seeded, fresh = tmp_path / "seeded", runs(1, "none", *GPT)
    p = trainer(
        "train", *GPT, "train.max_steps=1", "log.every_steps=1", f"ckpt.init_weights={step}",
        f"run_dir={seeded}", nproc=2, torchrun=False,
    )  # fmt: skip
    assert f"initial weights from {step}" in p.stdout
    assert train_losses(seeded)[1] < train_losses(fresh)[1] - 0.3


@pytest.mark.long  # 26 s: make test-long (make test stays in its 12 minutes)
def test_sigkill_then_rerun_under_fsdp_is_bitwise(runs, tmp_path):
    slow = ["model.name=tests.helpers:slow_gpt", "model.dropout=0.1", "model.kwargs.delay=0"]
    ref = runs(2, "fsdp", *GPT, *slow)
    run_dir = tmp_path / "run"
    proc = spawn(
        "train", *GPT, *slow[:2], "model.kwargs.delay=0.1", "dist.strategy=fsdp",
        f"run_dir={run_dir}", nproc=2,
    )  # fmt: skip
    wait_for(lambda: "step-000000006" in checkpoints(run_dir), 120, "checkpoint 6", proc)
    proc.kill()  # torchrun, then its workers die with it
    proc.wait()
    done = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert max(done) < 12, "the run finished before the kill landed"
    p = trainer(
        "train", *GPT, *slow[:2], "model.kwargs.delay=0.1", "dist.strategy=fsdp",
        f"run_dir={run_dir}", nproc=2, torchrun=False,
    )  # fmt: skip
    assert "resumed from" in p.stdout
    a, b = weights(run_dir), weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(run_dir) == train_losses(ref)


def test_activation_checkpointing_recomputes_and_gives_the_same_numbers(runs, tmp_path):
    plain = runs(2, "fsdp", *GPT)
    counted = ["model.name=tests.helpers:counting_gpt", f"model.kwargs.count_dir={tmp_path}"]
    recomputed = runs(2, "fsdp", *GPT, *counted, "train.activation_checkpointing=true")
    _close(train_losses(recomputed), train_losses(plain), rel=1e-6)
    # Each of the 2 blocks ran forward twice per step on rank 1 (once more in the backward pass);
    # without the setting: 12 x 2 = 24.
    assert (tmp_path / "rank-1").read_text() == "x" * (12 * 2 * 2)


def test_bf16_under_fsdp_trains_close_to_fp32(runs):
    fp32 = train_losses(runs(2, "fsdp", *GPT))
    bf16 = runs(2, "fsdp", *GPT, "train.precision=bf16")
    got = train_losses(bf16)
    assert sorted(got) == sorted(fp32)
    _close(got, fp32, rel=0.02)
    assert got != fp32  # it really computed in bf16
    # master weights stay fp32
    assert all(t.dtype == torch.float32 for t in weights(bf16).values())


def test_dry_run_under_fsdp_reports_per_rank_memory(tmp_path):
    run_dir = tmp_path / "run"
    p = trainer(
        "train", *GPT, "dist.strategy=fsdp", "--dry-run", f"run_dir={run_dir}", nproc=2,
        torchrun=False,
    )  # fmt: skip
    assert "dry run ok" in p.stdout and "(gloo, fsdp)" in p.stdout
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("per rank: params"))
    assert "grads" in line and "optimizer" in line
    assert not (run_dir / "checkpoints").exists() or not checkpoints(run_dir)


def test_a_model_without_shard_units_saves_sharded_checkpoints_after_evaluations(tmp_path):
    """FSDP2 leaves the root's parameters unsharded after an evaluation's forward (no backward
    follows), and a model without shard units has only the root: the saves after each epoch's
    evaluation, and the final one, are still every rank's shards (the format is decided as the
    model is built, never from what a forward left behind: rank 0 alone would gather)."""
    run_dir = tmp_path / "run"
    trainer(
        "train", *helpers.TINY, "train.epochs=2", "dist.strategy=fsdp", f"run_dir={run_dir}",
        nproc=2, torchrun=False, timeout=120,
    )  # fmt: skip
    saved = checkpoints(run_dir)
    assert len(saved) >= 2, saved
    for name in saved:
        meta = json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())
        assert meta["format"] == "sharded", (name, meta["format"])
        assert (run_dir / "checkpoints" / name / "dcp" / ".metadata").is_file()


def test_dp_refuses_a_multi_process_launch_in_one_line(tmp_path):
    status = tmp_path / "status"
    status.mkdir()
    p = trainer(
        "train", *GPT, "dist.strategy=dp", f"run_dir={tmp_path / 'run'}", nproc=2, check=False,
        torchrun=False, extra_env={"TRAINER_STATUS_DIR": str(status)},
    )  # fmt: skip
    codes = {f.read_text().strip() for f in status.glob("*.exit")}
    assert codes == {"2"}, codes  # every rank: bad config (torchrun itself reports 1)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("trainer: error:")]
    assert lines == [
        "trainer: error: dist.strategy=dp is single-process nn.DataParallel, but 2 processes were "
        "launched: use dist.strategy=ddp under torchrun (one process per GPU), or launch one"
    ]
    assert "Traceback" not in p.stderr.split("torch/distributed/elastic")[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_dp_trains_in_one_process_and_warns_that_ddp_is_faster(runs):
    run_dir = runs(1, "dp", *GPT)
    ref = runs(1, "none", *GPT)
    out = (run_dir.parent / "stdout.txt").read_text()
    assert out.count("warning: dist.strategy=dp runs nn.DataParallel on the CPU") == 1
    assert "dist.strategy=ddp under torchrun --nproc-per-node=N" in out and "(gloo, dp)" in out
    assert train_losses(run_dir) == train_losses(ref)
    assert not any(k.startswith("module.") for k in weights(run_dir))


def test_a_checkpoint_metadata_that_would_run_code_is_refused(runs, tmp_path, capsys):
    """DCP unpickles .metadata; a crafted one must not execute, even with a matching manifest."""
    from trainer.checkpoint import store

    step = tmp_path / "step-000000012"
    shutil.copytree(runs(2, "fsdp", *GPT) / "checkpoints" / "step-000000012", step)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    (step / "MANIFEST.sha256").unlink()
    store.seal(
        str(step),
        extra=store.torch_load(str(step / "state.pt")),
        meta=json.loads((step / "meta.json").read_text()),
        config_yaml=(step / "config.yaml").read_text(),
    )
    # cli.main in this process (what the `trainer` command runs): a payload that ran would touch
    # the marker from here; an exception other than the one-line refusal would fail the test.
    for args in (["export", str(step), "-o", str(tmp_path / "out")], ["eval", str(step)]):
        code = cli.main(args)
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert code == 2, out
        assert "Traceback" not in out and "posix.system" in out, out
        assert not marker.exists()
    run_dir = tmp_path / "run"
    status = tmp_path / "status"
    status.mkdir()
    p = trainer(
        "train", *GPT, "dist.strategy=fsdp", f"ckpt.resume={step}", f"run_dir={run_dir}",
        nproc=2, torchrun=False, check=False, extra_env={"TRAINER_STATUS_DIR": str(status)},
    )  # fmt: skip
    assert {f.read_text().strip() for f in status.glob("*.exit")} == {"2"}, p.stderr[-2000:]
    assert "posix.system" in p.stderr and not marker.exists()
