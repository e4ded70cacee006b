"""Test-split metrics: during training, and `trainer eval SRC` for saved weights."""

from __future__ import annotations

import math
import os

import torch

from trainer import data, models, ranks, sampler
from trainer.config import Config
from trainer.ranks import World
from trainer.step import loss_sum
from trainer.strategy import unwrap


@torch.inference_mode()
def evaluate(
    model, spec: data.DataSpec, world: World, batch: int, *, whole_batches: bool = False
) -> dict:
    """Metrics over the whole test split, each sample counted once across ranks:

    - classification: loss, accuracy;
    - regression: loss (MSE of the standardised target), mse and mae in the target's own units;
    - lm: loss per token, perplexity, bits_per_byte (tokens are bytes), next-byte accuracy.

    whole_batches (repro.world_invariant): each rank evaluates whole batches, every batch's sums
    go in its own row of a table that the ranks fill in (one rank's row plus zeros: an exact
    all-reduce), and the rows are added in batch order: the same bits on any world size.
    """
    net = unwrap(model)  # no DDP forward: evaluation needs no gradient sync
    was_training = net.training
    net.eval()
    batches = data.eval_batches(spec, batch, world.rank, world.size, whole=whole_batches)
    if whole_batches:
        n_batches = -(-len(spec.test) // batch)
        first = sampler.chunk_bounds(n_batches, world.rank, world.size)[0]
        table = torch.zeros(n_batches, 3, dtype=torch.float64, device=world.device)
        for i, (x, y) in enumerate(batches):
            table[first + i] = _batch_sums(net, spec, x, y, world.device)
        totals = ranks.all_reduce_sum(table).sum(dim=0)
    else:
        totals = torch.zeros(3, dtype=torch.float64, device=world.device)
        for x, y in batches:
            totals += _batch_sums(net, spec, x, y, world.device)
        ranks.all_reduce_sum(totals)
    net.train(was_training)
    loss_total, second, terms = totals.tolist()
    loss = loss_total / terms
    if spec.task == "lm":
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": loss / math.log(2),
            "accuracy": second / terms,
            "tokens": int(terms),
            "count": int(terms) // spec.tokens_per_sample,
        }
    result = {"loss": loss, "count": int(terms)}
    if spec.task == "classification":
        result["accuracy"] = second / terms
    else:  # the loss is the MSE of standardised targets; report both in the target's units
        result["mse"] = loss * spec.target_scale**2
        result["mae"] = second / terms * spec.target_scale
    return result


def _batch_sums(net, spec: data.DataSpec, x, y, device: str) -> torch.Tensor:
    """(loss sum, correct or absolute-error sum, loss terms) of one batch, in float64."""
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    out = net(x)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    sums[0] = loss_sum(spec.task, out, y).double()
    if spec.task == "regression":
        sums[1] = (out - y.reshape(out.shape).to(out.dtype)).abs().sum().double()
    else:
        sums[1] = (out.argmax(dim=-1) == y).sum()
    sums[2] = y.numel() if spec.task == "lm" else len(y)
    return sums


def evaluate_saved(cfg: Config, src: str) -> dict:
    """`trainer eval`: the weights at `src` (run dir, checkpoint dir or weights file) on cfg's data."""
    from trainer.checkpoint.weights import load_weights_into

    world = ranks.from_process(cfg.dist.device, cfg.dist.backend, os.environ)
    with ranks.process_group(world, cfg.dist.timeout_s):
        spec = data.build(cfg.data, cfg.seed)
        model = models.build(cfg.model, spec.in_shape, spec.num_classes, spec.task)
        load_weights_into(model, src, model_cfg=cfg.model)
        return evaluate(model.to(world.device), spec, world, cfg.data.eval_batch_size)
