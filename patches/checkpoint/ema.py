"""The EMA weights, a part of a checkpoint: the moving average of the model that F5-style
trainers keep beside it (``ema_pytorch.EMA``, torch's ``AveragedModel``, or the averaged
copy itself), vocabulary-aware.

``CheckpointManager.save(..., ema=)`` stores ``ema.state_dict()`` under ``"ema"`` (F5-TTS's
``"ema_model_state_dict"`` is read too). ``load_checkpoint(..., ema=)`` takes each form,
saved in one and loaded in another (:func:`split`, :func:`averaged_of`), plans the averaged
copy like the model (its new rows as the model's) and refuses one that is not the same
thing; after a growth the EMA's base rows are kept through its updates (:class:`KeptRows`).
Design: docs/design/checkpoint.md.
"""

from __future__ import annotations

import functools
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .plan import ModelPlan

logger = logging.getLogger("training_patches")

# The methods that move an EMA copy: ema_pytorch's EMA, torch's AveragedModel.
UPDATES = ("update", "update_parameters")
# The counters an EMA keeps beside its averaged copy: ema_pytorch's EMA (whether it copied
# the model yet, its update count), torch's AveragedModel (the models averaged).
COUNTERS = ("initted", "step", "n_averaged")


def saved(ema: Any) -> dict[str, torch.Tensor]:
    """What a checkpoint stores for ``ema``: its state dict (a module's, or the object's
    own ``state_dict()``)."""
    if not callable(getattr(ema, "state_dict", None)):
        raise ValueError(f"training-patches: cannot read the EMA weights of "
                         f"ema={type(ema).__name__}: expected a module (ema_pytorch's EMA, "
                         f"torch's AveragedModel, or the averaged copy itself). Pass the EMA, or "
                         f"leave ema= out.")
    return ema.state_dict()


_TOLD: "weakref.WeakSet[Any]" = weakref.WeakSet()


def saved_or_warn(ema: Any, where: str) -> dict[str, torch.Tensor] | None:
    """:func:`saved`, or None after one WARNING (once per EMA) saying that ``where`` is saved
    without the EMA weights."""
    try:
        return saved(ema)
    except Exception as exc:  # noqa: BLE001 - any object the user hands: said, left out
        why = str(exc).removeprefix("training-patches: ") or type(exc).__name__
        try:
            first = ema not in _TOLD
            _TOLD.add(ema)
        except TypeError:  # not weakly referable: said every time
            first = True
        if first:
            logger.warning("training-patches: %s is saved without the EMA weights (the other "
                           "parts are saved): %s", where,
                           why if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
                           f"{why[:300]}")
        return None


def averaged_of(ema: Any) -> torch.nn.Module | None:
    """The averaged copy inside ``ema``: ema_pytorch's ``ema_model``, an ``AveragedModel``'s
    ``module``, else ``ema`` itself (the copy passed as it is); None for what is no module."""
    if not isinstance(ema, torch.nn.Module):
        return None
    inner = ema._modules.get("ema_model")
    if isinstance(inner, torch.nn.Module):
        return inner
    if isinstance(ema, torch.optim.swa_utils.AveragedModel):
        return ema.module
    return ema


def _form(keys: Iterable[str]) -> str:
    """``"ema_pytorch"``, ``"averaged"`` (torch's AveragedModel) or ``"copy"``: the form a
    state dict with these keys was saved from."""
    keys = list(keys)
    if any(k.startswith("ema_model.") for k in keys):
        return "ema_pytorch"
    if "n_averaged" in keys and all(k == "n_averaged" or k.startswith("module.") for k in keys):
        return "averaged"
    return "copy"


def split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the averaged copy's weights, keyed as the copy's own state dict; the EMA's counters)
    of a saved EMA state dict, in whichever form it was saved. ema_pytorch's
    ``online_model.*`` (the model itself, saved with it) is left to the model part."""
    form = _form(state)
    if form == "copy":
        return dict(state), {}
    prefix = "ema_model." if form == "ema_pytorch" else "module."
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    counters = {k: v for k, v in state.items() if k in COUNTERS}
    return weights, counters


def module_of(ema: Any, where: Path) -> torch.nn.Module:
    """The module the file's averaged weights load into: the averaged copy inside ``ema``
    (:func:`averaged_of`)."""
    module = averaged_of(ema)
    if module is None:
        raise ValueError(f"training-patches: cannot load the EMA weights of {where} into "
                         f"ema={type(ema).__name__}: expected a torch module (ema_pytorch's "
                         f"EMA, torch's AveragedModel, or the averaged copy). Nothing was "
                         f"loaded.")
    return module


def describe(ema: Any) -> str:
    """``EMA`` / ``AveragedModel`` / ``CFM (the averaged copy)``: what was passed, in words."""
    module = averaged_of(ema)
    if module is None or module is ema:
        return f"{type(ema).__name__} (the averaged copy)" if module is not None else \
            type(ema).__name__
    return f"{type(ema).__name__} (averaged copy: {type(module).__name__})"


def other_shapes(ema: Any, model_state: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors of ``ema``'s averaged copy whose shape is not the model's (the model's
    planned state), in words: an EMA built before the model was resized."""
    module = averaged_of(ema)
    if module is None:
        return []
    found = []
    for key, value in module.state_dict().items():
        mine = model_state.get(key)
        if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor) and \
                tuple(mine.shape) != tuple(value.shape):
            found.append(f"{key}: EMA {list(value.shape)}, model {list(mine.shape)}")
    return found


