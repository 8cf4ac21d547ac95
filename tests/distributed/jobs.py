"""Starting many-process jobs in tests, gloo on the CPU.

:func:`ranks` starts a job's ranks the way ``torchrun`` starts its workers (the same
environment variables, each rank in its own session, the others stopped when one fails),
without torchrun's agent process: that process imports torch and torch.distributed.elastic
for each job (about 1.7 s of CPU, on 45 jobs a minute of the suite). The tests of the
launchers themselves (test_launch_launchers) run the real ``torchrun``
(:func:`torchrun_command`, :func:`run_job`, :func:`two_nodes`).

No job hangs a test: a job past its time limit is stopped (SIGTERM to every rank's
session, then SIGKILL) and the test fails with its output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import pytest
from processes import child_path

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
    unique to the job). Their output interleaves in ``stdout`` as under torchrun. As
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
    with tempfile.TemporaryFile("w+") as log:
        procs = [subprocess.Popen(command, env={**base, **common, "RANK": str(r),
                                                "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                                  stdout=log, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
                 for r in range(nproc)]
        timed_out = _wait_ranks(procs, time.monotonic() + timeout)
        log.seek(0)
        out = log.read()
    said = f"{nproc} ranks of {' '.join(command)}"
    if timed_out:
        pytest.fail(f"job timed out after {timeout}s: {said}\n{out[-6000:]}")
    codes = [p.returncode for p in procs]
    rc = 0 if all(c == 0 for c in codes) else 1
    if check and rc != 0:
        pytest.fail(f"job failed (rank exit codes {codes}): {said}\n{out[-6000:]}")
    return subprocess.CompletedProcess(command, rc, out, None)


def rank_results(script: str | Path, out: Path, *args: object, nproc: int = 2,
                 timeout: float = 240) -> list[dict]:
    """Run ``script OUT *args`` as :func:`ranks` does and load what each rank saved as
    ``OUT/result<rank>.pt`` (the rank scripts' convention), in rank order."""
    import torch  # lazy: the launcher tests of this module need no torch

    ranks(script, str(out), *args, nproc=nproc, timeout=timeout)
    return [torch.load(Path(out) / f"result{rank}.pt") for rank in range(nproc)]


def _wait_ranks(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every rank; stop the rest when one fails (torchrun's agent does), and all
    of them past ``deadline``. Returns whether the deadline was passed."""
    stop_at: float | None = None
    while any(p.poll() is None for p in procs):
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


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass


def _reap(procs: list[subprocess.Popen], grace: float) -> None:
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
