"""Vocabulary rules that know the model: TRAINING_PATCHES_BASE_VOCAB on any model with a
text embedding and head (IndexTTS UnifiedVoice's +1 slot included), a freeze that follows
modules swapped after it, and explicit row layouts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import patches
from patches import vocab_freeze
from patches.vocab_freeze import INDEXTTS_SLOT, PLAIN, XTTS_START_LAST, frozen_rows, row_layout

pytestmark = pytest.mark.usefixtures("clean_patches")

BASE, NEW = 40, 8


class UnifiedVoiceLike(nn.Module):
    """The IndexTTS shape: text embedding and head of ``number_text_tokens + 1`` rows."""

    def __init__(self, tokens: int, dim: int = 16) -> None:
        super().__init__()
        self.number_text_tokens = tokens
        self.start_text_token, self.stop_text_token = 0, 1
        self.text_embedding = nn.Embedding(tokens + 1, dim)
        self.body = nn.Linear(dim, dim)
        self.text_head = nn.Linear(dim, tokens + 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_head(torch.tanh(self.body(self.text_embedding(ids))))


def _train(model: nn.Module, steps: int = 6, seed: int = 0) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    rows = model.text_embedding.num_embeddings
    for _ in range(steps):
        ids = torch.randint(0, rows - 1, (4, 12))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_layouts_are_explicit() -> None:
    uv = UnifiedVoiceLike(BASE + NEW)
    assert row_layout(uv, BASE + NEW + 1) is INDEXTTS_SLOT
    assert INDEXTTS_SLOT.base_rows(BASE) == BASE + 1
    xtts_like = nn.Module()
    xtts_like.start_text_token = 81
    assert row_layout(xtts_like, 82) is XTTS_START_LAST
    xtts_like.start_text_token = 40  # [START] elsewhere: no row moves
    assert row_layout(xtts_like, 82) is PLAIN
    assert frozen_rows(82, 74, start_row_last=True) == (range(0, 73), range(81, 82))
    assert frozen_rows(49, 41, start_row_last=True) == (range(0, 40), range(48, 49))


def test_base_vocab_alone_freezes_a_plain_unifiedvoice_loop() -> None:
    patches.apply(base_vocab=BASE)
    model = UnifiedVoiceLike(BASE + NEW)
    before = model.text_embedding.weight.detach().clone()
    head_before = model.text_head.weight.detach().clone()
    _train(model)
    after = model.text_embedding.weight.detach()
    assert (after[:BASE] - before[:BASE]).abs().max().item() == 0.0
    assert (model.text_head.weight.detach()[:BASE] - head_before[:BASE]).abs().max().item() == 0.0
    assert torch.equal(after[-1], before[-1])  # the +1 slot is kept
    assert (after[BASE:BASE + NEW] - before[BASE:BASE + NEW]).abs().max().item() > 0
    # without the patch the same loop moves the base rows (the test can fail)
    patches.revert()
    model2 = UnifiedVoiceLike(BASE + NEW)
    before2 = model2.text_embedding.weight.detach().clone()
    _train(model2)
    assert (model2.text_embedding.weight.detach()[:BASE] - before2[:BASE]).abs().max() > 0


def test_the_freeze_follows_modules_swapped_after_it() -> None:
    model = UnifiedVoiceLike(BASE)  # built with the base vocabulary ...
    patches.freeze_base_vocab(model, BASE)
    # ... then the trainer swaps in extended modules holding the base rows it loaded
    old_emb, old_head = model.text_embedding, model.text_head
    emb = nn.Embedding(BASE + NEW + 1, 16)
    head = nn.Linear(16, BASE + NEW + 1)
    with torch.no_grad():
        emb.weight[:BASE] = old_emb.weight[:BASE]
        head.weight[:BASE] = old_head.weight[:BASE]
        head.bias[:BASE] = old_head.bias[:BASE]
    model.text_embedding, model.text_head = emb, head
    model.number_text_tokens = BASE + NEW
    before = emb.weight.detach().clone()
    _train(model)
    after = model.text_embedding.weight.detach()
    assert (after[:BASE] - before[:BASE]).abs().max().item() == 0.0
    assert (after[BASE:BASE + NEW] - before[BASE:BASE + NEW]).abs().max().item() > 0
    assert vocab_freeze.freeze_of(model.text_embedding.weight) is not None
