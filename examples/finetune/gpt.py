"""`python -m examples.finetune.gpt [OUT]` (make finetune): the byte-level GPT pre-trained on the
standard library's Python sources, then fine-tuned on a second corpus: pydoc's topics (English
prose about Python, in the same standard library: nothing downloaded): full, LoRA, from scratch,
and the pre-trained model as it is. Prints the table (test bits per byte) and draws
OUT/finetune-gpt.png."""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

from trainer import config
from trainer.run import evaluate_saved
from trainer.train import train

SHAPE = ["model.name=gpt", "data.name=text", "model.gpt.layers=2", "model.gpt.width=64"]
SHAPE += ["model.gpt.heads=4", "data.text.seq_len=64"]
BASE = [
    *SHAPE, "data.global_batch_size=32", "optim.name=adamw", "optim.decay=no_bias_norm",
    "optim.weight_decay=0.1", "sched.name=none", "ckpt.every_epochs=0", "log.progress=none",
    "log.tensorboard=false", "dist.device=cpu", "train.epochs=1000",
]  # fmt: skip
TOPICS = os.path.join(os.path.dirname(os.__file__), "pydoc_data", "topics.py")
SECOND = [f"data.text.path={TOPICS}", "data.text.max_train_bytes=200000"]
SECOND += ["data.text.max_test_bytes=20000", "train.max_steps=200", "train.eval_every_steps=20"]
PRE = ["data.text.max_train_bytes=1000000", "data.text.max_test_bytes=20000"]
PRE += ["train.max_steps=600", "train.eval_every_steps=600", "optim.lr=0.003"]


def variants(pretrained: str) -> dict[str, list[str]]:
    init = [f"ckpt.init_weights={pretrained}"]
    return {
        "full": [*init, "optim.lr=0.001"],
        "LoRA r=8": [*init, "optim.lora_targets=blocks.*.attn.qkv,blocks.*.fc", "optim.lr=0.003"],
        "scratch": ["optim.lr=0.003"],
    }


def main(out: str = "runs/finetune") -> list[dict]:
    torch.set_num_threads(1)
    pre_dir = os.path.join(out, "gpt-pretrain")
    summary = train(config.load(None, [*BASE, *PRE, f"run_dir={pre_dir}", "name=gpt-pretrain"]))
    print(f"pre-trained on the stdlib: test {summary['eval']['bits_per_byte']:.3f} bits/byte")
    as_is = evaluate_saved(config.load(None, [*BASE, *SECOND]), pre_dir)
    rows = [{"name": "pre-trained, not fine-tuned", "bits": as_is["bits_per_byte"], "curve": []}]
    for name, args in variants(pre_dir).items():
        tag = "gpt-" + name.split()[0].lower()
        run_dir = os.path.join(out, tag)
        train(config.load(None, [*BASE, *SECOND, *args, f"run_dir={run_dir}", f"name={tag}"]))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        curve = [(r["step"], r["eval.bits_per_byte"]) for r in records if r["kind"] == "eval"]
        weights = load_file(os.path.join(run_dir, "final", "model.safetensors"))
        rows.append({
            "name": name, "bits": curve[-1][1], "curve": curve,
            "ckpt_bytes": os.path.getsize(os.path.join(run_dir, "final", "model.safetensors")),
            "saved_params": sum(v.numel() for v in weights.values()),
        })  # fmt: skip
    print(table(rows))
    with open(os.path.join(out, "finetune-gpt.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, "finetune-gpt.png"))
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| pydoc topics (200 steps of 32 x 64 bytes) | test bits/byte | final/ bytes |",
        "|---|---|---|",
    ]
    for r in rows:
        size = f"{r['ckpt_bytes']:,}" if "ckpt_bytes" in r else "-"
        lines.append(f"| {r['name']} | {r['bits']:.3f} | {size} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["curve"]:
            ax.plot(*zip(*r["curve"], strict=True), marker="o", ms=3, label=r["name"])
        else:
            ax.axhline(r["bits"], color="grey", lw=0.8, ls="--", label=r["name"])
    ax.set(xlabel="optimizer step", ylabel="test bits per byte (pydoc topics)")
    ax.set_title("Byte GPT pre-trained on stdlib code, fine-tuned on prose")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
