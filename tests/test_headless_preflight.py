"""headlessXttsTrain.py's pre-flight: every bad input is one paragraph on stderr, exit code 2,
no traceback, nothing built and no input file changed; an error inside the coqui Trainer
is said once with its run folder kept; the patches' reports land in --output-dir.

Most cases run in-process through ``headlessXttsTrain.main([...])`` (they stop before any
model is built); a bad setting at activation and two real trainings run as subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import forkserver
import pytest
from processes import child_path

pytestmark = pytest.mark.xtts
pytest.importorskip("TTS")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "headlessXttsTrain.py"
PROG = "headlessXttsTrain.py: error: "


# -- the setup: a tiny Amharic base model and data, read-only for every test -------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """base/ (model.pth, config.json, dvae.pth, mel_stats.pth, vocab.json with [am]) and
    data/ (6 Amharic clips, metadata.csv): the inputs of a fine-tune that passes."""
    from conftest import write_amharic_base

    tmp = tmp_path_factory.mktemp("headless_preflight")
    tiny, base = write_amharic_base(tmp)
    return {"root": tmp, "base": base, "data": tiny.root, "manifest": tiny.manifest}


@pytest.fixture(scope="module")
def headless() -> Any:
    """The script as a module (its first line activates the patches in this process)."""
    sys.path.insert(0, str(ROOT))
    import headlessXttsTrain

    return headlessXttsTrain


@pytest.fixture(autouse=True)
def _no_leftover_log_handlers() -> Iterator[None]:
    """main() adds a train.log handler to three loggers; take it away after each case."""
    names = ("training_patches", "trainer", "TTS")
    before = {name: list(logging.getLogger(name).handlers) for name in names}
    yield
    for name in names:
        for handler in logging.getLogger(name).handlers[:]:
            if handler not in before[name]:
                logging.getLogger(name).removeHandler(handler)
                handler.close()


def _hashes(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(folder.rglob("*")) if p.is_file()}


def _args(setup: dict[str, Path], out: Path, *extra: str, manifest: Path | None = None) -> list[str]:
    return ["--base-dir", str(setup["base"]), "--train-manifest", str(manifest or setup["manifest"]),
            "--language", "am", "--output-dir", str(out), "--batch-size", "2", "--epochs", "1",
            *extra]


def _one_paragraph(err: str) -> str:
    """The error paragraph of stderr (the activation banner may come before it)."""
    assert "Traceback" not in err, err
    assert err.count(PROG) == 1, err
    text = err[err.index(PROG) + len(PROG):].strip()
    assert "\n\n" not in text, text  # one paragraph
    return text


def _manifest(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def _rows(setup: dict[str, Path]) -> list[str]:
    return setup["manifest"].read_text(encoding="utf-8").splitlines()


# -- the ten representative bad inputs (issue 11, "Done when") ----------------------------

def _case(name: str, setup: dict[str, Path], tmp: Path) -> tuple[list[str], str]:
    """(command line, words the paragraph must hold) for one bad input, made in ``tmp``."""
    data = setup["data"]  # the manifests are written beside the clips (paths are relative)
    out = tmp / "out"
    rows = _rows(setup)
    if name == "empty manifest":
        path = _manifest(data, "empty.csv", b"")
        return _args(setup, out, manifest=path), "is empty"
    if name == "binary manifest":
        path = _manifest(data, "binary.csv", bytes(range(256)) * 8)
        return _args(setup, out, manifest=path), "is a binary file"
    if name == "comma manifest":
        text = "\n".join(line.replace("|", ",") for line in rows) + "\n"
        path = _manifest(data, "commas.csv", text.encode("utf-8"))
        return _args(setup, out, manifest=path), "separated by commas"
    if name == "latin-1 manifest":
        text = "\n".join([rows[0], "wavs/clip_000.wav|café crème|spk0"]) + "\n"
        path = _manifest(data, "latin1.csv", text.encode("latin-1"))
        return _args(setup, out, manifest=path), "is not UTF-8"
    if name == "missing audio":
        text = "\n".join([rows[0], *rows[1:], "wavs/nope_1.wav|ሰላም|spk0",
                          "wavs/nope_2.wav|ሰላም|spk1"]) + "\n"
        path = _manifest(data, "missing.csv", text.encode("utf-8"))
        return _args(setup, out, manifest=path), "2 of 8 audio files are missing"
    if name == "vocab not JSON":
        bad = tmp / "vocab_bad.json"
        bad.write_text('{"model": {"type": "BPE", ', encoding="utf-8")
        return _args(setup, out, "--vocab", str(bad)), "is not JSON"
    if name == "wrong model file":
        return _args(setup, out, "--model", str(setup["base"] / "dvae.pth")), \
            "is not a checkpoint of this XTTS model"
    if name == "lr nan":
        return _args(setup, out, "--lr", "nan"), "--lr is nan"
    if name == "output is a file":
        afile = tmp / "a_file"
        afile.write_text("mine\n", encoding="utf-8")
        return _args(setup, afile), "is a file, not a folder"
    if name == "unknown language":
        args = _args(setup, out)
        args[args.index("--language") + 1] = "xx"
        return args, "'xx' is not a language the XTTS tokenizer knows"
    raise AssertionError(name)


TEN = ["empty manifest", "binary manifest", "comma manifest", "latin-1 manifest",
       "missing audio", "vocab not JSON", "wrong model file", "lr nan", "output is a file",
       "unknown language"]


@pytest.mark.parametrize("name", TEN)
def test_bad_input_is_one_paragraph_exit_2_inputs_unchanged(
        name: str, setup: dict[str, Path], headless: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv, words = _case(name, setup, tmp_path)
    before = _hashes(setup["base"], setup["data"], tmp_path)
    assert headless.main(argv) == 2
    text = _one_paragraph(capsys.readouterr().err)
    assert words in text, text
    after = _hashes(setup["base"], setup["data"], tmp_path)
    assert {path: after.get(path) for path in before} == before  # every input as it was
    # nothing was trained: no coqui run folder anywhere
    assert not list(tmp_path.rglob("xtts_finetune-*"))


def test_each_paragraph_names_file_found_expected_and_fix(
        setup: dict[str, Path], headless: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Spot checks of the content: the file, what was found, what was expected, the fix."""
    argv, _ = _case("latin-1 manifest", setup, tmp_path)
    headless.main(argv)
    text = _one_paragraph(capsys.readouterr().err)
    assert "latin1.csv" in text and "0xE9 on line 2" in text and "'é'" in text
    assert "Expected UTF-8" in text and "iconv" in text
    argv, _ = _case("missing audio", setup, tmp_path)
    headless.main(argv)
    text = _one_paragraph(capsys.readouterr().err)
    assert "nope_1.wav" in text and "nope_2.wav" in text and "Fix the paths" in text
    argv, _ = _case("wrong model file", setup, tmp_path)
    headless.main(argv)
    text = _one_paragraph(capsys.readouterr().err)
    assert "dvae.pth" in text and "only 0 of the model's" in text and "random weights" in text


