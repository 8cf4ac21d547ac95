"""Where the rows of new vocabulary tokens start: the rules, and the trained rows a new
token's spelling points to. Design and measurements: docs/design/row_init.md.

- ``auto`` (default, the embedding only): ``spelling`` where the base model reads its text,
  ``std0.02`` where it does not (:mod:`patches.reads_text` asks it), ``spelling`` where unknown.
- ``spelling``: the ``romanized`` row, its noise from a fixed seed (the same start for every
  seed); a new language tag (``[am]``) starts as the start token (XTTS's ``[START]``).
- ``romanized``: the mean of the trained rows of the pieces the token's Latin spelling
  encodes to (``ሰላም`` -> ``selam`` -> ``se`` + ``lam``), plus 0.1 of their spread as noise.
- ``romanized_offset`` (deprecated, one WARNING): halfway to the old mean, plus a shared offset.
- ``spread``: the old rows' mean plus noise of their own per-channel spread (also what a
  token nothing spells falls back to). ``mean``: transformers' ``mean_resizing``. ``std0.02``:
  N(0, 0.02), GPT-2's and IndexTTS's init. ``randn``: N(0, 1), GPTTrainer's. A head bias
  follows its head's rule. Pure functions of tensors and the seed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import languages
from ._log import logger

ROW_INITS = ("auto", "spelling", "romanized", "romanized_offset", "spread", "mean", "std0.02",
             "randn")
# The rules that start a new row from its spelling (they need the grown tokenizer).
SPELLED_RULES = ("spelling", "romanized", "romanized_offset")
# auto: the embedding's rule by whether the base model reads its text (patches.reads_text),
# True / False / None (not measured): spelled rows where it reads, near-zero rows where it
# does not (the new rows only disturb a model that does not read), spelled where unknown.
AUTO = "auto"
AUTO_RULES = {True: "spelling", False: "std0.02", None: "spelling"}
# The rules under which a new language tag ([am]) starts as the start token's rows (XTTS's
# [START]), where the layout has one: the base model reads it as a text's beginning.
TAGS_FROM_START = ("spelling", "romanized_offset")
# The defaults, chosen on held-out configurations (docs/design/row_init.md, "Why the default").
DEFAULT_ROW_INIT = AUTO
DEFAULT_HEAD_ROW_INIT = "spread"
# Rules kept working under their name, with one WARNING: why each is deprecated.
DEPRECATED_RULES = {
    "romanized_offset": "its one random offset makes the start depend on the seed (the "
                        "Amharic loss at step 0 spread 0.016-0.068 nats/code over load seeds "
                        "on one base model), and on base models it was not tuned on it kept "
                        "the base language no better than the spelled rows (docs/benchmarks.md, "
                        "issue 38)",
}
_warned_deprecated: set[str] = set()
# The rule of a row that a spelled rule cannot place.
FALLBACK = "spread"
# Noise around a romanised row, in units of the old rows' per-channel standard deviation:
# enough to tell apart tokens spelled alike (ሰ and ሠ are both "se"), small beside the row.
ROMANIZED_NOISE = 0.1
# spelling: the same rows as romanized, their noise (and the fallback rows') drawn from this
# fixed seed instead of the load's: the start is the same whatever the seed (no lottery).
SPELLING_NOISE_SEED = 20261127
# romanized_offset: the share of a spelled row's distance from the old mean it keeps, and the
# shared offset's length in the old rows' mean distance from their mean.
SPELLING_SHARE = 0.5
OFFSET_LENGTH = 0.6
# A language tag token, XTTS's form: [en], [am], [zh-cn].
LANGUAGE_TAG = re.compile(r"\[[a-z]{2,3}(-[a-z]{2,4})?\]")
# transformers scales the old rows' covariance by this before sampling new rows.
COVARIANCE_SCALE = 1e-9


@dataclass(frozen=True)
class RowSources:
    """The trained rows each new row of a grown vocabulary starts from (the spelled rules).

    ``sources``: new row -> the rows of its spelling's pieces; ``spelled``: -> its token and
    spelling; ``unspelled``: -> its token, for the rows that fall back. Rows are the grown
    tokenizer's ids, or after :meth:`shifted`, rows of a layout with rows before token 0.
    """

    sources: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    spelled: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    unspelled: Mapping[int, str] = field(default_factory=dict)
    # the unspelled rows whose token is a language tag (``[am]``)
    tags: Mapping[int, str] = field(default_factory=dict)
    # the romaniser (its label, patches.languages.Romanizer) -> the rows it spelled
    spelled_by: Mapping[str, int] = field(default_factory=dict)
    # the romaniser -> (texts it failed on: raised or returned no string, texts asked, the first)
    failures: Mapping[str, tuple[int, int, str]] = field(default_factory=dict)

    def shifted(self, rows: int) -> RowSources:
        """The same sources with every token id moved ``rows`` rows down (token ``i`` at
        row ``i + rows``)."""
        return replace(self,
                       sources={r + rows: tuple(i + rows for i in ids)
                                for r, ids in self.sources.items()},
                       spelled={r + rows: v for r, v in self.spelled.items()},
                       unspelled={r + rows: v for r, v in self.unspelled.items()},
                       tags={r + rows: v for r, v in self.tags.items()})

    def spellers(self) -> str:
        """``spelled by the library's Amharic table ('am'): 7``: who spelled how many rows
        ("" when none was spelled)."""
        if not self.spelled_by:
            return ""
        return "spelled by " + ", ".join(f"{who}: {n}" for who, n in self.spelled_by.items())

    def warnings(self) -> list[str]:
        """One line for each romaniser that failed on most of the texts it was asked."""
        return [f"training-patches: {who} failed on {failed} of the {asked} new token(s) it was "
                f"asked to spell (the first: {first}); those tokens went to the next romaniser "
                f"or started by {FALLBACK}. Expected the token in Latin letters, or None for "
                f"text it cannot spell: fix the function."
                for who, (failed, asked, first) in self.failures.items() if 2 * failed > asked]

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
        for how, tokens in ((f"by {FALLBACK}", fallback),
                            ("language tag(s) as the start token", list(tags.values()))):
            if tokens:
                shown = ", ".join(repr(t) for t in tokens[:limit])
                more = ", ..." if len(tokens) > limit else ""
                text += f", {len(tokens)} {how} ({shown}{more})"
        return text


def rules_for(what: str = "row_init") -> tuple[str, ...]:
    """The rules ``what`` takes: ``auto`` chooses the embedding's rows (``row_init``) only."""
    return ROW_INITS if what == "row_init" else tuple(r for r in ROW_INITS if r != AUTO)


