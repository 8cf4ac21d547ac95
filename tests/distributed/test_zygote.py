"""The fork servers of the rank processes (zygote.py, through jobs.start_rank): a forked rank
is a process of its own as a fresh one is, its exit code and output come back, and a job
whose start-up environment differs runs a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jobs

PROBE = '''import sys
TORCH_FIRST = "torch" in sys.modules  # before this script imported anything
import json, os, signal, time
mode, out = sys.argv[1:]
with open(out + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
               "torch_first": TORCH_FIRST, "hash": hash("a str"), "argv": sys.argv,
               "cwd": os.getcwd(), "env": dict(os.environ), "name": __name__,
               "file": __file__, "path": sys.path, "main": sorted(vars()),
               "signals": {s.name: repr(signal.getsignal(s)) for s in (
                   signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE,
                   signal.SIGCHLD)}}, f)
os.replace(out + ".tmp", out)
print("probe says", mode)
if mode == "raise":
    raise ValueError("the probe fails on purpose")
if mode == "sleep":
    time.sleep(120)
sys.exit(int(mode))
'''
PER_PROCESS = ("pid", "sid", "pgid", "torch_first", "hash")


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``start(mode, local_rank=0, **env)``: the probe script as a rank, in ``tmp_path/cwd``;
    returns the rank, its log and the file where it says what it saw."""
    monkeypatch.delenv(jobs.NO_ZYGOTE, raising=False)
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    started = iter(range(100))

    def start(mode: str, local_rank: int = 0, **env: str) -> tuple[jobs.Rank, Path, Path]:
        name = f"{mode}-{next(started)}"
        out, log = tmp_path / f"saw-{name}.json", tmp_path / f"log-{name}"
        log.touch()
        env = jobs.rank_env(LOCAL_RANK=str(local_rank), TRAINING_PATCHES_PROBE=mode, **env)
        rank = jobs.start_rank([sys.executable, str(script), mode, str(out)], env, log)
        return rank, log, out

    return start


def _wait(rank: jobs.Rank, timeout: float = 60) -> int:
    try:
        return rank.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(rank.pid, signal.SIGKILL)
        raise


def test_a_forked_rank_is_a_process_of_its_own(probe, tmp_path: Path) -> None:
    seen = []
    for mode, code, local_rank in (("0", 0, 0), ("3", 3, 1)):
        rank, log, out = probe(mode, local_rank)
        assert isinstance(rank, jobs.Forked)
        assert _wait(rank) == code and rank.poll() == code and rank.returncode == code
        saw = json.loads(out.read_text())
        assert saw["pid"] == rank.pid != os.getpid()
        assert saw["sid"] == saw["pgid"] == rank.pid  # a session of its own, as now
        assert saw["argv"] == [str(tmp_path / "probe.py"), mode, str(out)]
        assert saw["cwd"] == str(tmp_path / "cwd")
        assert saw["env"]["TRAINING_PATCHES_PROBE"] == mode
        assert saw["env"]["LOCAL_RANK"] == str(local_rank)
        assert saw["torch_first"]  # forked after the server imported torch
        assert saw["name"] == "__main__" and saw["file"] == str(tmp_path / "probe.py")
        assert saw["path"][0] == str(tmp_path)
        assert log.read_text() == f"probe says {mode}\n"
        seen.append(saw)
    if "PYTHONHASHSEED" not in os.environ:  # two ranks, two servers: two str hash seeds
        assert seen[0]["hash"] != seen[1]["hash"]


def test_a_forked_rank_stopped_by_sigterm(probe) -> None:
    rank, _, out = probe("sleep")
    assert isinstance(rank, jobs.Forked)
    deadline = time.monotonic() + 60
    while not out.exists():  # it runs
        assert rank.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(rank.pid, signal.SIGTERM)
    assert _wait(rank) == -signal.SIGTERM


def test_a_rank_that_raises_exits_1_with_its_traceback(probe) -> None:
    rank, log, _ = probe("raise")
    assert isinstance(rank, jobs.Forked)
    assert _wait(rank) == 1
    said = log.read_text()
    assert "Traceback (most recent call last):" in said
    assert "ValueError: the probe fails on purpose" in said
    assert "zygote.py" not in said  # from the script's frame on, as in a fresh process


def test_a_different_start_up_environment_runs_a_fresh_process(probe, monkeypatch) -> None:
    rank, log, out = probe("0", OMP_NUM_THREADS="2")  # read when torch loads OpenMP
    assert isinstance(rank, subprocess.Popen)
    assert _wait(rank) == 0
    assert not json.loads(out.read_text())["torch_first"]


def test_a_forked_rank_sees_what_a_fresh_one_sees(probe, monkeypatch) -> None:
    """The same request, forked and (``TESTS_NO_ZYGOTE=1``) fresh: the same argv, paths,
    environment, ``__main__``, signal dispositions, output and exit code."""
    forked, forked_log, forked_out = probe("3")
    monkeypatch.setenv(jobs.NO_ZYGOTE, "1")
    fresh, fresh_log, fresh_out = probe("3")
    assert isinstance(forked, jobs.Forked) and isinstance(fresh, subprocess.Popen)
    assert _wait(forked) == _wait(fresh) == 3
    assert forked_log.read_text() == fresh_log.read_text() == "probe says 3\n"
    seen = [json.loads(out.read_text()) for out in (forked_out, fresh_out)]
    assert [s["torch_first"] for s in seen] == [True, False]
    for saw in seen:
        saw["env"].pop(jobs.NO_ZYGOTE, None)  # the one difference asked for
        for key in PER_PROCESS:
            del saw[key]
        saw["argv"].pop()  # its own file
    assert seen[0] == seen[1]


def test_a_rank_that_fails_stops_a_peer_that_still_runs(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 fails while rank 0 still runs: rank 0 is stopped (SIGTERM), as torchrun's agent
    stops it, and the job returns 1 with both outputs, long before rank 0 would end or the
    job's time limit (polling stopped at the first running rank once: this job timed out)."""
    monkeypatch.delenv(jobs.NO_ZYGOTE, raising=False)
    script = tmp_path / "peers.py"
    script.write_text("import os, sys, time\n"
                      "print('rank', os.environ['RANK'], 'started', flush=True)\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(600)\n", encoding="utf-8")
    result = jobs.ranks(script, timeout=90, check=False)
    assert result.returncode == 1
    assert "rank 0 started" in result.stdout and "rank 1 started" in result.stdout
