"""Starting many-process jobs in tests: real ``torchrun``, gloo on the CPU.

:func:`run_job` never hangs: a job past its time limit is killed as a process group and
the test fails with its output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

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
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), str(HERE.parent)]),
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


def torchrun(script: str | Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None,
             timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun with ``nproc`` ranks (gloo on the CPU)."""
    return run_job(torchrun_command(script, *args, nproc=nproc), env=env, timeout=timeout,
                   check=check)


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
