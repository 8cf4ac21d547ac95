"""Integration ``xtts_language`` (patch ``languages``): the XTTS tokenizer and model accept
registered languages.

coqui-tts 0.28's ``VoiceBpeTokenizer.preprocess_text`` raises ``NotImplementedError`` outside
its 17 languages and ``Xtts.synthesize`` asserts ``language in config.languages``. The module
bindings ``VoiceBpeTokenizer`` and ``Xtts`` (and every ``from ... import`` copy) become
subclasses that handle the languages of :mod:`patches.languages` (their cleaner, character
limit and ``[code]`` token) and defer to coqui otherwise. The user's view:
TRAINING_PATCHES_README.md, "Languages the XTTS tokenizer does not know".
"""

from __future__ import annotations

import inspect
from typing import Any

from .. import languages
from .._log import info, logger
from .._registry import Integration, Site, is_enabled, register_integration, subclass_site

NAME = "xtts_language"
DISTRIBUTION = "coqui-tts"
SUPPORTED = ">=0.27,<0.29"
TOKENIZER_MODULE = "TTS.tts.layers.xtts.tokenizer"
MODEL_MODULE = "TTS.tts.models.xtts"


class LanguageTokenMissingError(ValueError):
    """The vocabulary has no ``[code]`` special token for a language being encoded."""


def _active_language(lang: str) -> languages.Language | None:
    """The registered language for ``lang`` while the patch is applied, else None."""
    return languages.get_language(lang) if is_enabled(NAME) else None


class _CharLimits(dict):
    """coqui's ``char_limits`` table that also answers (``[]`` and ``.get``) for languages
    registered, even after the tokenizer was built."""

    def __missing__(self, key: str) -> int:
        language = _active_language(key)
        if language is None:
            raise KeyError(key)
        return language.char_limit

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        language = _active_language(key)
        return super().get(key, default) if language is None else language.char_limit


def _is_special(backend: Any, token: str) -> bool:
    token_id = backend.token_to_id(token)
    return token_id is not None and backend.encode(token).ids == [token_id]


def language_token_code(tokenizer: Any, given: str, language: languages.Language,
                        vocab_file: Any = None) -> str:
    """The code whose ``[code]`` token the vocabulary holds: the one the data names (``amh``),
    else the registered code or an alias (``am``). Raises
    :class:`LanguageTokenMissingError` when the vocabulary has none of them."""
    backend = tokenizer.tokenizer
    candidates = [languages.base_code(given)] + [c for c in language.codes
                                                 if c != languages.base_code(given)]
    if backend is None:
        return candidates[0]  # coqui's own error (no vocabulary loaded) is clearer here
    for code in candidates:
        if _is_special(backend, f"[{code}]"):
            return code
    check_language_token(tokenizer, language.code, vocab_file)
    return language.code


def check_language_token(tokenizer: Any, code: str, vocab_file: Any) -> None:
    """Raise :class:`LanguageTokenMissingError` unless ``[code]`` encodes as one special token."""
    token = f"[{code}]"
    backend = tokenizer.tokenizer
    if backend is None or _is_special(backend, token):
        return  # no vocabulary loaded: coqui's own error is clearer than ours there
    token_id = backend.token_to_id(token)
    vocab = backend.get_vocab()
    found = sorted(t for t in vocab if len(t) <= 8 and t.startswith("[") and t.endswith("]")
                   and t[1:-1].replace("-", "").isalpha() and t[1:-1].islower())
    where = f"the vocabulary {vocab_file}" if vocab_file else "the tokenizer's vocabulary"
    state = ("is a plain BPE entry, not a special (added) token, so it is split into pieces"
             if token_id is not None else "is missing")
    raise LanguageTokenMissingError(
        f"training-patches: {where} ({len(vocab)} tokens) cannot encode language {code!r}: the "
        f"token {token!r} {state}. Language tokens found: {', '.join(found) or 'none'}. XTTS "
        f"starts every text with its language token, so {token!r} must be one special token "
        f"in vocab.json. `training-patches extend-tokenizer {vocab_file or 'vocab.json'} --corpus "
        f"TEXT --language {code} --output vocab_{code}.json` adds it with the language's BPE "
        f"tokens (headlessXttsTrain.py --extend-vocab TEXT does the same), or add it to "
        f"\"added_tokens\" with \"special\": true yourself; then train with that vocab.json "
        f"as tokenizer_file; the model's text embedding grows by the tokens added.")


