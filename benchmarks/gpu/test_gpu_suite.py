"""GPU validation suite: the fp16 path of the real coqui Trainer with the patches, on the tiny
XTTS GPT and on a realistic-size GPT (30 layers, 1024 channels, random init).

Run on a machine with a CUDA GPU: ``make gpu-suite``. Without one every test is skipped (see
conftest.py). Figures go to benchmarks/gpu/results/gpu_suite.{json,md} for docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpu_harness as harness
import patches

pytestmark = pytest.mark.usefixtures("clean_patches")


def _fit(tiny: Any, tmp_path: Any, name: str, gpu_results: dict[str, Any],
         inject_at: set[int] = frozenset(), **config: Any) -> dict[str, Any]:
    patches.advanced.apply()
    cfg = harness.make_config(tiny, tmp_path / name, **config)
    run = harness.fit_with_faults(tiny, cfg, inject_at)
    gpu_results["runs"][name] = run
    return run


def test_safe_grad_scaler_is_the_scaler_in_use(tiny, tmp_path, gpu_results) -> None:
    run = _fit(tiny, tmp_path, "tiny fp16 fused", gpu_results, precision="fp16", epochs=2)
    assert run["scaler"] == "SafeGradScaler" and run["optimizer_fused"]
    assert run["finite"] and run["iterations"] == 14


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_injected_infs_are_skipped_and_counted(tiny, tmp_path, gpu_results, fused) -> None:
    inject = {3, 4, 9}
    run = _fit(tiny, tmp_path, f"tiny fp16 {'fused' if fused else 'plain'}, infs at 3,4,9",
               gpu_results, inject, precision="fp16", fused=fused, epochs=2)
    assert run["finite"]
    assert inject <= set(run["skipped_iterations"])
    # the scaler's count is what the optimizer saw: every skip, no more
    assert run["scaler_stats"]["skipped"] == len(run["skipped_iterations"])
    assert run["scaler_stats"]["steps"] == run["iterations"]


def test_a_too_high_learning_rate_still_completes(tiny, tmp_path, gpu_results) -> None:
    run = _fit(tiny, tmp_path, "tiny fp16 fused, lr 0.05", gpu_results, precision="fp16",
               lr=0.05, epochs=3)
    assert run["finite"] and run["iterations"] == 21
    assert run["scaler_stats"]["skipped"] == len(run["skipped_iterations"])


@pytest.mark.parametrize("size,precision,fused", [
    ("tiny", "fp16", True), ("tiny", "fp16", False), ("tiny", "fp32", True),
    ("tiny", "fp32", False), ("realistic", "fp16", True), ("realistic", "fp16", False),
])
def test_syncs_time_and_memory_patched_vs_unpatched(tiny, tmp_path, gpu_results, size,
                                                     precision, fused) -> None:
    name = f"{size} {precision} {'fused' if fused else 'plain'} AdamW"
    steps = 10 if size == "realistic" else 20
    result = harness.compare_modes(
        tiny, lambda mode: harness.make_config(tiny, tmp_path / mode, size=size,
                                               precision=precision, fused=fused),
        rounds=2 if size == "realistic" else 4, steps=steps)
    gpu_results["compare"][name] = result
    if precision == "fp16":
        assert result["patched"]["scaler"] == "SafeGradScaler"
    if precision == "fp16" or fused:
        # the scaler path and the fused path: the patches add no sync
        assert result["extra_syncs_per_step"] == 0
    else:
        assert result["extra_syncs_per_step"] == 1  # the guard's one read (the control)
    assert result["peak_memory_ratio"] is None or result["peak_memory_ratio"] <= 1.05


def test_bf16_where_the_gpu_has_it(tiny, tmp_path, gpu_results) -> None:
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        gpu_results["checks"]["bf16"] = "not supported by this GPU"
        pytest.skip("this GPU has no bf16 (a T4 has none)")
    run = _fit(tiny, tmp_path, "tiny bf16 fused, infs at 3,5", gpu_results, {3, 5},
               precision="bf16", epochs=2)
    assert run["scaler"] is None  # bf16 needs no loss scaling: the guard protects the steps
    assert run["finite"] and set(run["skipped_iterations"]) == {3, 5}
    assert run["guard_stats"]["skipped"] == 2
