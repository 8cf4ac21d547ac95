"""Text as the trainer sees it: reading a corpus, cleaning it, and writing outputs safely.

A corpus is a plain text file (one sentence a line) or a coqui-format manifest
(``audio_file|text|speaker_name`` header; the ``text`` column is read). Each line goes
through what the trainer applies before the tokenizer: an optional G2P front-end named
``module:function`` (or ``path/to/file.py:function``), then the language's cleaner
(a language registered in :mod:`patches.languages`, e.g. Amharic ``am``/``amh``, or one
of coqui-tts's own, which needs coqui-tts installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .. import _output
from .._output import OutputRefused, same_file, write_file
from ...languages import COQUI_LANGUAGES, base_code, get_language
from .errors import FrontEndError, TokenizerToolError, require_file

# Base-language text checked when no --base-text is given: everyday English with
# punctuation, the language XTTS v2 and most base tokenizers know best.
ENGLISH_SAMPLE: tuple[str, ...] = (
    "the quick brown fox jumps over the lazy dog.",
    "she sells sea shells by the sea shore, doesn't she?",
    "good morning, and welcome to the training run!",
    "one two three four five six seven eight nine ten.",
    "the weather is calm today and the night will be quiet.",
    "please speak slowly; i am still learning the language.",
    "where is the nearest station, and how long does it take?",
    "every step of the optimizer moves the weights a little.",
    "a voice is more than words: it carries feeling and rhythm.",
    "they bought bread, milk and coffee at the market yesterday.",
    "thank you very much for your help with this project.",
    "it was the best of times, it was the worst of times.",
)

MANIFEST_COLUMN = "text"


# A table's first column naming audio files: a manifest (or an LJSpeech-style metadata file)
# without the coqui header, whose paths and names must not become vocabulary.
_AUDIO_COLUMN = re.compile(r"^[^|,;\t]*\.(wav|flac|mp3|ogg|opus|m4a|aac)\s*[|,;\t]", re.I)
# The longest piece between two spaces the corpus may hold (--max-word-chars): XTTS splits
# text at spaces and BPE learning time grows with the square of a piece's length (measured,
# tokenizers 0.22: 20,000 characters 0.5 s, 80,000 characters 5.7 s; a 9 MB line: hours).
MAX_WORD_CHARS = 1000


def read_lines(path: str | os.PathLike[str], *, what: str = "corpus") -> list[str]:
    """The text lines of ``path``: a plain text file (one line each, blank lines skipped)
    or a coqui manifest (the ``text`` column of an ``audio_file|text|speaker_name`` file).

    A UTF-8 byte-order mark is dropped. A table that is not a coqui manifest (``|``
    columns without that header, or audio file names in its first column) is refused:
    read as text, its paths, ids and speaker names would become vocabulary."""
    path = Path(path)
    require_file(path, what, "a UTF-8 text file with one sentence a line, or a coqui manifest "
                             "with the header 'audio_file|text|speaker_name'")
    try:
        raw = path.read_text(encoding="utf-8-sig")  # -sig: a leading BOM is not text
    except UnicodeDecodeError as exc:
        raise TokenizerToolError(
            f"the {what} {path} is not UTF-8 text (byte {exc.start} cannot be decoded). "
            f"Expected a UTF-8 text file or a coqui manifest. Convert it (e.g. iconv -t utf-8) "
            f"or check that you named the text file and not an audio or model file.") from None
    lines = [line.strip() for line in raw.splitlines()]
    lines = [line for line in lines if line]
    header = [name.strip().lower() for name in lines[0].split("|")] if lines else []
    if MANIFEST_COLUMN in header and "audio_file" in header:
        column = header.index(MANIFEST_COLUMN)
        texts = []
        for line in lines[1:]:
            fields = line.split("|")
            if len(fields) > column and fields[column].strip():
                texts.append(fields[column].strip())
        lines = texts
    elif lines:
        piped = sum("|" in line for line in lines)
        audio = sum(bool(_AUDIO_COLUMN.match(line)) for line in lines)
        if 2 * piped > len(lines) or 2 * audio > len(lines):
            found = (f"{audio} of its {len(lines)} lines start with an audio file name"
                     if 2 * audio > len(lines) else
                     f"{piped} of its {len(lines)} lines hold '|'-separated columns")
            raise TokenizerToolError(
                f"the {what} {path} looks like a dataset table, not text: {found}, and its "
                f"first line {lines[0][:80]!r} is not the coqui header "
                f"'audio_file|text|speaker_name'. Read as text, its file names and speaker "
                f"names would become tokens. Give a text file with one sentence a line, or a "
                f"coqui manifest with that header (its text column is then read).")
    if not lines:
        raise TokenizerToolError(
            f"the {what} {path} holds no text (no non-empty line; for a manifest, no row with "
            f"a transcript). Expected sentences of the language, one a line.")
    return lines


def check_word_lengths(texts: Sequence[str], limit: int, source: str) -> None:
    """Refuse text holding a piece of more than ``limit`` characters between spaces (see
    :data:`MAX_WORD_CHARS`), before the BPE learning that would take hours on it."""
    for number, text in enumerate(texts, start=1):
        if len(text) <= limit:
            continue
        longest = max(text.split(" "), key=len)
        if len(longest) > limit:
            raise TokenizerToolError(
                f"the corpus {source} holds a piece of {len(longest):,} characters without a "
                f"space (text line {number}, after cleaning: {longest[:40]!r}...). XTTS splits "
                f"text at spaces, and learning BPE pieces from one this long takes time that "
                f"grows with the square of its length (80,000 characters: about 6 s; a 9 MB "
                f"line: hours), so nothing was done. Expected sentences, one a line, with "
                f"spaces between words. Split the text, or raise --max-word-chars (now "
                f"{limit:,}) if it is really one word.")


def load_function(spec: str) -> Callable[..., str]:
    """``module:function`` or ``path/to/file.py:function`` -> the function."""
    module_name, sep, func_name = spec.rpartition(":")
    if not sep or not module_name or not func_name:
        raise TokenizerToolError(
            f"--g2p {spec!r}: expected MODULE:FUNCTION (e.g. my_g2p:to_ipa, or "
            f"path/to/g2p.py:to_ipa) naming a function that takes a sentence and returns "
            f"the text the trainer gives the tokenizer.")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            loader_spec = importlib.util.spec_from_file_location(file.stem, file)
            if loader_spec is None or loader_spec.loader is None or not file.is_file():
                raise ImportError(f"no such file: {file}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise TokenizerToolError(
            f"--g2p {spec}: the module {module_name} could not be imported "
            f"({type(exc).__name__}: {exc}). Expected an importable module (run from the "
            f"folder holding it, or name its .py file) defining {func_name}.") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise TokenizerToolError(
            f"--g2p {spec}: {module_name} has no function {func_name!r}. Expected a function "
            f"taking a sentence (and optionally the language code) and returning text.")
    return func


def _takes_language(func: Callable[..., str]) -> bool:
    try:
        params = [p for p in inspect.signature(func).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def language_cleaner(language: str) -> Callable[[str], str]:
    """The cleaner the XTTS tokenizer applies for ``language``: a registered language's own
    (with the ``xtts_language`` patch), else coqui-tts's for the languages it knows."""
    registered = get_language(language)
    if registered is not None:
        return registered.cleaner
    code = base_code(language)
    if code in COQUI_LANGUAGES:
        try:
            from TTS.tts.layers.xtts.tokenizer import VoiceBpeTokenizer  # lazy: TTS is optional
        except ImportError:
            raise TokenizerToolError(
                f"--language {language}: its cleaner is coqui-tts's, and coqui-tts is not "
                f"installed here. Install the 'xtts' extra (pip install "
                f"'training-patches[xtts]'), or pass --no-cleaner if the corpus is already "
                f"cleaned.") from None
        tokenizer = VoiceBpeTokenizer(None)
        return lambda text: tokenizer.preprocess_text(text, code)
    raise TokenizerToolError(
        f"--language {language}: no cleaner is registered for this language, so the text the "
        f"trainer will tokenize is unknown. Expected a language registered with "
        f"patches.advanced.register_language (Amharic 'am'/'amh' is) or one coqui-tts knows "
        f"({', '.join(sorted(COQUI_LANGUAGES))}). Register it first, or pass --no-cleaner to "
        f"use the corpus as it is.")


