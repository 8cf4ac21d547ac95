"""The patched clip_grad_norm_ on FSDP2's DTensor gradients (ranks started as torchrun starts them, gloo, 2 shards),
against torch's own clip_grad_norm_ on copies of the same gradients: the same norm and the
same clipped gradients, with TRAINING_PATCHES_CLIP_UNSCALE_FIRST=1 on the scaled gradients
of a ShardedGradScaler too; a non-finite norm leaves every shard as it was."""

from __future__ import annotations

import math

import pytest
import torch

import jobs

SCRIPT = jobs.HERE / "ranks" / "fsdp_clip.py"


def _results(tmp_path, what: str, unscale_first: str = "0") -> list[dict]:
    env = jobs.rank_env(TRAINING_PATCHES_CLIP_UNSCALE_FIRST=unscale_first)
    jobs.ranks(SCRIPT, what, str(tmp_path), env=env, timeout=180)
    return [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("what,unscale_first", [("plain", "0"), ("unscale_first", "1")])
def test_clip_equals_torch_on_dtensor_gradients(tmp_path, what: str, unscale_first: str) -> None:
    for result in _results(tmp_path, what, unscale_first):
        assert result["types"] == ["DTensor"]
        # unscale-first: the scaled gradients are clipped by the true norm (scale 1024, the
        # safe scaler's default), so they are torch's clip of the true gradients, scaled
        scale = result["scale"]
        assert scale == (1024.0 if what == "unscale_first" else 1.0)
        assert result["torch_norm"] > 0.05  # every gradient was clipped
        assert result["patched_norm"] == result["torch_norm"]
        for patched, ours_before, reference in zip(result["patched"], result["before"],
                                                   result["torch"]):
            assert torch.equal(patched, reference * scale)
            assert not torch.equal(patched, ours_before)
        assert result["clip"]["nonfinite_norms"] == 0
        assert result["clip"]["unscaled_first"] == (what == "unscale_first")


def test_a_nonfinite_norm_leaves_every_shard_as_it_was(tmp_path) -> None:
    for rank, result in enumerate(_results(tmp_path, "nonfinite")):
        assert math.isnan(result["patched_norm"]) and math.isnan(result["torch_norm"])
        assert result["clip"]["nonfinite_norms"] == 1  # counted on both ranks
        for patched, before, reference in zip(result["patched"], result["before"],
                                              result["torch"]):
            assert torch.equal(patched.nan_to_num(), before.nan_to_num())
        # torch's own clip turns this rank's finite gradients into NaN
        assert any(not bool(torch.isfinite(ref[torch.isfinite(b)]).all())
                   for ref, b in zip(result["torch"], result["before"]))
