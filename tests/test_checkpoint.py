"""load_checkpoint and CheckpointManager on plain PyTorch models (no coqui needed).

What a user notices: a refused file (and code that never ran), a clear error naming the
newest valid checkpoint, trained rows kept after the vocabulary grew, new rows near the
old mean, optimizer moments that fit, a warmup that restarts, files that are never torn
or deleted behind their back, and losses that continue exactly after a resume.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from torch import nn

import patches
from patches import checkpoint as ck
from patches.reads_text import READS_ABOVE
from tiny_models import TinyGPT
from patches import vocab_freeze  # noqa: F401  (a growth's freeze: if it cannot import, fail)
from patches.checkpoint.atomic import host_name
from patches.checkpoint import (CheckpointError, CheckpointManager, CheckpointMismatchError,
                                UnsafeCheckpointError, load_checkpoint)

torch.set_num_threads(1)

HIDDEN = 16


class XttsLikeGPT(nn.Module):
    """XTTS layout: ``gpt.text_embedding`` whose last row is the start-text token."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.gpt = TinyGPT(vocab)
        self.gpt.start_text_token = vocab - 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, vocab: int,
           scheduler=None, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, 6), generator=gen)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _warmup(optimizer: torch.optim.Optimizer, warmup: int = 10):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


def _trained_checkpoint(tmp_path: Path, vocab: int = 20, model_cls=TinyGPT, steps: int = 6):
    torch.manual_seed(0)
    model = model_cls(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = _warmup(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    _train(model, opt, steps, vocab, sched)
    path = CheckpointManager(tmp_path / "run").save(steps, model, opt, sched, scaler)
    return model, opt, sched, scaler, path


def _fresh(vocab: int, model_cls=TinyGPT, seed: int = 123):
    torch.manual_seed(seed)
    model = model_cls(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = _warmup(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    return model, opt, sched, scaler


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was changed by a refused load"


# ----------------------------------------------------------------- refused files


class _WritesMarker:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        # Unpickling this calls open(marker, "w"): the file appears if the code runs.
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("container", ["torch_zip", "plain_pickle"])
def test_malicious_pickle_is_refused_and_its_code_never_runs(tmp_path, container):
    _, _, _, _, good = _trained_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    evil = good.parent / "ckpt_000000999.pt"
    payload = {"model": {"text_embedding.weight": torch.zeros(20, HIDDEN)},
               "x": _WritesMarker(marker)}
    if container == "torch_zip":
        torch.save(payload, evil)
    else:
        evil.write_bytes(pickle.dumps(payload, protocol=2))
    # Control: the payload really does run code when unpickled without weights_only.
    if container == "plain_pickle":
        control = tmp_path / "control"
        pickle.loads(pickle.dumps(_WritesMarker(control), protocol=2))
        assert control.exists()

    model, opt, sched, scaler = _fresh(20)
    before = _snapshot(model)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(evil, model, opt, sched, scaler)
    message = str(info.value)
    assert not marker.exists(), "the malicious checkpoint's code ran"
    assert str(evil) in message and "open" in message and "none of its code ran" in message
    assert str(good) in message  # the newest valid checkpoint beside it
    _assert_unchanged(model, before)
    assert evil.exists()  # the user's file is left as it was


@pytest.mark.parametrize("damage", ["truncated", "empty", "random_bytes", "half_zip_tail"])
def test_damaged_files_get_a_clear_error_naming_the_newest_valid_one(tmp_path, damage):
    _, _, _, _, good = _trained_checkpoint(tmp_path)
    data = good.read_bytes()
    bad = good.parent / "ckpt_000000100.pt"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "random_bytes":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        bad.write_bytes(data[:-10])
    original = bad.read_bytes()
    model, opt, sched, scaler = _fresh(20)
    before = _snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(bad, model, opt, sched, scaler)
    message = str(info.value)
    assert str(bad) in message
    assert f"The newest valid checkpoint beside it is {good}" in message
    expected = {"truncated": "truncated", "empty": "empty", "random_bytes": "not a torch checkpoint",
                "half_zip_tail": "truncated"}[damage]
    assert expected in message
    _assert_unchanged(model, before)
    assert bad.read_bytes() == original


def test_missing_file_and_no_valid_neighbour(tmp_path):
    model = TinyGPT(20)
    with pytest.raises(CheckpointError, match="does not exist.*No other valid checkpoint"):
        load_checkpoint(tmp_path / "nope.pt", model)


# ----------------------------------------------------------------- vocabulary growth


def test_remap_grows_vocab_keeps_trained_rows_and_optimizer_state(tmp_path, caplog):
    old_model, old_opt, old_sched, old_scaler, path = _trained_checkpoint(tmp_path, vocab=20)
    model, opt, sched, scaler = _fresh(28)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        report = load_checkpoint(path, model, opt, sched, scaler, policy="remap", freeze=False)

    old_emb = old_model.text_embedding.weight.detach()
    new_emb = model.text_embedding.weight.detach()
    # 20 of 20 trained rows kept, in embedding and head.
    assert torch.equal(new_emb[:20], old_emb)
    assert torch.equal(model.text_head.weight.detach()[:20], old_model.text_head.weight.detach())
    assert torch.equal(model.text_head.bias.detach()[:20], old_model.text_head.bias.detach())
    assert report.kept_rows == {"text_embedding.weight": 20, "text_head.weight": 20,
                                "text_head.bias": 20}
    assert report.base_vocab_size == 20 and report.vocab_size == 28 and not report.start_row_moved
    # New rows by the default rules with no tokenizer to spell them (-> spread): finite,
    # around the old mean at the old rows' own per-channel spread, all different.
    # (the default auto: no tokenizer to draw the reading probe's texts from -> spelling)
    assert report.row_init == {"embedding": "spelling", "head": "spread", "spelled": 0,
                               "fallback": 8, "fallback_tokens": [], "no_tokenizer": True,
                               "auto": {"text_tv": None, "reads": None, "threshold": READS_ABOVE,
                                        "why": "no tokenizer was given to draw the probe's "
                                               "texts from", "seconds": 0.0, "failed": False}}
    new_rows = new_emb[20:]
    assert torch.isfinite(new_rows).all()
    std = old_emb.std(dim=0, unbiased=False)
    z = (new_rows - old_emb.mean(0)) / std
    assert z.abs().max() < 6 and z.abs().mean() > 0.3  # at the old scale, not at the mean
    assert len({tuple(r.tolist()) for r in new_rows}) == 8  # not 8 copies of one row
    bias = model.text_head.bias.detach()
    old_bias = old_model.text_head.bias.detach()
    assert (bias[20:] - old_bias.mean()).abs().max() < 1e-3 * old_bias.std()
    # Optimizer: every moment fits its parameter; unchanged ones are the saved ones.
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                if value.dim():
                    assert value.shape == p.shape, key
    saved = old_opt.state[old_model.body[0].weight]
    assert torch.equal(opt.state[model.body[0].weight]["exp_avg"], saved["exp_avg"])
    emb_state = opt.state[model.text_embedding.weight]
    old_emb_state = old_opt.state[old_model.text_embedding.weight]
    assert torch.equal(emb_state["exp_avg"][:20], old_emb_state["exp_avg"])
    assert torch.count_nonzero(emb_state["exp_avg"][20:]) == 0
    assert torch.allclose(emb_state["exp_avg_sq"][20:],
                          old_emb_state["exp_avg_sq"].mean(0, keepdim=True).expand(8, -1))
    assert sorted(report.optimizer_moments_resized) == sorted(report.resized)
    # Scheduler and scaler kept: the matched set.
    assert sched.last_epoch == old_sched.last_epoch == 6
    assert opt.param_groups[0]["lr"] == pytest.approx(old_opt.param_groups[0]["lr"])
    assert scaler.get_scale() == old_scaler.get_scale()
    assert report.step == 6 and report.restored == ["optimizer", "scheduler", "scaler"]
    # The first step works and new rows move by an old row's step size, not lr/eps.
    before = new_emb.clone()
    _train(model, opt, 1, 28, sched, seed=5)
    moved = (model.text_embedding.weight.detach() - before).abs().amax(dim=1)
    assert torch.isfinite(model.text_embedding.weight).all()
    assert moved[20:].max() <= 2 * opt.param_groups[0]["lr"]
    assert "20 trained rows kept" in caplog.text


def test_xtts_start_token_row_moves_to_the_new_end(tmp_path):
    old_model, *_, path = _trained_checkpoint(tmp_path, vocab=20, model_cls=XttsLikeGPT)
    model, opt, sched, scaler = _fresh(28, model_cls=XttsLikeGPT)
    report = load_checkpoint(path, model, opt, sched, scaler, freeze=False)
    old = old_model.gpt.text_embedding.weight.detach()
    new = model.gpt.text_embedding.weight.detach()
    assert report.start_row_moved
    assert torch.equal(new[:19], old[:19]) and torch.equal(new[27], old[19])
    assert torch.equal(model.gpt.text_head.bias.detach()[27], old_model.gpt.text_head.bias.detach()[19])
    z = (new[19:27] - old[:19].mean(0)) / old[:19].std(0, unbiased=False)
    assert z.abs().max() < 6 and z.abs().mean() > 0.3  # spread around the base rows' mean
    exp_avg = opt.state[model.gpt.text_embedding.weight]["exp_avg"]
    assert torch.count_nonzero(exp_avg[19:27]) == 0 and torch.count_nonzero(exp_avg[27]) > 0
    assert report.kept_rows["gpt.text_embedding.weight"] == 20


def test_start_token_not_last_keeps_rows_in_place(tmp_path):
    """A tokenizer with [START] at a low id: every old row stays where its token id is."""
    old_model, *_, path = _trained_checkpoint(tmp_path, vocab=20, model_cls=XttsLikeGPT)
    model, opt, sched, scaler = _fresh(28, model_cls=XttsLikeGPT)
    model.gpt.start_text_token = 3
    report = load_checkpoint(path, model, opt, sched, scaler, freeze=False)
    assert not report.start_row_moved
    assert torch.equal(model.gpt.text_embedding.weight.detach()[:20],
                       old_model.gpt.text_embedding.weight.detach())


def test_reset_starts_optimizer_scheduler_scaler_fresh_together(tmp_path):
    old_model, old_opt, old_sched, old_scaler, path = _trained_checkpoint(tmp_path, vocab=20)
    model, opt, sched, scaler = _fresh(28)
    fresh_lr = opt.param_groups[0]["lr"]
    _train(model, opt, 3, 28, sched)  # objects that already ran: reset must make them fresh
    scaler.scale(torch.ones(()))
    scaler.update(4.0)
    assert scaler.get_scale() == 4.0
    report = load_checkpoint(path, model, opt, sched, scaler, policy="reset", freeze=False)
    assert report.step == 0 and report.reset == ["optimizer", "scheduler", "scaler"]
    assert report.restored == []
    assert len(opt.state) == 0
    assert sched.last_epoch == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(fresh_lr) == pytest.approx(1e-2 / 10)
    assert scaler.get_scale() == 512.0 and scaler._get_growth_tracker() == 0
    assert torch.equal(model.text_embedding.weight.detach()[:20],
                       old_model.text_embedding.weight.detach())
    losses = _train(model, opt, 2, 28, sched)
    assert all(math.isfinite(x) for x in losses)
    for p in model.parameters():
        for value in opt.state[p].values():
            assert value.dim() == 0 or value.shape == p.shape
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 3 / 10)  # warmup goes on from 0


def test_other_shape_mismatch_is_an_error_and_nothing_is_loaded(tmp_path):
    *_, path = _trained_checkpoint(tmp_path, vocab=20)
    torch.manual_seed(1)
    model = TinyGPT(28, hidden=HIDDEN + 8)
    opt = torch.optim.AdamW(model.parameters())
    before = _snapshot(model)
    with pytest.raises(CheckpointMismatchError, match="does not fit this model.*no partial load"):
        load_checkpoint(path, model, opt)
    _assert_unchanged(model, before)
    assert len(opt.state) == 0


def test_vocab_shrink_and_missing_keys_are_refused(tmp_path):
    *_, path = _trained_checkpoint(tmp_path, vocab=20)
    small = TinyGPT(12)
    before = _snapshot(small)
    with pytest.raises(CheckpointMismatchError, match="tokenizer has 12 tokens and the "
                                                      "checkpoint .* trained with 20: 8 token"):
        load_checkpoint(path, small)
    _assert_unchanged(small, before)

    class Wider(TinyGPT):
        def __init__(self, vocab: int) -> None:
            super().__init__(vocab)
            self.extra = nn.Linear(2, 2)

    wider = Wider(20)
    with pytest.raises(CheckpointMismatchError, match="extra.weight"):
        load_checkpoint(path, wider)
    report = load_checkpoint(path, wider, strict=False)
    assert report.missing_keys == ["extra.bias", "extra.weight"]


def test_optimizer_state_for_other_parameters_is_refused_before_anything_changes(tmp_path):
    *_, path = _trained_checkpoint(tmp_path, vocab=20)
    model, _, _, _ = _fresh(20)
    # An optimizer over a subset: torch would accept the state and fail at step().
    opt = torch.optim.AdamW([model.text_head.weight, model.text_head.bias, model.body[0].weight,
                             model.body[0].bias, model.text_embedding.weight])
    before = _snapshot(model)
    with pytest.raises(CheckpointMismatchError, match="policy='reset'"):
        load_checkpoint(path, model, opt)
    _assert_unchanged(model, before)
    assert len(opt.state) == 0


def test_prefixed_keys_and_coqui_lists_load(tmp_path):
    """coqui Trainer layout: 'model' with an 'xtts.' prefix, lists of optimizer states."""
    old_model, old_opt, old_sched, _, _ = _trained_checkpoint(tmp_path, vocab=20)
    state = {"config": {}, "model": {f"xtts.{k}": v for k, v in old_model.state_dict().items()},
             "optimizer": [old_opt.state_dict()], "scheduler": [old_sched.state_dict()],
             "scaler": None, "step": 6, "epoch": 1}
    path = tmp_path / "checkpoint_6.pth"
    torch.save(state, path)
    model, opt, sched, _ = _fresh(24)
    report = load_checkpoint(path, model, [opt], [sched], None, freeze=False)
    assert report.epoch == 1 and report.step == 6 and report.vocab_size == 24
    assert torch.equal(model.text_embedding.weight.detach()[:20],
                       old_model.text_embedding.weight.detach())


def test_freeze_is_enabled_after_a_growth_when_available(tmp_path):
    *_, path = _trained_checkpoint(tmp_path, vocab=20)
    model, opt, sched, scaler = _fresh(28)
    report = load_checkpoint(path, model, opt, sched, scaler)
    assert report.freeze is not None
    base = model.text_embedding.weight.detach()[:20].clone()
    new_before = model.text_embedding.weight.detach()[20:].clone()
    _train(model, opt, 3, 28, sched)
    assert torch.equal(model.text_embedding.weight.detach()[:20], base)
    assert not torch.equal(model.text_embedding.weight.detach()[20:], new_before)
    head_base = model.text_head.weight.detach()[:20].clone()
    _train(model, opt, 2, 28, sched, seed=3)
    assert torch.equal(model.text_head.weight.detach()[:20], head_base)  # AdamW decay too


def test_freeze_false_leaves_all_rows_training(tmp_path):
    *_, path = _trained_checkpoint(tmp_path, vocab=20)
    model, opt, sched, scaler = _fresh(28)
    report = load_checkpoint(path, model, opt, sched, scaler, freeze=False)
    assert report.freeze is None
    base = model.text_embedding.weight.detach()[:20].clone()
    _train(model, opt, 2, 28, sched)
    assert not torch.equal(model.text_embedding.weight.detach()[:20], base)


# ----------------------------------------------------------------- manager


def test_manager_writes_manifest_latest_and_prunes_only_its_own(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    user_files = {out / "best.pt": b"user", out / "ckpt_000000001.pt": b"mine, no manifest",
                  out / "notes.txt": b"x"}
    for path, data in user_files.items():
        path.write_bytes(data)
    model = TinyGPT(20)
    opt = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(out, keep=2)
    for step in (10, 20, 30, 40):
        manager.save(step, model, opt, scaler=None, epoch=0)
    assert [p.name for p in manager.checkpoints()] == ["ckpt_000000030.pt", "ckpt_000000040.pt"]
    for path, data in user_files.items():
        assert path.read_bytes() == data
    assert (out / "latest").read_text().strip() == "ckpt_000000040.pt"
    manifest = json.loads((out / "ckpt_000000040.pt.manifest.json").read_text())
    assert manifest["step"] == 40 and manifest["vocab_size"] == 20 and manifest["amp"] is False
    assert manifest["param_shapes"]["text_head.weight"] == [20, HIDDEN]
    entry = manifest["files"]["ckpt_000000040.pt"]
    assert entry["bytes"] == (out / "ckpt_000000040.pt").stat().st_size
    # The digest is taken while writing (the file is not read back): it must be the file's.
    assert entry["digest"]["chunks"] == [
        blake3.blake3((out / "ckpt_000000040.pt").read_bytes()).hexdigest()]
    assert manifest["generation"] == 3 and manifest["nonfinite"] == []
    assert not [p for p in out.iterdir() if ".tp-tmp-" in p.name]


def test_resume_auto_passes_over_torn_and_unfinished_checkpoints(tmp_path, caplog):
    out = tmp_path / "run"
    model = TinyGPT(20)
    manager = CheckpointManager(out, keep=None)
    for step in (1, 2, 3, 4):
        manager.save(step, model)
    # step 4: torn on disk after its manifest was written (bit rot / copy gone wrong)
    p4 = manager.path_for(4)
    p4.write_bytes(p4.read_bytes()[:-100])
    # step 3: its bytes flipped, same size (only the hash can tell)
    p3 = manager.path_for(3)
    data = bytearray(p3.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p3.write_bytes(bytes(data))
    # step 5: written but its manifest never was (killed between the two)
    torch.save({"model": model.state_dict(), "step": 5}, manager.path_for(5))
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        chosen = manager.resume("auto")
    assert chosen == manager.path_for(2)
    assert "ckpt_000000004.pt" in caplog.text and "ckpt_000000005.pt has no manifest" in caplog.text
    assert manager.path_for(4).exists() and manager.path_for(5).exists()
    assert CheckpointManager(tmp_path / "empty").resume("auto") is None


def _unlistable(monkeypatch, folder: Path) -> None:
    """``folder`` cannot be listed (its read permission gone, its network disk failing);
    its files can still be written and read by name (tests run as root: chmod would not)."""
    iterdir = Path.iterdir

    def refuse(self):
        if Path(self) == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)
    monkeypatch.setattr(Path, "iterdir", refuse)


def test_a_folder_that_cannot_be_listed_still_saves_and_says_so_once(tmp_path, monkeypatch,
                                                                        caplog):
    out = tmp_path / "run"
    out.mkdir()
    model = TinyGPT(20)
    manager = CheckpointManager(out, keep=2)
    manager.save(1, model)
    _unlistable(monkeypatch, out)
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert manager.save(2, model) == manager.path_for(2)
        assert manager.save(3, model) == manager.path_for(3)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and str(out) in said[0] and "Permission denied" in said[0]
    assert "cannot be listed" in said[0] and "numbered after ckpt_000000001.pt" in said[0]
    assert ck.check_file(manager.path_for(2)) is None and ck.check_file(manager.path_for(3)) is None


def test_a_save_into_a_folder_that_cannot_be_listed_stays_the_newest(tmp_path, monkeypatch,
                                                                      caplog):
    """Numbered after the checkpoint ``latest`` names: once the folder can be listed again,
    ``resume("auto")`` takes it, not an older one; without a readable ``latest`` the save is
    not made (None, a WARNING, nothing written: training goes on, as on a full disk)."""
    out = tmp_path / "run"
    model = TinyGPT(20)
    manager = CheckpointManager(out, keep=None)
    for step in (1, 2, 3):
        manager.save(step, model)
    with monkeypatch.context() as patched:
        _unlistable(patched, out)
        assert manager.save(4, model) == manager.path_for(4)
    assert manager.resume("auto") == manager.path_for(4)

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _unlistable(monkeypatch, fresh)
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert CheckpointManager(fresh).save(1, model) is None
    said = [r.getMessage() for r in caplog.records if "NOT saved" in r.getMessage()]
    assert len(said) == 1 and str(fresh) in said[0] and "cannot be listed" in said[0]
    assert "Nothing was written; training goes on" in said[0]
    monkeypatch.undo()
    assert [p.name for p in fresh.iterdir() if not p.name.startswith(".training-patches")] == []


def test_a_leftover_temp_file_that_cannot_be_removed_does_not_stop_the_save(tmp_path,
                                                                             monkeypatch, caplog):
    out = tmp_path / "run"
    out.mkdir()
    left = out / f".ckpt_000000001.pt.tp-tmp-{os.getpid()}@{host_name()}~abc123"  # failed save
    left.write_bytes(b"partial")
    unlink = Path.unlink

    def refuse(self, missing_ok=False):
        if Path(self) == left:
            raise PermissionError(13, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)
    monkeypatch.setattr(Path, "unlink", refuse)
    manager = CheckpointManager(out, keep=2)
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert manager.save(1, TinyGPT(20)) == manager.path_for(1)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [f"training-patches: could not remove {left}, left by an interrupted save "
                    f"([Errno 13] Operation not permitted: '{left}')"]
    assert ck.check_file(manager.path_for(1)) is None and left.exists()


def test_a_resume_from_a_folder_that_cannot_be_listed_says_so(tmp_path, monkeypatch):
    out = tmp_path / "run"
    manager = CheckpointManager(out, keep=2)
    manager.save(1, TinyGPT(20))
    _unlistable(monkeypatch, out)
    with pytest.raises(CheckpointError, match="cannot be listed") as raised:
        manager.resume("auto")
    assert str(out) in str(raised.value) and "step 0" in str(raised.value)


def test_atomic_write_leaves_the_old_file_when_the_save_fails(tmp_path):
    target = tmp_path / "model.pt"
    ck.atomic_torch_save({"w": torch.ones(3)}, target)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ck.atomic_torch_save({"w": torch.zeros(3), "x": Boom()}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


# ----------------------------------------------------------------- exact resume


def _run(out: Path, total: int, stop_after: int | None, resume: bool) -> dict[int, float]:
    """A real loop: dropout (torch RNG), shuffling (numpy), noise (python), AMP scaler on
    the CPU, patched clipping counters; checkpoint every 3 steps."""
    torch.manual_seed(1234 if not resume else 999)  # a resumed process starts elsewhere
    np.random.seed(7 if not resume else 99)
    random.seed(3 if not resume else 33)
    model = TinyGPT(20, dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sched = _warmup(opt, 5)
    scaler = patches.advanced.SafeGradScaler("cpu", init_scale=64.0, growth_interval=2)
    data = torch.randint(0, 20, (24, 6), generator=torch.Generator().manual_seed(0))
    manager = CheckpointManager(out, keep=2)
    step, epoch, pos = 0, 0, 0
    if resume:
        path = manager.resume("auto")
        report = load_checkpoint(path, model, opt, sched, scaler)
        step, epoch, pos = report.step, report.extra["epoch"], report.extra["pos"]
    losses: dict[int, float] = {}
    while step < total:
        order = np.random.RandomState(epoch).permutation(len(data))
        while pos < len(order) and step < total:
            batch = data[torch.from_numpy(order[pos:pos + 4])]
            noise = random.random() * 1e-3
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(batch)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 20), batch.reshape(-1))
            loss = loss + noise + float(np.random.rand()) * 1e-3
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            patches.advanced.safe_clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            pos += 4
            losses[step] = loss.item()
            if step % 3 == 0:
                manager.save(step, model, opt, sched, scaler, epoch=epoch, pos=pos)
            if stop_after is not None and step == stop_after:
                return losses
        if pos >= len(order):
            epoch, pos = epoch + 1, 0
    return losses


def test_interrupted_and_resumed_run_has_the_same_losses_step_by_step(tmp_path):
    from patches import grad_clip

    grad_clip._counts().device.reset()
    reference = _run(tmp_path / "a", total=20, stop_after=None, resume=False)
    ref_counts = patches.stats()["grad_clip"]["nonfinite_norms"], grad_clip._counts().device.read()
    grad_clip._counts().device.reset()
    first = _run(tmp_path / "b", total=20, stop_after=11, resume=False)  # killed at 11, last ckpt 9
    grad_clip._counts().device.load({"nonfinite_norms": 5})  # garbage a new process would not have
    second = _run(tmp_path / "b", total=20, stop_after=None, resume=True)
    assert min(second) == 10
    for step in range(1, 21):
        got = first[step] if step <= 9 else second[step]
        assert got == reference[step], f"step {step}: {got!r} != {reference[step]!r}"
    assert first[10] == second[10] and first[11] == second[11]
    assert grad_clip._counts().device.read() == ref_counts[1]


def test_a_folder_of_consolidated_weights_is_named_as_such_not_a_torn_sharded_save(tmp_path) -> None:
    """DeepSpeed's zero_to_fp32 writes OUT/pytorch_model.bin (the path the library's own
    DeepSpeed refusal recommends): the folder is no incomplete sharded save; the error names
    the file to pass."""
    import torch

    import patches

    model = torch.nn.Linear(3, 3)
    out = tmp_path / "consolidated"
    out.mkdir()
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    with pytest.raises(patches.CheckpointError) as raised:
        patches.load_checkpoint(out, model)
    message = str(raised.value)
    assert "is no DCP save" in message and "commit marker (its save did not" not in message
    assert f"load_checkpoint('{out / 'pytorch_model.bin'}', model, ...)" in message
    report = patches.load_checkpoint(out / "pytorch_model.bin", model)
    assert report.parts["model"].status == "restored"
