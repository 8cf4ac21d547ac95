"""Is this tokenizer ready to train on? Sizes, ranges, special tokens, coverage, checkpoint.

:func:`verify` returns :class:`Finding` rows (``ok``/``warn``/``FAIL``); the CLI prints
them and exits 1 when any is ``FAIL``. What is checked:

- the vocabulary: size, the base and extended id ranges (from ``base`` or ``base_size``),
  that every base token kept its id, and the special tokens (XTTS: ``[STOP]`` id 0,
  ``[UNK]`` id 1, ``[SPACE]``, ``[START]`` and the ``[lang]`` tokens; SentencePiece: its
  control and unknown pieces);
- on texts (a text file or a coqui manifest), taken as the trainer sees them: the UNK
  rate, the share of tokens from the extended range, the characters not covered, lines
  that do not survive encode + decode, and tokens per character;
- against a checkpoint: whether its ``text_embedding``/``text_head`` rows fit the
  vocabulary, and what the vocabulary-aware loader would do (load as is, grow with the
  base rows kept, or refuse a shrink) and which rows it would freeze.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ... import _options
from ...row_init import AUTO, SPELLED_RULES, tokenizer_format
from ...integrations.xtts_vocab import FAIL, OK, XttsVocab
from ...vocab_rows import frozen_rows, new_rows
from .bpe import START, UNK, load_vocab_json, xtts_text
from .errors import FrontEndError, TokenizerToolError, require_file
from .spm import load_model_proto
from .text import read_lines

WARN = "warn"


@dataclass(frozen=True)
class Finding:
    """One line of the verdict."""

    status: str
    what: str
    detail: str


def _span(ids: range) -> str:
    return f"{ids.start}..{ids.stop - 1}" if len(ids) else "none"


# -- the two kinds of tokenizer -----------------------------------------------------------


class _Xtts:
    """An XTTS vocab.json, encoded as ``VoiceBpeTokenizer.encode`` does after cleaning."""

    kind = "XTTS vocab.json (BPE)"
    extra_rows = 0  # XTTS's text embedding has one row per id (max id + 1)

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer  # lazy: optional dependency tokenizers

        self.data = load_vocab_json(path)
        self.tok = Tokenizer.from_file(str(path))
        self.vocab = self.tok.get_vocab()
        self.size = max(self.vocab.values()) + 1
        self.unk = self.vocab[UNK]
        self.specials = {t["content"]: t["id"] for t in self.data["added_tokens"]
                         if t.get("special")}

    @property
    def start_last(self) -> bool:
        return self.vocab.get(START) == self.size - 1

    def encode(self, text: str, language: str | None) -> list[int]:
        ids = self.tok.encode(xtts_text(text, language)).ids
        lang_id = self.vocab.get(f"[{language}]") if language else None
        return ids[1:] if ids and lang_id is not None and ids[0] == lang_id else ids

    def decode(self, ids: list[int]) -> str:
        # VoiceBpeTokenizer.decode
        text = self.tok.decode(ids, skip_special_tokens=False).replace(" ", "")
        return text.replace("[SPACE]", " ").replace("[STOP]", "").replace(UNK, "")

    def reference(self, text: str) -> str:
        return text

    def covers(self, char: str) -> bool:
        ids = self.tok.encode(char).ids
        return bool(ids) and self.unk not in ids

    def new_ids(self, base_size: int) -> range:
        return new_rows(self.size, base_size, start_row_last=self.start_last)

    def base_ids_kept(self, base_path: Path) -> tuple[int, list[str]]:
        base = _Xtts(base_path)
        moved = [f"{t} {i}->{self.vocab.get(t)}" for t, i in base.vocab.items()
                 if self.vocab.get(t) != i and not (t == START and self.start_last)]
        return base.size, moved

    def special_findings(self, language: str | None) -> list[Finding]:
        """The runtime's rules (:class:`patches.integrations.xtts_vocab.XttsVocab`)."""
        return [Finding(*row) for row in XttsVocab(self.vocab, self.specials)
                .special_findings(language)]


