"""The deprecated AMP names behave as torch.amp's and emit no FutureWarning."""

from __future__ import annotations

import warnings

import pytest
import torch

import patches


@pytest.fixture
def autocast_patch() -> None:
    patches.advanced.apply(["autocast"])


def no_future_warnings(fn) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    assert [w for w in caught if issubclass(w.category, FutureWarning)] == []


def test_cpu_autocast_casts_like_the_modern_one(autocast_patch: None) -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)

    def run() -> None:
        with torch.cpu.amp.autocast():
            old = a @ b
        with torch.amp.autocast("cpu"):
            new = a @ b
        assert old.dtype == new.dtype == torch.bfloat16
        with torch.cpu.amp.autocast(dtype=torch.float16):
            assert (a @ b).dtype == torch.float16
        with torch.cpu.amp.autocast(enabled=False):
            assert (a @ b).dtype == torch.float32
    no_future_warnings(run)


def test_cuda_names_keep_their_arguments(autocast_patch: None) -> None:
    def run() -> None:
        ctx = torch.cuda.amp.autocast(enabled=False, dtype=torch.bfloat16, cache_enabled=False)
        assert isinstance(ctx, torch.amp.autocast)
        assert ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
        with ctx:
            pass
        scaler = torch.cuda.amp.GradScaler(enabled=False)
        assert isinstance(scaler, torch.amp.GradScaler)

        @torch.cuda.amp.autocast(enabled=False)
        def decorated(x: torch.Tensor) -> torch.Tensor:
            return x * 2
        assert decorated(torch.ones(1)).item() == 2.0
    no_future_warnings(run)


def test_custom_fwd_bwd_both_forms(autocast_patch: None) -> None:
    def run() -> None:
        class Double(torch.autograd.Function):
            @staticmethod
            @torch.cuda.amp.custom_fwd
            def forward(ctx, x):  # type: ignore[override]
                return x * 2

            @staticmethod
            @torch.cuda.amp.custom_bwd
            def backward(ctx, g):  # type: ignore[override]
                return g * 2

        class Cast(torch.autograd.Function):
            @staticmethod
            @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)
            def forward(ctx, x):  # type: ignore[override]
                return x + 1

            @staticmethod
            def backward(ctx, g):  # type: ignore[override]
                return g

        x = torch.ones(3, requires_grad=True)
        Double.apply(x).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]
        assert Cast.apply(torch.ones(2)).tolist() == [2.0, 2.0]
    no_future_warnings(run)


def test_unpatched_names_do_warn() -> None:
    with pytest.warns(FutureWarning):
        torch.cpu.amp.autocast()
