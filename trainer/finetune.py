"""`trainer export --merge`: a LoRA run's adapters folded into its base weights.

The run's config.yaml rebuilds the model as training built it (the base weights from its
ckpt.init_weights, adapters on optim.lora_targets), the run's weights (the adapters and
optim.lora_also_train) load into it, PEFT merges each adapter into its layer, and the plain
model's weights come out: they load into the model without LoRA and without PEFT.
"""

from __future__ import annotations

import torch

from trainer import config, lora
from trainer.checkpoint.weights import find_config, read_weights
from trainer.errors import UsageError
from trainer.namedstate import fit_problem
from trainer.run import Plugins, inputs


def merged_weights(src: str) -> dict[str, torch.Tensor]:
    """The merged plain weights of the LoRA run (or checkpoint) at `src`."""
    path = find_config(src)
    if path is None:
        raise UsageError(
            f"export --merge {src}: no config.yaml beside the weights: name the LoRA run's "
            "directory or one of its checkpoints"
        )
    cfg = config.load(path, ["dist.device=cpu"])
    if not cfg.optim.lora_targets:
        raise UsageError(
            f"export --merge {src}: not a LoRA run (its optim.lora_targets is empty): export it "
            "without --merge"
        )
    _, _, model = inputs(cfg, "cpu", Plugins())
    model = lora.prepare(cfg.optim, model, cfg.ckpt)
    state = read_weights(src)
    if problem := fit_problem(model, state):  # names, shapes, kinds of dtype: before the load
        raise UsageError(
            f"export --merge {src}: the weights are not this run's adapters ({problem}): "
            "export the run's own directory or checkpoint, with its config.yaml"
        )
    model.load_state_dict(state, strict=False)
    model = lora.merged(model)
    return {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
