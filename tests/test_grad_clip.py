"""clip_grad_norm_ after activation: survives non-finite norms, and under a loss scaler
clips as torch does (both PyTorch idioms) unless ``clip_unscale_first`` is on."""

from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch

import patches
from patches import _options
from patches.grad_scaler import SafeGradScaler

SCALE = 1024.0
MAX_NORM = 0.05  # true-gradient limit: the model's true norm is ~0.6, so this clips ~10x
LR = 0.5


@pytest.fixture
def clip_patch() -> None:
    patches.advanced.apply(["grad_clip"])


def set_unscale_first(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Turn the ``clip_unscale_first`` option on or off for this test."""
    patches.advanced.apply(["grad_clip"], clip_unscale_first=on)


def model_and_data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(32, 8), torch.randn(32, 4)


def fp32_reference() -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """(clipped gradients, parameters after one SGD step, true norm), by hand in fp32."""
    model, x, y = model_and_data()
    loss = torch.nn.functional.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    coef = min(1.0, MAX_NORM / (float(norm) + 1e-6))
    clipped = [g * coef for g in grads]
    stepped = [p.detach() - LR * g for p, g in zip(model.parameters(), clipped)]
    return clipped, stepped, float(norm)


Clip = Callable[[torch.nn.Module, torch.amp.GradScaler, torch.optim.Optimizer], torch.Tensor]


def fp16_step(scaler: torch.amp.GradScaler, clip: Clip) -> tuple[torch.nn.Module, torch.Tensor]:
    """One fp16-autocast step on CPU: scaled backward, ``clip``, scaler step and update."""
    model, x, y = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    norm = clip(model, scaler, opt)
    scaler.step(opt)  # unscales whatever clip left scaled
    scaler.update()
    return model, norm


def scaled_limit(model: torch.nn.Module, scaler: torch.amp.GradScaler,
                 opt: torch.optim.Optimizer) -> torch.Tensor:
    """PyTorch's idiom on still-scaled gradients (its test_grad_scaling_clipping)."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * scaler.get_scale())


def unscale_then_clip(model: torch.nn.Module, scaler: torch.amp.GradScaler,
                      opt: torch.optim.Optimizer) -> torch.Tensor:
    scaler.unscale_(opt)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def forgot_unscale(model: torch.nn.Module, scaler: torch.amp.GradScaler,
                   opt: torch.optim.Optimizer) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def torch_run(clip: Clip) -> tuple[torch.nn.Module, torch.Tensor]:
    """The same step with torch's own clip_grad_norm_ and torch's own GradScaler."""
    original = patches.advanced.get_original("torch.nn.utils", "clip_grad_norm_")
    saved = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = original
    try:
        return fp16_step(torch.amp.GradScaler("cpu", init_scale=SCALE), clip)
    finally:
        torch.nn.utils.clip_grad_norm_ = saved


def assert_matches_reference(model: torch.nn.Module) -> None:
    clipped, stepped, _ = fp32_reference()
    for p, g, q in zip(model.parameters(), clipped, stepped):
        # fp16 autocast against fp32: a few parts in a thousand; a wrong clip is >= 2x off
        torch.testing.assert_close(p.grad, g, rtol=2e-2, atol=2e-4)
        torch.testing.assert_close(p.detach(), q, rtol=2e-2, atol=2e-4)


def safe_scaler() -> SafeGradScaler:
    return SafeGradScaler("cpu", init_scale=SCALE, growth_interval=1000)


# -- non-finite norms and plain clipping ---------------------------------------

def test_nan_norm_leaves_finite_gradients_intact_and_is_counted(clip_patch: None) -> None:
    good, bad = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    good.grad = torch.full((4,), 3.0)
    bad.grad = torch.tensor([1.0, float("nan"), float("inf"), 1.0])
    before = patches.stats()["grad_clip"]["nonfinite_norms"]
    norm = torch.nn.utils.clip_grad_norm_([good, bad], max_norm=1.0)
    assert not torch.isfinite(norm)
    assert torch.equal(good.grad, torch.full((4,), 3.0))
    assert patches.stats()["grad_clip"]["nonfinite_norms"] == before + 1

    # torch's own clip destroys the finite gradient in the same situation
    original = patches.advanced.get_original("torch.nn.utils", "clip_grad_norm_")
    original([good, bad], max_norm=1.0)
    assert not torch.isfinite(good.grad).all()


def test_finite_norm_clips_exactly_like_torch(clip_patch: None) -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for pa, pb in zip(a, b):
        pa.grad = torch.randn_like(pa) * 10
        pb.grad = pa.grad.clone()
    original = patches.advanced.get_original("torch.nn.utils", "clip_grad_norm_")
    norm_a = torch.nn.utils.clip_grad_norm_(a, 0.5)
    norm_b = original(b, 0.5)
    assert torch.equal(norm_a, norm_b)
    for pa, pb in zip(a, b):
        assert torch.equal(pa.grad, pb.grad)


def test_error_if_nonfinite_keeps_torch_behaviour(clip_patch: None) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("nan"), 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def test_no_gradients_returns_zero(clip_patch: None) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    assert float(torch.nn.utils.clip_grad_norm_([p], 1.0)) == 0.0


# -- under a SafeGradScaler, fp16 autocast on CPU, against fp32 by hand ---------

@pytest.mark.parametrize("clip", [scaled_limit, unscale_then_clip],
                         ids=["max_norm*get_scale-on-scaled", "unscale_-then-max_norm"])
def test_pytorch_idioms_clip_exactly_as_torch(clip_patch: None, clip: Clip) -> None:
    model, norm = fp16_step(safe_scaler(), clip)
    assert_matches_reference(model)

    reference, reference_norm = torch_run(clip)
    assert torch.equal(norm, reference_norm)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad) and torch.equal(p, q)


