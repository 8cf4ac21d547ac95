"""The real coqui Trainer under DDP, started by coqui's own ``python -m trainer.distribute``
(2 ranks, gloo on the CPU; ranks/launch_coqui_ddp.py): rank 1's loss is NaN on one batch.
Both ranks skip that step; the parameters are finite and bit-identical across ranks,
which also needs the gradients all-reduced (coqui 0.4 alone never does: see
patches/integrations/coqui_trainer.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import jobs

pytestmark = pytest.mark.xtts  # coqui-tts-trainer's distribute and Trainer
RANK = jobs.HERE / "ranks" / "launch_coqui_ddp.py"


def distribute(out: Path, *args: str) -> list[dict]:
    pytest.importorskip("trainer")
    command = [sys.executable, "-m", "trainer.distribute", "--script", str(RANK),
               "--gpus", "0,1", f"--out={out}", f"--port={jobs.free_port()}", *args]
    # distribute starts each rank as a bare `python3`: this interpreter's, as in an
    # activated virtual environment
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    output = jobs.run_job(command, env=jobs.rank_env(PATH=path), cwd=out, timeout=420).stdout
    missing = [r for r in range(2) if not (out / f"rank{r}.pt").exists()]
    assert not missing, output[-6000:]  # distribute itself exits 0 when a rank fails
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def check_one_nan_skipped_everywhere(ranks: list[dict], steps: int) -> None:
    assert [all(bool(torch.isfinite(p).all()) for p in r["params"]) for r in ranks] == [True] * 2
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b), (a - b).abs().max().item()
    for result in ranks:
        assert result["ddp"] and result["steps"] == steps
        assert result["stats"]["skipped"] == 1 and result["stats"]["steps"] == steps
    assert ranks[1]["stats"]["nonfinite_losses"] == 1 and ranks[0]["stats"]["nonfinite_losses"] == 0


def test_coqui_trainer_ddp_one_nan_rank_both_skip_identical_params(tmp_path) -> None:
    """A coqui TrainerModel (the tiny GPT), each rank its own half of the data: equal
    parameters need the all-reduce; 16 samples, 2 ranks, batch 2 -> 4 steps."""
    check_one_nan_skipped_everywhere(distribute(tmp_path), steps=4)


def test_xtts_gpt_trainer_ddp_one_nan_rank(tmp_path, tiny_xtts) -> None:
    """XTTS's own GPTTrainer under coqui's DDP: its unused parameters (the HiFi-GAN
    decoder) do not stop DDP, and rank 1's NaN batch is skipped on both ranks. 13 clips
    split by a DistributedSampler: 7 a rank, batch 2, 4 steps; each rank draws its own
    clips (XTTSDataset picks at random: seeded per rank in the rank script), so equal
    parameters need the all-reduce here too."""
    check_one_nan_skipped_everywhere(distribute(tmp_path, f"--xtts={tiny_xtts.root}"), steps=4)
