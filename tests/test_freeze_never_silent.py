"""A freeze asked for and not done is never silent (TRAINING_PATCHES_BASE_VOCAB on a model
whose vocabulary layout the freeze does not know): a WARNING naming the model's embeddings
and how to name them, an error under STRICT, and ``status()`` that says ``waiting``, then
what was frozen or that nothing was."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import TinyTextModel
from torch import nn

import patches
from patches.vocab_freeze import VocabFreezeError, live_freezes


BASE, VOCAB, DIM = 8, 12, 4



class Gpt2Like(nn.Module):
    """The HF layout: ``wte`` and ``lm_head``, no ``text_embedding``/``text_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.body(self.wte(ids))))


def _train(model: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ids = torch.arange(VOCAB).repeat(2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), ids.roll(1)).backward()
        opt.step()


def test_unknown_layout_warns_names_its_embeddings_and_status_says_not_applied(
        caplog: pytest.LogCaptureFixture) -> None:
    patches.advanced.apply(["vocab_freeze"], base_vocab=BASE)
    model = Gpt2Like()
    before = model.wte.weight.detach().clone()
    status = patches.status("vocab_freeze")
    assert status["state"] == "waiting" and f"BASE_VOCAB={BASE}" in status["detail"]
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        _train(model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once, not at every step
    assert "NOTHING IS FROZEN" in warnings[0]
    assert f"wte ({VOCAB} x {DIM})" in warnings[0]
    assert f"lm_head (Linear {DIM} -> {VOCAB})" in warnings[0]
    assert f"freeze_base_vocab(model, {BASE}, modules=['wte', 'lm_head'])" in warnings[0]
    # what the warning says is true: the base rows moved
    assert (model.wte.weight[:BASE] - before[:BASE]).abs().max().item() > 0
    status = patches.status("vocab_freeze")
    assert status["state"] == "degraded"
    assert any(p.startswith("not applied: ") and "NOTHING IS FROZEN" in p
               for p in status["problems"])

    # the advice works: named, the base rows stay bit-identical and status says so
    model = Gpt2Like()
    handle = patches.advanced.freeze_base_vocab(model, BASE, modules=["wte", "lm_head"])
    try:
        before = model.wte.weight.detach().clone()
        _train(model)
        assert torch.equal(model.wte.weight[:BASE], before[:BASE])
        status = patches.status("vocab_freeze")
        assert status["state"] == "applied"
        assert status["detail"] == f"frozen {BASE} rows of {VOCAB} in wte.weight, lm_head.weight"
    finally:
        handle.remove()


def test_unknown_layout_is_an_error_under_strict() -> None:
    patches.advanced.apply(["vocab_freeze"], base_vocab=BASE, strict=True)
    model = Gpt2Like()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(VocabFreezeError, match="NOTHING IS FROZEN.*STRICT"):
        _train(model, steps=1)
    # the step never ran
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_known_layout_status_says_what_was_frozen_and_nothing_is_warned(
        caplog: pytest.LogCaptureFixture) -> None:
    patches.advanced.apply(["vocab_freeze"], base_vocab=BASE)
    model = TinyTextModel(VOCAB, DIM, "tanh")
    before = model.text_embedding.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.arange(VOCAB)[None]).float().pow(2).mean().backward()
            opt.step()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert torch.equal(model.text_embedding.weight[:BASE], before[:BASE])
    status = patches.status("vocab_freeze")
    for handle in live_freezes():
        handle.remove()
    assert status["state"] == "applied", status
    assert status["detail"].startswith(f"frozen {BASE} rows of {VOCAB} in ")
