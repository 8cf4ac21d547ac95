"""Every numeric setting is bounded by what the machine can honour, and a value out of
range is one paragraph when the patches are applied, never a crash at the first step.

The repros of issue 26: ``SPIKE_K=6 SPIKE_WINDOW=100000000000`` tried to allocate 400 GB
at the first step; ``INIT_SCALE=1e300`` failed converting to float32 in the first
``scaler.scale()``; ``GROWTH_INTERVAL``/``HYSTERESIS`` past int64/int32 overflowed in the
first ``update()``. And the other way round: the largest value each range allows trains.
"""

from __future__ import annotations

import math

import pytest
import torch

import patches
from patches import _options
from patches.advanced import ConfigError



def test_every_numeric_option_declares_its_range() -> None:
    unbounded = [name for name, option in _options.OPTIONS.items()
                 if isinstance(option.default, (int, float)) and not isinstance(option.default, bool)
                 and not option.range_text]
    unbounded += [name for name, option in _options.OPTIONS.items()
                  if name == "base_vocab" and not option.range_text]  # default None: off
    assert not unbounded


@pytest.mark.parametrize("env, value, message", [
    ("TRAINING_PATCHES_SPIKE_WINDOW", "100000000000",
     "TRAINING_PATCHES_SPIKE_WINDOW is '100000000000', which is out of range (above 100,000). "
     "Expected a whole number of steps of at least 2, e.g. 100: 2 to 100,000 (the window is a "
     "tensor on the training device"),
    ("TRAINING_PATCHES_INIT_SCALE", "1e300",
     "TRAINING_PATCHES_INIT_SCALE is '1e300', which is out of range (above 3.4e+38). Expected "
     "a number greater than 0, e.g. 1024: 2^-126 to 3.4e+38 (the loss scale is a float32 "
     "tensor: finite, and never rounded to 0)"),
    ("TRAINING_PATCHES_MIN_SCALE", "1e-300", "out of range (below 2^-126)"),
    ("TRAINING_PATCHES_GROWTH_INTERVAL", "100000000000000000000",
     "out of range (above 2^31-1)"),
    ("TRAINING_PATCHES_HYSTERESIS", "2147483648", "out of range (above 2^31-1)"),
    ("TRAINING_PATCHES_MAX_BAD_STEPS", str(2 ** 63), "out of range (above 2^63-1)"),
    ("TRAINING_PATCHES_BASE_VOCAB", str(2 ** 64), "out of range (above 2^63-1)"),
    ("TRAINING_PATCHES_SPIKE_K", "1e300", "out of range (above 1,000,000)"),
    # the lower bounds too, checked once, by the Option's low (issue 40: the parsers no
    # longer repeat them, so these were "not usable" before and never reached the range)
    ("TRAINING_PATCHES_SPIKE_WINDOW", "1", "out of range (below 2)"),
    ("TRAINING_PATCHES_READING_MIN_GAP", "0", "out of range (at or below 0)"),
    ("TRAINING_PATCHES_MAX_DROP_SHARE", "1.5", "out of range (above 1)"),
    # the parsers of whole and positive numbers checked the sign themselves until the third
    # stop of 2026-11-28 ("not usable (expected a whole number of at least 1)")
    ("TRAINING_PATCHES_GROWTH_INTERVAL", "0", "'0', which is out of range (below 1). Expected "
     "a whole number of steps of at least 1, e.g. 100: 1 to 2^31-1"),
    ("TRAINING_PATCHES_MAX_BAD_STEPS", "-3", "out of range (below 1)"),
    ("TRAINING_PATCHES_INIT_SCALE", "0", "out of range (below 2^-126)"),
])
def test_a_value_out_of_range_is_one_paragraph_at_apply(
        monkeypatch: pytest.MonkeyPatch, env: str, value: str, message: str) -> None:
    monkeypatch.setenv(env, value)
    if env == "TRAINING_PATCHES_SPIKE_WINDOW":
        monkeypatch.setenv("TRAINING_PATCHES_SPIKE_K", "6")
    with pytest.raises(ConfigError) as caught:
        patches.advanced.apply()
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert "leave it out to use the default" in text
    assert not patches.advanced.applied()  # nothing applied: the run never reaches its first step


def _fp16_steps(steps: int = 3) -> tuple[torch.nn.Module, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return model, scaler


def test_the_largest_value_of_each_range_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    top = {name: option.high for name, option in _options.OPTIONS.items()
           if option.high is not None}
    top["min_scale"] = _options.FLOAT32_TINY  # at most init_scale
    top["base_vocab"] = None  # a model's rows, not a machine limit: tested in vocab_freeze
    top["max_drop_share"] = 1.0
    patches.advanced.apply(**{k: v for k, v in top.items() if v is not None})
    model, scaler = _fp16_steps()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert scaler.stats()["steps"] == 3 and scaler.get_scale() == _options.FLOAT32_MAX


def test_the_smallest_scale_trains() -> None:
    patches.advanced.apply(init_scale=_options.FLOAT32_TINY, min_scale=_options.FLOAT32_TINY)
    model, scaler = _fp16_steps()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert scaler.stats()["steps"] == 3 and 0 < scaler.get_scale() < math.inf
