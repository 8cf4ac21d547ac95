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
        # the comm hook's callbacks were all freed before the exit, which waits for them
        assert result["callbacks_live"] == 0 and result["drain_registered"]
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


def test_the_exit_waits_until_every_reduction_callback_is_freed() -> None:
    """torch frees a comm hook's Python callback on the communication thread, taking the GIL
    in a destructor that cannot unwind: freed while the interpreter finalizes, it aborts the
    process (SIGABRT after a finished run). The exit function waits, GIL released, until
    the last callback the hook handed out is freed (here: 0.3 s later, on another thread)."""
    import threading
    import time

    from patches import _ddp

    held = [_ddp._Then(lambda fut: fut)]
    assert _ddp._live >= 1
    threading.Timer(0.3, held.clear).start()  # the comm thread lets go of it later
    started = time.monotonic()
    _ddp._drain_at_exit()
    assert _ddp._live == 0 and time.monotonic() - started >= 0.25
