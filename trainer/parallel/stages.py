"""How activations cross between pipeline stages: torch's PipelineStage for each of this rank's
stages (shapes given up front from one micro-batch run through the stages), and, outside torch's
schedules (the first step's shapes, evaluation), the stages run one after another with activations
sent point to point: a small header (dtype, rank of the shape, the shape), then the tensor.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from trainer import ranks
from trainer.errors import UsageError
from trainer.parallel.parts import Pipe
from trainer.parallel.split import stage_forward
from trainer.strategy import unwrap


def make_stages(pipe: Pipe, inputs: tuple | None, device: str) -> list:
    """torch's PipelineStage for each of this rank's stages, with its input and output shapes
    given (static mode) from one micro-batch run through the stages once: torch's inference on
    the first step would run a pass DDP counts as a backward."""
    from torch.distributed.pipelining import PipelineStage

    seen: dict[int, tuple] = {}
    with torch.no_grad():
        run_through(pipe, inputs, device, seen)
    out = []
    for s in pipe.local:
        # Activations carry gradients: torch derives the backward's buffers from these.
        stage_in, stage_out = (
            tuple(map(_needs_grad, v)) if isinstance(v, tuple) else _needs_grad(v) for v in seen[s]
        )
        out.append(
            PipelineStage(
                pipe.modules[s], s, pipe.split.n, torch.device(device),
                input_args=stage_in, output_args=stage_out, group=pipe.mesh.group("pp"),
            )
        )  # fmt: skip
    return out


def _needs_grad(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True) if t.is_floating_point() else t


def run_through(pipe: Pipe, inputs: tuple | None, device: str, seen: dict | None = None):
    """The stages one after another on `inputs` (the first stage's; None elsewhere), activations
    sent point to point: the model's output on the last stage's rank, None on the others.
    `seen`: each local stage's (inputs, output)."""
    x = inputs
    for s in range(pipe.split.n):
        if s not in pipe.local:
            continue
        if s > 0 and pipe.owner(s - 1) != pipe.mesh.rank:
            x = (ranks.recv_tensor(pipe.owner(s - 1), device),)
        with stage_forward(unwrap(pipe.modules[s]), s, pipe.split.n):
            y = unwrap(pipe.modules[s])(*x)
        if seen is not None:
            seen[s] = (x, y)
        if s == pipe.split.n - 1:
            return y
        if pipe.owner(s + 1) != pipe.mesh.rank:
            ranks.send_tensor(y, pipe.owner(s + 1))
        x = (y,)
    return None


def model_inputs(task, b) -> tuple:
    """The positional arguments task.forward hands the model for batch `b` (keywords are not
    supported under pp: one line)."""
    seen: list = []

    class Recorder(nn.Module):
        def forward(self, *args, **kwargs):
            if kwargs:
                raise UsageError(
                    f"{type(task).__name__}.forward passes keyword arguments to the model; "
                    "under pp a stage receives positional tensors only"
                )
            seen.append(args)
            return None

    task.forward(Recorder(), b)
    return seen[0]


def forward(pipe: Pipe, task, device: str, b):
    """The model's output for batch `b` on the last stage's rank (None on the others): a split
    model's evaluation forward."""
    with torch.no_grad():
        return run_through(pipe, model_inputs(task, b) if pipe.first else None, device)


def evaluator(pipe: Pipe | None, task, device: str):
    """`forward` bound to this rank's stages, or None for a model that is not split."""
    return None if pipe is None else functools.partial(forward, pipe, task, device)
