"""``training-patches``: the tools around a training run.

    training-patches doctor              what this machine can train with, and what is missing
    training-patches report RUN_DIR      a run's health from the files the patches wrote
    training-patches run COMMAND ...     a training command with the patches on, no line added
    training-patches extend-tokenizer    a vocab.json / SentencePiece model extended for a language
    training-patches verify-tokenizer    a tokenizer (and checkpoint) checked before training
    training-patches check-data MANIFEST what in a dataset will hurt a fine-tune
    training-patches options             every TRAINING_PATCHES_* setting, its default and owner

Each prints for a person and exits non-zero when something needs attention. Shared by all
(patches/tools/_output.py): a usage error (an unknown option, a number out of its range) is one
paragraph on stderr with exit 2; Ctrl-C and SIGTERM end a command with exit 130/143 and
one line, no traceback; every output file follows one rule (:func:`patches.tools._output.check_output`).
`report`, `verify-tokenizer`, `doctor` and `check-data` write a strict JSON object with
``--json FILE`` (``--json -``: on stdout, instead of the text).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import NoReturn, Sequence

from .._version import __version__
from ._output import Interrupted, WriteFailed, stop_on_signals

# Each subcommand lives in its own module, which has ``register(sub)``: it adds its parser
# with ``set_defaults(handler=...)``; a handler takes the parsed args and returns the exit
# code. Only the module of the command being run is imported (the others get a bare parser
# for their name), so one tool never loads another's code; ``build_parser()`` with no
# command, or a top-level ``--help``, imports them all.
COMMANDS: dict[str, str] = {  # subcommand -> its module, in the order --help lists them
    "doctor": "patches.tools.doctor",
    "report": "patches.tools.report",
    "run": "patches.tools.launcher",
    "extend-tokenizer": "patches.tools.extend_tokenizer",
    "verify-tokenizer": "patches.tools.verify_tokenizer",
    "check-data": "patches.tools.check_data.command",
    "options": "patches.tools.options",
}


# The commands that use the library's settings (language cleaners, row rules): they check
# them first, as activation does (doctor reports them itself; report and options read none).
SETTINGS_FIRST = ("extend-tokenizer", "verify-tokenizer", "check-data")


class Parser(argparse.ArgumentParser):
    """argparse's parser with a one-paragraph usage error: the error and where the options
    are listed, not the 10-line usage block above a bad number."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}. Nothing was done; `{self.prog} --help` "
                     f"lists the options.\n")


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs (its first word that is not an option), or None."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``training-patches`` parser: every subcommand in full, or with ``command`` only
    that one (the others by name, so a mistyped name is still told apart)."""
    parser = Parser(prog="training-patches", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"training-patches {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (130/143 after Ctrl-C/SIGTERM)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(command_of(argv)).parse_args(argv)
    if args.command in SETTINGS_FIRST:
        from .._api import check_settings  # lazy: only the commands that use the settings
        from .._options import ConfigError  # lazy: as above

        try:  # a bad TRAINING_PATCHES_* value: the paragraph training would stop with
            check_settings()
        except ConfigError as exc:
            print(f"training-patches {args.command}: {exc}", file=sys.stderr)
            return 2
    try:
        # check-data and extend-tokenizer say themselves what a signal left written; the
        # other commands write their one output atomically at the end: nothing half-written.
        # (``run`` execs the trainer, which gets the default handlers back.)
        with stop_on_signals():
            return int(args.handler(args))
    except WriteFailed as exc:  # a command that did not say it itself: still one paragraph
        print(f"training-patches {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `training-patches options | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (Interrupted, KeyboardInterrupt) as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"training-patches {args.command}: {stop}; stopped (its output files are written "
              f"whole or not at all: no partial file is left).", file=sys.stderr)
        return stop.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
