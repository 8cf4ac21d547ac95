"""``training-patches``: the tools around a training run.

    training-patches doctor              what this machine can train with, and what is missing
    training-patches report RUN_DIR      a run's health from the files the patches wrote
    training-patches run COMMAND ...     a training command with the patches on, no line added
    training-patches extend-tokenizer    a vocab.json / SentencePiece model extended for a language
    training-patches verify-tokenizer    a tokenizer (and checkpoint) checked before training
    training-patches check-data MANIFEST what in a dataset will hurt a fine-tune

Each prints for a person and exits non-zero when something needs attention.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence

# Each subcommand lives in its own module, which has ``register(sub)``: it adds its parser(s)
# with ``set_defaults(handler=...)``; a handler takes the parsed args and returns the exit
# code. Heavy imports stay inside the handlers, so ``--help`` is fast.
COMMAND_MODULES: tuple[str, ...] = ("patches.doctor", "patches.report", "patches.launcher",
                                     "patches.extend_tokenizer", "patches.verify_tokenizer",
                                     "patches.check_data")


def build_parser() -> argparse.ArgumentParser:
    """The ``training-patches`` parser with every subcommand."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="training-patches", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"training-patches {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns its exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
