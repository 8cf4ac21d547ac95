"""The CPU-side parts of the GPU validation suite (benchmarks/gpu), run here in CI: its
configs, its sync-counting harness against a fake count, its patched/unpatched comparison and
its fault-injected Trainer run (fp32 on the CPU, host reads standing in for syncs), its results
file, and the suite itself being skipped, not failed, without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from sync_count import count_host_reads

import patches

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import gpu_harness as harness  # noqa: E402

pytestmark = pytest.mark.xtts


@pytest.mark.slow
def test_configs_are_mixed_precision_fused_and_sized(tiny_xtts, tmp_path) -> None:
    pytest.importorskip("TTS")
    big = harness.make_config(tiny_xtts, tmp_path / "big", size="realistic", precision="fp16")
    assert (big.mixed_precision, big.precision) == (True, "fp16")
    assert big.optimizer_params["fused"] is True and big.grad_clip == 1.0
    args = big.model_args
    assert (args.gpt_layers, args.gpt_n_model_channels, args.gpt_n_heads) == (30, 1024, 16)
    assert 350e6 < harness.gpt_parameter_count(big) < 600e6  # XTTS v2's GPT size class
    small = harness.make_config(tiny_xtts, tmp_path / "small", precision="bf16", fused=False)
    assert (small.mixed_precision, small.precision) == (True, "bf16")
    assert "fused" not in small.optimizer_params
    assert harness.gpt_parameter_count(small) < 2e6
    plain = harness.make_config(tiny_xtts, tmp_path / "plain", precision="fp32")
    assert plain.mixed_precision is False
    with pytest.raises(ValueError, match="size must be one of"):
        harness.make_config(tiny_xtts, tmp_path / "x", size="huge")


def test_the_coqui_trainer_would_build_safe_grad_scaler(tiny_xtts, tmp_path) -> None:
    """On the CPU the Trainer builds no scaler even with mixed_precision fp16 (why the GPU
    suite exists); the binding it would call on CUDA is SafeGradScaler once patched."""
    import trainer.trainer as coqui

    patches.advanced.apply(quiet=True)
    config = harness.make_config(tiny_xtts, tmp_path / "run", precision="fp16")
    built = tiny_xtts.make_trainer(config)
    assert built.config.mixed_precision and built.scaler is None and not built.use_amp_scaler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available, disabling"
        assert type(coqui.GradScaler()).__name__ == "SafeGradScaler"


def test_sync_counter_counts_only_sync_warnings_and_restores_the_mode() -> None:
    modes = []
    counter = harness.SyncCounter(set_mode=modes.append)
    with pytest.warns(UserWarning, match="unrelated"):
        with counter.counting():
            for _ in range(3):
                warnings.warn(f"{harness.SYNC_MESSAGE} (cudaStreamSynchronize)")
            warnings.warn("unrelated")
    assert counter.count == 3 and modes == ["warn", 0]
    with pytest.raises(KeyError):
        with counter.counting():
            raise KeyError("boom")
    assert modes == ["warn", 0, "warn", 0]


class HostReads:
    """The CPU stand-in for :class:`harness.SyncCounter`: host reads (item, tolist, ...)."""

    def __init__(self) -> None:
        self.count = 0

    @contextmanager
    def counting(self) -> Iterator[HostReads]:
        with pytest.MonkeyPatch.context() as m:
            counter = count_host_reads(m)
            yield self
        self.count = counter[0]


@pytest.mark.slow
@pytest.mark.parametrize("fused,extra", [(True, 0), (False, 1)], ids=["fused", "plain"])
def test_compare_modes_on_the_cpu(tiny_xtts, tmp_path, fused, extra) -> None:
    """The suite's comparison, on the CPU with the real Trainer: with fused AdamW the patches
    add no host read per step, with the plain one the guard adds its one read."""
    result = harness.compare_modes(
        tiny_xtts, lambda mode: harness.make_config(tiny_xtts, tmp_path / mode,
                                                    precision="fp32", fused=fused),
        rounds=1, steps=4, warmup=2, device="cpu", counter=HostReads)
    assert result["extra_syncs_per_step"] == extra
    assert result["patched"]["scaler"] is None and result["peak_memory_ratio"] is None
    # a figure the suite reports, never a pass mark: a loaded machine stretches either side
    assert result["step_time_ratio"] > 0 and result["step_time_ratio"] != float("inf")
    assert not patches.advanced.applied()  # the comparison leaves nothing applied


@pytest.mark.slow
def test_fit_with_faults_counts_the_skips(tiny_xtts, tmp_path) -> None:
    patches.advanced.apply(quiet=True, output_dir=str(tmp_path))
    config = harness.make_config(tiny_xtts, tmp_path / "run", precision="fp32", epochs=1)
    run = harness.fit_with_faults(tiny_xtts, config, {2, 5})
    assert run["iterations"] == 7 and run["optimizer_fused"]
    assert run["skipped_iterations"] == [2, 5]
    assert run["guard_stats"]["skipped"] == 2 and run["finite"]


def test_results_are_written_as_json_and_markdown(tmp_path) -> None:
    mode = {"step_ms": 10.0, "syncs_per_step": 2.0, "peak_mib": 100.0, "scaler": None}
    results = {
        "compare": {"tiny fp16 fused AdamW": {
            "unpatched": mode, "patched": {**mode, "scaler": "SafeGradScaler", "step_ms": 10.1},
            "step_time_ratio": 1.01, "extra_syncs_per_step": 0.0, "peak_memory_ratio": 1.0}},
        "runs": {"tiny fp16": {"iterations": 14, "skipped_iterations": [3, 4], "scaler":
                               "SafeGradScaler", "scaler_stats": {"skipped": 2},
                               "guard_stats": {"skipped": 0}, "finite": True}},
        "multi": {"step ratio ddp": "| DDP, fp32 + clip | 10.00 | 10.10 | 1.010 |",
                  "accelerate DDP NCCL no, NaN on rank 1": "both skipped, equal"},
    }
    json_path, md_path = harness.write_results(results, tmp_path / "out")
    data = json.loads(json_path.read_text())
    assert data["machine"]["gpu"] is None and data["compare"]["tiny fp16 fused AdamW"]
    text = md_path.read_text()
    assert "| tiny fp16 fused AdamW | SafeGradScaler | 2 | 2 | 10.00 | 10.10 | 1.010 | 100 | 100 |" \
        in text
    assert "| tiny fp16 | SafeGradScaler | 14 | 2 | 2 | 0 | True |" in text
    assert "multi-GPU (2 ranks, NCCL):" in text and "| DDP, fp32 + clip | 10.00 | 10.10 | 1.010 |" \
        in text and "- accelerate DDP NCCL no, NaN on rank 1: both skipped, equal" in text


@pytest.mark.slow
def test_the_gpu_suite_is_skipped_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the suite runs for real (make gpu-suite)")
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/gpu", "-q", "-p",
                           "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # 11 single-GPU tests and the 7 of the multi-GPU section (test_gpu_multi.py)
    assert "18 skipped" in done.stdout and "no CUDA GPU visible" in done.stdout
