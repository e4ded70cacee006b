"""Saved state is keyed by parameter name in every format, so any layout's checkpoint seeds any
other layout: a world-1 checkpoint (AdamW state in two parameter groups, optim.decay=
no_bias_norm) resumes under FSDP dp=2, pp=2, tp=2 and dp=2 x pp=2, and each of those runs'
checkpoints resumes at world 1, on the uninterrupted world-1 curve (bit for bit where the layout
is, within tp's tolerance where it is not). Checkpoints written by main at 3a8a994 (index-keyed
whole files, and DCP shards of FSDP and of a pipeline) still resume, to the numbers that commit
gave them (tests/fixtures/main-3a8a994, made by its make.sh)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import ranks, shared_run, train_here, train_losses, weights

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "main-3a8a994"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
SMALL = EXPECTED["overrides"]  # a 2-block GPT of width 16: two groups of AdamW state
LONGER = [a for a in SMALL if not a.startswith(("train.max_steps", "train.eval_every"))]
LONGER += ["train.max_steps=6", "train.eval_every_steps=6"]
PRESET = ["--config", "stdlib-gpt"]
TOL = 1e-5
"""tests/test_tensor_parallel.py's tolerance for a layout that is not bitwise (tp's row sums,
FSDP's reduce-scatter): |loss difference| against the world-1 run."""


def _weights_sha(run_dir) -> str:
    state, digest = weights(run_dir), hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].numpy().tobytes())
    return digest.hexdigest()


def _here(*args: str) -> str:
    """`trainer train --config stdlib-gpt ARGS` in this process; its output."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        train_here("train", *args, config_file="stdlib-gpt")
    return out.getvalue()


@pytest.mark.parametrize("kind", ["whole", "fsdp", "pp"])
def test_a_checkpoint_written_by_main_at_3a8a994_resumes_to_its_numbers(kind, tmp_path):
    """Index-keyed whole files (optimizer.pt numbered group after group), FSDP's and a
    pipeline's flat DCP shards: each step-2 checkpoint resumes at world 1 and steps 3-4 give the
    losses and final weights that main gave them."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / kind / "step-000000002", run / "checkpoints" / "step-000000002")
    out = _here(*SMALL, f"run_dir={run}")
    assert "resumed from" in out, out
    want = EXPECTED["resumed_at_world_1"][kind]
    assert {str(k): v for k, v in train_losses(run).items()} == want["losses"]
    assert _weights_sha(run) == want["weights_sha256"]


@pytest.fixture(scope="module")
def world_1(tmp_path_factory):
    """The uninterrupted world-1 run: 6 steps, a checkpoint every 2."""
    return shared_run(tmp_path_factory, "layouts:world1", lambda d: _here(*LONGER, f"run_dir={d}"))


