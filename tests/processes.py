"""Processes of the signal and run-folder tests: headlessXttsTrain.py started in its own
process group (so that what is left of it after it exits can be looked for), waiting on a
line a run writes, and whether a process or a process group still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "headlessXttsTrain.py"
# XTTS's never-trained modules at small widths, in every process a test starts
# (tests/small_xtts/sitecustomize.py says why)
SMALL_XTTS = Path(__file__).resolve().parent / "small_xtts"


def child_path(*paths: str | os.PathLike[str]) -> str:
    """The PYTHONPATH of a process a test starts: ``paths``, then :data:`SMALL_XTTS`."""
    return os.pathsep.join([*(str(p) for p in paths), str(SMALL_XTTS)])


def exit_after_atexit(code: int = 0) -> None:
    """The end of a rank process whose work is done and written: run the exit handlers
    (the library's own records at exit among them), flush, and leave without the
    interpreter's teardown. There torch 2.14.1's gloo threads abort the process now and then
    ("terminate called without an active exception", SIGABRT) after every check passed,
    more often on a loaded machine (``make test`` runs a worker per core)."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def default_signals() -> None:
    """In a child, before it runs: SIGINT, SIGTERM and SIGHUP at their default disposition,
    whatever the test run inherited (under ``nohup`` SIGHUP is ignored, and an ignored
    signal is one the patches leave alone, rightly)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def start_headless(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``headlessXttsTrain.py args...`` in a new session; stdout and stderr together."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT))
    return forkserver.popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                            start_new_session=True, preexec_fn=default_signals)


def wait_for_text(path: Path, text: str, proc: subprocess.Popen[str],
                  timeout: float = 900) -> None:
    """Until ``path`` holds ``text``, ``proc`` still running (``timeout`` only turns a hang
    into a failure; nothing is decided by it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(encoding="utf-8", errors="replace"):
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}")


def _running(states: str) -> bool:
    return any(not state.startswith("Z") for state in states.split())  # a zombie has ended


def alive(pid: int) -> bool:
    """Whether the process ``pid`` runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _running(subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                                   text=True).stdout)


def group_left(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return _running(subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True,
                                   text=True).stdout)


def tiny_run(tmp_path: Path, *extra: str) -> tuple[Path, list[str]]:
    """A tiny Amharic base and dataset in ``tmp_path``: (the output folder, the arguments of
    a headless run into it, ``extra`` appended)."""
    from conftest import write_amharic_base

    tiny, base = write_amharic_base(tmp_path)
    out = tmp_path / "out"
    return out, ["--base-dir", str(base), "--train-manifest", str(tiny.manifest), "--language",
                 "am", "--output-dir", str(out), "--batch-size", "2", "--lr", "1e-4",
                 "--print-step", "1", *extra]
