"""Amharic (``am``) text normaliser for the XTTS tokenizer, and the library's romaniser.

:func:`normalize` turns a sentence into what should be *spoken*, in the marks the XTTS
tokenizer knows: dates, abbreviations, Ethiopic numerals and digits as Amharic words, Ethiopic
punctuation as ASCII, optionally homophone letters written one way. :func:`romanize` spells it
in Latin letters. The user's view: TRAINING_PATCHES_README.md, "Amharic normaliser".
"""

from __future__ import annotations

import functools
import re
import unicodedata
from types import SimpleNamespace

__all__ = ["normalize", "number_to_words", "ordinal_to_words", "ethiopic_to_int",
           "normalize_homophones", "romanize", "CHAR_LIMIT"]

# A syllable per character carries about two Latin letters: coqui uses 150 for Hindi,
# another abugida, and 250 for English.
CHAR_LIMIT = 150

_ONES = ["", "አንድ", "ሁለት", "ሶስት", "አራት", "አምስት", "ስድስት", "ሰባት", "ስምንት", "ዘጠኝ"]
_TENS = ["", "አስር", "ሃያ", "ሰላሳ", "አርባ", "ሃምሳ", "ስልሳ", "ሰባ", "ሰማንያ", "ዘጠና"]
# 11..19 are "አስራ" + the unit (አስራ አንድ), not "አስር" + the unit.
_TEEN_PREFIX = "አስራ"
_ZERO = "ዜሮ"
_HUNDRED = "መቶ"
_SCALES = [(10 ** 12, "ትሪሊዮን"), (10 ** 9, "ቢሊዮን"), (10 ** 6, "ሚሊዮን"), (1000, "ሺህ")]
_POINT = "ነጥብ"
_PERCENT = "በመቶ"
_MINUS = "ሲቀነስ"

_ETHIOPIC_MONTHS = ["መስከረም", "ጥቅምት", "ኅዳር", "ታኅሣሥ", "ጥር", "የካቲት", "መጋቢት",
                    "ሚያዝያ", "ግንቦት", "ሰኔ", "ሐምሌ", "ነሐሴ", "ጳጉሜ"]
_GREGORIAN_MONTHS = ["ጃንዩወሪ", "ፌብሩወሪ", "ማርች", "ኤፕሪል", "ሜይ", "ጁን", "ጁላይ",
                     "ኦገስት", "ሴፕቴምበር", "ኦክቶበር", "ኖቬምበር", "ዲሴምበር"]
_DAY = "ቀን"

# Longest first: "ጠ/ሚኒስትር" must win over "ጠ/ሚ".
_ABBREVIATIONS: list[tuple[str, str]] = sorted([
    ("ዓ.ም.", "ዓመተ ምሕረት"), ("ዓ.ም", "ዓመተ ምሕረት"), ("ዓ/ም", "ዓመተ ምሕረት"),
    ("ዓ.ዓ.", "ዓመተ ዓለም"), ("ዓ.ዓ", "ዓመተ ዓለም"),
    ("እ.ኤ.አ.", "እንደ አውሮፓውያን አቆጣጠር"), ("እ.ኤ.አ", "እንደ አውሮፓውያን አቆጣጠር"),
    ("ት/ቤት", "ትምህርት ቤት"), ("ት/ቤቶች", "ትምህርት ቤቶች"),
    ("ም/ቤት", "ምክር ቤት"), ("መ/ቤት", "መሥሪያ ቤት"), ("ቤ/ክ", "ቤተ ክርስቲያን"),
    ("ቤ/ክርስቲያን", "ቤተ ክርስቲያን"), ("ክ/ከተማ", "ክፍለ ከተማ"), ("ክ/ሀገር", "ክፍለ ሀገር"),
    ("ወ/ሮ", "ወይዘሮ"), ("ወ/ሪት", "ወይዘሪት"), ("ወ/ት", "ወይዘሪት"), ("ዶ/ር", "ዶክተር"),
    ("ፕ/ር", "ፕሮፌሰር"), ("ኢ/ር", "ኢንጂነር"), ("ጠ/ሚ", "ጠቅላይ ሚኒስትር"),
    ("ጠ/ሚኒስትር", "ጠቅላይ ሚኒስትር"), ("ም/ጠ/ሚ", "ምክትል ጠቅላይ ሚኒስትር"),
    ("ም/ል", "ምክትል"), ("ሆ/ል", "ሆስፒታል"), ("አ.አ.", "አዲስ አበባ"), ("አ.አ", "አዲስ አበባ"),
    ("ኪ.ሜ.", "ኪሎ ሜትር"), ("ኪ.ሜ", "ኪሎ ሜትር"), ("ሴ.ሜ.", "ሴንቲ ሜትር"), ("ሴ.ሜ", "ሴንቲ ሜትር"),
    ("ኪ.ግ.", "ኪሎ ግራም"), ("ኪ.ግ", "ኪሎ ግራም"), ("ሚ.ሜ", "ሚሊ ሜትር"),
], key=lambda pair: -len(pair[0]))

