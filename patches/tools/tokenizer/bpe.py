"""Extending an XTTS ``vocab.json`` (a Hugging Face ``tokenizers`` BPE) for a new language.

What the extension keeps and adds:

- every base token keeps its id and every base merge keeps its rank (new merges come
  after all base merges);
- ``[START]``: when it is the base vocabulary's LAST id, it moves to the new last id and
  the new tokens take ``base-1 .. new-2``. That is the layout XTTS's ``GPTTrainer`` and
  the vocabulary-aware loader (:mod:`patches.checkpoint`) assume: they carry the base
  model's last text-embedding row (the start-text token) to the new last row. When
  ``[START]`` is elsewhere, nothing moves and the new tokens take ``base .. new-1``;
- ``[lang]`` as a special (added) token, the first new id;
- every character of the corpus (a token each), then up to ``new_pieces`` BPE pieces
  learned from the corpus with the ``tokenizers`` library, under the base's own
  normalizer and pre-tokenizer, on the corpus exactly as the trainer will see it
  (cleaned, split at spaces: XTTS turns each space into ``[SPACE]``).

A learned merge of two BASE tokens is left out: it could change how base-language text
is split. Every kept merge has a new token on one side, and base-language text never
contains one, so it encodes exactly as before (and :func:`base_text_check` shows it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..._log import logger
from ...integrations.xtts_vocab import SPACE, START, STOP, UNK, parse_vocab_json
from ...integrations.xtts_vocab import all_ids as _all_ids
from ...languages import base_code
from .errors import TokenizerToolError, require_file
from .text import ENGLISH_SAMPLE, make_preprocess, read_lines, words_of, write_bytes_atomic

# About 2,000 new BPE pieces per language worked best in community XTTS experiments
# (3,000 similar, 5,000 worse); every character of the corpus comes on top.
DEFAULT_NEW_PIECES = 2000


@dataclass
class Extension:
    """What an extension did: sizes, id ranges, and the base-language check."""

    kind: str
    base_file: str
    out_file: str
    old_size: int
    new_size: int
    base_ids: range
    new_ids: range
    language_token: str | None = None
    language_token_id: int | None = None
    start_move: tuple[int, int] | None = None
    characters_added: list[str] = field(default_factory=list)
    pieces_added: int = 0
    merges_added: int = 0
    merges_left_out: int = 0
    uncovered: list[str] = field(default_factory=list)
    base_check: "BaseCheck | None" = None

    def lines(self) -> list[str]:
        """What the CLI prints."""
        out = [f"{self.kind}: {self.base_file} -> {self.out_file}",
               f"size: {self.old_size} -> {self.new_size} tokens (+{self.new_size - self.old_size})",
               f"base ids: {_span(self.base_ids)}   new ids: {_span(self.new_ids)}"]
        if self.start_move is not None:
            out.append(f"[START]: id {self.start_move[0]} -> {self.start_move[1]} (kept last, "
                       f"as XTTS's GPTTrainer and the loader move its row)")
        if self.language_token:
            out.append(f"language token: {self.language_token} = id {self.language_token_id} "
                       f"(special)")
        out.append(f"added: {len(self.characters_added)} characters, {self.pieces_added} "
                   f"learned pieces" + (f", {self.merges_added} merges" if self.merges_added
                                        else ""))
        if self.merges_left_out:
            out.append(f"left out: {self.merges_left_out} learned piece(s) made only of base tokens "
                       f"(they could change how base text is split)")
        out.append("corpus characters covered: " + (
            "all" if not self.uncovered else f"NOT {''.join(self.uncovered)}"))
        if self.base_check is not None:
            out.extend(self.base_check.lines())
        return out

    @property
    def ok(self) -> bool:
        return not self.uncovered and (self.base_check is None or self.base_check.ok)


@dataclass
class BaseCheck:
    """Base-language text encoded with the base and the extended tokenizer, compared piece
    by piece (a piece: what lies between spaces, split by the pre-tokenizer, e.g. "dog"
    and "." of "dog.")."""

    source: str
    lines_checked: int
    pieces_checked: int
    identical: int
    were_unknown: int
    changed: list[tuple[str, list[str], list[str]]]

    @property
    def ok(self) -> bool:
        return not self.changed

    def lines(self) -> list[str]:
        head = (f"base text ({self.source}): {self.identical} of {self.pieces_checked} pieces "
                f"encode exactly as before")
        if self.were_unknown:
            head += (f"; {self.were_unknown} were [UNK] in the base tokenizer (not compared)")
        out = [head + (" - OK" if self.ok else f" - {len(self.changed)} CHANGED")]
        for text, old, new in self.changed[:3]:
            out.append(f"  CHANGED: {text!r}: {' '.join(old)} -> {' '.join(new)}")
        return out


def _span(ids: range) -> str:
    return f"{ids.start}..{ids.stop - 1}" if len(ids) else "none"


# -- reading -------------------------------------------------------------------------------


def load_vocab_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``vocab.json``, checked to be a BPE tokenizer in XTTS's shape (the runtime's
    own reading: :func:`patches.integrations.xtts_vocab.parse_vocab_json`)."""
    path = Path(path)
    require_file(path, "tokenizer", "the XTTS vocab.json (a Hugging Face tokenizers BPE file) "
                                    "or a SentencePiece .model")
    try:
        return parse_vocab_json(path)
    except ValueError as exc:
        raise TokenizerToolError(str(exc)) from None


