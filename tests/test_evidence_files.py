"""Evidence files per rank: every record says which rank of how many wrote it, each rank of a
job appends to its own file (``nonfinite_events.rank1.jsonl``), one process keeps the plain
name, and every line is strict JSON (a NaN loss is the string "NaN", never bare NaN).

The rank comes from a launcher's RANK/WORLD_SIZE here (no process group in this process);
tests/distributed/test_evidence_ranks.py runs the same writers under a real torchrun job.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import patches
from patches import _run, dataset_guard, nan_guard, oom_guard



def _refuse(constant: str) -> None:
    raise ValueError(f"bare {constant} is not JSON")


def strict_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` parsed by a strict JSON parser (bare NaN/Infinity refused)."""
    return [json.loads(line, parse_constant=_refuse)
            for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(autouse=True)
def _run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_run, "_dir_providers", [])
    _run.set_output_dir(tmp_path)


def test_evidence_one_process_keeps_the_plain_name_with_rank_0_of_1(tmp_path: Path) -> None:
    path = _run.append_jsonl("nonfinite_events.jsonl", {"step": 1, "kind": "nonfinite_loss"})
    assert path == str(tmp_path / "nonfinite_events.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nonfinite_events.jsonl"]
    assert strict_lines(tmp_path / "nonfinite_events.jsonl") == [
        {"run_id": _run.run_id(), "rank": 0, "world_size": 1, "step": 1,
         "kind": "nonfinite_loss"}]


@pytest.mark.parametrize("rank", ["0", "1", "3"])
def test_evidence_each_rank_of_a_launcher_writes_its_own_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = _run.append_jsonl("oom_events.jsonl", {"kind": "out_of_memory"})
    assert path == str(tmp_path / f"oom_events.rank{rank}.jsonl")
    assert not (tmp_path / "oom_events.jsonl").exists()
    assert strict_lines(Path(path)) == [{"run_id": _run.run_id(), "rank": int(rank),
                                         "world_size": 4, "kind": "out_of_memory"}]


def test_evidence_a_rank_without_world_size_never_takes_the_plain_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """coqui's ``python -m trainer.distribute`` sets RANK only: rank 1 still writes its own."""
    monkeypatch.setenv("RANK", "1")
    path = _run.append_jsonl("loss_scale.jsonl", {"step": 2})
    assert Path(path).name == "loss_scale.rank1.jsonl"


def test_evidence_non_finite_floats_are_strict_json(tmp_path: Path) -> None:
    record = {"loss": math.nan, "scale": math.inf, "low": -math.inf, "fine": 0.5,
              "nested": {"values": [1.0, math.nan, (math.inf, 2)]}, "text": "NaN",
              "tensor": torch.tensor(1.0)}
    path = Path(_run.append_jsonl("x.jsonl", record))
    (line,) = strict_lines(path)
    assert line["loss"] == "NaN" and line["scale"] == "Infinity" and line["low"] == "-Infinity"
    assert line["fine"] == 0.5 and line["text"] == "NaN"
    assert line["nested"] == {"values": [1.0, "NaN", ["Infinity", 2]]}
    assert line["tensor"] == "tensor(1.)"  # objects JSON lacks are written as text


def test_evidence_the_guard_event_of_a_nan_loss_is_strict(tmp_path: Path) -> None:
    """The NaN guard's real event (a plain loop, one process): the loss NaN is "NaN"."""
    patches.advanced.apply()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(torch.ones(3, 4)).sum() * math.nan).backward()
    opt.step()
    assert nan_guard.stats()["skipped"] == 1
    (event,) = strict_lines(tmp_path / "nonfinite_events.jsonl")
    assert event["loss"] == "NaN" and event["rank"] == 0 and event["world_size"] == 1


def test_evidence_oom_events_go_to_the_rank_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    batch = {"filenames": ["a.wav", "b.wav"], "text_inputs": torch.zeros(2, 7)}
    oom_guard.on_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"), batch, [])
    (event,) = strict_lines(tmp_path / "oom_events.rank1.jsonl")
    assert event["rank"] == 1 and event["world_size"] == 2
    assert event["samples"] == ["a.wav", "b.wav"]
    assert not (tmp_path / "oom_events.jsonl").exists()


def test_evidence_dropped_samples_per_rank_once_each(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sample = {"audio_file": "a.wav", "text": "hi", "language": "en"}
    entry = {"split": "train", "audio_file": "a.wav", "reason": "decode_failure",
             "duration": math.nan}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        path = dataset_guard.report_path()
        assert path == tmp_path / f"dropped_samples.rank{rank}.jsonl"
        key = dataset_guard.sample_key("train", sample)
        assert dataset_guard.record_drop(path, key, entry) is True
        assert dataset_guard.record_drop(path, key, entry) is False  # once per file
        (line,) = strict_lines(path)
        assert line["rank"] == int(rank) and line["world_size"] == 2
        assert line["duration"] == "NaN" and line["key"] == key
    assert not (tmp_path / "dropped_samples.jsonl").exists()


def test_evidence_own_files_include_every_rank(tmp_path: Path) -> None:
    for name in ("nonfinite_events.rank1.jsonl", "loss_scale.jsonl", "notes.rank1.jsonl",
                 "oom_events.rankX.jsonl"):
        (tmp_path / name).write_text("{}\n")
    assert _run.own_files_in(str(tmp_path)) == ["loss_scale.jsonl",
                                                 "nonfinite_events.rank1.jsonl"]


@pytest.mark.slow
def test_evidence_every_record_names_its_run(tmp_path: Path, monkeypatch) -> None:
    """Two runs started from one folder append to one file: their records say which run
    each is (``run_id``); ranks of one job share theirs; a name given wins."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    # patches.advanced.apply(): a run id given in the environment is a known variable, not an error.
    code = ("import patches; patches.advanced.apply(); from patches import _run; "
            "_run.set_output_dir(r'%s'); "
            "_run.append_jsonl('nonfinite_events.jsonl', {'step': 1})" % tmp_path)

    def run(extra: dict[str, str]) -> None:
        env = {k: v for k, v in __import__("os").environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                            _run.RUN_ID_ENV)}
        subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(repo),
                                                          **extra}, check=True)

    run({})
    run({})
    run({_run.RUN_ID_ENV: "amharic-try-3"})
    run({"TORCHELASTIC_RUN_ID": "job-42", "RANK": "0", "WORLD_SIZE": "1"})
    ids = [line["run_id"] for line in strict_lines(tmp_path / "nonfinite_events.jsonl")]
    assert len(ids) == 4 and ids[0] != ids[1], ids
    assert ids[2:] == ["amharic-try-3", "job-42"]
    # Ranks without a rendezvous id (torchrun's default "none", trainer.distribute): the
    # launcher's pid on this host, the same for every rank it started.
    monkeypatch.setattr(_run, "_run_id", None)
    monkeypatch.delenv(_run.RUN_ID_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("RANK", "1")
    import os
    import socket
    assert _run.run_id() == f"{socket.gethostname()}-{os.getppid()}"