_ETHIOPIC_LETTER = "\u1200-\u135A"
_ABBREVIATION_MAP = dict(_ABBREVIATIONS)
# "X/ቤ..." with a suffix ("ት/ቤቱ", the school): the "X/" part expands, the word stays.
_PREFIX_ABBREVIATIONS = {"ት/ቤ": "ትምህርት ቤ", "ም/ቤ": "ምክር ቤ", "መ/ቤ": "መሥሪያ ቤ"}

_PUNCTUATION = {
    "\u1362": ".",   # ። full stop
    "\u1363": ",",   # ፣ comma
    "\u1364": ";",   # ፤ semicolon
    "\u1365": ":",   # ፥ colon
    "\u1366": ":",   # ፦ preface colon (introduces speech or a list)
    "\u1367": "?",   # ፧ question mark
    "\u1368": ".",   # ፨ paragraph separator: a full pause
    "\u1361": " ",   # ፡ word separator (old texts put it between every word)
    "\u1360": " ",   # ፠ section mark: not spoken
    "\u00a0": " ", "\u202f": " ",
    "«": "", "»": "", "“": "", "”": "", "„": "", '"': "", "‹": "", "›": "",
}

# Ethiopic numerals: ፩..፱ (U+1369..1371) are 1..9, ፲..፺ (U+1372..137A) 10..90,
# ፻ (U+137B) is 100, ፼ (U+137C) is 10 000.
_ETHIOPIC_DIGITS = {**{chr(0x1369 + i): i + 1 for i in range(9)},
                    **{chr(0x1372 + i): 10 * (i + 1) for i in range(9)}}
_ETHIOPIC_HUNDRED = "\u137b"
_ETHIOPIC_MYRIAD = "\u137c"


@functools.lru_cache(maxsize=None)
def _patterns() -> SimpleNamespace:
    """The normaliser's regular expressions, compiled at its first use, not at
    ``import patches.auto`` (about 1 ms, issue 41)."""
    return SimpleNamespace(
        abbreviation=re.compile(
            f"(?<![{_ETHIOPIC_LETTER}])("
            + "|".join(re.escape(short) for short, _ in _ABBREVIATIONS)
            + f")(?![{_ETHIOPIC_LETTER}])"),
        prefix_abbreviation=re.compile(
            f"(?<![{_ETHIOPIC_LETTER}])(" + "|".join(map(re.escape, _PREFIX_ABBREVIATIONS))
            + ")"),
        zero_width=re.compile("[\u200b\u200c\u200d\u2060\ufeff]"),
        ethiopic_numeral=re.compile("[\u1369-\u137c]+"),
        date=re.compile(
            r"(?<![\d.])(?P<gregorian>እ\.ኤ\.አ\.?\s*)?(?P<day>\d{1,2})(?P<sep>[/.\-])"
            r"(?P<month>\d{1,2})(?P=sep)(?P<year>\d{4})(?![\d])"),
        ordinal_suffix=re.compile(r"(\d+)\s?(ኛ)(ው|ዋ|ውን|ዋን)?"),
        grouped=re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])"),
        decimal=re.compile(r"(?<![\d])(\d+)\.(\d+)(?![\d])"),
        percent=re.compile(r"(\d+(?:\.\d+)?)\s?%"),
        negative=re.compile(r"(?<![\w\d])-(?=\d)"),
        number=re.compile(r"\d+"),
        spaces=re.compile(r"\s+"),
    )


def _below_thousand(n: int) -> list[str]:
    words: list[str] = []
    hundreds, rest = divmod(n, 100)
    if hundreds:
        # "መቶ" alone is one hundred; "ሁለት መቶ", "ዘጠኝ መቶ" for the others.
        words += ([_ONES[hundreds]] if hundreds > 1 else []) + [_HUNDRED]
    tens, ones = divmod(rest, 10)
    if tens == 1 and ones:
        return words + [_TEEN_PREFIX, _ONES[ones]]
    return words + [word for word in (_TENS[tens], _ONES[ones]) if word]  # 0 is ""


def number_to_words(n: int) -> str:
    """A whole number in Amharic words: 25 -> ሃያ አምስት, 2024 -> ሁለት ሺህ ሃያ አራት."""
    if n < 0:
        return f"{_MINUS} {number_to_words(-n)}"
    if n == 0:
        return _ZERO
    words: list[str] = []
    for scale, name in _SCALES:
        count, n = divmod(n, scale)
        if count:
            words += _below_thousand(count) if count < 1000 else number_to_words(count).split()
            words.append(name)
    words += _below_thousand(n)
    return " ".join(words)


