"""Issue 27: the data position under DDP, 2 ranks -> 2 ranks (ranks started as torchrun starts them, gloo, CPU): each
rank's resumed run sees exactly the batches, sample noise and RNG draws its uninterrupted
run saw after the step it stopped at (tests/distributed/ranks/data_position_job.py)."""

from __future__ import annotations

import json

import jobs

SCRIPT = jobs.HERE / "ranks" / "data_position_job.py"
STOP = 9


def test_each_rank_resumes_its_own_shard_mid_epoch(tmp_path) -> None:
    jobs.ranks(SCRIPT, str(tmp_path), timeout=180)
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in range(2)]
    for rank, run in enumerate(seen):
        assert run["first"] == run["full"][:STOP]
        assert run["rest"] == run["full"][STOP:], f"rank {rank}"
        assert run["part"] == ["restored", "epoch 1 continues at batch 3 of 6"]
    # the ranks read different samples (DistributedSampler shards the epoch)
    firsts = [{i for batch in run["full"][:6] for i in batch[1]} for run in seen]
    assert not firsts[0] & firsts[1] and len(firsts[0] | firsts[1]) == 44
