"""The EMA weights, a part of a checkpoint: the exponential moving average of the model that
F5-style trainers keep beside it (``ema_pytorch.EMA``, torch's ``AveragedModel``, or any
module holding the averaged copy), vocabulary-aware.

``CheckpointManager.save(..., ema=)`` stores ``ema.state_dict()`` under ``"ema"`` (F5-TTS's
own checkpoints, under ``"ema_model_state_dict"``, are read too);
``load_checkpoint(..., ema=)`` plans it like the model (keys matched, every tensor checked,
the vocabulary rows grown: the EMA's own trained rows kept) and gives the EMA's new rows the
values the model's new rows start with, so the average of a new token starts where the token
does. When the vocabulary grew and the base rows are frozen, the EMA's base rows are kept
too: bit-identical after every ``update()`` (ema_pytorch) or ``update_parameters()``
(``AveragedModel``), as the model's are after every optimizer step.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .plan import ModelPlan

logger = logging.getLogger("training_patches")

# The methods that move an EMA copy: ema_pytorch's EMA, torch's AveragedModel.
UPDATES = ("update", "update_parameters")


def saved(ema: Any) -> dict[str, torch.Tensor]:
    """What a checkpoint stores for ``ema``: its state dict (a module's, or the object's
    own ``state_dict()``)."""
    if not callable(getattr(ema, "state_dict", None)):
        raise ValueError(f"training-patches: cannot save ema={type(ema).__name__}: expected a "
                         f"module (ema_pytorch's EMA, torch's AveragedModel, or the averaged "
                         f"copy itself). Nothing was written.")
    return ema.state_dict()


def module_of(ema: Any, where: Path) -> torch.nn.Module:
    """The module whose tensors the EMA's state dict names (the EMA object itself)."""
    if not isinstance(ema, torch.nn.Module):
        raise ValueError(f"training-patches: cannot load the EMA weights of {where} into "
                         f"ema={type(ema).__name__}: expected a torch module (ema_pytorch's "
                         f"EMA, torch's AveragedModel, or the averaged copy). Nothing was "
                         f"loaded.")
    return ema


def start_new_rows_as_the_model(ema_plan: ModelPlan, model_plan: ModelPlan) -> int:
    """Give each grown EMA tensor's new rows the values the model's same tensor starts
    with (``ema_model.x`` / ``module.x`` is the model's ``x``). Returns the tensors set."""
    if ema_plan.rows is None or model_plan.rows is None:
        return 0
    done = 0
    new = list(ema_plan.rows.new_row_indices())
    for ema_key in ema_plan.resized:
        model_key = next((k for k in model_plan.resized
                          if ema_key == k or ema_key.endswith("." + k)), None)
        if model_key is None or not new:
            continue
        values = model_plan.state[model_key]
        target = ema_plan.state[ema_key]
        if values.shape != target.shape:
            continue
        target[new] = values[new].to(target.dtype)
        done += 1
    return done


class KeptRows:
    """The EMA's base rows held bit-identical: restored after each update call."""

    def __init__(self, ema: torch.nn.Module, keys: Iterable[str], rows: Sequence[range]) -> None:
        """``keys``: the EMA's vocabulary tensors (state-dict keys); ``rows``: the rows the
        model's freeze keeps (``VocabFreeze.rows``), kept at their values now."""
        self.ema = ema
        self.index = torch.tensor([i for r in rows for i in r], dtype=torch.long)
        tensors = dict(ema.named_parameters())
        tensors.update(dict(ema.named_buffers()))
        self.kept = {key: (tensors[key], tensors[key].detach()[self.index].clone())
                     for key in keys if key in tensors}
        self.wrapped: list[tuple[str, Any]] = []
        for name in UPDATES:
            method = getattr(ema, name, None)
            if callable(method):
                self.wrapped.append((name, method))
                setattr(ema, name, self._after(method))

    def _after(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def update(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            try:
                self.restore()
            except Exception as exc:  # noqa: BLE001 - never into the training step: said
                logger.warning("training-patches: the EMA's base rows could not be put back "
                               "(%s: %s); they are kept no more, training goes on",
                               type(exc).__name__, str(exc)[:200])
                self.remove()
            return result
        return update

    @torch.no_grad()
    def restore(self) -> None:
        for tensor, rows in self.kept.values():
            tensor[self.index] = rows

    def remove(self) -> None:
        """Stop keeping the rows (the update methods are the EMA's own again)."""
        for name, _ in self.wrapped:
            self.ema.__dict__.pop(name, None)
        self.wrapped = []

    def describe(self) -> str:
        return (f"{len(self.index)} base row(s) of {len(self.kept)} tensor(s) kept through "
                f"{', '.join(n for n, _ in self.wrapped) or 'no update method (none found)'}")


def part(plan: ModelPlan | None, given: bool, in_file: bool) -> tuple[str, str] | None:
    """The report's (status, detail) for the EMA; None when there is neither."""
    if plan is None:
        if in_file:
            return "dropped", "no ema passed"
        return ("absent", "the file holds no EMA weights; the EMA is left as it is") if given \
            else None
    if plan.rows is not None:
        return "remapped", (f"{len(plan.state)} tensor(s), {len(plan.resized)} of them grown by "
                            f"{plan.rows.added} vocabulary row(s) (new rows as the model's)")
    return "restored", f"{len(plan.state)} tensor(s)"


# Where a checkpoint keeps the EMA's state dict: the library's "ema", F5-TTS's own name.
EMA_KEYS = ("ema", "ema_model_state_dict")


def saved_ema(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((meta[key] for key in EMA_KEYS if isinstance(meta.get(key), Mapping)), None)


__all__ = ["EMA_KEYS", "saved", "module_of", "start_new_rows_as_the_model", "KeptRows", "part",
           "saved_ema", "UPDATES"]
