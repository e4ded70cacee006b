"""`trainer eval SRC`: the test-split metrics of saved weights, under the config that made them."""

from __future__ import annotations

import os

from trainer import checkpoint, data, dist, loop, models
from trainer.config import Config


def run(cfg: Config, src: str) -> dict:
    """Evaluate the weights at `src` (run dir, checkpoint dir or weights file) on cfg's data."""
    denv, device, backend = dist.resolve(cfg.dist.device, cfg.dist.backend, os.environ)
    dist.init(denv, device, backend, cfg.dist.timeout_s)
    try:
        spec = data.build(cfg.data, cfg.seed)
        model = models.build(cfg.model, spec.in_shape, spec.num_classes)
        checkpoint.load_weights_into(model, src)
        return loop.evaluate(model.to(device), spec, denv, device, cfg.data.eval_batch_size)
    finally:
        dist.teardown()
