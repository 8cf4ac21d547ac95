"""FSDP2 (2 shards, gloo): the base-vocab freeze is exact per shard (row shards, and column
shards under FSDP2 and tensor parallelism), ShardedGradScaler is made safe, and a layout the freeze cannot keep exact is refused on every rank."""

from __future__ import annotations

import pytest
import torch

import jobs

SCRIPT = jobs.HERE / "ranks" / "fsdp_freeze.py"
BASE = 64


def _results(tmp_path, *args: str, **env: str) -> list[dict]:
    jobs.ranks(SCRIPT, args[0], str(tmp_path), *args[1:], env=jobs.rank_env(**env))
    return [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("vocab", [80, 81])  # even shards, and uneven (41 + 40 rows)
def test_base_vocab_freeze_is_exact_on_row_shards(tmp_path, vocab: int) -> None:
    for result in _results(tmp_path, "freeze", str(vocab), TRAINING_PATCHES_BASE_VOCAB=str(BASE)):
        for name, before in result["before"].items():
            after = result["after"][name]
            assert (after[:BASE] - before[:BASE]).abs().max().item() == 0.0, name
            assert (after[BASE:] - before[BASE:]).abs().max().item() > 1e-3, name


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_base_vocab_freeze_is_exact_on_column_shards(tmp_path, layout: str) -> None:
    """Shard(1) weights (FSDP2 with a placement function; tensor parallelism with a
    ColwiseParallel embedding and a RowwiseParallel head): every rank holds every row,
    a slice of its columns, and keeps the base rows of its columns exact."""
    for result in _results(tmp_path, "freeze_cols", layout, TRAINING_PATCHES_BASE_VOCAB=str(BASE)):
        assert result["error"] is None
        assert result["placements"]["text_embedding.weight"] == ["S(1)"]
        assert result["placements"]["text_head.weight"] == ["S(1)"]
        for name, before in result["before"].items():
            after = result["after"][name]
            assert (after[:BASE] - before[:BASE]).abs().max().item() == 0.0, name
            assert (after[BASE:] - before[BASE:]).abs().max().item() > 1e-3, name


def test_sharded_grad_scaler_is_safe(tmp_path) -> None:
    for result in _results(tmp_path, "scaler"):
        assert (result["type"], result["scale"], result["sharded"]) == (
            "SafeShardedGradScaler", 1024.0, True)
        # a NaN loss on rank 0 at one step: both ranks skip it, the scale backs off once
        assert result.get("step_error") is None
        assert (result["stats"]["steps"], result["stats"]["skipped"],
                result["stats"]["scale"]) == (4, 1, 512.0)


def test_unmappable_layout_is_refused_on_every_rank(tmp_path) -> None:
    for result in _results(tmp_path, "refuse"):
        assert result["error"] and "Partial" in result["error"]
        assert "text_head.weight" in result["error"]
