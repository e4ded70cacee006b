"""What trains, applied to the model before the strategy wraps it: optim.freeze, and LoRA
adapters through Hugging Face PEFT (pip install 'repro-trainer[finetune]').

LoRA (optim.lora_targets): the base weights come from ckpt.init_weights (loaded here, on a
fresh start and on a resume alike: the checkpoints do not hold them), PEFT injects adapters into
the modules the patterns name, and every parameter that is not an adapter is frozen, bar
optim.lora_also_train (a new head). The model's state_dict then holds only what trains: the
checkpoints and final/ are the adapters (and that head); `trainer export --merge` folds the
adapters into the base weights and writes plain ones.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from trainer import params
from trainer.errors import UsageError


def prepare(cfg, model: nn.Module, ckpt=None) -> nn.Module:
    """The model ready to train under OptimConfig `cfg` (ckpt: the CkptConfig, for LoRA's base
    weights): LoRA adapters injected (base frozen), then optim.freeze applied."""
    if cfg.lora_targets:
        model = inject(cfg, model, ckpt)
    if cfg.freeze:
        params.freeze(model, cfg.freeze)
    return model


def _peft():
    try:
        import peft
    except ImportError:
        raise UsageError(
            "optim.lora_targets needs Hugging Face PEFT: pip install 'repro-trainer[finetune]' "
            "(or leave optim.lora_targets empty)"
        ) from None
    return peft


def target_names(model: nn.Module, patterns) -> list[str]:
    """The module names the glob patterns match (Linear, Conv, Embedding: what LoRA adapts);
    a pattern matching none is refused in one line."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)
    names = [n for n, m in model.named_modules() if n and isinstance(m, kinds)]
    patterns = params.patterns(patterns)
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise UsageError(
                f"optim.lora_targets: '{p}' matches no Linear/Conv/Embedding module (they are "
                f"named like {', '.join(names[:4])}, ...): fix the pattern"
            )
    return [n for n in names if params.matches(n, patterns)]


def inject(cfg, model: nn.Module, ckpt=None) -> nn.Module:
    """Base weights (ckpt.init_weights) loaded, adapters injected, the rest frozen, and the
    state_dict narrowed to what trains."""
    peft = _peft()
    report = None
    if ckpt is not None and ckpt.init_weights:
        from trainer.checkpoint.init import load_init

        report = load_init(model, ckpt)
    targets = target_names(model, cfg.lora_targets)
    config = peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets
    )
    also = params.patterns(cfg.lora_also_train)
    names = [n for n, _ in model.named_parameters()]
    for p in also:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise UsageError(
                f"optim.lora_also_train: '{p}' matches no parameter (they are named like "
                f"{', '.join(names[:3])}, ...): fix the pattern"
            )
    model = peft.inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or params.matches(_base_name(name), also))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    model._lora_hooks = [  # merged() removes them
        model.register_state_dict_post_hook(_only(trained)),
        model.register_load_state_dict_post_hook(_forgive(trained)),
    ]
    model._lora_base = report  # base_report(): what a fresh run prints of its base weights
    return model


def base_report(model: nn.Module):
    """The InitReport of the base weights inject() loaded beneath the adapters, or None."""
    return getattr(model, "_lora_base", None)


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _only(trained: set[str]):
    """A state_dict post-hook dropping the frozen parameters (a tied copy too); buffers stay.

    Why not PEFT's get_peft_model_state_dict: it keeps the adapters alone (and
    modules_to_save, which renames what it wraps), while a run also trains optim.lora_also_train
    (a new head) under its own name; and the narrowing has to be the module's own state_dict,
    which the checkpoints read through DCP's state-dict API for every layout."""

    def hook(module, state, prefix, local_metadata) -> None:
        names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        for key in [k for k in state if k.startswith(prefix)]:
            name = key.removeprefix(prefix)
            if name in names and name not in trained:
                del state[key]

    return hook


def _forgive(trained: set[str]):
    """A load of the narrowed state_dict does not miss the frozen base weights."""

    def hook(module, incompatible):
        names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        incompatible.missing_keys[:] = [
            k for k in incompatible.missing_keys if k not in names or k in trained
        ]

    return hook


def merged(model: nn.Module) -> nn.Module:
    """The adapters folded into their base layers, and the LoRA modules replaced by them."""
    from peft.tuners.lora import LoraLayer

    for hook in getattr(model, "_lora_hooks", []):
        hook.remove()
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model
