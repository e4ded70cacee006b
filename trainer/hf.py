"""Hugging Face layouts without `transformers`: folders (config.json beside model.safetensors,
pytorch_model.bin or shards with an index json) and the GPT-2 key layout, both ways.

A Hugging Face GPT-2 (`GPT2LMHeadModel`) is our GPT (trainer/gpt.py) under other names:
wte/wpe -> tok/pos, h.N.ln_1/ln_2 -> blocks.N.ln1/ln2, attn.c_attn -> attn.qkv (q, k, v in
the same order), attn.c_proj -> attn.proj, mlp.c_fc -> fc, mlp.c_proj -> proj, ln_f -> ln_f,
lm_head (tied to wte) -> head (tied to tok). GPT-2's linear layers are `Conv1D`, whose weight is
stored (in, out): the transpose of nn.Linear's (out, in). Both use tanh-approximated GELU,
LayerNorm eps 1e-5, scaled dot-product attention and a causal mask. The GPT-2 config options we
do not have (cross-attention, per-layer attention scaling, upcast-and-reorder attention, other
activations) are refused when read and never written.
"""

from __future__ import annotations

import json
import os
import re

from trainer.errors import UsageError, shorten

_NAMES = [  # (ours, GPT-2's) for each block's tensors, weights and biases
    ("ln1", "ln_1"),
    ("attn.qkv", "attn.c_attn"),
    ("attn.proj", "attn.c_proj"),
    ("ln2", "ln_2"),
    ("fc", "mlp.c_fc"),
    ("proj", "mlp.c_proj"),
]
_CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}  # stored (in, out)
_BLOCK = re.compile(r"^h\.(\d+)\.(.+)\.(weight|bias)$")
_UNSUPPORTED = {  # GPT-2 config option -> the value our GPT computes with
    "add_cross_attention": False,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "scale_attn_weights": True,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
}


MAX_JSON_BYTES = 16 * 2**20
"""A config.json or shard index larger than this is refused unread: real ones are kilobytes
(GPT-2 XL's index: 40 kB; a classifier's config with 21,843 labels: about 1 MB)."""

_SIZES = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")
"""The GPT-2 config's sizes: positive whole numbers."""


