"""ckpt.init_weights: a fresh run's starting weights from somebody else's, matched to the model.

The source (read_weights: ours, a state_dict of any saving strategy or device, sharded
safetensors with an index json, a Hugging Face folder) goes through, in order: the GPT-2 layout
converter (ckpt.init_convert), the renames (ckpt.init_rename, {regex: replacement}, each
applied to every key in turn), the exclusions (ckpt.init_exclude, glob patterns on the renamed keys). Then
strict (the default): every name and shape must fit, apart from the model's excluded tensors,
which keep their fresh initialisation. Non-strict: whatever fits loads, and one table says what
loaded, what stayed freshly initialised (missing), what the source held that the model has not
(unexpected) and what differed in shape (both shapes). No key matching at all is refused in both
modes (probably the wrong model). Every rank reads the same file and loads the same values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from trainer import hf
from trainer.checkpoint.weights import config_hint, read_weights
from trainer.errors import UsageError
from trainer.namedstate import load_weights, mine
from trainer.params import matches, patterns
from trainer.strategy import unwrap


@dataclass
class InitReport:
    """What an init load did, key by key (model names)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Model tensors the source did not give (or that were excluded): freshly initialised."""
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    """(key, shape in the source, shape in the model)."""
    excluded: list[str] = field(default_factory=list)
    """Source keys ckpt.init_exclude dropped."""
    converted: str = ""

    def table(self) -> str:
        """One table: a line per kind, the first few keys of each."""
        rows = [
            ("loaded", self.loaded),
            ("missing (fresh)", self.missing),
            ("unexpected", self.unexpected),
            (
                "shape-mismatched",
                [f"{k} {tuple(a)} there, {tuple(b)} here" for k, a, b in self.mismatched],
            ),
            ("excluded", self.excluded),
        ]
        lines = [f"  {name:<17} {len(keys):>5}  {_few(keys)}" for name, keys in rows]
        head = f"initial weights{f' ({self.converted})' if self.converted else ''}:"
        return "\n".join([head, *lines])


def _few(keys: list[str], n: int = 4) -> str:
    more = f", ... ({len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def parse_renames(rules: dict) -> list[tuple[re.Pattern, str]]:
    """{REGEX: REPLACEMENT} -> compiled pairs, in order; one line when a regex is bad."""
    out = []
    for pattern, replacement in rules.items():
        try:
            out.append((re.compile(pattern), str(replacement)))
        except re.error as e:
            raise UsageError(f"ckpt.init_rename: '{pattern}' is not a regex ({e})") from None
    return out


def matched(state: dict, cfg, model_keys) -> tuple[dict, InitReport]:
    """The source converted, renamed and filtered (cfg: the CkptConfig), and its report so far."""
    report = InitReport()
    convert = cfg.init_convert
    if convert == "auto":
        convert = "hf_gpt2" if hf.looks_gpt2(state) and "tok.weight" in model_keys else "none"
    if convert == "hf_gpt2":
        if not hf.looks_gpt2(state):
            raise UsageError(
                f"{cfg.init_weights}: ckpt.init_convert=hf_gpt2, but it holds no GPT-2 keys "
                "(transformer.h.N.attn.c_attn.weight): set ckpt.init_convert=none"
            )
        state, report.converted = hf.from_gpt2(state), "converted from Hugging Face GPT-2"
    for pattern, replacement in parse_renames(dict(cfg.init_rename)):
        state = {pattern.sub(replacement, k): v for k, v in state.items()}
    globs = patterns(cfg.init_exclude)
    report.excluded = sorted(k for k in state if matches(k, globs))
    state = {k: v for k, v in state.items() if k not in set(report.excluded)}
    return state, report


def load_init(model: nn.Module, cfg, model_cfg=None, *, shapes=None) -> InitReport:
    """Load cfg.init_weights (cfg: the CkptConfig) into `model` (wrapped or not, whole or this
    rank's part of a laid-out model): see the module docstring. `shapes`: the whole model's
    state_dict keys -> shapes (ModelParts.shapes; default: the model's own), which the source is
    matched against, the same on every rank. Raises a one-line UsageError for a strict mismatch
    or when no key matches."""
    path, view = cfg.init_weights, unwrap(model)
    expected = shapes or {k: tuple(v.shape) for k, v in view.state_dict().items()}
    state, report = matched(read_weights(path), cfg, expected.keys())
    excluded_here = [k for k in expected if matches(k, patterns(cfg.init_exclude))]
    report.unexpected = [k for k in state if k not in expected]
    for key, shape in expected.items():  # in the model's order
        if key in state and tuple(state[key].shape) != tuple(shape):
            report.mismatched.append((key, tuple(state[key].shape), tuple(shape)))
        elif key in state:
            report.loaded.append(key)
    report.missing = [k for k in expected if k not in report.loaded]
    if not report.loaded:
        raise UsageError(
            f"{path}: no tensor matches the model (source keys like {_few(sorted(state), 3)}; "
            f"model keys like {_few(list(expected), 3)}): probably the wrong model or weights; "
            "set ckpt.init_rename ({REGEX: REPLACEMENT}) if only the names differ"
        )
    if cfg.init_strict:
        _strict(path, report, excluded_here, model_cfg)
    # What is missing keeps its fresh initialisation (the same on every rank: the same seed).
    load_weights(view, mine({k: state[k] for k in report.loaded}, view), strict=False)
    return report


def _strict(path: str, report: InitReport, excluded_here: list[str], model_cfg) -> None:
    """ckpt.init_strict=true: only excluded model tensors may stay fresh; one line otherwise."""
    if report.mismatched:
        key, there, here = report.mismatched[0]
        raise UsageError(
            f"{path}: {key} has shape {there} there, {here} here: "
            f"{config_hint(path, model_cfg)}, or add it to ckpt.init_exclude (a new head) or set "
            "ckpt.init_strict=false"
        )
    missing = [k for k in report.missing if k not in excluded_here]
    if missing or report.unexpected:
        raise UsageError(
            f"{path}: weights do not fit model (missing {missing[:5]}, unexpected "
            f"{report.unexpected[:5]}): {config_hint(path, model_cfg)}, or set ckpt.init_rename "
            "/ ckpt.init_exclude, or ckpt.init_strict=false to load what fits"
        )
