"""The tiny GPT of the many-process tests: a text embedding and a text head of ``VOCAB``
rows around one residual MLP block, the row layout the vocabulary rules care about."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 80
BASE = 64  # base-vocabulary rows (frozen under TRAINING_PATCHES_BASE_VOCAB)
DIM = 32


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.text_head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.text_embedding(tokens)
        return self.text_head(hidden + self.block(hidden))


def batch(generator: torch.Generator, size: int = 8, length: int = 12,
          vocab: int = VOCAB) -> torch.Tensor:
    """Token ids that use every part of the vocabulary (base and new rows)."""
    return torch.randint(0, vocab, (size, length), generator=generator)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))
