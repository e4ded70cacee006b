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

import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

from trainer import hf
from trainer.checkpoint.weights import config_hint, read_source
from trainer.errors import UsageError
from trainer.namedstate import dtype_problem, load_weights, mine
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


@dataclass
class Source:
    """The starting weights on their way to the model: the tensors under their current names,
    and each name's key in the file (what the user sees there) for messages."""

    path: str
    state: dict
    origin: dict = field(default_factory=dict)

    def named(self, key: str) -> str:
        """`key`, with the file's own name for it beside where they differ."""
        theirs = self.origin.get(key, key)
        return key if theirs == key else f"{key} (the file's {theirs})"


def matched(source: Source, cfg, expected: dict, config=None, sizes=None) -> InitReport:
    """`source` converted, renamed and filtered (cfg: the CkptConfig; `expected`: the model's
    keys -> shapes), and the report so far. `config`: (path, contents) of the source's
    config.json; `sizes`: the model's GPT sizes (gpt_sizes), which a GPT-2's must agree with."""
    report = InitReport()
    state = source.state
    convert = cfg.init_convert
    if convert == "auto":
        convert = "hf_gpt2" if hf.looks_gpt2(state) and "tok.weight" in expected else "none"
    if convert == "hf_gpt2":
        if not hf.looks_gpt2(state):
            raise UsageError(
                f"{cfg.init_weights}: ckpt.init_convert=hf_gpt2, but it holds no GPT-2 keys "
                "(transformer.h.N.attn.c_attn.weight): set ckpt.init_convert=none"
            )
        if config is not None:
            hf.check_convertible(*config)
            if sizes:
                hf.check_sizes(*config, sizes)
        state = hf.from_gpt2(state, source.origin)
        report.converted = "converted from Hugging Face GPT-2"
        state = _positions(state, expected)
    source.state = state
    _rename(source, parse_renames(dict(cfg.init_rename)))
    globs = patterns(cfg.init_exclude)
    for glob in globs:
        if not any(fnmatch.fnmatchcase(k, glob) for k in (*source.state, *expected)):
            raise UsageError(
                f"ckpt.init_exclude: '{glob}' matches no key of {cfg.init_weights} (after "
                f"conversion and renames: {_few(sorted(source.state), 3)}) and no tensor of "
                f"the model ({_few(list(expected), 3)}): fix the pattern"
            )
    report.excluded = sorted(k for k in source.state if matches(k, globs))
    excluded = set(report.excluded)
    source.state = {k: v for k, v in source.state.items() if k not in excluded}
    return report


def _positions(state: dict, expected: dict) -> dict:
    """A GPT-2's position table cut to the model's sequence length where that is shorter (a
    shorter sequence uses the first positions): the sequence length may be at most the
    folder's n_positions."""
    pos, here = state.get("pos.weight"), expected.get("pos.weight")
    if pos is None or here is None or pos.dim() != 2 or len(here) != 2:
        return state
    if here[1] == pos.shape[1] and here[0] < pos.shape[0]:
        state = {**state, "pos.weight": pos[: here[0]].contiguous()}
    return state


def _rename(source: Source, rules: list[tuple[re.Pattern, str]]) -> None:
    """ckpt.init_rename's rules applied in order to every key: a rule that matches no key, or
    that gives two keys one name (one would silently replace the other), is refused in one line
    naming the rule and both keys."""
    for pattern, replacement in rules:
        rule = f"ckpt.init_rename: '{pattern.pattern}': '{replacement}'"
        state, origin, before = {}, {}, {}
        for key, value in source.state.items():
            try:
                new = pattern.sub(replacement, key)
            except (re.error, IndexError) as e:
                raise UsageError(
                    f"{rule} is not a replacement for this regex ({e}): refer only to its "
                    "groups (\\1 ...)"
                ) from None
            if new in state:
                raise UsageError(
                    f"{rule} renames both {source.named(before[new])} and {source.named(key)} "
                    f"to {new}: one would silently replace the other; make the rule tell them "
                    "apart"
                )
            state[new], before[new] = value, key
            origin[new] = source.origin.get(key, key)
        if not any(pattern.search(k) for k in source.state):
            raise UsageError(
                f"{rule} matches no key of {source.path} (after the conversion and the rules "
                f"before it, keys are like {_few(sorted(source.state), 3)}): fix the regex or "
                "drop the rule"
            )
        source.state, source.origin = state, origin


def gpt_sizes(view: nn.Module, expected: dict, model_cfg=None) -> dict:
    """The sizes of our GPT (built here: `expected` is its whole state's shapes) under GPT-2's
    config.json names: {n_layer: (our key, value)}, a value None where not known; {} for
    another model."""
    if "tok.weight" not in expected or "pos.weight" not in expected:
        return {}
    from trainer.gpt import CausalSelfAttention

    heads = next((m.heads for m in view.modules() if isinstance(m, CausalSelfAttention)), None)
    if heads is None and model_cfg is not None and model_cfg.name == "gpt":
        heads = model_cfg.gpt.heads
    blocks = {k.split(".")[1] for k in expected if k.startswith("blocks.")}
    return {
        "n_layer": ("model.gpt.layers", len(blocks)),
        "n_embd": ("model.gpt.width", expected["tok.weight"][-1]),
        "n_head": ("model.gpt.heads", heads),
        "n_positions": ("data.text.seq_len", expected["pos.weight"][0]),
    }


