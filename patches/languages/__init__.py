"""Languages the XTTS tokenizer does not know, registered with their text cleaner.

coqui-tts 0.28's ``VoiceBpeTokenizer`` hard-codes its languages: any other code
raises ``NotImplementedError`` in ``preprocess_text``. With the ``xtts_language``
patch applied, a language registered here is encoded with its own cleaner and
character limit (and the XTTS config accepts its code)::

    import patches
    patches.register_language("ti", cleaner=my_tigrinya_cleaner, char_limit=150,
                              romanize=my_tigrinya_romanizer)

A language's ``romanize`` (text -> Latin letters, or None) serves the pronunciation-informed
init of new vocabulary rows (:mod:`patches.row_init`). Amharic (``am``) is registered from the
start with :func:`patches.languages.amharic.normalize` and
:func:`patches.languages.amharic.romanize`.
Registering only fills this table; nothing upstream changes until the patch is applied.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from dataclasses import dataclass
from typing import Callable

from .. import _options
from .._log import info
from .._options import Option, flag
from .._registry import PatchSpec, register
from . import amharic

__all__ = ["Language", "register_language", "unregister_language", "get_language",
           "registered_languages", "plain_cleaner", "romanize", "COQUI_LANGUAGES"]

# What coqui-tts 0.28's VoiceBpeTokenizer.preprocess_text handles by itself.
COQUI_LANGUAGES = frozenset({"ar", "cs", "de", "en", "es", "fr", "hi", "hu", "it", "ja", "ko",
                             "nl", "pl", "pt", "ru", "tr", "zh"})
_CODE_RE = re.compile(r"^[a-z]{2,3}$")


@dataclass(frozen=True)
class Language:
    """A registered language: its code (``am``), text cleaner, character limit and
    (optionally) romaniser."""

    code: str
    cleaner: Callable[[str], str]
    char_limit: int
    name: str = ""
    aliases: tuple[str, ...] = ()  # other codes of the same language (ISO 639-3: "amh")
    # text -> Latin letters as the base language reads them, None for text not in this
    # language's script (patches.row_init's "romanized" rule)
    romanize: Callable[[str], str | None] | None = None

    @property
    def codes(self) -> tuple[str, ...]:
        """Every code that names this language, the registered one first."""
        return (self.code, *self.aliases)


_lock = threading.Lock()
_languages: dict[str, Language] = {}


def plain_cleaner(text: str) -> str:
    """The cleaner of a language registered without one: NFC, lowercase, single spaces."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


def _amharic_cleaner(text: str) -> str:
    # Read at call time, so TRAINING_PATCHES_AMHARIC_HOMOPHONES / apply(...) take effect.
    return amharic.normalize(text, homophones=_options.current().amharic_homophones)


def base_code(code: str) -> str:
    """``am-ET`` -> ``am``: the tokenizer, like coqui's, ignores the region."""
    return str(code).split("-")[0].strip().lower()