def _tokenizer_class(original: type) -> type:
    """A ``VoiceBpeTokenizer`` that also encodes registered languages."""

    class LanguageAwareTokenizer(original):  # type: ignore[misc,valid-type]
        __doc__ = (f"coqui's VoiceBpeTokenizer plus the languages registered with "
                   f"patches.advanced.register_language (training-patches {NAME}).")

        def __init__(self, vocab_file: Any = None, *args: Any, **kwargs: Any) -> None:
            super().__init__(vocab_file, *args, **kwargs)
            self._tp_vocab_file = vocab_file
            self._tp_codes: dict[str, str] = {}  # code in the data -> code of its [token]
            self.char_limits = _CharLimits(self.char_limits)

        def check_input_length(self, txt: str, lang: str) -> None:
            language = _active_language(lang)
            if language is None:
                return super().check_input_length(txt, lang)
            if len(txt) > language.char_limit:
                logger.warning(
                    "training-patches: the text is %d characters long, above the limit of %d "
                    "for language %r; the audio may be truncated: %s...", len(txt),
                    language.char_limit, language.code, txt[:50])
            return None

        def preprocess_text(self, txt: str, lang: str) -> str:
            language = _active_language(lang)
            if language is None:
                return super().preprocess_text(txt, lang)
            return language.cleaner(txt)

        def encode(self, txt: str, lang: str) -> list[int]:
            language = _active_language(lang)
            if language is not None:
                code = self._tp_codes.get(lang)
                if code is None:
                    code = self._tp_codes[lang] = language_token_code(
                        self, lang, language, self._tp_vocab_file)
                lang = code  # coqui writes f"[{lang}]" in front of the text
            return super().encode(txt, lang)

    return LanguageAwareTokenizer


def _model_class(original: type) -> type:
    """An ``Xtts`` whose ``synthesize`` accepts registered languages."""
    signature = inspect.signature(original.synthesize)

    class LanguageAwareXtts(original):  # type: ignore[misc,valid-type]
        __doc__ = (f"coqui's Xtts whose config accepts the languages registered with "
                   f"patches.advanced.register_language (training-patches {NAME}).")

        def synthesize(self, *args: Any, **kwargs: Any) -> Any:
            # ``language`` may come by position or keyword: bind as coqui's signature does.
            try:
                language = signature.bind(self, *args, **kwargs).arguments.get("language")
            except TypeError:
                language = None  # coqui raises its own, clearer, error below
            if language is not None:
                accept_language(self.config, language)
            return super().synthesize(*args, **kwargs)

    return LanguageAwareXtts


def accept_language(config: Any, code: str) -> bool:
    """Add a registered ``code`` to an XTTS config's ``languages`` (which coqui checks before
    synthesising, and a fine-tune's config.json should list); True if added."""
    language = _active_language(code)
    langs = getattr(config, "languages", None)
    if language is None or not isinstance(langs, list) or language.code in langs:
        return False
    langs.append(language.code)
    info("training-patches: XTTS config now lists language %r (registered language)",
         language.code)
    return True


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="TTS",
    describe="the XTTS tokenizer and model accept registered languages",
    sites=(
        Site(TOKENIZER_MODULE, "VoiceBpeTokenizer",
             subclass_site(_tokenizer_class, __name__, "LanguageAwareTokenizer"), sweep=True,
             patch="languages",
             lost="the XTTS tokenizer raises NotImplementedError for registered languages"),
        Site(MODEL_MODULE, "Xtts", subclass_site(_model_class, __name__, "LanguageAwareXtts"),
             sweep=True, patch="languages",
             lost="Xtts.synthesize refuses registered languages (test sentences, inference)"),
    ),
))
