"""Issue 27: the EMA weights, a checkpoint part (``patches/checkpoint/ema.py``). Saved with
``CheckpointManager.save(..., ema=)``, loaded with ``load_checkpoint(..., ema=)`` into a
grown vocabulary: the EMA's own trained rows kept, its new rows started as the model's, and
with the freeze its base rows bit-identical through its updates, for torch's
``AveragedModel`` and ema_pytorch's ``EMA`` (F5-TTS's). Real modules, real files."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyTextModel

from patches.checkpoint import CheckpointManager, CheckpointMismatchError, load_checkpoint

OLD, NEW = 20, 24


def _averaged(model: torch.nn.Module, kind: str):
    if kind == "AveragedModel":
        return torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ema_pytorch = pytest.importorskip("ema_pytorch")
    return ema_pytorch.EMA(model, beta=0.9, update_after_step=0, update_every=1)


def _update(ema, model) -> None:
    if hasattr(ema, "update_parameters"):
        ema.update_parameters(model)
    else:
        ema.update()


def _ema_weight(ema, name: str) -> torch.Tensor:
    inner = ema.module if hasattr(ema, "update_parameters") else ema.ema_model
    return dict(inner.named_parameters())[name].detach()


def _train(model, ema, steps: int, tokens: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.arange(tokens)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        _update(ema, model)


@pytest.fixture
def saved(tmp_path):
    def save(kind: str):
        torch.manual_seed(0)
        model = TinyTextModel(OLD, 8, "tanh")
        ema = _averaged(model, kind)
        _update(ema, model)  # ema_pytorch copies the model at its first update
        _train(model, ema, 5, OLD)
        path = CheckpointManager(tmp_path / kind).save(5, model, ema=ema)
        return path, model, ema
    return save


@pytest.mark.parametrize("kind", ["AveragedModel", "EMA"])
def test_ema_weights_grow_with_the_vocabulary_and_keep_their_base_rows(saved, kind):
    path, old_model, old_ema = saved(kind)
    name = "text_embedding.weight"
    before = _ema_weight(old_ema, name).clone()
    assert not torch.equal(before, old_model.text_embedding.weight.detach())  # it averages
    model = TinyTextModel(NEW, 8, "tanh")
    ema = _averaged(model, kind)
    report = load_checkpoint(path, model, ema=ema, row_init="spread")
    loaded = _ema_weight(ema, name)
    assert loaded.shape[0] == NEW
    assert torch.equal(loaded[:OLD], before)  # the EMA's own trained rows, not the model's
    assert torch.equal(loaded[OLD:], model.text_embedding.weight.detach()[OLD:])  # as the model's
    assert report.parts["ema"].status == "remapped" and "new rows as the model's" in \
        report.parts["ema"].detail
    # training on with the freeze: the EMA's base rows stay bit-identical, its new rows move
    new_rows = loaded[OLD:].clone()
    _train(model, ema, 4, NEW)
    after = _ema_weight(ema, name)
    assert torch.equal(after[:OLD], before)
    assert not torch.equal(after[OLD:], new_rows)
    # the control: without the kept rows the same updates move the EMA's base rows
    report.ema_freeze.remove()
    _train(model, ema, 1, NEW)
    assert not torch.equal(_ema_weight(ema, name)[:OLD], before)


def test_the_ema_part_says_what_was_done(saved, tmp_path):
    path, _, _ = saved("AveragedModel")
    report = load_checkpoint(path, TinyTextModel(OLD, 8, "tanh"))
    assert report.parts["ema"].status == "dropped" and report.parts["ema"].detail == \
        "no ema passed"
    plain = CheckpointManager(tmp_path / "plain").save(1, TinyTextModel(OLD, 8, "tanh"))
    model = TinyTextModel(OLD, 8, "tanh")
    report = load_checkpoint(plain, model, ema=_averaged(model, "AveragedModel"))
    assert report.parts["ema"].status == "absent"
    model = TinyTextModel(OLD, 8, "tanh")
    ema = _averaged(model, "AveragedModel")
    report = load_checkpoint(path, model, ema=ema)
    assert report.parts["ema"].status == "restored" and "EMA restored" in report.summary()


def test_an_ema_that_does_not_fit_is_refused_before_anything_changes(saved):
    path, _, _ = saved("AveragedModel")
    model = TinyTextModel(OLD, 8, "tanh")
    other = torch.optim.swa_utils.AveragedModel(TinyTextModel(OLD, 6, "tanh"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, model, ema=other)
    assert "Nothing was loaded" in str(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_ema_weights_are_one_unit_of_the_parts(saved, monkeypatch):
    """``parts.EmaPart`` in ``parts.UNITS`` plans, applies and reports the EMA weights: taken
    out of the list, the EMA is neither loaded nor reported, and the model still is."""
    from patches.checkpoint import parts

    path, trained, trained_ema = saved("AveragedModel")
    assert any(isinstance(p, parts.EmaPart) for p in parts.UNITS)
    model = TinyTextModel(OLD, 8, "tanh")
    ema = _averaged(model, "AveragedModel")
    report = load_checkpoint(path, model, ema=ema)
    assert torch.equal(_ema_weight(ema, "text_embedding.weight"),
                       _ema_weight(trained_ema, "text_embedding.weight"))
    assert report.parts["ema"].status == "restored"
    monkeypatch.setattr(parts, "UNITS", tuple(p for p in parts.UNITS if p.name != "ema"))
    model = TinyTextModel(OLD, 8, "tanh")
    ema = _averaged(model, "AveragedModel")
    untouched = _ema_weight(ema, "text_embedding.weight").clone()
    report = load_checkpoint(path, model, ema=ema)
    assert torch.equal(_ema_weight(ema, "text_embedding.weight"), untouched)
    assert "ema" not in report.parts
    assert torch.equal(model.text_embedding.weight.detach(), trained.text_embedding.weight.detach())
