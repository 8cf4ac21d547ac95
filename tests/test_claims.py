"""Claims that used to survive their own removal, each pinned by a behaviour a user would
notice: how many norm reductions a guarded step makes, how many host reads the guard adds
next to a scaler, and how large a new vocabulary row's first Adam update is."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from sync_count import count_host_reads
from tiny_models import TinyTextModel
from torch import nn

import patches
from patches import _step, grad_clip, nan_guard



def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _count_norms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count total-norm reductions made by the clip and by the guard."""
    counter = [0]
    for module in (grad_clip, nan_guard):
        original = module.get_total_norm

        def counted(*args: object, _o: Callable[..., torch.Tensor] = original,
                    **kwargs: object) -> torch.Tensor:
            counter[0] += 1
            return _o(*args, **kwargs)
        monkeypatch.setattr(module, "get_total_norm", counted)
    return counter


def _clipped_steps(steps: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def test_the_guard_reuses_the_clips_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    patches.advanced.apply(["grad_clip", "nan_guard"])
    counter = _count_norms(monkeypatch)
    _clipped_steps(5)
    assert counter[0] == 5  # one reduction per step serves the clip and the guard


def test_without_the_reuse_the_guard_reduces_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the same loop with the guard's reuse switched off makes two per step."""
    patches.advanced.apply(["grad_clip", "nan_guard"])
    counter = _count_norms(monkeypatch)
    monkeypatch.setattr(_step.context(), "take_clip", lambda grads: None)
    _clipped_steps(5)
    assert counter[0] == 10


def _scaled_steps(scaler: torch.amp.GradScaler, steps: int,
                  monkeypatch: pytest.MonkeyPatch) -> int:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [torch.randn(8, 16) for _ in range(steps + 1)]
    # one warm-up step outside the count (first-use allocations)
    for x in data[:1]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    with monkeypatch.context() as m:
        counter = count_host_reads(m)
        for x in data[1:]:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return counter[0]


def test_guard_and_scaler_add_no_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    torch_reads = _scaled_steps(torch.amp.GradScaler("cpu"), 10, monkeypatch)
    patches.advanced.apply(["grad_scaler", "nan_guard", "grad_clip"])
    scaler = torch.amp.GradScaler("cpu")
    assert type(scaler).__name__ == "SafeGradScaler"
    patched_reads = _scaled_steps(scaler, 10, monkeypatch)
    assert patched_reads == torch_reads  # the same reads torch's own scaler makes


def test_a_guard_that_checked_scaler_steps_would_read_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: without the rule that steps a scaler checks are left to it, the guard
    adds its own read to every scaled step."""
    torch_reads = _scaled_steps(torch.amp.GradScaler("cpu"), 10, monkeypatch)
    patches.advanced.apply(["grad_scaler", "nan_guard", "grad_clip"])
    monkeypatch.setattr(nan_guard, "_protected", lambda optimizer, kwargs: False)
    reads = _scaled_steps(torch.amp.GradScaler("cpu"), 10, monkeypatch)
    assert reads == torch_reads + 10  # one more per step


# -- new vocabulary rows: the first Adam update at a realistic step count -------------------

def _Vocab(rows: int) -> TinyTextModel:
    return TinyTextModel(rows, 16, hidden=False)


def _first_update_ratio(tmp_path: Path, old: int = 24, new: int = 32,
                        steps: int = 3000) -> float:
    """Train ``steps`` steps on ``old`` tokens, grow to ``new`` with remap, take one step on
    all tokens: the mean update size of a new embedding row over that of an old row."""
    torch.manual_seed(0)
    model = _Vocab(old)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, old, (8, 4))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = patches.CheckpointManager(tmp_path / "run").save(steps, model, opt)
    grown = _Vocab(new)
    grown_opt = torch.optim.Adam(grown.parameters(), lr=1e-3)
    # mean rows isolate the moments: rows that start apart (spread, romanized) get larger
    # gradients on their first step, whatever their moments hold
    patches.load_checkpoint(path, grown, grown_opt, policy="remap", freeze=False,
                            restore_rng=False, row_init="mean", head_row_init="mean")
    before = grown.text_embedding.weight.detach().clone()
    ids = torch.arange(new).repeat(2).reshape(8, -1)
    loss = nn.functional.cross_entropy(grown(ids).flatten(0, 1), ids.flatten())
    grown_opt.zero_grad()
    loss.backward()
    grown_opt.step()
    moved = (grown.text_embedding.weight.detach() - before).abs().mean(dim=1)
    return float(moved[old:].mean() / moved[:old].mean())


@pytest.mark.slow  # trains two small models (2 s): not in the unit tier
def test_new_rows_first_update_is_like_an_old_rows(tmp_path: Path) -> None:
    ratio = _first_update_ratio(tmp_path)
    assert ratio < 3.0


@pytest.mark.slow  # trains two small models (2 s): not in the unit tier
def test_zero_seeded_second_moments_make_new_rows_jump(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: new rows' second moment seeded with zeros (what padding does)."""
    import patches.vocab_resize as vocab_resize

    original = vocab_resize.grow_moment
    monkeypatch.setattr(
        vocab_resize, "grow_moment",
        lambda old, plan, second_moment: original(old, plan, second_moment=False))
    import patches.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "grow_moment", vocab_resize.grow_moment, raising=False)
    ratio = _first_update_ratio(tmp_path)
    assert ratio > 10.0