def _text_returned(value: object) -> str:
    """What a front-end returned, if it is text: None, bytes or a list of phonemes would be
    trained into the tokenizer as their ``str()`` ("None", "b'...'", "['a', ...]")."""
    if not isinstance(value, str):
        raise TypeError(f"it returned {type(value).__name__} {str(value)[:40]!r}, not text "
                        f"(a str)")
    return value


def make_preprocess(language: str | None, *, g2p: str | None = None,
                    clean: bool = True) -> Callable[[str], str]:
    """Text -> what the trainer gives the tokenizer: G2P (if named), then the cleaner."""
    front = load_function(g2p) if g2p else None
    with_language = front is not None and _takes_language(front)
    cleaner = language_cleaner(language) if (clean and language) else None

    def preprocess(text: str) -> str:
        # The user's function (or a cleaner) raising is their bug to see in one paragraph
        # naming it and the text, not a traceback through this module.
        original = text
        if front is not None:
            try:
                text = _text_returned(front(text, language) if with_language else front(text))
            except Exception as exc:  # noqa: BLE001 - any failure of the user's code
                raise FrontEndError(f"--g2p {g2p}", original, exc) from None
        if cleaner is not None:
            try:
                text = _text_returned(cleaner(text))
            except Exception as exc:  # noqa: BLE001
                raise FrontEndError(f"the {language} cleaner", original, exc) from None
        return text

    return preprocess


