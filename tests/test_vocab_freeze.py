"""Exact freezing of the base vocabulary (issue 4).

Plain PyTorch loops with an IndexTTS-like module, then the real coqui Trainer with a
tiny XTTS GPTTrainer whose vocabulary grew 74 -> 82. "Frozen" means bit-identical:
the maximum absolute difference is exactly 0.0.
"""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
from tiny_models import TinyTextModel
from torch import nn

import patches
from patches.advanced import SafeGradScaler, freeze_base_vocab
from patches.integrations.layouts import start_row_is_last
from patches.vocab_freeze import VocabFreezeError, freeze_of, live_freezes
from patches.vocab_rows import frozen_rows, new_rows

BASE, VOCAB, DIM = 40, 52, 16


# IndexTTS-style: text_embedding / text_head on the model itself.
UnifiedVoiceLike = functools.partial(TinyTextModel, VOCAB, DIM, "tanh")


def _batches(steps: int, vocab: int = VOCAB, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    # Tokens from the whole vocabulary: base rows get real gradients every step.
    return [(torch.randint(0, vocab, (8, 12), generator=gen),
             torch.randint(0, vocab, (8, 12), generator=gen)) for _ in range(steps)]


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def _tensors(gpt: nn.Module) -> dict[str, torch.Tensor]:
    return {"text_embedding.weight": gpt.text_embedding.weight,
            "text_head.weight": gpt.text_head.weight, "text_head.bias": gpt.text_head.bias}


def _snapshot(gpt: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _tensors(gpt).items()}


def _rows(t: torch.Tensor, ranges) -> torch.Tensor:
    return torch.cat([t[r.start:r.stop] for r in ranges])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_base_frozen_new_trained(before: dict[str, torch.Tensor], gpt: nn.Module,
                                   frozen, trained: range) -> None:
    for name, now in _tensors(gpt).items():
        now = now.detach()
        assert _max_diff(_rows(now, frozen), _rows(before[name], frozen)) == 0.0, name
        assert _max_diff(now[trained.start:trained.stop],
                         before[name][trained.start:trained.stop]) > 0.0, name


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
}


# -- the rule and the errors -------------------------------------------------------


def test_frozen_rows_rule() -> None:
    assert frozen_rows(82, 74, start_row_last=True) == (range(0, 73), range(81, 82))
    assert new_rows(82, 74, start_row_last=True) == range(73, 81)
    assert frozen_rows(24000, 12000) == (range(0, 12000),)
    assert new_rows(24000, 12000) == range(12000, 24000)
    assert frozen_rows(74, 74, start_row_last=True) == (range(0, 74),)
    with pytest.raises(VocabFreezeError, match="base vocabulary size is 90.*82 rows"):
        frozen_rows(82, 90)


def test_clear_errors() -> None:
    with pytest.raises(VocabFreezeError, match="base vocabulary size is 60, but .* 52 rows"):
        freeze_base_vocab(UnifiedVoiceLike(), 60)
    with pytest.raises(VocabFreezeError, match="no text embedding found in Sequential.*modules"):
        freeze_base_vocab(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)), 5)
    with pytest.raises(VocabFreezeError, match="'decoder.embed', which is not a submodule"):
        freeze_base_vocab(UnifiedVoiceLike(), 5, modules=["decoder.embed"])
    with pytest.raises(VocabFreezeError, match="until_step is 0"):
        freeze_base_vocab(UnifiedVoiceLike(), 5, until_step=0)