def register_language(code: str, cleaner: Callable[[str], str] | None = None,
                      char_limit: int = 250, *, name: str = "", aliases: tuple[str, ...] = (),
                      romanize: Callable[[str], str | None] | None = None,
                      replace: bool = False) -> Language:
    """Teach the XTTS tokenizer a language (effective while ``xtts_language`` is applied).

    ``cleaner(text) -> text`` turns raw text into what should be spoken (numbers as
    words, abbreviations expanded ...); ``char_limit`` is the length above which
    coqui warns that audio may be truncated and splits text at inference. The
    vocabulary must hold ``[code]`` as a special token; encoding says so clearly if
    it does not. Registering a code that is already registered, or one coqui
    handles itself (``en``, ``de`` ...), needs ``replace=True``. ``aliases`` are other
    codes of the same language (the ISO 639-3 ``amh`` for ``am``): manifests, the
    tokenizer and the headless CLI accept each of them as this language. ``romanize(text)``
    spells text of this language's script in Latin letters as the base language reads them
    (``ሰላም`` -> ``selam``) and returns None for text it cannot spell: the "romanized" rule
    of :mod:`patches.row_init` starts a new token's rows from the base rows of its spelling.
    """
    key = base_code(code)
    alias_keys = tuple(base_code(alias) for alias in aliases)
    for alias in (key, *alias_keys):
        if not _CODE_RE.match(alias):
            raise _options.ConfigError(
                f"training-patches: register_language got the language code {alias!r}. "
                f"Expected a 2- or 3-letter ISO 639 code such as 'am' or 'tir' (a region such "
                f"as 'am-ET' is allowed and ignored). Pass the code your manifests use in "
                f"their language column.")
    if not _CODE_RE.match(key):
        raise _options.ConfigError(
            f"training-patches: register_language got the language code {code!r}. Expected a "
            f"2- or 3-letter ISO 639 code such as 'am' or 'tir' (a region such as 'am-ET' is "
            f"allowed and ignored). Pass the code your manifests use in their language column.")
    if cleaner is not None and not callable(cleaner):
        raise _options.ConfigError(
            f"training-patches: register_language({key!r}) got cleaner={cleaner!r}, which is not "
            f"callable. Expected a function taking the text and returning the cleaned text, "
            f"or None for NFC + lowercase + single spaces.")
    if romanize is not None and not callable(romanize):
        raise _options.ConfigError(
            f"training-patches: register_language({key!r}) got romanize={romanize!r}, which is "
            f"not callable. Expected a function taking text and returning it in Latin letters "
            f"(or None when it cannot), or None for no romaniser.")
    if isinstance(char_limit, bool) or not isinstance(char_limit, int) or char_limit < 1:
        raise _options.ConfigError(
            f"training-patches: register_language({key!r}) got char_limit={char_limit!r}. "
            f"Expected a whole number of characters of at least 1 (coqui uses 250 for English, "
            f"150 for Hindi).")
    with _lock:
        if not replace and (key in _languages or key in COQUI_LANGUAGES):
            where = "already registered" if key in _languages else "built into coqui-tts"
            raise _options.ConfigError(
                f"training-patches: the language {key!r} is {where}. Pass replace=True to "
                f"register_language to use your cleaner and limit instead.")
        language = Language(key, cleaner or plain_cleaner, char_limit, name, alias_keys, romanize)
        _languages[key] = language
    info("training-patches: language %r registered (char limit %d)", key, char_limit)
    return language


def unregister_language(code: str) -> bool:
    """Forget a registered language; False if it was not registered."""
    with _lock:
        return _languages.pop(base_code(code), None) is not None


def get_language(code: str) -> Language | None:
    """The registered language for ``code`` or one of its aliases (region ignored), or None."""
    key = base_code(code)
    found = _languages.get(key)
    if found is None:
        found = next((lang for lang in _languages.values() if key in lang.aliases), None)
    return found


def registered_languages() -> dict[str, Language]:
    """Code -> :class:`Language` for every registered language."""
    return dict(_languages)


def romanize(text: str) -> tuple[str, str] | None:
    """``(romanised text, language code)`` from the first registered language whose
    romaniser spells ``text``, or None when none does. A romaniser that raises or returns
    something other than a non-empty string counts as "cannot spell it"."""
    for language in list(_languages.values()):
        if language.romanize is None:
            continue
        try:
            spelled = language.romanize(text)
        except Exception:  # a user's function: its failure is a fallback, not a crash
            continue
        if isinstance(spelled, str) and spelled.strip():
            return spelled.strip(), language.code
    return None


# Amharic ships registered; the registration is only an entry in the table above.
_languages["am"] = Language("am", _amharic_cleaner, amharic.CHAR_LIMIT, "Amharic", ("amh",),
                            amharic.romanize)


def _describe(options: object) -> str:
    codes = ", ".join(sorted(_languages)) or "none"
    return f"registered languages ({codes}) are accepted by the tokenizers of the integrations"


SPEC = register(PatchSpec(
    name="languages", describe=_describe,
    options=(Option("amharic_homophones", flag, False, "1 or 0",
                    "1: fold Amharic homophone letters (ሐ ኀ -> ሀ, ...)"),),
))