def read_json(path: str, what: str):
    """The JSON document at `path` (a config.json or a shard index): UTF-8, at most
    MAX_JSON_BYTES; one line naming the file for anything else."""
    fix = f"fix or replace the {what}"
    try:
        size = os.path.getsize(path)
        if size > MAX_JSON_BYTES:
            raise UsageError(
                f"{path}: {size:,} bytes, more than a {what} holds (at most "
                f"{MAX_JSON_BYTES:,}): {fix}"
            )
        with open(path, "rb") as f:
            text = f.read(MAX_JSON_BYTES + 1).decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path}: not UTF-8 text (byte {e.start}): a {what} is JSON: {fix}"
        ) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5,000-digit number, [[[[...
        raise UsageError(f"{path}: not valid JSON ({shorten(str(e), 120)}): {fix}") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read the {what} ({e.strerror or e}): {fix}") from None


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words (an array, a string, ...)."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def is_folder(path: str) -> bool:
    """A Hugging Face-style model folder: model.safetensors, pytorch_model.bin or a shard index
    (*.index.json) directly inside (a run's final/ is one too, and reads the same)."""
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    return bool(
        {"model.safetensors", "pytorch_model.bin"} & names
        or any(n.endswith(".index.json") for n in names)
    )


def weight_files(folder: str) -> list[str]:
    """The weight files of a Hugging Face folder: one file, or every shard its index names."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(folder, index)):
            return index_files(os.path.join(folder, index))
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    raise UsageError(
        f"{folder}: no model.safetensors, pytorch_model.bin or *.index.json inside: point at a "
        "Hugging Face model folder, a run directory or a weights file"
    )


def index_files(index: str) -> list[str]:
    """The shard files a `*.index.json` names (its weight_map), each a file beside the index
    (or below it) that exists; one line naming the index and the entry otherwise."""
    form = '{"weight_map": {"tensor name": "shard file beside the index"}}'
    data = read_json(index, "shard index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(weight_map, dict) or not weight_map:
        what = (
            f"a JSON {json_kind(data)}, not an object"
            if not isinstance(data, dict)
            else "no weight_map"
            if "weight_map" not in data
            else f"its weight_map is {shorten(repr(weight_map))}"
        )
        raise UsageError(f"{index}: not a shard index ({what}): it needs {form}")
    names = set()
    for tensor, shard in weight_map.items():
        entry = f"{index}: weight_map[{shorten(repr(tensor))}]"
        if not isinstance(shard, str) or not shard.strip() or "\0" in shard:
            raise UsageError(
                f"{entry} is {shorten(repr(shard))}, not a shard file name: it needs {form}"
            )
        name = os.path.normpath(shard)
        if os.path.isabs(shard) or name == os.curdir or name.split(os.sep)[0] == os.pardir:
            raise UsageError(
                f"{entry} is {shorten(repr(shard))}, outside the index's folder: a shard is "
                "named by its file name beside the index (model-00001-of-00002.safetensors): "
                "fix the index"
            )
        names.add(name)
    folder = os.path.dirname(index)
    paths = [os.path.join(folder, s) for s in sorted(names)]
    if missing := [p for p in paths if not os.path.isfile(p)]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UsageError(f"{index}: names the shard {missing[0]}{more}, which is not there")
    return paths


def looks_gpt2(state: dict) -> bool:
    """Keys in the GPT-2 layout (with or without the `transformer.` prefix)."""
    return any(_BLOCK.match(k.removeprefix("transformer.")) for k in state) and any(
        k.removeprefix("transformer.") == "wte.weight" for k in state
    )


def from_gpt2(state: dict, origin: dict | None = None) -> dict:
    """GPT-2 names and Conv1D layout -> our GPT's state dict (head tied to tok). Keys that have
    no counterpart (the causal-mask buffers of older files) are dropped; others pass through.
    `origin` (if given) gets each new key's source key, for messages; two source keys that
    become one (`wte.weight` beside `transformer.wte.weight`) are refused in one line."""
    out, origin = {}, {} if origin is None else origin

    def put(new: str, key: str, value) -> None:
        if new in out:
            raise UsageError(
                f"ckpt.init_convert=hf_gpt2: {origin[new]} and {key} both become {new}: the "
                "weights hold one GPT-2 tensor twice; keep one (ckpt.init_convert=none and "
                "ckpt.init_rename to choose)"
            )
        out[new], origin[new] = value, key

    for key, value in state.items():
        k = key.removeprefix("transformer.")
        if k in ("wte.weight", "wpe.weight"):
            put({"wte.weight": "tok.weight", "wpe.weight": "pos.weight"}[k], key, value)
        elif k.startswith("ln_f."):
            put(k, key, value)
        elif k == "lm_head.weight":
            continue  # tied to wte: ours is set from tok below
        elif re.match(r"^h\.\d+\.attn\.(masked_)?bias$", k):
            continue  # old transformers' causal-mask buffers: the mask is built in
        elif m := _BLOCK.match(k):
            layer, part, kind = m.groups()
            ours = dict((theirs, mine) for mine, theirs in _NAMES).get(part)
            if ours is None:
                put(key, key, value)  # unknown: reported as unexpected
                continue
            if part in _CONV1D and kind == "weight" and value.dim() == 2:
                value = value.t()  # (not a matrix: left as it is, the shape check names it)
            put(f"blocks.{layer}.{ours}.{kind}", key, value.contiguous())
        else:
            put(key, key, value)
    if "tok.weight" in out:
        out["head.weight"], origin["head.weight"] = out["tok.weight"], origin["tok.weight"]
    return out


def to_gpt2(state: dict) -> dict:
    """Our GPT's state dict -> GPT2LMHeadModel's names and Conv1D layout."""
    out = {}
    for key, value in state.items():
        if key in ("tok.weight", "pos.weight"):
            out[
                {"tok.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight"}[
                    key
                ]
            ] = value
        elif key.startswith("ln_f."):
            out[f"transformer.{key}"] = value
        elif key == "head.weight":
            continue  # tied: transformers ties lm_head to wte
        elif m := re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", key):
            layer, part, kind = m.groups()
            theirs = dict(_NAMES)[part]
            if theirs in _CONV1D and kind == "weight":
                value = value.t()
            out[f"transformer.h.{layer}.{theirs}.{kind}"] = value.contiguous()
        else:
            raise UsageError(
                f"export --format hf-gpt2: {key} has no place in a GPT-2: export a "
                "model.name=gpt run (or use the default format)"
            )
    return out


def check_gpt2_config(folder: str) -> dict | None:
    """The folder's config.json (None: it has none), a JSON object; a GPT-2 one's sizes are
    positive whole numbers and options our GPT computes differently are refused (one line
    naming the file and the option)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    config = read_json(path, "config.json")
    if not isinstance(config, dict):
        raise UsageError(
            f"{path}: a JSON {json_kind(config)}, not an object (a model's config.json is "
            '{"model_type": "gpt2", "n_layer": 12, ...}): fix or remove the file'
        )
    if not is_gpt2(config):
        return config
    for key in _SIZES:
        value = config.get(key)
        if key in config and (type(value) is not int or value < 1):
            raise UsageError(
                f"{path}: {key} is {shorten(repr(value))}, not a positive whole number: fix the "
                'file (a GPT-2\'s config.json says e.g. "n_layer": 12)'
            )
    for key, ours in _UNSUPPORTED.items():
        if key in config and config[key] != ours:
            raise UsageError(
                f"{path}: {key}={shorten(repr(config[key]))}, but trainer's GPT computes with "
                f"{ours!r}: this GPT-2 cannot be converted exactly"
            )
    inner, width = config.get("n_inner"), config.get("n_embd")
    if inner is not None and width is not None and inner != 4 * width:
        raise UsageError(
            f"{path}: n_inner={shorten(repr(inner))}, but trainer's GPT's MLP is 4 x n_embd = "
            f"{4 * width} wide: this GPT-2 cannot be converted exactly"
        )
    return config


def is_gpt2(config: dict) -> bool:
    """A GPT-2's config.json: model_type gpt2, or no model_type and a GPT2* architecture."""
    if "model_type" in config:
        return config["model_type"] == "gpt2"
    arch = config.get("architectures")
    return isinstance(arch, list) and any(str(a).startswith("GPT2") for a in arch)


def check_convertible(path: str, config: dict) -> None:
    """ckpt.init_convert=hf_gpt2 reads GPT-2 weights only: a config.json (at `path`) naming
    another model_type or architecture is refused in one line naming it, even when the
    tensors' names look like GPT-2's."""
    model_type, arch = config.get("model_type"), config.get("architectures")
    fix = (
        "ckpt.init_convert=hf_gpt2 converts GPT-2 (GPT2LMHeadModel) weights only: point "
        "ckpt.init_weights at a GPT-2 folder, or set ckpt.init_convert=none (with "
        "ckpt.init_rename) to load the tensors by their own names"
    )
    if "model_type" in config and model_type != "gpt2":
        raise UsageError(f"{path}: model_type is {shorten(repr(model_type))}, not 'gpt2': {fix}")
    if arch is not None and not (
        isinstance(arch, list) and any(isinstance(a, str) and a.startswith("GPT2") for a in arch)
    ):
        raise UsageError(f"{path}: architectures is {shorten(repr(arch))}, not a GPT-2 one: {fix}")


def check_sizes(path: str, config: dict, ours: dict[str, tuple[str, int | None]]) -> None:
    """The GPT-2 config.json at `path` against the model built here: `ours` maps n_layer,
    n_embd, n_head, n_positions to (our config key, its value; None: not known). The same
    tensors under another head count load, and compute something else: every size that
    disagrees is refused in one line naming both. n_positions may exceed the sequence length
    (the first positions are used)."""
    for key, (name, value) in ours.items():
        theirs = config.get(key)
        if value is None or theirs is None:
            continue
        if isinstance(theirs, bool) or not isinstance(theirs, int) or theirs < 1:
            raise UsageError(
                f"{path}: {key} is {shorten(repr(theirs))}, not a positive whole number: fix "
                "the folder's config.json (a GPT-2's sizes are numbers, e.g. \"n_head\": 12)"
            )
        if key == "n_positions" and theirs < value:
            raise UsageError(
                f"{path}: n_positions={theirs}, but the model reads sequences of {value} "
                f"({name}): set {name} to at most {theirs}"
            )
        if key != "n_positions" and theirs != value:
            raise UsageError(
                f"{path}: {key}={theirs}, but {name}={value} here: set {name}={theirs} "
                "(the weights are this GPT-2's)"
            )


def gpt2_config(state: dict, heads: int) -> dict:
    """A GPT2LMHeadModel config.json for our GPT's state dict (`heads`: model.gpt.heads)."""
    vocab, width = state["tok.weight"].shape
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(vocab),
        "n_positions": int(state["pos.weight"].shape[0]),
        "n_embd": int(width),
        "n_layer": layers,
        "n_head": int(heads),
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": int(vocab) - 1,
        "eos_token_id": int(vocab) - 1,
        "torch_dtype": "float32",
    }
