"""The training-patches command: doctor and report."""

from __future__ import annotations

from pathlib import Path

import json

import forkserver
from patches.tools import cli
from processes import child_path


def test_doctor_lists_torch_and_exits_zero(capsys) -> None:
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "wrapt" in out and "ffmpeg" in out


def test_report_summarises_events_and_dropped_samples(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the picture goes to the current folder
    events = [
        {"step": 3, "trainer_step": 2, "kind": "nonfinite_loss", "samples": ["a.wav", "b.wav"],
         "consecutive": 1, "source": {"module": "gpt.text_embedding", "where": "output"}},
        {"step": 9, "trainer_step": 8, "kind": "nonfinite_grad", "samples": ["a.wav", "c.wav"],
         "consecutive": 1},
    ]
    (tmp_path / "nonfinite_events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events) + "{torn line\n")
    (tmp_path / "dropped_samples.jsonl").write_text(
        json.dumps({"audio_file": "x.wav", "reason": "decode_failure"}) + "\n")
    assert cli.main(["report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "skipped steps: 2 (nonfinite_loss 1, nonfinite_grad 1)" in out
    assert "a.wav (2)" in out and "gpt.text_embedding" in out
    assert "1 unreadable line(s)" in out
    assert "dropped samples: 1 (decode_failure 1)" in out


def test_report_on_a_missing_folder_is_a_clear_error(tmp_path, capsys) -> None:
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def _options_of(parser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command")
    return {f for a in sub.choices[command]._actions for f in a.option_strings}


def test_each_command_is_built_from_its_own_module() -> None:
    """The parser for one command (all that ``training-patches COMMAND`` imports) has that
    command in full, the same as the parser of every command; the others only by name."""
    full = cli.build_parser()
    sub = next(a for a in full._actions if a.dest == "command")
    assert list(sub.choices) == list(cli.COMMANDS)
    for command in cli.COMMANDS:
        one = cli.build_parser(command)
        assert _options_of(one, command) == _options_of(full, command), command
        assert all(_options_of(one, other) == {"-h", "--help"}
                   for other in cli.COMMANDS if other != command)
    assert cli.command_of(["--version"]) is None
    assert cli.command_of(["check-data", "m.csv", "--json", "-"]) == "check-data"
    assert cli.command_of(["run", "python", "doctor"]) == "run"


def test_version(capsys) -> None:
    import pytest

    import patches

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"training-patches {patches.__version__}"


def test_the_version_is_one_everywhere() -> None:
    """setup.cfg reads patches/_version.py: the installed metadata, --version, the banner
    and the checkpoints' "written_by" all say the same version."""
    import importlib.metadata
    import configparser

    import patches

    assert importlib.metadata.version("training-patches") == patches.__version__
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: patches._version.__version__"


# -- every command: one-paragraph usage errors, --json, signals (issue 19) ---------------------

import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def strict_loads(text: str) -> object:
    """json.loads that refuses NaN/Infinity, as strict JSON parsers (jq, JavaScript) do."""
    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("argv", [
    ["check-data", "m.csv", "--max-audio-seconds", "nan"],
    ["check-data", "m.csv", "--min-snr", "inf"],
    ["verify-tokenizer", "vocab.json", "--max-unk-rate", "nan"],
    ["extend-tokenizer", "vocab.json", "--corpus", "c.txt", "--new-pieces", "-3"],
    ["report", "run", "--no-such-option"],
])
def test_a_usage_error_is_one_paragraph_and_exit_2(argv, capsys) -> None:
    """A bad number or option: the error and where the options are listed, on one line,
    not argparse's usage block above it."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert "usage:" not in captured.err and "--help" in captured.err


def test_doctor_json_on_stdout_is_the_whole_output_and_strict(capsys) -> None:
    assert cli.main(["doctor", "--json", "-"]) == 0
    doc = strict_loads(capsys.readouterr().out)  # stdout holds the JSON object and nothing else
    assert doc["tool"] == "training-patches doctor" and doc["format"] == 1
    assert doc["ok"] is True and doc["exit_code"] == 0
    checks = {c["what"]: c for c in doc["checks"]}
    import torch

    assert checks["torch"] == {"status": "ok", "what": "torch", "detail": torch.__version__}
    assert {c["status"] for c in doc["checks"]} <= {"ok", "warn", "FAIL"}


def test_doctor_json_file_follows_the_output_rule(tmp_path, capsys, monkeypatch) -> None:
    """--json FILE: created with the umask's mode; an existing file only with --force; a
    folder never; the text still printed."""
    out = tmp_path / "doctor.json"
    old = os.umask(0o027)
    try:
        assert cli.main(["doctor", "--json", str(out)]) == 0
    finally:
        os.umask(old)
    assert "[ok  ] torch" in capsys.readouterr().out
    assert out.stat().st_mode & 0o777 == 0o640  # mkstemp's 0600 would not follow the umask
    assert strict_loads(out.read_text(encoding="utf-8"))["tool"] == "training-patches doctor"
    written = out.read_bytes()
    assert cli.main(["doctor", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == written
    assert cli.main(["doctor", "--json", str(out), "--force"]) == 0  # its own JSON: replaced
    assert strict_loads(out.read_text(encoding="utf-8"))["ok"] is True
    out.write_text("mine", encoding="utf-8")  # not a doctor JSON: refused, --force or not
    assert cli.main(["doctor", "--json", str(out), "--force"]) == 2
    assert "is not a JSON report written by training-patches doctor" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == "mine"
    capsys.readouterr()
    assert cli.main(["doctor", "--json", str(tmp_path), "--force"]) == 2
    assert "is a folder" in capsys.readouterr().err


def _foreign_files(folder: Path) -> dict[str, Path]:
    """Files no command writes: a checkpoint, a run's events file, a user's JSON, another
    command's JSON report, a user's text."""
    import torch

    folder.mkdir()
    files = {"checkpoint": folder / "checkpoint_6.pth", "events": folder / "nonfinite_events.jsonl",
             "user_json": folder / "settings.json", "doctor_json": folder / "doctor.json",
             "notes": folder / "notes.txt"}
    torch.save({"model": {"w": torch.ones(64, 64)}, "step": 6}, files["checkpoint"])
    files["events"].write_text('{"step": 3, "kind": "nonfinite_loss", "loss": "NaN"}\n',
                               encoding="utf-8")
    files["user_json"].write_text('{"lr": 5e-06, "epochs": 10}\n', encoding="utf-8")
    files["doctor_json"].write_text('{"tool": "training-patches doctor", "format": 1}\n',
                                    encoding="utf-8")
    files["notes"].write_text("audio_file is the first column\n", encoding="utf-8")
    return files


# Each command's --force output, with what the refusal names as its own kind.
FORCE_OUTPUTS = {
    "report --json": (["report", "{run}", "--no-picture", "--json", "{out}"],
                      "a JSON report written by training-patches report"),
    "doctor --json": (["doctor", "--json", "{out}"],
                      "a JSON report written by training-patches doctor"),
    "verify-tokenizer --json": (["verify-tokenizer", "{vocab}", "--json", "{out}"],
                                "a JSON report written by training-patches verify-tokenizer"),
    "check-data --json": (["check-data", "{manifest}", "--json", "{out}"],
                          "a JSON report written by training-patches check-data"),
    "check-data --clean-manifest": (["check-data", "{manifest}", "--clean-manifest", "{out}"],
                                    "a coqui manifest"),
    "extend-tokenizer --output": (["extend-tokenizer", "{vocab}", "--corpus", "{corpus}",
                                   "--language", "am", "--output", "{out}"],
                                  "an XTTS vocab.json tokenizer"),
}


@pytest.mark.parametrize("output", list(FORCE_OUTPUTS))
def test_force_replaces_only_a_file_the_command_wrote(output, tmp_path, capsys) -> None:
    """Issue 26 item 4: ``report --json FILE --force`` replaced a 324 MB checkpoint with a
    1.5 KB JSON. --force replaces only the command's own kind of output: a checkpoint, an
    events file, a user's JSON, another command's report or a text file is refused (exit 2,
    one paragraph) and kept byte for byte. (The replacing of the command's own earlier
    output is tested with each command.)"""
    argv, kind = FORCE_OUTPUTS[output]
    run = tmp_path / "run"
    run.mkdir()
    inputs = {"run": run, "vocab": tmp_path / "vocab.json", "manifest": tmp_path / "m.csv",
              "corpus": tmp_path / "am.txt"}
    inputs["vocab"].write_text("{}", encoding="utf-8")  # refused before it is read
    inputs["manifest"].write_text("audio_file|text|speaker_name\nmissing.wav|hello|spk\n",
                                  encoding="utf-8")
    files = _foreign_files(tmp_path / "others")
    if "doctor" in output:
        del files["doctor_json"]  # its own kind
    for name, path in files.items():
        before = path.read_bytes()
        line = [a.format(out=path, **inputs) for a in argv]
        for force in ([], ["--force"]):
            assert cli.main(line + force) == 2, (name, force)
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
            assert str(path) in err, err
            if force or name != "checkpoint":
                continue
            assert "already exists" in err
        assert f"is not {kind}" in err and "untouched" in err, err
        assert path.read_bytes() == before, name


def test_a_json_write_the_system_refuses_is_one_paragraph_and_exit_1(tmp_path, capsys) -> None:
    """Issue 26 item 7: every command's --json into a read-only folder (and onto a full
    disk) is one paragraph saying which, exit 1 (not a usage error), nothing left there."""
    from io_faults import full_disk, read_only, temporaries

    run = tmp_path / "run"
    run.mkdir()
    (run / "nonfinite_events.jsonl").write_text('{"step": 3, "kind": "nonfinite_loss"}\n',
                                                encoding="utf-8")
    manifest = tmp_path / "m.csv"
    manifest.write_text("audio_file|text|speaker_name\nmissing.wav|hello|spk\n",
                        encoding="utf-8")
    pytest.importorskip("tokenizers")
    from demo.xtts_tiny import DEFAULT_TEXTS, train_bpe_vocab

    vocab = train_bpe_vocab(list(DEFAULT_TEXTS), tmp_path / "vocab.json", languages=("en",),
                            vocab_size=74)
    commands = {"doctor": ["doctor"], "report": ["report", str(run), "--no-picture"],
                "check-data": ["check-data", str(manifest), "--workers", "1"],
                "verify-tokenizer": ["verify-tokenizer", str(vocab)]}
    for fault, place in (("the file system is read-only", read_only(tmp_path / "ro")),
                         ("the disk is full", full_disk(tmp_path / "full", free=0))):
        with place as folder:
            listing = sorted(p.name for p in folder.iterdir())
            for name, argv in commands.items():
                out = folder / f"{name}.json"
                assert cli.main([*argv, "--json", str(out)]) == 1, name
                err = capsys.readouterr().err.strip()
                assert f"could not write {out}: {fault}" in err, err
                assert err.splitlines()[-1].startswith(f"training-patches {name}"), err
                assert "Traceback" not in err and not out.exists()
            assert sorted(p.name for p in folder.iterdir()) == listing
            assert temporaries(folder) == []


def _tool(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT))
    return forkserver.popen([sys.executable, "-m", "patches", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_verify_tokenizer_with_one_line(tmp_path, signum, code) -> None:
    """Ctrl-C (SIGTERM) while verify-tokenizer runs the user's --g2p: exit 130 (143), one
    line on stderr, no traceback, no --json file."""
    pytest.importorskip("tokenizers")
    from demo.xtts_tiny import DEFAULT_TEXTS, train_bpe_vocab

    vocab = train_bpe_vocab(list(DEFAULT_TEXTS), tmp_path / "vocab.json", languages=("en",),
                            vocab_size=74)
    (tmp_path / "text.txt").write_text("hello there\n" * 50, encoding="utf-8")
    (tmp_path / "slow_g2p.py").write_text(
        "import pathlib, time\n"
        "def g2p(text):\n"
        "    pathlib.Path('started').touch()\n"
        "    time.sleep(60)\n"
        "    return text\n", encoding="utf-8")
    proc = _tool(["verify-tokenizer", str(vocab), "--text", "text.txt", "--no-cleaner",
                  "--g2p", "slow_g2p.py:g2p", "--json", "v.json"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert signal.Signals(signum).name in stderr and "verify-tokenizer" in stderr
    assert not (tmp_path / "v.json").exists()


@pytest.mark.slow
def test_doctor_reads_the_tts_a_trainer_would_import(tmp_path) -> None:
    """doctor run in a trainer's folder that ships its own TTS/ (0.22) reports that copy,
    as the banner does, and warns that it is outside the supported range; the installed
    coqui-tts's metadata would say 0.28."""
    import subprocess
    import sys

    vendored = tmp_path / "TTS"
    vendored.mkdir()
    (vendored / "__init__.py").write_text('__version__ = "0.22.0"\n')
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "patches", "doctor"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True,
                          text=True, timeout=120)
    line = next(l for l in done.stdout.splitlines() if " coqui-tts " in l)
    assert line.startswith("[warn]") and "0.22.0" in line, done.stdout
    assert str(vendored) in line or "TTS" in line


def test_a_tool_that_uses_the_settings_refuses_a_bad_one_first(tmp_path, capsys,
                                                               monkeypatch) -> None:
    """Without the activation line the settings are read at first use; a tool that uses them
    checks them first and stops with activation's paragraph (not a failure per row)."""
    from patches import _options

    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "bogus")
    monkeypatch.setattr(_options, "_current", None, raising=False)
    manifest = tmp_path / "metadata.csv"
    manifest.write_text("audio_file|text|speaker_name\n", encoding="utf-8")
    assert cli.main(["check-data", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("training-patches check-data: training-patches: the environment "
                          "variable TRAINING_PATCHES_ROW_INIT is 'bogus'")
    assert "\n" not in err.strip()