# -- plain PyTorch loops ------------------------------------------------------------


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_plain_loop_any_optimizer(opt_name: str, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = UnifiedVoiceLike()
    opt = OPTIMIZERS[opt_name](model.parameters())
    data = _batches(12)
    # Optimizer state with momentum in the base rows, as after loading a checkpoint.
    for x, y in data[:3]:
        _step(model, opt, x, y)
    before = _snapshot(model)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        handle = freeze_base_vocab(model, BASE)
    assert f"[Extended Vocab Fix] Detected extended vocabulary: {VOCAB} tokens" in caplog.text
    assert f"[Extended Vocab Fix] Base tokens: 0-{BASE - 1} (frozen)" in caplog.text
    assert f"[Extended Vocab Fix] New tokens: {BASE}-{VOCAB - 1} (trainable)" in caplog.text
    for x, y in data[3:]:
        _step(model, opt, x, y)
    assert handle.steps == 9
    assert_base_frozen_new_trained(before, model, handle.rows, range(BASE, VOCAB))
    # gradients of base rows were zeroed: their fresh optimizer state would stay zero
    assert model.text_embedding.weight.grad[:BASE].abs().max().item() == 0.0
    handle.remove()
    _step(model, opt, *data[0])
    assert _max_diff(model.text_head.weight[:BASE], before["text_head.weight"][:BASE]) > 0.0


def test_gradient_hook_alone_is_not_a_freeze() -> None:
    """The common fix (zero the base rows' gradients) drifts under AdamW: the control."""
    torch.manual_seed(0)
    model = UnifiedVoiceLike()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    before = _snapshot(model)
    for p in (model.text_embedding.weight, model.text_head.weight, model.text_head.bias):
        p.register_hook(lambda g: torch.cat([torch.zeros_like(g[:BASE]), g[BASE:]]))
    for x, y in _batches(5):
        _step(model, opt, x, y)
    assert _max_diff(model.text_head.weight[:BASE], before["text_head.weight"][:BASE]) > 0.0


def test_until_step_releases_after_k_steps() -> None:
    torch.manual_seed(0)
    model = UnifiedVoiceLike()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    before = _snapshot(model)
    handle = freeze_base_vocab(model, BASE, until_step=3)
    data = _batches(5)
    for i, (x, y) in enumerate(data[:3]):
        _step(model, opt, x, y)
        assert _max_diff(model.text_embedding.weight[:BASE],
                         before["text_embedding.weight"][:BASE]) == 0.0, f"step {i + 1}"
    assert handle.released and handle.steps == 3
    _step(model, opt, *data[3])
    for name, now in _tensors(model).items():
        assert _max_diff(now[:BASE], before[name][:BASE]) > 0.0, name


def test_optimizer_without_these_params_is_left_alone() -> None:
    model, other = UnifiedVoiceLike(), nn.Linear(4, 4)
    freeze_base_vocab(model, BASE)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    before = other.weight.detach().clone()
    other(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert _max_diff(other.weight, before) > 0.0


def test_load_state_dict_refreshes_kept_rows() -> None:
    """Weights restored after the freeze (the coqui Trainer's resume) are what is kept."""
    torch.manual_seed(0)
    model = UnifiedVoiceLike()
    handle = freeze_base_vocab(model, BASE)
    trained = UnifiedVoiceLike().state_dict()
    model.load_state_dict(trained)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in _batches(3):
        _step(model, opt, x, y)
    assert _max_diff(model.text_embedding.weight[:BASE], trained["text_embedding.weight"][:BASE]) == 0.0
    assert _max_diff(model.text_head.bias[:BASE], trained["text_head.bias"][:BASE]) == 0.0
    assert handle.steps == 3


def test_explicit_modules_and_second_freeze_replaces_first() -> None:
    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.lm_head = nn.Linear(DIM, VOCAB)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(torch.tanh(self.embed(x)))

    torch.manual_seed(0)
    model = Decoder()
    first = freeze_base_vocab(model, 10, modules=["embed", "lm_head"])
    handle = freeze_base_vocab(model, BASE, modules=[model.embed, model.lm_head])
    assert first.released and handle.paths == ["embed.weight", "lm_head.weight", "lm_head.bias"]
    before = {"w": model.lm_head.weight.detach().clone(), "e": model.embed.weight.detach().clone()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _batches(4):
        _step(model, opt, x, y)
    assert _max_diff(model.lm_head.weight[:BASE], before["w"][:BASE]) == 0.0
    assert _max_diff(model.embed.weight[:BASE], before["e"][:BASE]) == 0.0
    assert _max_diff(model.embed.weight[BASE:], before["e"][BASE:]) > 0.0


def test_one_block_per_model_with_the_true_share(caplog: pytest.LogCaptureFixture) -> None:
    """The same tensors frozen under two names (an Xtts's ``gpt.*``, then its GPTTrainer's
    ``xtts.gpt.*``) give one block, whose freeze line states the share of rows that
    train and a parameter share that is never a false 0.0%."""
    class Xtts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = UnifiedVoiceLike()
            self.decoder = nn.Linear(512, 512)  # the big rest of the model

    class Trainer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.xtts = Xtts()

    model = Trainer()
    with caplog.at_level(logging.INFO, logger="training_patches"):
        first = freeze_base_vocab(model.xtts, BASE)
        second = freeze_base_vocab(model, BASE)
    lines = [r.getMessage() for r in caplog.records if "[Extended Vocab Fix]" in r.getMessage()]
    assert sum("Freezing" in line for line in lines) == 1, lines
    assert sum("Detected extended vocabulary" in line for line in lines) == 1, lines
    freezing = next(line for line in lines if "Freezing" in line)
    total = sum(p.numel() for p in model.xtts.parameters())
    assert (f"Freezing {BASE} of {VOCAB} rows (76.9%; {VOCAB - BASE} rows train, 23.1%) of "
            f"gpt.text_embedding.weight, gpt.text_head.weight, gpt.text_head.bias: "
            f"{BASE * (2 * DIM + 1):,} parameters, ") in freezing
    share = 100 * BASE * (2 * DIM + 1) / total
    assert f"{share:.1f}%" in freezing and f"of the model's {total:,}" in freezing
    assert first.released and not second.released
    assert freeze_of(model.xtts.gpt.text_embedding.weight) is second
    # a freeze of the same tensors with other rows is a change: said, with its own block
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training_patches"):
        freeze_base_vocab(model, BASE - 4)
    assert "Replacing the earlier freeze of xtts.gpt.text_embedding.weight" in caplog.text
    assert f"Freezing {BASE - 4} of {VOCAB} rows" in caplog.text
    # a share far below 0.1% keeps its digits
    from patches.vocab_freeze import _percent
    assert _percent(9546, 78_166_512) == "0.012%" and _percent(0, 10) == "0.0%"


def test_fp16_safe_grad_scaler_skip_and_nan_grads() -> None:
    """CPU fp16 autocast + SafeGradScaler: an overflow step is skipped; fp32 NaN grads
    stepped by the optimizer do not reach the base rows either."""
    torch.manual_seed(0)
    model = UnifiedVoiceLike()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = SafeGradScaler(device="cpu")
    before = _snapshot(model)
    handle = freeze_base_vocab(model, BASE)
    for i, (x, y) in enumerate(_batches(6)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        if i == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.stats()["skipped"] == 1 and handle.steps == 5
    assert_base_frozen_new_trained(before, model, handle.rows, range(BASE, VOCAB))
    # fp32, no scaler: the optimizer steps on NaN gradients
    x, y = _batches(1)[0]
    opt.zero_grad(set_to_none=True)
    logits = model(x)
    (nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) * float("nan")).backward()
    opt.step()
    assert _max_diff(_rows(model.text_head.weight.detach(), handle.rows),
                     _rows(before["text_head.weight"], handle.rows)) == 0.0
    assert torch.isnan(model.text_head.weight[BASE:]).any()  # the new rows did take NaN


# -- the real XTTS GPTTrainer and coqui Trainer ------------------------------------

xtts = pytest.mark.xtts


def _xtts_rows(gpt: nn.Module):
    vocab = gpt.text_embedding.weight.shape[0]
    start_last = start_row_is_last(gpt, vocab)
    return (frozen_rows(vocab, 74, start_row_last=start_last),
            new_rows(vocab, 74, start_row_last=start_last))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@xtts
@pytest.mark.parametrize("wd_only_on_weights", [True, False], ids=["wd_weights", "wd_all"])
def test_coqui_trainer_env_activation(tiny_xtts, tiny_xtts_extended_vocab, tiny_xtts_mixed_manifest,
                                      tmp_path, one_thread, monkeypatch,
                                      caplog: pytest.LogCaptureFixture,
                                      wd_only_on_weights: bool) -> None:
    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", "74")
    patches.advanced.apply(["vocab_freeze"])
    config = tiny_xtts.make_config(tmp_path / "run", vocab=tiny_xtts_extended_vocab,
                                   manifest=tiny_xtts_mixed_manifest,
                                   optimizer_wd_only_on_weights=wd_only_on_weights)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        model = tiny_xtts.make_model(config)
    gpt = model.xtts.gpt
    assert gpt.text_embedding.weight.shape[0] == 82 and gpt.start_text_token == 81
    assert "[Extended Vocab Fix] Detected extended vocabulary: 82 tokens" in caplog.text
    assert "[Extended Vocab Fix] Base tokens: 0-72, 81" in caplog.text
    assert "[Extended Vocab Fix] New tokens: 73-80 (trainable)" in caplog.text
    before = _snapshot(gpt)
    trainer = tiny_xtts.train(config, model)
    assert trainer.total_steps_done == 7
    assert math.isfinite(trainer.keep_avg_train.avg_values["avg_loss"])
    frozen, trained = _xtts_rows(gpt)
    assert_base_frozen_new_trained(before, gpt, frozen, trained)
    assert freeze_of(gpt.text_head.weight).steps == 7


@xtts
def test_xtts_checkpoint_growth_prints_one_freeze_block(tiny_xtts, tiny_xtts_extended_vocab,
                                                        tmp_path, one_thread,
                                                        monkeypatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """GPTTrainer with an ``xtts_checkpoint`` of the base vocabulary: the loader freezes
    Xtts's ``gpt.*`` after the growth, the GPTTrainer hook the same tensors as
    ``xtts.gpt.*``: one ``[Extended Vocab Fix]`` block, not two."""
    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", "74")
    patches.advanced.apply(["vocab_freeze", "checkpoint"])
    base = tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "base"))
    torch.save({"model": base.state_dict()}, tmp_path / "base.pth")
    config = tiny_xtts.make_config(tmp_path / "run", vocab=tiny_xtts_extended_vocab,
                                   xtts_checkpoint=str(tmp_path / "base.pth"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training_patches"):
        model = tiny_xtts.make_model(config)
    lines = [r.getMessage() for r in caplog.records if "[Extended Vocab Fix]" in r.getMessage()]
    assert sum("Freezing" in line for line in lines) == 1, lines
    assert sum("Base tokens: 0-72, 81" in line for line in lines) == 1, lines
    assert "Freezing 74 of 82 rows (90.2%; 8 rows train, 9.8%)" in caplog.text
    assert "(0.0%)" not in caplog.text
    handle = freeze_of(model.xtts.gpt.text_head.weight)
    assert [h for h in live_freezes() if h.covers_same(handle)] == [handle]


def _rewrite_vocab(src, out, edit) -> str:
    """A copy of the vocab.json ``src`` with ``edit(ids)`` applied to its token -> id map
    (model vocab and added tokens alike); a token mapped to None is dropped."""
    import json

    data = json.loads(open(src, encoding="utf-8").read())
    ids = {**data["model"]["vocab"], **{a["content"]: a["id"] for a in data["added_tokens"]}}
    new = edit(dict(ids))
    data["model"]["vocab"] = {t: new[t] for t in data["model"]["vocab"] if new.get(t) is not None}
    data["added_tokens"] = [{**a, "id": new[a["content"]]} for a in data["added_tokens"]
                            if new.get(a["content"]) is not None]
    # tokenizers renumbers an added token the model vocab lacks: list each one there too
    data["model"]["vocab"].update({a["content"]: a["id"] for a in data["added_tokens"]})
    with open(out, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(data, ensure_ascii=False))
    return str(out)


class _Gpt(nn.Module):
    """What the check reads of XTTS's GPT: the text embedding and the start/stop ids."""

    def __init__(self, rows: int, start: int | None, stop: int | None = 0) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(rows, 4)
        self.start_text_token, self.stop_text_token = start, stop


@xtts
def test_vocab_layout_problems_against_tokenizer_and_model(tiny_xtts, tiny_xtts_extended_vocab,
                                                           tmp_path) -> None:
    from patches.integrations.xtts_gpt import vocab_layout_problems

    good = str(tiny_xtts_extended_vocab)  # [am] 73, new 74..80, [START] moved to 81
    assert vocab_layout_problems(good, _Gpt(82, 81), 74) == []
    assert vocab_layout_problems(str(tiny_xtts.vocab), _Gpt(74, 73), 74) == []
    # a third-party extender: [START] dropped, its id 73 given to [am]
    dropped = _rewrite_vocab(good, tmp_path / "dropped.json",
                             lambda ids: {**ids, "[START]": None})
    problems = vocab_layout_problems(dropped, _Gpt(81, None), 74)
    assert any(p.startswith("[START] missing") for p in problems), problems
    assert any("row 73 ([am]) keeps the base model's row 73" in p for p in problems), problems
    # [START] moved into the new range but not last: row 73 is still frozen for [am]
    moved = _rewrite_vocab(good, tmp_path / "moved.json", lambda ids: {
        **ids, "[START]": 80, **{t: 81 for t, i in ids.items() if i == 80}})
    problems = vocab_layout_problems(moved, _Gpt(82, 80), 74)
    assert any("[START] is id 80, a new row that trains" in p and "row 73 ([am])" in p
               for p in problems), problems
    # the model's ids disagree with the tokenizer's; rows disagree with the ids
    problems = vocab_layout_problems(good, _Gpt(83, 73, stop=2), 74)
    assert "the model's start_text_token is 73, but the tokenizer's [START] is id 81" in problems
    assert "the model's stop_text_token is 2, but the tokenizer's [STOP] is id 0" in problems
    assert "the text embedding has 83 rows, the tokenizer 82 ids" in problems
    # a dataset language needs its [lang] special token (under its code or an alias)
    assert vocab_layout_problems(good, _Gpt(82, 81), 74, ["am", "en", "am-ET"]) == []
    problems = vocab_layout_problems(good, _Gpt(82, 81), 74, ["de"])
    assert len(problems) == 1 and problems[0].startswith("dataset language 'de': [de] is missing")


@xtts
def test_activation_on_a_broken_vocabulary_warns_and_strict_stops(
        tiny_xtts, tiny_xtts_extended_vocab, tmp_path, one_thread, monkeypatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """TRAINING_PATCHES_BASE_VOCAB on a GPTTrainer whose vocabulary lost [START] (its id
    given to [am]): a WARNING before the freeze block, not only "Base tokens: 0-73";
    under TRAINING_PATCHES_STRICT=1 the GPTTrainer is not built."""
    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", "74")
    patches.advanced.apply(["vocab_freeze"])
    dropped = _rewrite_vocab(tiny_xtts_extended_vocab, tmp_path / "dropped.json",
                             lambda ids: {**ids, "[START]": None})
    with caplog.at_level(logging.INFO, logger="training_patches"):
        tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "ok",
                                                   vocab=tiny_xtts_extended_vocab))
    assert "Base tokens: 0-72, 81" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and "[Extended Vocab Fix]" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training_patches"):
        tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "broken", vocab=dropped))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "[Extended Vocab Fix]" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "[START] missing" in warnings[0] and "row 73 ([am])" in warnings[0]
    assert dropped in warnings[0] and "verify-tokenizer" in warnings[0]
    assert "Base tokens: 0-73 (frozen)" in caplog.text  # what was done, after the warning
    patches.revert()
    patches.advanced.apply(["vocab_freeze"], strict=True)
    with pytest.raises(VocabFreezeError, match=r"STRICT=1.*\[START\] missing"):
        tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "strict", vocab=dropped))


