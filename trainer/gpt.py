"""A decoder-only transformer language model in the GPT-2 shape, over byte tokens.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual),
learned position embeddings, the output head tied to the token embedding, and attention through
`scaled_dot_product_attention` (flash or memory-efficient kernels on GPUs). Initialised as GPT-2:
normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 * layers).

`model.name=gpt` with model.gpt.{layers, width, heads}; the vocabulary (256 bytes) and the
sequence length come from the dataset (data.name=text).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import UsageError


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(x)
        # This rank's width and heads: all of them, or 1/tp under tensor parallelism (its heads).
        width = qkv.shape[-1] // 3
        heads = self.heads * width // c
        q, k, v = qkv.split(width, dim=2)
        # (B, T, width) -> (B, heads, T, C / self.heads)
        q, k, v = (z.view(b, t, heads, width // heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class Block(nn.Module):
    """One transformer layer: the unit FSDP shards and activation checkpointing recomputes."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, seq_len: int, layers: int, width: int, heads: int, dropout: float = 0.0
    ):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # the residual branches' outputs (GPT-2)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def shard_units(self) -> list[nn.Module]:
        """The blocks: what FSDP shards one by one and activation checkpointing recomputes."""
        return list(_layers(self.blocks))

    def tensor_parallel_plan(self, tp: int) -> dict:
        """Megatron's layout for dist.mesh=tp=N (trainer/parallel/tensor.py): in each block the
        fused q,k,v projection and the MLP's first layer split by output columns (each rank holds
        heads / tp whole heads and 4 x width / tp hidden units), the two output projections by
        input rows, whose partial sums one all-reduce adds. Embeddings, head, LayerNorms and the
        row-parallel layers' biases stay replicated."""
        from trainer.parallel.styles import check_heads, fused_colwise, styles

        heads = next(iter(_layers(self.blocks))).attn.heads
        check_heads(heads, tp, f"{type(self).__name__}'s attention")
        colwise, rowwise = styles()
        return {
            "blocks.*.attn.qkv": fused_colwise(3),
            "blocks.*.attn.proj": rowwise(),
            "blocks.*.fc": colwise(),
            "blocks.*.proj": rowwise(),
        }

    def pipeline_layers(self) -> str:
        """The container of the layers that pipeline stages split (dist.mesh=pp=N): each stage
        keeps a run of blocks, the first also the embeddings, the last ln_f and the head. A
        stage's forward skips what it does not hold (None), so one forward serves them all."""
        return "blocks"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) byte tokens -> (B, T, vocab) next-token logits (a pipeline stage: its part)."""
        x = idx
        if self.tok is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.tok(idx) + self.pos(pos))  # (B, T, C)
        for block in _layers(self.blocks):
            x = block(x)
        return x if self.head is None else self.head(self.ln_f(x))


def _layers(container: nn.Module):
    """The blocks in order: a ModuleList's, or a pipeline stage's ModuleDict (original indices)."""
    return container.values() if isinstance(container, nn.ModuleDict) else container


def gpt(
    in_shape: tuple[int, ...],
    num_classes: int,
    layers: int = 4,
    width: int = 128,
    heads: int = 4,
    dropout: float = 0.0,
) -> GPT:
    """model.name=gpt: in_shape is (sequence length,), num_classes the vocabulary (256 bytes)."""
    if len(in_shape) != 1:
        raise UsageError(
            f"model.name=gpt reads token sequences, but the dataset's samples have shape "
            f"{tuple(in_shape)}: use data.name=text"
        )
    if width % heads:
        raise UsageError(
            f"model.gpt.width={width} does not split over model.gpt.heads={heads}: use a width "
            f"that is a multiple of the heads (e.g. {heads * max(1, round(width / heads))})"
        )
    return GPT(num_classes, in_shape[0], layers, width, heads, dropout)
