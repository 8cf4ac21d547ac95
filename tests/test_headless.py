"""headlessXttsTrain.py: every option documented, bad input is one clear message (exit 2),
and a tiny Amharic fine-tune runs end to end through the real coqui Trainer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from processes import child_path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "headlessXttsTrain.py"


def _run(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT), **env_vars)
    return forkserver.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_first_import_is_the_activation_line() -> None:
    """The first statement after the docstring imports the one line (inside a try, whose
    handler turns a bad setting into one paragraph)."""
    import ast

    body = [node for node in ast.parse(SCRIPT.read_text(encoding="utf-8")).body
            if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    first = body[0].body[0] if isinstance(body[0], ast.Try) else body[0]
    assert isinstance(first, ast.ImportFrom) and first.module == "utils"
    assert [alias.name for alias in first.names] == ["training_patches"]


@pytest.fixture(scope="module")
def help_run() -> subprocess.CompletedProcess[str]:
    """``--help`` once, read by the two tests below (each process is ~2 s of imports)."""
    return _run("--help")


@pytest.mark.slow
def test_help_documents_every_option(help_run: subprocess.CompletedProcess[str]) -> None:
    sys.path.insert(0, str(ROOT))
    import headlessXttsTrain

    result = help_run
    assert result.returncode == 0, result.stderr
    parser = headlessXttsTrain.build_parser()
    flags = [flag for action in parser._actions for flag in action.option_strings
             if flag.startswith("--")]
    for flag in flags:
        assert flag in result.stdout, f"{flag} missing from --help"
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
    for needed in ("--precision", "--resume", "--keep-checkpoints", "--preset",
                   "--text-loss-weight", "--mel-loss-weight", "--extend-vocab", "--grad-accum"):
        assert needed in flags


@pytest.mark.slow
def test_help_comes_without_the_banner(help_run: subprocess.CompletedProcess[str]) -> None:
    """``--help`` prints the help, not the activation's 20-line banner first (issue 19); any
    other start still shows the banner (here: an unknown flag, refused by argparse)."""
    result = help_run
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: headlessXttsTrain.py")
    assert "applying training patches" not in result.stdout + result.stderr
    assert result.stderr == ""
    other = _run("--no-such-flag")
    assert other.returncode == 2
    assert "applying training patches" in other.stderr and "unrecognized" in other.stderr


@pytest.mark.slow
def test_missing_base_file_is_a_clear_error(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    for name in ("model.pth", "config.json", "mel_stats.pth", "vocab.json"):
        (base / name).write_bytes(b"x")
    manifest = tmp_path / "train.csv"
    manifest.write_text("audio_file|text|speaker_name\n", encoding="utf-8")
    result = _run("--base-dir", str(base), "--train-manifest", str(manifest),
                  "--output-dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{base / 'dvae.pth'} not found" in result.stderr
    assert "discrete VAE" in result.stderr and "never downloads" in result.stderr
    assert "model.pth not found" not in result.stderr  # only what is missing is named


@pytest.mark.slow
def test_bf16_on_cpu_and_extend_vocab_are_clear_errors(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    for name in ("model.pth", "config.json", "dvae.pth", "mel_stats.pth", "vocab.json"):
        (base / name).write_bytes(b"x")
    manifest = tmp_path / "train.csv"  # a manifest that passes pre-flight: one clip
    manifest.write_text("audio_file|text|speaker_name\nwavs/0001.wav|ሰላም|spk1\n",
                        encoding="utf-8")
    (tmp_path / "wavs").mkdir()
    (tmp_path / "wavs" / "0001.wav").write_bytes(b"RIFF")
    common = ["--base-dir", str(base), "--train-manifest", str(manifest),
              "--output-dir", str(tmp_path / "out")]
    result = _run(*common, "--extend-vocab", str(manifest))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{base / 'vocab.json'} is not JSON" in result.stderr  # the base vocab is junk
    assert not (tmp_path / "out" / "vocab_am.json").exists()
    import torch
    if not torch.cuda.is_available():
        result = _run(*common, "--precision", "bf16")
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.xtts
@pytest.mark.slow
def test_tiny_amharic_finetune_and_resume_auto(tmp_path: Path) -> None:
    """Real GPTTrainer + coqui Trainer, language am, Amharic transcripts: zero samples dropped,
    finite losses, a checkpoint written, and --resume auto continues that run."""
    pytest.importorskip("TTS")
    import torch

    from conftest import write_amharic_base

    torch.set_num_threads(1)
    tiny, base = write_amharic_base(tmp_path)
    out = tmp_path / "out"
    common = ["--base-dir", str(base), "--train-manifest", str(tiny.manifest), "--language",
              "am", "--output-dir", str(out), "--batch-size", "2", "--lr", "1e-4",
              "--print-step", "1"]
    first = _run(*common, "--epochs", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    log = (out / "train.log").read_text(encoding="utf-8")
    assert "no samples dropped" in log
    # none anywhere: the reports' one place is <output-dir> (set before any data is read;
    # tests/test_headless_preflight.py shows them landing there when there is something)
    assert not list(tmp_path.rglob("dropped_samples.jsonl"))
    assert not list(tmp_path.rglob("nonfinite_events.jsonl"))
    runs = list(out.glob("xtts_finetune-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.pth")), "no checkpoint written"
    losses = [float(v) for v in re.findall(r"> loss: ([^\s]+)", first.stdout + first.stderr)]
    assert losses and all(v == v and abs(v) != float("inf") for v in losses)
    steps_first = int(re.search(r"finished: {'steps': (\d+)", log).group(1))
    # the run's report is written when it ends (training-patches report)
    assert (out / "training_report.png").read_bytes()[:4] == b"\x89PNG"
    assert f"run report: {out / 'training_report.png'}; verdict: healthy" in log

    second = _run(*common, "--epochs", "2", "--resume", "auto")
    assert second.returncode == 0, second.stderr[-3000:]
    log = (out / "train.log").read_text(encoding="utf-8")
    assert f"resuming the run in {runs[0]}" in log
    steps_second = int(re.findall(r"finished: {'steps': (\d+)", log)[-1])
    assert steps_second > steps_first  # continued the step count, not restarted
    assert list(out.glob("xtts_finetune-*")) == runs


# -- a signal is an interruption (issue 26 item 2) ------------------------------------------


@pytest.mark.xtts
@pytest.mark.slow
@pytest.mark.parametrize("signame,code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_is_an_interruption(tmp_path: Path, signame: str, code: int) -> None:
    """SIGTERM (a cloud machine stopping) or SIGHUP (a closed ssh session) during training:
    the step ends, a checkpoint is written, one line says so, an ``interrupted`` record,
    exit 143 (129), its DataLoader workers gone with it; ``report`` calls the run
    interrupted, not healthy, until ``--resume auto`` continues it to its end."""
    pytest.importorskip("TTS")
    import signal

    from processes import group_left, start_headless, tiny_run, wait_for_text

    out, common = tiny_run(tmp_path, "--workers", "2")
    proc = start_headless(*common, "--epochs", "4", cwd=tmp_path)
    try:
        wait_for_text(out / "train.log", "GLOBAL_STEP: 1", proc)  # steps have finished
        proc.send_signal(getattr(signal, signame))
        output = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, output[-3000:]
    assert "Traceback" not in output
    said = [line for line in output.splitlines() if "interrupted" in line]
    assert len(said) == 1, said
    records = [json.loads(line) for line in
               (out / "headless_runs.jsonl").read_text(encoding="utf-8").splitlines()]
    stop = records[-1]
    assert stop["event"] == "interrupted" and stop["signal"] == signame
    checkpoint = Path(stop["checkpoint"])
    assert checkpoint.is_file() and checkpoint.name == f"checkpoint_{stop['step']}.pth"
    assert f"interrupted by {signame} after trainer step {stop['step']}" in said[0]
    assert f"{checkpoint.name} written" in said[0]
    assert not group_left(proc.pid), "a DataLoader worker outlived the run"
    report = _run_report(out)
    assert report.returncode == 1 and "verdict: interrupted" in report.stdout, report.stdout
    assert f"stopped by {signame} at trainer step {stop['step']}" in report.stdout
    if signame == "SIGTERM":  # continued to its end: no longer interrupted
        resumed = _run(*common, "--epochs", "1", "--resume", "auto", "--workers", "0")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        # coqui continues with the run folder's config.json: said, and the run's 4 epochs
        said = resumed.stdout + resumed.stderr
        assert "--epochs 1 (the run uses 4) not applied" in said
        assert "training 4 epochs" in said
        report = _run_report(out)
        assert "verdict: interrupted" not in report.stdout, report.stdout


def _run_report(folder: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=child_path(ROOT))
    return forkserver.run([sys.executable, "-m", "patches", "report", str(folder),
                           "--no-picture"], capture_output=True, text=True, env=env)


# -- is it learning? (issue 37 item 5) ------------------------------------------------------


@pytest.mark.xtts
@pytest.mark.slow
def test_shuffled_transcripts_are_named_in_the_log_and_the_report(tmp_path: Path) -> None:
    """A manifest whose transcripts belong to other clips (train and eval alike): the run is
    alive, its audio loss falls, and the log and `report` say the text is not read."""
    pytest.importorskip("TTS")
    import csv

    from conftest import write_amharic_base

    tiny, base = write_amharic_base(tmp_path)
    with open(tiny.manifest, encoding="utf-8") as handle:
        rows = list(csv.reader(handle, delimiter="|"))
    header, body = rows[0], rows[1:]
    texts = [row[1] for row in body]
    shuffled = tiny.manifest.parent / "shuffled.csv"
    with open(shuffled, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="|")
        writer.writerow(header)
        for i, row in enumerate(body):
            writer.writerow([row[0], texts[(i + 2) % len(texts)], row[2]])
    out = tmp_path / "out"
    run = _run("--base-dir", str(base), "--train-manifest", str(shuffled), "--eval-manifest",
               str(shuffled), "--language", "am", "--output-dir", str(out), "--batch-size",
               "2", "--lr", "1e-3", "--print-step", "1", "--epochs", "4",
               # a tiny epoch takes seconds: measure at every evaluation, not within 2% of them
               TRAINING_PATCHES_READING_BUDGET="1")
    assert run.returncode == 0, run.stderr[-3000:]
    log = (out / "train.log").read_text(encoding="utf-8")
    assert re.search(r"reading am at step \d+: gap", log), log[-3000:]
    warned = re.findall(r"learning: not reading the text \(am\) since step (\d+)", log)
    assert len(warned) == 1, log[-3000:]
    report = _run_report(out)
    assert report.returncode == 1
    assert f"not reading the text (am) since step {warned[0]}" in report.stdout, report.stdout