@pytest.mark.slow
def test_bad_inputs_as_real_processes(setup: dict[str, Path], tmp_path: Path) -> None:
    """Two of the ten through a real process: the wrong model file (found once the model is
    built, before the Trainer) and a Latin-1 manifest."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT))
    for name in ("wrong model file", "latin-1 manifest"):
        argv, words = _case(name, setup, tmp_path / name.replace(" ", "_"))
        before = _hashes(setup["base"], setup["data"])
        result = forkserver.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                                text=True, env=env, timeout=300, cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-2000:]
        assert words in _one_paragraph(result.stderr)
        assert _hashes(setup["base"], setup["data"]) == before


# -- the other cases of item 3 -------------------------------------------------------------

def _expect_2(headless: Any, argv: list[str], capsys: pytest.CaptureFixture[str],
              *words: str) -> str:
    assert headless.main(argv) == 2
    text = _one_paragraph(capsys.readouterr().err)
    for word in words:
        assert word in text, text
    return text


def test_other_manifest_faults(setup: dict[str, Path], headless: Any, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    data, out, rows = setup["data"], tmp_path / "out", _rows(setup)
    utf16 = _manifest(data, "utf16.csv", "\n".join(rows).encode("utf-16"))
    _expect_2(headless, _args(setup, out, manifest=utf16), capsys, "encoded as UTF-16")
    header_only = _manifest(data, "header_only.csv", (rows[0] + "\n").encode())
    _expect_2(headless, _args(setup, out, manifest=header_only), capsys,
              "has the header but no rows")
    four = _manifest(data, "four.csv", ("\n".join(
        [rows[0] + "|emotion_name"] + [r + "|neutral" for r in rows[1:]]) + "\n").encode())
    _expect_2(headless, _args(setup, out, manifest=four), capsys, "It has 4 columns",
              "audio_file|text|speaker_name")
    pipe_in_text = _manifest(data, "pipe.csv", ("\n".join(
        [rows[0], rows[1], "wavs/clip_001.wav|ሰላም|ሰላም|spk1"]) + "\n").encode())
    _expect_2(headless, _args(setup, out, manifest=pipe_in_text), capsys,
              "1 of 2 rows", "line 3: 4 fields")
    no_header = _manifest(data, "no_header.csv", ("\n".join(rows[1:]) + "\n").encode())
    _expect_2(headless, _args(setup, out, manifest=no_header), capsys,
              "looks like a data row")
    bom = _manifest(data, "bom.csv", b"\xef\xbb\xbf" + "\n".join(rows).encode())
    _expect_2(headless, _args(setup, out, manifest=bom), capsys, "byte-order mark")
    eval_bad = _manifest(data, "eval_missing.csv", (rows[0] + "\nwavs/gone.wav|ሰላም|spk0\n"
                                                    ).encode())
    _expect_2(headless, _args(setup, out, "--eval-manifest", str(eval_bad)), capsys,
              "--eval-manifest", "gone.wav")


def test_vocab_without_the_language_token(setup: dict[str, Path], headless: Any,
                                          tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from demo.xtts_tiny import train_bpe_vocab

    english = train_bpe_vocab(["hello there", "general kenobi"], tmp_path / "vocab_en.json",
                              languages=["en"], vocab_size=60)
    _expect_2(headless, _args(setup, tmp_path / "out", "--vocab", str(english)), capsys,
              "vocab_en.json", "cannot encode language 'am'", "[am]", "[en]")
    config_as_vocab = setup["base"] / "config.json"
    _expect_2(headless, _args(setup, tmp_path / "out", "--vocab", str(config_as_vocab)),
              capsys, "not a tokenizer file")


def test_damaged_base_files(setup: dict[str, Path], headless: Any, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "model.pth"
    data = (setup["base"] / "model.pth").read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    _expect_2(headless, _args(setup, tmp_path / "out", "--model", str(damaged)), capsys,
              "--model", "model.pth", "truncated")
    dvae = tmp_path / "dvae.pth"
    dvae.write_bytes(b"not a torch file")
    _expect_2(headless, _args(setup, tmp_path / "out", "--dvae", str(dvae)), capsys,
              "--dvae", "cannot be read by torch.load")


@pytest.mark.parametrize("flag,value,words", [
    ("--lr", "0", "--lr is 0.0"), ("--lr", "inf", "--lr is inf"),
    ("--workers", "-1", "--workers is -1"), ("--print-step", "0", "--print-step is 0"),
    ("--max-audio-seconds", "-2", "--max-audio-seconds is -2.0"),
])
def test_numbers_out_of_range(flag: str, value: str, words: str, setup: dict[str, Path],
                              headless: Any, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    _expect_2(headless, _args(setup, tmp_path / "out", flag, value), capsys, words, "expected")


def test_output_dir_that_cannot_be_made_or_written(setup: dict[str, Path], headless: Any,
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "a_file"
    afile.write_text("x", encoding="utf-8")
    _expect_2(headless, _args(setup, afile / "sub"), capsys, "cannot be created",
              "is a file, not a folder")
    assert afile.read_text(encoding="utf-8") == "x"
    if os.geteuid() != 0:  # root writes into read-only folders: nothing to refuse there
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            _expect_2(headless, _args(setup, ro / "out"), capsys, "cannot be written")
        finally:
            ro.chmod(0o755)


def test_resume_forms(setup: dict[str, Path], headless: Any, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    """--resume: a missing path, an empty folder, a folder without config.json and an older
    checkpoint are refused; the newest checkpoint file and its folder are the same run."""
    out = tmp_path / "out"
    _expect_2(headless, _args(setup, out, "--resume", str(tmp_path / "nowhere")), capsys,
              "no such file or folder")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    _expect_2(headless, _args(setup, out, "--resume", str(empty)), capsys,
              "holds no checkpoint", "Start without --resume")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint_5.pth").write_bytes(b"5")
    (run / "checkpoint_10.pth").write_bytes(b"10")
    _expect_2(headless, _args(setup, out, "--resume", str(run)), capsys, "has no config.json")
    shutil.copy(setup["base"] / "config.json", run / "config.json")
    _expect_2(headless, _args(setup, out, "--resume", str(run / "checkpoint_5.pth")), capsys,
              "newest checkpoint", "checkpoint_10.pth", "make a new folder")
    parser = headless.build_parser()
    for given in (run, run / "checkpoint_10.pth"):
        settings = headless.preflight(parser.parse_args(_args(setup, out, "--resume",
                                                              str(given))))
        assert settings.resume_folder == run


def test_language_aliases_and_disabled_patch(setup: dict[str, Path], headless: Any,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    parser = headless.build_parser()
    args = _args(setup, tmp_path / "out")
    args[args.index("--language") + 1] = "amh"  # ISO 639-3: the same language as am
    assert headless.preflight(parser.parse_args(args)).language == "amh"
    assert not (tmp_path / "out").exists()  # pre-flight writes nothing
    monkeypatch.setenv("TRAINING_PATCHES_DISABLE", "xtts_language")
    _expect_2(headless, args, capsys, "TRAINING_PATCHES_DISABLE", "xtts_language")


def test_bad_setting_in_process(setup: dict[str, Path], headless: Any, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRAINING_PATCHES_MIN_SCALE", "4096")
    _expect_2(headless, _args(setup, tmp_path / "out"), capsys,
              "TRAINING_PATCHES_MIN_SCALE", "above", "init_scale")


def test_coqui_not_installed(setup: dict[str, Path], headless: Any, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "TTS", None)  # what `import TTS` meets when it is absent
    _expect_2(headless, _args(setup, tmp_path / "out"), capsys,
              "coqui-tts cannot be imported", "pip install")


@pytest.mark.slow
def test_bad_setting_at_activation_is_one_paragraph(setup: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """A misspelled variable stops the first-line activation: one paragraph, exit 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT),
               TRAINING_PATCHES_BASEVOCAB="12000")
    result = forkserver.run([sys.executable, str(SCRIPT), *_args(setup, tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    text = _one_paragraph(result.stderr)
    assert "TRAINING_PATCHES_BASEVOCAB (did you mean TRAINING_PATCHES_BASE_VOCAB?)" in text
    assert not (tmp_path / "out").exists()


# -- doctor validates exactly as activation does ----------------------------------------

@pytest.mark.parametrize("env", [{"TRAINING_PATCHES_MIN_SCALE": "4096"},
                                 {"TRAINING_PATCHES_BASEVOCAB": "12000"},
                                 {"TRAINING_PATCHES_DISABLE": "nan_gaurd"}])
def test_doctor_reports_the_error_activation_stops_with(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    import patches
    from patches.tools import doctor

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(patches.advanced.ConfigError) as activation:
        patches.advanced.apply()
    assert patches.advanced.applied() == {}
    status, what, detail = doctor.settings_check()
    assert (status, what) == (doctor.FAIL, "settings")
    assert detail.startswith(str(activation.value))
    assert doctor._doctor(argparse.Namespace(json=None, force=False)) == 1
    assert "[FAIL] settings" in capsys.readouterr().out


def test_doctor_settings_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    from patches.tools import doctor

    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", "12000")
    assert doctor.settings_check() == (doctor.OK, "settings",
                                       "TRAINING_PATCHES_BASE_VOCAB=12000 (vocab_freeze)")


# -- a real run: reports in --output-dir, an error inside the Trainer said once ---------------

@pytest.mark.xtts
@pytest.mark.slow
def test_trainer_error_is_one_paragraph_and_reports_land_in_output_dir(
        setup: dict[str, Path], tmp_path: Path) -> None:
    """A real fine-tune through the coqui Trainer: one sample with characters the vocabulary
    lacks is dropped (in the first epoch, which reads every sample) and a NaN at step 5 is
    skipped, both listed in <output-dir>; with
    MAX_BAD_STEPS=1 the guard then stops the run: exit 1, one paragraph, no traceback on
    stderr (it is in train.log), the run folder kept."""
    rows = _rows(setup)
    manifest = _manifest(setup["data"], "with_latin.csv", ("\n".join(
        [*rows, "wavs/clip_000.wav|zqxj wvkf|spk0"]) + "\n").encode())
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT),
               TRAINING_PATCHES_MAX_BAD_STEPS="1")
    result = forkserver.run(
        [sys.executable, str(SCRIPT), *_args(setup, out, "--epochs", "3", "--lr", "1e-4",
                                             "--print-step", "1", "--inject-nan-step", "5",
                                             manifest=manifest)],
        capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    text = _one_paragraph(result.stderr)
    assert text.startswith("training stopped inside the coqui Trainer at step"), text
    assert "1 consecutive optimizer steps had non-finite loss" in text, text
    assert "NonFiniteTrainingError" not in text and "did not come from" not in text
    runs = list(out.glob("xtts_finetune-*"))
    assert len(runs) == 1 and str(runs[0]) in text  # kept, and named
    log = (out / "train.log").read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in log and "NonFiniteTrainingError" in log
    # the one documented place: <output-dir>, not the run folder, not the working directory
    events = [json.loads(line) for line in
              (out / "nonfinite_events.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(events) == 1
    dropped = [json.loads(line) for line in
               (out / "dropped_samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [d["reason"] for d in dropped] == ["unknown_token"]
    for name in ("nonfinite_events.jsonl", "dropped_samples.jsonl"):
        assert sorted(p.parent for p in tmp_path.rglob(name)) == [out]
    failed = [json.loads(line) for line in
              (out / "headless_runs.jsonl").read_text(encoding="utf-8").splitlines()]
    assert failed[-1]["event"] == "failed" and "NonFiniteTrainingError" in failed[-1]["error"]


def test_output_dir_setting_uses_the_same_check(tmp_path: Path) -> None:
    """TRAINING_PATCHES_OUTPUT_DIR and --output-dir share one check (_options.output_dir_problem)."""
    from patches import _options
    from patches.advanced import ConfigError

    afile = tmp_path / "a_file"
    afile.write_text("x", encoding="utf-8")
    assert _options.output_dir_problem(tmp_path / "new" / "deeper") is None
    assert _options.output_dir_problem(afile) == "is a file, not a folder"
    assert "is a file, not a folder" in _options.output_dir_problem(afile / "sub")
    with pytest.raises(ConfigError, match="TRAINING_PATCHES_OUTPUT_DIR.*is a file"):
        _options.resolve(environ={"TRAINING_PATCHES_OUTPUT_DIR": str(afile)})
    assert not (tmp_path / "new").exists()  # checking creates nothing