@xtts
def test_coqui_trainer_without_freeze_moves_base_rows(tiny_xtts, tiny_xtts_extended_vocab,
                                                      tmp_path, one_thread,
                                                      monkeypatch) -> None:
    """Control: the same run with the variable unset changes the base rows."""
    monkeypatch.delenv("TRAINING_PATCHES_BASE_VOCAB", raising=False)
    patches.advanced.apply(["vocab_freeze"])
    config = tiny_xtts.make_config(tmp_path / "run", vocab=tiny_xtts_extended_vocab)
    model = tiny_xtts.make_model(config)
    before = _snapshot(model.xtts.gpt)
    tiny_xtts.train(config, model)
    frozen, _ = _xtts_rows(model.xtts.gpt)
    assert _max_diff(_rows(model.xtts.gpt.text_head.weight.detach(), frozen),
                     _rows(before["text_head.weight"], frozen)) > 0.0


@xtts
def test_coqui_trainer_save_resume_and_nan_step(tiny_xtts, tiny_xtts_extended_vocab,
                                                tiny_xtts_mixed_manifest, tmp_path,
                                                one_thread) -> None:
    """Run 1 saves, run 2 resumes with continue_path (hooks come back by themselves) and
    meets a NaN loss at its third step: the base rows of run 1's start stay exact."""
    from TTS.tts.layers.xtts.trainer.gpt_trainer import GPTTrainer

    patches.advanced.apply(["vocab_freeze"], base_vocab=74)
    config = tiny_xtts.make_config(tmp_path / "run", vocab=tiny_xtts_extended_vocab,
                                   manifest=tiny_xtts_mixed_manifest, save_step=3)
    model = tiny_xtts.make_model(config)
    before = _snapshot(model.xtts.gpt)
    first = tiny_xtts.train(config, model)

    class NaNAtThirdStep(GPTTrainer):
        calls = 0

        def train_step(self, batch, criterion, optimizer_idx=None):
            outputs, losses = super().train_step(batch, criterion, optimizer_idx)
            NaNAtThirdStep.calls += 1
            if NaNAtThirdStep.calls == 3:
                losses["loss"] = losses["loss"] * float("nan")
            return outputs, losses

    config2 = tiny_xtts.make_config(tmp_path / "run", vocab=tiny_xtts_extended_vocab,
                                    manifest=tiny_xtts_mixed_manifest)
    resumed = NaNAtThirdStep(config2)  # a fresh model: different random rows until restored
    assert _max_diff(resumed.xtts.gpt.text_head.weight, before["text_head.weight"]) > 0.0
    trainer = tiny_xtts.make_trainer(config2, resumed, continue_path=str(first.output_path))
    try:
        trainer.fit()
    except SystemExit as exc:  # coqui turns any error into exit(1)
        pytest.fail(f"resumed training failed (exit {exc.code})")
    assert NaNAtThirdStep.calls >= 3
    gpt = resumed.xtts.gpt
    frozen, trained = _xtts_rows(gpt)
    for name, now in _tensors(gpt).items():
        assert _max_diff(_rows(now.detach(), frozen), _rows(before[name], frozen)) == 0.0, name
        assert torch.isfinite(_rows(now.detach(), frozen)).all()
    # hooks came back by themselves on the rebuilt model and kept the restored rows
    assert freeze_of(gpt.text_embedding.weight).steps >= 3


