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
import torch and the patches is refused before anything starts; so is one whose Python's
own flags drop the bootstrap (``-E``, ``-I``, ``-S``, on the command line or its ``#!``
line). A shell script that sets its own ``PYTHONPATH`` (or unsets it, or empties the
environment) gets one WARNING naming the line: the Pythons it starts after it are not
patched. A script's ``#!/usr/bin/env python3`` is looked up on the child's ``PATH``, the
one the script will run with.
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
_SHELL_NAME = re.compile(r"(?:ba|da|z|k|)sh$")
# The interpreter's own flags that keep the bootstrap from loading, and why.
_DROPPING = {
    "E": "-E makes Python ignore the PYTHON* variables, PYTHONPATH among them",
    "I": "-I (isolated mode) makes Python ignore the PYTHON* variables, PYTHONPATH among them",
    "S": "-S makes Python skip the site module, which is what imports sitecustomize",
}
# A shell line that takes the bootstrap off PYTHONPATH for what it starts after it:
# PYTHONPATH set without $PYTHONPATH in its value, unset, or an emptied environment.
_RESETS = re.compile(
    r"(?:^|[\s;&|(`])(?:export\s+|declare\s+-x\s+|env\s+)?PYTHONPATH=(?P<value>\S*)"
    r"|(?:^|[\s;&|(`])unset\s+(?:-v\s+)?PYTHONPATH\b"
    r"|(?:^|[\s;&|(`])env\s+(?:-i|--ignore-environment|-)(?:\s|$)")


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


def _first_line(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _shebang(executable: str) -> list[str]:
    """The words of ``executable``'s ``#!`` line after ``env`` and its options and variable
    settings (``#!/usr/bin/env -S python3 -u``: ``python3 -u``); [] without one."""
    first = _first_line(executable)
    if not first.startswith("#!"):
        return []
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):
            words = words[1:]
    return words


def python_of(executable: str, path: str | None = None) -> tuple[str | None, list[str]]:
    """The Python interpreter ``executable`` runs in, and the flags it is given there: itself
    when it is one (``python3``; its flags are the command's); the one on its ``#!`` line
    for a console script (``torchrun``, ``accelerate``) or a script (``./train.py``), found
    on ``path`` (the child's ``PATH``) when the line names it bare, with the flags after it;
    else (None, []) (a shell script, a binary: nothing to check)."""
    if _PYTHON_NAME.match(os.path.basename(executable)):
        return executable, []
    words = _shebang(executable)
    if not words or not _PYTHON_NAME.match(os.path.basename(words[0])):
        return None, []
    found = words[0] if os.path.isabs(words[0]) else shutil.which(words[0], path=path)
    return found, words[1:]


def dropping_flags(args: Sequence[str]) -> list[str]:
    """The flags among a Python's own options (``args``: what comes before the script,
    ``-c`` or ``-m``) that keep the bootstrap from loading (:data:`_DROPPING`)."""
    found: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--" or arg == "-" or not arg.startswith("-"):
            break  # the script (or stdin): the options end
        if arg.startswith("--"):
            index += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        for position, letter in enumerate(arg[1:], start=1):
            if letter in "cm":
                return found  # -c COMMAND, -m MODULE: the options end
            if letter in "WX":  # -W arg, -X opt: the rest, or the next word, is its value
                index += 1 if position == len(arg) - 1 else 0
                break
            if letter in _DROPPING and f"-{letter}" not in found:
                found.append(f"-{letter}")
        index += 1
    return found


def _flags_error(command: str, python: str, flags: list[str], on_line: bool) -> str:
    """One paragraph refusing a command whose Python's flags drop the bootstrap."""
    where = f"the #! line of {command}" if on_line else "the command"
    why = "; ".join(_DROPPING[flag[1]] for flag in flags)
    return (f"training-patches run: {where} starts {python} with {' '.join(flags)}: {why}, "
            f"so the bootstrap the launcher puts first on PYTHONPATH (its sitecustomize, "
            f"which applies the patches) would never load and the training would run "
            f"unprotected. Nothing was started. Drop {' and '.join(flags)} from {where}, or "
            f"put `import patches.auto` first in the trainer and start it without the "
            f"launcher.")


def shell_script_of(executable: str, argv: Sequence[str]) -> tuple[str, str] | None:
    """(where, its text) of the shell code the command runs: the script of ``bash
    train.sh`` (or the text of ``sh -c '...'``), or a script whose ``#!`` line is a
    shell; None for anything else."""
    if _SHELL_NAME.match(os.path.basename(executable)):
        args = list(argv[1:])
        while args and args[0].startswith("-") and args[0] not in ("-c", "--"):
            args = args[1:]
        if args[:1] == ["-c"] and len(args) > 1:
            return f"the {os.path.basename(executable)} -c command", args[1]
        script = args[1] if args[:1] == ["--"] and len(args) > 1 else (args[0] if args else "")
        if not script:
            return None  # commands read from stdin: nothing to look at
        # as the shell finds it: the file named, else (a bare name) on PATH
        executable = script if os.path.isfile(script) else shutil.which(script) or ""
        if not executable:
            return None
    else:
        words = _shebang(executable)
        if not words or not _SHELL_NAME.match(os.path.basename(words[0])):
            return None
    try:
        with open(executable, encoding="utf-8", errors="replace") as handle:
            return executable, handle.read(1 << 20)
    except OSError:
        return None


_PYTHON_CALL = re.compile(r"(?:^|[\s;&|(`])(?:\S*/)?python[0-9.]*((?:\s+-\S+)+)")


def unpatched_line(text: str) -> tuple[int, str, str] | None:
    """(line number, line, why) of the first shell line after which the Pythons started
    are not patched: one that takes the launcher's PYTHONPATH away (:data:`_RESETS`), or
    one that starts a Python with a flag that drops the bootstrap (:func:`dropping_flags`);
    None when no line does."""
    for number, line in enumerate(text.splitlines(), start=1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#!") else ""
        for match in _RESETS.finditer(code):
            value = match.group("value")
            if value is None or "PYTHONPATH" not in value:
                return number, line.strip(), (
                    "takes the launcher's bootstrap off PYTHONPATH: the Python programs it "
                    "starts after that line do not load it and train UNPROTECTED")
        for match in _PYTHON_CALL.finditer(code):
            flags = dropping_flags(match.group(1).split())
            if flags:
                return number, line.strip(), (
                    f"starts Python with {' '.join(flags)}: "
                    + "; ".join(_DROPPING[f[1]] for f in flags)
                    + ", so that Python does not load the launcher's bootstrap and trains "
                      "UNPROTECTED")
    return None


def _unpatched_warning(where: str, found: tuple[int, str, str]) -> str:
    number, line, why = found
    return (f"training-patches run: WARNING: {where}, line {number} (`{line[:200]}`), {why} "
            f"(no patch, no banner). Keep the PYTHONPATH it was given "
            f"(`export PYTHONPATH=your/src:$PYTHONPATH`) and leave out -E, -I and -S, or put "
            f"`import patches.auto` first in the trainer.")


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
    python, flags = python_of(executable, env.get("PATH"))
    if python is not None:
        named = executable == python
        dropping = dropping_flags(argv[1:] if named else flags)
        if dropping:
            print(_flags_error(argv[0] if named else executable, python, dropping,
                               on_line=not named), file=sys.stderr)
            return 2
    problem = python and _interpreter_error(executable, python, env)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    shell = shell_script_of(executable, argv)
    found = shell and unpatched_line(shell[1])
    if shell and found:
        print(_unpatched_warning(shell[0], found), file=sys.stderr)
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
