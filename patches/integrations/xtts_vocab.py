"""XTTS (coqui-tts 0.28): freeze the base vocabulary of every GPTTrainer it builds.

With ``TRAINING_PATCHES_BASE_VOCAB=12000`` (or ``patches.apply(base_vocab=12000)``)
the ``vocab_freeze`` patch wraps ``GPTTrainer.__init__``: once the original has built
the model (and loaded ``xtts_checkpoint``/``gpt_checkpoint``, resized or not), it calls
:func:`patches.vocab_freeze.freeze_base_vocab` on it. Unset, the wrapper only calls the
original.

Why this site and not another (the least invasive one that is always on the path):

- every start AND every resume builds a fresh ``GPTTrainer`` (the coqui Trainer takes
  a built model; ``continue_path``/``restore_path`` only load weights into it), so
  the hooks come back by themselves on resume;
- it runs after XTTS loads its own checkpoints, so the stored base rows are the
  pretrained ones; weights the coqui Trainer restores later go through
  ``load_state_dict``, which the freeze watches (a load-state-dict post-hook on the
  embedding and head) to refresh its stored rows;
- it runs before the Trainer builds its optimizer; the freeze uses torch's global
  optimizer step post-hook, filtered to optimizers holding these parameters, so it
  needs nothing from the Trainer, and ``Trainer.restore_model`` (wrapped by the
  checkpoint patch) is left alone;
- ``Xtts.init_models`` would be too early (before checkpoints load) and is also used
  for inference, where nothing trains.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .._registry import Site

SUPPORTED = "coqui-tts >= 0.24, < 0.30"
MODULE = "TTS.tts.layers.xtts.trainer.gpt_trainer"
INIT_ATTR = "GPTTrainer.__init__"
PATCH = "vocab_freeze"


def wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    """``GPTTrainer.__init__`` that freezes the base rows when ``base_vocab`` is set."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from .. import _options
        from .._registry import is_enabled

        base = _options.current().base_vocab
        if base and is_enabled(PATCH):
            from ..vocab_freeze import freeze_base_vocab

            freeze_base_vocab(self, base)

    __init__._training_patch = PATCH  # type: ignore[attr-defined]
    return __init__


def sites() -> tuple[Site, ...]:
    return (Site(MODULE, INIT_ATTR, wrap_init),)
