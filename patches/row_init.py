"""Where the rows of new vocabulary tokens start: the rules, and the trained rows a new
token's spelling points to. Design and measurements: docs/design/row_init.md.

- ``romanized``: the mean of the trained rows of the pieces the token's Latin spelling
  encodes to (``ሰላም`` -> ``selam`` -> ``se`` + ``lam``; the registered language's
  ``romanize``, Amharic built in), plus 0.1 of the old rows' per-channel spread as noise;
  a token nothing spells falls back to ``spread`` and is counted.
- ``spread``: the old rows' mean plus noise of their own per-channel spread.
- ``mean``: transformers' ``mean_resizing`` (every new row the old mean, within 3e-5 std).
- ``std0.02``: N(0, 0.02), GPT-2's and IndexTTS's init. ``randn``: N(0, 1), GPTTrainer's.

A head bias follows its head's rule (``romanized``: its pieces' mean; ``randn``/``std0.02``:
zero; otherwise the old mean). Pure functions of tensors and the seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import languages

ROW_INITS = ("romanized", "spread", "mean", "std0.02", "randn")
# The defaults, chosen from the benchmarks (docs/design/row_init.md, "Why the default"):
# the embedding from the token's spelling, the head at the old rows' own spread.
DEFAULT_ROW_INIT = "romanized"
DEFAULT_HEAD_ROW_INIT = "spread"
# The rule of a row that "romanized" cannot place.
FALLBACK = "spread"
# Noise around a romanised row, in units of the old rows' per-channel standard deviation:
# enough to tell apart tokens spelled alike (ሰ and ሠ are both "se"), small beside the row.
ROMANIZED_NOISE = 0.1
# transformers scales the old rows' covariance by this before sampling new rows.
COVARIANCE_SCALE = 1e-9


@dataclass(frozen=True)
class RowSources:
    """The trained rows each new row of a grown vocabulary starts from (rule ``romanized``).

    ``sources``: new row -> the rows of the pieces its spelling encodes to. ``spelled``:
    new row -> its token and its spelling. ``unspelled``: new row -> its token, for the rows
    that fall back (no romaniser spells it, or its spelling encodes to no trained piece).
    Rows are token ids of the grown tokenizer (the row of token ``i`` is row ``i``), or,
    after :meth:`shifted`, rows of a layout with rows before token 0 (F5-TTS's filler).
    """

    sources: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    spelled: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    unspelled: Mapping[int, str] = field(default_factory=dict)

    def shifted(self, rows: int) -> RowSources:
        """The same sources with every token id moved ``rows`` rows down (token ``i`` at
        row ``i + rows``)."""
        return RowSources({r + rows: tuple(i + rows for i in ids) for r, ids in self.sources.items()},
                          {r + rows: v for r, v in self.spelled.items()},
                          {r + rows: v for r, v in self.unspelled.items()})

    def describe(self, limit: int = 5) -> str:
        """``118 from their spelling, 2 by spread ('።', '፣')``."""
        text = f"{len(self.sources)} from their spelling"
        if self.unspelled:
            shown = ", ".join(repr(t) for t in list(self.unspelled.values())[:limit])
            more = ", ..." if len(self.unspelled) > limit else ""
            text += f", {len(self.unspelled)} by {FALLBACK} ({shown}{more})"
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
    for i, row in enumerate(rows):
        pieces = sources.sources.get(row)
        if pieces:
            out[i] = base[list(pieces)].mean(dim=0) + ROMANIZED_NOISE * noise[i] * std
    return out


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
    if rule == "romanized" and sources is not None:
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
                f"training-patches: row_init 'romanized' needs the grown tokenizer to spell new "
                f"tokens, and got a {type(tokenizer).__name__}. Expected a path to a vocab.json "
                f"(Hugging Face tokenizers) or a SentencePiece .model, or such a tokenizer object.")
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
            f"training-patches: row_init 'romanized' was given the tokenizer {path}, which is "
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
    in ``unspelled`` (it falls back to :data:`FALLBACK`)."""
    tokens = _Tokens(tokenizer)
    speller = romanize or languages.romanize
    sources: dict[int, tuple[int, ...]] = {}
    spelled: dict[int, tuple[str, str]] = {}
    unspelled: dict[int, str] = {}
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
    return RowSources(sources, spelled, unspelled)


__all__ = ["COVARIANCE_SCALE", "DEFAULT_HEAD_ROW_INIT", "DEFAULT_ROW_INIT", "FALLBACK", "ROMANIZED_NOISE", "ROW_INITS", "RowSources",
           "check_rule", "new_bias_values", "new_row_values", "romanized_sources"]
