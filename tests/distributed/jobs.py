"""Starting many-process jobs in tests, gloo on the CPU.

:func:`ranks` starts a job's ranks the way ``torchrun`` starts its workers (the same
environment variables, each rank in its own session, the others stopped when one fails),
without torchrun's agent process (it imports torch.distributed.elastic for each job). Each
rank is forked from a server that imported torch, torch.distributed and numpy and nothing
else (zygote.py; one per local rank in a test process): the rank scripts import torch
first, and the child gets the environment, session, output, seeds and ``__main__`` of a
fresh ``python script`` and ends as one ends, less the ~2 s of CPU of that import. A job
whose environment differs in what start-up may read, and every job under
``TESTS_NO_ZYGOTE=1``, runs fresh processes. The launchers' tests run the real ``torchrun``.

No job hangs a test: a job past its time limit is stopped (SIGTERM to every rank's
session, then SIGKILL) and the test fails with its output.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import pytest
from processes import alive, child_path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(**extra: str) -> dict[str, str]:
    """The environment of a job: this repository first on PYTHONPATH, one thread a rank,
    no TRAINING_PATCHES_* setting inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    env.update(PYTHONPATH=child_path(REPO, HERE, HERE.parent),
               OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun_command(script: str | Path, *args: str, nproc: int = 2, nnodes: int = 1,
                     node_rank: int = 0, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` for ``script`` on this host."""
    port = port or free_port()
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
            f"--master-port={port}", "--max-restarts=0", str(script), *map(str, args)]


def run_job(command: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 240,
            cwd: str | Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a job in its own process group; kill the whole group past ``timeout``."""
    proc = subprocess.Popen(list(command), env=env or rank_env(), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = _stop(proc)
        pytest.fail(f"job timed out after {timeout}s: {' '.join(command)}\n{out[-6000:]}")
    result = subprocess.CompletedProcess(command, proc.returncode, out, None)
    if check and proc.returncode != 0:
        pytest.fail(f"job exited {proc.returncode}: {' '.join(command)}\n{out[-6000:]}")
    return result


def _stop(proc: subprocess.Popen) -> str:
    """End a job that ran past its time: SIGTERM to its group first (torchrun passes it on
    to its ranks, which run in sessions of their own), then SIGKILL; never wait unbounded."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=grace)
            return out or ""
        except subprocess.TimeoutExpired:
            continue
    return "(no output: the job's ranks still hold its pipe)"


def ranks(script: str | Path, *args: object, nproc: int = 2, env: dict[str, str] | None = None,
          timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` as one job of ``nproc`` ranks on this host, each started with the
    environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT`` for ``init_process_group``, ``TORCHELASTIC_RUN_ID``
    unique to the job), in its own session, forked from a server that imported torch
    (:func:`start_rank`). Their output interleaves in ``stdout`` as under torchrun. As
    torchrun does, when one rank fails the others get SIGTERM, then SIGKILL 30 s later;
    the return code is 0 when every rank exited 0, else 1."""
    port = free_port()
    base = env or rank_env()
    common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                  LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                  ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc),
                  TORCHELASTIC_RUN_ID=f"tests-{os.getpid()}-{port}",
                  TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    command = [sys.executable, str(script), *map(str, args)]
    if forking():
        for r in range(nproc):
            zygote(r)  # started together: they import torch at once
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        log = Path(folder) / "log"
        log.touch()
        procs = [start_rank(command, {**base, **common, "RANK": str(r), "LOCAL_RANK": str(r),
                                      "ROLE_RANK": str(r)}, log)
                 for r in range(nproc)]
        timed_out = _wait_ranks(procs, time.monotonic() + timeout)
        out = log.read_text(errors="replace")
    said = f"{nproc} ranks of {' '.join(command)}"
    if timed_out:
        pytest.fail(f"job timed out after {timeout}s: {said}\n{out[-6000:]}")
    codes = [p.returncode for p in procs]
    rc = 0 if all(c == 0 for c in codes) else 1
    if check and rc != 0:
        pytest.fail(f"job failed (rank exit codes {codes}): {said}\n{out[-6000:]}")
    return subprocess.CompletedProcess(command, rc, out, None)


# -- ranks forked from servers that imported torch (zygote.py) -------------------------

NO_ZYGOTE = "TESTS_NO_ZYGOTE"  # =1: every rank a fresh process (not TRAINING_PATCHES_*:
# the library refuses a variable of its prefix it does not know, in the test process too)
# The variables a forked rank may have otherwise than its server: the job's and the rank's
# (torchrun's, the library's settings, pytest's name of the test), read only by the rank
# script. Any other difference runs a fresh process: what is read at start-up cannot be
# listed (PYTHON*, OMP_*, TORCH_*, LD_*, ... by name; torch's import of tqdm reads TQDM_*
# by scanning the environment), while none of these is read then (checked: torch 2.14.1).
PER_RANK = re.compile(r"((LOCAL_|GROUP_|ROLE_)?(RANK|WORLD_SIZE)|ROLE_NAME|MASTER_ADDR|"
                      r"MASTER_PORT|PYTEST_CURRENT_TEST)$|TORCHELASTIC_|TRAINING_PATCHES_")


class Forked:
    """A rank forked by a server: the part of ``subprocess.Popen`` the jobs use. Its exit
    code comes from the file the server writes when it reaps it."""

    def __init__(self, pid: int, rc_file: Path, server: Zygote) -> None:
        self.pid, self.rc_file, self.server = pid, rc_file, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self.rc_file.read_text())
            except FileNotFoundError:
                if not self.server.alive() and not alive(self.pid):
                    self.returncode = 1  # no server left to report it: a failure, not a hang
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


Rank = subprocess.Popen | Forked  # what start_rank returns


class Zygote:
    """The client of one zygote.py server, started with ``env`` (it imports torch while the
    test goes on; :meth:`can_fork` waits for it)."""

    def __init__(self, env: dict[str, str], ready_timeout: float = 120) -> None:
        self.env, self.ready_timeout = env, ready_timeout
        self.proc = subprocess.Popen([sys.executable, str(HERE / "zygote.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=HERE)  # a folder no test removes
        atexit.register(self.close)
        self.ok: bool | None = None  # not known until it says it is ready
        self.startup: dict[str, str] = {}

    def _ready(self) -> bool:
        if self.ok is None:
            ready = self._answer(self.ready_timeout)
            self.ok = bool(ready and ready.get("ready"))
            # What the interpreter's start set in its environment (LC_CTYPE in a C locale)
            # and a fresh rank's start sets too
            self.startup = {k: v for k, v in (ready or {}).get("env", {}).items()
                            if self.env.get(k) != v}
        return self.ok

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        """The server's next protocol line (None: it ended, or said nothing in ``timeout``).
        Other lines (something torch printed while the server imported it) are skipped."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))[0]:
            line = self.proc.stdout.readline()
            if not line:
                return None
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict):
                return answer
        return None

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a rank with ``env`` may be forked: the server runs, and only
        :data:`PER_RANK` variables differ from its environment."""
        if not (self._ready() and self.alive()):
            return False
        return all(self.env.get(k) == env.get(k) for k in self.env.keys() | env.keys()
                   if not PER_RANK.match(k))

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, log: Path) -> Forked | None:
        """``python *argv`` forked by the server (None: it could not, start it fresh)."""
        assert self.proc.stdin is not None
        umask = os.umask(0o022)  # the only way to read it; a fresh process inherits it
        os.umask(umask)
        request = {"argv": argv, "env": {**env, **self.startup}, "cwd": cwd, "log": str(log),
                   "umask": umask}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self.ok = False
            return None
        answer = self._answer(60)
        if answer is None:
            self.ok = False  # ended or stuck: every later rank starts fresh
            return None
        if "pid" not in answer:
            return None  # it refused (a thread it should not have): this rank starts fresh
        return Forked(answer["pid"], Path(f"{log}.{answer['pid']}.rc"), self)

    def close(self) -> None:
        """End the server (at exit): end of its stdin, then a bounded wait, then SIGKILL."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# One server per local rank: the ranks of a job come from different processes, each with