def words_of(lines: Iterable[str]) -> list[str]:
    """The pieces between spaces: XTTS replaces each space by ``[SPACE]`` before its BPE
    runs, so no BPE piece ever spans a space."""
    return [word for line in lines for word in line.split(" ") if word]


def check_output(src: Path, out: Path | None, *, in_place: bool, force: bool,
                 suffix: str, inputs: Sequence[tuple[str, str | os.PathLike[str]]] = (),
                 own: _output.OwnKind | None = None) -> Path:
    """Where to write, refusing to overwrite the input (unless ``in_place``), an existing
    file (unless ``force``, and then only one of the kind ``own``: a tokenizer), a folder,
    or any of ``inputs`` ((what, path): the corpus, the base text; never, even with
    ``force`` or ``in_place``)."""
    if in_place:
        if out is not None and out.resolve() != src.resolve():
            raise TokenizerToolError(
                f"--in-place writes over {src} itself; it cannot be used with --output {out}. "
                f"Give one of them.")
        for what, path in inputs:  # --in-place replaces the tokenizer, never another input
            if same_file(src, path):
                raise TokenizerToolError(
                    f"--in-place would write over {src}, which is also the {what} "
                    f"({os.fspath(path)}): an input is never overwritten, so nothing was "
                    f"written. Expected the {what} to be another file than the tokenizer; "
                    f"give the right {what}.")
        return src
    if out is None:
        raise TokenizerToolError(
            f"no output file given. Pass --output FILE (e.g. {src.with_name(src.stem + suffix + src.suffix)}); "
            f"the input {src} is only overwritten with --in-place.")
    if same_file(out, src):  # a link to it too
        raise TokenizerToolError(
            f"--output {out} is the input tokenizer itself. The input is never overwritten "
            f"unless you pass --in-place; name another output file.")
    example = src.with_name(src.stem + suffix + src.suffix)
    try:  # the rule every command follows (patches/tools/_output.py)
        _output.check_output(out, prog="training-patches extend-tokenizer", what="--output",
                             force=force, inputs=inputs, example=str(example), stdout=False,
                             own=own)
    except OutputRefused as exc:
        raise TokenizerToolError(str(exc).split(": ", 1)[1]) from None
    return out


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """``path`` complete or untouched, replaced if there: a fsynced temporary file in the
    same folder, then ``os.replace``; its mode follows the umask
    (:func:`patches.tools._output.write_file`)."""
    return write_file(path, data, replace=True)


def sample_base_text(path: str | os.PathLike[str] | None) -> tuple[list[str], str]:
    """The base-language lines to check, and where they came from."""
    if path is None:
        return list(ENGLISH_SAMPLE), f"the built-in English sample ({len(ENGLISH_SAMPLE)} lines)"
    lines = read_lines(path, what="base text")
    return lines, f"{path} ({len(lines)} lines)"


__all__ = ["read_lines", "load_function", "language_cleaner", "make_preprocess", "words_of",
           "check_output", "check_word_lengths", "write_bytes_atomic", "sample_base_text",
           "ENGLISH_SAMPLE", "MAX_WORD_CHARS"]
