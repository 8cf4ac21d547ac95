"""Checkpoints under many processes (ranks started as torchrun starts them, gloo, CPU): one writer and one outcome on
every rank under DDP, FSDP2 sharded checkpoints through DCP with resharding, per-rank RNG,
a SIGKILLed save, and a temp-file sweep that never touches another host's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import jobs
from patches._runlock import LOCK_NAME
from patches.checkpoint import CheckpointManager, check_file
from patches.checkpoint.reading import read_manifest
from patches.checkpoint.atomic import host_name
from patches.checkpoint.sharded import COMMIT_NAME, MANIFEST_NAME, read_folder_manifest

JOB = jobs.HERE / "ranks" / "ckpt_job.py"


def job(*args: object, nproc: int = 2, timeout: float = 180,
             check: bool = True) -> subprocess.CompletedProcess:
    """The checkpoint job's ``nproc`` ranks, started as torchrun starts them (``jobs.ranks``)."""
    return jobs.ranks(JOB, *args, nproc=nproc, timeout=timeout, check=check)


def said(output: str) -> dict[str, dict[int, list]]:
    """``RANK <r> <KEY> <json>`` lines: key -> rank -> values in order."""
    found: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for line in output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == "RANK" and parts[1].isdigit():
            found[parts[2]][int(parts[1])].append(json.loads(parts[3]))
    return found


def test_ckpt_ddp_save_from_every_rank_20_times(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = job("ddp_saves", out, "20", timeout=240)
    lines = said(result.stdout)
    paths = lines["PATHS"]
    assert set(paths) == {0, 1}
    assert paths[0] == paths[1], "every rank must get the same paths back"
    assert [Path(p).name for p in paths[0][0]] == [f"ckpt_{s:09d}.pt" for s in range(20)]
    # No torn pair, no orphan: exactly 20 files, their 20 manifests and `latest` (and the
    # writer's folder lock, which ended with it).
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"ckpt_{s:09d}.pt" for s in range(20)]
                           + [f"ckpt_{s:09d}.pt.manifest.json" for s in range(20)]
                           + ["latest", LOCK_NAME])
    manifests = []
    for step in range(20):
        path = out / f"ckpt_{step:09d}.pt"
        assert check_file(path) is None, f"{path.name}: {check_file(path)}"
        manifest, problem = read_manifest(path)
        assert problem is None and manifest.step == step
        manifests.append(manifest)
    assert [m.generation for m in manifests] == list(range(20)), "generations must be consecutive"
    # One writer: global rank 0's process wrote every checkpoint.
    writer = {"rank": 0, "host": host_name(), "pid": lines["PID"][0][0]}
    assert [m.data["writer"] for m in manifests] == [writer] * 20
    assert {m.data["world_size"] for m in manifests} == {2}
    # Both ranks' RNG states are inside, each its own.
    ckpt = torch.load(out / "ckpt_000000019.pt", weights_only=True)
    assert len(ckpt["rng_ranks"]) == 2
    assert not torch.equal(ckpt["rng_ranks"][0]["torch"], ckpt["rng_ranks"][1]["torch"]) or \
        ckpt["rng_ranks"][0]["python"] != ckpt["rng_ranks"][1]["python"]


