"""Languages the XTTS tokenizer does not know, registered with their text cleaner.

With the ``xtts_language`` patch applied, a registered language is encoded with its own
cleaner and character limit (coqui-tts 0.28 raises ``NotImplementedError`` for it); its
``romanize`` spells new vocabulary rows' tokens (:mod:`patches.row_init`). Amharic (``am``)
is registered from the start (:mod:`patches.languages.amharic`). Registering only fills
these tables.
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["Language", "Romanizer", "Speller", "register_language", "unregister_language",
           "get_language", "registered_languages", "romanizers", "plain_cleaner", "romanize",
           "COQUI_LANGUAGES"]

# What coqui-tts 0.28's VoiceBpeTokenizer.preprocess_text handles by itself.
COQUI_LANGUAGES = frozenset({"ar", "cs", "de", "en", "es", "fr", "hi", "hu", "it", "ja", "ko",
                             "nl", "pl", "pt", "ru", "tr", "zh"})
_CODE_RE = re.compile(r"^[a-z]{2,3}$")
# The character limit of a language registered without one (coqui's for English).
DEFAULT_CHAR_LIMIT = 250


@dataclass(frozen=True)
class Language:
    """A registered language: its code (``am``), text cleaner, character limit and
    (optionally) romaniser. ``cleaner`` and ``char_limit`` are None only for a romaniser
    added to a language coqui-tts knows (which is not in this table)."""

    code: str
    cleaner: Callable[[str], str] | None
    char_limit: int | None
    name: str = ""
    aliases: tuple[str, ...] = ()  # other codes of the same language (ISO 639-3: "amh")
    # text -> Latin letters as the base language reads them, None for text not in this
    # language's script (patches.row_init's "romanized" rule)
    romanize: Callable[[str], str | None] | None = None

    @property
    def codes(self) -> tuple[str, ...]:
        """Every code that names this language, the registered one first."""
        return (self.code, *self.aliases)


@dataclass(frozen=True)
class Romanizer:
    """A romaniser as :func:`romanize` asks it: the code of its language, the function, and
    whether it is one of the library's own tables (``builtin``: asked after every user's)."""

    code: str
    spell: Callable[[str], str | None]
    builtin: bool = False
    name: str = ""

    @property
    def label(self) -> str:
        """Who it is, as the load line and its WARNING name it."""
        if self.builtin:
            return f"the library's {self.name or self.code} table ({self.code!r})"
        function = getattr(self.spell, "__name__", type(self.spell).__name__)
        return f"register_language({self.code!r}, romanize={function})"


_lock = threading.Lock()
_languages: dict[str, Language] = {}
# code -> its romaniser, in registration order (also for languages coqui-tts knows)
_romanizers: dict[str, Romanizer] = {}


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
                      char_limit: int | None = None, *, name: str = "",
                      aliases: tuple[str, ...] = (),
                      romanize: Callable[[str], str | None] | None = None,
                      replace: bool = False) -> Language:
    """Teach the XTTS tokenizer a language (effective while ``xtts_language`` is applied).

    ``cleaner(text) -> text`` turns raw text into what should be spoken; ``char_limit``
    (default 250) is the length above which coqui warns and splits text at inference; the
    vocabulary must hold ``[code]`` as a special token. A code already registered, or one
    coqui handles itself (``en``, ``de`` ...), needs ``replace=True``. ``aliases``: other
    codes of the language (``amh`` for ``am``), accepted everywhere as it. ``romanize(text)``
    spells the language's script in Latin letters as the base language reads them (``ሰላም``
    -> ``selam``), None for text it cannot spell (:mod:`patches.row_init`'s spelled rules);
    a user's romaniser is asked before the library's tables. ``romanize=`` alone, for a
    language coqui-tts or this table knows, adds only the romaniser (its cleaner and limit
    kept); replacing a romaniser it has needs ``replace=True``.
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
    for arg, value, expected in (
            ("cleaner", cleaner, "a function taking the text and returning the cleaned text, "
                                 "or None for NFC + lowercase + single spaces"),
            ("romanize", romanize, "a function taking text and returning it in Latin letters "
                                   "(or None when it cannot), or None for no romaniser")):
        if value is not None and not callable(value):
            raise _options.ConfigError(
                f"training-patches: register_language({key!r}) got {arg}={value!r}, which is "
                f"not callable. Expected {expected}.")
    if char_limit is not None and (isinstance(char_limit, bool) or
                                   not isinstance(char_limit, int) or char_limit < 1):
        raise _options.ConfigError(
            f"training-patches: register_language({key!r}) got char_limit={char_limit!r}. "
            f"Expected a whole number of characters of at least 1 (coqui uses 250 for English, "
            f"150 for Hindi).")
    with _lock:
        known = _languages.get(key)
        if (romanize is not None and cleaner is None and char_limit is None and not alias_keys
                and (known is not None or key in COQUI_LANGUAGES)):
            had = _romanizers.get(key)
            if had is not None and not replace:
                raise _options.ConfigError(
                    f"training-patches: the language {key!r} already has a romaniser "
                    f"({had.label}). Pass replace=True to register_language to use yours "
                    f"instead.")
            _romanizers.pop(key, None)
            _romanizers[key] = Romanizer(key, romanize, name=name or (known.name if known else ""))
            if known is None:  # coqui's language: its cleaner stays coqui's
                language = Language(key, None, None, name, (), romanize)
            else:
                language = _languages[key] = dataclasses.replace(known, romanize=romanize)
            info("training-patches: romaniser of language %r registered (%s cleaner and char "
                 "limit kept)", key, "coqui-tts's" if known is None else "its")
            return language
        if not replace and (known is not None or key in COQUI_LANGUAGES):
            where = "already registered" if known is not None else "built into coqui-tts"
            raise _options.ConfigError(
                f"training-patches: the language {key!r} is {where}. Pass replace=True to "
                f"register_language to use your cleaner and limit instead, or pass romanize= "
                f"alone to add a romaniser and keep its cleaner and limit.")
        language = Language(key, cleaner or plain_cleaner,
                            DEFAULT_CHAR_LIMIT if char_limit is None else char_limit, name,
                            alias_keys, romanize)
        _languages[key] = language
        _romanizers.pop(key, None)
        if romanize is not None:
            _romanizers[key] = Romanizer(key, romanize, name=name)
    info("training-patches: language %r registered (char limit %d)", key, language.char_limit)
    return language


def unregister_language(code: str) -> bool:
    """Forget a registered language (and its romaniser, or a romaniser added to a language
    coqui-tts knows); False if neither was registered."""
    key = base_code(code)
    with _lock:
        language = _languages.pop(key, None)
        romanizer = _romanizers.pop(key, None)
    return language is not None or romanizer is not None


def get_language(code: str) -> Language | None:
    """The registered language for ``code`` or one of its aliases (region ignored), or None."""
    key = base_code(code)
    return _languages.get(key) or next(
        (lang for lang in _languages.values() if key in lang.aliases), None)


def registered_languages() -> dict[str, Language]:
    """Code -> :class:`Language` for every registered language."""
    return dict(_languages)


def romanizers() -> list[Romanizer]:
    """Every romaniser in the order :func:`romanize` asks them: the users' (in the order they
    were registered), then the library's own tables."""
    found = list(_romanizers.values())
    return [r for r in found if not r.builtin] + [r for r in found if r.builtin]


class Speller:
    """:func:`romanize` over many texts, recording what each romaniser did: ``asked``
    (romaniser -> texts it was asked), ``failed`` (-> texts on which it raised or returned
    something other than a string or None) and ``first_error`` (-> the first of those, said)."""

    def __init__(self) -> None:
        self.order = romanizers()
        self.asked: dict[Romanizer, int] = {}
        self.failed: dict[Romanizer, int] = {}
        self.first_error: dict[Romanizer, str] = {}

    def __call__(self, text: str) -> tuple[str, Romanizer] | None:
        """(the spelling, the romaniser that gave it) from the first that spells ``text``."""
        for romanizer in self.order:
            self.asked[romanizer] = self.asked.get(romanizer, 0) + 1
            try:
                spelled = romanizer.spell(text)
            except Exception as exc:  # a user's function: its failure is a fallback, counted
                self._fail(romanizer, f"{type(exc).__name__}: {exc} on {text!r}")
                continue
            if spelled is not None and not isinstance(spelled, str):
                self._fail(romanizer, f"it returned a {type(spelled).__name__} for {text!r}")
                continue
            if spelled and spelled.strip():
                return spelled.strip(), romanizer
        return None

    def _fail(self, romanizer: Romanizer, why: str) -> None:
        self.failed[romanizer] = self.failed.get(romanizer, 0) + 1
        self.first_error.setdefault(romanizer, why)


def romanize(text: str) -> tuple[str, str] | None:
    """``(romanised text, language code)`` from the first romaniser (:func:`romanizers`'s
    order) that spells ``text``, or None when none does. A romaniser that raises or returns
    something other than a non-empty string counts as "cannot spell it"."""
    found = Speller()(text)
    return None if found is None else (found[0], found[1].code)


# Amharic ships registered; the registration is only an entry in the tables above.
_languages["am"] = Language("am", _amharic_cleaner, amharic.CHAR_LIMIT, "Amharic", ("amh",),
                            amharic.romanize)
_romanizers["am"] = Romanizer("am", amharic.romanize, builtin=True, name="Amharic")


SPEC = register(PatchSpec(
    name="languages",
    describe=lambda o: (f"registered languages ({', '.join(sorted(_languages)) or 'none'}) are "
                        f"accepted by the tokenizers of the integrations"),
    options=(Option("amharic_homophones", flag, False, "1 or 0",
                    "1: fold Amharic homophone letters (ሐ ኀ -> ሀ, ...)"),),
))
