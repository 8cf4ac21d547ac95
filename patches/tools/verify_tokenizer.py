"""``training-patches verify-tokenizer``: is this tokenizer (and checkpoint) ready to train on?

    training-patches verify-tokenizer vocab_am.json --base base/vocab.json --language am \\
        --text data/train.csv --checkpoint base/model.pth

The checks are :func:`patches.tools.tokenizer.verify.verify`; this module is their command line.
"""

from __future__ import annotations

import argparse
import sys

from ._output import (STDOUT, OutputRefused, WriteFailed, check_output, number, tool_json,
                       write_json)
from .._options import ConfigError
from ..checkpoint import CheckpointError
from .tokenizer import TokenizerToolError
from .tokenizer.text import make_preprocess
from .tokenizer.verify import FAIL, verify

PROG = "training-patches verify-tokenizer"

DESCRIPTION = """\
Check a tokenizer before training on it: an XTTS vocab.json or a SentencePiece .model.

Reports the vocabulary size, the base and extended id ranges (with --base or
--base-size), whether every base token kept its id, and the special tokens ([STOP] 0,
[UNK] 1, [SPACE], [START], [LANG] for XTTS). With --text (a text file or a coqui
manifest, cleaned as the trainer does): the UNK rate, the share of tokens from the
extended range, characters not covered, lines that do not survive encode + decode,
and tokens per character. With --checkpoint (model.pth): whether its text_embedding /
text_head rows fit the vocabulary and what training-patches' loader would do with them
(load as is, grow keeping the trained rows, or refuse), how it starts the new rows
(TRAINING_PATCHES_ROW_INIT / TRAINING_PATCHES_HEAD_ROW_INIT) and which rows it freezes.

--json FILE writes the findings as one strict JSON object ({"tool", "format", "tokenizer",
"ok", "exit_code", "findings": [{"status", "what", "detail"}]}); --json - puts it on
stdout instead of the text.

Exit codes: 0 every check passed, 1 a check FAILED, 2 bad input (a file that is not a
tokenizer, a missing file, a --g2p that fails, a refused --json)."""

JSON_FORMAT = 1  # raised when a key changes meaning or goes away


def findings_json(tokenizer: str, found: list) -> dict:
    """The ``--json`` object of a list of :class:`patches.tools.tokenizer.verify.Finding`."""
    failed = any(f.status == FAIL for f in found)
    return {"tool": PROG, "format": JSON_FORMAT, "tokenizer": tokenizer, "ok": not failed,
            "exit_code": 1 if failed else 0,
            "findings": [{"status": f.status.strip(), "what": f.what, "detail": f.detail}
                         for f in found]}


def _verify(args: argparse.Namespace) -> int:
    try:
        if args.json is not None:
            check_output(args.json, prog=PROG, what="--json", force=args.force,
                         example="verify.json", own=tool_json(PROG),
                         inputs=[("tokenizer", args.tokenizer), ("--base", args.base),
                                 ("--checkpoint", args.checkpoint),
                                 *(("--text", text) for text in args.text or ())])
        try:
            preprocess = make_preprocess(args.language, g2p=args.g2p, clean=not args.no_cleaner
                                         ) if args.text else (lambda t: t)
            found = verify(args.tokenizer, base=args.base, base_size=args.base_size,
                           language=args.language, texts=args.text or (),
                           preprocess=preprocess, checkpoint=args.checkpoint,
                           max_unk_rate=args.max_unk_rate)
        except OSError as exc:  # an input that exists and cannot be read
            print(f"{PROG}: error: could not read {exc.filename or 'an input'} "
                  f"({exc.strerror or exc}); nothing was checked or written. Expected a "
                  f"readable file; check the path and its permissions.", file=sys.stderr)
            return 2
        if args.json is not None:
            write_json(args.json, findings_json(args.tokenizer, found), replace=args.force,
                       prog=PROG)
    except (TokenizerToolError, CheckpointError, ConfigError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OutputRefused as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except WriteFailed as exc:  # the system refused the write: not a usage error
        print(f"{PROG}: --json: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{PROG}: could not write --json {args.json} ({exc.strerror or exc}). Expected "
              f"a writable place; give another path.", file=sys.stderr)
        return 2
    failed = [f for f in found if f.status == FAIL]
    if args.json == STDOUT:  # the JSON object is the whole of stdout
        return 1 if failed else 0
    width = max(len(f.what) for f in found)
    for f in found:
        print(f"[{f.status}] {f.what:<{width}}  {f.detail}")
    print(f"verdict: {'FAILED (' + str(len(failed)) + ' check(s))' if failed else 'OK'}")
    if args.json is not None:
        print(f"json: {args.json}")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``verify-tokenizer`` to the ``training-patches`` command."""
    cmd = sub.add_parser("verify-tokenizer", help="check a tokenizer (and a checkpoint) before "
                         "training", description=DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("tokenizer", help="XTTS vocab.json or SentencePiece .model to check")
    base = cmd.add_mutually_exclusive_group()
    base.add_argument("--base", metavar="FILE",
                      help="the tokenizer this one extends: gives the base/extended id ranges "
                           "and checks every base id is kept")
    base.add_argument("--base-size", type=number(int, low=1), metavar="N",
                      help="the number of base tokens, when the base file is not at hand")
    cmd.add_argument("--language", metavar="CODE",
                     help="the language of the texts: its [CODE] token must be special "
                          "(vocab.json), and its cleaner is applied to --text")
    cmd.add_argument("--text", action="append", metavar="FILE",
                     help="a text file (one line each) or coqui manifest to measure; repeatable")
    cmd.add_argument("--checkpoint", metavar="MODEL_PTH",
                     help="a model checkpoint whose text-embedding rows must fit the vocabulary")
    cmd.add_argument("--max-unk-rate", type=number(low=0, high=1), default=0.0, metavar="R",
                     help="highest share of [UNK] tokens that passes (default 0.0: none)")
    cmd.add_argument("--g2p", metavar="MODULE:FUNCTION",
                     help="the G2P/front-end the trainer applies before tokenizing")
    cmd.add_argument("--no-cleaner", action="store_true",
                     help="measure --text as it is, without the language's cleaner")
    cmd.add_argument("--json", metavar="FILE",
                     help="also write the findings as one strict JSON object; - puts it on "
                          "stdout instead of the text")
    cmd.add_argument("--force", action="store_true", help="replace an existing --json FILE")
    cmd.set_defaults(handler=_verify)
