"""Growing a text vocabulary inside a checkpoint: the rows, the head bias, the Adam moments.

When a tokenizer grows (74 -> 82 tokens, 12k -> 24k), the trained rows survive and the new
rows start somewhere the model can use:

- base rows are copied unchanged, in place;
- XTTS keeps its start-text token in the *last* row of ``text_embedding``/``text_head``
  when ``[START]`` is the last id of the vocabulary; then that row moves to the new
  end (as coqui's GPTTrainer does), and the rows between are the new ones;
- new rows (and new head-bias entries) start by a rule of :mod:`patches.row_init`
  (:data:`patches.row_init.ROW_INITS`), the embedding and the head each by its own;
- Adam moments keep their base rows; new rows get a first moment of 0 and the old rows'
  mean second moment (see :func:`grow_moment`).

Pure functions of tensors; :mod:`patches.checkpoint` decides when.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .row_init import COVARIANCE_SCALE, RowSources, new_bias_values, new_row_values


@dataclass(frozen=True)
class RowPlan:
    """Where the rows of a grown vocabulary come from.

    ``old_rows``/``new_rows`` count rows (the start-token row included when there is one);
    with ``start_row_last`` the old last row is the start token and moves to the new end.
    """

    old_rows: int
    new_rows: int
    start_row_last: bool = False

    @property
    def base_rows(self) -> int:
        """Rows copied in place (the start-token row, if moved, is not among them)."""
        return self.old_rows - 1 if self.start_row_last else self.old_rows

    @property
    def added(self) -> int:
        return self.new_rows - self.old_rows

    def new_row_indices(self) -> range:
        """Indices of the rows that did not exist before, in the grown tensor."""
        return range(self.base_rows, self.base_rows + self.added)


def truncate_rows(old: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``old`` with its last ids removed (``plan.added < 0``): the rows ``0 .. new-1`` (the
    kept last row, XTTS's ``[START]`` or IndexTTS's slot, stays last). Weights, biases and
    optimizer moments alike."""
    keep = plan.new_rows - 1 if plan.start_row_last else plan.new_rows
    pieces = [old[:keep]]
    if plan.start_row_last:
        pieces.append(old[plan.old_rows - 1:])
    return torch.cat(pieces, dim=0).clone()


def _assemble(old: torch.Tensor, new_part: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Old base rows, then ``new_part``, then (if moved) the start-token row."""
    pieces = [old[: plan.base_rows], new_part.to(dtype=old.dtype, device=old.device)]
    if plan.start_row_last:
        pieces.append(old[plan.old_rows - 1:])
    return torch.cat(pieces, dim=0)


def _old_base_rows(old: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    # The start token is a special row; its statistics are not the vocabulary's.
    base = old[: plan.base_rows]
    return base if base.shape[0] > 0 else old


def _grow(old: torch.Tensor, plan: RowPlan, generator: torch.Generator, rule: str,
          sources: RowSources | None, values: Callable[..., torch.Tensor]) -> torch.Tensor:
    if plan.added < 0:
        return truncate_rows(old, plan)
    if plan.added == 0:
        return old.clone()
    base = _old_base_rows(old, plan).detach().to(torch.float64)
    return _assemble(old, values(base, plan.new_row_indices(), rule, generator, sources), plan)


def grow_rows(old: torch.Tensor, plan: RowPlan, generator: torch.Generator,
              rule: str = "mean", sources: RowSources | None = None) -> torch.Tensor:
    """A 2-D weight (embedding or head) grown: new rows by ``rule`` (:mod:`patches.row_init`)."""
    if old.dim() != 2:
        raise ValueError(f"grow_rows expects a 2-D weight, got shape {tuple(old.shape)}")
    return _grow(old, plan, generator, rule, sources, new_row_values)


def grow_bias(old: torch.Tensor, plan: RowPlan, generator: torch.Generator,
              rule: str = "mean", sources: RowSources | None = None) -> torch.Tensor:
    """A 1-D head bias grown by its head's ``rule`` (:mod:`patches.row_init`)."""
    if old.dim() != 1:
        raise ValueError(f"grow_bias expects a 1-D bias, got shape {tuple(old.shape)}")
    return _grow(old, plan, generator, rule, sources, new_bias_values)


def grow_moment(old: torch.Tensor, plan: RowPlan, *, second_moment: bool) -> torch.Tensor:
    """An optimizer moment (same shape as its parameter) grown along dim 0.

    First moments (``exp_avg``, ``momentum_buffer``) start at 0 for new rows. Second
    moments (``exp_avg_sq``, ``max_exp_avg_sq``) start at the old rows' mean, column by
    column: with a zero second moment and a step count in the thousands, Adam's bias
    correction is ~1 and a new row's first update would be ``lr * g / (|g|*0.03 + eps)``,
    tens of times larger than an old row's.
    """
    if plan.added < 0:
        return truncate_rows(old, plan)
    if plan.added == 0:
        return old.clone()
    if second_moment:
        base = _old_base_rows(old, plan)
        fill = base.to(torch.float64).mean(dim=0, keepdim=True)
        new_part = fill.expand(plan.added, *old.shape[1:])
    else:
        new_part = torch.zeros((plan.added, *old.shape[1:]), dtype=old.dtype, device=old.device)
    return _assemble(old, new_part, plan)


def is_second_moment(state_key: str) -> bool:
    """Adam/AdamW/RAdam/Adagrad-style second-moment buffers (squared gradients)."""
    return "sq" in state_key or state_key in ("sum", "square_avg", "acc_delta")


__all__ = ["RowPlan", "truncate_rows", "grow_rows", "grow_bias", "grow_moment", "is_second_moment",
           "COVARIANCE_SCALE"]
