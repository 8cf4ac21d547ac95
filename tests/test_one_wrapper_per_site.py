"""One wrapper per upstream site (issue 40, item 5): a name several patches want is declared
once, naming them all, and holds one replacement over the original; each patch's part of it
runs only while that patch is applied, so reverting one drops its part and keeps the others'.
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

import patches
from patches import _registry
from patches._interrupt import TrainingInterrupted
from patches._registry import Integration, Site

xtts = pytest.mark.xtts  # the tests that import coqui-tts-trainer


def test_every_upstream_name_is_declared_by_one_site() -> None:
    owners: dict[tuple[str, str], list[str]] = {}
    for name, spec in _registry.specs().items():
        for site in spec.sites:
            owners.setdefault(site.key, []).append(name)
    for name, integ in _registry.integrations().items():
        for site in integ.sites:
            owners.setdefault(site.key, []).append(name)
    twice = {f"{m}.{a}": by for (m, a), by in owners.items() if len(by) > 1}
    assert not twice, f"declared by more than one Site (one wrapper each): {twice}"


def test_a_second_site_at_a_declared_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_registry, "_integrations", dict(_registry._integrations))
    again = Integration("tp_second_site", "tp-second-site", ">=1", sites=(
        Site("trainer.trainer", "Trainer.train_step", lambda original: original,
             patch="learning"),))
    with pytest.raises(ValueError, match="coqui_trainer declares already"):
        _registry.register_integration(again)


@pytest.fixture
def shared_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An upstream module whose ``step`` one Site serves for nan_guard and oom_guard: its
    wrapper appends the name of each applied patch it does the work of."""
    (tmp_path / "tp_shared_upstream.py").write_text(textwrap.dedent("""
        def step():
            return "upstream"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(original):
        @functools.wraps(original)
        def step():
            return original() + "".join(f"+{name}" for name in ("nan_guard", "oom_guard")
                                        if _registry.active(name))
        return step

    integ = Integration("tp_shared", "tp-shared-dist", ">=1", sites=(
        Site("tp_shared_upstream", "step", make, patch=("nan_guard", "oom_guard"),
             lost={"nan_guard": "the guard's part", "oom_guard": "the OOM part"}),))
    monkeypatch.setitem(_registry._integrations, "tp_shared", integ)
    import tp_shared_upstream

    yield tp_shared_upstream
    patches.revert()  # while the integration is still declared
    sys.modules.pop("tp_shared_upstream", None)


def test_a_shared_site_lands_with_its_first_patch_and_goes_with_its_last(
        shared_site: types.ModuleType) -> None:
    original = shared_site.step
    patches.advanced.apply(["nan_guard"])
    assert shared_site.step() == "upstream+nan_guard"
    assert shared_site.step.__wrapped__ is original
    patches.advanced.apply(["oom_guard"])
    assert shared_site.step() == "upstream+nan_guard+oom_guard"
    assert shared_site.step.__wrapped__ is original  # made again, over the original
    assert patches.status("tp_shared")["landed"] == ["tp_shared_upstream.step"]
    for name in ("nan_guard", "oom_guard"):
        assert "tp_shared_upstream.step" in patches.status(name)["landed"]
    patches.revert(["nan_guard"])
    assert shared_site.step() == "upstream+oom_guard"
    assert shared_site.step.__wrapped__ is original
    patches.revert(["oom_guard"])
    assert shared_site.step is original


def test_a_shared_site_that_cannot_land_says_what_each_patch_loses(
        shared_site: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(shared_site, "step")
    patches.advanced.apply(["nan_guard", "oom_guard"])
    lost = {p.patch: p.message for p in _registry.problems("tp_shared")}
    assert set(lost) == {"nan_guard", "oom_guard"}
    assert lost["nan_guard"].endswith("NOT protected: the guard's part")
    assert lost["oom_guard"].endswith("NOT protected: the OOM part")
    assert patches.status("nan_guard")["state"] == "degraded"


def test_the_deprecated_cuda_scaler_is_the_applied_patches_class() -> None:
    from patches.autocast import CudaGradScaler
    from patches.grad_scaler import CudaSafeGradScaler

    original = patches.advanced.get_original("torch.cuda.amp", "GradScaler")
    for first, second in (("autocast", "grad_scaler"), ("grad_scaler", "autocast")):
        patches.advanced.apply([first])
        patches.advanced.apply([second])
        assert torch.cuda.amp.GradScaler is CudaSafeGradScaler
        patches.revert(["grad_scaler"])  # autocast alone: the modern class, no FutureWarning
        assert torch.cuda.amp.GradScaler is CudaGradScaler
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            torch.cuda.amp.GradScaler(enabled=False)
        patches.revert(["autocast"])
        assert torch.cuda.amp.GradScaler is original


# -- the coqui Trainer: train_step was three wrappers deep, fit two -----------------------

@pytest.fixture
def coqui_trainer_class():
    pytest.importorskip("trainer")
    import trainer.trainer

    return trainer.trainer.Trainer


@xtts
def test_each_coqui_site_is_one_wrapper_over_the_original(coqui_trainer_class) -> None:
    originals = {attr: coqui_trainer_class.__dict__[attr] for attr in ("train_step", "fit")}
    patches.advanced.apply()
    for revert in ([], ["oom_guard"], ["checkpoint"]):
        patches.revert(revert)
        for attr, original in originals.items():
            wrapper = coqui_trainer_class.__dict__[attr]
            assert wrapper is not original and wrapper.__wrapped__ is original, (attr, revert)
    patches.revert()
    assert all(coqui_trainer_class.__dict__[attr] is original
               for attr, original in originals.items())


class _Trainer:
    """What coqui's ``train_step`` wrapper reads of its Trainer."""

    total_steps_done = 3
    optimizer: list = []
    config = None
    args = types.SimpleNamespace(rank=0)
    output_path = "/nonexistent"


def _step(self, batch):
    """An upstream ``train_step``: a signal comes half-way; a batch that is too big runs out
    of memory."""
    from patches.integrations import coqui_interrupt

    interruption = coqui_interrupt._interruptions.get(self)
    if interruption is not None:
        interruption._on_signal(signal.SIGTERM, None)  # SIGTERM arrives during the step
    if batch.get("too_big"):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    batch["finished"] = True
    return "outputs", "losses"


@xtts
def test_reverting_oom_guard_keeps_the_checkpoint_part_of_train_step(
        coqui_trainer_class, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from patches.integrations import coqui_interrupt, coqui_trainer

    patches.advanced.apply(["nan_guard", "checkpoint", "oom_guard"])
    patches.advanced.set_output_dir(tmp_path)
    train_step = coqui_trainer.make_train_step(_step)  # what the site installs over the original
    trainer = _Trainer()
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert train_step(trainer, {"too_big": True}) == (None, None)  # oom_guard: skipped
    assert "ran out of GPU memory" in caplog.text

    patches.revert(["oom_guard"])
    with pytest.raises(torch.cuda.OutOfMemoryError):  # the OOM catch went with oom_guard
        train_step(trainer, {"too_big": True})
    batch: dict = {}
    with pytest.raises(TrainingInterrupted) as stop:
        with coqui_interrupt.interruptible_run(trainer):
            train_step(trainer, batch)
    assert batch["finished"] and not stop.value.mid_step  # checkpoint: the step ended first

    patches.revert(["checkpoint"])
    batch = {}
    with pytest.raises(TrainingInterrupted):
        with coqui_interrupt.interruptible_run(trainer):  # its run, but train_step's part gone
            train_step(trainer, batch)
    assert "finished" not in batch  # the signal stopped the step half-way
