"""``training-patches extend-tokenizer``: a tokenizer extended for a new language, base ids kept.

    training-patches extend-tokenizer base/vocab.json --corpus am.txt --language am \\
        --output vocab_am.json
    training-patches extend-tokenizer checkpoints/bpe.model --corpus train.csv \\
        --language am --output bpe_am.model

The library is :mod:`patches.tools.tokenizer`; this module is its command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from ._output import (Interrupted, OutputExists, OwnKind, WriteFailed, number, stop_on_signals,
                       write_file)
from .tokenizer import TokenizerToolError
from .tokenizer.bpe import DEFAULT_NEW_PIECES, extend_vocab_file, load_vocab_json
from .tokenizer.errors import FrontEndError
from .tokenizer.text import (MAX_WORD_CHARS, check_output, check_word_lengths, make_preprocess,
                              read_lines, sample_base_text)
from .tokenizer.verify import is_json_tokenizer

PROG = "training-patches extend-tokenizer"
# Beyond these the tokenizers' trainers overflow (a traceback, or a Rust panic): a million
# pieces is far more than any TTS tokenizer holds (XTTS's: 6,681 for 17 languages).
MAX_NEW_PIECES = 1_000_000
MAX_MIN_FREQUENCY = 2 ** 31 - 1

DESCRIPTION = """\
Extend a tokenizer for a new language, keeping every base id.

