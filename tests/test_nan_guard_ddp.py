"""Under DDP every rank makes the same skip decision, with and without a loss scaler
(gloo, 2 CPU processes)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from ddp_worker import worker

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fault_on_one_rank_is_skipped_on_both(tmp_path) -> None:
    inject = [4, 11, 12, 25]
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), inject), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    for result in results:
        assert result["stats"]["skipped"] == len(inject)
        assert result["stats"]["steps"] == 30
        assert all(bool(torch.isfinite(p).all()) for p in result["params"])
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_scaler_overflow_on_one_rank_is_skipped_on_both(tmp_path) -> None:
    """fp16-style loss scaling under DDP: a non-finite gradient on one rank (before the
    reduction, which spreads it) is skipped on both: same skips, same scale, same weights,
    with no collective of the scaler's own (tests/distributed/test_ddp_scaler_collectives.py;
    one rank's edit after the reduction stops every rank there)."""
    inject = [4, 11, 12, 25]
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), inject, True), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    for result in results:
        assert result["scaler"]["class"] == "SafeGradScaler"
        assert result["scaler"]["skipped"] == len(inject)
        assert result["scaler"]["steps"] == 30
        assert all(bool(torch.isfinite(p).all()) for p in result["params"])
    assert results[0]["scaler"]["scale"] == results[1]["scaler"]["scale"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
