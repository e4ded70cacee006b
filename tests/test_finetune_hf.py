"""Hugging Face hand-off: a GPT-2 folder made here with `transformers` (small config, random
weights, sharded with an index: nothing downloaded) fine-tunes in our trainer, and goes back to
`transformers` through `trainer export --format hf-gpt2` with logits matching ours."""

from __future__ import annotations

import json

import pytest
import torch

from tests import helpers
from trainer import config
from trainer.checkpoint.init import load_init
from trainer.checkpoint.weights import read_weights
from trainer.cli import main
from trainer.errors import UsageError
from trainer.gpt import gpt

transformers = pytest.importorskip("transformers")

SEQ, WIDTH, LAYERS, HEADS = 32, 32, 2, 2
GPT = [
    "model.name=gpt", "data.name=text", f"model.gpt.layers={LAYERS}", f"model.gpt.width={WIDTH}",
    f"model.gpt.heads={HEADS}", f"data.text.seq_len={SEQ}", "data.text.max_train_bytes=4000",
    "data.text.max_test_bytes=1000", "data.global_batch_size=8", "train.max_steps=3",
    "log.progress=none", "log.tensorboard=false", "optim.lr=0.003",
]  # fmt: skip
TOLERANCE = 1e-4  # max |logit difference|, fp32 on CPU (measured: about 2e-6)


def _hf_gpt2(folder, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder, max_shard_size="40KB")  # shards and model.safetensors.index.json
    return model


def _ids():
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_a_gpt2_folder_converts_to_our_gpt_with_the_same_logits(tmp_path):
    theirs = _hf_gpt2(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = gpt((SEQ,), 256, layers=LAYERS, width=WIDTH, heads=HEADS).eval()
    ckpt = config.load(None, [f"ckpt.init_weights={tmp_path / 'hf'}"]).ckpt
    report = load_init(ours, ckpt)
    assert report.converted and not report.missing and not report.unexpected
    with torch.no_grad():
        diff = (ours(_ids()) - theirs(_ids()).logits).abs().max().item()
    assert diff < TOLERANCE
    plain = config.load(None, [f"ckpt.init_weights={tmp_path / 'hf'}", "ckpt.init_convert=none"])
    with pytest.raises(UsageError, match="no tensor matches the model"):
        load_init(gpt((SEQ,), 256, layers=LAYERS, width=WIDTH, heads=HEADS), plain.ckpt)


def test_a_gpt2_folder_fine_tunes_and_exports_back_to_transformers(tmp_path):
    _hf_gpt2(tmp_path / "hf")
    run = tmp_path / "run"
    helpers.train_here("train", *GPT, f"run_dir={run}", f"ckpt.init_weights={tmp_path / 'hf'}")
    assert main(["export", str(run), "-o", str(tmp_path / "back"), "--format", "hf-gpt2"]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["n_head"] == HEADS
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    ours = gpt((SEQ,), 256, layers=LAYERS, width=WIDTH, heads=HEADS).eval()
    ours.load_state_dict(read_weights(str(run)))
    with torch.no_grad():
        diff = (ours(_ids()) - theirs(_ids()).logits).abs().max().item()
        start = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
        moved = (start(_ids()).logits - theirs(_ids()).logits).abs().max().item()
    assert diff < TOLERANCE and moved > 100 * TOLERANCE  # it trained, and it went back exactly


def test_trainer_eval_of_a_gpt2_folder_evaluates_the_converted_starting_weights(tmp_path, capsys):
    """Checking an import before training (issue 56 item 9): `trainer eval HF_FOLDER` with the
    GPT's settings converts the folder as ckpt.init_weights would, and its metrics are those of
    the same weights converted by hand and saved under our names."""
    from safetensors.torch import save_file

    from trainer import hf

    model = _hf_gpt2(tmp_path / "hf")
    ours = hf.from_gpt2({k: v.contiguous() for k, v in model.state_dict().items()})
    save_file({k: v.clone() for k, v in ours.items()}, tmp_path / "ours.safetensors")
    results = []
    for src in (tmp_path / "hf", tmp_path / "ours.safetensors"):
        capsys.readouterr()
        assert main(["eval", str(src), *GPT]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert results[0] == results[1] and results[0]["count"] > 0