def test_idioms_clip_exactly_as_torch_with_the_whole_default_set() -> None:
    patches.advanced.apply()  # grad_scaler, nan_guard, ... as a user's import line gives them
    model, _ = fp16_step(torch.GradScaler("cpu", init_scale=SCALE), scaled_limit)
    assert_matches_reference(model)


def test_forgotten_unscale_clips_as_torch_by_default_and_warns_once(
        clip_patch: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="training_patches")
    model, norm = fp16_step(safe_scaler(), forgot_unscale)
    reference, reference_norm = torch_run(forgot_unscale)
    assert torch.equal(norm, reference_norm)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    # which is the trap: the step is about SCALE times smaller than the fp32 one
    clipped, _, _ = fp32_reference()
    shrink = float(torch.linalg.vector_norm(clipped[0]) / torch.linalg.vector_norm(
        next(model.parameters()).grad))
    assert shrink == pytest.approx(SCALE, rel=2e-2)

    warnings = [r for r in caplog.records
                if "TRAINING_PATCHES_CLIP_UNSCALE_FIRST" in r.getMessage()]
    assert len(warnings) == 1 and "unscale_(optimizer)" in warnings[0].getMessage()
    fp16_step(safe_scaler(), forgot_unscale)
    assert len([r for r in caplog.records if "CLIP_UNSCALE_FIRST" in r.getMessage()]) == 1
    assert patches.stats()["grad_clip"]["scaled_clips"] == 2
    assert patches.stats()["grad_clip"]["unscaled_first"] == 0


def test_unscale_then_clip_logs_no_warning(clip_patch: None,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="training_patches")
    fp16_step(safe_scaler(), unscale_then_clip)
    assert not [r for r in caplog.records if r.name == "training_patches"]
    assert patches.stats()["grad_clip"]["scaled_clips"] == 0


def test_forgotten_unscale_clips_true_gradients_with_clip_unscale_first(
        clip_patch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    set_unscale_first(monkeypatch, True)
    model, norm = fp16_step(safe_scaler(), forgot_unscale)
    assert_matches_reference(model)
    _, _, true_norm = fp32_reference()
    assert float(norm) == pytest.approx(true_norm, rel=2e-2)  # the true norm, not SCALE x
    assert patches.stats()["grad_clip"]["unscaled_first"] == 1

    # unscale_ first stays unchanged with the option on: torch's result, bit for bit
    model, norm = fp16_step(safe_scaler(), unscale_then_clip)
    reference, reference_norm = torch_run(unscale_then_clip)
    assert torch.equal(norm, reference_norm)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_clip_unscale_first_combines_unscaled_and_scaled_gradients(
        clip_patch: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two optimizers, one unscaled: the norm is that of all true gradients."""
    set_unscale_first(monkeypatch, True)
    model, x, y = model_and_data()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt_a, opt_b = torch.optim.SGD(first, lr=LR), torch.optim.SGD(second, lr=LR)
    scaler = safe_scaler()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt_a)  # the first layer's gradients are true, the last layer's scaled
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    _, _, true_norm = fp32_reference()
    assert float(norm) == pytest.approx(true_norm, rel=2e-2)
    assert_matches_reference(model)


def test_nonfinite_scaled_gradients_are_left_for_the_scaler_to_skip(clip_patch: None) -> None:
    model, x, y = model_and_data()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = safe_scaler()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    model[2].weight.grad[0, 0] = float("inf")
    kept = model[0].weight.grad.clone()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * scaler.get_scale())
    assert not torch.isfinite(norm)
    assert torch.equal(model[0].weight.grad, kept)  # torch's clip would zero it
    assert patches.stats()["grad_clip"]["nonfinite_norms"] == 1
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler.get_scale() == SCALE / 2


def test_option_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINING_PATCHES_CLIP_UNSCALE_FIRST", "1")
    patches.advanced.apply(["grad_clip"])
    model, _ = fp16_step(safe_scaler(), forgot_unscale)
    assert_matches_reference(model)
    assert _options.current().clip_unscale_first is True
