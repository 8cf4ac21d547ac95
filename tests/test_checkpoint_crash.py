"""Crash suite: a real training process killed with SIGKILL at random moments.

Half of the kills land between two training steps, half inside a save: while the
checkpoint's bytes are written, before its rename, before its manifest, before ``latest``
and in the middle of a prune. The moments are drawn at random (seeded), and each is
reached by the worker itself: at that point it writes ``stopped ...`` to its log and
waits, and only then is it killed. No sleep decides where a kill lands, so the suite is
the same on a loaded machine (issue 26 item 9). After every kill:

- ``CheckpointManager.resume("auto")`` finds a checkpoint, it validates, and
  ``load_checkpoint`` loads it in a fresh model (every resume succeeds);
- no file vouched for by a manifest is torn (a torn file is never picked);
- no checkpoint disappears unless ``keep`` newer complete ones exist, and the user's
  own files in the folder are byte-identical;
and at the end, every loss the killed-and-resumed processes logged equals, step by
step and bit for bit, the loss of one uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from patches.checkpoint import CheckpointManager, check_file, load_checkpoint, manifest_path
from tiny_models import TinyGPT

torch.set_num_threads(1)

TRIALS = 22
KEEP = 3
REPO = Path(__file__).resolve().parents[1]

WORKER = r'''
import os, pathlib, random, sys, time
import numpy as np
import torch
from torch import nn
torch.set_num_threads(1)
from patches.advanced import SafeGradScaler
from patches.checkpoint import CheckpointManager, load_checkpoint
from tiny_models import TinyGPT

VOCAB, HIDDEN = 1500, 192


def Model() -> nn.Module:
    return TinyGPT(VOCAB, HIDDEN, dropout=0.1)


def block(log, why):
    """A kill point reached: say so, then wait for the SIGKILL."""
    log.write(f"stopped {why}\n")
    log.flush()
    while True:
        time.sleep(3600)


def arm(log, stop, point, nbytes, saving):
    """Make the save of step ``stop`` wait at ``point`` (``saving[0]``: the step being saved)."""
    from patches.checkpoint import manager as mgr

    def armed():
        return saving[0] == stop

    real_write = mgr.write_atomically

    def write_atomically(path, write, **kwargs):
        if not (armed() and point == "write" and mgr.CheckpointManager.PATTERN.match(path.name)):
            return real_write(path, write, **kwargs)

        class Tripwire:  # the checkpoint's bytes: stop once nbytes of them are written
            def __init__(self, handle):
                self.handle, self.size = handle, 0

            def write(self, data):
                written = self.handle.write(data)
                self.size += memoryview(data).nbytes
                if self.size >= nbytes:
                    self.handle.flush()
                    block(log, f"{stop} write {self.size}")
                return written

            def flush(self):
                self.handle.flush()
        return real_write(path, lambda handle: write(Tripwire(handle)), **kwargs)

    mgr.write_atomically = write_atomically
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(dst))
        if armed():
            if point in ("write", "rename") and name.endswith(".pt"):
                block(log, f"{stop} {point}")  # "write": its byte count was past the end
            if point == "manifest" and name.endswith(".manifest.json"):
                block(log, f"{stop} manifest")
            if point == "latest" and name == "latest":
                block(log, f"{stop} latest")
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
    real_unlink = pathlib.Path.unlink

    def unlink(self, *args, **kwargs):
        # A prune removes the manifest, then the file: stop between the two.
        if armed() and point == "prune" and mgr.CheckpointManager.PATTERN.match(self.name):
            block(log, f"{stop} prune {self.name}")
        return real_unlink(self, *args, **kwargs)

    pathlib.Path.unlink = unlink


def main(out, log_path, total, save_every, stop=0, point="", nbytes=0):
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    scaler = SafeGradScaler("cpu", init_scale=128.0, growth_interval=5)
    data = torch.randint(0, VOCAB, (40, 8), generator=torch.Generator().manual_seed(1))
    manager = CheckpointManager(out, keep=%(keep)d)
    log = open(log_path, "a", buffering=1)
    saving = [None]
    if point and point != "step":
        arm(log, stop, point, nbytes, saving)
    step, epoch, pos = 0, 0, 0
    if save_every:
        path = manager.resume("auto")
        if path is not None:
            report = load_checkpoint(path, model, opt, sched, scaler)
            step, epoch, pos = report.step, report.extra["epoch"], report.extra["pos"]
            log.write(f"resumed {step} {path.name}\n")
    log.write("ready\n")
    while step < total:
        order = np.random.RandomState(epoch).permutation(len(data))
        while pos < len(order) and step < total:
            batch = data[torch.from_numpy(order[pos:pos + 4])]
            logits = model(batch)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.reshape(-1))
            loss = loss + random.random() * 1e-4 + float(np.random.rand()) * 1e-4
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            pos += 4
            log.write(f"loss {step} {loss.item()!r}\n")
            if point == "step" and step == stop:
                block(log, f"{stop} step")
            if save_every and step %% save_every == 0:
                log.write(f"save-begin {step}\n")
                saving[0] = step
                manager.save(step, model, opt, sched, scaler, epoch=epoch, pos=pos)
                saving[0] = None
                log.write(f"save-end {step}\n")
                if point and step == stop:  # the point was never reached: still stop here
                    block(log, f"{stop} missed")
        if pos >= len(order):
            epoch, pos = epoch + 1, 0
    log.write("done\n")
    log.close()


# A zygote: torch is imported once, every training process is a fork of this one
# (a real process, killed with a real SIGKILL) so that 20+ trials do not pay 20+ imports.
# One short run first: torch imports the rest of itself lazily on the first step and save.
import tempfile
with tempfile.TemporaryDirectory() as warm:
    main(os.path.join(warm, "run"), os.path.join(warm, "log"), 2, 2)
for command in sys.stdin:
    words = command.split()
    if words[0] == "run":
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                main(words[1], words[2], int(words[3]), int(words[4]), int(words[5]),
                     words[6] if words[6] != "-" else "", int(words[7]))
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(pid, flush=True)
    elif words[0] == "wait":
        _, status = os.waitpid(int(words[1]), 0)
        print(status, flush=True)
''' % {"keep": KEEP}


class Zygote:
    """A process that imported torch once and forks one training process per run."""

    def __init__(self, script: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", TRAINING_PATCHES_QUIET="1",
                   PYTHONPATH=os.pathsep.join((str(REPO), str(REPO / "tests"))))
        self.running: int | None = None  # a forked run not yet waited for
        self.proc = subprocess.Popen([sys.executable, "-W", "ignore", str(script)], env=env,
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def run(self, out: Path, log: Path, total: int, save_every: int, stop: int = 0,
            point: str = "-", nbytes: int = 0) -> int:
        """Fork a training run; with ``point``, it waits at that point of step ``stop``."""
        self.proc.stdin.write(f"run {out} {log} {total} {save_every} {stop} {point} {nbytes}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def wait(self, pid: int) -> int:
        """The raw wait status of a child (signal number for a kill, exit code << 8)."""
        self.proc.stdin.write(f"wait {pid}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        # Nothing is left to check in the zygote itself: end it rather than wait for its
        # exit, which on a starved machine can take longer than any fixed time.
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _wait_for(log: Path, start: int, predicate, timeout: float = 600.0) -> bool:
    """Poll the worker's log until a line from ``start`` on matches; ``timeout`` only turns
    a worker that never gets there into a failure instead of a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(predicate(line) for line in _lines(log)[start:]):
            return True
        time.sleep(0.01)
    raise AssertionError(f"worker did not get there in {timeout}s: {_lines(log)[start:][-5:]}")


