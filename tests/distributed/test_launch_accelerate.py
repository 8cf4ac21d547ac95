"""``accelerate launch`` with DDP on the CPU (2 processes, gloo): ``import patches.auto``
first, a plain loop through ``Accelerator.backward``, ``accelerator.clip_grad_norm_`` and
``save_state``/``load_state`` (ranks/launch_accelerate.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import jobs

RANK = jobs.HERE / "ranks" / "launch_accelerate.py"


def accelerate_launch(out: Path, *args: str, launcher: tuple[str, ...] = ()) -> list[dict]:
    """``accelerate launch --multi_gpu --num_processes 2``: on a machine without a GPU this
    is accelerate's MULTI_CPU mode (gloo), chosen by the script's ``Accelerator(cpu=True)``
    (``--cpu`` would start one process: it cannot be combined with ``--multi_gpu``)."""
    pytest.importorskip("accelerate")
    command = [*launcher, sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(jobs.free_port()),
               str(RANK), str(out), *args]
    jobs.run_job(command, env=jobs.rank_env(), cwd=out, timeout=300)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_accelerate_ddp_one_nan_rank_both_skip_and_state_round_trip(tmp_path) -> None:
    ranks = accelerate_launch(tmp_path, "ddp")
    for result in ranks:
        assert result["world"] == 2 and result["type"] == "DistributedType.MULTI_CPU"
        assert all(bool(torch.isfinite(p).all()) for p in result["params"])
        # rank 1's NaN loss: the one step skipped on both ranks, nothing else
        assert result["nan_step_unchanged"] and result["stats"]["skipped"] == 1, result["stats"]
        # save_state/load_state with the patches on: the saved parameters come back, and
        # the same two steps from them give the same parameters again (optimizer state too)
        assert result["load_restores"] and result["replay_equal"]
    assert ranks[1]["stats"]["nonfinite_losses"] == 1 and ranks[0]["stats"]["nonfinite_losses"] == 0
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


def test_accelerate_under_the_launcher_without_the_line(tmp_path) -> None:
    """``training-patches run accelerate launch ...`` with no line in the script: the same
    protection on every rank."""
    ranks = accelerate_launch(tmp_path, "ddp", "--plain",
                              launcher=(sys.executable, "-m", "patches", "run"))
    for result in ranks:
        assert result["stats"]["skipped"] == 1 and result["nan_step_unchanged"]
        assert all(bool(torch.isfinite(p).all()) for p in result["params"])
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