def check_rule(rule: Any, what: str = "row_init") -> str:
    """``rule`` if it names one of :data:`ROW_INITS`, else a one-paragraph ValueError. A
    rule of :data:`DEPRECATED_RULES` still runs, with one WARNING per process."""
    allowed = rules_for(what)
    if rule not in allowed:
        raise ValueError(
            f"training-patches: {what} is {rule!r}. Expected one of {', '.join(allowed)} "
            f"(docs/benchmarks.md, 'New rows that learn', measures each; TRAINING_PATCHES_"
            f"{what.upper()} sets the default).")
    if rule in DEPRECATED_RULES and rule not in _warned_deprecated:
        _warned_deprecated.add(rule)
        logger.warning("training-patches: %s %r is deprecated and still runs: %s. Use %r "
                       "(the default) or leave %s unset.", what, rule, DEPRECATED_RULES[rule],
                       DEFAULT_ROW_INIT, what)
    return rule


def new_row_values(base: torch.Tensor, rows: Sequence[int], rule: str,
                   generator: torch.Generator, sources: RowSources | None = None
                   ) -> torch.Tensor:
    """The values of the new rows ``rows`` (float64, ``len(rows)`` x dim) under ``rule``,
    from ``base`` (the trained rows, float64, indexed as the grown tensor's first rows)."""
    if check_rule(rule) == AUTO:
        raise ValueError("row_init 'auto' is resolved by the loader (plan_model) to "
                         f"{' or '.join(sorted(set(AUTO_RULES.values())))} before any row is made")
    k, dim = len(rows), base.shape[1]
    # One draw for every rule, so each rule's noise is the same function of the seed.
    noise = torch.randn(k, dim, generator=generator, dtype=torch.float64)
    if rule == "randn":
        return noise
    if rule == "std0.02":
        return 0.02 * noise
    mean = base.mean(dim=0)
    std = base.std(dim=0, unbiased=False) if base.shape[0] > 1 else torch.zeros_like(mean)
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
    if rule == "spelling":
        # the load's draw is made all the same (the head's noise stays the seed's), but
        # the rows' noise is the fixed seed's
        fixed = torch.Generator().manual_seed(SPELLING_NOISE_SEED)
        noise = torch.randn(k, dim, generator=fixed, dtype=torch.float64)
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


