"""Count the ways a training step copies a tensor to the host (item, tolist, bool, ...).

On a GPU each of these waits for the device; on the CPU they cost nothing, so tests count
them instead of timing them (the GPU suite in benchmarks/gpu counts real syncs).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch the Tensor methods in :data:`HOST_READS` to count calls; returns the
    one-element counter."""
    counter = [0]
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _o: Callable[..., object] = original,
                    **k: object) -> object:
            counter[0] += 1
            return _o(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return counter
