"""No collective of SafeGradScaler's own under DDP (issue 41): where DDP reduced every
gradient the scaler checks, each rank's overflow check already sees the same reduced
gradients, so a patched loss-scaled DDP step makes exactly the collectives (counted with
torch's profiler, gloo, 2 ranks) and the host reads of one under torch's GradScaler, and an
overflow on one rank (a NaN gradient before the reduction, a NaN loss) is still skipped by
both. Where DDP did not reduce them all (a parameter outside the DDP module, a step of
no_sync backwards only, the user's own comm hook) the scaler keeps its one all-reduce and
the ranks agree; where ranks decided differently (a gradient edited on one rank after the
reduction) every rank stops at the next step, naming it."""

from __future__ import annotations

import pytest
import torch

import jobs

SCRIPT = jobs.HERE / "ranks" / "ddp_scaler_collectives.py"
STEPS = 4  # the counted steps of each setting


def _results(tmp_path, *args: str) -> list[dict]:
    return jobs.rank_results(SCRIPT, tmp_path, *args)


@pytest.mark.parametrize("variant", ["foreach", "fused"])
def test_a_scaled_ddp_step_makes_the_collectives_of_an_unpatched_one(tmp_path,
                                                                     variant: str) -> None:
    results = _results(tmp_path, "count", variant)
    for result in results:
        assert result["scaler_class"] == "SafeGradScaler"
        assert result["unpatched"] >= STEPS * 2  # several buckets a step
        assert result["patched"] == result["unpatched"], result
        assert result["same_weights"]  # the carried flags change no gradient
        unpatched_reads, patched_reads = result["reads"]  # tensor-to-host copies of a step
        assert patched_reads == unpatched_reads, result["reads"]
        # rank 0 overflows alone (before the reduction, a NaN loss): one step's collectives,
        # and that step skipped on both ranks
        assert result["before"] == result["nan_loss"] == result["unpatched"] // STEPS
        assert result["before_unchanged"] and result["nan_loss_unchanged"]
        # no_sync micro-batches, then a synced one: the same collectives as torch's scaler
        assert result["accum_patched"] == result["accum_unpatched"]
        assert result["stats"]["skipped"] == 2
    assert results[0]["scale"] == results[1]["scale"]
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name


def test_gradients_ddp_did_not_reduce_keep_the_scalers_all_reduce(tmp_path) -> None:
    results = _results(tmp_path, "fallback")
    for result in results:
        unpatched, patched = result["outside"]
        assert patched == unpatched + STEPS  # one agreement a step
        assert result["outside_unchanged"]  # rank 0's overflow outside DDP: both skipped
        # a step of no_sync backwards only: no bucket reduced, the scaler's agreement alone
        assert result["nosync_synced"] >= 2 and result["nosync_only"] == 1, result
        assert result["nosync_stats"]["skipped"] == 1
        unpatched, patched = result["userhook"]
        assert patched == unpatched + STEPS
    for name, value in results[0]["outside_params"].items():
        assert torch.equal(value, results[1]["outside_params"][name]), name


@pytest.mark.parametrize("variant", ["foreach", "fused"])
def test_a_gradient_edited_after_the_reduction_on_one_rank_stops_every_rank(tmp_path,
                                                                            variant: str) -> None:
    for result in _results(tmp_path, "edit", variant):
        raised = result.get("raised", "")
        assert raised.startswith("RanksDivergedError: ") and \
            "did not all take the same decision" in raised, result