XTTS vocab.json (Hugging Face tokenizers BPE): adds [LANG] as a special token, every
character of the corpus and up to --new-pieces BPE pieces learned from it, keeps every
base id and merge (new merges rank after the base ones). When [START] is the last id it
moves to the new last id: the layout XTTS's GPTTrainer and training-patches' loader
expect (they move the base model's last row there). SentencePiece .model (IndexTTS):
appends the learned pieces and every new character through sentencepiece's model
protobuf; ids and scores of the base pieces are kept.

The corpus (a text file or a coqui manifest audio_file|text|speaker_name) is taken as
the trainer sees it: through --g2p if given, then the language's cleaner (a language
registered in training-patches, e.g. am/amh, or coqui-tts's own). A UTF-8 BOM is
dropped; a '|' table without the coqui header is refused, as is a piece of text longer
than --max-word-chars between spaces. Base-language text (--base-text, default a built-in
English sample) must encode exactly as before; then the output is written atomically.
The input tokenizer is never overwritten without --in-place, the corpus and the other
inputs never, an existing output never without --force: without it the output is created
only if still absent at the moment of writing. Exit codes: 0 written, 2 bad input (nothing
written), 130/143 interrupted by Ctrl-C/SIGTERM (nothing written)."""


def _clean_corpus(raw: list[str], preprocess: Callable[[str], str], g2p: str | None
                  ) -> list[str]:
    """Each corpus line through --g2p and the cleaner, with a progress bar (stderr, when it
    is a terminal) counted in characters: a large corpus shows it is moving."""
    try:
        from tqdm import tqdm  # lazy: tqdm is optional (the tools extra)
    except ImportError:  # the bar is a comfort, not a need
        tqdm = None
    bar = tqdm(total=sum(map(len, raw)), unit="char", unit_scale=True, desc="cleaning corpus",
               file=sys.stderr, disable=None, leave=False) if tqdm is not None else None
    texts = []
    try:
        for number, line in enumerate(raw, start=1):
            try:
                texts.append(preprocess(line))
            except FrontEndError as exc:  # the user's front-end or the cleaner failed
                raise TokenizerToolError(exc.at(f"corpus text line {number} ({line[:60]!r})")
                                         ) from None
            if bar is not None:
                bar.update(len(line))
    finally:
        if bar is not None:
            bar.close()
    return texts


def tokenizer_kind(json_kind: bool) -> OwnKind:
    """What ``--force`` may replace: a tokenizer of the input's format (an XTTS vocab.json,
    or a SentencePiece model), never a checkpoint, a record or another file."""
    def test(path: str) -> bool:
        try:
            with open(path, "rb") as handle:
                head = handle.read(64)
            if json_kind:
                return head.lstrip()[:1] == b"{" and bool(load_vocab_json(path))
            if head[:1] != b"\n":  # a ModelProto starts with its pieces (field 1)
                return False
            from .tokenizer.spm import load_model_proto  # lazy: sentencepiece+protobuf, .model only
            return bool(load_model_proto(path))
        except (OSError, TokenizerToolError):
            return False

    return OwnKind("an XTTS vocab.json tokenizer" if json_kind else "a SentencePiece model",
                   test)


def _extend(args: argparse.Namespace) -> int:
    try:
        with stop_on_signals():
            texts, ext, out = _extend_checked(args)
    except TokenizerToolError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except WriteFailed as exc:  # full, read-only, over the file-size limit: exit 1
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"{PROG}: {stop}; nothing was written (no partial file is left).", file=sys.stderr)
        return stop.exit_code
    print(f"corpus: {len(texts)} lines from {', '.join(map(str, args.corpus))}"
          + (f", cleaned as {args.language}" if args.language and not args.no_cleaner else "")
          + (f", through {args.g2p}" if args.g2p else ""))
    print("\n".join(ext.lines()))
    print(f"written: {out}")
    return 0


def _extend_checked(args: argparse.Namespace) -> tuple[list[str], Any, Path]:
    """The extension, or :class:`TokenizerToolError` with nothing written."""
    src = Path(args.tokenizer)
    if not src.is_file():
        raise TokenizerToolError(
            f"the tokenizer {src} was not found. Expected the base XTTS vocab.json or a "
            f"SentencePiece .model. Check the path.")
    json_kind = is_json_tokenizer(src)
    if json_kind and not args.language:
        raise TokenizerToolError(
            f"--language is needed for the XTTS vocab.json {src}: XTTS starts every text "
            f"with its [language] token, which the extension adds (e.g. --language am).")
    inputs = [("corpus", corpus) for corpus in args.corpus]
    if args.base_text:
        inputs.append(("--base-text", args.base_text))
    if args.g2p and args.g2p.rpartition(":")[0].endswith(".py"):
        inputs.append(("--g2p file", args.g2p.rpartition(":")[0]))
    out = check_output(src, Path(args.output) if args.output else None,
                       in_place=args.in_place, force=args.force,
                       suffix=f"_{args.language}" if args.language else "_extended",
                       inputs=inputs, own=tokenizer_kind(json_kind))
    preprocess = make_preprocess(args.language, g2p=args.g2p, clean=not args.no_cleaner)
    raw = [line for corpus in args.corpus for line in read_lines(corpus)]
    texts = _clean_corpus(raw, preprocess, args.g2p)
    check_word_lengths(texts, args.max_word_chars, ", ".join(map(str, args.corpus)))
    base_text, source = sample_base_text(args.base_text)
    replace = args.force or args.in_place

    def write(path: Path, data: bytes) -> None:
        # Without --force the output is created only if it is still absent now: a second
        # run that passed the same check meanwhile is refused here, not silently replaced.
        try:
            write_file(path, data, replace=replace)
        except OutputExists:
            raise TokenizerToolError(
                f"--output {path} was created by another program while this one ran (another "
                f"extend-tokenizer writing the same file?); it was left as it is and nothing "
                f"was written. Pass --force to replace it, or name a new file.") from None
        except IsADirectoryError:
            raise TokenizerToolError(f"--output {path} became a folder while this command "
                                     f"ran; nothing was written. Name a file.") from None

    if json_kind:
        ext = extend_vocab_file(src, texts, out, language=args.language,
                                new_pieces=args.new_pieces, min_frequency=args.min_frequency,
                                base_text=base_text, base_text_source=source, write=write)
    else:
        from .tokenizer.spm import extend_model_file  # lazy: sentencepiece+protobuf, .model only

        ext = extend_model_file(src, texts, out, new_pieces=args.new_pieces,
                                base_text=base_text, base_text_source=source, write=write)
    return texts, ext, out


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``extend-tokenizer`` to the ``training-patches`` command."""
    cmd = sub.add_parser("extend-tokenizer", help="extend a vocab.json or SentencePiece model "
                         "for a new language, base ids kept", description=DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("tokenizer", help="the base tokenizer: XTTS vocab.json or a SentencePiece "
                                       ".model (told apart by content)")
    cmd.add_argument("--corpus", action="append", required=True, metavar="FILE",
                     help="text of the new language: one sentence a line, or a coqui manifest "
                          "(its text column); repeat for several files")
    cmd.add_argument("--language", metavar="CODE",
                     help="language code (am, amh, ...): its [CODE] token is added (vocab.json; "
                          "required there) and its cleaner applied to the corpus")
    cmd.add_argument("--output", "-o", metavar="FILE", help="where to write the extended tokenizer")
    cmd.add_argument("--in-place", action="store_true",
                     help="write over the input tokenizer instead of --output")
    cmd.add_argument("--force", action="store_true", help="replace an existing --output file")
    cmd.add_argument("--new-pieces", type=number(int, low=0, high=MAX_NEW_PIECES,
                                                 what="more than any tokenizer's vocabulary"),
                     default=DEFAULT_NEW_PIECES,
                     metavar="N",
                     help=f"learned pieces to add besides every character (default "
                          f"{DEFAULT_NEW_PIECES}: about 2,000 per language worked best for XTTS "
                          f"in community experiments; 3,000 similar, 5,000 worse)")
    cmd.add_argument("--min-frequency", type=number(int, low=1, high=MAX_MIN_FREQUENCY),
                     default=2, metavar="N",
                     help="a vocab.json piece must occur at least N times in the corpus "
                          "(default 2)")
    cmd.add_argument("--g2p", metavar="MODULE:FUNCTION",
                     help="a G2P/front-end the trainer applies before tokenizing: "
                          "FUNCTION(text) or FUNCTION(text, language) returning text "
                          "(module importable from here, or path/to/file.py:function)")
    cmd.add_argument("--no-cleaner", action="store_true",
                     help="use the corpus as it is (after --g2p), without the language's cleaner")
    cmd.add_argument("--max-word-chars", type=number(int, low=1), default=MAX_WORD_CHARS,
                     metavar="N",
                     help=f"refuse a corpus holding a piece of more than N characters between "
                          f"spaces (default {MAX_WORD_CHARS:,}): learning from one takes time "
                          f"that grows with the square of its length")
    cmd.add_argument("--base-text", metavar="FILE",
                     help="base-language text that must encode exactly as before (default: a "
                          "built-in English sample)")
    cmd.set_defaults(handler=_extend)
