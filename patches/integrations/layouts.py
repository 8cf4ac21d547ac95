"""The text-vocabulary row layouts of upstream models, registered with
:mod:`patches.vocab_rows` (read by the freeze, the checkpoint loader and the tokenizer check):

- XTTS, ``[START]`` last (:data:`XTTS_START_LAST`): coqui's ``GPTTrainer`` grows a
  ``gpt_checkpoint`` by moving the old last row (``[START]``) to the new last row, as the
  loader does; when the ``GPT``'s ``start_text_token`` is the last row, the base rows are
  ``0 .. base-2`` plus that row (pretrained, it begins every sequence), else plain.
- IndexTTS, +1 slot (:data:`INDEXTTS_SLOT`): ``UnifiedVoice`` has ``number_text_tokens *
  types + 1`` rows, the last a slot that is no token, kept last and frozen.
- F5-TTS, filler row 0 (:data:`F5_FILLER`): ``text_embed`` looks token ``i`` up at row
  ``i + 1`` (row 0: padding's filler, frozen); no head; found anywhere in the model.

Owners are looked for at ``.gpt``, ``.xtts.gpt`` and ``.model.gpt``, besides the model itself
and its ``.model``.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

from torch import nn

from ..vocab_rows import RowLayout, register_layout, register_owner_paths, register_vocab_finder


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def start_row_is_last(owner: nn.Module | None, vocab_size: int) -> bool:
    """True when ``owner`` (the module holding the text embedding) is XTTS-like and its
    ``start_text_token`` is the last row: the layout coqui's resize assumes."""
    start = getattr(owner, "start_text_token", None) if owner is not None else None
    return _whole(start) and start == vocab_size - 1


def has_slot_row(owner: nn.Module | None, rows: int) -> bool:
    """True for the IndexTTS ``UnifiedVoice`` layout: ``number_text_tokens * types + 1``
    rows, the last one an extra slot that is no token of the tokenizer."""
    tokens = getattr(owner, "number_text_tokens", None) if owner is not None else None
    types = getattr(owner, "types", 1) if owner is not None else 1
    return _whole(tokens) and _whole(types) and rows == tokens * types + 1 and \
        not start_row_is_last(owner, rows)


def _coqui_start_was_last(ckpt: Mapping[str, Any]) -> bool | None:
    """A coqui XTTS checkpoint's config, when it records them, says whether the OLD
    vocabulary's ``[START]`` was its last id (``gpt_start_text_token`` and
    ``gpt_number_text_tokens`` of ``model_args``)."""
    config = ckpt.get("config")
    args = config.get("model_args") if isinstance(config, Mapping) else None
    old_start = args.get("gpt_start_text_token") if isinstance(args, Mapping) else None
    old_rows = args.get("gpt_number_text_tokens") if isinstance(args, Mapping) else None
    if isinstance(old_start, int) and isinstance(old_rows, int):
        return old_start == old_rows - 1
    return None


XTTS_START_LAST = RowLayout("xtts, [START] last", last_row_kept=True,
                            checkpoint_last_row_kept=_coqui_start_was_last)
INDEXTTS_SLOT = RowLayout("indextts, +1 slot last", last_row_kept=True, extra_rows=1)


@register_layout
def xtts_layout(owner: nn.Module | None, rows: int) -> RowLayout | None:
    """:data:`XTTS_START_LAST` when ``owner``'s ``start_text_token`` is its last row."""
    return XTTS_START_LAST if start_row_is_last(owner, rows) else None


@register_layout
def indextts_layout(owner: nn.Module | None, rows: int) -> RowLayout | None:
    """:data:`INDEXTTS_SLOT` for ``number_text_tokens * types + 1`` rows."""
    return INDEXTTS_SLOT if has_slot_row(owner, rows) else None


F5_FILLER = RowLayout("f5-tts, filler row 0", leading_rows=1)


def is_f5_text_embedding(module: Any) -> bool:
    """An F5-TTS ``TextEmbedding``: ``text_embed`` rows are the tokens shifted by one."""
    kind = type(module)
    return (kind.__name__ == "TextEmbedding" and kind.__module__.startswith("f5_tts.")
            and isinstance(getattr(module, "text_embed", None), nn.Embedding))


@register_layout
def f5_layout(owner: nn.Module | None, rows: int) -> RowLayout | None:
    """:data:`F5_FILLER` for F5-TTS's ``TextEmbedding``."""
    return F5_FILLER if owner is not None and is_f5_text_embedding(owner) else None


@register_vocab_finder
def f5_vocab_modules(model: Any) -> tuple[list[tuple[str, nn.Module]], nn.Module] | None:
    """F5-TTS's text embedding (there is no head), and its ``TextEmbedding`` as the owner."""
    # asked of every live module at an optimizer's first step: no walk without F5 loaded
    if "f5_tts" not in sys.modules or not isinstance(model, nn.Module):
        return None
    for path, module in model.named_modules():
        if is_f5_text_embedding(module):
            return [(f"{path}.text_embed" if path else "text_embed", module.text_embed)], module
    return None


# Tried in this order: the model itself, .gpt, .xtts.gpt, .model (generic), .model.gpt.
register_owner_paths("gpt", "xtts.gpt", before="model",
                     models=("XTTS GPTTrainer", "XTTS GPT", "IndexTTS-style UnifiedVoice"))
register_owner_paths("model.gpt")

__all__ = ["F5_FILLER", "INDEXTTS_SLOT", "XTTS_START_LAST", "f5_layout", "f5_vocab_modules",
           "has_slot_row", "indextts_layout", "is_f5_text_embedding",
           "start_row_is_last", "xtts_layout"]
