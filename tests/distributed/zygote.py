"""A fork server ("zygote") for the rank processes of tests/distributed/jobs.py.

Started with a job's environment, it imports torch, torch.distributed and numpy (never the
library under test) and forks one child per request; the child becomes ``python script.py
args...``: its own session, environment, working directory, output, fresh seeds and
``__main__``, and it ends as that interpreter ends (threads joined, atexit, finalization).
The rank scripts import torch first, so the child runs their code as a fresh process would,
less the ~2 s of CPU that import costs.

Protocol, one JSON object a line: it prints ``{"ready": true, "env": ...}``, then answers
each request ``{"argv", "env", "cwd", "umask", "log"}`` with ``{"pid": N}`` once the child
leads its own session (``{"error": ...}``: the client starts a fresh process instead), and
writes each child's exit code, as ``subprocess`` reports it, to ``<log>.<pid>.rc``. It
ends with its stdin.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import random
import select
import signal
import sys
import threading
import types
from importlib.machinery import SourceFileLoader
from typing import Any

# What this process was started with, as a fresh rank of the same client would be: the
# child restores them (SIGINT is Python's KeyboardInterrupt handler, SIGPIPE ignored, ...).
START_SIGNALS = {sig: signal.getsignal(sig) for sig in (
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD,
    signal.SIGPIPE, signal.SIGXFSZ)}


def _threads() -> int:
    """Threads of this process, native ones too (an OpenMP or BLAS pool): a fork copies
    only the calling thread, so locks another thread held stay held in the child."""
    return len(os.listdir("/proc/self/task"))


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())  # unbuffered: a child copies no buffer


def _write_rc(path: str, status: int) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(tmp, path)  # the client never reads half a number
    except OSError:
        pass  # the job's folder is gone: its client stopped waiting


def reap(children: dict[int, str]) -> None:
    """Write the exit code of each ended child to its file (``children``: pid -> file)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            _write_rc(path, status)


def fork_child(session: bool = True) -> int:
    """Fork a child; 0 in the child. With ``session`` the parent returns once the child
    leads its own session, so that ``os.killpg(pid, ...)`` reaches it from the start.
    RuntimeError where another thread runs (a fork copies only this one)."""
    if threading.active_count() != 1 or _threads() != 1:
        raise RuntimeError(f"{_threads()} threads: forking is unsafe")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        if session:
            os.setsid()
        os.close(r)
        os.close(w)
        return 0
    os.close(w)
    os.read(r, 1)  # end of file once the child closed its end (or died)
    os.close(r)
    return pid


def serve() -> dict[str, Any] | None:
    """Answer requests until stdin ends (None); in a forked child, return its request."""
    children: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        reap(children)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)  # not sys.stdin: its buffer would hide lines from select
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if not line.strip():
                continue
            request = json.loads(line)
            try:
                pid = fork_child()
            except Exception as exc:  # the client starts this rank as a fresh process
                _say({"error": f"{type(exc).__name__}: {exc}"})
                continue
            if pid == 0:
                return request
            children[pid] = f"{request['log']}.{pid}.rc"
            _say({"pid": pid})


def become(request: dict[str, Any]) -> types.ModuleType:
    """In the child: the process state of ``python script args...`` started by the client
    (``subprocess.Popen(..., start_new_session=True)``); returns its ``__main__`` module."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)  # the job's ranks share one log, their lines interleave as under torchrun
    os.dup2(log, 2)
    os.close(log)
    fresh_state(START_SIGNALS, request["env"], request["cwd"], request["umask"])
    script, *args = request["argv"]
    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(path)
    return new_main(path)


def fresh_state(signals: dict[int, Any], env: dict[str, str], cwd: str, umask: int) -> None:
    """In a forked child: what a fresh process started with ``env`` in ``cwd`` has (the
    signal dispositions it starts with, its own seeds, the folders listed anew)."""
    for sig, handler in signals.items():
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(env)  # putenv too: gloo and the C libraries read it
    os.chdir(cwd)
    os.umask(umask)
    # A fresh process seeds these from the OS; a fork would share the server's state.
    # (torch's default generator starts from a fixed seed, and no torch op ran here.)
    random.seed()
    sys.modules["numpy"].random.seed()
    importlib.invalidate_caches()  # files written since the server listed the folders


def new_main(path: str | None) -> types.ModuleType:
    """A fresh ``__main__`` module, for the script at ``path`` (None: ``-c`` or ``-m``).
    Not runpy.run_path: it puts the server's __main__ back when the script returns, while
    the atexit handlers and the finalization still run; and ``__file__`` is absolute."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=builtins, __cached__=None)
    if path is not None:
        main.__dict__.update(__file__=path, __loader__=SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    return main


def run_script(main: types.ModuleType) -> None:
    """Run the script as the interpreter runs ``python script.py`` (:func:`run_code`)."""
    path = main.__file__
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] "
              f"{exc.strerror}", file=sys.stderr)
        sys.exit(2)
    run_code(main, source, path)


def run_code(main: types.ModuleType, source: str | bytes, filename: str) -> None:
    """Run ``source`` in ``main`` as the interpreter runs a script; SystemExit and
    KeyboardInterrupt go on to the interpreter, which ends the process as it ends a fresh
    one (SIGINT for an unhandled KeyboardInterrupt). Another exception: its traceback from
    the script's frame on, exit code 1."""
    code = compile(source, filename, "exec", dont_inherit=True)  # no __future__ of this file
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # this file's frames: a fresh process has none
        exc.__traceback__ = tb  # the one printed (sys.excepthook's argument only if none)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        sys.excepthook(type(exc), exc, tb)
        sys.exit(1)


if __name__ == "__main__":
    # What every rank imports first, in a rank script's order (torch loads numpy itself,
    # and which library loads first may decide which OpenMP a process runs)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import numpy  # noqa: F401

    if threading.active_count() != 1 or _threads() != 1:
        _say({"ready": False, "why": f"{_threads()} threads after importing torch "
                                     f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"})
        sys.exit(0)
    # Ctrl-C is for the test run; the server ends when the client closes its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import gc

    gc.freeze()  # a rank's collections and its exit skip what the server imported
    _say({"ready": True, "pid": os.getpid(), "env": dict(os.environ)})
    request = serve()
    if request is not None:
        run_script(become(request))
