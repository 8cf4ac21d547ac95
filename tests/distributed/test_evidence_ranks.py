"""Evidence of a real 2-rank job (ranks started as torchrun starts them, gloo, CPU): each
rank appends to its own files, every line strict JSON with its own rank, none interleaved;
``training-patches report`` merges the ranks into one run where the NaN step rank 0 saw is
one skipped step."""

from __future__ import annotations

import json
from pathlib import Path

import jobs
import pytest

from patches.tools import cli
from patches.tools.report import build, find_runs

RANKS = jobs.HERE / "ranks"
N_OOM, N_DROPPED = 40, 15


def _strict(path: Path) -> list[dict]:
    def refuse(constant: str) -> None:
        raise ValueError(f"bare {constant} in {path}")
    return [json.loads(line, parse_constant=refuse)
            for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("evidence_job")
    jobs.ranks(RANKS / "evidence_writer.py", str(out), str(N_OOM), str(N_DROPPED),
                  timeout=180)
    return out


def test_evidence_each_rank_writes_its_own_files(job_dir: Path) -> None:
    names = sorted(p.name for p in job_dir.glob("*.jsonl"))
    assert names == [f"{stem}.rank{r}.jsonl" for stem in
                     ("dropped_samples", "nonfinite_events", "oom_events") for r in (0, 1)]
    for rank in (0, 1):
        stats = json.loads((job_dir / f"job.rank{rank}.json").read_text())
        assert stats["identical"] and stats["finite"]
        assert stats["nan_guard"]["skipped"] == 1 and stats["nan_guard"]["steps"] == 6
        ooms = _strict(job_dir / f"oom_events.rank{rank}.jsonl")
        assert len(ooms) == N_OOM  # whole lines, none lost or interleaved with a peer's
        assert all(e["rank"] == rank and e["world_size"] == 2 for e in ooms)
        assert [e["trainer_step"] for e in ooms] == list(range(N_OOM))
        assert all(s.startswith(f"r{rank}_") for e in ooms for s in e["samples"])
        dropped = _strict(job_dir / f"dropped_samples.rank{rank}.jsonl")
        assert len(dropped) == N_DROPPED + 1
        assert all(e["rank"] == rank and e["world_size"] == 2 for e in dropped)
        (event,) = _strict(job_dir / f"nonfinite_events.rank{rank}.jsonl")
        assert event["rank"] == rank and event["world_size"] == 2 and event["step"] == 3
    (seen,) = _strict(job_dir / "nonfinite_events.rank0.jsonl")
    assert seen["kind"] == "nonfinite_loss" and seen["loss"] == "NaN"
    # One run: every record of both ranks names the same run_id (the job's TORCHELASTIC_RUN_ID).
    run_ids = {e["run_id"] for path in job_dir.glob("*.jsonl") for e in _strict(path)}
    assert len(run_ids) == 1, run_ids


def test_evidence_report_merges_the_ranks(job_dir: Path, capsys) -> None:
    (run,) = find_runs(str(job_dir))
    f = build(run).facts
    (skip,) = f.skips  # skipped on both ranks: one skipped step of the run
    assert skip.step == 3 and skip.kind == "nonfinite_loss" and skip.seen_on[0] == 0
    # rank 1 received rank 0's NaN through DDP's gradient all-reduce: it saw NaN gradients
    # (this branch), or followed its peer (peer_nonfinite, the guard's own labelling)
    assert sorted(skip.seen_on + skip.followed_on) == [0, 1]
    assert f.ooms == 2 * N_OOM and sum(f.dropped.values()) == 2 * N_DROPPED + 1
    assert cli.main(["report", str(job_dir), "--out", str(job_dir / "r.png")]) == 1
    out = capsys.readouterr().out
    assert "skipped steps: 1 (nonfinite_loss 1) at steps 3" in out
    assert "ranks: 2 (0, 1)" in out and f"out-of-memory batches skipped: {2 * N_OOM}" in out


@pytest.mark.parametrize("fault", ["under_a_file", "full_disk", "read_only"])
def test_evidence_that_cannot_be_written_never_stops_a_job(job_dir: Path, tmp_path: Path,
                                                           fault: str) -> None:
    """The same job with its report folder under a file (NotADirectoryError on every
    write), on a full tmpfs or on a read-only one: both ranks train to the same parameters as
    the job above, each rank warns once per file it could not write, and counts every
    record that waits."""
    import contextlib

    from io_faults import full_disk, read_only

    if fault == "under_a_file":
        (tmp_path / "afile").write_text("a file, not a folder")
        place = contextlib.nullcontext(tmp_path / "afile")
        folder, error = "afile/reports", "(NotADirectoryError: [Errno 20] Not a directory)"
    elif fault == "full_disk":
        place = full_disk(tmp_path / "full", free=0)
        folder, error = "full", "(OSError: [Errno 28] No space left on device)"
    else:
        place = read_only(tmp_path / "ro")
        folder, error = "ro", "(OSError: [Errno 30] Read-only file system)"
    with place:
        reports = tmp_path / folder
        result = jobs.ranks(RANKS / "evidence_writer.py", str(tmp_path), str(N_OOM),
                               str(N_DROPPED), str(reports), timeout=180)
    for rank in (0, 1):
        stats = json.loads((tmp_path / f"job.rank{rank}.json").read_text())
        expected = json.loads((job_dir / f"job.rank{rank}.json").read_text())
        assert stats["identical"] and stats["finite"]
        assert stats["params"] == expected["params"] and stats["nan_guard"]["skipped"] == 1
        assert stats["evidence"]["waiting"] == 1 + N_OOM + N_DROPPED + 1
        for name in ("nonfinite_events", "oom_events", "dropped_samples"):
            assert result.stdout.count(
                f"could not write to {reports}/{name}.rank{rank}.jsonl {error}") == 1, \
                result.stdout[-3000:]
