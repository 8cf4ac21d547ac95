"""Integration ``xtts_language`` (patch ``languages``): the XTTS tokenizer and model accept
registered languages.

coqui-tts 0.28 cannot train or speak a language it does not list:

- ``VoiceBpeTokenizer.preprocess_text`` raises ``NotImplementedError`` for any code
  outside its 17 languages, and ``char_limits[lang]`` is a KeyError at inference
  with text splitting;
- ``Xtts.synthesize`` asserts ``language in config.languages`` (test sentences
  during training and every inference call);
- ``encode`` prefixes ``[lang]``; a vocabulary without that special token splits it
  into BPE pieces (or ``[UNK]``) and the dataset silently drops every sample.

The patch replaces the module-level bindings ``VoiceBpeTokenizer`` (in
``TTS.tts.layers.xtts.tokenizer``) and ``Xtts`` (in ``TTS.tts.models.xtts``), and
every copy taken with ``from ... import``, with subclasses that handle the
languages in :mod:`patches.languages` and defer to coqui for everything else.
Module bindings (not class attributes) are what the registry patches, so the
usual import-order and revert guarantees hold; objects built while the patch was
applied fall back to coqui's behaviour once it is reverted.
"""

from __future__ import annotations

import inspect
from typing import Any

from .. import languages
from .._log import info, logger
from .._registry import Integration, Site, is_enabled, register_integration

NAME = "xtts_language"
DISTRIBUTION = "coqui-tts"
SUPPORTED = ">=0.27,<0.29"
TOKENIZER_MODULE = "TTS.tts.layers.xtts.tokenizer"
MODEL_MODULE = "TTS.tts.models.xtts"


class LanguageTokenMissingError(ValueError):
    """The vocabulary has no ``[code]`` special token for a language being encoded."""


def _active_language(lang: str) -> languages.Language | None:
    """The registered language for ``lang`` while the patch is applied, else None."""
    if not is_enabled(NAME):
        return None
    return languages.get_language(lang)


class _CharLimits(dict):
    """coqui's ``char_limits`` table that also answers for registered languages.

    ``Xtts.inference`` indexes it (``char_limits[language]``) and
    ``check_input_length`` calls ``.get``; both must see a language registered
    after the tokenizer was built.
    """

    def __missing__(self, key: str) -> int:
        language = _active_language(key)
        if language is None:
            raise KeyError(key)
        return language.char_limit

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        language = _active_language(key)
        if language is not None:
            return language.char_limit
        return super().get(key, default)


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
    if backend is None:
        return  # coqui's own error (no vocabulary loaded) is clearer than ours here
    token_id = backend.token_to_id(token)
    if _is_special(backend, token):
        return
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
                bound = signature.bind(self, *args, **kwargs)
            except TypeError:
                bound = None  # coqui raises its own, clearer, error below
            language = bound.arguments.get("language") if bound is not None else None
            if language is not None:
                accept_language(self.config, language)
            return super().synthesize(*args, **kwargs)

    return LanguageAwareXtts


def accept_language(config: Any, code: str) -> bool:
    """Add a registered ``code`` to an XTTS config's ``languages``; True if added.

    coqui checks ``language in config.languages`` before synthesising; the saved
    ``config.json`` of a fine-tune should also list the language it learned.
    """
    language = _active_language(code)
    langs = getattr(config, "languages", None)
    if language is None or not isinstance(langs, list) or language.code in langs:
        return False
    langs.append(language.code)
    info("training-patches: XTTS config now lists language %r (registered language)",
         language.code)
    return True


# One subclass per original class, so apply/revert/apply installs the same object
# and pickling (DataLoader workers under spawn) finds it by name in this module.
_made: dict[int, type] = {}


def _cached(factory: Any, public_name: str) -> Any:
    def make(original: type) -> type:
        cls = _made.get(id(original))
        if cls is None or cls.__bases__[0] is not original:
            cls = _made[id(original)] = factory(original)
            cls.__module__ = __name__
            cls.__qualname__ = cls.__name__ = public_name
            globals()[public_name] = cls
        return cls
    return make


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="TTS",
    describe="the XTTS tokenizer and model accept registered languages",
    sites=(
        Site(TOKENIZER_MODULE, "VoiceBpeTokenizer",
             _cached(_tokenizer_class, "LanguageAwareTokenizer"), sweep=True,
             patch="languages",
             lost="the XTTS tokenizer raises NotImplementedError for registered languages"),
        Site(MODEL_MODULE, "Xtts", _cached(_model_class, "LanguageAwareXtts"), sweep=True,
             patch="languages",
             lost="Xtts.synthesize refuses registered languages (test sentences, inference)"),
    ),
))
