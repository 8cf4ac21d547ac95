"""Count the ways a training step copies a tensor to the host (item, tolist, bool)."""

from __future__ import annotations

import pytest
import torch


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch Tensor.item/tolist/__bool__ to count calls; returns the one-element counter."""
    counter = [0]
    for name in ("item", "tolist", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _o=original, **k: object) -> object:
            counter[0] += 1
            return _o(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return counter
