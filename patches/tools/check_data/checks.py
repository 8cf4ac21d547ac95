"""The checks of ``check-data``: each row's audio and text, the speaking rates, and the
report of a whole manifest (:func:`check_manifest`)."""

from __future__ import annotations

import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .audio import SILENCE_DBFS, analyse_many
from .manifest import Row, read_data_manifest
from .text import (TextTokenizer, char_limit_of, cleaner_of, in_script, is_letter, load_tokenizer,
                   script_of)

# -- limits: coqui-tts 0.28 XTTS GPTArgs defaults ------------------------------------------

XTTS_SAMPLE_RATE = 22050
MAX_WAV_LENGTH = 255995          # samples at 22050 Hz (GPTArgs.max_wav_length)
MIN_CONDITIONING_LENGTH = 66150  # GPTArgs.min_conditioning_length (3 s)
MAX_CONDITIONING_LENGTH = 132300  # GPTArgs.max_conditioning_length (6 s)
MAX_TEXT_LENGTH = 200            # tokens, the [lang] token included (GPTArgs.max_text_length)
MIN_SECONDS = 0.5                # XTTSDataset drops shorter clips

# -- thresholds (the signal measures: audio.signal_stats) --------------------------------

MAX_CLIPPING = 0.001      # error: more than 0.1 % of the samples clipped
MAX_SILENCE = 0.95        # error: 95 % of the frames or more are silence
WARN_SILENCE = 0.60       # warning: more than 60 % silence
MIN_SNR_DB = 10.0         # error: estimated SNR under 10 dB
WARN_SNR_DB = 20.0        # warning: under 20 dB
MIN_SCRIPT_SHARE = 0.5    # error: under half the letters in the language's script
RATE_TOLERANCE = 2.0      # error: rate more than 2x above or below the speaker's median ...
RATE_MIN_UNITS = 4        # ... and at least 4 syllables (letters) away from the expected count
MIN_RATE_ROWS = 3         # rows a speaker needs for its own median (else: all speakers')

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
    "repeated_file": ("the same audio file as an earlier row: trained on once per row, "
                      "counted once in the minutes", "remove the extra rows unless you mean "
                      "to weight that clip"),
}



@dataclass
class Clip:
    """What was found about one row."""

    row: Row
    audio: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    file: str = ""  # the audio file's real path: rows naming one file share it

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
    letters = [char for char in text if is_letter(char)]
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
class CheckDataOptions:
    """The knobs of :func:`check_manifest` (the CLI's options)."""

    language: str = "am"
    tokenizer: str | None = None
    workers: int = 1
    max_audio_seconds: float = MAX_WAV_LENGTH / XTTS_SAMPLE_RATE
    max_text_tokens: int = MAX_TEXT_LENGTH
    min_snr: float = MIN_SNR_DB
    rate_tolerance: float = RATE_TOLERANCE
    progress: bool | None = None  # None: a bar when stderr is a terminal


def check_manifest(path: str, options: CheckDataOptions,
                   manifest: tuple[list[str], list[Row]] | None = None
                   ) -> tuple[dict[str, Any], list[Clip]]:
    """Check every row of a manifest; returns the JSON report and the clips.

    ``manifest``: what :func:`read_data_manifest` returned for ``path``, if already read.
    :class:`ManifestError` when the manifest itself cannot be read.
    """
    from tqdm import tqdm  # lazy: tqdm is optional (the tools extra)

    header, rows = manifest if manifest is not None else read_data_manifest(path)
    tokenizer = load_tokenizer(options.tokenizer, options.language)  # fails before decoding
    clips = [Clip(row, file=os.path.realpath(row.audio_path)) for row in rows]
    # each audio file is decoded once, however many rows name it
    by_file: dict[str, list[Clip]] = {}
    for clip in clips:
        by_file.setdefault(clip.file, []).append(clip)
    bar = tqdm(total=len(clips), unit="clip", desc="check-data", disable=(
        None if options.progress is None else not options.progress), file=sys.stderr)
    results = analyse_many([same[0].row.audio_path for same in by_file.values()],
                           options.workers)
    try:
        with bar:
            for same, stats in zip(by_file.values(), results):
                for clip in same:
                    if "_columns" in clip.row.fields:
                        clip.error("malformed_row", f"{clip.row.fields['_columns']} columns, "
                                   f"the header has {len(header)}")
                    check_audio(clip, dict(stats), options.max_audio_seconds, options.min_snr)
                    if clip is not same[0]:
                        clip.warn("repeated_file", f"the same audio file as line "
                                  f"{same[0].row.line_no}")
                bar.update(len(same))
    finally:
        results.close()  # a signal between two clips: the workers end here
    script = script_of(options.language)
    clean, limit = cleaner_of(options.language), char_limit_of(options.language)
    for clip in clips:
        check_text(clip, clean, script, limit, tokenizer, options.max_text_tokens)
    unit = "syllables" if script == "Ethiopic" else "letters"
    medians = check_rates(clips, unit, options.rate_tolerance)
    return _report(path, options, clips, script, unit, medians, tokenizer), clips


def _minutes(clips: Sequence[Clip]) -> dict[str, float]:
    """Minutes of audio of ``clips``, each audio file counted once however many rows name
    it: ``minutes`` (every file), ``clean_minutes`` and ``speech_minutes`` (voiced; files
    named by at least one row without errors)."""
    files: dict[str, tuple[Clip, bool]] = {}
    for clip in clips:
        first, clean = files.get(clip.file, (clip, False))
        files[clip.file] = (first, clean or not clip.errors)
    return {"minutes": round(sum(c.audio.get("duration_s", 0.0) for c, _ in files.values())
                             / 60.0, 3),
            "clean_minutes": round(sum(c.audio.get("duration_s", 0.0)
                                       for c, clean in files.values() if clean) / 60.0, 3),
            "speech_minutes": round(sum(voiced_seconds(c) for c, clean in files.values()
                                        if clean) / 60.0, 3)}


def _report(path: str, options: CheckDataOptions, clips: Sequence[Clip], script: str | None,
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
        entry = speakers.setdefault(clip.speaker, {"clips": 0, "clean_clips": 0})
        entry["clips"] += 1
        entry["clean_clips"] += not clip.errors
        entry["median_rate"] = medians.get(clip.speaker, medians.get("*"))
    for name, entry in speakers.items():
        entry.update(_minutes([c for c in clips if c.speaker == name]))
    totals = _minutes(clips)
    errors = Counter(e["reason"] for c in clips for e in c.errors)
    warnings = Counter(w["reason"] for c in clips for w in c.warnings)
    rates = Counter(c.audio["sample_rate"] for c in clips if c.audio)
    channels = Counter(c.audio["channels"] for c in clips if c.audio)
    summary = {
        "clips": len(clips), "clean_clips": sum(not c.errors for c in clips),
        "flagged_clips": sum(bool(c.errors) for c in clips),
        "clips_with_warnings": sum(bool(c.warnings) and not c.errors for c in clips),
        "errors": dict(errors.most_common()), "warnings": dict(warnings.most_common()),
        "audio_files": len({c.file for c in clips}),
        "repeated_rows": len(clips) - len({c.file for c in clips}),
        **totals,
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
                   "char_limit": char_limit_of(options.language),
                   "max_clipping_ratio": MAX_CLIPPING, "max_silence_ratio": MAX_SILENCE,
                   "min_snr_db": options.min_snr, "min_script_share": MIN_SCRIPT_SHARE,
                   "rate_tolerance": options.rate_tolerance},
        "summary": summary, "speakers": speakers, "rate_medians": medians,
        "clips": [c.as_json() for c in clips],
    }
