"""accelerate's own GradScaler creation sites (``Accelerator.__init__`` with fp16): each
one builds a SafeGradScaler once the patches are applied. Called directly: accelerate
builds a scaler only on a GPU, and the sites are what it calls there."""

from __future__ import annotations

import warnings

import pytest

import patches

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import DistributedType  # noqa: E402



def _built(factory, *args, **kwargs):
    with warnings.catch_warnings():  # "CUDA is not available, disabling" on a CPU machine
        warnings.simplefilter("ignore")
        return factory(*args, **kwargs)


def test_ddp_scaler_is_safe() -> None:
    from accelerate.utils.modeling import get_grad_scaler

    assert not isinstance(_built(get_grad_scaler, DistributedType.MULTI_GPU),
                          patches.advanced.SafeGradScaler)  # the control
    patches.advanced.apply()
    scaler = _built(get_grad_scaler, DistributedType.MULTI_GPU, init_scale=512.0)
    assert isinstance(scaler, patches.advanced.SafeGradScaler)


def test_fsdp2_scaler_is_safe() -> None:
    """accelerate imports FSDP2's scaler class from torch.amp.grad_scaler: the integration
    replaces the function Accelerator.__init__ calls."""
    import accelerate.accelerator as acc

    assert not isinstance(_built(acc.get_fsdp2_grad_scaler, device="cuda"),
                          patches.advanced.SafeGradScaler)
    patches.advanced.apply()
    scaler = _built(acc.get_fsdp2_grad_scaler, device="cuda")
    assert isinstance(scaler, patches.advanced.SafeGradScaler)
    assert ("accelerate.accelerator.get_fsdp2_grad_scaler"
            in patches.advanced.applied()["grad_scaler"])
    patches.revert()
    assert not isinstance(_built(acc.get_fsdp2_grad_scaler, device="cuda"),
                          patches.advanced.SafeGradScaler)


def test_fsdp1_sharded_scaler_is_safe() -> None:
    from accelerate.utils.modeling import get_grad_scaler

    patches.advanced.apply()
    scaler = _built(get_grad_scaler, DistributedType.FSDP)
    assert isinstance(scaler, patches.advanced.SafeGradScaler)
