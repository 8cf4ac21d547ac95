"""Transcripts: the script tables, the language's cleaner and character limit, and the
tokenizer as the trainer encodes with it."""

from __future__ import annotations

import os
import unicodedata
from typing import Callable

from ...languages import base_code, get_language, plain_cleaner
from .manifest import ManifestError

# Scripts as code point ranges (inclusive). Ethiopic: the block and its supplements.
SCRIPTS: dict[str, tuple[tuple[int, int], ...]] = {
    "Ethiopic": ((0x1200, 0x137F), (0x1380, 0x139F), (0x2D80, 0x2DDF), (0xAB00, 0xAB2F),
                 (0x1E7E0, 0x1E7FF)),
    "Latin": ((0x0041, 0x005A), (0x0061, 0x007A), (0x00C0, 0x024F), (0x1E00, 0x1EFF)),
    "Cyrillic": ((0x0400, 0x052F),),
    "Arabic": ((0x0600, 0x06FF), (0x0750, 0x077F)),
    "Devanagari": ((0x0900, 0x097F),),
}
LANGUAGE_SCRIPTS = {"am": "Ethiopic", "ti": "Ethiopic", "gez": "Ethiopic", "tig": "Ethiopic",
                    "en": "Latin", "de": "Latin", "fr": "Latin", "es": "Latin", "it": "Latin",
                    "pt": "Latin", "nl": "Latin", "pl": "Latin", "cs": "Latin", "hu": "Latin",
                    "tr": "Latin", "ru": "Cyrillic", "ar": "Arabic", "hi": "Devanagari"}


def script_of(language: str) -> str | None:
    """The script name of a language code (``am`` -> ``Ethiopic``), or None if not known."""
    code = base_code(language)
    registered = get_language(code)
    for candidate in ((registered.codes if registered else ()) + (code,)):
        if candidate in LANGUAGE_SCRIPTS:
            return LANGUAGE_SCRIPTS[candidate]
    return None


def in_script(char: str, script: str) -> bool:
    point = ord(char)
    return any(low <= point <= high for low, high in SCRIPTS[script])


def is_letter(char: str) -> bool:
    return unicodedata.category(char)[0] in "LM"


class TextTokenizer:
    """An XTTS ``vocab.json`` (HF tokenizers) or a SentencePiece ``.model``, as the trainer
    encodes with it."""

    def __init__(self, path: str, language: str) -> None:
        self.path = path
        self.language = language
        self.missing_language_token = False
        if path.endswith(".model"):
            import sentencepiece as spm  # lazy: may be missing: _check_installed says so first

            self.kind = "sentencepiece"
            self._sp = spm.SentencePieceProcessor(model_file=path)
            self.unk_id = self._sp.unk_id()
            self.size = self._sp.get_piece_size()
        else:
            from tokenizers import Tokenizer  # lazy: tokenizers is optional (the tools extra)

            self.kind = "xtts-bpe"
            self._hf = Tokenizer.from_file(path)
            self.unk_id = self._hf.token_to_id("[UNK]")
            self.size = self._hf.get_vocab_size()
            self.missing_language_token = self._hf.token_to_id(f"[{language}]") is None

    def encode(self, text: str) -> list[int]:
        """Token ids of cleaned text, as the trainer makes them (XTTS: ``[lang]`` first,
        spaces as ``[SPACE]``)."""
        if self.kind == "sentencepiece":
            return list(self._sp.encode(text))
        ids = self._hf.encode(text.replace(" ", "[SPACE]")).ids
        return ids if self.missing_language_token else [self._hf.token_to_id(
            f"[{self.language}]")] + ids

    def unknown_characters(self, text: str) -> list[str]:
        """The characters of ``text`` that encode to ``[UNK]`` on their own."""
        if self.unk_id is None:
            return []
        found = []
        for char in dict.fromkeys(text):
            if char.isspace():
                continue
            ids = (self._sp.encode(char) if self.kind == "sentencepiece"
                   else self._hf.encode(char).ids)
            if self.unk_id in ids:
                found.append(char)
        return found


def cleaner_of(language: str) -> Callable[[str], str]:
    registered = get_language(language)
    return registered.cleaner if registered else plain_cleaner


def char_limit_of(language: str) -> int | None:
    registered = get_language(language)
    return registered.char_limit if registered else None


def load_tokenizer(path: str | None, language: str) -> TextTokenizer | None:
    """The ``--tokenizer`` file loaded, None without one, or :class:`ManifestError`."""
    if not path:
        return None
    if not os.path.isfile(path):
        raise ManifestError(
            f"training-patches check-data: --tokenizer {path}: no such file. Expected an XTTS "
            f"vocab.json (Hugging Face tokenizers) or a SentencePiece .model. Check the path.")
    try:
        return TextTokenizer(path, language)
    except Exception as exc:  # noqa: BLE001 - any loader error means the same to the user
        raise ManifestError(
            f"training-patches check-data: --tokenizer {path} could not be loaded "
            f"({type(exc).__name__}: {str(exc).strip()[:200]}). Expected an XTTS vocab.json "
            f"(a Hugging Face tokenizers file) or a SentencePiece .model (the name must end "
            f"in .model). Pass the tokenizer file the trainer uses.") from None
