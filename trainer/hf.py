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

from trainer.errors import UsageError

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
    """The shard files a `*.index.json` names (its weight_map), each checked to exist."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(
            f"{index}: not a shard index ({type(e).__name__}: {e}): it needs "
            '{"weight_map": {"tensor name": "shard file"}}'
        ) from None
    folder = os.path.dirname(index)
    paths = [os.path.join(folder, s) for s in shards]
    if missing := [p for p in paths if not os.path.isfile(p)]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UsageError(f"{index}: names the shard {missing[0]}{more}, which is not there")
    return paths


def looks_gpt2(state: dict) -> bool:
    """Keys in the GPT-2 layout (with or without the `transformer.` prefix)."""
    return any(_BLOCK.match(k.removeprefix("transformer.")) for k in state) and any(
        k.removeprefix("transformer.") == "wte.weight" for k in state
    )


def from_gpt2(state: dict) -> dict:
    """GPT-2 names and Conv1D layout -> our GPT's state dict (head tied to tok). Keys that have
    no counterpart (the causal-mask buffers of older files) are dropped; others pass through."""
    out = {}
    for key, value in state.items():
        k = key.removeprefix("transformer.")
        if k in ("wte.weight", "wpe.weight"):
            out[{"wte.weight": "tok.weight", "wpe.weight": "pos.weight"}[k]] = value
        elif k.startswith("ln_f."):
            out[k] = value
        elif k == "lm_head.weight":
            continue  # tied to wte: ours is set from tok below
        elif m := _BLOCK.match(k):
            layer, part, kind = m.groups()
            ours = dict((theirs, mine) for mine, theirs in _NAMES).get(part)
            if ours is None:
                out[key] = value  # unknown: reported as unexpected
                continue
            if part in _CONV1D and kind == "weight":
                value = value.t()
            out[f"blocks.{layer}.{ours}.{kind}"] = value.contiguous()
        elif re.match(r"^h\.\d+\.attn\.(masked_)?bias$", k):
            continue  # old transformers' causal-mask buffers: the mask is built in
        else:
            out[key] = value
    if "tok.weight" in out:
        out["head.weight"] = out["tok.weight"]
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
    """The folder's config.json, when it is a GPT-2 one; refuses options our GPT computes
    differently (one line naming the option)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable config.json ({e})") from None
    if config.get("model_type") != "gpt2":
        return config
    for key, ours in _UNSUPPORTED.items():
        if key in config and config[key] != ours:
            raise UsageError(
                f"{path}: {key}={config[key]!r}, but trainer's GPT computes with {ours!r}: "
                "this GPT-2 cannot be converted exactly"
            )
    return config


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
