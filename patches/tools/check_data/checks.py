"""``training-patches check-data MANIFEST``: what in a coqui dataset will hurt a fine-tune.

Most failed new-language fine-tunes are decided before the first step: clipped or silent
audio, transcripts in the wrong script or for another clip, a tokenizer that maps the
language to ``[UNK]``, too little speech. This reads a coqui manifest
(``audio_file|text|speaker_name`` with a header, audio paths relative to the manifest's
folder, read as coqui's ``coqui`` formatter reads it) and checks every row:

- audio: missing, unreadable or undecodable files (soundfile decodes; what it cannot read
  goes to torchcodec, the decoder coqui-tts uses, when installed), sample rate, channels;
- duration against the XTTS dataset's limits (coqui-tts 0.28 ``GPTArgs`` defaults:
  ``max_wav_length`` 255995 samples at 22050 Hz = 11.61 s; clips under 0.5 s are dropped;
  under ``min_conditioning_length`` 66150 samples = 3 s the conditioning slice is half the clip);
- signal, on 20 ms frames of the mono mix (see :func:`signal_stats`): clipping ratio,
  silence ratio and an SNR estimate;
- text, after the language's registered cleaner (what the trainer sees): the share of letters
  in the language's script (Ethiopic for ``am``), the letters outside it, the length against
  the language's character limit and, with ``--tokenizer``, the tokens that encode to
  ``[UNK]`` and the token count against ``max_text_length`` (200);
- speakers, minutes per speaker, total speech;
- speaking rate: Ethiopic letters are syllables, so syllables per second of voiced audio far
  from the speaker's median flag a transcript that does not belong to its audio (other
  scripts: letters per second).

A row with an *error* is left out of ``--clean-manifest``; *warnings* are reported and kept.
Exit status: 0 clean, 1 errors found, 2 bad usage (one paragraph on stderr), 130/143
interrupted by Ctrl-C/SIGTERM (the decoding workers ended with it, within seconds).
Decoding runs in a process pool (``--workers``, default all cores).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

# -- limits: coqui-tts 0.28 XTTS GPTArgs defaults ------------------------------------------

XTTS_SAMPLE_RATE = 22050
MAX_WAV_LENGTH = 255995          # samples at 22050 Hz (GPTArgs.max_wav_length)
MIN_CONDITIONING_LENGTH = 66150  # GPTArgs.min_conditioning_length (3 s)
MAX_CONDITIONING_LENGTH = 132300  # GPTArgs.max_conditioning_length (6 s)
MAX_TEXT_LENGTH = 200            # tokens, the [lang] token included (GPTArgs.max_text_length)
MIN_SECONDS = 0.5                # XTTSDataset drops shorter clips

# -- signal thresholds (documented in signal_stats) --------------------------------------

FRAME_SECONDS = 0.020
FULL_SCALE = 0.999        # |x| at or above this (of 1.0) counts as a clipped sample
MAX_CLIPPING = 0.001      # error: more than 0.1 % of the samples clipped
SILENCE_DBFS = -50.0      # a frame quieter than this (RMS) is silence
MAX_SILENCE = 0.95        # error: 95 % of the frames or more are silence
WARN_SILENCE = 0.60       # warning: more than 60 % silence
MIN_SNR_DB = 10.0         # error: estimated SNR under 10 dB
WARN_SNR_DB = 20.0        # warning: under 20 dB
MIN_SCRIPT_SHARE = 0.5    # error: under half the letters in the language's script
RATE_TOLERANCE = 2.0      # error: rate more than 2x above or below the speaker's median ...
RATE_MIN_UNITS = 4        # ... and at least 4 syllables (letters) away from the expected count
MIN_RATE_ROWS = 3         # rows a speaker needs for its own median (else: all speakers')

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

REASONS: dict[str, tuple[str, str]] = {  # reason -> (what it means, what to do)
    "malformed_row": ("the row does not have the header's columns",
                      "fix the row: audio_file|text|speaker_name, separated by |"),
    "missing_file": ("the audio file does not exist", "fix the path (relative to the "
                     "manifest's folder) or remove the row"),
    "unreadable": ("the audio file cannot be opened", "check its permissions"),
    "decode_failure": ("the audio cannot be decoded", "re-encode it as 16-bit PCM WAV "
                       "(ffmpeg -i IN -ar 22050 -ac 1 OUT.wav)"),
    "too_short": ("shorter than 0.5 s: the XTTS dataset drops it", "remove it"),
    "too_long_audio": ("longer than max_wav_length: the XTTS dataset drops it",
                       "split the clip or raise max_wav_length (--max-audio-seconds)"),
    "clipped": ("more than 0.1 % of the samples are at full scale",
                "re-record or take the clip from a source before the clipping"),
    "silent": ("almost no frame is above -50 dBFS", "remove it or fix the recording"),
    "noisy": ("the estimated SNR is under the limit (--min-snr)",
              "denoise it or remove it"),
    "empty_text": ("the transcript is empty", "fill it in or remove the row"),
    "wrong_script": ("most letters are not in the language's script",
                     "check the transcript and --language"),
    "unknown_token": ("the tokenizer maps some characters to [UNK]",
                      "extend the tokenizer (training-patches extend-tokenizer)"),
    "too_long_text": ("more tokens than max_text_length: the XTTS dataset drops it",
                      "split the clip and its transcript"),
    "rate_mismatch": ("syllables (letters) per second far from the speaker's median: the "
                      "transcript may belong to another clip", "listen to the clip and fix "
                      "its transcript"),
    # warnings
    "low_sample_rate": ("sample rate under 22050 Hz: upsampled, no high frequencies", ""),
    "multichannel": ("more than one channel: mixed down to mono when loaded", ""),
    "short_conditioning": ("under 3 s (min_conditioning_length): its conditioning slice is "
                           "half the clip", ""),
    "much_silence": ("more than 60 % of the frames are silence", "trim the silence"),
    "low_snr": ("estimated SNR under 20 dB", ""),
    "foreign_letters": ("some letters are outside the language's script", ""),
    "over_char_limit": ("longer than the language's character limit (coqui warns and may "
                        "truncate the audio at inference)", "split long transcripts"),
}


PROG = "training-patches check-data"
JSON_FORMAT = 1  # of the --json report: raised when a key changes meaning or goes away
MAX_WORKERS = 1024  # --workers: beyond any machine's cores, a typo (a pool this big would
#                     fork until the machine runs out of processes)


class ManifestError(ValueError):
    """The manifest cannot be checked at all (bad usage): one paragraph for the user."""


@dataclass
class Row:
    """One manifest row: its line number, the line as written and its fields."""

    line_no: int
    raw: str
    fields: dict[str, str]
    audio_path: str  # resolved against the manifest's folder


@dataclass
class Clip:
    """What was found about one row."""

    row: Row
    audio: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)

    def error(self, reason: str, detail: str) -> None:
        self.errors.append({"reason": reason, "detail": detail})

    def warn(self, reason: str, detail: str) -> None:
        self.warnings.append({"reason": reason, "detail": detail})

    @property
    def speaker(self) -> str:
        return self.row.fields.get("speaker_name") or "coqui"

    def as_json(self) -> dict[str, Any]:
        return {"line": self.row.line_no, "audio_file": self.row.fields.get("audio_file"),
                "speaker": self.speaker, "text": self.row.fields.get("text"),
                **self.audio, **self.text, "errors": self.errors, "warnings": self.warnings}


# -- the manifest ------------------------------------------------------------------------

def _usage(path: str, found: str, expected: str, todo: str) -> ManifestError:
    return ManifestError(f"training-patches check-data: {path}: {found} Expected {expected} "
                         f"{todo}")


_EXPECTED = ("a coqui manifest: UTF-8 text, a header line `audio_file|text|speaker_name` and "
             "one row per clip with the same columns separated by `|`.")


def read_manifest(path: str) -> tuple[list[str], list[Row]]:
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


# -- audio (runs in the worker processes) ------------------------------------------------

def _decode(path: str) -> tuple[Any, int, str]:
    """(samples float32 [frames, channels], sample rate, decoder) of an audio file."""
    import numpy as np
    import soundfile as sf

    try:
        data, rate = sf.read(path, dtype="float32", always_2d=True)
        return data, int(rate), "soundfile"
    except sf.LibsndfileError as sf_error:
        try:
            from torchcodec.decoders import AudioDecoder
        except Exception:  # noqa: BLE001 - no fallback installed: soundfile's word stands
            raise sf_error from None
        try:
            samples = AudioDecoder(path).get_all_samples()
        except Exception as exc:  # noqa: BLE001 - report both decoders' reasons
            raise RuntimeError(f"soundfile: {sf_error}; torchcodec: {exc}") from None
        data = np.ascontiguousarray(samples.data.numpy().T, dtype=np.float32)
        return data, int(samples.sample_rate), "torchcodec"


def signal_stats(data: Any, rate: int) -> dict[str, Any]:
    """Clipping ratio, silence ratio and an SNR estimate of decoded audio.

    - clipping ratio: the share of samples (all channels) with ``|x| >= 0.999`` of full scale.
      Audio that was clipped and then scaled down is not seen; one peak-normalised sample is
      not counted as clipping by the 0.1 % limit.
    - silence ratio: the share of 20 ms frames of the mono mix whose RMS is under -50 dBFS.
    - SNR estimate (dB): the 95th percentile of the frames' RMS level minus their 10th
      percentile, i.e. speech level over the noise floor heard in the pauses. Speech has
      pauses, so the quiet frames are noise; a clip with no pause at all reads low. None
      for clips under 10 frames or with no frame above -50 dBFS.
    """
    import numpy as np

    mono = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    clipping = float(np.count_nonzero(np.abs(data) >= FULL_SCALE)) / max(data.size, 1)
    hop = max(int(rate * FRAME_SECONDS), 1)
    frames = len(mono) // hop
    if frames == 0:
        return {"clipping_ratio": round(clipping, 6), "silence_ratio": 1.0, "snr_db": None}
    framed = mono[: frames * hop].astype(np.float64).reshape(frames, hop)
    rms = np.sqrt(np.mean(framed * framed, axis=1))
    level = 20.0 * np.log10(np.maximum(rms, 1e-10))
    silence = float(np.count_nonzero(level < SILENCE_DBFS)) / frames
    snr = None
    if frames >= 10 and level.max() >= SILENCE_DBFS:
        snr = float(min(np.percentile(level, 95) - np.percentile(level, 10), 100.0))
    return {"clipping_ratio": round(clipping, 6), "silence_ratio": round(silence, 4),
            "snr_db": None if snr is None else round(snr, 1)}


def analyse_audio(path: str) -> dict[str, Any]:
    """What the audio checks need from one file; ``{"failure": (reason, detail)}`` if none.

    Runs in a worker process: only picklable values go back.
    """
    if not os.path.exists(path):
        return {"failure": ("missing_file", f"{path} does not exist")}
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        return {"failure": ("unreadable", f"{path} is not a readable file")}
    try:
        data, rate, decoder = _decode(path)
    except OSError as exc:
        return {"failure": ("unreadable", f"{type(exc).__name__}: {exc}")}
    except Exception as exc:  # noqa: BLE001 - any decoder error is this file's reason
        return {"failure": ("decode_failure", f"{type(exc).__name__}: {str(exc)[:300]}")}
    if data.shape[0] == 0 or rate <= 0:
        return {"failure": ("decode_failure", "the file holds no audio samples")}
    result = {"duration_s": round(data.shape[0] / rate, 3), "sample_rate": rate,
              "channels": int(data.shape[1]), "decoder": decoder}
    result.update(signal_stats(data, rate))
    return result


def _analyse_many(paths: Sequence[str], workers: int) -> Iterator[dict[str, Any]]:
    """:func:`analyse_audio` for each path, in order, over ``workers`` processes.

    The workers end with the generator: when it is closed early or an exception (a
    signal's :class:`~patches._output.Interrupted`) passes through it, they are terminated
    at once instead of finishing the queue, so nothing outlives the command holding its
    stdout."""
    if workers <= 1 or len(paths) < 2:
        yield from map(analyse_audio, paths)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # fork: the workers inherit the imported modules instead of importing torch again
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    chunk = max(1, min(16, len(paths) // (workers * 8)))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                               initializer=_worker_init)
    try:
        yield from pool.map(analyse_audio, paths, chunksize=chunk)
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)


def _worker_init() -> None:
    """In each worker: Ctrl-C is the command's to handle (the terminal sends it to the whole
    process group), SIGTERM kills, and (Linux) the worker gets SIGTERM if the command dies
    without ending it (SIGKILL)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc symbol: the parent still ends them
            pass


