"""``training-patches report``: runs found under an output dir, a verdict with its figures,
and one PNG page whose panels and skip markers are read back from the Figure."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import patches
from patches.tools import cli
from patches.tools.report import build, find_runs, write_report
from patches.tools.report.plotting import PANELS

pytest.importorskip("matplotlib")


def _jsonl(path: Path, records: list[object], extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + extra, encoding="utf-8")
    return path


def _tensorboard(folder: Path, losses: list[float], lr: float = 1e-4) -> None:
    """TensorBoard scalars under the tags the coqui Trainer writes (TrainIterStats/...)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, loss in enumerate(losses):
        writer.add_scalar("TrainIterStats/loss", loss, step)
        writer.add_scalar("TrainIterStats/current_lr", lr, step)
        writer.add_scalar("TrainIterStats/grad_norm", 1.0, step)
    writer.close()


def _axes(fig) -> dict[str, object]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def _marks(ax) -> dict[str, list[float]]:
    """Skip markers of a panel: label -> the steps they stand at."""
    return {c.get_label(): [float(x) for x, _ in c.get_offsets()]
            for c in ax.collections if c.get_label().startswith("skipped")}


# -- finding runs, bad records, never OK with events ------------------------------------------

def test_empty_folder_is_no_run_found(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("nothing a run writes")
    assert cli.main(["report", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "no run found" in captured.err and str(tmp_path) in captured.err
    assert "health: OK" not in captured.out
    assert not (tmp_path / "training_report.png").exists()


def test_corrupt_lines_are_counted_not_fatal(tmp_path, capsys) -> None:
    good = {"step": 4, "trainer_step": 3, "kind": "nonfinite_loss", "consecutive": 1}
    _jsonl(tmp_path / "nonfinite_events.jsonl", [good],
           extra='{"step": 5, "kind": "nonfin\n[1, 2]\n\x00\x01 binary\n')
    _jsonl(tmp_path / "dropped_samples.jsonl", [], extra="not json either\n")
    assert cli.main(["report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "3 unreadable line(s) in " + str(tmp_path / "nonfinite_events.jsonl") in out
    assert "1 unreadable line(s) in " + str(tmp_path / "dropped_samples.jsonl") in out
    assert "skipped steps: 1 (nonfinite_loss 1) at steps 3" in out
    assert "unreadable records" in out and "health: OK" not in out


@pytest.mark.parametrize("name, record", [
    ("nonfinite_events.jsonl", {"step": 1, "trainer_step": 0, "kind": "nonfinite_grad"}),
    ("dropped_samples.jsonl", {"audio_file": "a.wav", "reason": "too_long_audio"}),
    ("oom_events.jsonl", {"kind": "out_of_memory", "trainer_step": 7}),
    ("loss_scale.jsonl", {"step": 3, "scale_before": 1024.0, "scale": 512.0,
                          "overflow": True}),
])
def test_a_run_with_events_is_never_ok(tmp_path, capsys, name, record) -> None:
    _tensorboard(tmp_path, [5.0 - 0.3 * i for i in range(12)])  # a falling loss
    _jsonl(tmp_path / name, [record])
    assert cli.main(["report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "health: needs a look" in out and "verdict: healthy" not in out


def test_a_clean_run_is_healthy(tmp_path, capsys) -> None:
    _tensorboard(tmp_path, [5.0 - 0.3 * i for i in range(12)])
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "verdict: healthy" in out and "health: OK" in out
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_output_dir_holding_a_run_subfolder_is_found(tmp_path, capsys, monkeypatch) -> None:
    """headlessXttsTrain.py: headless_runs.jsonl in --output-dir, the Trainer's run folder
    (TensorBoard, the NaN guard's events) below it."""
    run = tmp_path / "xtts_finetune-May-01-2026_10+00AM-abc"
    _tensorboard(run, [5.0 - 0.3 * i for i in range(12)])
    _jsonl(run / "nonfinite_events.jsonl",
           [{"step": 4, "trainer_step": 3, "kind": "nonfinite_loss", "consecutive": 1}])
    _jsonl(tmp_path / "headless_runs.jsonl", [{"event": "start", "run_folder": str(run)}])
    runs = find_runs(str(tmp_path))
    assert [r.folder for r in runs] == [str(run)]
    assert runs[0].shared_folders == [str(tmp_path)]
    here = tmp_path.parent / f"{tmp_path.name}_here"  # outside the run's folders
    here.mkdir()
    monkeypatch.chdir(here)  # the picture goes to the current folder
    assert cli.main(["report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"run: {run}" in out and "skipped steps: 1" in out
    assert (here / f"training_report_{tmp_path.name}.png").is_file()


def test_stalled_loss_and_unstable_scale_are_named_with_figures(tmp_path) -> None:
    _tensorboard(tmp_path, [4.0, 4.01, 3.99, 4.0, 4.02, 4.0, 3.99, 4.01, 4.0, 4.0, 4.01, 4.0])
    scale, records = 1024.0, []
    for step in (2, 3, 4, 6, 8, 9):  # six overflows in 12 steps: 1024 -> 16
        records.append({"step": step, "trainer_step": step, "scale_before": scale,
                        "scale": scale / 2, "overflow": True})
        scale /= 2
    _jsonl(tmp_path / "loss_scale.jsonl", records)
    report = build(find_runs(str(tmp_path))[0])
    names = [f.name for f in report.findings]
    assert names == ["unstable scale", "repeated skips", "stalled loss"]
    details = {f.name: f.detail for f in report.findings}
    assert "backed off 6 times in 12 steps, from 1024 down to 16" in details["unstable scale"]
    # TensorBoard's last step is a lower bound (it logs every plot_step): no percentage
    assert ("6 skipped steps in at least 12 (the run's total number of steps was not "
            "recorded): 6 overflow") in details["repeated skips"]
    assert "longest streak 3" in details["repeated skips"]
    assert "mean loss of the first 3 logged steps 4" in details["stalled loss"]
    fig = report.figure()
    scale_ax = _axes(fig)["Loss scale"]
    steps, values = scale_ax.lines[0].get_data()
    assert list(values)[0] == 1024.0 and list(values)[-1] == 16.0


def test_panels_without_data_say_so(tmp_path) -> None:
    _jsonl(tmp_path / "nonfinite_events.jsonl",
           [{"step": 2, "trainer_step": 1, "kind": "nonfinite_loss"}])
    fig = build(find_runs(str(tmp_path))[0]).figure()
    axes = _axes(fig)
    assert set(PANELS) <= set(axes)
    for title in ("Loss scale", "Gradient norm", "Learning rate", "Dropped samples by reason"):
        texts = " ".join(t.get_text() for t in axes[title].texts)
        assert texts.startswith("no ") and not axes[title].lines, title
    assert "no loss values recorded" in " ".join(t.get_text() for t in axes["Loss"].texts)
    assert _marks(axes["Loss"]) == {"skipped: non-finite loss (1)": [1.0]}


# -- a real run: coqui Trainer, tiny XTTS, a NaN, an overflow, a dropped sample ---------------

NAN_STEP, INF_STEP = 2, 8  # trainer steps: a NaN batch, inf gradients (an fp16 overflow)


@pytest.mark.slow
@pytest.mark.xtts
def test_report_of_a_real_coqui_run(tiny_xtts, tmp_path) -> None:
    """Two epochs of the tiny XTTS GPT through the real coqui Trainer with the patches on:

    - trainer step 2's batch gives a NaN loss (a forward hook, as a bad sample would);
      under a GradScaler the scaler skips it as an overflow (the NaN guard leaves a
      protected step to it) and ``loss_scale.jsonl`` records the NaN loss;
    - step 8's gradients are made inf after backward (a parameter hook): what an fp16
      overflow looks like to the scaler. The Trainer builds its GradScaler only for CUDA
      (``use_amp_scaler``) and binds it with ``device="cuda"``; ``use_grad_scaler=True``
      makes it build one on the CPU, and the binding is pointed at ``device="cpu"`` here:
      the stand-in for the GPU. Everything else is the real path: ``scaler.scale``,
      ``unscale_`` in ``_grad_clipping``, ``step``, ``update``, coqui's ``amp_scaler``;
    - one manifest row is an undecodable file: the dataset guard drops it.
    """
    import torch
    import trainer.trainer as coqui
    from TTS.config.shared_configs import BaseDatasetConfig

    from patches import _run
    from patches.grad_scaler import SafeGradScaler

    torch.set_num_threads(1)
    (tmp_path / "wavs").mkdir()  # coqui wants paths below the dataset folder: link them
    clips = []
    for clip in sorted(tiny_xtts.audio_dir.glob("clip_*.wav")):
        (tmp_path / "wavs" / clip.name).symlink_to(clip)
        clips.append(f"wavs/{clip.name}")
    (tmp_path / "wavs" / "broken.wav").write_bytes(b"not audio" * 100)
    rows = [f"{c}|{t}|spk0" for c, t in zip(clips, tiny_xtts.texts * 3)]
    rows.append("wavs/broken.wav|hello|spk0")
    (tmp_path / "train.csv").write_text("audio_file|text|speaker_name\n" + "\n".join(rows)
                                        + "\n", encoding="utf-8")
    dataset = BaseDatasetConfig(formatter="coqui", dataset_name="tiny", path=str(tmp_path),
                                meta_file_train="train.csv", language=tiny_xtts.language)
    out = tmp_path / "out"
    patches.advanced.apply()
    config = tiny_xtts.make_config(out, datasets=[dataset], epochs=2, plot_step=1,
                                   use_grad_scaler=True, grad_clip=1.0)
    model = tiny_xtts.make_model(config)
    # The coqui integration tells the patches the trainer step before each forward.
    model.xtts.gpt.text_embedding.register_forward_hook(
        lambda module, inputs, output:
        output * float("nan") if module.training and _run.current().trainer_step == NAN_STEP
        else output)
    model.xtts.gpt.text_head.weight.register_hook(
        lambda grad: grad * float("inf") if _run.current().trainer_step == INF_STEP else grad)
    binding = coqui.GradScaler
    coqui.GradScaler = functools.partial(SafeGradScaler, device="cpu")
    try:
        trainer = tiny_xtts.train(config, model)
    finally:
        coqui.GradScaler = binding
    assert isinstance(trainer.scaler, SafeGradScaler) and trainer.scaler._enabled
    stats = patches.stats()

    runs = find_runs(str(out))
    assert [r.folder for r in runs] == [str(trainer.output_path)]
    report = build(runs[0])
    f = report.facts
    assert f.steps == 14  # 14 samples (13 clips + 1 broken) in batches of 2, 2 epochs
    nan_step, inf_step = NAN_STEP, INF_STEP
    assert [(s.step, s.kind) for s in f.skips] == [(nan_step, "nonfinite_loss"),
                                                   (inf_step, "overflow")]
    assert stats["grad_scaler"]["skipped"] == 2 and stats["grad_scaler"]["steps"] == 14
    assert [v for _, v in f.scale] == [1024.0, 512.0, 256.0] and f.backoffs == 2
    assert dict(f.dropped) == {"decode_failure": 1}
    assert [s for s, _ in f.losses["loss"]] == [s for s in range(14) if s != NAN_STEP]
    assert f.lr and f.grad_norm and any(v for _, v in f.grad_norm)
    assert report.headline == "repeated skips, dropped samples"
    details = {x.name: x.detail for x in report.findings}
    # no headless_runs.jsonl: TensorBoard's last step is only a lower bound (it logs
    # every plot_step), so no percentage is claimed
    assert details["repeated skips"].startswith(
        "2 skipped steps in at least 14 (the run's total number of steps was not recorded): "
        "1 nonfinite loss, 1 overflow")

    fig = report.figure()  # read before saving
    axes = _axes(fig)
    assert set(PANELS) <= set(axes)
    assert _marks(axes["Loss"]) == {"skipped: non-finite loss (1)": [nan_step],
                                    "skipped: fp16 overflow (1)": [inf_step]}
    assert {line.get_label() for line in axes["Loss"].lines} >= {"total loss",
                                                                 "mel (audio-token) loss"}
    assert axes["Loss scale"].lines and axes["Gradient norm"].lines
    assert axes["Learning rate"].lines
    bars = axes["Dropped samples by reason"].patches
    assert [b.get_width() for b in bars] == [1]
    assert [t.get_text() for t in axes["Dropped samples by reason"].get_yticklabels()] == \
        ["decode_failure"]

    reports, png = write_report(out)
    assert png == str(out / "training_report.png") and Path(png).stat().st_size > 10_000


@pytest.mark.parametrize("moved", [0.0, 1e-6])
def test_frozen_rows_checked_against_the_base_model(tmp_path, moved) -> None:
    """headless_runs.jsonl records the base model and the frozen rows; the newest checkpoint's
    rows are compared with the base model's, bit for bit."""
    import torch

    torch.manual_seed(0)
    base = {"gpt.text_embedding.weight": torch.randn(6, 4), "gpt.text_head.weight":
            torch.randn(6, 4), "gpt.text_head.bias": torch.randn(6)}
    torch.save({"model": base}, tmp_path / "model.pth")
    run = tmp_path / "out" / "xtts_finetune-x"
    run.mkdir(parents=True)
    grown = {}
    for name, old in base.items():  # 6 base rows -> 9: rows 0..4 kept, new 5..7, start row last
        new = torch.randn(9, *old.shape[1:])
        new[:5], new[8] = old[:5], old[5]
        grown["xtts." + name] = new
    grown["xtts.gpt.text_head.weight"][8, 0] += moved
    torch.save({"model": grown}, run / "checkpoint_10.pth")
    _tensorboard(run, [5.0 - 0.3 * i for i in range(12)])
    _jsonl(tmp_path / "out" / "headless_runs.jsonl", [{
        "event": "start", "run_folder": str(run),
        "base_weights": {"path": str(tmp_path / "model.pth"), "frozen_rows": [[0, 4], [8, 8]]}}])
    report = build(find_runs(str(tmp_path / "out"))[0])
    assert report.facts.freeze["max_drift"] == pytest.approx(moved, abs=1e-7)
    assert "text_embedding.weight, text_head.weight, text_head.bias" in \
        report.facts.freeze["detail"]
    assert report.headline == ("frozen rows moved" if moved else "healthy")


def test_the_report_says_how_the_new_rows_started_and_why(tmp_path) -> None:
    """The start record's base_weights keep the load's row_init (its rule and auto's probe):
    the report names the rule that ran and why, in its text and its JSON."""
    run = tmp_path / "out" / "xtts_finetune-x"
    run.mkdir(parents=True)
    _tensorboard(run, [5.0 - 0.3 * i for i in range(12)])
    row_init = {"embedding": "std0.02", "head": "spread",
                "auto": {"text_tv": 0.007, "reads": False, "threshold": 0.05,
                         "why": "text_tv 0.007 at or below 0.05", "seconds": 0.1,
                         "failed": False}}
    _jsonl(tmp_path / "out" / "headless_runs.jsonl", [{
        "event": "start", "run_folder": str(run),
        "base_weights": {"path": str(tmp_path / "model.pth"), "frozen_rows": None,
                         "row_init": row_init}}])
    report = build(find_runs(str(tmp_path / "out"))[0])
    assert report.facts.new_rows == row_init
    assert ("new rows: embedding std0.02, head spread (row_init auto: the base model does not "
            "read its text, text_tv 0.007 at or below 0.05)") in report.lines


# -- the picture never takes a run's file (issue 19) -------------------------------------------

@pytest.fixture(autouse=True)
def _pictures_in_a_scratch_folder(tmp_path_factory, monkeypatch) -> None:
    """``report`` without --out draws into the current folder: never the checkout's."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run_with_records(folder: Path) -> dict[str, Path]:
    _tensorboard(folder, [5.0 - 0.3 * i for i in range(12)])
    events = _jsonl(folder / "nonfinite_events.jsonl",
                    [{"step": 4, "trainer_step": 3, "kind": "nonfinite_loss", "consecutive": 1}])
    checkpoint = folder / "checkpoint_12.pth"
    checkpoint.write_bytes(b"PK\x03\x04 a checkpoint's bytes")
    return {"events": events, "checkpoint": checkpoint}


def _one_paragraph(err: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_out_never_replaces_a_run_record_or_a_foreign_file(tmp_path, capsys) -> None:
    """--out naming the run's own records, a foreign PNG or a non-.png name: exit 2, one
    paragraph, the file byte for byte as it was (and no new file)."""
    run = tmp_path / "run"
    files = _run_with_records(run)
    foreign = run / "spectrogram.png"  # a picture the report did not draw
    foreign.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    files["foreign"] = foreign
    tfevents = next(run.glob("events.out.tfevents.*"))
    files["tensorboard"] = tfevents
    before = {name: _sha(path) for name, path in files.items()}
    listing = sorted(p.name for p in run.iterdir())
    for name, path in files.items():
        assert cli.main(["report", str(run), "--out", str(path)]) == 2, name
        err = capsys.readouterr().err
        _one_paragraph(err)
        assert str(path) in err and "untouched" in err, err
    assert cli.main(["report", str(run), "--out", str(run / "summary.txt")]) == 2
    err = capsys.readouterr().err
    _one_paragraph(err)
    assert "does not end in .png" in err
    assert {name: _sha(path) for name, path in files.items()} == before
    assert sorted(p.name for p in run.iterdir()) == listing  # nothing added, no temporary


def test_default_picture_goes_to_the_current_folder_not_the_run(tmp_path, capsys,
                                                                monkeypatch) -> None:
    """Without --out the run folder is left exactly as the run wrote it; the PNG lands in
    the current folder, named after the run; a second report replaces its own PNG only
    with --force (issue 26: it redrew it without)."""
    run = tmp_path / "am_run"
    _run_with_records(run)
    listing = {p.name: _sha(p) for p in run.iterdir()}
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert cli.main(["report", str(run)]) == 1
    out = capsys.readouterr().out
    png = here / "training_report_am_run.png"
    assert f"picture: {png.name}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name: _sha(p) for p in run.iterdir()} == listing
    first, digest = png.stat().st_mtime_ns, _sha(png)
    # a second look: the verdict again (its exit code), the picture left as it is (only
    # --force redraws it); the newcomer study's reader lost the verdict to an exit 2 here
    assert cli.main(["report", str(run)]) == 1
    again = capsys.readouterr().out
    assert "verdict:" in again
    assert (f"picture: not drawn: {png.name} exists (the report drew it before; it is left "
            f"as it is: --force draws it again") in again
    assert _sha(png) == digest and png.stat().st_mtime_ns == first
    assert cli.main(["report", str(run), "--force"]) == 1
    assert png.stat().st_mtime_ns >= first and "picture:" in capsys.readouterr().out
    assert sorted(p.name for p in here.iterdir()) == [png.name]


# -- a truncated TensorBoard file, --json (issue 19) -------------------------------------------

def test_a_truncated_tensorboard_file_is_never_healthy(tmp_path, capsys) -> None:
    """The last record of the event file cut short (a run killed mid-write): TensorBoard's
    reader stops quietly before it, so the figures look whole; the report names the
    truncation, the verdict is not healthy, exit 1."""
    _tensorboard(tmp_path, [5.0 - 0.3 * i for i in range(12)])
    tfevents = next(tmp_path.glob("events.out.tfevents.*"))
    assert cli.main(["report", str(tmp_path), "--no-picture"]) == 0  # whole: healthy
    assert "verdict: healthy" in capsys.readouterr().out
    data = tfevents.read_bytes()
    tfevents.write_bytes(data[:-30])
    assert cli.main(["report", str(tmp_path), "--no-picture"]) == 1
    out = capsys.readouterr().out
    assert "verdict: incomplete TensorBoard file" in out and "healthy" not in out
    assert f"{tfevents} is truncated" in out and f"the file ends at byte {len(data) - 30:,}" in out
    assert "health: needs a look" in out


def _strict(text: str) -> dict:
    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_on_stdout_is_strict_and_the_whole_output(tmp_path, capsys) -> None:
    """--json -: stdout is one strict JSON object (the NaN loss of a skipped step as the
    string "NaN"), with the verdict and figures the text gives; no picture drawn with
    --no-picture."""
    _tensorboard(tmp_path, [5.0 - 0.3 * i for i in range(12)])
    (tmp_path / "nonfinite_events.jsonl").write_text(
        '{"step": 4, "trainer_step": 3, "kind": "nonfinite_loss", "loss": NaN, '
        '"consecutive": 1}\n', encoding="utf-8")  # an older writer's bare NaN
    assert cli.main(["report", str(tmp_path), "--json", "-", "--no-picture"]) == 1
    captured = capsys.readouterr()
    doc = _strict(captured.out)
    assert doc["tool"] == "training-patches report" and doc["format"] == 1
    assert doc["healthy"] is False and doc["exit_code"] == 1 and doc["picture"] is None
    (run,) = doc["runs"]
    assert run["folder"] == str(tmp_path) and run["verdict"] == "skipped steps"
    assert run["skipped_steps"] == [{"step": 3, "kind": "nonfinite_loss", "loss": "NaN",
                                     "seen_on_ranks": [0], "followed_on_ranks": []}]
    assert run["loss"]["first"] == [0, 5.0] and run["loss"]["logged"] == 12
    assert run["findings"][0]["name"] == "skipped steps"
    assert run["tensorboard"]["incomplete"] == []
    assert not list(Path.cwd().iterdir())  # --no-picture: nothing drawn


def test_json_file_never_replaces_a_run_file(tmp_path, capsys) -> None:
    """--json naming one of the run's records, its TensorBoard file or the --out picture is
    refused even with --force (the files byte for byte as they were); a report JSON it
    wrote before is replaced with --force, refused without."""
    run = tmp_path / "run"
    files = _run_with_records(run)
    files["tensorboard"] = next(run.glob("events.out.tfevents.*"))
    before = {name: _sha(path) for name, path in files.items()}
    for name, path in files.items():
        assert cli.main(["report", str(run), "--json", str(path), "--force"]) == 2, name
        err = capsys.readouterr().err
        _one_paragraph(err)
        assert "an input of this command" in err, err
    assert cli.main(["report", str(run), "--json", str(tmp_path / "a.png"),
                     "--out", str(tmp_path / "a.png")]) == 2
    assert "are the same file" in capsys.readouterr().err
    assert {name: _sha(path) for name, path in files.items()} == before
    out = run / "report.json"  # asked for: a new file in the run folder is written
    assert cli.main(["report", str(run), "--json", str(out), "--no-picture"]) == 1
    assert _strict(out.read_text(encoding="utf-8"))["runs"][0]["verdict"] == "skipped steps"
    capsys.readouterr()
    assert cli.main(["report", str(run), "--json", str(out), "--no-picture"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["report", str(run), "--json", str(out), "--no-picture", "--force"]) == 1


def test_no_default_picture_inside_the_run_folder(tmp_path, capsys, monkeypatch) -> None:
    """Run from inside the run's folder, the default picture would land among the run's
    files: it is not drawn, and the report says how to ask for it."""
    run = tmp_path / "am_run"
    _run_with_records(run)
    listing = {p.name: _sha(p) for p in run.iterdir()}
    monkeypatch.chdir(run)
    assert cli.main(["report", "."]) == 1
    out = capsys.readouterr().out
    assert "picture: not drawn: the current folder is the run's own folder" in out
    assert {p.name: _sha(p) for p in run.iterdir()} == listing
    assert cli.main(["report", ".", "--out", "mine.png"]) == 1  # asked for: written
    assert (run / "mine.png").is_file()


def test_an_interrupted_run_is_named_interrupted_not_healthy(tmp_path, capsys) -> None:
    """Issue 26 item 2: a run stopped by SIGTERM was called healthy. Its last record is an
    ``interrupted`` one: the verdict says so, exit 1; once a resume of that run folder has
    finished, it is healthy again. Another run folder's records say nothing about it."""
    out = tmp_path / "out"
    run = out / "xtts_finetune-November-25-2026_01+43PM-0000000"
    _tensorboard(run, [5.0 - 0.3 * i for i in range(12)])
    other = "xtts_finetune-November-25-2026_01+44PM-0000000"
    records = [
        {"event": "start", "run_folder": f"out/{run.name}", "start_step": 0},  # relative
        {"event": "interrupted", "run_folder": f"out/{run.name}", "step": 7,
         "signal": "SIGTERM", "checkpoint": f"out/{run.name}/checkpoint_7.pth"},
        {"event": "finished", "run_folder": f"out/{other}", "steps": 12},
    ]
    _jsonl(out / "headless_runs.jsonl", records)
    assert cli.main(["report", str(out), "--no-picture"]) == 1
    text = capsys.readouterr().out
    assert "verdict: interrupted" in text
    assert ("interrupted: stopped by SIGTERM at trainer step 7 and not continued since; "
            "checkpoint_7.pth was written: continue it with --resume auto") in text
    _jsonl(out / "headless_runs.jsonl", records + [
        {"event": "start", "run_folder": str(run), "start_step": 8},
        {"event": "finished", "run_folder": str(run), "steps": 12}])
    assert cli.main(["report", str(out), "--no-picture"]) == 0
    assert "verdict: healthy" in capsys.readouterr().out