def ordinal_to_words(n: int) -> str:
    """An ordinal in Amharic: 1 -> አንደኛ, 3 -> ሶስተኛ, 9 -> ዘጠነኛ, 20 -> ሃያኛ.

    The suffix ``ኛ`` follows the last word; a final consonant (the sixth order of
    its letter, ``ት`` ``ድ`` ``ኝ`` ``ር`` ...) takes its first-order vowel: ሁለት -> ሁለተኛ.
    """
    words = number_to_words(n).split()
    last = words[-1]
    final = last[-1]
    if final == "ህ":  # ሺህ -> ሺኛ: the silent ህ is dropped
        last = last[:-1]
    elif final == "ኝ":  # ዘጠኝ -> ዘጠነኛ: the palatal ኝ is spoken ነ before ኛ
        last = last[:-1] + "ነ"
    elif 0x1200 <= ord(final) <= 0x135A and (ord(final) - 0x1200) % 8 == 5:
        last = last[:-1] + chr(ord(final) - 5)
    words[-1] = last + "ኛ"
    return " ".join(words)


def ethiopic_to_int(numeral: str) -> int:
    """The value of an Ethiopic numeral: ፳፻፲፮ -> 2016, ፲፪፼፴፬፻፶፮ -> 123456.

    Ones and tens add up to a number below 100; ``፻`` multiplies what precedes it in
    its group by 100 (alone it is 100); ``፼`` multiplies everything before it by
    10 000 (alone it is 10 000; ``፻፼`` is a million, ``፼፼`` a hundred million).
    """
    total = group = current = 0
    for char in numeral:
        if char in _ETHIOPIC_DIGITS:
            current += _ETHIOPIC_DIGITS[char]
        elif char == _ETHIOPIC_HUNDRED:
            group = (group + (current or 1)) * 100
            current = 0
        elif char == _ETHIOPIC_MYRIAD:
            before = total + group + current
            total = (before or 1) * 10000
            group = current = 0
        else:
            raise ValueError(f"{char!r} is not an Ethiopic numeral")
    return total + group + current


# Each Ethiopic consonant has its seven vowel orders (and often a labialised eighth) at
# consecutive code points, so a whole series maps by offset.
_HOMOPHONES = {start + i: target + i for start, target, count in (
    (0x1210, 0x1200, 7),  # ሐ..ሖ -> ሀ..ሆ
    (0x1280, 0x1200, 8),  # ኀ..ኇ -> ሀ..ሇ
    (0x1220, 0x1230, 8),  # ሠ..ሧ -> ሰ..ሷ
    (0x12D0, 0x12A0, 7),  # ዐ..ዖ -> አ..ኦ
    (0x1340, 0x1338, 8),  # ፀ..ፇ -> ጸ..ጿ
) for i in range(count)} | {0x1217: 0x128B}  # ሗ (hʷa) -> ኋ, the usual spelling of that sound


def normalize_homophones(text: str) -> str:
    """Write letters that sound alike one way: ሐ ኀ -> ሀ, ሠ -> ሰ, ዐ -> አ, ፀ -> ጸ (all orders)."""
    return text.translate(_HOMOPHONES)


def _expand_date(match: re.Match[str]) -> str:
    day, month, year = int(match["day"]), int(match["month"]), int(match["year"])
    gregorian = bool(match["gregorian"])
    months = _GREGORIAN_MONTHS if gregorian else _ETHIOPIC_MONTHS
    if not (1 <= day <= 31 and 1 <= month <= len(months)):
        return match.group(0)  # not a date we can read; the numbers are read one by one
    prefix = _ABBREVIATION_MAP["እ.ኤ.አ."] + " " if gregorian else ""
    return f"{prefix}{months[month - 1]} {number_to_words(day)} {_DAY} {number_to_words(year)}"


def _expand_numbers(text: str) -> str:
    # Ethiopic numerals become digits first, so "፫ኛ" and "፳፭%" read like "3ኛ" and "25%".
    found = _patterns()
    text = found.ethiopic_numeral.sub(lambda m: str(ethiopic_to_int(m[0])), text)
    text = found.grouped.sub(lambda m: m[0].replace(",", ""), text)
    text = found.percent.sub(lambda m: f"{m[1]} {_PERCENT}", text)
    text = found.ordinal_suffix.sub(lambda m: ordinal_to_words(int(m[1])) + (m[3] or ""), text)
    text = found.decimal.sub(
        lambda m: f"{number_to_words(int(m[1]))} {_POINT} "
                  + " ".join(_ONES[int(d)] if d != "0" else _ZERO for d in m[2]), text)
    text = found.negative.sub(_MINUS + " ", text)
    return found.number.sub(lambda m: number_to_words(int(m[0])), text)