# -- the tokenizer the spellings are encoded with ----------------------------------------------

# A tokenizer's structural tokens (unknown, start and end of a text, XTTS's [SPACE]): the base
# vocabulary has them from the start, so a tokenizer holding one at a new row is not the
# model's (with its unknown token and a SentencePiece model's control pieces).
STRUCTURAL_TOKENS = ("[UNK]", "[START]", "[STOP]", "[SPACE]", "<unk>", "<s>", "</s>")
_BOM = b"\xef\xbb\xbf"


class TokenizerReadError(ValueError):
    """The tokenizer given to the spelled rules cannot be read or used. The message says what
    was found and what is expected; the loader puts it in its one paragraph."""


def tokenizer_format(path: str | os.PathLike[str]) -> str:
    """``"json"`` (a Hugging Face ``tokenizers`` file, XTTS's vocab.json) or
    ``"sentencepiece"`` (a SentencePiece model), told by the file's content, whatever its
    name: a JSON file starts with ``{``."""
    with open(path, "rb") as handle:
        head = handle.read(64)
    return "json" if head.removeprefix(_BOM).lstrip()[:1] == b"{" else "sentencepiece"


class Tokens:
    """A tokenizer as the spelled rules read it: ``token(id)``, ``encode(text) -> ids`` (no
    special token added), ``size`` (None when unknown), ``unk`` (-1: none) and ``name``. From
    a file (a ``tokenizers`` JSON or a SentencePiece model, by its content), or an object: a
    ``tokenizers``, SentencePiece or ``transformers`` tokenizer, or one holding it as
    ``.tokenizer``, ``.sp_model`` or ``.backend_tokenizer``; else a TokenizerReadError."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):
            self.name = os.fspath(tokenizer)
            tokenizer = _open(self.name)
        else:
            self.name = f"given (a {type(tokenizer).__name__})"
        kind = _kind(tokenizer)
        for attr in ("tokenizer", "sp_model", "backend_tokenizer"):
            inner = getattr(tokenizer, attr, None)
            if kind is None and inner is not None and _kind(inner) is not None:
                tokenizer, kind = inner, _kind(inner)
        if kind is None:
            raise TokenizerReadError(
                f"a {type(tokenizer).__name__} is not a tokenizer the spelled rules can read; "
                f"expected a path to a vocab.json (Hugging Face tokenizers) or a SentencePiece "
                f"model, or such a tokenizer object (tokenizers, sentencepiece, transformers, "
                f"or one holding it as .tokenizer)")
        self._tok = tok = tokenizer
        self.kind = kind
        self.size: int | None
        if kind == "sentencepiece":
            self.size, unk = int(tok.get_piece_size()), tok.unk_id()
        elif kind == "transformers":
            self.size, unk = len(tok), tok.unk_token_id
        else:
            vocab = tok.get_vocab(with_added_tokens=True) if hasattr(tok, "get_vocab") else None
            self.size = max(vocab.values()) + 1 if vocab else None
            named = getattr(getattr(tok, "model", None), "unk_token", None)
            unk = next((i for i in (self.id_of(t) for t in (named, "[UNK]", "<unk>") if t)
                        if i is not None), None)
        self.unk = unk if isinstance(unk, int) else -1

    def token(self, index: int) -> str | None:
        """The token of id ``index``; None beyond the tokenizer."""
        if self.size is not None and not 0 <= index < self.size:
            return None
        try:
            if self.kind == "sentencepiece":
                return self._tok.id_to_piece(index)
            if self.kind == "transformers":
                return self._tok.convert_ids_to_tokens(index)
            return self._tok.id_to_token(index)
        except Exception:  # an id beyond the tokenizer: no token
            return None

    def id_of(self, token: str) -> int | None:
        """The id of ``token``, None when the tokenizer has no such token."""
        tok = self._tok
        try:
            if self.kind == "tokenizers":
                found = tok.token_to_id(token) if hasattr(tok, "token_to_id") else None
            else:
                found = (tok.piece_to_id(token) if self.kind == "sentencepiece"
                         else tok.convert_tokens_to_ids(token))
                # both answer the unknown token's id for a token they lack
                found = found if isinstance(found, int) and self.token(found) == token else None
        except Exception:  # an object that cannot look it up: it does not have it
            return None
        return found if isinstance(found, int) else None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without the special tokens a tokenizer may add around it."""
        try:
            if self.kind == "sentencepiece":
                return list(self._tok.encode(text))
            if self.kind == "transformers":
                return list(self._tok.encode(text, add_special_tokens=False))
            try:
                encoded = self._tok.encode(text, add_special_tokens=False)
            except TypeError:  # a tokenizer-like object without the keyword
                encoded = self._tok.encode(text)
            return list(encoded.ids)
        except Exception as exc:  # the library's own errors are plain Exceptions
            raise TokenizerReadError(
                f"encoding {text!r} with the tokenizer {self.name} raised "
                f"{type(exc).__name__}: {exc}") from None

    def structural(self) -> dict[int, str]:
        """id -> token of the tokens the base vocabulary holds from the start: its unknown
        token, :data:`STRUCTURAL_TOKENS` it has, a SentencePiece model's control pieces."""
        found = {i: t for t in STRUCTURAL_TOKENS if (i := self.id_of(t)) is not None}
        if self.unk >= 0:
            found[self.unk] = self.token(self.unk) or "<unknown>"
        if self.kind == "sentencepiece":
            found.update({i: self._tok.id_to_piece(i) for i in range(self.size or 0)
                          if self._tok.is_control(i) or self._tok.is_unknown(i)})
        return found

    def mismatch(self, tokens: int, trained: int, new_ids: Sequence[int],
                 last_kept: bool) -> str | None:
        """Why this tokenizer is not that of a model whose text rows hold ``tokens`` tokens,
        ``trained`` of them the checkpoint's and ``new_ids`` new (``last_kept``: the layout
        keeps its last row last); None when it fits: its size the model's (below it only where
        nothing is kept last), above ``trained``, no :meth:`structural` token at a new id."""
        size = self.size
        if size is not None and (size > tokens or size <= trained or
                                 (last_kept and size != tokens)):
            why = ("no token beyond the checkpoint's (the tokenizer before its extension?)"
                   if size <= trained else "more ids than the model has rows for"
                   if size > tokens else "the layout keeps its last row last, so the sizes "
                                         "must be equal")
            return (f"it has {size} ids and the model's text rows hold {tokens} tokens "
                    f"({trained} trained in the checkpoint, {tokens - trained} new): {why}")
        new = set(new_ids)
        misplaced = sorted((i, t) for i, t in self.structural().items() if i in new)
        if misplaced:
            said = ", ".join(f"{t!r} (id {i})" for i, t in misplaced[:5])
            return (f"its own {said} would be new token(s) of the model (new ids "
                    f"{min(new)}..{max(new)}), but a tokenizer's structural tokens belong to "
                    f"the base vocabulary, so its ids are not the model's (the tokenizer before "
                    f"its extension, or another model's?)")
        return None


