"""A coqui manifest read as coqui's ``coqui`` formatter reads it, or one paragraph
saying why it cannot be (:class:`ManifestError`)."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass


class ManifestError(ValueError):
    """The manifest cannot be checked at all (bad usage): one paragraph for the user."""


@dataclass
class Row:
    """One manifest row: its line number, the line as written and its fields."""

    line_no: int
    raw: str
    fields: dict[str, str]
    audio_path: str  # resolved against the manifest's folder



def _usage(path: str, found: str, expected: str, todo: str) -> ManifestError:
    return ManifestError(f"training-patches check-data: {path}: {found} Expected {expected} "
                         f"{todo}")


_EXPECTED = ("a coqui manifest: UTF-8 text, a header line `audio_file|text|speaker_name` and "
             "one row per clip with the same columns separated by `|`.")


def read_data_manifest(path: str) -> tuple[list[str], list[Row]]:
    """The header and rows of a coqui manifest, or :class:`ManifestError` saying why not."""
    if not os.path.exists(path):
        raise _usage(path, "no such file.", "the path of " + _EXPECTED,
                     "Check the path.")
    if os.path.isdir(path):
        raise _usage(path, "this is a folder.", "the path of " + _EXPECTED,
                     "Give the manifest file inside it (e.g. metadata_train.csv).")
    with open(path, "rb") as handle:
        data = handle.read()
    if not data.strip():
        raise _usage(path, "the file is empty.", _EXPECTED,
                     "Write the header and at least one row.")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or _looks_utf16(data):
        raise _usage(path, "the file is UTF-16 text.", _EXPECTED,
                     f"Re-save it as UTF-8, e.g. `iconv -f UTF-16 -t UTF-8 {path} > "
                     f"{path}.utf8` and use that.")
    if b"\x00" in data[:8192]:
        raise _usage(path, "the file is binary (it holds NUL bytes), not a text manifest.",
                     _EXPECTED, "Pass the manifest (.csv/.txt), not an audio or archive file.")
    if data.startswith(b"\xef\xbb\xbf"):
        raise _usage(path, "the file starts with a UTF-8 byte-order mark, which coqui's "
                     "reader keeps in the first column's name (its `audio_file` column is "
                     "then not found).", _EXPECTED,
                     "Re-save it as UTF-8 without a BOM (e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' "
                     f"{path}`).")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _usage(path, f"the file is not UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                     f"{exc.start} cannot be decoded; Latin-1 or Windows-1252 text looks like "
                     f"this).", _EXPECTED, f"Re-save it as UTF-8, e.g. `iconv -f LATIN1 -t "
                     f"UTF-8 {path} > {path}.utf8` (use the encoding it was written in).") from None
    lines = text.splitlines(keepends=True)
    header_line = lines[0].rstrip("\r\n")
    header = header_line.split("|")
    if "|" not in header_line:
        names = {",": "comma", "\t": "tab", ";": "semicolon"}
        sep = next((s for s in names if s in header_line), None)
        found = (f"the header `{header_line[:120]}` is {names[sep]}-separated." if sep
                 else f"the first line `{header_line[:120]}` has no `|` separator.")
        raise _usage(path, found, _EXPECTED,
                     "Rewrite it with `|` between the columns (coqui's `coqui` formatter "
                     "reads `|` only) and a header line.")
    missing = [name for name in ("audio_file", "text") if name not in header]
    if missing:
        raise _usage(path, f"the header `{header_line[:120]}` lacks the column(s) "
                     f"{', '.join(missing)}.", _EXPECTED,
                     "Add the header line `audio_file|text|speaker_name` (or rename the "
                     "columns); coqui's formatter needs audio_file and text.")
    root = os.path.dirname(os.path.abspath(path))
    rows: list[Row] = []
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.rstrip("\r\n")
        if not stripped.strip():
            continue
        # csv with "|" as coqui's DictReader parses it (quotes included)
        try:
            values = next(csv.reader([stripped], delimiter="|"))
        except csv.Error as exc:  # e.g. a field over csv's 131072-character limit
            raise _usage(path, f"line {number} ({len(stripped):,} characters) cannot be read "
                         f"as a row: {exc}; coqui's formatter (csv) fails on it the same way.",
                         _EXPECTED, "Fix that line (a transcript is one clip's sentence; a "
                         "stray quote or a missing line break joins rows) or remove it.") from None
        fields = dict(zip(header, values))
        if len(values) != len(header):
            fields["_columns"] = str(len(values))
        audio = fields.get("audio_file", "")
        rows.append(Row(number, line, fields, os.path.join(root, audio)))
    if not rows:
        raise _usage(path, "the file has a header but no rows.", _EXPECTED,
                     "Add one row per clip.")
    return header, rows


def _looks_utf16(data: bytes) -> bool:
    """UTF-16 without a byte-order mark: one byte of each pair (nearly) always NUL."""
    head = data[:400]
    halves = (head[0::2], head[1::2])
    return any(a.count(0) > 0.9 * len(a) and b.count(0) < 0.1 * len(b)
               for a, b in (halves, halves[::-1]))
