"""clip_grad_norm_ after activation: clips the true gradients, survives non-finite norms."""

from __future__ import annotations

import pytest
import torch

import patches
from patches import SafeGradScaler


@pytest.fixture
def clip_patch(clean_patches: None) -> None:
    patches.apply(["grad_clip"])


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


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
    original = patches.get_original("torch.nn.utils", "clip_grad_norm_")
    original([good, bad], max_norm=1.0)
    assert not torch.isfinite(good.grad).all()


def test_finite_norm_clips_exactly_like_torch(clip_patch: None) -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for pa, pb in zip(a, b):
        pa.grad = torch.randn_like(pa) * 10
        pb.grad = pa.grad.clone()
    original = patches.get_original("torch.nn.utils", "clip_grad_norm_")
    norm_a = torch.nn.utils.clip_grad_norm_(a, 0.5)
    norm_b = original(b, 0.5)
    assert torch.equal(norm_a, norm_b)
    for pa, pb in zip(a, b):
        assert torch.equal(pa.grad, pb.grad)


def _step(model: torch.nn.Module, scaler: SafeGradScaler | None, unscale: bool) -> torch.Tensor:
    torch.manual_seed(3)
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss(model(x), y) * 50
    if scaler is None:
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        return norm
    scaler.scale(loss).backward()
    if unscale:
        scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    scaler.step(opt)
    scaler.update()
    return norm


@pytest.mark.parametrize("unscale", [False, True], ids=["scaled-grads", "unscaled-first"])
def test_clip_applies_to_true_gradients_under_a_scaler(clip_patch: None, unscale: bool) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(6, 2)

    reference, scaled = model(), model()
    true_norm = _step(reference, None, unscale=False)
    norm = _step(scaled, SafeGradScaler("cpu", init_scale=4096), unscale=unscale)
    assert torch.allclose(norm, true_norm, rtol=1e-5)
    for p, q in zip(scaled.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


def test_error_if_nonfinite_keeps_torch_behaviour(clip_patch: None) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("nan"), 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def test_no_gradients_returns_zero(clip_patch: None) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    assert float(torch.nn.utils.clip_grad_norm_([p], 1.0)) == 0.0
