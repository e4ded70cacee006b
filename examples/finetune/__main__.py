"""`python -m examples.finetune [OUT]` (make finetune): LeNet pre-trained on digits 0-4, then
fine-tuned on digits 5-9 with a new head, four ways: frozen backbone, full, LoRA (PEFT) and
from scratch. Prints the table (test accuracy, time to a target accuracy, trainable parameters,
final checkpoint size) and draws OUT/finetune.png. One CPU process per run, ~1 minute in all."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from safetensors.torch import load_file

from trainer import config
from trainer.params import matches, patterns
from trainer.train import train

BASE = [
    "data.name=examples.finetune.data:digits_classes",
    "model.name=lenet",
    "model.activation=relu",
    "data.global_batch_size=32",
    "optim.name=adamw",
    "optim.weight_decay=0.01",
    "optim.decay=no_bias_norm",
    "sched.name=none",
    "train.eval_every_epochs=1",
    "ckpt.every_epochs=0",
    "log.progress=none",
    "log.tensorboard=false",
    "dist.device=cpu",
]
BACKBONE = ["0.*", "3.*", "7.*", "9.*"]  # lenet's convolutions and hidden layers; 11.* is the head
EPOCHS = 10  # pre-training on digits 0-4 (all 721 training images)
FT_EPOCHS = 10  # fine-tuning on digits 5-9 (all 717 training images, or PER_CLASS of each)
PER_CLASS = 0  # 0: all; e.g. 20 for a few-label run
TARGET = 0.95


def variants(pretrained: str) -> dict[str, list[str]]:
    init = [f"ckpt.init_weights={pretrained}", "ckpt.init_exclude=11.*"]  # a new head
    return {
        "frozen backbone": [*init, f"optim.freeze={','.join(BACKBONE)}", "optim.lr=0.05"],
        "full": [*init, "optim.lr=0.003", "optim.groups.head={params: ['11.*'], lr_mult: 10}"],
        "LoRA r=4": [
            *init, "optim.lora_targets=0,3,7,9", "optim.lora_also_train=11.*",
            "optim.lora_rank=4", "optim.lora_alpha=8", "optim.lr=0.01",
        ],
        "scratch": ["optim.lr=0.003"],
    }  # fmt: skip


def run(out: str, name: str, args: list[str]) -> dict:
    run_dir = os.path.join(out, name.split()[0].lower())
    cfg = config.load(None, [*BASE, *args, f"run_dir={run_dir}", f"name={name.split()[0].lower()}"])
    started = time.perf_counter()
    summary = train(cfg)
    wall = time.perf_counter() - started
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    t0 = min(r["time"] for r in records)
    evals = [
        (r["epoch"], r["time"] - t0, r["eval.accuracy"]) for r in records if r["kind"] == "eval"
    ]
    hit = next(((e, t) for e, t, a in evals if a >= TARGET), (None, None))
    weights = load_file(os.path.join(run_dir, "final", "model.safetensors"))
    frozen = patterns(cfg.optim.freeze)  # (LoRA's final weights hold only what trained)
    trainable = sum(v.numel() for k, v in weights.items() if not matches(k, frozen))
    return {
        "name": name,
        "accuracy": evals[-1][2],
        "epoch_to_target": hit[0],
        "s_to_target": hit[1],
        "wall_s": wall,
        "train_time_s": summary["train_time_s"],
        "trainable": trainable,
        "ckpt_bytes": os.path.getsize(os.path.join(run_dir, "final", "model.safetensors")),
        "curve": evals,
    }


def main(out: str = "runs/finetune") -> list[dict]:
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)  # as each rank of a launched run: tiny convolutions, no contention
    pre = [*BASE, "data.kwargs.classes=[0,1,2,3,4]", "optim.lr=0.003", f"train.epochs={EPOCHS}"]
    pre_dir = os.path.join(out, "pretrain")
    summary = train(config.load(None, [*pre, f"run_dir={pre_dir}", "name=pretrain"]))
    print(f"pre-trained on digits 0-4: test accuracy {summary['eval']['accuracy']:.3f}")
    rows = []
    for name, args in variants(pre_dir).items():
        few = ["data.kwargs.classes=[5,6,7,8,9]", f"data.kwargs.per_class={PER_CLASS}"]
        rows.append(run(out, name, [*args, *few, f"train.epochs={FT_EPOCHS}"]))
    print(table(rows))
    with open(os.path.join(out, "finetune.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, "finetune.png"))
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"| digits 5-9 ({PER_CLASS or 'all'} images per class), new head | test accuracy "
        f"({FT_EPOCHS} epochs) "
        f"| epochs to {TARGET} | seconds to {TARGET} | trained parameters | checkpoint bytes |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = r["epoch_to_target"]
        seconds = f"{r['s_to_target']:.2f}" if hit else "-"
        lines.append(
            f"| {r['name']} | {r['accuracy']:.3f} | {hit if hit else 'not reached'} | "
            f"{seconds} | {r['trainable']:,} | {r['ckpt_bytes']:,} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        epochs = [e for e, _, _ in r["curve"]]
        ax.plot(epochs, [a for _, _, a in r["curve"]], marker="o", ms=3, label=r["name"])
    ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="epoch", ylabel="test accuracy (digits 5-9)", ylim=(0.5, 1.0))
    ax.set_title("LeNet pre-trained on digits 0-4, fine-tuned on 5-9")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
