"""A plain PyTorch loop gets the guard's evidence with no extra calls: events beside its
checkpoints, parameters named by module path, the loss and step recorded; and under
gradient accumulation a non-finite micro-batch is left out exactly."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tiny_models import TinyTextModel
from torch import nn

import patches
from patches import nan_guard



@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch):
    # a plain loop: no coqui Trainer log file left behind by other tests names a folder
    from patches import _run

    monkeypatch.setattr(_run, "_dir_providers", [])


def Tiny() -> TinyTextModel:
    return TinyTextModel(20, 8, hidden=False)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 20, (4, 6), generator=g)
    return ids, ids.roll(1, dims=1)


def _loss(model: nn.Module, i: int, poison: bool) -> torch.Tensor:
    ids, target = _batch(i)
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    return loss * float("nan") if poison else loss


def test_events_go_beside_the_checkpoints_with_names_loss_and_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    patches.advanced.apply()
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for step in range(1, 7):
        loss = _loss(model, step, poison=(step == 4))
        opt.zero_grad()
        loss.backward()  # no observe_loss(): the guard sees the loss here
        opt.step()
        if step == 2:
            torch.save(model.state_dict(), ckpts / f"model_step{step}.pth")
    events = [json.loads(line) for line in (ckpts / "nonfinite_events.jsonl").open()]
    assert len(events) == 1
    event = events[0]
    assert event["kind"] == "nonfinite_loss" and event["loss"] == "NaN"  # strict JSON
    assert event["step"] == 4  # the guard's own count of the loop's optimizer steps
    assert event["trainer_step"] is None  # no integration knows a trainer's counter here
    assert "text_embedding.weight" in event["nonfinite_grads"]
    assert not any(name.startswith("param_groups") for name in event["nonfinite_grads"])
    assert str(ckpts / "nonfinite_events.jsonl") in caplog.text
    assert not (tmp_path / "training_patches").exists()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_without_any_folder_events_go_to_training_patches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    patches.advanced.apply()
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, 0, poison=True).backward()
    opt.step()
    assert (tmp_path / "training_patches" / "nonfinite_events.jsonl").exists()


def test_events_go_beside_the_checkpoint_managers_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """CheckpointManager writes through temporary files (no torch.save path names the
    folder): creating it is enough for the run's reports to go beside its checkpoints,
    before the first save too; ./training_patches/ is never made."""
    from patches.checkpoint import CheckpointManager

    monkeypatch.chdir(tmp_path)
    patches.advanced.apply()
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path / "run_a" / "ckpts", keep=2)
    for step in range(1, 5):
        opt.zero_grad()
        _loss(model, step, poison=(step in (1, 3))).backward()
        opt.step()
        if step == 2:
            manager.save(step, model, opt)
    events = tmp_path / "run_a" / "ckpts" / "nonfinite_events.jsonl"
    assert [json.loads(line)["step"] for line in events.open()] == [1, 3]
    assert str(events) in caplog.text
    assert not (tmp_path / "training_patches").exists()
    assert (tmp_path / "run_a" / "ckpts" / "ckpt_000000002.pt").exists()
    # a folder the user sets still wins
    patches.advanced.set_output_dir(tmp_path / "mine")
    opt.zero_grad()
    _loss(model, 9, poison=True).backward()
    opt.step()
    assert (tmp_path / "mine" / "nonfinite_events.jsonl").exists()


def _accumulate(model: nn.Module, opt: torch.optim.Optimizer, steps: int, micro: int,
                poison: tuple[int, int] | None, leave_out: tuple[int, int] | None) -> None:
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            if leave_out == (step, m):
                continue
            loss = _loss(model, step * micro + m, poison=(poison == (step, m))) / micro
            loss.backward()
        opt.step()


def test_a_nan_micro_batch_is_left_out_and_the_others_are_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    patches.advanced.apply()
    caplog.set_level(logging.WARNING, logger="training_patches")
    torch.manual_seed(0)
    guarded = Tiny()
    reference = Tiny()
    reference.load_state_dict(guarded.state_dict())
    opt = torch.optim.AdamW(guarded.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # step 0 teaches the guard that steps accumulate; the NaN is micro-batch 2 of step 2
    _accumulate(guarded, opt, 4, 4, poison=(2, 2), leave_out=None)
    patches.revert()
    _accumulate(reference, ref_opt, 4, 4, poison=None, leave_out=(2, 2))
    for (name, p), q in zip(guarded.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name  # exactly the run without that micro-batch
    stats = nan_guard.stats()
    assert stats["skipped"] == 0 and stats["skipped_micro_batches"] == 1
    assert stats["nonfinite_losses"] == 1 and stats["steps"] == 4
    assert "left out of the accumulated gradient" in caplog.text
    events = [json.loads(line)
              for line in (tmp_path / "training_patches" / "nonfinite_events.jsonl").open()]
    assert len(events) == 1 and events[0]["micro_batch"] is True and events[0]["step"] == 3


def test_without_the_micro_batch_check_the_whole_step_is_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same NaN with the backward check off costs the whole step."""
    monkeypatch.chdir(tmp_path)
    patches.advanced.apply()
    # the guard without its Tensor.backward site (undone before the patches are reverted)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "backward",
                  patches.advanced.get_original("torch._tensor", "Tensor.backward"))
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _accumulate(model, opt, 4, 4, poison=(2, 2), leave_out=None)
    stats = nan_guard.stats()
    assert stats["skipped"] == 1 and stats["skipped_micro_batches"] == 0