def _size(data: dict[str, Any]) -> int:
    """Rows of the text embedding XTTS builds: max id + 1."""
    return max(_all_ids(data).values()) + 1


def _tokenizer(data: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer  # lazy: tokenizers is optional (the tools/xtts extra)

    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def _merge_pair(merge: Any) -> tuple[str, str]:
    if isinstance(merge, str):
        left, right = merge.split(" ", 1)
        return left, right
    return merge[0], merge[1]


def xtts_text(text: str, language: str | None) -> str:
    """What ``VoiceBpeTokenizer.encode`` gives its BPE for already-cleaned ``text``."""
    prefix = f"[{language}]" if language else ""
    return f"{prefix}{text}".replace(" ", SPACE)


# -- extending -----------------------------------------------------------------------------


def _learn(base: Any, words: Sequence[str], new_pieces: int, min_frequency: int,
           model: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a BPE on ``words`` with the base's normalizer and pre-tokenizer; return its
    alphabet and its merges in rank order."""
    from tokenizers import Tokenizer, models, trainers  # lazy: tokenizers is optional

    kwargs: dict[str, Any] = {key: model[key] for key in ("continuing_subword_prefix",
                                                          "end_of_word_suffix") if model.get(key)}
    learner = Tokenizer(models.BPE(unk_token=UNK, **kwargs))
    if base.normalizer is not None:
        learner.normalizer = base.normalizer
    if base.pre_tokenizer is not None:
        learner.pre_tokenizer = base.pre_tokenizer
    chars = sorted({char for word in words for char in word})
    # Twice the pieces asked for: some learned merges join two base tokens and are left out.
    trainer = trainers.BpeTrainer(vocab_size=len(chars) + 2 * new_pieces,
                                  min_frequency=min_frequency, initial_alphabet=chars,
                                  show_progress=False, special_tokens=[], **kwargs)
    learner.train_from_iterator(words, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    merges = [_merge_pair(m) for m in learned["merges"]]
    products = {left + right for left, right in merges}
    order = sorted(learned["vocab"].items(), key=lambda item: item[1])
    alphabet = [tok for tok, _ in order if tok not in products]
    return alphabet, merges


def extend_bpe(data: dict[str, Any], texts: Sequence[str], *, language: str | None,
               new_pieces: int = DEFAULT_NEW_PIECES, min_frequency: int = 2
               ) -> tuple[dict[str, Any], Extension]:
    """``data`` (a parsed XTTS vocab.json) extended with ``texts`` (already as the trainer
    sees them: cleaned). Returns the new JSON data and what was done (files not named)."""
    if new_pieces < 0:
        raise TokenizerToolError(f"--new-pieces is {new_pieces}; expected 0 or more.")
    data = json.loads(json.dumps(data))  # never change the caller's copy
    base = _tokenizer(data)
    model = data["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list[Any] = model["merges"]
    strings = bool(merges) and isinstance(merges[0], str)
    added = data["added_tokens"]
    old_ids = _all_ids(data)
    old_size = _size(data)
    base_tokens = set(vocab)
    start = next((tok for tok in added if tok["content"] == START), None)
    start_last = start is not None and start["id"] == old_size - 1
    next_id = old_size - 1 if start_last else old_size
    first_new = next_id

    def take(token: str) -> int:
        nonlocal next_id
        vocab[token] = next_id
        next_id += 1
        return vocab[token]

    ext = Extension(kind="XTTS vocab.json (BPE)", base_file="", out_file="", old_size=old_size,
                    new_size=old_size, base_ids=range(0, old_size), new_ids=range(0, 0))
    if language:
        token = f"[{language}]"
        entry = next((tok for tok in added if tok["content"] == token), None)
        if entry is None:
            token_id = vocab[token] if token in vocab else take(token)
            added.append({"id": token_id, "content": token, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True})
        else:
            entry["special"] = True
            token_id = entry["id"]
        ext.language_token, ext.language_token_id = token, token_id

    words = words_of(texts)
    if words:
        alphabet, learned = _learn(base, words, new_pieces, min_frequency, model)
    else:
        alphabet, learned = [], []
    for token in alphabet:
        if token not in vocab and token not in old_ids:
            take(token)
            ext.characters_added.append(token)
    reachable = set(vocab)
    pieces = 0
    for left, right in learned:
        if pieces >= new_pieces:
            break
        if left not in reachable or right not in reachable:
            continue  # built on a left-out merge
        if left in base_tokens and right in base_tokens:
            ext.merges_left_out += 1
            continue
        product = left + right
        if product not in vocab:
            take(product)
            pieces += 1
        reachable.add(product)
        merges.append(f"{left} {right}" if strings else [left, right])
        ext.merges_added += 1
    ext.pieces_added = pieces
    if start_last:
        ext.start_move = (start["id"], next_id)
        start["id"] = next_id
        if START in vocab:
            vocab[START] = next_id
        next_id += 1
    added.sort(key=lambda tok: tok["id"])
    ext.new_size = _size(data)
    ext.base_ids = range(0, old_size - 1 if start_last else old_size)
    ext.new_ids = range(first_new, first_new + (ext.new_size - old_size))
    _check_ids(data, old_ids, ext)
    extended = _tokenizer(data)
    ext.uncovered = uncovered_characters(extended, {char for word in words for char in word})
    return data, ext


def uncovered_characters(tokenizer: Any, chars: Any) -> list[str]:
    """The characters that encode to ``[UNK]`` on their own (or to nothing)."""
    unk = tokenizer.token_to_id(UNK)
    missing = []
    for char in sorted(chars):
        ids = tokenizer.encode(char).ids
        if not ids or unk in ids:
            missing.append(char)
    return missing


def _check_ids(data: dict[str, Any], old_ids: dict[str, int], ext: Extension) -> None:
    """Every base token keeps its id (``[START]`` aside when it moved); fail loudly if the
    tokenizers library numbered anything otherwise."""
    now = _tokenizer(data).get_vocab()
    moved = {tok: (old, now.get(tok)) for tok, old in old_ids.items()
             if now.get(tok) != old and not (tok == START and ext.start_move)}
    if moved:
        sample = ", ".join(f"{t} {o}->{n}" for t, (o, n) in list(moved.items())[:5])
        raise TokenizerToolError(
            f"extending the vocabulary would renumber {len(moved)} base token(s) ({sample}); "
            f"nothing was written. This vocab.json has a layout the extension does not handle "
            f"(ids with gaps or duplicates?); please report it with the file.")


def base_text_check(base: dict[str, Any], extended: dict[str, Any], lines: Sequence[str],
                    source: str) -> BaseCheck:
    """Encode the base-language ``lines`` (lowercased, as XTTS's cleaners do) with both
    tokenizers, piece by piece; a piece the base maps to ``[UNK]`` is counted, not compared."""
    old_tok, new_tok = _tokenizer(base), _tokenizer(extended)
    unk = old_tok.token_to_id(UNK)
    pieces = identical = were_unknown = 0
    changed = []
    for line in lines:
        for word in words_of([line.lower()]):
            parts = ([p for p, _ in old_tok.pre_tokenizer.pre_tokenize_str(word)]
                     if old_tok.pre_tokenizer is not None else [word])
            for part in parts:
                old, new = old_tok.encode(part), new_tok.encode(part)
                pieces += 1
                if unk in old.ids:
                    were_unknown += 1
                elif old.ids == new.ids:
                    identical += 1
                else:
                    changed.append((part, old.tokens, new.tokens))
    return BaseCheck(source, len(lines), pieces, identical, were_unknown, changed)


def extend_vocab_file(base: str | os.PathLike[str], texts: Sequence[str],
                      out: str | os.PathLike[str], *, language: str | None,
                      new_pieces: int = DEFAULT_NEW_PIECES, min_frequency: int = 2,
                      base_text: Sequence[str] | None = None, base_text_source: str = "",
                      write: Callable[[Path, bytes], Any] | None = None) -> Extension:
    """Extend the XTTS vocab.json ``base`` with cleaned ``texts`` and write ``out``
    atomically (through ``write(path, bytes)`` when given). Raises
    :class:`TokenizerToolError` (nothing written) when base text would encode otherwise
    or a corpus character stays uncovered."""
    data = load_vocab_json(base)
    extended, ext = extend_bpe(data, texts, language=language, new_pieces=new_pieces,
                               min_frequency=min_frequency)
    check_before_writing(ext, base, out, lambda lines, source: base_text_check(
        data, extended, lines, source), base_text, base_text_source)
    payload = encode_json(extended)
    (write or write_bytes_atomic)(Path(out), payload)
    return ext


def check_before_writing(ext: Extension, base: str | os.PathLike[str],
                         out: str | os.PathLike[str],
                         check: Callable[[list[str], str], BaseCheck],
                         base_text: Sequence[str] | None, base_text_source: str) -> None:
    """Record the files and the base-text check (``check(lines, source)``) in ``ext``;
    raise :class:`TokenizerToolError` (so nothing is written) when any check failed.
    Shared by the vocab.json and the SentencePiece extension."""
    ext.base_file, ext.out_file = str(base), str(out)
    ext.base_check = check(
        list(base_text or ENGLISH_SAMPLE),
        base_text_source or f"the built-in English sample ({len(ENGLISH_SAMPLE)} lines)")
    if not ext.ok:
        raise TokenizerToolError(
            f"extending {base} failed its own checks, so {out} was not written: "
            + "; ".join(ext.lines()[-3:]) + ". Report this with the files if it persists.")


def encode_json(data: dict[str, Any]) -> bytes:
    """The bytes of a vocab.json as written (UTF-8, readable, like the XTTS release)."""
    return (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


__all__ = ["Extension", "BaseCheck", "load_vocab_json", "extend_bpe", "extend_vocab_file",
           "base_text_check", "uncovered_characters", "extend_for_run", "xtts_text", "encode_json", "DEFAULT_NEW_PIECES", "START", "UNK"]


def extend_for_run(base: str | os.PathLike[str], corpus: str | os.PathLike[str],
                   output_dir: str | os.PathLike[str], language: str, *,
                   new_pieces: int = DEFAULT_NEW_PIECES) -> tuple[Path, Extension, bool]:
    """The extended vocab.json a training run uses: ``output_dir/vocab_<language>.json``,
    made from ``base`` and ``corpus`` (cleaned as ``language``; the base file is never
    touched). A run that resumes finds it there: it is reused when extending again gives
    the same bytes, and refused (nothing changed) when it differs, because the checkpoint
    was trained with the one on disk. Returns (path, what was done, reused)."""
    code = base_code(language)
    out = Path(output_dir) / f"vocab_{code}.json"
    if out.resolve() == Path(base).resolve():
        raise TokenizerToolError(
            f"the base vocabulary {base} is the file the extension would write ({out}). Name "
            f"the base model's own vocab.json as the base, or another output folder.")
    load_vocab_json(base)  # a bad base file is named before the corpus is read
    preprocess = make_preprocess(code)
    texts = [preprocess(line) for line in read_lines(corpus)]
    made: list[bytes] = []
    ext = extend_vocab_file(base, texts, out, language=code, new_pieces=new_pieces,
                            write=lambda _path, data: made.append(data))
    if out.exists():
        if out.read_bytes() != made[0]:
            raise TokenizerToolError(
                f"{out} exists and is not what extending {base} with {corpus} gives now (the "
                f"base vocabulary, the corpus or the cleaner changed). A run must keep the "
                f"vocabulary its checkpoints were trained with, so nothing was changed. To "
                f"continue that run, pass --vocab {out} instead of --extend-vocab; to start "
                f"over, use a new --output-dir.")
        logger.info("training-patches: reusing the extended vocabulary %s (%d tokens)", out,
                    ext.new_size)
        return out, ext, True
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, made[0])
    for line in ext.lines():
        logger.info("training-patches: extend-vocab: %s", line)
    return out, ext, False
