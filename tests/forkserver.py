"""A fork server for the Python processes the tests start (headlessXttsTrain.py, ``python -m
patches ...``, the client trainers): each child is forked from a server that has imported
torch, transformers and the other libraries those processes import and the patches never
patch, and becomes ``python script args`` (``-m module``, ``-c code``) with its own pipes,
environment, working directory, session and ``__main__``. A fresh process spends 3-4 s of
CPU importing them, most of such a test's time; the library under test, coqui's Trainer
and TTS are never imported by the server, so the child imports them in the order a fresh
process does. One server per environment the children start with; ``popen``/``run``
start a fresh process where no server can stand in for one (another interpreter option, no
server ready yet) and always under ``TESTS_NO_FORKSERVER=1``. What differs from a fresh
process: the children of one server share its string-hash seed, and its imports are done.

Protocol over a SOCK_SEQPACKET socket: ``{"ready": true}`` once; then each request
``{"argv", "env", "cwd", "umask", "session", "default_signals", "rc"}`` with the child's
stdin, stdout and stderr as passed descriptors, answered ``{"pid": N}`` (or ``{"error"}``);
the child's exit code is written to ``rc`` when the server reaps it (the zygote's ``reap``).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

from distributed.zygote import (START_SIGNALS, _threads, fork_child, fresh_state, new_main, reap,
                                run_code, run_script)

SMALL_XTTS = Path(__file__).resolve().parent / "small_xtts"
# What the started processes import that no patch site is (tests/test_forkserver.py checks):
# torch's compiler and distributed tensors, transformers' model code, coqui's audio stack
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
           "scipy.signal", "scipy.optimize", "scipy.stats", "transformers", "tokenizers", "safetensors", "huggingface_hub",
           "einops", "librosa", "coqpit", "soundfile", "fsspec", "torchaudio", "matplotlib")
# Variables the preloaded modules do not read at import: a child may set them its own way.
# Some are set in the test process by what its tests import (scikit-learn sets Intel
# OpenMP's KMP_*, which torch's GNU OpenMP never reads; Lightning sets the NVML check, read
# per call; tokenizers reads its parallelism per call too); OMP_NUM_THREADS is applied in
# the child (become).
FREE = re.compile(r"(TRAINING_PATCHES_|CLIENT_|PYTEST_|KMP_).*|DS_ACCELERATOR|PATH|PYTHONPATH|"
                  r"TORCHINDUCTOR_CACHE_DIR|OMP_NUM_THREADS|PYTORCH_NVML_BASED_CUDA_CHECK|"
                  r"TOKENIZERS_PARALLELISM")
# At most this many servers per test process, one per environment its children start with
# (an in-process coqui Trainer sets PYTHONHASHSEED for every later child: a server of its own)
MAX_SERVERS = 3


# -- the server --------------------------------------------------------------------------

def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Answer requests until the client closes its end (None); in a child, its request."""
    children: dict[int, str] = {}
    while True:
        readable, _, _ = select.select([sock], [], [], 0.02)
        reap(children)
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not data:
            return None
        request = json.loads(data)
        try:
            pid = fork_child(session=request["session"])
        except RuntimeError as exc:  # the client starts this one as a fresh process
            _send(sock, {"error": str(exc)})
            pid = -1
        if pid == 0:
            return request, fds
        for fd in fds:
            os.close(fd)  # the child's copies only: its pipes end when it does
        if pid > 0:
            children[pid] = request["rc"]
            _send(sock, {"pid": pid})


def become(request: dict[str, Any], fds: list[int], sock: socket.socket,
           start_signals: dict[int, Any]) -> types.ModuleType:
    """In the child: the state of a fresh ``python argv...`` (its ``__main__`` module)."""
    sock.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    server_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    fresh_state(start_signals, request["env"], request["cwd"], request["umask"])
    if request["default_signals"]:  # processes.default_signals, run before exec
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    # OpenMP read OMP_NUM_THREADS (1) when the server loaded it: the count a fresh process
    # would take from its own (or, without it, one thread per CPU it may run on)
    threads = request["env"].get("OMP_NUM_THREADS") or str(len(os.sched_getaffinity(0)))
    if threads.isdigit() and int(threads) != 1:
        sys.modules["torch"].set_num_threads(int(threads))
    mode, target, *args = request["argv"]
    if mode == "script":
        path = os.path.abspath(target)
        first, sys.argv = os.path.dirname(path), [target, *args]
    else:
        path, first = None, os.getcwd() if mode == "-m" else ""
        sys.argv = ["-c" if mode == "-c" else target, *args]
    child_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[: 1 + len([p for p in server_path if p])] = [first, *child_path]
    return new_main(path)


