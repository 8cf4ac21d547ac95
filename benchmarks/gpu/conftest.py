"""The GPU validation suite: skipped (not failed) where no CUDA GPU is visible.

Run: ``make gpu-suite`` (``.venv/bin/python -m pytest benchmarks/gpu -q``). Results go to
``$GPU_SUITE_OUT`` (default ``benchmarks/gpu/results/``) as gpu_suite.json and gpu_suite.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_GPU = "no CUDA GPU visible: the GPU suite runs only on a machine with one (make gpu-suite)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_results() -> Iterator[dict[str, Any]]:
    """Every test adds its figures here; written once at the end of the session."""
    results: dict[str, Any] = {"compare": {}, "runs": {}, "checks": {}, "multi": {}}
    yield results
    if any(results.values()):
        from gpu_harness import write_results

        out = os.environ.get("GPU_SUITE_OUT") or str(HERE / "results")
        json_path, md_path = write_results(results, out)
        print(f"\nGPU suite results: {json_path} and {md_path}")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("TTS")
    from demo.xtts_tiny import build_tiny_xtts

    return build_tiny_xtts(tmp_path_factory.mktemp("tiny_xtts"))
