"""``training-patches report`` says only what it checked and counts real steps.

A check that could not run (a relative path nothing resolves, TensorBoard files that
cannot be read, a freeze with no checkpoint) is a finding, never a silent skip; records
with impossible values (a NaN step) are a finding, never a traceback. Relative paths are
resolved from the working directory the run recorded. Steps are the guard's own count
(the optimizer's does not advance on a skip), a percentage is given only against a
recorded total, runs sharing a folder are told apart by ``run_id``, and event records name
parameters by their full path.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import patches
from patches import _run
from patches.tools import cli
from patches.tools.report import build, find_runs

EVENTS, HEADLESS = "nonfinite_events.jsonl", "headless_runs.jsonl"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_run, "_dir_providers", [])
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))  # pictures never land in the checkout
    patches.advanced.reset_runtime_state()
    yield
    _run.set_output_dir(None)
    patches.advanced.reset_runtime_state()


def _jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)


def _report(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict]:
    code = cli.main(["report", str(folder), "--no-picture", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == code
    return code, "", data


def _text(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["report", str(folder), "--no-picture"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _plain_loop(bad: tuple[int, ...], steps: int = 12) -> Nested:
    """AdamW on a nested model; the gradient of ``block.1.weight`` is Inf at ``bad``."""
    torch.manual_seed(0)
    model = Nested()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        opt.zero_grad()
        out = model(torch.ones(2, 3))
        hook = (model.block[1].weight.register_hook(lambda g: g * math.inf)
                if step in bad else None)
        out.sum().backward()
        opt.step()
        if hook is not None:
            hook.remove()
    return model


def test_a_plain_loop_is_counted_in_real_steps_with_full_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Skips at 3, 6, 8 of 12 were reported as "at steps 3, 5, 6", "3 of 7 steps skipped
    (42.9%)", "longest streak 2" (AdamW's own step count stalls on each skip)."""
    patches.advanced.apply()
    _run.set_output_dir(tmp_path)
    _plain_loop(bad=(3, 6, 8))
    events = [json.loads(line) for line in (tmp_path / EVENTS).open()]
    assert [e["step"] for e in events] == [3, 6, 8]
    assert all(e["nonfinite_grads"] == ["block.1.weight"] for e in events)
    code, out = _text(tmp_path, capsys)
    assert "skipped steps: 3 (nonfinite_grad 3) at steps 3, 6, 8" in out
    assert ("3 skipped steps in at least 8 (the run's total number of steps was not "
            "recorded)") in out and "%" not in out.split("verdict:")[1]
    assert "longest streak 1" in out and "steps: at least 8 (not recorded)" in out
    # the run's end, as headlessXttsTrain.py records it: the guard's count is the total
    _jsonl(tmp_path / HEADLESS, [{"event": "finished", "patch_stats": patches.stats()}])
    code, out = _text(tmp_path, capsys)
    assert "3 of 12 steps skipped (25.0%)" in out and "steps: 12" in out


def test_two_runs_in_one_folder_are_told_apart_by_run_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _run.set_output_dir(tmp_path)
    for run_id, steps in (("run-a", (2, 5)), ("run-b", (2, 3)), ("run-a-resumed", (9,))):
        monkeypatch.setattr(_run, "_run_id", run_id)
        for step in steps:
            _run.append_jsonl(EVENTS, {"step": step, "kind": "nonfinite_loss", "loss": "NaN"})
    code, _, data = _report(tmp_path, capsys)
    assert [r["run_ids"] for r in data["runs"]] == [["run-a"], ["run-b", "run-a-resumed"]]
    assert [[s["step"] for s in r["skipped_steps"]] for r in data["runs"]] == [[2, 5], [2, 3, 9]]
    assert all(s["seen_on_ranks"] == [0] for r in data["runs"] for s in r["skipped_steps"])
    code, out = _text(tmp_path, capsys)
    assert f"run: {tmp_path} (run_id run-b, run-a-resumed)" in out
    assert "1 other run(s) under" in out and "0, 0" not in out


def _freeze_run(root: Path, moved: float) -> tuple[Path, Path]:
    """A headless-style output folder ``root/runs/am`` with a run folder, a base model and a
    checkpoint whose frozen rows moved by ``moved``. Returns (output dir, run folder)."""
    torch.manual_seed(0)
    base = {"gpt.text_embedding.weight": torch.randn(6, 4),
            "gpt.text_head.weight": torch.randn(6, 4), "gpt.text_head.bias": torch.randn(6)}
    (root / "base").mkdir(parents=True)
    torch.save({"model": base}, root / "base" / "model.pth")
    run = root / "runs" / "am" / "xtts_finetune-x"
    run.mkdir(parents=True)
    trained = {"xtts." + k: v.clone() for k, v in base.items()}
    trained["xtts.gpt.text_head.weight"][2, 0] += moved
    torch.save({"model": trained}, run / "checkpoint_10.pth")
    (run / "trainer_0_log.txt").write_text("the coqui Trainer's log\n")
    return root / "runs" / "am", run