def run_main(mode: str, target: str, main: types.ModuleType) -> None:
    """Run as the interpreter runs it (the zygote's :func:`run_code`: its exit code and
    traceback as a fresh process's)."""
    if mode == "-m":
        import runpy  # lazy: the child's only

        runpy._run_module_as_main(target, alter_argv=True)
    elif mode == "-c":
        run_code(main, target, "<string>")
    else:
        run_script(main)


def _server_main(fd: int, sites: list[str], preload: list[str]) -> None:
    sock = socket.socket(fileno=fd)
    import importlib  # lazy: the server's only

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a library this machine lacks: its children import it themselves
    import importlib.metadata  # lazy: the server's only

    importlib.metadata.packages_distributions()  # coqui's scan, cached (small_xtts)
    found = sorted(name for name in sites if name in sys.modules)
    if found or _threads() != 1:
        _send(sock, {"ready": False, "why": f"sites {found}, {_threads()} threads"})
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the test run
    import gc  # lazy: the server's only

    gc.freeze()  # the children's collections skip what the server imported (and copy less)
    try:
        _send(sock, {"ready": True})
    except OSError:  # its client closed before the imports ended: nothing to serve
        return
    served = serve(sock)
    if served is not None:
        request, fds = served
        mode, target = request["argv"][:2]
        run_main(mode, target, become(request, fds, sock, START_SIGNALS))


# -- the client ----------------------------------------------------------------------------

def server_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of the server that forks a child with ``env``: the variables a
    preloaded module may read as the child has them, OMP_NUM_THREADS=1 and the small XTTS
    modules on PYTHONPATH."""
    return {**{k: v for k, v in env.items() if not FREE.fullmatch(k)},
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SMALL_XTTS)}


class Server:
    """The client of one server process, started with ``env``."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        from patches import _registry  # lazy: the sites it must not preload

        # torch's sites are imported before any patch in every process (the library imports
        # torch); every other site must be imported by the child itself, as in a fresh one
        sites = sorted({site.module for site, _, _ in _registry._declared()
                        if not site.module.startswith("torch")} | {"patches", "trainer", "TTS"})
        self.env = env
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), json.dumps(sites),
             json.dumps(preload)],
            pass_fds=[theirs.fileno()], env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, cwd=Path(__file__).parent)
        theirs.close()
        self.ready: bool | None = None
        self.why = ""  # what a server that is not ready said
        self.lock = threading.Lock()
        self.folder = tempfile.mkdtemp(prefix="forkserver-")
        atexit.register(self.close)

    def is_ready(self) -> bool:
        if self.ready is None and select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(1 << 16)
            said = json.loads(data) if data else {"why": "it ended"}
            self.ready, self.why = said.get("ready") is True, said.get("why", "")
        return bool(self.ready)

    def alive(self) -> bool:
        return self.proc.poll() is None

    @staticmethod
    def misfits(env: dict[str, str]) -> list[str]:
        """Why a child with ``env`` cannot be forked by the server :func:`server_for` gives it
        (which has every variable a preloaded module may read as ``env`` has it): a
        PYTHONPATH without the small XTTS modules its sitecustomize installed."""
        if str(SMALL_XTTS) in env.get("PYTHONPATH", "").split(os.pathsep):
            return []
        return ["PYTHONPATH without tests/small_xtts"]

    def fork(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The server's answer: ``{"pid": ...}``, or ``{"error": why}`` where it did not fork."""
        with self.lock:
            if not self.alive():
                return {"error": "the server ended"}
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            data = self.sock.recv(1 << 16)
        return json.loads(data) if data else {"error": "the server ended"}

    def close(self) -> None:
        if not self.is_ready() and self.ready is None:
            self.proc.kill()  # still importing: nothing it could serve
        self.sock.close()  # the server ends with its socket
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)  # its children's exit codes


_servers: dict[tuple[tuple[str, str], ...], Server] = {}
_asked: set[tuple[tuple[str, str], ...]] = set()


def _key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(server_env(env).items()))


def server_for(env: dict[str, str], start: bool = True) -> Server | None:
    """The ready server whose children start with ``env`` (None: none yet). A server starts
    for the second child asking for one environment, so that a one-off (a job's own
    variables) costs no server's imports; ``start`` starts it at once."""
    if os.environ.get("TESTS_NO_FORKSERVER") == "1":
        return None
    key = _key(env)
    server = _servers.get(key)
    if server is None and (key in _asked or start) and len(_servers) < MAX_SERVERS:
        server = _servers[key] = Server(server_env(env))
    _asked.add(key)
    return server if server is not None and server.is_ready() and server.alive() else None


