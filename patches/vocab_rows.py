"""The rows of a text vocabulary: which rows belong to the base vocabulary (frozen, kept when
it grows) and which are new, for every layout a model may have.

Generic: the layouts (:func:`register_layout`), the paths of a model's ``text_embedding``/
``text_head`` owner (:func:`register_owner_paths`) and the finders of other models'
vocabulary modules (:func:`register_vocab_finder`) are registered by the layer above
(:mod:`patches.integrations.layouts`); a model none claims is :data:`PLAIN`. Used by the
freeze, the checkpoint loader and the tokenizer check; it imports nothing of the package,
and not torch, so the tokenizer tools stay light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from torch import nn


class VocabFreezeError(ValueError):
    """The base vocabulary cannot be frozen as asked (size or model not as expected)."""


# -- the rule ----------------------------------------------------------------


def frozen_rows(vocab_size: int, base_vocab_size: int, *,
                start_row_last: bool = False) -> tuple[range, ...]:
    """The row ranges of the base vocabulary (to freeze), sizes in rows. With
    ``start_row_last`` the base's last row lives in the grown tensor's last row: the base
    rows are ``range(0, base-1)`` and ``range(vocab-1, vocab)``."""
    if base_vocab_size < 1 or base_vocab_size > vocab_size:
        raise VocabFreezeError(
            f"training-patches vocab_freeze: the base vocabulary size is {base_vocab_size}, but "
            f"the model's text embedding has {vocab_size} rows. Expected a base size between 1 "
            f"and {vocab_size} (the number of tokens of the ORIGINAL tokenizer, e.g. 12000 for a "
            f"12k base extended to 24k). Check TRAINING_PATCHES_BASE_VOCAB (or the "
            f"base_vocab_size you passed) and that the model was built with the extended "
            f"tokenizer.")
    if start_row_last and base_vocab_size < vocab_size:
        return (range(0, base_vocab_size - 1), range(vocab_size - 1, vocab_size))
    return (range(0, base_vocab_size),)


def new_rows(vocab_size: int, base_vocab_size: int, *, start_row_last: bool = False) -> range:
    """The rows that train (the complement of :func:`frozen_rows`, always one range)."""
    frozen_rows(vocab_size, base_vocab_size, start_row_last=start_row_last)  # validates
    if start_row_last and base_vocab_size < vocab_size:
        return range(base_vocab_size - 1, vocab_size - 1)
    return range(base_vocab_size, vocab_size)


def describe_rows(rows: Sequence[range]) -> str:
    """Row ranges as log lines write them: ``0-72, 81`` (empty ranges left out)."""
    return ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
                     for r in rows if len(r))


# -- layouts -----------------------------------------------------------------


@dataclass(frozen=True)
class RowLayout:
    """How the rows of a text embedding map to tokens. ``last_row_kept``: the last row is
    the base model's and stays last when the vocabulary grows; ``extra_rows``: rows after the
    tokens that are no token (a base of N tokens is N + extra_rows rows); ``leading_rows``:
    rows before token 0 that are no token, frozen with the base;
    ``checkpoint_last_row_kept(ckpt)``: whether the OLD vocabulary had that row last too
    (None where the checkpoint does not say)."""

    name: str
    last_row_kept: bool = False
    extra_rows: int = 0
    leading_rows: int = 0
    checkpoint_last_row_kept: Callable[[Mapping[str, Any]], bool | None] | None = field(
        default=None, compare=False, repr=False)

    def base_rows(self, base_tokens: int) -> int:
        return base_tokens + self.extra_rows + self.leading_rows


PLAIN = RowLayout("plain")

# detect(owner, rows) -> the owner's layout, or None when it is not one the detector knows
Detect = Callable[["nn.Module | None", int], "RowLayout | None"]
_layouts: list[Detect] = []
# The model itself and a generic wrapper's model; the layer above adds the paths its
# models keep their text embedding at.
_owner_paths: list[str] = ["", "model"]
_owner_models: list[str] = []


def register_layout(detect: Detect) -> Detect:
    """Add a layout detector: ``detect(owner, rows)``, the :class:`RowLayout` of ``owner``
    (holding ``text_embedding``/``text_head``) for ``rows`` rows, or None; the first answer
    wins, none is :data:`PLAIN`. Registering the same function again changes nothing."""
    if detect not in _layouts:
        _layouts.append(detect)
    return detect


def row_layout(owner: nn.Module | None, rows: int) -> RowLayout:
    """The :class:`RowLayout` of the module that owns ``text_embedding``/``text_head``."""
    for detect in _layouts:
        layout = detect(owner, rows)
        if layout is not None:
            return layout
    return PLAIN


def _hf_finder(model: Any) -> tuple[list[tuple[str, Any]], Any] | None:
    """A Hugging Face ``PreTrainedModel``'s vocabulary modules with their paths, and the
    model: ``get_input_embeddings()`` and, when it is a Linear with one output per token,
    ``get_output_embeddings()``; rows are tokens (PLAIN). None for any other model."""
    if not any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__):
        return None
    try:
        embedding = model.get_input_embeddings()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except (AttributeError, NotImplementedError):  # e.g. XTTS's GPT2 core, whose wte is gone
        return None
    rows = getattr(embedding, "num_embeddings", None)
    if type(embedding).__name__ != "Embedding" or rows is None:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    found = [(names.get(id(embedding), "input_embeddings"), embedding)]
    if type(head).__name__ == "Linear" and getattr(head, "out_features", None) == rows:
        found.append((names.get(id(head), "output_embeddings"), head))
    return found, model


# find(model) -> (the vocabulary modules with their paths, the module owning them) or None:
# models that keep their vocabulary elsewhere than text_embedding/text_head (a Hugging Face
# model's get_input_embeddings(), F5-TTS's text_embed). The first that answers wins.
Find = Callable[[Any], "tuple[list[tuple[str, Any]], Any] | None"]
_finders: list[Find] = []


def register_vocab_finder(find: Find) -> Find:
    """Add a finder of vocabulary modules for models without ``text_embedding``/``text_head``:
    ``find(model)`` -> ``([(path, module), ...], owner)`` (the embedding first; the owner's
    :func:`row_layout` applies), or None. Registering the same function again changes nothing."""
    if find not in _finders:
        _finders.append(find)
    return find


def find_vocab_modules(model: Any) -> tuple[list[tuple[str, Any]], Any] | None:
    """The registered finders' answer for ``model`` (the first that answers), else None.
    The freeze and the vocabulary-aware loader both ask here."""
    for find in _finders:
        hit = find(model)
        if hit:
            return hit
    return None


register_vocab_finder(_hf_finder)


def register_owner_paths(*paths: str, models: Sequence[str] = (),
                         before: str | None = None) -> None:
    """Add submodule paths (``"gpt"``, ``"a.b"``) at which a model keeps the owner of
    ``text_embedding``/``text_head``, tried in order (at the end, or before ``before``), and
    the names of the models they are for (error messages list them)."""
    new = [path for path in dict.fromkeys(paths) if path not in _owner_paths]
    at = _owner_paths.index(before) if before in _owner_paths else len(_owner_paths)
    _owner_paths[at:at] = new
    _owner_models.extend(name for name in models if name not in _owner_models)


def owner_paths() -> tuple[str, ...]:
    """The paths tried, in order, for the owner of the text embedding ("" is the model)."""
    return tuple(_owner_paths)


def owner_models() -> tuple[str, ...]:
    """The names of the models whose owner paths were registered."""
    return tuple(_owner_models)


__all__ = ["PLAIN", "RowLayout", "VocabFreezeError", "describe_rows", "find_vocab_modules",
           "frozen_rows", "new_rows", "register_vocab_finder",
           "owner_models", "owner_paths", "register_layout", "register_owner_paths",
           "row_layout"]
