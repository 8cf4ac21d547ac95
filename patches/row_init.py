"""Where the rows of new vocabulary tokens start: the rules, and the trained rows a new
token's spelling points to. Design and measurements: docs/design/row_init.md.

- ``romanized_offset`` (default): halfway from the old rows' mean to the ``romanized`` row,
  plus one offset shared by the new language's spelled rows; a new language tag (``[am]``)
  starts as the start token (XTTS's ``[START]``) where the layout has one.
- ``romanized``: the mean of the trained rows of the pieces the token's Latin spelling
  encodes to (``ሰላም`` -> ``selam`` -> ``se`` + ``lam``), plus 0.1 of their spread as noise.
- ``spread``: the old rows' mean plus noise of their own per-channel spread (also what a
  token nothing spells falls back to, counted). ``mean``: transformers' ``mean_resizing``.
- ``std0.02``: N(0, 0.02), GPT-2's and IndexTTS's init. ``randn``: N(0, 1), GPTTrainer's.

A head bias follows its head's rule (the spelled rules: its pieces' mean; ``randn``/
``std0.02``: zero; otherwise the old mean). Pure functions of tensors and the seed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import languages

ROW_INITS = ("romanized_offset", "romanized", "spread", "mean", "std0.02", "randn")
# The rules that start a new row from its spelling (they need the grown tokenizer).
SPELLED_RULES = ("romanized", "romanized_offset")
# The embedding rules under which a new language tag ([am]) starts, in the embedding, the
# head and its bias, as the start token's rows where the layout has one (XTTS's [START], the
# last row): the base model reads it as the beginning of a text and never predicts it.
TAGS_FROM_START = ("romanized_offset",)
# The defaults, chosen from the benchmarks (docs/design/row_init.md, "Why the default"):
# the embedding from the token's spelling, pulled in and moved apart from the base language;
# the head at the old rows' own spread.
DEFAULT_ROW_INIT = "romanized_offset"
DEFAULT_HEAD_ROW_INIT = "spread"
# The rule of a row that a spelled rule cannot place.
FALLBACK = "spread"
# Noise around a romanised row, in units of the old rows' per-channel standard deviation:
# enough to tell apart tokens spelled alike (ሰ and ሠ are both "se"), small beside the row.
ROMANIZED_NOISE = 0.1
# romanized_offset: how much of a spelled row's distance from the old mean it keeps, and the
# shared offset's length in units of the old rows' mean distance from their mean
# (docs/benchmarks.md, "A shared offset for the new language").
SPELLING_SHARE = 0.5
OFFSET_LENGTH = 0.6
# A language tag token, XTTS's form: [en], [am], [zh-cn].
LANGUAGE_TAG = re.compile(r"\[[a-z]{2,3}(-[a-z]{2,4})?\]")
# transformers scales the old rows' covariance by this before sampling new rows.
COVARIANCE_SCALE = 1e-9


@dataclass(frozen=True)
class RowSources:
    """The trained rows each new row of a grown vocabulary starts from (the spelled rules).

    ``sources``: new row -> the rows of the pieces its spelling encodes to. ``spelled``:
    new row -> its token and its spelling. ``unspelled``: new row -> its token, for the rows
    that fall back (no romaniser spells it, or its spelling encodes to no trained piece).
    Rows are token ids of the grown tokenizer (the row of token ``i`` is row ``i``), or,
    after :meth:`shifted`, rows of a layout with rows before token 0 (F5-TTS's filler).
    """

    sources: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    spelled: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    unspelled: Mapping[int, str] = field(default_factory=dict)
    # the unspelled rows whose token is a language tag (``[am]``)
    tags: Mapping[int, str] = field(default_factory=dict)

    def shifted(self, rows: int) -> RowSources:
        """The same sources with every token id moved ``rows`` rows down (token ``i`` at
        row ``i + rows``)."""
        return RowSources({r + rows: tuple(i + rows for i in ids) for r, ids in self.sources.items()},
                          {r + rows: v for r, v in self.spelled.items()},
                          {r + rows: v for r, v in self.unspelled.items()},
                          {r + rows: v for r, v in self.tags.items()})

    def fallback_tokens(self, tags_from_start: bool = False) -> list[str]:
        """The tokens whose rows fall back to :data:`FALLBACK`: every unspelled one, but the
        language tags when they start as the start token."""
        tags = self.tags if tags_from_start else {}
        return [t for r, t in self.unspelled.items() if r not in tags]

    def describe(self, limit: int = 5, tags_from_start: bool = False) -> str:
        """``118 from their spelling, 2 by spread ('።', '፣')``; with ``tags_from_start``, the
        language tags apart: ``..., 1 language tag as the start token ('[am]')``."""
        text = f"{len(self.sources)} from their spelling"
        tags = self.tags if tags_from_start else {}
        fallback = self.fallback_tokens(tags_from_start)
        for count, how, tokens in ((len(fallback), f"by {FALLBACK}", fallback),
                                   (len(tags), "language tag(s) as the start token",
                                    list(tags.values()))):
            if count:
                shown = ", ".join(repr(t) for t in tokens[:limit])
                more = ", ..." if count > limit else ""
                text += f", {count} {how} ({shown}{more})"
        return text


def check_rule(rule: Any, what: str = "row_init") -> str:
    """``rule`` if it names one of :data:`ROW_INITS`, else a one-paragraph ValueError."""
    if rule not in ROW_INITS:
        raise ValueError(
            f"training-patches: {what} is {rule!r}. Expected one of {', '.join(ROW_INITS)} "
            f"(docs/benchmarks.md, 'New rows that learn', measures each; TRAINING_PATCHES_"
            f"{what.upper()} sets the default).")
    return rule


def _stats(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = base.mean(dim=0)
    std = base.std(dim=0, unbiased=False) if base.shape[0] > 1 else torch.zeros_like(mean)
    return mean, std


def new_row_values(base: torch.Tensor, rows: Sequence[int], rule: str,
                   generator: torch.Generator, sources: RowSources | None = None
                   ) -> torch.Tensor:
    """The values of the new rows ``rows`` (float64, ``len(rows)`` x dim) under ``rule``,
    from ``base`` (the trained rows, float64, indexed as the grown tensor's first rows)."""
    check_rule(rule)
    k, dim = len(rows), base.shape[1]
    # One draw for every rule, so each rule's noise is the same function of the seed.
    noise = torch.randn(k, dim, generator=generator, dtype=torch.float64)
    if rule == "randn":
        return noise
    if rule == "std0.02":
        return 0.02 * noise
    mean, std = _stats(base)
    if rule == "mean":
        centered = base - mean
        covariance = centered.T @ centered / base.shape[0]
        try:
            # Cholesky succeeds exactly when the scaled covariance is positive definite,
            # which is transformers' condition for sampling from it.
            chol = torch.linalg.cholesky(COVARIANCE_SCALE * covariance)
            return mean + noise @ chol.T
        except RuntimeError:
            return mean + noise * (COVARIANCE_SCALE ** 0.5) * std
    spread = mean + noise * std
    if rule == "spread" or sources is None:
        return spread
    out = spread.clone()
    spelled = [i for i, row in enumerate(rows) if sources.sources.get(row)]
    for i in spelled:
        out[i] = base[list(sources.sources[rows[i]])].mean(dim=0) + ROMANIZED_NOISE * noise[i] * std
    if rule == "romanized_offset" and spelled:
        out[spelled] = mean + SPELLING_SHARE * (out[spelled] - mean) + \
            language_offset(base, generator)
    return out


def language_offset(base: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The offset ``romanized_offset`` adds to every spelled new row: a random direction
    (drawn after the rows' noise), :data:`OFFSET_LENGTH` times the old rows' mean distance
    from their mean."""
    direction = torch.randn(base.shape[1], generator=generator, dtype=torch.float64)
    length = (base - base.mean(dim=0)).norm(dim=1).mean()
    return direction / direction.norm() * OFFSET_LENGTH * length


def new_bias_values(base: torch.Tensor, rows: Sequence[int], rule: str,
                    generator: torch.Generator, sources: RowSources | None = None
                    ) -> torch.Tensor:
    """The new entries of a head bias (float64) under its head's ``rule``."""
    check_rule(rule)
    k = len(rows)
    noise = torch.randn(k, generator=generator, dtype=torch.float64)
    if rule in ("randn", "std0.02"):
        return torch.zeros(k, dtype=torch.float64)
    std = base.std(unbiased=False) if base.numel() > 1 else torch.zeros((), dtype=torch.float64)
    out = base.mean() + noise * COVARIANCE_SCALE * std
    if rule in SPELLED_RULES and sources is not None:
        for i, row in enumerate(rows):
            pieces = sources.sources.get(row)
            if pieces:
                out[i] = base[list(pieces)].mean()
    return out


# -- spellings -> trained rows ---------------------------------------------------------------


class _Tokens:
    """A tokenizer seen as ``token(id)`` and ``encode(text) -> ids``: a Hugging Face
    ``tokenizers`` JSON file or object, a SentencePiece ``.model`` file or processor, or
    anything holding one of them as ``.tokenizer`` / ``.sp_model`` (coqui's tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _open(os.fspath(tokenizer))
        for attr in ("tokenizer", "sp_model"):
            inner = getattr(tokenizer, attr, None)
            if inner is not None and not _usable(tokenizer):
                tokenizer = inner
        if not _usable(tokenizer):
            raise TypeError(
                f"training-patches: row_init 'romanized' or 'romanized_offset' needs the grown "
                f"tokenizer to spell new tokens, and got a {type(tokenizer).__name__}. Expected "
                f"a path to a vocab.json (Hugging Face tokenizers) or a SentencePiece .model, "
                f"or such a tokenizer object.")
        self._tok = tokenizer
        self._spm = hasattr(tokenizer, "id_to_piece")
        unk = (tokenizer.unk_id() if self._spm else tokenizer.token_to_id("[UNK]"))
        self.unk = unk if isinstance(unk, int) else -1

    def token(self, index: int) -> str | None:
        try:
            return self._tok.id_to_piece(index) if self._spm else self._tok.id_to_token(index)
        except Exception:  # an id beyond the tokenizer: no token
            return None

    def encode(self, text: str) -> list[int]:
        if self._spm:
            return list(self._tok.encode(text))
        return list(self._tok.encode(text).ids)


def _usable(tokenizer: Any) -> bool:
    return (hasattr(tokenizer, "id_to_piece") or hasattr(tokenizer, "id_to_token")) and \
        hasattr(tokenizer, "encode")


def _open(path: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"training-patches: the spelled row rules were given the tokenizer {path}, which is "
            f"not a file. Expected the grown tokenizer the model was built with (vocab.json or "
            f"a SentencePiece .model).")
    if path.endswith(".json"):
        from tokenizers import Tokenizer  # lazy: tokenizers is optional

        return Tokenizer.from_file(path)
    import sentencepiece  # lazy: only a SentencePiece tokenizer needs it

    return sentencepiece.SentencePieceProcessor(model_file=path)


def _is_special(token: str) -> bool:
    return len(token) > 2 and ((token[0] == "[" and token[-1] == "]") or
                               (token[0] == "<" and token[-1] == ">"))


def romanized_sources(tokenizer: Any, rows: Iterable[int],
                      trained: Callable[[int], bool],
                      romanize: Callable[[str], tuple[str, str] | None] | None = None,
                      ) -> RowSources:
    """For each new row in ``rows``: its token spelled by a registered language's romaniser
    (``romanize``, default :func:`patches.languages.romanize`), encoded with ``tokenizer``,
    and the pieces kept whose rows ``trained(id)`` says hold trained values (never the
    unknown token). A row with no spelling, or none of whose pieces is trained, is listed
    in ``unspelled`` (it falls back to :data:`FALLBACK`); one whose token is a language tag
    (``[am]``, XTTS's form) in ``tags`` too."""
    tokens = _Tokens(tokenizer)
    speller = romanize or languages.romanize
    sources: dict[int, tuple[int, ...]] = {}
    spelled: dict[int, tuple[str, str]] = {}
    unspelled: dict[int, str] = {}
    tags: dict[int, str] = {}
    for row in rows:
        token = tokens.token(row)
        text = (token or "").replace("\u2581", " ").strip()
        found = speller(text) if text and not _is_special(text) else None
        pieces: tuple[int, ...] = ()
        if found is not None:
            ids = [i for i in tokens.encode(found[0]) if i != tokens.unk and trained(i)]
            pieces = tuple(ids)
        if pieces:
            sources[row] = pieces
            spelled[row] = (token or "", found[0] if found else "")
        else:
            unspelled[row] = token if token is not None else f"<row {row}>"
            if LANGUAGE_TAG.fullmatch(text):
                tags[row] = text
    return RowSources(sources, spelled, unspelled, tags)


__all__ = ["COVARIANCE_SCALE", "DEFAULT_HEAD_ROW_INIT", "DEFAULT_ROW_INIT", "FALLBACK",
           "OFFSET_LENGTH", "ROMANIZED_NOISE", "ROW_INITS", "RowSources", "SPELLED_RULES",
           "SPELLING_SHARE", "TAGS_FROM_START", "check_rule", "language_offset", "new_bias_values",
           "new_row_values", "romanized_sources"]