def read_tokenizer(tokenizer: Any) -> Tokens:
    """``tokenizer`` (a path or an object, see :class:`Tokens`) read for the spelled rules;
    one :class:`TokenizerReadError` for whatever cannot be read."""
    return tokenizer if isinstance(tokenizer, Tokens) else Tokens(tokenizer)


def _kind(tokenizer: Any) -> str | None:
    if not hasattr(tokenizer, "encode"):
        return None
    if hasattr(tokenizer, "id_to_piece"):
        return "sentencepiece"
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return "transformers"
    return "tokenizers" if hasattr(tokenizer, "id_to_token") else None


def _open(path: str) -> Any:
    expected = ("expected the grown tokenizer the model was built with: a Hugging Face "
                "tokenizers file (XTTS's vocab.json) or a SentencePiece model")
    if not os.path.isfile(path):
        raise TokenizerReadError(f"{path}, which is not a file; {expected}")
    kind = ""
    try:
        kind = tokenizer_format(path)
        if kind == "json":
            from tokenizers import Tokenizer  # lazy: tokenizers is optional

            return Tokenizer.from_file(path)
        import sentencepiece  # lazy: only a SentencePiece tokenizer needs it

        return sentencepiece.SentencePieceProcessor(model_file=path)
    except OSError as exc:
        raise TokenizerReadError(f"{path} could not be read ({exc.strerror or exc}); "
                                 f"{expected}") from None
    except ImportError as exc:
        raise TokenizerReadError(
            f"{path} needs the {exc.name or 'tokenizer'} package, which is not installed "
            f"(pip install {exc.name or 'tokenizers sentencepiece'})") from None
    except Exception as exc:  # the libraries raise plain Exceptions for a file they cannot read
        found = ("JSON that the tokenizers library cannot read as a tokenizer"
                 if kind == "json" else "no JSON, and sentencepiece cannot read it as a model")
        raise TokenizerReadError(f"{path} holds {found} ({type(exc).__name__}: "
                                 f"{str(exc).strip()[:200]}); {expected}") from None


