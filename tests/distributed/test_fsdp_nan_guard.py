"""NaN guard under DDP and FSDP2 (ranks started as torchrun starts them, gloo, 2 ranks, AdamW with weight decay): a NaN
loss on rank 0 and a NaN gradient on rank 1 at known steps are skipped by both ranks, exactly
(parameters equal to a run where those steps never happened), with per-rank evidence."""

from __future__ import annotations

import pytest
import torch

import jobs

SCRIPT = jobs.HERE / "ranks" / "fsdp_nan.py"
LOSS_STEPS, GRAD_STEPS = {3, 8}, {5, 10}


@pytest.mark.parametrize("mode,variant", [("fsdp2", "foreach"), ("fsdp2", "forloop"),
                                          ("fsdp2", "fused"), ("ddp", "foreach")])
def test_nan_on_one_rank_is_skipped_exactly_on_both(tmp_path, mode: str, variant: str) -> None:
    jobs.ranks(SCRIPT, mode, str(tmp_path), variant, timeout=240)
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    for rank, result in enumerate(results):
        stats = result["stats"]
        # DDP: rank 1's NaN gradient is made before the sync, which brings it to rank 0's
        # own gradient: rank 0 sees it itself (fsdp_nan.py says why)
        peer_skips = 0 if mode == "ddp" and rank == 0 else 2
        assert (stats["steps"], stats["skipped"], stats["peer_skips"]) == (12, 4, peer_skips)
        assert stats["nonfinite_losses"] == (2 if rank == 0 else 0)
        kinds = {event["step"]: event["kind"] for event in result["events"]}
        mine, peers = (LOSS_STEPS, GRAD_STEPS) if rank == 0 else (GRAD_STEPS, LOSS_STEPS)
        if mode == "ddp" and rank == 0:
            mine, peers = LOSS_STEPS | GRAD_STEPS, set()
        assert {step: kinds[step] for step in peers} == dict.fromkeys(peers, "peer_nonfinite")
        assert all(kinds[step] in ("nonfinite_loss", "nonfinite_grad") for step in mine)
        assert sorted(kinds) == sorted(LOSS_STEPS | GRAD_STEPS)
        for event in result["events"]:
            if event["kind"] == "peer_nonfinite":
                assert "nonfinite_grads" not in event  # no bogus gradient list
        for name, value in result["guarded"].items():
            assert bool(torch.isfinite(value).all()), name
            # exact skips: the same as a run in which the bad steps never happened
            assert torch.equal(value, result["reference"][name]), name
    for name, value in results[0]["guarded"].items():
        assert torch.equal(value, results[1]["guarded"][name]), name