# its own str hash seed and address layout, as fresh ranks are (a fork shares both).
_servers: dict[int, Zygote] = {}


def zygote(local_rank: int = 0) -> Zygote:
    """This test process's server for ``local_rank``, started on first use with
    :func:`rank_env`."""
    if local_rank not in _servers:
        _servers[local_rank] = Zygote(rank_env())
    return _servers[local_rank]


def forking() -> bool:
    """Whether ranks are forked (``TESTS_NO_ZYGOTE=1``: fresh processes, to compare)."""
    return os.environ.get(NO_ZYGOTE) != "1"


def start_rank(command: list[str], env: dict[str, str], log: Path) -> Rank:
    """Start ``command`` (``[sys.executable, script, *args]``) in its own session in this
    working directory, output appended to ``log``: forked from the server of its
    ``LOCAL_RANK`` when that is equivalent to a fresh process, else a fresh process."""
    if forking() and command[0] == sys.executable:
        server = zygote(int(env.get("LOCAL_RANK", "0")))
        forked = server.fork(command[1:], env, os.getcwd(), log) if server.can_fork(env) \
            else None
        if forked is not None:
            return forked
    # A fresh process: asked for, the server did not start or could not fork, or the job's
    # environment differs from the server's in what start-up may read.
    with open(log, "a") as sink:  # O_APPEND: the ranks' lines interleave, none overwritten
        return subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def rank_results(script: str | Path, out: Path, *args: object, nproc: int = 2,
                 timeout: float = 240) -> list[dict]:
    """Run ``script OUT *args`` as :func:`ranks` does and load what each rank saved as
    ``OUT/result<rank>.pt`` (the rank scripts' convention), in rank order."""
    import torch  # lazy: the launcher tests of this module need no torch

    ranks(script, str(out), *args, nproc=nproc, timeout=timeout)
    return [torch.load(Path(out) / f"result{rank}.pt") for rank in range(nproc)]