# -- spellings -> trained rows ---------------------------------------------------------------


def _is_special(token: str) -> bool:
    return len(token) > 2 and ((token[0] == "[" and token[-1] == "]") or
                               (token[0] == "<" and token[-1] == ">"))


def romanized_sources(tokenizer: Any, rows: Iterable[int],
                      trained: Callable[[int], bool],
                      romanize: Callable[[str], tuple[str, str] | None] | None = None,
                      ) -> RowSources:
    """For each new row in ``rows``: its token spelled by the registered romanisers (or
    ``romanize``, text -> (spelling, code) or None), encoded with ``tokenizer``, and the
    pieces kept whose rows ``trained(id)`` says are trained (never the unknown token). A row
    with no trained piece is ``unspelled`` (and in ``tags`` when it is a language tag)."""
    tokens = read_tokenizer(tokenizer)
    speller = languages.Speller() if romanize is None else None
    sources: dict[int, tuple[int, ...]] = {}
    spelled: dict[int, tuple[str, str]] = {}
    unspelled: dict[int, str] = {}
    tags: dict[int, str] = {}
    spelled_by: dict[str, int] = {}
    for row in rows:
        token = tokens.token(row)
        text = (token or "").replace("\u2581", " ").strip()
        found, who = None, ""
        if text and not _is_special(text):
            hit = speller(text) if speller is not None else romanize(text)
            if hit:
                found, who = hit[0], hit[1].label if speller is not None else repr(hit[1])
        pieces: tuple[int, ...] = ()
        if found is not None:
            pieces = tuple(i for i in tokens.encode(found) if i != tokens.unk and trained(i))
        if pieces:
            sources[row] = pieces
            spelled[row] = (token or "", found or "")
            spelled_by[who] = spelled_by.get(who, 0) + 1
        else:
            unspelled[row] = token if token is not None else f"<row {row}>"
            if LANGUAGE_TAG.fullmatch(text):
                tags[row] = text
    failures = ({} if speller is None else
                {r.label: (n, speller.asked[r], speller.first_error[r])
                 for r, n in speller.failed.items()})
    return RowSources(sources, spelled, unspelled, tags, spelled_by, failures)


__all__ = ["AUTO", "AUTO_RULES", "COVARIANCE_SCALE", "DEFAULT_HEAD_ROW_INIT", "DEFAULT_ROW_INIT",
           "DEPRECATED_RULES", "FALLBACK", "OFFSET_LENGTH", "ROMANIZED_NOISE", "ROW_INITS",
           "RowSources", "SPELLED_RULES", "SPELLING_NOISE_SEED", "SPELLING_SHARE",
           "STRUCTURAL_TOKENS", "TAGS_FROM_START", "TokenizerReadError", "Tokens", "check_rule",
           "language_offset", "new_bias_values", "new_row_values", "read_tokenizer",
           "romanized_sources", "rules_for", "tokenizer_format"]
