"""``training-patches run COMMAND ...``: the patches in a program that has no line for them.

In the style of ``ddtrace-run`` and ``opentelemetry-instrument``: the command runs with
``patches/_bootstrap`` first on ``PYTHONPATH``, so every Python process it starts (the
trainer, its spawned DataLoader workers, each ``torchrun`` rank) loads our
``sitecustomize``, which applies the patches the moment ``torch`` is imported. A process
that never imports torch (pip, a shell script's helpers) pays nothing.

    training-patches run python train.py --config cfg.json
    training-patches run torchrun --nproc_per_node 2 train.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Mapping, Sequence

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
# The folder holding the ``patches`` package: on the child's path too, so a checkout that
# is not pip-installed works under the launcher.
LIBRARY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set in the child's environment: tells the bootstrap (and a curious user) who started it.
LAUNCHED_ENV = "TRAINING_PATCHES_LAUNCHED"


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the bootstrap first on ``PYTHONPATH`` (once) and the launch flag set."""
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if os.path.abspath(p) not in (BOOTSTRAP_DIR, LIBRARY_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *parts, LIBRARY_ROOT])
    env[LAUNCHED_ENV] = "1"
    return env


def _settings_error(environ: Mapping[str, str]) -> str | None:
    """The settings check activation would make, done before anything is started."""
    from patches import _options

    try:
        _options.resolve(environ=environ)
    except _options.ConfigError as exc:
        return str(exc)
    return None


def run(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Replace this process with ``argv`` run under the patches (returns only on error)."""
    environ = os.environ if environ is None else environ
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("training-patches run: no command given. Put the command that starts training "
              "after `run`, for example: training-patches run python train.py --config "
              "config.json", file=sys.stderr)
        return 2
    problem = _settings_error(environ)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    executable = shutil.which(argv[0], path=environ.get("PATH"))
    if executable is None:
        print(f"training-patches run: the command {argv[0]!r} was not found on PATH. Give the "
              f"program that starts training (python, torchrun, accelerate) followed by its "
              f"arguments.", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, argv, child_environment(environ))
    return 0  # not reached: execve replaced this process


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``run`` to the ``training-patches`` command."""
    parser = sub.add_parser(
        "run", help="run a training command with the patches on, no line added",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the command that starts training, with its arguments")
    parser.set_defaults(handler=lambda args: run(args.argv))
