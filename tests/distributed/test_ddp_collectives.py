"""No collective of the library's own under DDP (issue 41): the NaN guard's skip decision
rides the gradient reduction, so a patched DDP step makes exactly the collectives of an
unpatched one (counted with torch's profiler, gloo, 2 ranks), and still skips a NaN loss on
one rank on both. Where it cannot carry the flag (the user's own comm hook) it says so and
keeps its all-reduce; where ranks decided differently (a gradient edited after the
reduction on one rank) every rank stops at the next step, naming it."""

from __future__ import annotations

import pytest
import torch

import jobs

SCRIPT = jobs.HERE / "ranks" / "ddp_collectives.py"


def _results(tmp_path, *args: str) -> list[dict]:
    return jobs.rank_results(SCRIPT, tmp_path, *args)


@pytest.mark.parametrize("variant", ["foreach", "fused"])
def test_a_patched_ddp_step_makes_the_collectives_of_an_unpatched_one(tmp_path,
                                                                       variant: str) -> None:
    results = _results(tmp_path, "count", variant)
    for rank, result in enumerate(results):
        assert result["unpatched"] >= 4 * 2  # several buckets a step
        assert result["patched"] == result["unpatched"], result
        assert result["nan_step"] == result["unpatched"] // 4  # a skipped step: the same
        assert result["unchanged"]  # rank 0's NaN loss: skipped on both ranks
        assert result["same_weights"]  # patched and unpatched DDP: the same weights
        stats = result["stats"]
        assert (stats["skipped"], stats["peer_skips"]) == (1, rank)
        assert stats["nonfinite_losses"] == (1 if rank == 0 else 0)
        assert [e["kind"] for e in result["events"]] == (
            ["nonfinite_loss"] if rank == 0 else ["peer_nonfinite"])
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
    # the flags ride the smallest bucket, not the first (DDP's first holds the model's last
    # tensors: at XTTS's size the text head alone, whose copy cost 4-5% of a step)
    sizes, carry_at = results[0]["sizes"], results[0]["carry_at"]
    assert sizes[carry_at] == min(sizes.values()) < sizes[0], sizes
    assert (results[1]["carry_at"], results[1]["sizes"]) == (carry_at, sizes)


def test_the_users_comm_hook_keeps_the_guards_all_reduce(tmp_path) -> None:
    results = _results(tmp_path, "userhook")
    for rank, result in enumerate(results):
        assert result["patched"] == result["unpatched"] + 4  # one agreement a step
        assert result["unchanged"]
        assert result["stats"]["skipped"] == 1
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name


def test_a_gradient_edited_after_the_reduction_on_one_rank_stops_every_rank(tmp_path) -> None:
    results = _results(tmp_path, "edit")
    for result in results:
        assert result["patched"] == result["unpatched"]
        assert "did not all take the same decision" in result.get("raised", ""), result