@xtts
def test_xtts_fp16_cpu_with_safe_grad_scaler(tiny_xtts, tiny_xtts_extended_vocab,
                                             tiny_xtts_mixed_manifest, tmp_path,
                                             one_thread) -> None:
    """A plain loop over the real XTTS GPTTrainer step with CPU fp16 autocast."""
    config = tiny_xtts.make_config(tmp_path / "run", vocab=tiny_xtts_extended_vocab,
                                   manifest=tiny_xtts_mixed_manifest,
                                   optimizer_wd_only_on_weights=False)
    torch.manual_seed(0)
    model = tiny_xtts.make_model(config)
    handle = freeze_base_vocab(model, 74)
    gpt = model.xtts.gpt
    before = _snapshot(gpt)
    opt = model.get_optimizer()
    scaler = SafeGradScaler(device="cpu")
    loader = model.get_data_loader(config, samples=tiny_xtts.samples(config))
    model.eval()
    gpt.train()
    for i, batch in zip(range(5), loader):
        batch = model.format_batch_on_device(batch)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            _, losses = model.train_step(batch, None)
        loss = losses["loss"].float() * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.stats()["skipped"] >= 1 and handle.steps <= 4
    frozen, trained = _xtts_rows(gpt)
    assert_base_frozen_new_trained(before, gpt, frozen, trained)


