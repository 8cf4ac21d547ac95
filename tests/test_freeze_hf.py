"""The freeze on a Hugging Face model grown with ``resize_token_embeddings`` (the LLM-based
TTS models fine-tune this way): found through ``get_input_embeddings()`` /
``get_output_embeddings()``, a tied head frozen and counted once, base rows bit-identical."""

from __future__ import annotations

import logging

import pytest
import torch

import patches
from patches.vocab_freeze import live_freezes

transformers = pytest.importorskip("transformers")


BASE, GROWN = 64, 80


def _gpt2() -> torch.nn.Module:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=BASE,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.resize_token_embeddings(GROWN)
    return model



def _train(model: torch.nn.Module, steps: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(GROWN).reshape(4, 20)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def test_base_vocab_freezes_a_grown_hf_model_through_its_embeddings(
        caplog: pytest.LogCaptureFixture) -> None:
    patches.advanced.apply(["vocab_freeze"], base_vocab=BASE)
    model = _gpt2()
    wte = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is wte  # tied
    before = wte.detach().clone()
    try:
        with caplog.at_level(logging.INFO, logger="training_patches"):
            _train(model)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert torch.equal(wte[:BASE], before[:BASE])  # bit-identical
        assert (wte[BASE:] - before[BASE:]).abs().max().item() > 0  # the new rows learn
        status = patches.status("vocab_freeze")
        assert status["state"] == "applied"
        assert status["detail"] == f"frozen {BASE} rows of {GROWN} in transformer.wte.weight"
        # the share is the one tied tensor's, counted once
        total = sum(p.numel() for p in model.parameters())
        share = f"{100 * BASE * 16 / total:.1f}%"
        line = next(r.getMessage() for r in caplog.records if "Freezing" in r.getMessage())
        assert f"{BASE * 16:,} parameters, {share} of the model's {total:,}" in line, line
    finally:
        for handle in live_freezes():
            handle.remove()


def test_explicit_tied_modules_are_one_tensor() -> None:
    model = _gpt2()
    handle = patches.advanced.freeze_base_vocab(model, BASE, modules=["transformer.wte", "lm_head"])
    try:
        assert handle.paths == ["transformer.wte.weight"]
        assert handle.frozen_numel() == BASE * 16
    finally:
        handle.remove()


def test_load_checkpoint_grows_a_hf_models_vocabulary_through_its_embeddings(
        tmp_path) -> None:
    """Issue 28: the vocabulary-aware loader finds a Hugging Face model's rows where the
    freeze does (get_input/output_embeddings()): a checkpoint of the 64-token model loads
    into the model grown to 80 (``resize_token_embeddings``), every trained row kept, the
    tied head given the embedding's rows (one tensor), the new rows by the rule, the base
    rows frozen. Before, the grown wte was refused as a shape mismatch."""
    from patches.checkpoint import CheckpointManager, load_checkpoint

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=BASE,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    small = transformers.GPT2LMHeadModel(config)
    ids = torch.arange(BASE).reshape(4, 16)
    opt = torch.optim.AdamW(small.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        small(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    path = CheckpointManager(tmp_path / "run").save(3, small, opt)
    trained = small.get_input_embeddings().weight.detach().clone()
    grown = _gpt2()  # 80 tokens, tied
    grown_opt = torch.optim.AdamW(grown.parameters(), lr=1e-2)
    # the embedding's rule (mean) and the head's (spread) differ: the tied tensor must get
    # the embedding's
    report = load_checkpoint(path, grown, grown_opt, row_init="mean", head_row_init="spread")
    wte = grown.get_input_embeddings().weight
    assert wte.shape[0] == GROWN and grown.get_output_embeddings().weight is wte
    assert torch.equal(wte[:BASE], trained)
    assert torch.isfinite(wte[BASE:]).all()
    spread = trained.std(0, unbiased=False)
    assert ((wte[BASE:] - trained.mean(0)).abs() / spread).max() < 1e-3  # the mean rule
    assert report.parts["model"].status == "remapped"
    assert report.parts["optimizer"].status == "remapped"
    assert report.freeze is not None and report.freeze.base_vocab_size == BASE
    _train(grown)
    assert torch.equal(wte[:BASE], trained)  # frozen through training