def load_init(model: nn.Module, cfg, model_cfg=None, *, shapes=None, dtypes=None) -> InitReport:
    """Load cfg.init_weights (cfg: the CkptConfig) into `model` (wrapped or not, whole or this
    rank's part of a laid-out model): see the module docstring. `shapes` and `dtypes`: the whole
    model's state_dict keys -> shapes and dtypes (ModelParts.shapes, .dtypes; default: the
    model's own), which the source is matched against, the same on every rank. Raises a
    one-line UsageError for a strict mismatch, a tensor of another kind of dtype (integers
    into a float parameter), or when no key matches."""
    path, view = cfg.init_weights, unwrap(model)
    own = view.state_dict()
    expected = shapes or {k: tuple(v.shape) for k, v in own.items()}
    kinds = dtypes or {k: v.dtype for k, v in own.items()}
    state, config = read_source(path)
    source = Source(path, state)
    sizes = gpt_sizes(view, expected, model_cfg)
    report = matched(source, cfg, expected, config, sizes)
    state = source.state
    excluded_here = [k for k in expected if matches(k, patterns(cfg.init_exclude))]
    report.unexpected = [k for k in state if k not in expected]
    for key, shape in expected.items():  # in the model's order
        if key in state and tuple(state[key].shape) != tuple(shape):
            report.mismatched.append((key, tuple(state[key].shape), tuple(shape)))
        elif key in state:
            report.loaded.append(key)
    report.missing = [k for k in expected if k not in report.loaded]
    for key in report.loaded:
        if key in kinds and (problem := dtype_problem(key, state[key].dtype, kinds[key])):
            raise UsageError(
                f"{path}: {problem.replace(key, source.named(key), 1)}: these are not weights "
                "of this model; point ckpt.init_weights at a float checkpoint, or add the key "
                "to ckpt.init_exclude"
            )
    if not report.loaded and report.mismatched:
        key, there, here = report.mismatched[0]
        raise UsageError(
            f"{path}: no tensor fits the model: every name that matches differs in shape "
            f"({source.named(key)} has shape {there} there, {here} here): "
            f"{config_hint(path, model_cfg)}"
        )
    if not report.loaded:
        raise UsageError(
            f"{path}: no tensor matches the model (source keys like {_few(sorted(state), 3)}; "
            f"model keys like {_few(list(expected), 3)}): probably the wrong model or weights; "
            "set ckpt.init_rename ({REGEX: REPLACEMENT}) if only the names differ"
        )
    if cfg.init_strict:
        _strict(source, report, excluded_here, model_cfg)
    # What is missing keeps its fresh initialisation (the same on every rank: the same seed).
    load_weights(view, mine({k: state[k] for k in report.loaded}, view), strict=False)
    return report


def _vocabulary(model_cfg, key: str, there: tuple, here: tuple) -> bool:
    """The GPT's token embedding or head differing only in its rows: the vocabulary, which the
    data sets (not model.gpt.*)."""
    gpt = model_cfg is not None and getattr(model_cfg, "name", None) == "gpt"
    rows_only = len(there) == len(here) == 2 and there[1] == here[1] and there[0] != here[0]
    return gpt and key in ("tok.weight", "head.weight") and rows_only


def _strict(source: Source, report: InitReport, excluded_here: list[str], model_cfg) -> None:
    """ckpt.init_strict=true: only excluded model tensors may stay fresh; one line otherwise."""
    path = source.path
    if report.mismatched:
        key, there, here = report.mismatched[0]
        hint = config_hint(path, model_cfg)
        if _vocabulary(model_cfg, key, there, here):
            hint = (
                f"the vocabulary ({there[0]} tokens there, {here[0]} here) is the data's, not a "
                "model.gpt.* setting: train on data tokenized as the weights were (data.name="
                "tokens with that tokenizer's ids; data.name=text reads bytes, 256 tokens)"
            )
        raise UsageError(
            f"{path}: {source.named(key)} has shape {there} there, {here} here: "
            f"{hint}, or add it to ckpt.init_exclude (a new head) or set ckpt.init_strict=false"
        )
    missing = [k for k in report.missing if k not in excluded_here]
    if missing or report.unexpected:
        unexpected = [source.named(k) for k in report.unexpected[:5]]
        raise UsageError(
            f"{path}: weights do not fit model (missing {missing[:5]}, unexpected "
            f"{unexpected}): {config_hint(path, model_cfg)}, or set ckpt.init_rename "
            "/ ckpt.init_exclude, or ckpt.init_strict=false to load what fits"
        )
