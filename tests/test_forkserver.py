"""The fork server of the tests' Python processes (tests/forkserver.py): a forked child is
the process a fresh ``python script`` / ``-m`` / ``-c`` would be (its argv, path, working
directory, environment, signals, pipes, exit code), less the imports the server made; a child
the server cannot stand in for runs as a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
from processes import child_path, default_signals

# Each comparison starts a fresh process beside the forked one, and a server imports for
# seconds: not the unit tier's
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PROBE = '''import sys
FIRST = sorted(m for m in ("torch", "transformers", "patches", "TTS", "trainer")
               if m in sys.modules)  # before this code imported anything
import json, os, signal
print(json.dumps({"first": FIRST, "pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv,
                  "path": sys.path, "cwd": os.getcwd(), "name": __name__,
                  "file": globals().get("__file__"), "stdin": sys.stdin.read(),
                  "env": {k: v for k, v in os.environ.items() if k.startswith("CLIENT_")},
                  "threads": __import__("torch").get_num_threads(),
                  "signals": {s.name: repr(signal.getsignal(s)) for s in (
                      signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)}}))
print("to stderr", file=sys.stderr)
if sys.argv[-1] == "raise":
    raise ValueError("the probe fails on purpose")
if sys.argv[-1] == "sleep":
    sys.stdout.flush()
    signal.pause()
sys.exit(int(sys.argv[-1]))
'''
PER_PROCESS = ("first", "pid", "sid")


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> forkserver.Server:
    """This worker's server, ready (it imports for a few seconds)."""
    monkeypatch.delenv("TESTS_NO_FORKSERVER", raising=False)
    env = dict(os.environ)
    forkserver.server_for(env)
    server = forkserver._servers[forkserver._key(env)]
    deadline = time.monotonic() + 120
    while not server.is_ready():
        assert server.alive() and time.monotonic() < deadline, f"no server: {server.why}"
        time.sleep(0.1)
    return server


def _both(monkeypatch: pytest.MonkeyPatch, argv: list[str], **kwargs):
    """(forked, fresh) ``run(argv, **kwargs)``."""
    done = []
    for fresh in ("0", "1"):
        monkeypatch.setenv("TESTS_NO_FORKSERVER", fresh)
        done.append(forkserver.run(argv, capture_output=True, text=True, timeout=120,
                                   **kwargs))
    monkeypatch.delenv("TESTS_NO_FORKSERVER")
    return done


@pytest.mark.parametrize("how", ["script", "-m", "-c"])
def test_a_forked_child_sees_what_a_fresh_one_sees(server, monkeypatch, tmp_path: Path,
                                                   how: str) -> None:
    (tmp_path / "probe_mod.py").write_text(PROBE, encoding="utf-8")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    argv = {"script": [str(tmp_path / "probe_mod.py")], "-m": ["-m", "probe_mod"],
            "-c": ["-c", PROBE]}[how]
    env = dict(os.environ, PYTHONPATH=child_path(tmp_path), CLIENT_PROBE="x",
               TRAINING_PATCHES_QUIET="1")
    env.pop("OMP_NUM_THREADS", None)  # the server's is 1: the child takes a fresh one's
    assert server.misfits(env) == []
    forked, fresh = _both(monkeypatch, [sys.executable, *argv, "a b", "3"], input="to stdin",
                          env=env, cwd=cwd, start_new_session=True,
                          preexec_fn=default_signals)
    assert (forked.returncode, fresh.returncode) == (3, 3), forked.stderr + fresh.stderr
    assert forked.stderr == fresh.stderr == "to stderr\n"
    saw, saw_fresh = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert saw["first"] == ["torch", "transformers"] and saw_fresh["first"] == []
    assert saw["sid"] == saw["pid"] != os.getpid() and saw_fresh["sid"] == saw_fresh["pid"]
    assert {k: v for k, v in saw.items() if k not in PER_PROCESS} == \
        {k: v for k, v in saw_fresh.items() if k not in PER_PROCESS}
    assert saw["stdin"] == "to stdin" and saw["env"] == {"CLIENT_PROBE": "x"}


def test_a_failing_child_exits_1_with_its_own_traceback(server, monkeypatch,
                                                        tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=child_path(), OMP_NUM_THREADS="1")
    assert server.misfits(env) == []
    forked, fresh = _both(monkeypatch, [sys.executable, str(script), "raise"], env=env)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr.splitlines()[-1] == "ValueError: the probe fails on purpose"
    assert "forkserver" not in forked.stderr  # no frame of the server's
    assert forked.stderr.count("File ") == fresh.stderr.count("File ") == 1


def test_a_forked_child_in_its_session_ends_by_a_signal_to_its_group(server,
                                                                     tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    child = forkserver.popen([sys.executable, str(script), "sleep"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=default_signals, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, PYTHONPATH=child_path(),
                                      OMP_NUM_THREADS="1"))
    assert isinstance(child, forkserver.Forked)
    saw = json.loads(child.stdout.readline())
    assert saw["pid"] == child.pid and saw["first"] == ["torch", "transformers"]
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    child.communicate()


def test_a_child_the_server_cannot_stand_in_for_runs_fresh(server, tmp_path: Path) -> None:
    """The first child with an environment a preloaded module reads at import
    (MKL_NUM_THREADS: a server of its own starts for the second), another interpreter
    option: a fresh process."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=child_path(), OMP_NUM_THREADS="1")
    for argv, extra in (([sys.executable, str(script), "0"], {"MKL_NUM_THREADS": "1"}),
                        ([sys.executable, "-X", "utf8", str(script), "0"], {})):
        child = forkserver.popen(argv, env={**env, **extra}, stdout=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True)
        assert type(child) is subprocess.Popen
        assert json.loads(child.communicate(timeout=120)[0])["first"] == []


def test_a_server_whose_imports_reach_a_patch_site_forks_nothing() -> None:
    """Preloading coqui's Trainer (a site) would let the child find it imported before the
    patches: such a server says so and never becomes ready."""
    bad = forkserver.Server(forkserver.server_env(dict(os.environ)), preload=("numpy", "trainer"))
    try:
        assert bad.proc.wait(timeout=120) == 0
        assert not bad.is_ready() and bad.ready is False
        assert "trainer" in bad.why
    finally:
        bad.close()


def test_children_with_a_fixed_hash_seed_get_a_server_started_with_it(
        server, monkeypatch, tmp_path: Path) -> None:
    """An in-process coqui Trainer leaves PYTHONHASHSEED in the test process's environment,
    and every later child inherits it: the server that forks them is started with it, so a
    forked child hashes as a fresh one does."""
    monkeypatch.setattr(forkserver, "MAX_SERVERS", len(forkserver._servers) + 1)
    code = "import sys; print(hash('a str'), 'torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=child_path(), OMP_NUM_THREADS="1", PYTHONHASHSEED="123")
    argv = [sys.executable, "-c", code]
    first = forkserver.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert first.stdout.split()[1] == "False"  # the first asks for a server, runs fresh
    forkserver.server_for(env)
    seeded = forkserver._servers[forkserver._key(env)]
    assert seeded is not server and seeded.env["PYTHONHASHSEED"] == "123"
    deadline = time.monotonic() + 120
    while not seeded.is_ready():
        assert seeded.alive() and time.monotonic() < deadline, seeded.why
        time.sleep(0.1)
    forked, fresh = _both(monkeypatch, argv, env=env)
    assert forked.stdout.split() == [first.stdout.split()[0], "True"]
    assert fresh.stdout.split() == [first.stdout.split()[0], "False"]
