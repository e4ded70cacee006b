"""The model plug-in: a factory the trainer calls with the arguments it names (`data`: the
DataSpec; `dim` from model.kwargs). The model takes two inputs, a user and an item."""

import torch
from torch import nn


class TwoTower(nn.Module):
    """A user tower and an item tower (embeddings), their dot product plus biases and a small
    MLP over both: a predicted star rating per (user, item) pair."""

    def __init__(self, users: int, items: int, dim: int = 32):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.user_bias, self.item_bias = nn.Embedding(users, 1), nn.Embedding(items, 1)
        self.mix = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, 1))
        for e in (self.user, self.item):
            nn.init.normal_(e.weight, std=0.1)
        for b in (self.user_bias, self.item_bias):
            nn.init.zeros_(b.weight)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        u, i = self.user(user), self.item(item)  # (B, dim) each
        dot = (u * i).sum(dim=1, keepdim=True)
        out = (
            3.0 + dot + self.user_bias(user) + self.item_bias(item) + self.mix(torch.cat([u, i], 1))
        )
        return out.squeeze(1)  # (B,)


def build(data, dim: int = 32) -> nn.Module:
    """model.name=ratings.model:build."""
    return TwoTower(data.source["users"], data.source["items"], dim)
