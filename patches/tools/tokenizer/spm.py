"""Extending a SentencePiece ``.model`` (IndexTTS's ``bpe.model``) for a new language.

New pieces are APPENDED to the model protobuf that ``sentencepiece`` ships
(``sentencepiece_model_pb2``): every base piece keeps its id, its score and its type.
The pieces are learned by ``sentencepiece`` itself on the corpus (same model type and
normalization as the base), and only those holding at least one character the base
lacks are kept, plus every such character on its own: base-language text, made of base
characters only, can match none of them and encodes exactly as before.

Scores: a BPE model merges by score, so appended pieces score below every base piece
(in their learned order); a unigram model's scores are log-probabilities, so appended
pieces keep the scores they were learned with.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import sentencepiece as spm
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2 as pb

from .bpe import DEFAULT_NEW_PIECES, BaseCheck, Extension, check_before_writing
from .errors import TokenizerToolError, require_file
from .text import words_of, write_bytes_atomic


def load_model_proto(path: str | os.PathLike[str]) -> Any:
    """The parsed ``ModelProto`` of ``path``, checked to load in ``sentencepiece``."""
    path = Path(path)
    require_file(path, "tokenizer", "a SentencePiece .model file (the IndexTTS bpe.model) or an "
                                    "XTTS vocab.json")
    raw = path.read_bytes()
    proto = pb.ModelProto()
    try:
        proto.ParseFromString(raw)
        if not len(proto.pieces):
            raise DecodeError("no pieces")
        spm.SentencePieceProcessor(model_proto=raw)
    except (DecodeError, RuntimeError, OSError) as exc:
        kind = "JSON text" if raw[:1] in (b"{", b"[") else f"{len(raw)} bytes"
        raise TokenizerToolError(
            f"the tokenizer {path} is not a SentencePiece model (it holds {kind} that "
            f"sentencepiece cannot read: {exc}). Expected a .model file written by "
            f"sentencepiece (IndexTTS's bpe.model); an XTTS tokenizer is a vocab.json.") from None
    return proto


def _processor(proto: Any) -> Any:
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _learn(base: Any, texts: Sequence[str], size: int) -> Any:
    """A SentencePiece model learned on ``texts`` with the base's type and normalization."""
    types = {pb.TrainerSpec.BPE: "bpe", pb.TrainerSpec.UNIGRAM: "unigram"}
    model_type = types.get(base.trainer_spec.model_type)
    if model_type is None:
        raise TokenizerToolError(
            f"the base SentencePiece model is of type "
            f"{pb.TrainerSpec.ModelType.Name(base.trainer_spec.model_type)}; only BPE and "
            f"unigram models can be extended with learned pieces.")
    norm = base.normalizer_spec
    rule = norm.name if norm.name in ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf",
                                      "identity") else "identity"
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=out, vocab_size=max(size, 8),
        model_type=model_type, character_coverage=1.0, hard_vocab_limit=False,
        normalization_rule_name=rule, add_dummy_prefix=norm.add_dummy_prefix,
        remove_extra_whitespaces=norm.remove_extra_whitespaces,
        split_digits=base.trainer_spec.split_digits, bos_id=-1, eos_id=-1, unk_id=0,
        minloglevel=2, num_threads=1)
    learned = pb.ModelProto()
    learned.ParseFromString(out.getvalue())
    return learned


def extend_spm(base: Any, texts: Sequence[str], *, new_pieces: int = DEFAULT_NEW_PIECES
               ) -> tuple[Any, Extension]:
    """``base`` (a ``ModelProto``) with pieces learned from ``texts`` appended."""
    if new_pieces < 0:
        raise TokenizerToolError(f"--new-pieces is {new_pieces}; expected 0 or more.")
    proto = pb.ModelProto()
    proto.CopyFrom(base)
    kinds = pb.ModelProto.SentencePiece
    old_size = len(proto.pieces)
    known = {p.piece for p in proto.pieces}
    base_chars = {char for p in proto.pieces if p.type in (kinds.NORMAL, kinds.USER_DEFINED)
                  for char in p.piece}
    corpus_chars = sorted({char for text in texts for char in text if not char.isspace()})
    new_chars = [char for char in corpus_chars if char not in base_chars]
    ext = Extension(kind="SentencePiece model", base_file="", out_file="", old_size=old_size,
                    new_size=old_size, base_ids=range(0, old_size), new_ids=range(0, 0))
    learned = _learn(proto, texts, len(corpus_chars) + new_pieces + 1) if new_chars else None
    bpe = proto.trainer_spec.model_type == pb.TrainerSpec.BPE
    floor = min((p.score for p in proto.pieces if p.type == kinds.NORMAL), default=0.0)
    appended: list[tuple[str, float]] = []
    if learned is not None:
        for piece in learned.pieces:
            if piece.type != kinds.NORMAL or piece.piece in known:
                continue
            if not any(char in new_chars for char in piece.piece):
                ext.merges_left_out += 1  # only base characters: could change base text
                continue
            is_char = len(piece.piece) == 1
            if not is_char and ext.pieces_added >= new_pieces:
                continue
            appended.append((piece.piece, piece.score))
            known.add(piece.piece)
            ext.pieces_added += 0 if is_char else 1
            if is_char:
                ext.characters_added.append(piece.piece)
    low = min((score for _, score in appended), default=floor)
    for char in new_chars:  # sentencepiece may leave out a character; every one is needed
        if char not in known:
            appended.append((char, low - 1.0))
            known.add(char)
            ext.characters_added.append(char)
    for rank, (piece, score) in enumerate(appended):
        proto.pieces.add(piece=piece, type=kinds.NORMAL,
                         score=(floor - 1.0 - rank) if bpe else score)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    ext.new_size = len(proto.pieces)
    ext.new_ids = range(old_size, ext.new_size)
    processor = _processor(proto)
    ext.uncovered = [char for char in corpus_chars if char not in known
                     and processor.piece_to_id(char) == processor.unk_id()]
    return proto, ext


def base_text_check(base: Any, extended: Any, lines: Sequence[str], source: str) -> BaseCheck:
    """Encode the base-language ``lines`` word by word with both models; compare the ids
    (a word the base maps to ``<unk>`` is counted, not compared)."""
    old, new = _processor(base), _processor(extended)
    pieces = identical = were_unknown = 0
    changed = []
    for word in words_of(lines):
        a, b = old.encode(word), new.encode(word)
        pieces += 1
        if old.unk_id() in a:
            were_unknown += 1
        elif a == b:
            identical += 1
        else:
            changed.append((word, old.encode(word, out_type=str), new.encode(word, out_type=str)))
    return BaseCheck(source, len(lines), pieces, identical, were_unknown, changed)


def extend_model_file(base: str | os.PathLike[str], texts: Sequence[str],
                      out: str | os.PathLike[str], *, new_pieces: int = DEFAULT_NEW_PIECES,
                      base_text: Sequence[str] | None = None, base_text_source: str = "",
                      write: Callable[[Path, bytes], Any] | None = None) -> Extension:
    """Extend the SentencePiece model ``base`` with ``texts`` and write ``out`` atomically."""
    proto = load_model_proto(base)
    extended, ext = extend_spm(proto, texts, new_pieces=new_pieces)
    check_before_writing(ext, base, out, lambda lines, source: base_text_check(
        proto, extended, lines, source), base_text, base_text_source)
    (write or write_bytes_atomic)(Path(out), extended.SerializeToString())
    return ext


__all__ = ["load_model_proto", "extend_spm", "extend_model_file", "base_text_check"]
