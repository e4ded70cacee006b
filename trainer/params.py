"""What trains: frozen parameters, parameter groups by name pattern, and which parameters decay.

Names are the plain model's (no `module.`/`_orig_mod.`), matched with glob patterns
(fnmatch: `*` crosses dots, e.g. `blocks.0.*`, `*.bias`). Pure functions of the model and the
OptimConfig, the same on every rank.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from trainer.errors import UsageError

_PREFIXES = ("module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter name without DDP/DataParallel (`module.`) or torch.compile prefixes."""
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def patterns(value) -> list[str]:
    """Glob patterns from a config value: 'a.*, b.*' (comma-separated) or a list of them."""
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value or ()]
    return [p.strip() for p in items if p.strip()]


def matches(name: str, globs) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in globs)


def freeze(model: nn.Module, globs) -> list[str]:
    """requires_grad=False on the parameters `globs` match (optim.freeze); call it before the
    strategy wraps the model, so DDP/FSDP leave them out of the gradient reduction. A pattern
    that matches nothing is refused in one line."""
    globs = patterns(globs)
    names = [plain_name(n) for n, _ in model.named_parameters()]
    for p in globs:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            raise UsageError(
                f"optim.freeze: '{p}' matches no parameter (they are named like "
                f"{', '.join(names[:3])}, ...): fix the pattern"
            )
    frozen = []
    for name, param in model.named_parameters():
        if matches(plain_name(name), globs):
            param.requires_grad_(False)
            frozen.append(plain_name(name))
    if frozen and len(frozen) == len(names):
        raise UsageError(
            "optim.freeze: every parameter is frozen: nothing would train; narrow the patterns "
            "(to evaluate weights as they are, use trainer eval)"
        )
    return frozen


def _group_of(name: str, groups: dict) -> str | None:
    """The optim.groups entry whose patterns match `name` (None: the default group); a name
    two groups match is refused."""
    hits = [g for g, spec in groups.items() if matches(name, patterns(spec["params"]))]
    if len(hits) > 1:
        raise UsageError(
            f"optim.groups: {name} is in both {hits[0]} and {hits[1]}: groups may not overlap; "
            "narrow one group's params"
        )
    return hits[0] if hits else None


def no_decay(name: str, param) -> bool:
    """optim.decay=no_bias_norm leaves these out of weight decay: biases and norm weights, i.e.
    every parameter of fewer than 2 dimensions (nanoGPT's rule)."""
    return param.dim() < 2


def param_groups(cfg, named_parameters, whole=None) -> list:
    """The optimizer's parameter groups for OptimConfig `cfg`: trainable parameters only, by
    optim.groups (lr = optim.lr * lr_mult, their own weight_decay), each split into decaying
    and non-decaying parts under optim.decay=no_bias_norm. With none of these set, the plain
    list of parameters (one group, as before). `whole`: the names a group's patterns must match
    one of (a pipeline stage holds part of the model; default: `named_parameters`' own)."""
    named = [(plain_name(n), p) for n, p in named_parameters if p.requires_grad]
    if not cfg.groups and cfg.decay == "all":
        return [p for _, p in named]
    check_groups(cfg, [n for n, _ in named] if whole is None else whole)
    return [{"params": [p for _, p in members], **spec} for spec, members in _grouped(cfg, named)]


def check_groups(cfg, names) -> None:
    """Every optim.groups entry matches one of the trainable `names`, or one line."""
    for g, spec in dict(cfg.groups).items():
        if not any(matches(n, patterns(spec["params"])) for n in names):
            raise UsageError(
                f"optim.groups.{g}: params {patterns(spec['params'])} match no trainable parameter "
                "(frozen ones do not count): fix the patterns"
            )


def numbering(cfg, named_parameters) -> list[str]:
    """The trainable parameters' names in the order torch's optimizer state_dict numbers them
    (group after group): what an index-keyed optimizer state's indices mean."""
    named = [(plain_name(n), p) for n, p in named_parameters if p.requires_grad]
    return [n for _, members in _grouped(cfg, named) for n, _ in members]


def _grouped(cfg, named: list) -> list[tuple[dict, list]]:
    """(group settings, its (name, parameter) pairs) in the optimizer's group order."""
    groups = dict(cfg.groups)
    buckets: dict[tuple, list] = {}
    for name, param in named:
        g = _group_of(name, groups)
        decays = not (cfg.decay == "no_bias_norm" and no_decay(name, param))
        buckets.setdefault((g, decays), []).append((name, param))
    order = [None, *groups]
    out = []
    for (g, decays), members in sorted(
        buckets.items(), key=lambda kv: (order.index(kv[0][0]), not kv[0][1])
    ):
        spec = groups.get(g, {}) if g else {}
        wd = float(spec.get("weight_decay", cfg.weight_decay)) if decays else 0.0
        lr = cfg.lr * float(spec.get("lr_mult", 1.0))
        out.append(({"lr": lr, "weight_decay": wd, "group": g or "default"}, members))
    return out
