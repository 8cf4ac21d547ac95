"""Gradient accumulation under DDP and FSDP2 (ranks started as torchrun starts them, gloo, 2 ranks, 4 micro-batches a
step): a NaN loss in one micro-batch of one rank, in a ``no_sync`` micro-batch or in the
final synced one, never hangs the job, and every rank ends with the same parameters as a
run in which that micro-batch contributed exactly nothing."""

from __future__ import annotations

import pytest
import torch

import jobs

SCRIPT = jobs.HERE / "ranks" / "accum_nan.py"
# rank -> its left-out micro-batches (accum_nan.BAD): 3 of its own + 4 at the all-bad step
LEFT_OUT = {0: 2 + 4, 1: 3 + 4}


@pytest.mark.parametrize("mode", ["ddp_nosync", "ddp_sync", "fsdp2"])
def test_a_nan_micro_batch_on_one_rank_is_left_out_alike_everywhere(tmp_path, mode: str) -> None:
    jobs.ranks(SCRIPT, mode, str(tmp_path), timeout=180)  # a hang fails here
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    for rank, result in enumerate(results):
        stats = result["stats"]
        assert (stats["steps"], stats["skipped"]) == (9, 0)
        assert stats["skipped_micro_batches"] == stats["nonfinite_losses"] == LEFT_OUT[rank]
        assert all(e["micro_batch"] and e["kind"] == "nonfinite_loss"
                   for e in result["events"])
        assert len(result["events"]) == LEFT_OUT[rank]
        for name, value in result["guarded"].items():
            assert bool(torch.isfinite(value).all()), name
            # exact: the run whose bad micro-batches added a zero gradient (and which took
            # no optimizer step where every micro-batch of every rank was bad)
            assert torch.equal(value, result["reference"][name]), name
    for name, value in results[0]["guarded"].items():
        assert torch.equal(value, results[1]["guarded"][name]), name