def test_leading_filler_row_is_frozen_with_the_base(caplog) -> None:
    """F5-TTS's text embedding keeps a filler row 0 and token i at row i + 1: 26 base tokens
    are rows 0..26. ``leading_rows=1`` freezes exactly those; the first new token's row (27)
    trains. Without it, row 26 (the last base token) would train."""
    import logging

    class TextEmbed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text_embed = torch.nn.Embedding(26 + 1 + 6, 8)  # filler + 26 base + 6 new

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.text_embed(ids + 1)  # F5: ids shifted by one, 0 is the filler

    torch.manual_seed(0)
    model = TextEmbed()
    before = model.text_embed.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="training_patches"):
        handle = freeze_base_vocab(model, 26, modules=["text_embed"], leading_rows=1)
    try:
        assert [(r.start, r.stop) for r in handle.rows] == [(0, 27)]
        assert "row 0 is the model's filler row, no token" in caplog.text
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            model(torch.arange(32)).pow(2).sum().backward()
            opt.step()
        after = model.text_embed.weight.detach()
        assert torch.equal(after[:27], before[:27])
        assert not torch.equal(after[27], before[27])
    finally:
        handle.remove()
    with pytest.raises(VocabFreezeError, match="leading_rows is -1"):
        freeze_base_vocab(model, 26, modules=["text_embed"], leading_rows=-1)