def _stop_workers(pool: Any) -> None:
    """Terminate a ProcessPoolExecutor's workers now (running and queued work dropped)."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


# -- text --------------------------------------------------------------------------------

def script_of(language: str) -> str | None:
    """The script name of a language code (``am`` -> ``Ethiopic``), or None if not known."""
    from ...languages import base_code, get_language

    code = base_code(language)
    registered = get_language(code)
    for candidate in ((registered.codes if registered else ()) + (code,)):
        if candidate in LANGUAGE_SCRIPTS:
            return LANGUAGE_SCRIPTS[candidate]
    return None


def in_script(char: str, script: str) -> bool:
    point = ord(char)
    return any(low <= point <= high for low, high in SCRIPTS[script])


def _is_letter(char: str) -> bool:
    return unicodedata.category(char)[0] in "LM"


class TextTokenizer:
    """An XTTS ``vocab.json`` (HF tokenizers) or a SentencePiece ``.model``, as the trainer
    encodes with it."""

    def __init__(self, path: str, language: str) -> None:
        self.path = path
        self.language = language
        self.missing_language_token = False
        if path.endswith(".model"):
            import sentencepiece as spm

            self.kind = "sentencepiece"
            self._sp = spm.SentencePieceProcessor(model_file=path)
            self.unk_id = self._sp.unk_id()
            self.size = self._sp.get_piece_size()
        else:
            from tokenizers import Tokenizer

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


def _cleaner(language: str) -> Callable[[str], str]:
    from ...languages import _plain_cleaner, get_language

    registered = get_language(language)
    return registered.cleaner if registered else _plain_cleaner


def _char_limit(language: str) -> int | None:
    from ...languages import get_language

    registered = get_language(language)
    return registered.char_limit if registered else None


def check_text(clip: Clip, clean: Callable[[str], str], script: str | None,
               char_limit: int | None, tokenizer: TextTokenizer | None,
               max_tokens: int) -> None:
    """Fill ``clip.text`` and its text errors and warnings."""
    raw = clip.row.fields.get("text", "")
    if not raw.strip():
        clip.error("empty_text", "the transcript is empty")
        return
    try:
        text = clean(raw)
    except Exception as exc:  # noqa: BLE001 - a cleaner failure is this row's problem
        clip.error("empty_text", f"the language's cleaner failed on it: {exc}")
        return
    letters = [char for char in text if _is_letter(char)]
    info: dict[str, Any] = {"chars": len(text)}
    clip.text = info
    if not letters:
        clip.error("empty_text", f"no letters after cleaning (cleaned text: {text[:60]!r})")
        return
    if script is not None:
        inside = [char for char in letters if in_script(char, script)]
        share = len(inside) / len(letters) if letters else 0.0
        outside = sorted(set(letters) - set(inside))
        info.update(script_share=round(share, 3), outside_script="".join(outside))
        info["units"] = len(inside)
        if share < MIN_SCRIPT_SHARE:
            clip.error("wrong_script", f"{100 * share:.0f}% of its {len(letters)} letters are "
                       f"{script}; letters outside it: {''.join(outside[:30])}")
        elif outside:
            clip.warn("foreign_letters", f"letters outside {script}: {''.join(outside[:30])}")
    else:
        info["units"] = len(letters)
    if char_limit is not None and len(text) > char_limit:
        clip.warn("over_char_limit", f"{len(text)} characters, the language's limit is "
                  f"{char_limit}")
    if tokenizer is not None:
        ids = tokenizer.encode(text)
        info["tokens"] = len(ids)
        if tokenizer.unk_id is not None and tokenizer.unk_id in ids:
            chars = tokenizer.unknown_characters(text)
            info["unknown_chars"] = "".join(chars)
            clip.error("unknown_token", f"{ids.count(tokenizer.unk_id)} [UNK] token(s); "
                       f"characters not in the vocabulary: "
                       f"{' '.join(repr(c) for c in chars) or '(not found one by one)'}")
        if len(ids) > max_tokens:
            clip.error("too_long_text", f"{len(ids)} tokens, max_text_length allows "
                       f"{max_tokens}")


# -- audio verdicts ----------------------------------------------------------------------

def check_audio(clip: Clip, stats: dict[str, Any], max_seconds: float, min_snr: float) -> None:
    """Fill ``clip.audio`` and its audio errors and warnings from :func:`analyse_audio`."""
    if "failure" in stats:
        reason, detail = stats["failure"]
        clip.error(reason, detail)
        return
    clip.audio = stats
    seconds = stats["duration_s"]
    if seconds < MIN_SECONDS:
        clip.error("too_short", f"{seconds:.2f} s of audio, at least {MIN_SECONDS} s needed")
    elif seconds > max_seconds:
        clip.error("too_long_audio", f"{seconds:.2f} s of audio, max_wav_length allows "
                   f"{max_seconds:.2f} s")
    elif seconds < MIN_CONDITIONING_LENGTH / XTTS_SAMPLE_RATE:
        clip.warn("short_conditioning", f"{seconds:.2f} s: conditioning slice of "
                  f"{seconds / 2:.2f} s instead of 3-6 s")
    if stats["sample_rate"] < XTTS_SAMPLE_RATE:
        clip.warn("low_sample_rate", f"{stats['sample_rate']} Hz, XTTS trains at "
                  f"{XTTS_SAMPLE_RATE} Hz")
    if stats["channels"] > 1:
        clip.warn("multichannel", f"{stats['channels']} channels")
    if stats["clipping_ratio"] > MAX_CLIPPING:
        clip.error("clipped", f"{100 * stats['clipping_ratio']:.2f}% of the samples at full "
                   f"scale (limit {100 * MAX_CLIPPING:.1f}%)")
    if stats["silence_ratio"] >= MAX_SILENCE:
        clip.error("silent", f"{100 * stats['silence_ratio']:.0f}% of the 20 ms frames under "
                   f"{SILENCE_DBFS:.0f} dBFS")
    elif stats["silence_ratio"] > WARN_SILENCE:
        clip.warn("much_silence", f"{100 * stats['silence_ratio']:.0f}% of the frames silent")
    snr = stats["snr_db"]
    if snr is not None and stats["silence_ratio"] < MAX_SILENCE:
        if snr < min_snr:
            clip.error("noisy", f"estimated SNR {snr:.1f} dB, at least {min_snr:.0f} dB "
                       f"needed")
        elif snr < WARN_SNR_DB:
            clip.warn("low_snr", f"estimated SNR {snr:.1f} dB")


def voiced_seconds(clip: Clip) -> float:
    """Seconds of audio that are not silence (the time the transcript is spoken in)."""
    return clip.audio["duration_s"] * (1.0 - clip.audio["silence_ratio"])


def check_rates(clips: Sequence[Clip], unit: str, tolerance: float) -> dict[str, float]:
    """Flag speaking-rate outliers among the clips without other errors; returns the
    median rate per speaker (``*`` for all speakers)."""
    rated = [c for c in clips if not c.errors and c.text.get("units")
             and voiced_seconds(c) > 0.1]
    for clip in rated:
        clip.text["rate"] = round(clip.text["units"] / voiced_seconds(clip), 2)
    medians: dict[str, float] = {}
    if rated:
        medians["*"] = statistics.median(c.text["rate"] for c in rated)
    by_speaker: dict[str, list[Clip]] = {}
    for clip in rated:
        by_speaker.setdefault(clip.speaker, []).append(clip)
    for speaker, group in by_speaker.items():
        if len(group) >= MIN_RATE_ROWS:
            medians[speaker] = statistics.median(c.text["rate"] for c in group)
    for clip in rated:
        median = medians.get(clip.speaker, medians["*"])
        ratio = clip.text["rate"] / median
        expected = median * voiced_seconds(clip)
        if (ratio > tolerance or ratio < 1 / tolerance) and \
                abs(clip.text["units"] - expected) >= RATE_MIN_UNITS:
            clip.error("rate_mismatch", f"{clip.text['units']} {unit} in "
                       f"{voiced_seconds(clip):.2f} s of voiced audio = {clip.text['rate']:.1f}"
                       f"/s; the speaker's median is {median:.1f}/s (about "
                       f"{expected:.0f} {unit} expected)")
    return {k: round(v, 2) for k, v in medians.items()}


# -- the whole check ---------------------------------------------------------------------

@dataclass
class Options:
    """The knobs of :func:`check_manifest` (the CLI's options)."""

    language: str = "am"
    tokenizer: str | None = None
    workers: int = 1
    max_audio_seconds: float = MAX_WAV_LENGTH / XTTS_SAMPLE_RATE
    max_text_tokens: int = MAX_TEXT_LENGTH
    min_snr: float = MIN_SNR_DB
    rate_tolerance: float = RATE_TOLERANCE
    progress: bool | None = None  # None: a bar when stderr is a terminal


def _load_tokenizer(path: str | None, language: str) -> TextTokenizer | None:
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


def check_manifest(path: str, options: Options,
                   manifest: tuple[list[str], list[Row]] | None = None
                   ) -> tuple[dict[str, Any], list[Clip]]:
    """Check every row of a manifest; returns the JSON report and the clips.

    ``manifest``: what :func:`read_manifest` returned for ``path``, if already read.
    :class:`ManifestError` when the manifest itself cannot be read.
    """
    from tqdm import tqdm

    header, rows = manifest if manifest is not None else read_manifest(path)
    tokenizer = _load_tokenizer(options.tokenizer, options.language)  # fails before decoding
    clips = [Clip(row) for row in rows]
    paths = [row.audio_path for row in rows]
    bar = tqdm(total=len(paths), unit="clip", desc="check-data", disable=(
        None if options.progress is None else not options.progress), file=sys.stderr)
    results = _analyse_many(paths, options.workers)
    try:
        with bar:
            for clip, stats in zip(clips, results):
                if "_columns" in clip.row.fields:
                    clip.error("malformed_row", f"{clip.row.fields['_columns']} columns, the "
                               f"header has {len(header)}")
                check_audio(clip, stats, options.max_audio_seconds, options.min_snr)
                bar.update(1)
    finally:
        results.close()  # a signal between two clips: the workers end here
    script = script_of(options.language)
    clean, limit = _cleaner(options.language), _char_limit(options.language)
    for clip in clips:
        check_text(clip, clean, script, limit, tokenizer, options.max_text_tokens)
    unit = "syllables" if script == "Ethiopic" else "letters"
    medians = check_rates(clips, unit, options.rate_tolerance)
    return _report(path, options, clips, script, unit, medians, tokenizer), clips


def _report(path: str, options: Options, clips: Sequence[Clip], script: str | None,
            unit: str, medians: dict[str, float], tokenizer: TextTokenizer | None
            ) -> dict[str, Any]:
    problems: list[str] = []
    if tokenizer is not None and tokenizer.missing_language_token:
        problems.append(f"the tokenizer {tokenizer.path} has no [{options.language}] token: "
                        f"the XTTS tokenizer refuses the language. Add it as a special token "
                        f"(training-patches extend-tokenizer).")
    notes: list[str] = []
    if script is None:
        notes.append(f"no script is known for the language {options.language!r}: the "
                     f"script share was not checked and the rate is in letters")
    speakers: dict[str, dict[str, Any]] = {}
    for clip in clips:
        entry = speakers.setdefault(clip.speaker, {"clips": 0, "clean_clips": 0,
                                                   "minutes": 0.0, "clean_minutes": 0.0,
                                                   "speech_minutes": 0.0})
        entry["clips"] += 1
        minutes = clip.audio.get("duration_s", 0.0) / 60.0
        entry["minutes"] += minutes
        if not clip.errors:
            entry["clean_clips"] += 1
            entry["clean_minutes"] += minutes
            entry["speech_minutes"] += voiced_seconds(clip) / 60.0
        entry["median_rate"] = medians.get(clip.speaker, medians.get("*"))
    for entry in speakers.values():
        for key in ("minutes", "clean_minutes", "speech_minutes"):
            entry[key] = round(entry[key], 3)
    errors = Counter(e["reason"] for c in clips for e in c.errors)
    warnings = Counter(w["reason"] for c in clips for w in c.warnings)
    rates = Counter(c.audio["sample_rate"] for c in clips if c.audio)
    channels = Counter(c.audio["channels"] for c in clips if c.audio)
    summary = {
        "clips": len(clips), "clean_clips": sum(not c.errors for c in clips),
        "flagged_clips": sum(bool(c.errors) for c in clips),
        "clips_with_warnings": sum(bool(c.warnings) and not c.errors for c in clips),
        "errors": dict(errors.most_common()), "warnings": dict(warnings.most_common()),
        "minutes": round(sum(s["minutes"] for s in speakers.values()), 3),
        "clean_minutes": round(sum(s["clean_minutes"] for s in speakers.values()), 3),
        "speech_minutes": round(sum(s["speech_minutes"] for s in speakers.values()), 3),
        "sample_rates": {str(k): v for k, v in sorted(rates.items())},
        "channels": {str(k): v for k, v in sorted(channels.items())},
        "problems": problems, "notes": notes,
    }
    return {
        "manifest": os.path.abspath(path), "language": options.language, "script": script,
        "rate_unit": f"{unit}/s", "tokenizer": options.tokenizer and {
            "path": options.tokenizer, "kind": tokenizer.kind, "size": tokenizer.size},
        "limits": {"max_audio_seconds": round(options.max_audio_seconds, 3),
                   "min_audio_seconds": MIN_SECONDS,
                   "min_conditioning_seconds": MIN_CONDITIONING_LENGTH / XTTS_SAMPLE_RATE,
                   "max_conditioning_seconds": MAX_CONDITIONING_LENGTH / XTTS_SAMPLE_RATE,
                   "max_text_tokens": options.max_text_tokens,
                   "char_limit": _char_limit(options.language),
                   "max_clipping_ratio": MAX_CLIPPING, "max_silence_ratio": MAX_SILENCE,
                   "min_snr_db": options.min_snr, "min_script_share": MIN_SCRIPT_SHARE,
                   "rate_tolerance": options.rate_tolerance},
        "summary": summary, "speakers": speakers, "rate_medians": medians,
        "clips": [c.as_json() for c in clips],
    }


# -- output ------------------------------------------------------------------------------

def summary_lines(report: dict[str, Any], clips: Sequence[Clip], most: int = 25) -> list[str]:
    """The table printed on stdout."""
    s = report["summary"]
    lines = [f"manifest: {report['manifest']}",
             f"language: {report['language']} (script {report['script'] or 'unknown'}, rate in "
             f"{report['rate_unit']})",
             f"clips: {s['clips']}  clean: {s['clean_clips']}  with errors: "
             f"{s['flagged_clips']}  clean with warnings: {s['clips_with_warnings']}",
             f"audio: {s['minutes']:.1f} min, clean {s['clean_minutes']:.1f} min, speech "
             f"(voiced, clean clips) {s['speech_minutes']:.1f} min",
             "sample rates: " + (", ".join(f"{k} Hz x{v}" for k, v in
                                           s["sample_rates"].items()) or "none decoded")
             + "; channels: " + (", ".join(f"{k} x{v}" for k, v in s["channels"].items())
                                 or "-"),
             ""]
    width = max([len(name) for name in report["speakers"]] + [7])
    lines.append(f"{'speaker':<{width}}  clips  clean  minutes  clean min  median rate")
    for name, sp in sorted(report["speakers"].items()):
        rate = "-" if sp["median_rate"] is None else f"{sp['median_rate']:.1f}"
        lines.append(f"{name:<{width}}  {sp['clips']:>5}  {sp['clean_clips']:>5}  "
                     f"{sp['minutes']:>7.2f}  {sp['clean_minutes']:>9.2f}  {rate:>11}")
    for kind in ("errors", "warnings"):
        if s[kind]:
            lines += ["", f"{kind} (clips):"]
            for reason, count in s[kind].items():
                meaning, todo = REASONS.get(reason, ("", ""))
                lines.append(f"  {reason:<18} {count:>5}  {meaning}"
                             + (f"; {todo}" if todo else ""))
    flagged = [c for c in clips if c.errors]
    if flagged:
        lines += ["", f"clips with errors ({len(flagged)}"
                  + (f", first {most}" if len(flagged) > most else "") + "):"]
        for clip in flagged[:most]:
            detail = "; ".join(f"{e['reason']}: {e['detail']}" for e in clip.errors)
            lines.append(f"  line {clip.row.line_no} {clip.row.fields.get('audio_file')}: "
                         f"{detail}")
    for note in s["notes"]:
        lines += ["", f"note: {note}"]
    for problem in s["problems"]:
        lines += ["", f"error: {problem}"]
    return lines


def clean_manifest_text(manifest: str, out: str, header: str, clips: Iterable[Clip]) -> str:
    """The cleaned manifest: the header and the rows without errors. In the manifest's
    folder each row is kept as written; elsewhere a relative audio path is rewritten to be
    relative to the new folder, so it still points at the same file."""
    same = os.path.dirname(os.path.abspath(manifest)) == os.path.dirname(os.path.abspath(out))
    buffer = io.StringIO()
    buffer.write(header)
    writer = csv.writer(buffer, delimiter="|", lineterminator="\n")
    for clip in clips:
        if clip.errors:
            continue
        row = clip.row
        if same or os.path.isabs(row.fields["audio_file"]):
            buffer.write(row.raw if row.raw.endswith("\n") else row.raw + "\n")
        else:
            fields = dict(row.fields)
            fields["audio_file"] = os.path.relpath(row.audio_path,
                                                   os.path.dirname(os.path.abspath(out)))
            writer.writerow(list(fields.values()))
    return buffer.getvalue()


def _check_outputs(args: argparse.Namespace, rows: Sequence[Row] = ()) -> None:
    """The shared output rule (:func:`patches._output.check_output`) for --json and
    --clean-manifest: never the manifest, the tokenizer or (with ``rows``) an audio file it
    names, never each other; an existing file only with --force."""
    from ..._output import OutputRefused, check_output

    stem, suffix = Path(args.manifest).stem, Path(args.manifest).suffix
    inputs: list[tuple[str, str | None]] = [("manifest being checked", args.manifest),
                                            ("--tokenizer", args.tokenizer)]
    inputs += [(f"audio file (manifest line {row.line_no})", row.audio_path) for row in rows
               if os.path.exists(row.audio_path)]
    outputs = [("--json", args.json, "check.json"),
               ("--clean-manifest", args.clean_manifest, f"{stem}.clean{suffix}")]
    for what, path, example in outputs:
        if path is None:
            continue
        others = [(o_what, o_path) for o_what, o_path, _ in outputs if o_what != what]
        try:
            check_output(path, prog=PROG, what=what, force=args.force, inputs=inputs,
                         others=others, example=example)
        except OutputRefused as exc:
            raise ManifestError(str(exc)) from None


def _check_installed(tokenizer: str | None) -> None:
    """The libraries check-data needs (the ``tools`` extra), or one paragraph saying which."""
    import importlib.util

    needed = ["soundfile", "tqdm", "numpy"]
    if tokenizer:
        needed.append("sentencepiece" if tokenizer.endswith(".model") else "tokenizers")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ManifestError(
            f"training-patches check-data: the package(s) {', '.join(missing)} are not "
            f"installed in {sys.executable}. Expected the `tools` extra. Install it with "
            f"`pip install 'training-patches[tools]'` (or `pip install {' '.join(missing)}`).")


def _cores() -> int:
    """The cores this process may run on (a container's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _run(args: argparse.Namespace) -> int:
    """The command: SIGINT and SIGTERM end it and its workers within seconds, exit 130/143,
    one line, no report or manifest written."""
    from ..._output import Interrupted, stop_on_signals

    written: list[str] = []
    try:
        with stop_on_signals():
            return _check(args, written)
    except (Interrupted, KeyboardInterrupt) as exc:
        import signal

        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"training-patches check-data: {stop}; its decoding workers were ended and "
              + (f"only {' and '.join(written)} had been written." if written else
                 "nothing was written (no --json report, no --clean-manifest)."),
              file=sys.stderr)
        return stop.exit_code


def _check(args: argparse.Namespace, written: list[str]) -> int:
    from ..._output import OutputExists, OutputRefused, STDOUT, write_file, write_json

    options = Options(language=args.language, tokenizer=args.tokenizer, workers=args.workers,
                      max_audio_seconds=args.max_audio_seconds,
                      max_text_tokens=args.max_text_tokens, min_snr=args.min_snr,
                      rate_tolerance=args.rate_tolerance,
                      progress=False if args.no_progress else None)
    try:
        _check_outputs(args)  # before the manifest is read: a refusal costs nothing
        _check_installed(args.tokenizer)
        manifest = read_manifest(args.manifest)
        _check_outputs(args, manifest[1])  # ... and never one of its audio files
        report, clips = check_manifest(args.manifest, options, manifest=manifest)
    except ManifestError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    # --json -: the JSON object alone on stdout, the table on stderr
    text = sys.stderr if args.json == STDOUT else sys.stdout
    print("\n".join(summary_lines(report, clips)), file=text)
    try:
        if args.json:
            failed = bool(report["summary"]["flagged_clips"] or report["summary"]["problems"])
            where = write_json(args.json, {"tool": PROG, "format": JSON_FORMAT,
                                           "exit_code": 1 if failed else 0, **report},
                               replace=args.force, prog=PROG)
            if args.json != STDOUT:
                written.append(args.json)
            print(f"\nreport: {where}", file=text)
        if args.clean_manifest:
            with open(args.manifest, encoding="utf-8") as handle:
                header = handle.readline()
            cleaned = clean_manifest_text(args.manifest, args.clean_manifest, header, clips)
            try:
                write_file(args.clean_manifest, cleaned.encode("utf-8"),
                           replace=args.force)
            except OutputExists:
                raise OutputRefused(
                    f"{PROG}: --clean-manifest {args.clean_manifest} was created by another "
                    f"program while this command ran; it was left as it is. Run again with "
                    f"another path, or pass --force to replace it.") from None
            written.append(args.clean_manifest)
            print(f"clean manifest: {args.clean_manifest} ({report['summary']['clean_clips']} "
                  f"of {report['summary']['clips']} rows)", file=text)
    except (OutputRefused, OSError) as exc:
        done = f" ({' and '.join(written)} had been written)" if written else ""
        print(f"{exc}{done}" if isinstance(exc, OutputRefused) else
              f"{PROG}: could not write {exc.filename or 'an output'}: {exc.strerror or exc}"
              f"{done}. Expected a writable place; give another path.", file=sys.stderr)
        return 2
    summary = report["summary"]
    failed = bool(summary["flagged_clips"] or summary["problems"])
    print(f"\nresult: {summary['flagged_clips']} of {summary['clips']} clips with errors"
          + (f", {len(summary['problems'])} dataset error(s)" if summary["problems"] else "")
          + f" (exit {1 if failed else 0})", file=text)
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``check-data`` to the ``training-patches`` command."""
    from ..._output import number

    parser = sub.add_parser(
        "check-data", help="check a coqui manifest's audio and transcripts before training",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", help="coqui manifest (audio_file|text|speaker_name, header)")
    parser.add_argument("--language", default="am",
                        help="language code of the transcripts (default am): its cleaner, "
                             "script and character limit")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="XTTS vocab.json or SentencePiece .model: report [UNK] tokens and "
                             "the token count")
    parser.add_argument("--json", metavar="FILE",
                        help="write the full report as one strict JSON object (NaN/Infinity "
                             "as strings); - puts it on stdout and the table on stderr")
    parser.add_argument("--clean-manifest", metavar="FILE",
                        help="write the header and the rows without errors (never the input)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --json/--clean-manifest file")
    parser.add_argument("--workers", type=number(int, low=1, high=MAX_WORKERS,
                                                 what="decoding processes"),
                        default=_cores(), help="decoding processes (default: all cores)")
    parser.add_argument("--max-audio-seconds", type=number(above=MIN_SECONDS, high=3600),
                        default=MAX_WAV_LENGTH / XTTS_SAMPLE_RATE,
                        help="longest clip (default: XTTS max_wav_length, 11.61 s)")
    parser.add_argument("--max-text-tokens", type=number(int, low=1),
                        default=MAX_TEXT_LENGTH,
                        help="most tokens per transcript with --tokenizer (default 200)")
    parser.add_argument("--min-snr", type=number(low=-100, high=100, what="dB"),
                        default=MIN_SNR_DB, help="lowest estimated SNR in dB (default 10)")
    parser.add_argument("--rate-tolerance", type=number(above=1), default=RATE_TOLERANCE,
                        help="flag rates more than this factor from the speaker's median "
                             "(default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_run)
