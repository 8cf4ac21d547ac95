"""The public API: apply/revert/applied/is_applied/get_original/stats, options, banner."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import patches
from patches import ConfigError, _options, _registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {name for name, spec in _registry.specs().items() if spec.default}


def test_apply_reports_sites_and_revert_restores_identity(clean_patches: None) -> None:
    before = torch.nn.utils.clip_grad_norm_
    result = patches.apply(["grad_clip", "grad_scaler"])
    assert "torch.nn.utils.clip_grad_norm_" in result["grad_clip"]
    assert "torch.GradScaler" in result["grad_scaler"]
    assert patches.is_applied("grad_clip") and not patches.is_applied("autocast")
    assert torch.nn.utils.clip_grad_norm_ is not before
    assert patches.get_original("torch.nn.utils", "clip_grad_norm_") is before
    assert patches.get_original(torch.nn.utils, "clip_grad_norm_") is before
    assert patches.revert() == ["grad_scaler", "grad_clip"]  # registry order
    assert torch.nn.utils.clip_grad_norm_ is before
    assert patches.applied() == {}


def test_default_set_and_disable(clean_patches: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="training_patches")
    applied = patches.apply(disable="grad_clip")
    assert set(applied) == DEFAULTS - {"grad_clip"}
    assert "[off] grad_clip" in caplog.text and "TRAINING_PATCHES_DISABLE" in caplog.text
    assert "[on ] grad_scaler" in caplog.text


def test_options_keyword_beats_environment() -> None:
    env = {"TRAINING_PATCHES_INIT_SCALE": "512", "TRAINING_PATCHES_LOG_INTERVAL": "7"}
    opts = _options.resolve({"init_scale": 64}, env)
    assert opts.init_scale == 64 and opts.log_interval == 7 and opts.growth_interval == 100


@pytest.mark.parametrize("var,value", [
    ("TRAINING_PATCHES_INIT_SCALE", "abc"),
    ("TRAINING_PATCHES_INIT_SCALE", "-4"),
    ("TRAINING_PATCHES_GROWTH_INTERVAL", "0"),
    ("TRAINING_PATCHES_LOG_INTERVAL", "1.5"),
    ("TRAINING_PATCHES_ANOMALY", "maybe"),
])
def test_bad_environment_value_is_a_clear_error(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _options.resolve({}, {var: value})
    message = str(raised.value)
    assert var in message and repr(value) in message and "Expected" in message


def test_unknown_names_are_clear_errors(clean_patches: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        patches.apply(init_scael=3)
    with pytest.raises(ConfigError, match="Known patches"):
        patches.apply(["autocats"])
    monkeypatch.setenv("TRAINING_PATCHES_DISABLE", "grad_clip,nope")
    with pytest.raises(ConfigError, match="nope"):
        patches.apply()
    assert patches.applied() == {}


def test_anomaly_switch_and_context_manager(clean_patches: None) -> None:
    assert not torch.is_anomaly_enabled()
    with patches.enable_anomaly_detection():
        assert torch.is_anomaly_enabled()
    assert not torch.is_anomaly_enabled()
    patches.apply(anomaly=True)
    assert patches.is_applied("anomaly") and torch.is_anomaly_enabled()
    patches.revert("anomaly")
    assert not torch.is_anomaly_enabled()


def test_stats_are_plain_numbers(clean_patches: None) -> None:
    patches.apply()
    scaler = torch.amp.GradScaler("cpu")
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale((p * 2).sum()).backward()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    scaler.step(opt)
    scaler.update()
    stats = patches.stats()
    assert stats["grad_scaler"]["steps"] == 1 and stats["grad_scaler"]["scale"] == 1024.0
    assert stats["grad_clip"]["calls"] >= 1
    for group in stats.values():
        assert all(isinstance(v, (int, float)) for v in group.values())


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env=full_env, timeout=300)


@pytest.mark.slow
def test_activation_line_applies_once_with_banner() -> None:
    result = _run(
        "from utils import training_patches\n"
        "from utils import training_patches as again\n"
        "import importlib, patches\n"
        "importlib.import_module('patches.auto')\n"
        "print(','.join(sorted(patches.applied())))\n")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.strip().split(",")) == DEFAULTS
    assert {"autocast", "grad_scaler", "grad_clip", "nan_guard"} <= DEFAULTS
    assert result.stderr.count("applying training patches") == 1
    assert "[off] anomaly" in result.stderr


@pytest.mark.slow
def test_activation_quiet_and_env_disable() -> None:
    result = _run("from utils import training_patches\nimport patches\n"
                  "print(','.join(sorted(patches.applied())))\n",
                  TRAINING_PATCHES_QUIET="1", TRAINING_PATCHES_DISABLE="autocast")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.strip().split(",")) == DEFAULTS - {"autocast"}
    assert "applying training patches" not in result.stderr


@pytest.mark.slow
def test_activation_with_a_bad_variable_fails_clearly() -> None:
    result = _run("from utils import training_patches", TRAINING_PATCHES_INIT_SCALE="big")
    assert result.returncode != 0
    assert "TRAINING_PATCHES_INIT_SCALE" in result.stderr and "'big'" in result.stderr