def normalize(text: str, *, homophones: bool = False) -> str:
    """Amharic text as it should be spoken, in the characters XTTS reads (see module doc)."""
    found = _patterns()
    text = unicodedata.normalize("NFC", str(text))
    text = found.zero_width.sub("", text)
    text = found.date.sub(_expand_date, text)
    text = found.abbreviation.sub(lambda m: _ABBREVIATION_MAP[m[1]], text)
    text = found.prefix_abbreviation.sub(lambda m: _PREFIX_ABBREVIATIONS[m[1]], text)
    text = _expand_numbers(text)
    text = "".join(_PUNCTUATION.get(char, char) for char in text)
    if homophones:
        text = normalize_homophones(text)
    text = found.spaces.sub(" ", text.lower()).strip()
    # A mark left after a space ("ሰላም ." after a removed quote) belongs to the word.
    return re.sub(r" ([.,;:?!])", r"\1", text)


# -- romanisation -------------------------------------------------------------------------
# The library's own table for patches.row_init: each syllable spelled as an English reader
# would say it, from the Ethiopic block's layout (a consonant series every 8 code points) and
# SERA's vowels, its consonants respelled for English (ቀ q -> k, ሸ x -> sh, ጠ ejective -> t).

# First code point of a series -> its consonant.
_ONSETS = {
    0x1200: "h", 0x1208: "l", 0x1210: "h", 0x1218: "m", 0x1220: "s", 0x1228: "r", 0x1230: "s",
    0x1238: "sh", 0x1240: "k", 0x1250: "kh", 0x1260: "b", 0x1268: "v", 0x1270: "t",
    0x1278: "ch", 0x1280: "h", 0x1290: "n", 0x1298: "ny", 0x12A0: "", 0x12A8: "k", 0x12B8: "h",
    0x12C8: "w", 0x12D0: "", 0x12D8: "z", 0x12E0: "zh", 0x12E8: "y", 0x12F0: "d", 0x12F8: "d",
    0x1300: "j", 0x1308: "g", 0x1318: "ng", 0x1320: "t", 0x1328: "ch", 0x1330: "p",
    0x1338: "ts", 0x1340: "ts", 0x1348: "f", 0x1350: "p",
}
# Labialised series (ቈ ቊ ቋ ቌ ቍ): orders 1, 3, 4, 5, 6 only.
_LABIALISED = {0x1248: "kw", 0x1258: "khw", 0x1288: "hw", 0x12B0: "kw", 0x12C0: "hw",
               0x1310: "gw"}
# The eight orders: ä, u, i, a, ē, (bare / ɨ), o, wa.
_ORDERS = ("e", "u", "i", "a", "e", "", "o", "wa")
# A series with no consonant (አ, ዐ) is the vowel itself; its sixth order is ɨ.
_VOWEL_SERIES = ("a", "u", "i", "a", "e", "i", "o", "wa")
_LABIALISED_ORDERS = ("e", None, "i", "a", "e", "", None, None)
_OTHER = {"\u1358": "rya", "\u1359": "mya", "\u135A": "fya"}


def _syllable(char: str) -> str | None:
    code = ord(char)
    if char in _OTHER:
        return _OTHER[char]
    base, order = code - (code - 0x1200) % 8, (code - 0x1200) % 8
    if base in _ONSETS:
        onset = _ONSETS[base]
        return (_VOWEL_SERIES if onset == "" else tuple(onset + v for v in _ORDERS))[order]
    if base in _LABIALISED and _LABIALISED_ORDERS[order] is not None:
        return _LABIALISED[base] + _LABIALISED_ORDERS[order]
    return None


def romanize(text: str) -> str | None:
    """``text`` in Latin letters as an English reader would say it (``ሰላም`` -> ``selam``,
    ``ኢትዮጵያ`` -> ``ityopya``): Ethiopic syllables by the table above, Latin letters and
    digits lower-cased as they are, spaces kept, anything else (punctuation, Ethiopic
    numerals, marks) left out. None when ``text`` holds no Ethiopic syllable: it is not
    Amharic, and another language's romaniser may know it."""
    out, found = [], False
    for char in unicodedata.normalize("NFC", text):
        if "\u1200" <= char <= "\u135A":
            spelled = _syllable(char)
            if spelled is not None:
                out.append(spelled)
                found = True
        elif char.isascii() and char.isalnum():
            out.append(char.lower())
        elif char.isspace():
            out.append(" ")
    return " ".join("".join(out).split()) if found else None