def refusal(where: Path, ema: Any, inner: str) -> str:
    """The paragraph of an EMA refused by the planner, which words it for the model: here it
    is the EMA's averaged copy that does not fit (the model part, planned first, fits)."""
    text = inner.removeprefix("training-patches: ")
    for said, meant in (("does not fit this model", "does not fit the EMA's averaged copy"),
                        ("do not fit the model's", "do not fit the EMA copy's"),
                        ("model key(s)", "key(s) of the EMA's copy"),
                        ("not in the model", "not in the EMA's copy"),
                        ("Build the model with", "Build the model and its EMA with")):
        text = text.replace(said, meant)
    return (f"training-patches: cannot load the EMA weights of {where} into "
            f"ema={describe(ema)} (the model's own weights fit; the EMA is matched in any of "
            f"its forms: ema_pytorch's EMA, torch's AveragedModel or the averaged copy): {text}")


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
        tensors: dict[str, torch.Tensor] = {}
        inner = averaged_of(ema)
        for module in (inner, ema):  # the copy's own keys, and the EMA's (ema_model.x)
            if isinstance(module, torch.nn.Module):
                tensors.update(dict(module.named_parameters()))
                tensors.update(dict(module.named_buffers()))
        self.kept = {key: (tensors[key], tensors[key].detach()[self.index].clone())
                     for key in keys if key in tensors}
        self.wrapped: list[tuple[str, Any]] = []
        for name in UPDATES:
            method = getattr(ema, name, None)
            if callable(method):
                self.wrapped.append((name, method))
                setattr(ema, name, self._after(method))
        if not self.wrapped and self.kept:
            logger.warning(
                "training-patches: the EMA's base rows are not kept through its updates: "
                "ema=%s has no update() or update_parameters() (the averaged copy was passed; "
                "its wrapper makes the updates, which pull its base rows toward the model's). "
                "Pass the EMA itself (ema_pytorch's EMA, or the AveragedModel) to load_checkpoint "
                "to keep them.", type(ema).__name__)

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


def part(plan: ModelPlan | None, given: bool, in_file: bool,
         counters: Sequence[str] = ()) -> tuple[str, str] | None:
    """The report's (status, detail) for the EMA; None when there is neither. ``counters``:
    what was set beside the weights (``step from the file``, ...)."""
    if plan is None:
        if in_file:
            return "dropped", "no ema passed"
        return ("absent", "the file holds no EMA weights; the EMA is left as it is") if given \
            else None
    with_counters = f"; {', '.join(counters)}" if counters else ""
    if plan.rows is not None:
        return "remapped", (f"{len(plan.state)} tensor(s), {len(plan.resized)} of them grown by "
                            f"{plan.rows.added} vocabulary row(s) (new rows as the model's)"
                            f"{with_counters}")
    return "restored", f"{len(plan.state)} tensor(s){with_counters}"


# Where a checkpoint keeps the EMA's state dict: the library's "ema", F5-TTS's own name.
EMA_KEYS = ("ema", "ema_model_state_dict")


def saved_state(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The EMA's state dict as the checkpoint holds it (None: it holds none)."""
    return next((meta[key] for key in EMA_KEYS if isinstance(meta.get(key), Mapping)), None)


def saved_ema(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The checkpoint's averaged weights, keyed as the averaged copy's own state dict
    (:func:`split`); None when it holds no EMA."""
    state = saved_state(meta)
    return split(state)[0] if state is not None else None


def saved_counters(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's EMA counters (``initted``, ``step``, ``n_averaged``: :func:`split`)."""
    state = saved_state(meta)
    return split(state)[1] if state is not None else {}


def counters_plan(ema: Any, saved: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the counters to set in ``ema``'s own buffers, what that is in words): the file's, or
    the nearest it holds (``step`` and ``n_averaged`` both count updates), else the value that
    makes the next update average into the loaded weights rather than copy the model."""
    if averaged_of(ema) is ema or not isinstance(ema, torch.nn.Module):
        return {}, []  # the averaged copy itself keeps no counters
    buffers = dict(ema.named_buffers(recurse=False))
    counts = {"step": "n_averaged", "n_averaged": "step"}
    values: dict[str, Any] = {}
    said: list[str] = []
    for name in COUNTERS:
        if name not in buffers:
            continue
        other = counts.get(name)
        if isinstance(saved.get(name), torch.Tensor):
            values[name] = saved[name]
            said.append(f"{name} {_scalar(saved[name])} from the file")
        elif other is not None and isinstance(saved.get(other), torch.Tensor):
            values[name] = saved[other].to(buffers[name].dtype)
            said.append(f"{name} {_scalar(saved[other])} from the file's {other}")
        elif name == "initted" and not bool(buffers[name]):
            values[name] = torch.tensor(True)
            said.append("initted set (the file holds none: the loaded weights are the average)")
        elif name == "n_averaged" and int(buffers[name]) == 0:
            values[name] = torch.tensor(1, dtype=buffers[name].dtype)
            said.append("n_averaged 0 -> 1 (the file holds no count: the next update averages "
                        "into the loaded weights)")
        elif name == "step" and isinstance(getattr(ema, "update_after_step", None), int) and \
                int(buffers[name]) <= ema.update_after_step:
            values[name] = torch.tensor(ema.update_after_step + 1, dtype=buffers[name].dtype)
            said.append(f"step {ema.update_after_step + 1} (the file holds no count: past "
                        f"update_after_step, so the next update averages into the loaded "
                        f"weights)")
    return values, said


def _scalar(value: torch.Tensor) -> Any:
    return value.item() if value.numel() == 1 else list(value.shape)


__all__ = ["EMA_KEYS", "COUNTERS", "saved", "saved_or_warn", "averaged_of", "split", "module_of",
           "describe", "other_shapes", "refusal", "start_new_rows_as_the_model", "KeptRows",
           "part", "saved_state", "saved_ema", "saved_counters", "counters_plan", "UPDATES"]
