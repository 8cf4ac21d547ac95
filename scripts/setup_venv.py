#!/usr/bin/env python3
"""Create the virtual environment and install the project with every extra (``make setup``).

uv installs the same packages as pip in under half the time (a fresh venv here: 36 s against
83 s, the same 174 distributions; docs/benchmarks.md "The suite's time"), so this installs uv
with pip and lets uv install the rest. uv does not read pip's configuration: the machine's
indexes, find-links and constraints are read from ``pip config list`` and handed to it. Where
uv cannot install (no wheel of it for this platform, an index it cannot read), pip installs
everything, as before, after one line saying why.

    python3 scripts/setup_venv.py .venv
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import venv
from pathlib import Path

UV = "uv==0.13.9"
EXTRAS = ".[xtts,tools,test,bench]"
# uv's names for the pip settings that choose what gets installed
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}


def pip_settings(python: Path) -> tuple[list[str], dict[str, str]]:
    """uv's flags for the indexes, find-links and constraints pip is configured with, and its
    environment for pip's certificate bundle (uv otherwise trusts only its own roots)."""
    listed = subprocess.run([str(python), "-m", "pip", "config", "list"], check=True,
                            capture_output=True, text=True).stdout
    flags: list[str] = []
    env = dict(os.environ)
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        try:  # pip prints each value as a Python literal: a multi-line one holds "\n"
            value = str(ast.literal_eval(value)) if value else ""
        except (ValueError, SyntaxError):
            value = value.strip("'\"")
        if name == "cert" and value:
            env.setdefault("SSL_CERT_FILE", value.strip())
        flag = FLAGS.get(name)
        for item in value.split() if flag else ():
            if item not in flags:
                flags += [flag, item]
    return flags, env


def run(*args: str, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True, env=env)


def main(target: str) -> int:
    python = Path(target).resolve() / "bin" / "python"
    if not python.exists():
        venv.create(target, with_pip=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    # F5-TTS's trainer for its integration tests, without its app's requirements (setup.cfg)
    installs = [["-c", "constraints.txt", "-e", EXTRAS],
                ["-c", "constraints.txt", "--no-deps", "f5-tts"]]
    try:
        run(*pip, UV)
        uv = [str(python.parent / "uv"), "pip", "install", "-q", "--python", str(python),
              "--index-strategy", "unsafe-best-match", "--compile-bytecode"]
        flags, env = pip_settings(python)
        for args in installs:
            run(*uv, *flags, *args, env=env)
    except (subprocess.CalledProcessError, OSError, IndexError) as exc:
        print(f"setup_venv: uv could not install ({exc}); installing with pip instead",
              flush=True)
        run(*pip, "--upgrade", "pip")
        for args in installs:
            run(*pip, *args)
    return 0


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".venv"))
