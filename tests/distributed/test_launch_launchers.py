"""``training-patches run`` in front of the launchers that start many processes: torchrun
on two nodes, coqui's ``python -m trainer.distribute`` (ranks started as a bare
``python3``), and a command whose Python cannot be patched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jobs

PROBE = jobs.HERE / "ranks" / "launch_probe.py"
LAUNCHER = [sys.executable, "-m", "patches", "run"]


def _reports(folder: Path, ranks: int) -> dict[int, dict]:
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
    assert sorted(found) == list(range(ranks)), sorted(found)
    return found


def _two_nodes(out: Path, launcher: list[str]) -> dict[int, dict]:
    port = jobs.free_port()
    jobs.run_nodes([launcher + jobs.torchrun_command(PROBE, str(out), nproc=2, nnodes=2,
                                                     node_rank=node, port=port)
                    for node in (0, 1)])
    return _reports(out, 4)


def test_torchrun_on_two_nodes_patches_every_rank_of_each(tmp_path) -> None:
    """Node 0 and node 1 each started through ``training-patches run``: all four ranks
    of the one job are patched."""
    for name, launcher in (("launched", LAUNCHER), ("plain", [])):
        (tmp_path / name).mkdir()
        reports = _two_nodes(tmp_path / name, launcher)
        assert {r["world"] for r in reports.values()} == {4}  # one job of two nodes
        assert sorted(r["local_rank"] for r in reports.values()) == ["0", "0", "1", "1"]
        if launcher:
            for report in reports.values():
                assert report["applied"] is not None, f"rank {report['rank']} unpatched"
                assert "torch._tensor.Tensor.backward" in report["applied"]["nan_guard"], report
        else:  # the control: plain torchrun patches nothing
            assert all(r["applied"] is None for r in reports.values()), reports


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` folder of a fresh virtual environment without torch: a ``python3`` that
    comes first on PATH but cannot train (as a system Python often is)."""
    root = tmp_path_factory.mktemp("bare") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    return root / "bin"


def _distribute(out: Path, launcher: list[str], path: str) -> str:
    """coqui's launcher, 2 ranks: each started as ``python3 launch_probe.py ...``."""
    command = launcher + [sys.executable, "-m", "trainer.distribute", "--script", str(PROBE),
                          "--gpus", "0,1", f"--probe_out={out}"]
    env = jobs.rank_env(PATH=path)
    return jobs.run_job(command, env=env, timeout=240, check=False).stdout


@pytest.mark.xtts
def test_coqui_distribute_ranks_run_the_launchers_python(tmp_path, bare_python) -> None:
    """``python -m trainer.distribute`` starts its ranks as bare ``python3``: under the
    launcher that is the launcher's own interpreter, even when another ``python3`` (one
    without torch) comes first on PATH, and every rank is patched."""
    pytest.importorskip("trainer")
    path = os.pathsep.join([str(bare_python), os.environ.get("PATH", os.defpath)])
    launched, plain = tmp_path / "launched", tmp_path / "plain"
    launched.mkdir(), plain.mkdir()
    output = _distribute(launched, LAUNCHER, path)
    reports = _reports(launched, 2)
    for report in reports.values():
        assert Path(report["executable"]).parent == Path(sys.executable).parent, report
        assert "torch._tensor.Tensor.backward" in report["applied"]["nan_guard"], output
    # the control: without the launcher the ranks' python3 is the bare one, which has no
    # torch; no rank gets as far as reporting
    output = _distribute(plain, [], path)
    assert "No module named 'torch'" in output and not list(plain.iterdir()), output


def test_a_command_whose_python_cannot_be_patched_is_refused(tmp_path, bare_python) -> None:
    """``training-patches run PYTHON ...`` where PYTHON cannot import torch and the
    patches: one paragraph naming that interpreter, exit 2, nothing started."""
    marker = tmp_path / "started"
    for command in ([str(bare_python / "python3")], [str(bare_python / "python")]):
        done = subprocess.run(LAUNCHER + command + ["-c", f"open({str(marker)!r}, 'w')"],
                              env=jobs.rank_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        message = done.stderr.strip()
        assert command[0] in message and "cannot import torch and the patches" in message
        assert sys.executable in message and "\n" not in message  # one paragraph, a fix
        assert "No module named" not in message and not marker.exists()
    # a console script is judged by its #! line: torchrun of a Python without torch
    script = tmp_path / "torchrun"
    script.write_text(f"#!{bare_python / 'python3'}\nimport torch\n")
    script.chmod(0o755)
    done = subprocess.run(LAUNCHER + [str(script)], env=jobs.rank_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and f"the interpreter of {script}" in done.stderr, done.stderr
