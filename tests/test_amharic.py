"""The Amharic normaliser: what the XTTS tokenizer is given to speak (pure Python)."""

from __future__ import annotations

import unicodedata

import pytest

from patches.languages import amharic, get_language, register_language, unregister_language
from patches.languages.amharic import ethiopic_to_int, normalize, number_to_words, ordinal_to_words
from patches.advanced import ConfigError


@pytest.mark.parametrize("number, words", [
    (0, "ዜሮ"), (1, "አንድ"), (2, "ሁለት"), (3, "ሶስት"), (4, "አራት"), (5, "አምስት"), (6, "ስድስት"),
    (7, "ሰባት"), (8, "ስምንት"), (9, "ዘጠኝ"), (10, "አስር"), (11, "አስራ አንድ"), (19, "አስራ ዘጠኝ"),
    (20, "ሃያ"), (25, "ሃያ አምስት"), (30, "ሰላሳ"), (40, "አርባ"), (50, "ሃምሳ"), (60, "ስልሳ"),
    (70, "ሰባ"), (80, "ሰማንያ"), (90, "ዘጠና"), (99, "ዘጠና ዘጠኝ"), (100, "መቶ"),
    (125, "መቶ ሃያ አምስት"), (300, "ሶስት መቶ"), (1000, "አንድ ሺህ"), (2024, "ሁለት ሺህ ሃያ አራት"),
    (12345, "አስራ ሁለት ሺህ ሶስት መቶ አርባ አምስት"), (100000, "መቶ ሺህ"),
    (1000000, "አንድ ሚሊዮን"), (2500000, "ሁለት ሚሊዮን አምስት መቶ ሺህ"),
])
def test_number_words(number: int, words: str) -> None:
    assert number_to_words(number) == words


@pytest.mark.parametrize("number, words", [
    (1, "አንደኛ"), (2, "ሁለተኛ"), (3, "ሶስተኛ"), (9, "ዘጠነኛ"), (10, "አስረኛ"), (20, "ሃያኛ"),
    (21, "ሃያ አንደኛ"), (100, "መቶኛ"),
])
def test_ordinals(number: int, words: str) -> None:
    assert ordinal_to_words(number) == words


@pytest.mark.parametrize("numeral, value", [
    ("፩", 1), ("፱", 9), ("፲", 10), ("፲፪", 12), ("፺፱", 99), ("፻", 100), ("፻፳", 120),
    ("፪፻", 200), ("፲፻", 1000), ("፳፻፲፮", 2016), ("፼", 10000), ("፲፪፼፴፬፻፶፮", 123456),
    ("፻፼", 1000000), ("፪፻፼", 2000000), ("፼፼", 100000000),
])
def test_ethiopic_numerals(numeral: str, value: int) -> None:
    assert ethiopic_to_int(numeral) == value


