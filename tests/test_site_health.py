"""Loud failure: a missing or failing site, an unsupported upstream or a missing private
torch name is a WARNING in the banner, a degraded status, and an error in strict mode;
never a broken user import and never silence."""

from __future__ import annotations

import gc
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import patches
from patches import _options, _registry
from patches._registry import Integration, Site

xtts = pytest.mark.xtts  # the tests that take coqui_trainer_module


@pytest.fixture
def coqui_trainer_module():
    pytest.importorskip("trainer")
    import trainer.trainer

    return trainer.trainer


@xtts
def test_renamed_upstream_site_is_a_banner_warning_and_degrades(
        coqui_trainer_module, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # what a future coqui-tts-trainer that renamed _compute_loss looks like
    monkeypatch.delattr(coqui_trainer_module.Trainer, "_compute_loss")
    caplog.set_level(logging.INFO, logger="training_patches")
    patches.advanced.apply()
    banner = [r for r in caplog.records if "applying training patches" in r.getMessage()]
    assert len(banner) == 1 and banner[0].levelno == logging.WARNING
    text = banner[0].getMessage()
    assert "WARNING nan_guard: trainer.trainer.Trainer._compute_loss does not exist" in text
    assert "coqui-tts-trainer" in text and "NOT protected" in text
    assert "[on!] nan_guard" in text
    assert not patches.advanced.is_applied("nan_guard")
    assert not patches.advanced.is_applied("coqui_trainer")
    state = patches.status("nan_guard")
    assert state["state"] == "degraded"
    assert "trainer.trainer.Trainer._compute_loss (NOT APPLIED: missing)" in \
        patches.advanced.applied()["nan_guard"]
    # the sites that exist still landed
    assert "trainer.trainer.Trainer.detach_loss_dict" in state["landed"]
    assert patches.advanced.is_applied("grad_clip")


@xtts
def test_renamed_site_in_strict_mode_raises(coqui_trainer_module,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(coqui_trainer_module, "get_last_checkpoint")
    with pytest.raises(patches.advanced.PatchSiteError, match="get_last_checkpoint"):
        patches.advanced.apply(strict=True)


@xtts
def test_leaving_the_integration_off_keeps_the_torch_level_patch(
        coqui_trainer_module, monkeypatch: pytest.MonkeyPatch) -> None:
    original = coqui_trainer_module.Trainer.__dict__["_compute_loss"]
    monkeypatch.setenv("TRAINING_PATCHES_DISABLE", "coqui_trainer")
    patches.advanced.apply()
    assert coqui_trainer_module.Trainer.__dict__["_compute_loss"] is original
    assert patches.advanced.is_applied("nan_guard")
    assert not patches.advanced.is_applied("coqui_trainer")
    assert patches.status("coqui_trainer")["state"] == "off"
    # the torch-level guard still skips a NaN step
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    (p.sum() * float("nan")).backward()
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


@xtts
def test_unsupported_upstream_version_is_loud(coqui_trainer_module,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    # the imported trainer package says which version runs (not the package metadata)
    monkeypatch.setattr(sys.modules["trainer"], "__version__", "0.9.1")
    caplog.set_level(logging.INFO, logger="training_patches")
    patches.advanced.apply()
    assert "coqui-tts-trainer 0.9.1 is what this process runs (trainer.__version__ of the " \
           "imported trainer at " in caplog.text
    assert "integration coqui_trainer supports coqui-tts-trainer >=0.3,<0.5" in caplog.text
    assert patches.status("coqui_trainer")["state"] == "degraded"
    assert not patches.advanced.is_applied("coqui_trainer")
    patches.revert()
    with pytest.raises(patches.advanced.PatchSiteError, match="0.9.1"):
        patches.advanced.apply(strict=True)


def test_a_make_that_raises_never_breaks_the_users_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "fake_upstream_mod.py").write_text(textwrap.dedent("""
        def step():
            return "upstream"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken(original):
        raise RuntimeError("cannot wrap this")

    integ = Integration("fake_upstream", "fake-upstream-dist", ">=1", sites=(
        Site("fake_upstream_mod", "step", broken, patch="nan_guard", lost="fake protection"),))
    monkeypatch.setitem(_registry._integrations, "fake_upstream", integ)
    patches.advanced.apply(["nan_guard"])
    caplog.set_level(logging.WARNING, logger="training_patches")
    import fake_upstream_mod  # the user's import: must work, with the original in place

    assert fake_upstream_mod.step() == "upstream"
    assert "fake_upstream_mod.step could not be patched (RuntimeError: cannot wrap this)" \
        in caplog.text and "fake protection" in caplog.text
    assert patches.status("nan_guard")["state"] == "degraded"
    sys.modules.pop("fake_upstream_mod", None)


def test_a_missing_private_torch_name_turns_off_only_the_scaler(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import torch.amp.grad_scaler as tgs

    monkeypatch.delattr(tgs, "_refresh_per_optimizer_state")
    caplog.set_level(logging.INFO, logger="training_patches")
    patches.advanced.apply()
    assert "[OFF] grad_scaler" in caplog.text
    assert "lacks torch.amp.grad_scaler._refresh_per_optimizer_state" in caplog.text
    assert not patches.advanced.is_applied("grad_scaler")
    assert patches.status("grad_scaler")["state"] == "degraded"
    assert torch.amp.GradScaler is patches.advanced.get_original("torch.amp", "GradScaler")
    assert patches.advanced.is_applied("nan_guard") and patches.advanced.is_applied("grad_clip")


def test_reapplying_changes_only_that_patch_and_logs_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="training_patches")
    patches.advanced.apply(["nan_guard"], max_bad_steps=5)
    patches.advanced.apply(["grad_clip"])  # never touches nan_guard's options
    assert _options.current().max_bad_steps == 5
    patches.advanced.apply(["nan_guard"], max_bad_steps=7)
    assert _options.current().max_bad_steps == 7
    assert "nan_guard options changed: max_bad_steps 5 -> 7" in caplog.text
    sites = patches.advanced.applied()["nan_guard"]
    assert sites.count("torch.optim.lr_scheduler.LRScheduler.step") == 1


def test_freezes_leave_no_global_hook_behind() -> None:
    from torch.optim import optimizer as torch_optimizer

    from patches import vocab_freeze

    before = len(torch_optimizer._global_optimizer_post_hooks)
    for _ in range(100):
        model = torch.nn.Module()
        model.text_embedding = torch.nn.Embedding(10, 4)
        model.text_head = torch.nn.Linear(4, 10)
        patches.advanced.freeze_base_vocab(model, 8)
    assert len(torch_optimizer._global_optimizer_post_hooks) <= before + 1
    del model
    gc.collect()
    assert vocab_freeze.live_freezes() == []


@pytest.mark.slow
def test_records_reach_logging_configured_after_the_import_line(tmp_path: Path) -> None:
    import subprocess

    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from utils import training_patches   # first line, logging not configured yet
        import logging
        logging.basicConfig(filename={str(tmp_path / 'user.log')!r}, level=logging.INFO)
        logging.getLogger("training_patches").warning("a record after the user's config")
    """)
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith("TRAINING_PATCHES_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "applying training patches" in result.stderr  # visible with nothing configured
    assert "a record after the user's config" in (tmp_path / "user.log").read_text()
    assert "a record after the user's config" not in result.stderr  # no duplicate on stderr


def test_activation_reads_versions_without_packaging_or_the_email_parser(monkeypatch) -> None:
    """Issue 41: every integration's range is compared without importing ``packaging``
    (about 5 ms of the import line) and each version read from its metadata's header
    without importlib's email parsing; the answers are packaging's and importlib's."""
    import email
    import importlib.metadata

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from patches import _upstream

    ranges = sorted({integ.supported for integ in _registry.integrations().values()}
                    | {"==1.2", ">1.2", "<=2.0.0"})
    versions = ["0.3", "0.4.9", "0.5", "1", "1.0.0", "1.2", "1.2.0", "1.2.1", "2.0.0.0", "2.6.5",
                "2.7", "0.28.0", "0.29", "4.57.0", "5.24.0", "6", "0.19.0", "0.20"]
    expected = {(v, r): Version(v) in SpecifierSet(r) for v in versions for r in ranges}
    names = [d for d in ("torch", "wrapt", "packaging") if _upstream.distribution_version(d)]
    known = {d: importlib.metadata.version(d) for d in names}
    _upstream.distribution_version.cache_clear()
    for name in ("packaging", "packaging.specifiers", "packaging.version"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    monkeypatch.setattr(email, "message_from_string", None)  # importlib's parser: unusable
    try:
        assert {(v, r): _upstream.version_in(v, r) for v in versions for r in ranges} == expected
        assert {d: _upstream.distribution_version(d) for d in names} == known
    finally:
        _upstream.distribution_version.cache_clear()
    with pytest.raises(ImportError):  # an unusual version still goes to packaging
        _upstream.version_in("1.0rc1", ">=1.0")