def _complete(out: Path) -> dict[str, int]:
    """name -> step of checkpoints whose manifest is written (complete ones)."""
    manager = CheckpointManager(out, keep=None)
    return {path.name: int(path.stem.split("_")[1]) for path in manager.checkpoints()}


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_or_tears_a_checkpoint(tmp_path):
    rng = random.Random(20240607)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "run"
    out.mkdir()
    log = tmp_path / "train.log"
    # The user's own files in the output folder: never touched.
    user_files = {out / "best_by_hand.pt": b"my own", out / "notes.txt": b"do not delete",
                  out / "ckpt_000000001.pt.bak": b"backup"}
    for path, data in user_files.items():
        path.write_bytes(data)

    zygote = Zygote(script)
    try:
        _trials(zygote, rng, out, log, user_files, tmp_path)
    finally:
        if zygote.running is not None:  # a failed trial: its worker still waits
            os.kill(zygote.running, signal.SIGKILL)
        zygote.close()


# Where inside a save the odd trials stop the worker, in turn.
SAVE_POINTS = ("write", "rename", "manifest", "latest", "prune")
SAVE_EVERY = 2


def _trials(zygote, rng, out, log, user_files, tmp_path) -> None:
    seen: dict[str, int] = {}
    during_save = 0
    resumed_from: list[int] = []
    points: list[str] = []
    for trial in range(TRIALS):
        newest = max(seen.values(), default=0)
        if trial % 2 == 0:
            # Between two steps (at least one save done before the first kill).
            point, stop = "step", newest + rng.randint(3 if trial == 0 else 1, 7)
        else:
            point = SAVE_POINTS[(trial // 2) % len(SAVE_POINTS)]
            saves = rng.randint(1, 3)
            if point == "prune":  # a save prunes once more than KEEP are complete
                saves = max(saves, KEEP - len(seen) + 1)
            stop = newest + SAVE_EVERY * saves
        points.append(point)
        start = len(_lines(log))
        pid = zygote.run(out, log, total=10 ** 6, save_every=SAVE_EVERY, stop=stop,
                         point=point, nbytes=rng.randint(1, 8_000_000))
        zygote.running = pid
        assert _wait_for(log, start, lambda line: line.startswith("stopped "))
        os.kill(pid, signal.SIGKILL)
        status = zygote.wait(pid)
        zygote.running = None
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        stopped = [line for line in _lines(log)[start:] if line.startswith("stopped ")]
        assert stopped[-1].split()[1:3] == [str(stop), point], stopped  # where it was aimed
        tail = [line for line in _lines(log)[start:] if line.startswith("save-")]
        if tail and tail[-1].startswith("save-begin"):
            during_save += 1
        resumed = [line for line in _lines(log)[start:] if line.startswith("resumed")]
        if trial > 0 and seen:
            assert resumed, f"trial {trial}: the worker did not resume although checkpoints exist"
            resumed_from.append(int(resumed[0].split()[1]))
            # It resumed from the newest complete checkpoint that existed before it started.
            assert resumed_from[-1] == max(seen.values())

        # Invariants after the kill.
        complete = _complete(out)
        for name in complete:
            assert check_file(out / name) is None, f"trial {trial}: {name} has a manifest but is torn"
        newest = max(complete.values(), default=None)
        for name, step in seen.items():
            if name not in complete:
                newer = [s for s in complete.values() if s > step]
                assert len(newer) >= KEEP, (
                    f"trial {trial}: {name} disappeared with only {len(newer)} newer checkpoints")
        seen = complete
        for path, data in user_files.items():
            assert path.read_bytes() == data, f"trial {trial}: {path.name} was changed"
        chosen = CheckpointManager(out, keep=KEEP).resume("auto")
        if newest is not None:
            assert chosen is not None and chosen.name == f"ckpt_{newest:09d}.pt"
            fresh = TinyGPT(1500, 192, dropout=0.1)  # the worker's model
            report = load_checkpoint(chosen, fresh, freeze=False, restore_rng=False)
            assert report.step == newest

    # Every save-point kill landed inside a save, and every trial after the first resumed.
    assert during_save == sum(p != "step" for p in points), (during_save, points)
    assert len(resumed_from) == TRIALS - 1, f"only {len(resumed_from)} trials resumed"

    # Finish the run without a kill, then replay it uninterrupted from scratch.
    last = max(seen.values())
    start = len(_lines(log))
    status = zygote.wait(zygote.run(out, log, total=last + 4, save_every=2))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert _lines(log)[-1] == "done"
    ref_log = tmp_path / "reference.log"
    status = zygote.wait(zygote.run(tmp_path / "ref", ref_log, total=last + 4, save_every=0))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    reference = {int(line.split()[1]): line.split()[2] for line in _lines(ref_log)
                 if line.startswith("loss")}
    logged = [line.split()[1:] for line in _lines(log) if line.startswith("loss")]
    replayed = sum(1 for step, _ in logged) - len({step for step, _ in logged})
    assert replayed > 0  # steps lost to kills were trained again after a resume
    for step, loss in logged:
        assert loss == reference[int(step)], f"step {step}: {loss} != {reference[int(step)]}"
    # Temporary files of killed saves (checkpoints, manifests, latest) were swept by later
    # saves: all their writers are dead.
    leftovers = [p.name for p in out.iterdir() if ".tp-tmp-" in p.name]
    assert leftovers == [], leftovers
    assert all(manifest_path(out / name).is_file() for name in _complete(out))