def _mode(argv: list[str]) -> list[str] | None:
    """``["script"|"-m"|"-c", target, *args]`` for ``python ...`` argv, else None."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] in ("-m", "-c") and len(argv) > 2:
        return [argv[1], *argv[2:]]
    return None if argv[1].startswith("-") else ["script", *argv[1:]]


class Forked(subprocess.Popen):
    """``subprocess.Popen`` whose child is forked by the server: the pipes, ``communicate``,
    ``send_signal`` and ``wait`` are Popen's own; the wait status comes from the server."""

    def __init__(self, argv: list[str], server: Server, mode: list[str], **kwargs: Any):
        self._server, self._mode = server, mode
        self._session = bool(kwargs.get("start_new_session"))
        self._rc = os.path.join(server.folder, f"{time.monotonic_ns()}-{threading.get_ident()}")
        super().__init__(argv, **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any,
                       pass_fds: Any, cwd: Any, env: Any, startupinfo: Any,
                       creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                       *rest: Any) -> None:
        request = {"argv": self._mode, "env": dict(env if env is not None else os.environ),
                   "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
                   "umask": _umask(), "session": self._session,
                   "default_signals": preexec_fn is not None, "rc": self._rc}
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2]
        answer = self._server.fork(request, fds)
        pid = answer.get("pid")
        _note("forked" if pid else f"fresh (the server: {answer.get('error')})", self.args)
        if pid is None:  # the server could not: a fresh process, as Popen starts it
            super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd,
                                   env, startupinfo, creationflags, shell, p2cread, p2cwrite,
                                   c2pread, c2pwrite, errread, errwrite, *rest)
            self._rc = ""
            return
        self.pid, self._child_created = pid, True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _status(self) -> int | None:
        """The child's wait status, from the exit code the server wrote (-N: signal N)."""
        try:
            code = int(Path(self._rc).read_text())
            return code << 8 if code >= 0 else -code
        except (FileNotFoundError, ValueError):
            if not self._server.alive() and not _alive(self.pid):
                return 1 << 8  # no server left to say it: exit code 1, not a hang
            return None

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if not self._rc:
            return super()._try_wait(wait_flags)
        while True:
            status = self._status()
            if status is not None:
                return self.pid, status
            if wait_flags & os.WNOHANG:
                return 0, 0
            time.sleep(0.01)

    def _internal_poll(self, _deadstate: Any = None, **_: Any) -> int | None:
        if not self._rc:
            return super()._internal_poll(_deadstate=_deadstate)
        if self.returncode is None:
            pid, status = self._try_wait(os.WNOHANG)
            if pid == self.pid:
                self._handle_exitstatus(status)
        return self.returncode


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    from processes import alive  # lazy: a helper of the tests' own

    return alive(pid)


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **kwargs)``, forked by the server where it can stand in for
    a fresh process."""
    from processes import default_signals  # lazy: a helper of the tests' own

    mode = _mode([str(a) for a in argv])
    env = kwargs.get("env")
    plain = not set(kwargs) - {"env", "cwd", "stdin", "stdout", "stderr", "text",
                               "start_new_session", "preexec_fn", "encoding", "errors",
                               "universal_newlines", "bufsize"}
    if mode is not None and plain and kwargs.get("preexec_fn") in (None, default_signals):
        child_env = dict(env if env is not None else os.environ)
        server = server_for(child_env, start=False)
        why = ["no server ready"] if server is None else server.misfits(child_env)
        if server is not None and not why:
            return Forked([str(a) for a in argv], server, mode, **kwargs)
        _note(f"fresh ({', '.join(why)})", argv)
    else:
        _note("fresh (not python with a script, -m or -c and plain arguments)", argv)
    return subprocess.Popen(argv, **kwargs)


def _note(what: str, argv: list[Any]) -> None:
    """With TESTS_FORKSERVER_LOG=FILE: a line per process started, forked or fresh and why."""
    log = os.environ.get("TESTS_FORKSERVER_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{what}: {' '.join(map(str, argv))[:200]}\n")


def run(argv: list[str], *, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` over :func:`popen`."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(argv, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        except BaseException:
            process.kill()
            raise
        retcode = process.poll()
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, process.args, output=stdout,
                                                stderr=stderr)
    return subprocess.CompletedProcess(process.args, retcode, stdout, stderr)


if __name__ == "__main__":
    _server_main(int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]))