@pytest.mark.parametrize("text, spoken", [
    # Ethiopic punctuation -> what the tokenizer and prosody know.
    ("ሰላም፣ እንዴት ነህ፧", "ሰላም, እንዴት ነህ?"),
    ("ዝናቡ ቆመ። ፀሐይ ወጣች፤ ልጆቹ ወጡ፥", "ዝናቡ ቆመ. ፀሐይ ወጣች; ልጆቹ ወጡ:"),
    ("እንዲህ አለ፦ «ና»", "እንዲህ አለ: ና"),
    ("ሰላም፡ለዓለም፡ሁሉ።", "ሰላም ለዓለም ሁሉ."),
    # Numbers, attached prefixes, years with their abbreviation, grouped digits, %, decimals.
    ("በ2016 ዓ.ም. ት/ቤቱ ተከፈተ።", "በሁለት ሺህ አስራ ስድስት ዓመተ ምሕረት ትምህርት ቤቱ ተከፈተ."),
    ("ዋጋው 1,250,000 ብር ነው።", "ዋጋው አንድ ሚሊዮን ሁለት መቶ ሃምሳ ሺህ ብር ነው."),
    ("ምርቱ 25% ጨመረ።", "ምርቱ ሃያ አምስት በመቶ ጨመረ."),
    ("3.5 ኪ.ግ ስኳር", "ሶስት ነጥብ አምስት ኪሎ ግራም ስኳር"),
    ("3ኛው ቀን", "ሶስተኛው ቀን"),
    ("በ፳፻፲፮ ዓ.ም", "በሁለት ሺህ አስራ ስድስት ዓመተ ምሕረት"),
    ("፲፪ ሰዎች መጡ", "አስራ ሁለት ሰዎች መጡ"),
    # Abbreviations.
    ("ወ/ሮ አልማዝ እና ዶ/ር አበበ አ.አ. ደረሱ።", "ወይዘሮ አልማዝ እና ዶክተር አበበ አዲስ አበባ ደረሱ."),
    ("ጠ/ሚ ንግግር አደረጉ።", "ጠቅላይ ሚኒስትር ንግግር አደረጉ."),
    # Dates: Ethiopian month names by default, Gregorian after እ.ኤ.አ.
    ("ስብሰባው 12/05/2016 ዓ.ም. ነው።", "ስብሰባው ጥር አስራ ሁለት ቀን ሁለት ሺህ አስራ ስድስት ዓመተ ምሕረት ነው."),
    ("እ.ኤ.አ. 12/05/2024 ተወለደ።", "እንደ አውሮፓውያን አቆጣጠር ሜይ አስራ ሁለት ቀን ሁለት ሺህ ሃያ አራት ተወለደ."),
    # Whitespace and invisible characters.
    ("  ሰላም\u200b   ዓለም \u00a0 ", "ሰላም ዓለም"),
])
def test_normalize_sentences(text: str, spoken: str) -> None:
    assert normalize(text) == spoken


def test_nfc() -> None:
    decomposed = unicodedata.normalize("NFD", "café ሰላም")
    assert normalize(decomposed) == unicodedata.normalize("NFC", "café ሰላም")


def test_homophones_are_optional_and_cover_every_order() -> None:
    text = "ሐበሻ ኀይል ሠላም ዐይን ፀሐይ ሑ ሒ ሓ ሔ ሕ ሖ ሡ ሢ ሣ ሤ ሥ ሦ ዑ ዒ ዓ ዔ ዕ ዖ ፁ ፂ ፃ ፄ ፅ ፆ"
    assert normalize(text) == text  # off by default: the vocabulary decides
    assert normalize(text, homophones=True) == (
        "ሀበሻ ሀይል ሰላም አይን ጸሀይ ሁ ሂ ሃ ሄ ህ ሆ ሱ ሲ ሳ ሴ ስ ሶ ኡ ኢ ኣ ኤ እ ኦ ጹ ጺ ጻ ጼ ጽ ጾ")


def test_amharic_is_registered_by_default() -> None:
    language = get_language("am-ET")
    assert language is not None and language.code == "am"
    assert language.char_limit == amharic.CHAR_LIMIT
    assert language.cleaner("በ2016 ዓ.ም።") == "በሁለት ሺህ አስራ ስድስት ዓመተ ምሕረት."


def test_register_language_rejects_bad_input_clearly() -> None:
    with pytest.raises(ConfigError, match="2- or 3-letter"):
        register_language("amharic!")
    with pytest.raises(ConfigError, match="not callable"):
        register_language("ti", cleaner="upper")
    with pytest.raises(ConfigError, match="char_limit"):
        register_language("ti", char_limit=0)
    with pytest.raises(ConfigError, match="already registered.*replace=True"):
        register_language("am")
    with pytest.raises(ConfigError, match="built into coqui"):
        register_language("en")
    try:
        language = register_language("ti", char_limit=120)
        assert language.cleaner("  ሰላም   ALL ") == "ሰላም all"
    finally:
        unregister_language("ti")
