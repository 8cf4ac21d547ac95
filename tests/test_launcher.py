"""``training-patches run``: a command runs patched or is told why it is not (issue 38,
item 6). Python's flags that drop the bootstrap (``-E``, ``-I``, ``-S``, on the command or
on a script's ``#!`` line) are refused before anything starts; ``-s`` runs patched; a
script's ``#!/usr/bin/env python3`` is the child's ``python3`` (the launcher's interpreter
first on its PATH), not the first on the launcher's own PATH; a shell script that takes
the bootstrap off ``PYTHONPATH`` gets one WARNING naming the line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest

from patches.tools import launcher
from processes import child_path

ROOT = Path(__file__).resolve().parents[1]
PATCHED = ("import json, torch, patches; "
           "print(json.dumps({'patched': bool(patches.advanced.applied().get('nan_guard'))}))")
# whether the launcher's bootstrap loaded (it applies the patches when torch is imported)
BOOTSTRAPPED = ("import sys; m = sys.modules.get('sitecustomize'); "
                "print('bootstrap' if '_bootstrap' in str(getattr(m, '__file__', '')) "
                "else 'no bootstrap')")


def _launch(*command: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ if env is None else env, PYTHONPATH=child_path(ROOT))
    return forkserver.run([sys.executable, "-m", "patches", "run", *command], env=environ,
                          cwd=cwd, capture_output=True, text=True, timeout=180)


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.slow  # the launcher and a Python behind it
@pytest.mark.parametrize("flags", ["-I", "-E", "-S", "-uIB"])
def test_a_python_flag_that_drops_the_bootstrap_is_refused(tmp_path, flags) -> None:
    """``training-patches run python -I train.py`` ran the trainer unpatched with no word
    (-I and -E ignore PYTHONPATH, where the bootstrap is; -S skips site, which imports
    sitecustomize): refused, one paragraph naming the flag and why, exit 2, nothing
    started."""
    marker = tmp_path / "started"
    done = _launch(sys.executable, flags, "-c", f"open({str(marker)!r}, 'w')")
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    flag = "-" + next(c for c in flags[1:] if c in "IES")
    assert f"the command starts {sys.executable} with {flag}:" in message, message
    assert "Nothing was started" in message and "\n" not in message
    assert not marker.exists()


@pytest.mark.slow  # the launcher and a Python behind it
def test_flags_that_keep_the_bootstrap_run_patched(tmp_path) -> None:
    """``-s`` (no user site folder), ``-u``, ``-X dev``, ``-W``: the bootstrap still loads."""
    done = _launch(sys.executable, "-s", "-u", "-X", "dev", "-W", "ignore", "-c", PATCHED)
    assert done.returncode == 0, done.stderr
    assert '{"patched": true}' in done.stdout, done.stdout + done.stderr


@pytest.mark.slow  # the launcher and a Python behind it
def test_a_script_whose_shebang_drops_the_bootstrap_is_refused(tmp_path) -> None:
    """A script run directly whose ``#!`` line gives its Python ``-I``: refused, naming
    the line."""
    script = _script(tmp_path / "train.py", f"#!{sys.executable} -I\nprint('trained')\n")
    done = _launch(str(script))
    assert done.returncode == 2 and "trained" not in done.stdout, done.stdout + done.stderr
    assert f"the #! line of {script} starts {sys.executable} with -I:" in done.stderr


@pytest.mark.slow  # the launcher and a Python behind it
def test_a_script_with_env_python3_finds_the_childs_python(tmp_path) -> None:
    """``run ./train.py`` with ``#!/usr/bin/env python3``, where the first ``python3`` on
    the launcher's own PATH cannot import torch: the script runs with the child's
    ``python3`` (the launcher's interpreter goes first on the child's PATH), patched. It was
    refused, the interpreter looked up on the launcher's PATH."""
    if not launcher.IN_ENVIRONMENT or not (Path(launcher.INTERPRETER_DIR) / "python3").exists():
        pytest.skip("the launcher's interpreter is not a virtual environment's python3")
    bare = tmp_path / "bare"
    bare.mkdir()
    _script(bare / "python3", "#!/bin/sh\nexit 3\n")  # a python3 that cannot import torch
    script = _script(tmp_path / "train.py", f"#!/usr/bin/env python3\n{PATCHED}\n")
    path = os.pathsep.join([str(bare), os.environ.get("PATH", os.defpath)])
    done = _launch(str(script), env=dict(os.environ, PATH=path))
    assert done.returncode == 0, done.stderr
    assert '{"patched": true}' in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("line", [
    "export PYTHONPATH=/opt/project/src",
    "PYTHONPATH=/opt/project/src python3 -c \"$PROGRAM\"",
    "unset PYTHONPATH",
    "python3 -I -c \"$PROGRAM\"",
])
def test_a_shell_script_that_drops_the_bootstrap_gets_one_warning(tmp_path, line) -> None:
    """A shell script that sets its own PYTHONPATH (or unsets it, or starts Python with
    -I) ran its trainer unpatched with no word: one WARNING names the script, the line and
    why; the script still runs."""
    script = _script(tmp_path / "train.sh",
                     f"#!/bin/sh\nPROGRAM=\"{BOOTSTRAPPED}\"\n{line}\npython3 -c \"$PROGRAM\"\n")
    done = _launch(str(script))
    assert done.returncode == 0, done.stderr
    warnings = [w for w in done.stderr.splitlines() if "WARNING" in w]
    assert len(warnings) == 1, done.stderr
    assert f"{script}, line 3 (`{line}`)" in warnings[0] and "UNPROTECTED" in warnings[0]
    assert "no bootstrap" in done.stdout, done.stdout  # as the warning says


@pytest.mark.slow  # the launcher and a Python behind it
def test_a_shell_script_that_keeps_pythonpath_runs_patched_with_no_warning(tmp_path) -> None:
    """``export PYTHONPATH=src:$PYTHONPATH`` keeps the bootstrap: no warning, patched; so
    does ``bash train.sh`` (the script given to the shell)."""
    script = _script(tmp_path / "train.sh",
                     f"#!/bin/sh\nexport PYTHONPATH=/opt/project/src:$PYTHONPATH\n"
                     f"python3 -c \"{BOOTSTRAPPED}\"\n")
    for command in ([str(script)], ["bash", str(script)]):
        done = _launch(*command)
        assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr
        assert done.stdout.split() == ["bootstrap"], done.stdout + done.stderr


@pytest.mark.parametrize("args, found", [
    (["-u", "-I", "train.py"], ["-I"]),
    (["-IB", "train.py", "-E"], ["-I"]),  # -E is the script's
    (["-c", "pass", "-I"], []),
    (["-m", "torch.distributed.run", "-E"], []),
    (["-W", "-I", "x.py"], []),  # -I is -W's value
    (["-Xdev", "-E", "x.py"], ["-E"]),
    (["--check-hash-based-pycs", "always", "-S", "x.py"], ["-S"]),
    (["-s", "-b", "x.py"], []),
    (["-Es", "-c", "pass"], ["-E"]),
])
def test_the_flags_are_read_as_python_reads_them(args, found) -> None:
    assert launcher.dropping_flags(args) == found
