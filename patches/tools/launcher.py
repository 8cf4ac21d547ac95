"""``training-patches run COMMAND ...``: the patches in a program that has no line for them.

In the style of ``ddtrace-run`` and ``opentelemetry-instrument``: the command runs with
``patches/tools/_bootstrap`` first on ``PYTHONPATH``, so every Python process it starts (the
trainer, its spawned DataLoader workers, each ``torchrun`` rank) loads our
``sitecustomize``, which applies the patches the moment ``torch`` is imported. A process
that never imports torch (pip, a shell script's helpers) pays nothing.

    training-patches run python train.py --config cfg.json
    training-patches run torchrun --nproc_per_node 2 train.py

Launchers that start each rank by a bare name (coqui's ``python -m trainer.distribute``
runs ``python3 ...``) find this interpreter: its folder goes first on the child's
``PATH``, as activating its virtual (or conda) environment would. A command whose Python cannot
import torch and the patches is refused before anything starts.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

from .. import _options

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
# The folder holding the ``patches`` package (this file is patches/tools/launcher.py): on the
# child's path too, so a checkout that is not pip-installed works under the launcher.
LIBRARY_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Set in the child's environment: tells the bootstrap (and a curious user) who started it.
LAUNCHED_ENV = "TRAINING_PATCHES_LAUNCHED"
# The folder of the interpreter running the launcher (one that imports torch and the
# patches): first on the child's PATH so that a rank started as bare ``python3`` is it.
INTERPRETER_DIR = os.path.dirname(os.path.abspath(sys.executable))
# Only an environment's own bin folder (venv, conda) is put first: a system interpreter's
# (/usr/bin) would reorder every other tool on PATH as well.
IN_ENVIRONMENT = (sys.prefix != sys.base_prefix
                  or os.path.isdir(os.path.join(sys.prefix, "conda-meta")))
# What a Python needs for the bootstrap to patch it (checked without importing torch).
_CAN_PATCH = ("import importlib.util as u, sys; "
              "sys.exit(0 if all(u.find_spec(m) for m in ('torch', 'wrapt', 'patches')) else 3)")
_PYTHON_NAME = re.compile(r"python[0-9.]*$")


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the bootstrap first on ``PYTHONPATH`` (once), this interpreter's
    folder first on ``PATH`` (once, when it is a virtual or conda environment's) and the
    launch flag set."""
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if os.path.abspath(p) not in (BOOTSTRAP_DIR, LIBRARY_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *parts, LIBRARY_ROOT])
    if IN_ENVIRONMENT:
        path = [p for p in env.get("PATH", os.defpath).split(os.pathsep)
                if p and os.path.abspath(p) != INTERPRETER_DIR]
        env["PATH"] = os.pathsep.join([INTERPRETER_DIR, *path])
    env[LAUNCHED_ENV] = "1"
    return env


def python_of(executable: str) -> str | None:
    """The Python interpreter ``executable`` runs in: itself when it is one (``python3``),
    the one on its ``#!`` line for a console script (``torchrun``, ``accelerate``), else
    None (a shell script, a binary: nothing to check)."""
    if _PYTHON_NAME.match(os.path.basename(executable)):
        return executable
    try:
        with open(executable, "rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = words[1:]  # "#!/usr/bin/env python3"
    if not words or not _PYTHON_NAME.match(os.path.basename(words[0])):
        return None
    return words[0] if os.path.isabs(words[0]) else shutil.which(words[0])


def _interpreter_error(command: str, python: str, env: Mapping[str, str]) -> str | None:
    """A one-paragraph refusal when ``python`` (the command's interpreter) cannot import
    torch, wrapt and the patches: everything it started would train unprotected."""
    try:
        done = subprocess.run([python, "-c", _CAN_PATCH], env=dict(env), timeout=60,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done.returncode == 0:
            return None
    except (OSError, subprocess.TimeoutExpired):
        pass
    via = "" if python == command else f" (the interpreter of {command})"
    return (f"training-patches run: the Python that would run your command, {python}{via}, "
            f"cannot import torch and the patches (the package is installed for "
            f"{sys.executable}), so the training it starts would run unprotected. Run the "
            f"command with that interpreter instead, for example `training-patches run "
            f"{sys.executable} train.py` or `{sys.executable} -m patches run torchrun ...`, "
            f"or install training-patches into the environment of {python}.")


def _settings_error(environ: Mapping[str, str]) -> str | None:
    """The settings check activation would make, done before anything is started."""
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
    env = child_environment(environ)
    executable = shutil.which(argv[0], path=env.get("PATH"))
    if executable is None:
        print(f"training-patches run: the command {argv[0]!r} was not found on PATH. Give the "
              f"program that starts training (python, torchrun, accelerate) followed by its "
              f"arguments.", file=sys.stderr)
        return 127
    python = python_of(executable)
    problem = python and _interpreter_error(executable, python, env)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, argv, env)
    return 0  # not reached: execve replaced this process


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``run`` to the ``training-patches`` command."""
    parser = sub.add_parser(
        "run", help="run a training command with the patches on, no line added",
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help="the command that starts training, with its arguments")
    parser.set_defaults(handler=lambda args: run(args.argv))
