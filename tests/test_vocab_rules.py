"""Vocabulary rules that know the model: TRAINING_PATCHES_BASE_VOCAB on any model with a
text embedding and head (IndexTTS UnifiedVoice's +1 slot included), a freeze that follows
modules swapped after it, and explicit row layouts."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import TinyTextModel
from torch import nn

import patches
from patches import vocab_freeze
from patches.integrations.layouts import INDEXTTS_SLOT, XTTS_START_LAST
from patches.vocab_rows import PLAIN, frozen_rows, owner_paths, row_layout


BASE, NEW = 40, 8


class UnifiedVoiceLike(TinyTextModel):
    """The IndexTTS shape: text embedding and head of ``number_text_tokens + 1`` rows."""

    def __init__(self, tokens: int, dim: int = 16) -> None:
        super().__init__(tokens + 1, dim, "tanh")
        self.number_text_tokens = tokens
        self.start_text_token, self.stop_text_token = 0, 1


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
    # where the owner of the text embedding is looked for, in order (the first found wins)
    assert owner_paths() == ("", "gpt", "xtts.gpt", "model", "model.gpt")


def test_base_vocab_alone_freezes_a_plain_unifiedvoice_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    patches.advanced.apply(base_vocab=BASE)
    model = UnifiedVoiceLike(BASE + NEW)
    before = model.text_embedding.weight.detach().clone()
    head_before = model.text_head.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="training_patches"):
        _train(model)
    slot = BASE + NEW  # the layout's extra row is named as such in the freeze block
    assert (f"Base tokens: 0-{BASE - 1}, {slot} (row {slot} is the model's extra slot, no "
            f"token; kept last) (frozen)") in caplog.text
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
    patches.advanced.freeze_base_vocab(model, BASE)
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


def _train_ids(model: nn.Module, opt: torch.optim.Optimizer, tokens: int, steps: int) -> None:
    for _ in range(steps):
        ids = torch.randint(0, tokens, (4, 12))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("base_known", [True, False])
def test_resume_after_growth_freezes_the_base_not_the_trained_new_rows(
        tmp_path, monkeypatch: pytest.MonkeyPatch, base_known: bool) -> None:
    """IndexTTS shape: 40 base tokens, a checkpoint already trained on 48 (8 Amharic rows),
    resumed into a tokenizer of 56. The 8 trained Amharic rows must keep training."""
    if base_known:
        monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", str(BASE))
    patches.advanced.apply()
    torch.manual_seed(0)
    trained = UnifiedVoiceLike(BASE + NEW)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2, weight_decay=0.01)
    _train_ids(trained, opt, BASE + NEW, 4)
    path = patches.CheckpointManager(tmp_path / "run").save(4, trained, opt)
    for handle in vocab_freeze.live_freezes():
        handle.remove()
    grown = UnifiedVoiceLike(BASE + 2 * NEW)
    grown_opt = torch.optim.AdamW(grown.parameters(), lr=1e-2, weight_decay=0.01)
    report = patches.load_checkpoint(path, grown, grown_opt, policy="remap", restore_rng=False)
    assert report.freeze is not None
    before = grown.text_embedding.weight.detach().clone()
    _train_ids(grown, grown_opt, BASE + 2 * NEW, 4)
    after = grown.text_embedding.weight.detach()
    moved = (after - before).abs().amax(dim=1)
    assert moved[:BASE].max().item() == 0.0  # the base tokens: bit-identical
    assert moved[-1].item() == 0.0  # the +1 slot, kept last
    amharic_trained = moved[BASE:BASE + NEW]
    if base_known:
        assert (amharic_trained > 0).all()  # the rows trained before the growth train on
    else:
        assert (amharic_trained == 0).all()  # unknown base: every old row frozen (logged)
    assert (moved[BASE + NEW:BASE + 2 * NEW] > 0).all()


def test_a_shrink_is_explained_in_tokens_and_truncated_only_on_request(tmp_path) -> None:
    """IndexTTS shape: a checkpoint of 48 tokens (49 rows) into a tokenizer of 44 tokens."""
    patches.advanced.apply()
    torch.manual_seed(0)
    trained = UnifiedVoiceLike(BASE + NEW)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    _train_ids(trained, opt, BASE + NEW, 2)
    path = patches.CheckpointManager(tmp_path / "run").save(2, trained, opt)
    small = UnifiedVoiceLike(BASE + 4)
    small_opt = torch.optim.AdamW(small.parameters(), lr=1e-2)
    before = small.text_embedding.weight.detach().clone()
    with pytest.raises(patches.CheckpointMismatchError) as refused:
        patches.load_checkpoint(path, small, small_opt, restore_rng=False)
    message = str(refused.value)
    assert "tokenizer has 44 tokens" in message and "trained with 48: 4 token(s) fewer" in message
    assert "ids 44..47" in message and "truncate=True" in message
    assert torch.equal(small.text_embedding.weight, before) and not small_opt.state

    report = patches.load_checkpoint(path, small, small_opt, restore_rng=False, truncate=True)
    old = trained.text_embedding.weight
    new = small.text_embedding.weight
    assert torch.equal(new[:BASE + 4], old[:BASE + 4])  # tokens 0..43 kept in place
    assert torch.equal(new[-1], old[-1])  # the +1 slot stays last
    assert torch.equal(small.text_head.bias, torch.cat([trained.text_head.bias[:BASE + 4],
                                                        trained.text_head.bias[-1:]]))
    moment = small_opt.state[small.text_embedding.weight]["exp_avg_sq"]
    saved = opt.state[trained.text_embedding.weight]["exp_avg_sq"]
    assert torch.equal(moment, torch.cat([saved[:BASE + 4], saved[-1:]]))
    assert report.freeze is None and "truncated on request" in report.summary()
    _train_ids(small, small_opt, BASE + 4, 1)  # and it trains on
    assert torch.isfinite(small.text_embedding.weight).all()


@pytest.mark.parametrize("old_start", [9, 3, None])
def test_a_coqui_config_says_whether_the_old_start_row_was_last(tmp_path, old_start) -> None:
    """XTTS shape ([START] the new last id): the old last row moves to the new end unless the
    checkpoint's coqui config records the OLD [START] elsewhere (gpt_start_text_token)."""
    torch.manual_seed(0)
    old = TinyTextModel(10, 16, "tanh")
    ckpt: dict = {"model": old.state_dict()}
    if old_start is not None:
        ckpt["config"] = {"model_args": {"gpt_start_text_token": old_start,
                                         "gpt_number_text_tokens": 10}}
    torch.save(ckpt, tmp_path / "model.pth")
    grown = TinyTextModel(14, 16, "tanh")
    grown.start_text_token = 13
    patches.load_checkpoint(tmp_path / "model.pth", grown, freeze=False, restore_rng=False)
    before, after = old.text_embedding.weight, grown.text_embedding.weight
    if old_start == 3:  # [START] was not last: no row moves
        assert torch.equal(after[:10], before)
    else:  # the config confirms it (9 = last of 10), or says nothing: the last row moves
        assert torch.equal(after[:9], before[:9]) and torch.equal(after[13], before[9])
