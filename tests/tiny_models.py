"""The tiny text model of the unit tests: the row layout the vocabulary rules and the
checkpoint loader care about (``text_embedding`` and ``text_head`` of ``vocab`` rows)
around at most one hidden layer. Importable as ``tiny_models`` (tests/ is on pythonpath).

:class:`TinyGPT` is the same layout with an ``nn.Sequential`` body (Linear, GELU, Dropout:
optimizer state addressed by index, dropout for the RNG tests). The many-process tests have
their own (tests/distributed/tiny_gpt.py, a residual block that its rank scripts import).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "tanh": torch.tanh,
}


class TinyTextModel(nn.Module):
    """``text_head(act(body(text_embedding(tokens))))``; with ``hidden=False`` no ``body``:
    ``text_head(text_embedding(tokens))``. The parameters are made in that order, so a
    seeded model is the same as the hand-written copies it replaces."""

    def __init__(self, vocab: int = 20, dim: int = 16, activation: str = "relu",
                 hidden: bool = True) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(vocab, dim)
        if hidden:
            self.body = nn.Linear(dim, dim)
        self.text_head = nn.Linear(dim, vocab)
        self._activation = ACTIVATIONS[activation]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.text_embedding(tokens)
        if hasattr(self, "body"):
            hidden = self._activation(self.body(hidden))
        return self.text_head(hidden)


class TinyGPT(nn.Module):
    """IndexTTS-style names at the top level: ``text_head(body(text_embedding(tokens)))``
    with ``body = Sequential(Linear, GELU, Dropout(dropout))``."""

    def __init__(self, vocab: int, hidden: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(vocab, hidden)
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout))
        self.text_head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.text_head(self.body(self.text_embedding(tokens)))
