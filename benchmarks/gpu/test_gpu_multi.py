"""Multi-GPU section of the GPU suite: the many-process checks of tests/distributed with NCCL,
one GPU a rank, and the patched/unpatched step ratio under DDP and FSDP2
(benchmarks/bench_distributed.py --device cuda).

Runs where 2 or more CUDA GPUs are visible; skipped (not failed) elsewhere, including on a
machine with one GPU. Rows go to the suite's results (gpu_suite.md, "multi-GPU").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTED = ROOT / "tests" / "distributed"
sys.path[:0] = [str(ROOT / "benchmarks"), str(DISTRIBUTED)]

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="the multi-GPU section needs 2 or more CUDA GPUs and NCCL")


def _accelerate(out: Path, mode: str, precision: str = "no") -> list[dict[str, Any]]:
    """ranks/launch_accelerate.py under ``accelerate launch``, 2 GPUs: rank 1's loss is NaN
    at one step, then a save_state/load_state round trip."""
    pytest.importorskip("accelerate")
    import jobs

    extra = ["--use_fsdp", "--fsdp_version", "2"] if mode == "fsdp2" else ["--multi_gpu"]
    command = [sys.executable, "-m", "accelerate.commands.launch", *extra, "--num_processes",
               "2", "--num_machines", "1", "--mixed_precision", precision, "--dynamo_backend",
               "no", "--main_process_port", str(jobs.free_port()),
               str(DISTRIBUTED / "ranks" / "launch_accelerate.py"), str(out), mode]
    jobs.run_job(command, env=jobs.rank_env(CUDA_VISIBLE_DEVICES="0,1"), cwd=out, timeout=480)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _check_one_nan_skipped(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert all(bool(torch.isfinite(p).all()) for p in result["params"])
        assert result["nan_step_unchanged"] and result["stats"]["skipped"] == 1, result["stats"]
        assert result["load_restores"] and result["replay_equal"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_accelerate_ddp_nccl_one_nan_rank(tmp_path, gpu_results, precision) -> None:
    ranks = _accelerate(tmp_path, "ddp", precision)
    assert ranks[0]["type"] == "DistributedType.MULTI_GPU"
    if precision == "fp16":  # accelerate's own scaler (get_grad_scaler) is ours
        assert {r["scaler"] for r in ranks} == {"SafeGradScaler"}
    _check_one_nan_skipped(ranks)
    gpu_results["multi"][f"accelerate DDP NCCL {precision}, NaN on rank 1"] = "both skipped, equal"


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_accelerate_fsdp2_nccl_one_nan_rank(tmp_path, gpu_results, precision) -> None:
    ranks = _accelerate(tmp_path, "fsdp2", precision)
    assert ranks[0]["type"] == "DistributedType.FSDP"
    if precision == "fp16":  # accelerate's FSDP2 scaler (get_fsdp2_grad_scaler) is ours
        assert {r["scaler"] for r in ranks} == {"SafeGradScaler"}
    _check_one_nan_skipped(ranks)
    gpu_results["multi"][f"accelerate FSDP2 NCCL {precision}, NaN on rank 1"] = "both skipped, equal"


@pytest.mark.parametrize("setting", ["ddp", "ddp-fused", "fsdp2"])
def test_step_ratio_patched_vs_unpatched(gpu_results, setting) -> None:
    import bench_distributed as bench

    row = bench.run_setting(setting, rounds=8, steps=20, timeout=480, device="cuda")
    gpu_results["multi"][f"step ratio {setting}"] = row
    assert "FAILED" not in row and "hung" not in row, row
    ratio = float(row.strip().strip("|").split("|")[-1])
    assert ratio <= 1.05, row  # the floor is 1.02 on a quiet machine; 1.05 leaves it noise