def test_ckpt_writer_error_reaches_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    result = job("ddp_diskfull", out, timeout=120, check=False)
    assert time.monotonic() - started < 120
    assert result.returncode != 0, result.stdout[-3000:]
    errors = said(result.stdout)["ERROR"]
    assert set(errors) == {0, 1}, result.stdout[-3000:]
    assert errors[0] == errors[1], "every rank must raise the same error"
    message = errors[0][0]
    assert message.startswith("DiskFullError: training-patches: the disk filled up while writing "
                               "ckpt_000000001.pt"), message
    assert "SAVED" not in said(result.stdout)
    # The failed save left none of its files behind (the lock is the writer's, not the save's).
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def _run_until(command: list[str], marker: str, timeout: float, log: Path) -> subprocess.Popen:
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=jobs.rank_env(), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while marker not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the job ended by itself: its log says why
                pass
            proc.wait()
            pytest.fail(f"{marker!r} never came:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return proc


def test_ckpt_sigkill_mid_save_then_every_rank_resumes(tmp_path: Path) -> None:
    out, log = tmp_path / "run", tmp_path / "job1.log"
    hang_at = 3
    proc = _run_until(jobs.torchrun_command(JOB, "ddp_hang", out, str(hang_at)), "HANGING",
                      timeout=120, log=log)
    lines = said(log.read_text())
    # SIGKILL the whole job: every rank (torchrun starts each in its own session) and torchrun.
    for pids in lines["PID"].values():
        os.kill(pids[0], signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert [s for s, _ in lines["SAVED"][0]] == list(range(hang_at))
    expected = {rank: draws[-1] for rank, draws in lines["DRAWS_AFTER"].items()}
    assert expected[0][0] == hang_at - 1 and expected[1][0] == hang_at - 1
    temp = [p.name for p in out.iterdir() if ".tp-tmp-" in p.name]
    assert len(temp) == 1 and f"@{host_name()}~" in temp[0], temp  # the killed write

    result = job("ddp_resume", out, timeout=180)
    resumed = said(result.stdout)
    for rank in (0, 1):
        path, step, rng_restored = resumed["RESUMED"][rank][0]
        assert Path(path).name == f"ckpt_{hang_at - 1:09d}.pt" and step == hang_at - 1
        assert rng_restored
        # Each rank draws what it would have drawn without the interruption: its own stream.
        assert resumed["DRAWS"][rank][0] == expected[rank][1]
    assert resumed["DRAWS"][0][0] != resumed["DRAWS"][1][0], "ranks must not share one RNG"
    left = resumed["LEFT"][0][0]
    assert not [n for n in left if ".tp-tmp-" in n], left  # the next save swept it


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_ckpt_fsdp2_sharded_save_and_reshard(tmp_path: Path, saved_by: int,
                                              loaded_by: int) -> None:
    out, ref = tmp_path / "run", tmp_path / "full_reference.pt"
    saved = said(job("fsdp_save", out, ref, nproc=saved_by, timeout=240).stdout)
    assert {r: [s for s, _ in v] for r, v in saved["SAVED"].items()} == {
        r: [1, 2, 3] for r in range(saved_by)}
    # keep=2: the oldest folder was pruned; the others are complete, marker written last.
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == ["ckpt_000000002.dcp", "ckpt_000000003.dcp"]
    manifest, problem = read_folder_manifest(out / folders[-1])
    assert problem is None
    assert (manifest["step"], manifest["generation"], manifest["world_size"],
            manifest["vocab_size"]) == (3, 2, saved_by, 80)
    shards = {f"__{r}_0.distcp" for r in range(saved_by)} | {
        f"rng.rank{r}.pt" for r in range(saved_by)} | {".metadata", "meta.pt"}
    assert set(manifest["files"]) == shards
    folder = out / folders[-1]
    assert (folder / COMMIT_NAME).stat().st_mtime_ns >= max(
        (folder / name).stat().st_mtime_ns for name in [*shards, MANIFEST_NAME])

    loaded = said(job("fsdp_resume", out, ref, nproc=loaded_by,
                                timeout=240).stdout)
    assert loaded["EQUAL"][0][0][0] is True, "full parameters and optimizer state must be equal"
    assert loaded["EQUAL"][0][0][1] > 20  # parameters, moments and steps were compared
    for rank in range(loaded_by):
        path, step, extra, rng_restored, parts = loaded["RESUMED"][rank][0]
        assert Path(path).name == "ckpt_000000003.dcp" and step == 3 and extra["pos"] == 30
        assert rng_restored is (rank < saved_by)
        # The report (and the log line built from it) says what each rank got.
        assert parts["optimizer"] == "restored" and parts["step"] == "restored"
        assert parts["rng"] == ("restored" if rank < saved_by else
                                f"absent (none saved for rank {rank}; its current RNG is kept)")
        assert loaded["STEPPED"][rank][0] == "ckpt_000000004.dcp"
    # Rank 0 (and rank 1 when it was saved) draws its own stream on.
    for rank in range(min(saved_by, loaded_by)):
        assert loaded["DRAWS"][rank][0] == saved["DRAWS_AFTER"][rank][0]
    # A folder without its commit marker is never resumed.
    newest = out / "ckpt_000000004.dcp"
    assert CheckpointManager(out, keep=2).resume("auto") == newest
    (newest / COMMIT_NAME).unlink()
    assert CheckpointManager(out, keep=2).resume("auto") == out / "ckpt_000000003.dcp"


def test_ckpt_refusal_on_one_rank_is_raised_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job("ddp_saves", out, "1", timeout=120)
    result = job("ddp_refuse", out, timeout=120)
    lines = said(result.stdout)
    errors = lines["ERROR"]
    assert set(errors) == {0, 1} and errors[0] == errors[1], result.stdout[-3000:]
    assert errors[0][0].startswith("CheckpointMismatchError: "), errors[0][0]
    # Rank 0 could have loaded the file, but no rank changed anything.
    assert lines["UNCHANGED"] == {0: [True], 1: [True]}


def test_ckpt_auto_rows_decided_differently_on_two_ranks_are_refused_on_both(
        tmp_path: Path) -> None:
    """row_init auto: each rank probes; where one says "reads" and the other not, no rank
    loads (the replicas would start with different new rows), and both say which rank
    decided what."""
    pytest.importorskip("tokenizers")
    result = job("ddp_auto_disagree", tmp_path / "run", timeout=120)
    lines = said(result.stdout)
    errors = lines["ERROR"]
    assert set(errors) == {0, 1} and errors[0] == errors[1], result.stdout[-3000:]
    text = errors[0][0]
    assert text.startswith("CheckpointError: training-patches: the ranks decided differently "
                           "before changing anything (rank 0: embedding spelling (text_tv "), text
    assert "rank 1: embedding std0.02 (text_tv 0.000 at or below" in text, text
    assert "TRAINING_PATCHES_ROW_INIT=spelling or std0.02" in text, text
    assert lines["UNCHANGED"] == {0: [True], 1: [True]}


def test_ckpt_single_file_into_fsdp2_model_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "single"
    job("ddp_saves", out, "1", timeout=120)
    result = job("fsdp_single", tmp_path / "unused", out / "ckpt_000000000.pt",
                           timeout=120)
    errors = said(result.stdout)["ERROR"]
    assert set(errors) == {0, 1} and errors[0] == errors[1]
    assert "parameters are DTensors" in errors[0][0]
    assert "BEFORE sharding it" in errors[0][0]


def test_ckpt_sweep_leaves_other_hosts_temp_files(tmp_path: Path) -> None:
    from tiny_gpt import TinyGPT

    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs (on this host)
    here = host_name()
    other_host = out / f".ckpt_000000001.pt.tp-tmp-{dead.pid}@another-node-7~abc123"
    dead_here = out / f".ckpt_000000002.pt.tp-tmp-{dead.pid}@{here}~def456"
    live_here = out / f".ckpt_000000003.pt.tp-tmp-{os.getppid()}@{here}~ghi789"
    for path in (other_host, dead_here, live_here):
        path.write_bytes(b"PK\x03\x04 partial")
    CheckpointManager(out, keep=2).save(5, TinyGPT())
    assert other_host.exists(), "another host's save in progress must never be touched"
    assert live_here.exists(), "a live writer's file on this host must be left alone"
    assert not dead_here.exists(), "this host's file of a dead writer is swept"


def test_ckpt_save_on_rank0_only_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    out = tmp_path / "run"
    started = time.monotonic()
    lines = said(job("rank0_only", out, timeout=120).stdout)
    assert time.monotonic() - started < 120
    message = lines["ERROR"][0][0]
    assert message.startswith("CheckpointError: training-patches: rank 0 waited for the other "
                              "ranks"), message
    assert "collective=False" in message and "EVERY rank" in message
    # Nothing of the collective save was written; the one-process save works.
    assert lines["SAVED_LOCAL"][0][0] == [LOCK_NAME, "ckpt_000000002.pt",
                                          "ckpt_000000002.pt.manifest.json", "latest"]


def test_ckpt_fsdp2_error_on_one_rank_reaches_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = job("fsdp_diskfull", out, timeout=120, check=False)
    assert result.returncode != 0
    errors = said(result.stdout)["ERROR"]
    assert set(errors) == {0, 1} and errors[0] == errors[1], result.stdout[-3000:]
    assert errors[0][0].startswith("CheckpointError: training-patches: the sharded (DCP) save of "
                                   f"{out / 'ckpt_000000001.dcp'} failed on rank 0 (OSError: "
                                   "[Errno 28] No space left on device)"), errors[0][0]
    # The torn folder has no commit marker: nothing to resume from.
    assert not (out / "ckpt_000000001.dcp" / COMMIT_NAME).exists()
    assert CheckpointManager(out).resume("auto") is None


def test_ckpt_fsdp2_killed_save_is_never_resumed_and_swept_by_the_next(tmp_path: Path) -> None:
    """A sharded save SIGKILLed before its commit marker: resume passes over its folder;
    the next save's writer removes it (this host, dead writer) and leaves alone another
    host's incomplete folder, a live writer's and one that names no writer."""
    out, log = tmp_path / "run", tmp_path / "job1.log"
    proc = _run_until(jobs.torchrun_command(JOB, "fsdp_kill", out), "HANGING", timeout=150,
                      log=log)
    lines = said(log.read_text())
    for pids in lines["PID"].values():
        os.kill(pids[0], signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed = out / "ckpt_000000003.dcp"
    assert (killed / MANIFEST_NAME).exists() and not (killed / COMMIT_NAME).exists()
    writer = json.loads((killed / "writer.json").read_text())
    assert (writer["host"], writer["pid"]) == (host_name(), lines["PID"][0][0])
    # Incomplete folders the sweep must leave (newer steps: resume must pass them over too).
    dead = subprocess.Popen(["true"])
    dead.wait()
    kept = {10: {"host": "another-node-7", "pid": dead.pid},  # another host's save
            11: {"host": host_name(), "pid": os.getppid()},  # a live writer here
            12: None}  # no writer record (an older version)
    for step, record in kept.items():
        folder = out / f"ckpt_{step:09d}.dcp"
        folder.mkdir()
        (folder / "__0_0.distcp").write_bytes(b"partial shard")
        if record is not None:
            (folder / "writer.json").write_text(json.dumps(record))
    assert CheckpointManager(out, keep=2).resume("auto") == out / "ckpt_000000002.dcp"

    lines = said(job("fsdp_next_save", out, timeout=180).stdout)
    for rank in (0, 1):
        path, step = lines["RESUMED"][rank][0]
        assert Path(path).name == "ckpt_000000002.dcp" and step == 2
        assert Path(lines["SAVED"][rank][0]).name == "ckpt_000000007.dcp"
    assert not killed.exists(), "the killed save's folder (dead writer, this host) is swept"
    assert read_folder_manifest(out / "ckpt_000000007.dcp")[1] is None
    for step in kept:
        assert (out / f"ckpt_{step:09d}.dcp" / "__0_0.distcp").exists(), step
    assert not (out / "ckpt_000000001.dcp").exists()  # keep=2 pruned the oldest complete



def _on_two_nodes(*args: object) -> tuple[dict, str]:
    """The job on two launchers as two nodes: what every rank said, and the output."""
    out = "".join(r.stdout for r in jobs.two_nodes(JOB, *args, timeout=180, check=False))
    return said(out), out[-3000:]


@pytest.mark.parametrize("access", ["rw", "ro"])
def test_ckpt_folder_not_shared_between_nodes_is_refused_on_every_rank(
        tmp_path: Path, access: str) -> None:
    """Two launchers as two nodes, each with its own checkpoint folder (the same path on
    another disk, as a node-local disk is): rank 0's is
    empty, rank 1's holds the run. Without the check resume("auto") returns None on every
    rank and the job silently starts over. Refused on every rank, before anything is read;
    where no probe file can be written (ro), by the checkpoints each rank sees."""
    job("ddp_saves", tmp_path / "node1", "2", timeout=120)  # the run, on "node 1"
    lines, out = _on_two_nodes("node_local_resume", tmp_path, "per_node", access)
    errors = lines["ERROR"]
    # the same error on both ranks (each names its own folder: here the paths differ)
    assert set(errors) == {0, 1}, out
    assert errors[0][0] == errors[1][0].replace(str(tmp_path / "node1"), str(tmp_path / "node0"))
    message = errors[0][0]
    assert message.startswith("CheckpointError: ") and "not one folder shared by every rank" in message
    assert "collective=False" in message
    if access == "rw":
        assert "not visible to rank 1" in message
    else:
        assert "rank 0 (host" in message and "sees the checkpoints none" in message
        assert "ckpt_000000001.pt" in message
    assert not any(name.startswith(".training_patches_shared")
                   for node in ("node0", "node1") if (tmp_path / node).is_dir()
                   for name in os.listdir(tmp_path / node))
    # The same files in one shared folder resume on every rank, writable or not.
    lines, out = _on_two_nodes("node_local_resume", tmp_path / "node1", "shared", access)
    assert "ERROR" not in lines, out
    assert lines["RESUMED"][0] == lines["RESUMED"][1] and \
        lines["RESUMED"][0][0].endswith("ckpt_000000001.pt"), out


def test_ckpt_fsdp2_save_into_folders_local_to_each_node_is_refused(tmp_path: Path) -> None:
    """An FSDP2 save into a folder local to each node would commit a folder without the
    other node's shards (found only at resume, which then starts over): refused first."""
    lines, out = _on_two_nodes("node_local_fsdp_save", tmp_path)
    errors = lines["ERROR"]
    assert set(errors) == {0, 1} and "not one folder shared by every rank" in errors[0][0], out
    assert not list(tmp_path.rglob(COMMIT_NAME)) and not list(tmp_path.rglob("*.dcp"))
