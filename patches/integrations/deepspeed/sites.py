"""What the ``deepspeed`` integration's sites do (declared in
:mod:`patches.integrations.deepspeed`, which imports this module when one lands)."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from ... import _options, _run, nan_guard, vocab_freeze
from ..._log import info, logger
from ...checkpoint.errors import CheckpointMismatchError

_checked: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _masters(engine: Any) -> bool:
    """Whether the engine's optimizer steps copies of the weights, not the module's own."""
    return (engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled()
            or engine.fp16_enabled())


def _freezes_of(engine: Any) -> list[Any]:
    ids = {id(p) for p in engine.module.parameters()}
    return [h for h in vocab_freeze.live_freezes()
            if any(id(param) in ids for param, _ in h.kept_rows())]


def _check(engine: Any) -> None:
    """Once per engine: BASE_VOCAB applied to its module; a freeze under ZeRO-3 refused."""
    if engine in _checked:
        return
    _checked.add(engine)
    if _masters(engine) and engine.zero_optimization_stage() < 3:
        handle = vocab_freeze.discover_in(engine.module)
        if handle is not None:
            info("training-patches: DeepSpeed (ZeRO-%d%s): the frozen base rows are put back "
                 "in the fp32 master weights and the module after every optimizer step",
                 engine.zero_optimization_stage(),
                 ", bf16" if engine.bfloat16_enabled() else
                 ", fp16" if engine.fp16_enabled() else "")
    if engine.zero_optimization_stage() >= 3:
        # (the layout cannot be read here: the parameters are partitions of 0 rows)
        asked = bool(_freezes_of(engine)) or bool(_options.current().base_vocab)
        for handle in _freezes_of(engine):
            handle.remove()
        if asked:
            vocab_freeze.not_applied(
                "DeepSpeed ZeRO-3 partitions the model's own parameters across the ranks, so "
                "the base vocabulary rows cannot be kept exactly: NOTHING IS FROZEN, every "
                "base row trains. Use ZeRO-1 or ZeRO-2 (the freeze is exact there: the rows "
                "are put back in the fp32 masters), or freeze nothing on purpose "
                "(TRAINING_PATCHES_BASE_VOCAB unset).")


@torch.no_grad()
def _keep_rows(engine: Any) -> None:
    """Put the frozen rows back in the fp32 masters and in the module (ZeRO-1/2, bf16/fp16)."""
    from deepspeed.utils import (  # lazy: deepspeed is imported by the trainer, never here
        safe_get_full_fp32_param, safe_set_full_fp32_param)

    for handle in _freezes_of(engine):
        for param, pieces in handle.kept_rows():
            full = safe_get_full_fp32_param(param)
            if full is not None:
                for rows, values in pieces:
                    full[rows.start:rows.stop] = values.to(full.device, full.dtype)
                safe_set_full_fp32_param(param, full)
            for rows, values in pieces:
                param.data[rows.start:rows.stop] = values.to(param.device, param.dtype)


def _cannot_keep(exc: Exception) -> None:
    """The rows could not be put back (a DeepSpeed that moved its fp32 masters): the step
    stands, the freeze is said to hold no more, once."""
    if _run.current().first_time("deepspeed.cannot_keep"):
        logger.warning("training-patches: DeepSpeed: the frozen base rows could not be put back "
                       "in the fp32 master weights (%s: %s): from this step on the base rows "
                       "TRAIN; training goes on", type(exc).__name__, str(exc)[:200])


def make_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DeepSpeedEngine.step``: the frozen rows kept through the masters, and the engine's
    own overflow skips recorded."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _check(self)
        skipped, steps = self.skipped_steps, self.global_steps
        _run.current().trainer_step = int(steps)  # the records' trainer step: the engine's
        result = original(self, *args, **kwargs)
        if self.global_steps != steps and _masters(self) and self.zero_optimization_stage() < 3:
            try:
                _keep_rows(self)
            except Exception as exc:  # noqa: BLE001 - never into the step: said, loudly
                _cannot_keep(exc)
        if self.skipped_steps > skipped:
            nan_guard.record_trainer_skip(
                "DeepSpeed", self.global_steps,
                "its fp16 loss scaler found an overflow; the loss scale is now "
                f"{getattr(self.optimizer, 'cur_scale', 'unknown')}")
        return result

    return step


_loading: "weakref.WeakKeyDictionary[Any, tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def make_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DeepSpeedEngine.load_checkpoint``: the folder and tag it loads, for the refusal of
    :func:`make_load_module_state_dict` to name."""

    @functools.wraps(original)
    def load_checkpoint(self: Any, load_dir: Any, tag: Any = None, *args: Any,
                        **kwargs: Any) -> Any:
        _loading[self] = (load_dir, tag)
        try:
            return original(self, load_dir, tag, *args, **kwargs)
        finally:
            _loading.pop(self, None)

    return load_checkpoint


def _consolidate_hint(engine: Any) -> str:
    """How to write the checkpoint's fp32 weights as the one file the library loads."""
    load_dir, tag = _loading.get(engine, (None, None))
    folder = repr(str(load_dir)) if load_dir is not None else "LOAD_DIR"
    tagged = f", tag={str(tag)!r}" if tag is not None else ""
    script = (f"{load_dir}/zero_to_fp32.py {load_dir} OUT" if load_dir is not None
              else "LOAD_DIR/zero_to_fp32.py LOAD_DIR OUT")
    return (f"consolidate the checkpoint's weights into one file (torch.save(deepspeed.utils."
            f"zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint({folder}{tagged}), "
            f"'consolidated.pt'); the script `python {script}` writes the same weights as "
            f"OUT/pytorch_model.bin: pass that file, not the folder OUT), load that file with "
            f"patches.load_checkpoint(path, model) BEFORE deepspeed.initialize")


def make_load_module_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DeepSpeedEngine.load_module_state_dict``: a checkpoint of a smaller (or larger)
    vocabulary refused before anything is loaded, in one paragraph that says what to do."""

    @functools.wraps(original)
    def load_module_state_dict(self: Any, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        from ...checkpoint import grown  # lazy: heavy (issue 41)

        state = checkpoint.get("module") if isinstance(checkpoint, dict) else None
        changes = grown.vocabulary_growth(grown.tensor_shapes(state), self.module) \
            if isinstance(state, dict) else {}
        if changes:
            said = "; ".join(f"{k}: checkpoint {list(a)}, model {list(b)}"
                             for k, (a, b) in changes.items())
            load_dir, tag = _loading.get(self, (None, None))
            where = "" if load_dir is None else f" ({load_dir}, " + (
                f"tag {tag})" if tag is not None else "the tag its 'latest' file names)")
            raise CheckpointMismatchError(
                f"training-patches: the DeepSpeed checkpoint being loaded{where} was saved with "
                f"another text vocabulary than this model's ({said}). DeepSpeed's "
                f"load_checkpoint cannot grow its flattened optimizer partitions, so nothing "
                f"was loaded. To continue into the grown vocabulary: "
                f"{_consolidate_hint(self)} (trained rows kept, new rows by the row rules, "
                f"the base rows frozen), and let the optimizer start fresh.")
        return original(self, checkpoint, *args, **kwargs)

    return load_module_state_dict