LAYOUTS = [
    pytest.param(["dist.strategy=fsdp"], 2, False, "fsdp", id="fsdp-dp2"),
    pytest.param(["dist.mesh=pp=2"], 2, True, "pp", id="pp2"),
    pytest.param(["dist.mesh=tp=2"], 2, False, "tp", id="tp2"),
    pytest.param(["dist.mesh=dp=2,pp=2"], 4, False, "ddp+pp", id="dp2-pp2", marks=pytest.mark.mesh),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc, bitwise, name", LAYOUTS)
def test_a_world_1_checkpoint_resumes_under_a_layout_and_back(
    world_1, tmp_path, layout, nproc, bitwise, name
):
    """world 1 -> the layout at step 2 -> world 1 at step 4: every segment on the world-1 curve."""
    there, back = tmp_path / "there", tmp_path / "back"
    start = world_1 / "checkpoints" / "step-000000002"
    argv = ["train", *PRESET, *LONGER, *layout, f"run_dir={there}", f"ckpt.resume={start}"]
    out = ranks(*argv, nproc=nproc, timeout=300).stdout
    assert "resumed from" in out and f", {name}) |" in out, out
    out = _here(
        *LONGER, f"run_dir={back}", f"ckpt.resume={there / 'checkpoints' / 'step-000000004'}"
    )
    assert f"world size {nproc} -> 1" in out, out
    want = train_losses(world_1)
    got = {**train_losses(there), **train_losses(back)}
    assert sorted(got) == [3, 4, 5, 6]
    if bitwise:
        assert got == {s: want[s] for s in got}
        assert _weights_sha(back) == _weights_sha(world_1)
    else:
        assert max(abs(got[s] - want[s]) for s in got) <= TOL, (got, want)


@pytest.mark.slow
def test_starting_weights_seed_a_pipeline_as_they_seed_one_process(world_1, tmp_path):
    """ckpt.init_weights is matched against the whole model on every rank (strict: every name
    and shape) and each stage loads its part: a pp=2 run from the world-1 run's final weights
    trains as one process from them, bit for bit."""
    init = ["train.max_steps=2", f"ckpt.init_weights={world_1 / 'final' / 'model.safetensors'}"]
    args = [*[a for a in LONGER if not a.startswith("train.max_steps")], *init]
    _here(*args, f"run_dir={tmp_path / 'one'}")
    out = ranks("train", *PRESET, *args, "dist.mesh=pp=2", f"run_dir={tmp_path / 'pp'}", nproc=2)
    assert "initial weights from" in out.stdout, out.stdout
    assert train_losses(tmp_path / "pp") == train_losses(tmp_path / "one")
    assert len(train_losses(tmp_path / "one")) == 2


class _Unused(torch.nn.Module):
    """A model with a layer no forward reaches: AdamW never makes its state."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


class _Counting(torch.optim.SGD):
    """An optimizer plug-in whose state_dict holds an entry of its own."""

    def state_dict(self):
        return {**super().state_dict(), "calls": 7}

    def load_state_dict(self, state_dict):
        self.calls = state_dict.pop("calls")
        super().load_state_dict(state_dict)


@pytest.mark.parametrize("make", [torch.optim.AdamW, _Counting], ids=["adamw", "plug-in"])
def test_a_whole_checkpoint_loads_a_parameter_without_state_and_a_plug_ins_own_entries(make):
    """A whole model's optimizer state is torch's own state_dict keyed by name: a parameter that
    never had a gradient (no state) and a plug-in's extra entries go in and come back as they
    were, parameter by parameter, on the live optimizer's numbering."""
    from trainer import namedstate
    from trainer.parallel.parts import whole

    def groups(m):
        return [
            {"params": [m.used.weight, m.unused.weight]},
            {"params": [m.used.bias, m.unused.bias]},
        ]

    torch.manual_seed(0)
    model = _Unused()
    opt = make(groups(model), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    saved = namedstate.whole(whole(model), opt)
    assert set(saved["optimizer"]["state"]) <= {"used.weight", "used.bias"}
    torch.manual_seed(1)
    again = _Unused()
    other = make(groups(again), lr=0.1)
    namedstate.load_whole(whole(again), other, saved, sharded=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )
    assert len(other.state) == len(opt.state)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert opt.state[p].keys() == other.state[q].keys()
        assert all(
            torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(other.state[q][k]))
            for k in opt.state[p]
        )
    if make is _Counting:
        assert other.calls == 7


@pytest.mark.slow
def test_a_whole_checkpoint_of_an_optimizer_without_state_resumes_under_fsdp(tmp_path):
    """SGD without momentum keeps no state: DCP's full-state load finds no tensor to cut
    ("Expected device to be set"), so only the settings are loaded, by name."""
    sgd = [*SMALL, "optim.name=sgd", "optim.momentum=0"]
    _here(*sgd, f"run_dir={tmp_path / 'one'}")
    start = tmp_path / "one" / "checkpoints" / "step-000000002"
    out = ranks(
        "train", *PRESET, *sgd, "dist.strategy=fsdp", f"run_dir={tmp_path / 'fsdp'}",
        f"ckpt.resume={start}", nproc=2,
    ).stdout  # fmt: skip
    assert "resumed from" in out, out
    want, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    assert sorted(got) == [3, 4] and max(abs(got[s] - want[s]) for s in got) <= TOL