class _Spm:
    """A SentencePiece model (IndexTTS: the text embedding has one extra slot row)."""

    kind = "SentencePiece model"
    extra_rows = 1

    def __init__(self, path: Path) -> None:
        import sentencepiece as spm  # lazy: optional dependency sentencepiece

        self.proto = load_model_proto(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.size = self.sp.get_piece_size()
        self.unk = self.sp.unk_id()
        self.start_last = False

    def encode(self, text: str, language: str | None) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def reference(self, text: str) -> str:
        # the text after the model's own normalization, spaces as spaces
        return " ".join(self.sp.normalize(text).replace("\u2581", " ").split())

    def covers(self, char: str) -> bool:
        return self.sp.piece_to_id(char) != self.unk

    def new_ids(self, base_size: int) -> range:
        return range(base_size, self.size)

    def base_ids_kept(self, base_path: Path) -> tuple[int, list[str]]:
        base = _Spm(base_path)
        moved = [f"{p.piece} {i}->{self.sp.piece_to_id(p.piece)}"
                 for i, p in enumerate(base.proto.pieces)
                 if i >= self.size or self.proto.pieces[i].piece != p.piece]
        return base.size, moved

    def special_findings(self, language: str | None) -> list[Finding]:
        from sentencepiece import (  # lazy: optional dependency sentencepiece
            sentencepiece_model_pb2 as pb)

        kinds = pb.ModelProto.SentencePiece
        special = [(i, p.piece) for i, p in enumerate(self.proto.pieces)
                   if p.type in (kinds.CONTROL, kinds.UNKNOWN, kinds.USER_DEFINED)]
        found = [Finding(OK, "special pieces", ", ".join(f"{p} {i}" for i, p in special[:12])
                         or "none")]
        if not any(p.type == kinds.UNKNOWN for p in self.proto.pieces):
            found.append(Finding(FAIL, "<unk>", "the model has no unknown piece"))
        return found


def open_tokenizer(path: str | os.PathLike[str]) -> Any:
    """An XTTS vocab.json or a SentencePiece model, told apart by content."""
    path = Path(path)
    require_file(path, "tokenizer", "an XTTS vocab.json or a SentencePiece .model")
    if is_json_tokenizer(path):
        return _Xtts(path)
    return _Spm(path)


def is_json_tokenizer(path: Path) -> bool:
    """A Hugging Face tokenizers file, else SentencePiece: told by the content
    (:func:`patches.row_init.tokenizer_format`, the loader's own test), whatever the name; a
    file that is neither is read as its name says (``.json``: its error says it is not JSON)."""
    if tokenizer_format(path) == "json":
        return True
    if path.suffix.lower() != ".json":
        return False
    try:
        load_model_proto(path)
    except TokenizerToolError:
        return True
    return False  # a SentencePiece model, whatever its name


# -- the checks ------------------------------------------------------------------------------


def _text_findings(tok: Any, lines: Sequence[str], source: str, language: str | None,
                   preprocess: Callable[[str], str], new_ids: range | None,
                   max_unk_rate: float) -> list[Finding]:
    tokens = unknown = extended = chars = bad_lines = 0
    char_counts: collections.Counter[str] = collections.Counter()
    example = ""
    for number, line in enumerate(lines, start=1):
        try:
            text = preprocess(line)
        except FrontEndError as exc:
            raise TokenizerToolError(exc.at(f"--text {source}, text line {number} "
                                            f"({line[:60]!r})")) from None
        ids = tok.encode(text, language)
        tokens += len(ids)
        unknown += sum(1 for i in ids if i == tok.unk)
        if new_ids is not None:
            extended += sum(1 for i in ids if i in new_ids)
        chars += len(text)
        char_counts.update(c for c in text if not c.isspace())
        if tok.decode(ids) != tok.reference(text):
            bad_lines += 1
            example = example or f"{text!r} -> {tok.decode(ids)!r}"
    found = []
    rate = unknown / tokens if tokens else 0.0
    found.append(Finding(FAIL if rate > max_unk_rate else OK, "UNK rate",
                         f"{rate:.2%} ({unknown} of {tokens} tokens in {len(lines)} lines of "
                         f"{source})" + (f"; at most {max_unk_rate:.2%} allowed"
                                         if rate > max_unk_rate else "")))
    missing = {c: n for c, n in char_counts.items() if not tok.covers(c)}
    if missing:
        shown = ", ".join(f"{c!r} ({n})" for c, n in sorted(missing.items(),
                                                            key=lambda kv: -kv[1])[:20])
        found.append(Finding(FAIL, "characters not covered",
                             f"{len(missing)}: {shown}. Extend the tokenizer with this text "
                             f"(training-patches extend-tokenizer) or fix the transcripts"))
    else:
        found.append(Finding(OK, "characters covered", f"all {len(char_counts)} distinct"))
    if new_ids is not None:
        share = extended / tokens if tokens else 0.0
        found.append(Finding(OK, "extended-range share",
                             f"{share:.1%} of tokens have ids {_span(new_ids)}"))
    found.append(Finding(FAIL if bad_lines else OK, "round trip",
                         f"{len(lines) - bad_lines} of {len(lines)} lines decode to the text "
                         f"encoded" + (f"; e.g. {example}" if example else "")))
    found.append(Finding(OK, "tokens per character",
                         f"{tokens / chars:.2f}" if chars else "no text"))
    return found


def _checkpoint_findings(tok: Any, path: Path, base_size: int | None) -> list[Finding]:
    from ...checkpoint import read_checkpoint  # lazy: heavy (torch), only for --checkpoint

    ckpt = read_checkpoint(path)
    state = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else {}
    if not isinstance(state, dict):
        state = {}
    rows = {key: int(value.shape[0]) for key, value in state.items()
            if hasattr(value, "shape") and value.dim() >= 1 and
            key.endswith(("text_embedding.weight", "text_head.weight", "text_head.bias"))}
    if not rows:
        return [Finding(FAIL, "checkpoint", f"{path} has no text_embedding/text_head tensor "
                        f"(keys such as gpt.text_embedding.weight); expected an XTTS model.pth "
                        f"or an IndexTTS gpt checkpoint")]
    counts = set(rows.values())
    if len(counts) != 1:
        return [Finding(FAIL, "checkpoint rows", f"the vocabulary tensors of {path} disagree: "
                        + ", ".join(f"{k} {n}" for k, n in rows.items())
                        + "; the loader refuses it")]
    have = counts.pop()
    want = tok.size + tok.extra_rows
    layout = "one row per id" if not tok.extra_rows else "ids + 1 slot row (IndexTTS)"
    found = [Finding(OK, "checkpoint rows", f"{have} in {path.name} "
                     f"({', '.join(sorted(rows))}); the vocabulary needs {want} ({layout})")]
    start_last = tok.start_last or bool(tok.extra_rows)
    if have > want:
        found.append(Finding(FAIL, "loader", f"the checkpoint has {have - want} row(s) more than "
                             f"the vocabulary: the loader refuses a shrink (it would throw "
                             f"trained rows away). Use the tokenizer it was trained with"))
        return found
    if base_size is not None and have not in (want, base_size + tok.extra_rows):
        found.append(Finding(FAIL, "loader", f"{have} rows match neither the base vocabulary "
                             f"({base_size + tok.extra_rows} rows) nor this one ({want}): the "
                             f"checkpoint was trained with another tokenizer"))
        return found
    if have == want:
        detail = "loads the rows as they are (no resize)"
        base_rows = base_size + tok.extra_rows if base_size is not None else None
    else:
        moved = " and moves the last row (the start token) to the new end" if start_last else ""
        detail = (f"grows {have} -> {want} rows: keeps the {have} trained rows{moved}; "
                  f"{_new_rows_start()}")
        base_rows = have
    found.append(Finding(OK, "loader", detail))
    if base_rows is not None and base_rows < want:
        frozen = frozen_rows(want, base_rows, start_row_last=start_last)
        found.append(Finding(OK, "freeze", "rows " + " and ".join(_span(r) for r in frozen)
                             + f" stay frozen (base); rows "
                             f"{_span(_trainable(want, frozen))} train: set "
                             f"TRAINING_PATCHES_BASE_VOCAB={base_rows - tok.extra_rows} (the "
                             f"{base_rows - tok.extra_rows} tokens the base model was trained "
                             f"with; the entries of a tokenizer file can count otherwise)"))
    return found


def _new_rows_start() -> str:
    """How the loader starts the new rows, from the settings it reads (TRAINING_PATCHES_ROW_INIT,
    TRAINING_PATCHES_HEAD_ROW_INIT): ``the new rows start by row_init spelling ...``."""
    opts = _options.current()
    spelled = (" (from each token's spelling when the loader is given this tokenizer, else "
               "spread)" if opts.row_init in SPELLED_RULES else
               " (spelling where the base model reads its text, std0.02 where it does not: the "
               "loader asks it)" if opts.row_init == AUTO else "")
    return (f"the new rows start by row_init {opts.row_init}{spelled}, the head's by "
            f"{opts.head_row_init}")


def _trainable(rows: int, frozen: Sequence[range]) -> range:
    taken = {i for r in frozen for i in r}
    free = [i for i in range(rows) if i not in taken]
    return range(free[0], free[-1] + 1) if free else range(0, 0)


def verify(tokenizer: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None,
           base_size: int | None = None, language: str | None = None,
           texts: Sequence[str | os.PathLike[str]] = (),
           preprocess: Callable[[str], str] = lambda text: text,
           checkpoint: str | os.PathLike[str] | None = None,
           max_unk_rate: float = 0.0) -> list[Finding]:
    """Every finding about ``tokenizer`` (see the module docstring)."""
    path = Path(tokenizer)
    tok = open_tokenizer(path)
    found = [Finding(OK, "tokenizer", f"{tok.kind}, {tok.size} tokens ({path})")]
    if base is not None:
        base_size, moved = tok.base_ids_kept(Path(base))
        found.append(Finding(FAIL if moved else OK, "base ids kept",
                             f"{len(moved)} base token(s) changed id: {', '.join(moved[:5])}"
                             if moved else f"every token of {base} has its id"))
    new_ids = None
    if base_size is not None:
        if not 0 < base_size <= tok.size:
            raise TokenizerToolError(
                f"--base-size {base_size}: the tokenizer {path} has {tok.size} tokens; expected "
                f"a base size from 1 to {tok.size} (the size of the tokenizer it extends).")
        new_ids = tok.new_ids(base_size)
        base_ids = [r for r in ((range(0, base_size - 1), range(tok.size - 1, tok.size))
                                if tok.start_last and base_size < tok.size
                                else (range(0, base_size),)) if len(r)]
        found.append(Finding(OK, "id ranges", "base " + " and ".join(_span(r) for r in base_ids)
                             + f", extended {_span(new_ids)} ({len(new_ids)} tokens)"))
    else:
        found.append(Finding(WARN, "id ranges", "unknown: pass --base (the tokenizer this "
                                                "extends) or --base-size"))
    found.extend(tok.special_findings(language))
    for source in texts:
        lines = read_lines(source, what="text")
        found.extend(_text_findings(tok, lines, str(source), language, preprocess, new_ids,
                                    max_unk_rate))
    if checkpoint is not None:
        found.extend(_checkpoint_findings(tok, Path(checkpoint), base_size))
    return found


__all__ = ["Finding", "verify", "open_tokenizer", "is_json_tokenizer", "OK", "WARN", "FAIL"]