def _wait_ranks(procs: list[Rank], deadline: float) -> bool:
    """Wait for every rank; stop the rest when one fails (torchrun's agent does), and all
    of them past ``deadline``. Returns whether the deadline was passed."""
    stop_at: float | None = None
    while None in [p.poll() for p in procs]:  # each polled: any() stopped at a running one
        now = time.monotonic()
        if now > deadline:
            _signal_all(procs, signal.SIGTERM)
            _reap(procs, 15)
            return True
        if stop_at is None and any(p.returncode not in (None, 0) for p in procs):
            _signal_all(procs, signal.SIGTERM)
            stop_at = now + 30
        elif stop_at is not None and now > stop_at:
            _reap(procs, 0)  # SIGKILL once, then wait for every rank
            break
        time.sleep(0.05)
    return False


def _signal_all(procs: list[Rank], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


def _reap(procs: list[Rank], grace: float) -> None:
    end = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.05)
    _signal_all(procs, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_nodes(commands: list[list[str]], *, timeout: float = 240,
              check: bool = True) -> list[subprocess.CompletedProcess]:
    """Start every node's command at once (they rendezvous with each other, e.g. torchrun
    with ``nnodes=2``); stop all of them past ``timeout``."""
    procs = [subprocess.Popen(c, env=rank_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for c in commands]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail("the nodes timed out:\n" + "\n".join(_stop(p)[-3000:] for p in procs))
    results = [subprocess.CompletedProcess(c, p.returncode, out, None)
               for c, p, out in zip(commands, procs, outputs)]
    if check:
        for result in results:
            assert result.returncode == 0, result.stdout[-4000:]
    return results


def two_nodes(script: str | Path, *args: object, timeout: float = 240,
              check: bool = True) -> list[subprocess.CompletedProcess]:
    """``script`` as one job of two torchrun launchers (two "nodes" on this host, one rank
    each: node 0 holds global rank 0), both started at once."""
    port = free_port()
    return run_nodes([torchrun_command(script, *map(str, args), nproc=1, nnodes=2,
                                       node_rank=node, port=port) for node in (0, 1)],
                     timeout=timeout, check=check)
