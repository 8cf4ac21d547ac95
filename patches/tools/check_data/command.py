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
- signal, on 20 ms frames of the mono mix (see :func:`.audio.signal_stats`): clipping ratio,
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
import importlib.util
import io
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from .._output import (STDOUT, Interrupted, OutputExists, OutputRefused, OwnKind, WriteFailed,
                        check_output, number, stop_on_signals, tool_json, write_file,
                        write_json)
from .checks import (MAX_TEXT_LENGTH, MAX_WAV_LENGTH, MIN_SECONDS, MIN_SNR_DB, RATE_TOLERANCE,
                     REASONS, XTTS_SAMPLE_RATE, CheckDataOptions, Clip, check_manifest)
from .manifest import ManifestError, Row, read_data_manifest

PROG = "training-patches check-data"
JSON_FORMAT = 1  # of the --json report: raised when a key changes meaning or goes away
MAX_WORKERS = 1024  # --workers: beyond any machine's cores, a typo (a pool this big would
#                     fork until the machine runs out of processes)



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
             f"(voiced, clean clips) {s['speech_minutes']:.1f} min"
             + (f" in {s['audio_files']} audio files; {s['repeated_rows']} rows name a file "
                f"an earlier row names (each file counted once)" if s["repeated_rows"] else ""),
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


def _is_manifest(path: str) -> bool:
    """A coqui manifest: its first line (a BOM aside) is a ``|`` header naming audio_file."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            first = handle.readline(4096)
    except (OSError, UnicodeDecodeError):
        return False
    return first.rstrip("\r\n").split("|")[0] == "audio_file"


# What --force may replace with --clean-manifest: a manifest, never a checkpoint or a record.
MANIFEST_KIND = OwnKind("a coqui manifest (header audio_file|text|speaker_name)", _is_manifest)


def _check_outputs(args: argparse.Namespace, rows: Sequence[Row] | None = None) -> None:
    """The shared output rule (:func:`patches.tools._output.check_output`) for --json and
    --clean-manifest: never the manifest, the tokenizer or (with ``rows``) an audio file it
    names, never each other; an existing file only with --force, and (once ``rows`` are
    known, so that an audio file is named as such) only one of the command's own kind."""
    stem, suffix = Path(args.manifest).stem, Path(args.manifest).suffix
    inputs: list[tuple[str, str | None]] = [("manifest being checked", args.manifest),
                                            ("--tokenizer", args.tokenizer)]
    inputs += [(f"audio file (manifest line {row.line_no})", row.audio_path)
               for row in rows or () if os.path.exists(row.audio_path)]
    outputs = [("--json", args.json, "check.json", tool_json(PROG)),
               ("--clean-manifest", args.clean_manifest, f"{stem}.clean{suffix}", MANIFEST_KIND)]
    if args.json == STDOUT and args.clean_manifest == STDOUT:
        raise ManifestError(
            f"{PROG}: --json - and --clean-manifest - both ask for stdout, which can carry only "
            f"one of them; nothing was read or written. Give one of them a file name (e.g. "
            f"--clean-manifest {stem}.clean{suffix}).")
    for what, path, example, own in outputs:
        if path is None:
            continue
        others = [(o_what, o_path) for o_what, o_path, _, _ in outputs if o_what != what]
        try:
            check_output(path, prog=PROG, what=what, force=args.force, inputs=inputs,
                         others=others, example=example, own=own if rows is not None else None)
        except OutputRefused as exc:
            raise ManifestError(str(exc)) from None


def _check_installed(tokenizer: str | None) -> None:
    """The libraries check-data needs (the ``tools`` extra), or one paragraph saying which."""
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
    written: list[str] = []
    try:
        with stop_on_signals():
            return _check(args, written)
    except (Interrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"training-patches check-data: {stop}; its decoding workers were ended and "
              + (f"only {' and '.join(written)} had been written." if written else
                 "nothing was written (no --json report, no --clean-manifest)."),
              file=sys.stderr)
        return stop.exit_code


def _check(args: argparse.Namespace, written: list[str]) -> int:
    options = CheckDataOptions(language=args.language, tokenizer=args.tokenizer,
                               workers=args.workers, max_audio_seconds=args.max_audio_seconds,
                               max_text_tokens=args.max_text_tokens, min_snr=args.min_snr,
                               rate_tolerance=args.rate_tolerance,
                               progress=False if args.no_progress else None)
    try:
        _check_outputs(args)  # before the manifest is read: a refusal costs nothing
        _check_installed(args.tokenizer)
        manifest = read_data_manifest(args.manifest)
        _check_outputs(args, manifest[1])  # ... and never one of its audio files
        report, clips = check_manifest(args.manifest, options, manifest=manifest)
    except ManifestError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    # --json - or --clean-manifest -: that output alone on stdout, the table on stderr
    text = sys.stderr if STDOUT in (args.json, args.clean_manifest) else sys.stdout
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
            # on stdout, audio paths are made relative to the current folder
            cleaned = clean_manifest_text(args.manifest, args.clean_manifest, header, clips)
            if args.clean_manifest == STDOUT:
                sys.stdout.write(cleaned)
                sys.stdout.flush()
            else:
                try:
                    write_file(args.clean_manifest, cleaned.encode("utf-8"),
                               replace=args.force)
                except OutputExists:
                    raise OutputRefused(
                        f"{PROG}: --clean-manifest {args.clean_manifest} was created by another "
                        f"program while this command ran; it was left as it is. Run again with "
                        f"another path, or pass --force to replace it.") from None
                written.append(args.clean_manifest)
            print(f"clean manifest: {'stdout' if args.clean_manifest == STDOUT else args.clean_manifest}"
                  f" ({report['summary']['clean_clips']} of {report['summary']['clips']} rows)",
                  file=text)
    except (OutputRefused, OSError) as exc:
        done = f" ({' and '.join(written)} had been written)" if written else ""
        if isinstance(exc, WriteFailed):  # the system refused the write: not a usage error
            print(f"{PROG}: {exc}{done}", file=sys.stderr)
            return 1
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
                        help="write the header and the rows without errors (never the input); "
                             "- puts them on stdout (the table then goes to stderr)")
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