def _start(run_folder: str, base: str, **extra: Any) -> dict[str, Any]:
    return {"event": "start", "run_folder": run_folder,
            "base_weights": {"path": base, "frozen_rows": [[0, 5]]}, **extra}


@pytest.mark.parametrize("record_cwd", [True, False])
def test_a_relative_output_dir_is_resolved_as_the_run_did(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], record_cwd: bool) -> None:
    """A run started with a relative --output-dir: its frozen rows moved, and the report
    said `healthy` (the check was skipped without a word)."""
    out, run = _freeze_run(tmp_path, moved=1e-3)
    extra = {"cwd": str(tmp_path)} if record_cwd else {}
    # without cwd (an older writer): the run folder's ending names the folder; the base
    # model, relative too, resolves from the same place
    _jsonl(out / HEADLESS, [_start("runs/am/xtts_finetune-x", "base/model.pth", **extra)])
    code, out_text = _text(out, capsys)
    assert code == 1 and "frozen rows moved: frozen base rows moved by up to 0.001" in out_text


def test_a_path_nothing_resolves_is_a_check_not_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, run = _freeze_run(tmp_path, moved=0.0)
    _jsonl(out / HEADLESS, [_start("moved/away/xtts_finetune-y", "base/model.pth"),
                            {"event": "finished", "run_folder": "moved/away/xtts_finetune-y",
                             "patch_stats": {"nan_guard": {"steps": 5, "skipped": 0}}}])
    code, text = _text(out, capsys)
    assert code == 1 and "health: OK" not in text and "verdict: checks not run" in text
    assert ("the patches' counters and freeze in headless_runs.jsonl: it names the relative "
            "run folder(s) moved/away/xtts_finetune-y and not the working directory") in text
    assert ("the frozen rows: not checked: headless_runs.jsonl records a freeze for the "
            "relative run folder(s) moved/away/xtts_finetune-y") in text


def test_a_freeze_without_a_checkpoint_is_a_check_not_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, run = _freeze_run(tmp_path, moved=0.0)
    (run / "checkpoint_10.pth").unlink()
    _jsonl(out / HEADLESS, [_start(str(run), str(tmp_path / "base" / "model.pth"))])
    code, _, data = _report(out, capsys)
    (finding,) = data["runs"][-1]["findings"]
    assert code == 1 and finding == {"name": "checks not run", "detail": (
        "the frozen rows: not checked: no checkpoint in the run folder to check the frozen "
        "rows against")}


def test_unreadable_tensorboard_files_are_a_check_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing", None)
    code, text = _text(tmp_path, capsys)
    assert code == 1 and "verdict: checks not run" in text
    assert "the TensorBoard files: the tensorboard package is not installed" in text


@pytest.mark.parametrize("bad", ["NaN", "-3", "2.5", "1e400"])
def test_a_record_with_an_impossible_step_is_a_finding_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    (tmp_path / EVENTS).write_text(
        '{"step": 4, "kind": "nonfinite_loss", "loss": "NaN"}\n'
        f'{{"step": {bad}, "trainer_step": {bad}, "kind": "nonfinite_loss"}}\n',
        encoding="utf-8")
    code, text = _text(tmp_path, capsys)
    assert code == 1 and "skipped steps: 1 (nonfinite_loss 1) at steps 4" in text
    assert f"impossible records: 1 record(s) of nonfinite_events.jsonl (step " in text


def test_the_headless_record_carries_the_working_directory(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import headlessXttsTrain

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    headlessXttsTrain._record(Path("out"), "start")
    (record,) = [json.loads(line) for line in (tmp_path / "out" / HEADLESS).open()]
    assert record["cwd"] == str(tmp_path)


def test_records_the_run_could_not_write_are_a_finding(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run's own count (patches.stats()["evidence"], in headless_runs.jsonl): records
    still waiting in memory when it ended are missing from its files and figures."""
    _jsonl(tmp_path / EVENTS, [{"step": 3, "kind": "nonfinite_loss", "loss": "NaN"}])
    _jsonl(tmp_path / HEADLESS, [
        {"event": "interrupted", "patch_stats": {"nan_guard": {"steps": 6},
                                                 "evidence": {"written": 1, "waiting": 4}}},
        {"event": "finished", "patch_stats": {"nan_guard": {"steps": 6},
                                              "evidence": {"written": 0, "waiting": 2}}}])
    code, text = _text(tmp_path, capsys)
    assert code == 1 and "records not written: 2 record(s) of the patches could not be " \
        "written when the run ended" in text
