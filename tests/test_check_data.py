"""``training-patches check-data``: each planted defect is flagged on its clip and no other.

The dataset is made here: speech-like clips (demo.xtts_tiny.speech_like) with Amharic
transcripts that match their length, two speakers, and one clip per defect.
"""

from __future__ import annotations

import csv
import json
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from demo.xtts_tiny import SAMPLE_RATE, speech_like
from patches.tools import check_data, cli

WORDS = ["ሰላም", "እንዴት", "ነህ", "ዛሬ", "ጥሩ", "ቀን", "ነው", "አዲስ", "አበባ", "ከተማ", "ቤት",
         "ትምህርት", "መጽሐፍ", "ውሃ", "ቡና", "እናት", "አባት", "ልጅ", "ገበያ", "መንገድ"]


def amharic_text(syllables: int, seed: int) -> str:
    """An Amharic sentence of about ``syllables`` Ethiopic letters (each one a syllable)."""
    rng = np.random.RandomState(seed)
    words: list[str] = []
    while sum(map(len, words)) < syllables:
        words.append(WORDS[rng.randint(len(WORDS))])
    return " ".join(words) + "።"


def matching_text(seconds: float, seed: int) -> str:
    # speech_like voices about 70 % of its frames; about 5 syllables per voiced second
    return amharic_text(round(5 * 0.7 * seconds), seed)


def write_wav(folder: Path, name: str, wave: np.ndarray) -> str:
    (folder / "wavs").mkdir(exist_ok=True)
    sf.write(folder / "wavs" / name, wave.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
    return f"wavs/{name}"


def write_manifest(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="|", quoting=csv.QUOTE_NONE, escapechar="\\",
                            lineterminator="\n")
        writer.writerow(["audio_file", "text", "speaker_name"])
        writer.writerows(rows)
    return path


def clean_rows(folder: Path, count: int = 8) -> list[tuple[str, str, str]]:
    rows = []
    for i in range(count):
        seconds = 3.2 + 0.35 * i
        name = write_wav(folder, f"clean_{i}.wav", speech_like(seconds, 100 + i))
        rows.append((name, matching_text(seconds, i), f"speaker{i % 2}"))
    return rows


# defect -> the reason check-data must give
DEFECTS = {"clipped": "clipped", "silent": "silent", "noisy": "noisy",
           "too_long": "too_long_audio", "wrong_script": "wrong_script",
           "missing": "missing_file", "mismatched": "rate_mismatch"}


def defect_rows(folder: Path) -> dict[str, tuple[str, str, str]]:
    rng = np.random.RandomState(0)
    speech = speech_like(4.0, 7)
    rows = {
        "clipped": (write_wav(folder, "clipped.wav", np.clip(speech * 4, -1, 1)),
                    matching_text(4.0, 50), "speaker0"),
        "silent": (write_wav(folder, "silent.wav", 1e-5 * rng.randn(4 * SAMPLE_RATE)),
                   matching_text(4.0, 51), "speaker1"),
        "noisy": (write_wav(folder, "noisy.wav", 0.6 * speech + 0.08 * rng.randn(len(speech))),
                  matching_text(4.0, 52), "speaker0"),
        "too_long": (write_wav(folder, "too_long.wav", speech_like(12.5, 8)),
                     matching_text(12.5, 53), "speaker1"),
        "wrong_script": (write_wav(folder, "wrong_script.wav", speech_like(4.0, 9)),
                         "this transcript is written in the latin alphabet, not in ethiopic.",
                         "speaker0"),
        "missing": ("wavs/not_there.wav", matching_text(4.0, 54), "speaker1"),
        # 3.5 s of audio with about 80 syllables: five times the speaker's rate
        "mismatched": (write_wav(folder, "mismatched.wav", speech_like(3.5, 10)),
                       amharic_text(80, 55), "speaker0"),
    }
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[tuple[str, str, str]], dict]:
    folder = tmp_path_factory.mktemp("dataset")
    clean = clean_rows(folder)
    defects = defect_rows(folder)
    rows = clean[:4] + list(defects.values()) + clean[4:]  # defects among the clean rows
    return write_manifest(folder / "metadata.csv", rows), clean, defects


def run(argv: list[str]) -> int:
    return cli.main(["check-data", "--no-progress", *argv])


def test_each_defect_is_flagged_on_its_clip_and_no_clean_clip_is(dataset, tmp_path,
                                                                capsys) -> None:
    manifest, clean, defects = dataset
    report_path = tmp_path / "report.json"
    assert run([str(manifest), "--workers", "2", "--json", str(report_path)]) == 1
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text(encoding="utf-8"))
    by_file = {clip["audio_file"]: clip for clip in report["clips"]}
    for defect, reason in DEFECTS.items():
        clip = by_file[defects[defect][0]]
        assert [e["reason"] for e in clip["errors"]] == [reason], (defect, clip)
    for row in clean:
        clip = by_file[row[0]]
        assert clip["errors"] == [] and clip["warnings"] == [], clip
    summary = report["summary"]
    assert summary["clips"] == 15 and summary["clean_clips"] == 8
    assert summary["errors"] == {reason: 1 for reason in DEFECTS.values()}
    assert report["script"] == "Ethiopic" and report["rate_unit"] == "syllables/s"
    # the table names each flagged clip with its reason
    for defect, reason in DEFECTS.items():
        assert any(defects[defect][0] in line and reason in line for line in out.splitlines())
    # speakers and minutes: every clean clip counted once, at its decoded length
    clean_seconds = sum(sf.info(manifest.parent / row[0]).duration for row in clean)
    assert summary["clean_minutes"] == pytest.approx(clean_seconds / 60, abs=0.002)
    assert {s: v["clean_clips"] for s, v in report["speakers"].items()} == {
        "speaker0": 4, "speaker1": 4}


def test_one_worker_and_a_pool_find_the_same(dataset, tmp_path) -> None:
    manifest, _, _ = dataset
    reports = []
    for workers in ("1", "2"):
        path = tmp_path / f"r{workers}.json"
        assert run([str(manifest), "--workers", workers, "--json", str(path)]) == 1
        reports.append(json.loads(path.read_text(encoding="utf-8"))["clips"])
    assert reports[0] == reports[1]


def test_clean_manifest_holds_exactly_the_clean_rows(dataset, tmp_path) -> None:
    manifest, clean, _ = dataset
    out = manifest.parent / "metadata.clean.csv"
    assert run([str(manifest), "--workers", "1", "--clean-manifest", str(out)]) == 1
    lines = manifest.read_text(encoding="utf-8").splitlines(keepends=True)
    clean_files = {row[0] for row in clean}
    expected = [lines[0]] + [line for line in lines[1:] if line.split("|")[0] in clean_files]
    assert out.read_text(encoding="utf-8").splitlines(keepends=True) == expected
    assert len(expected) == 9
    # the cleaned manifest checks clean
    assert run([str(out), "--workers", "1"]) == 0
    # an existing output is refused without --force, replaced with it
    before = out.read_bytes()
    assert run([str(manifest), "--workers", "1", "--clean-manifest", str(out)]) == 2
    assert out.read_bytes() == before
    out.write_text("mine\n", encoding="utf-8")  # not a manifest: never replaced (issue 26)
    assert run([str(manifest), "--workers", "1", "--clean-manifest", str(out), "--force"]) == 2
    assert out.read_text(encoding="utf-8") == "mine\n"
    out.write_text("audio_file|text|speaker_name\nold.wav|an older run|spk\n",
                   encoding="utf-8")  # a manifest (an earlier output): replaced with --force
    assert run([str(manifest), "--workers", "1", "--clean-manifest", str(out), "--force"]) == 1
    assert out.read_text(encoding="utf-8").splitlines(keepends=True) == expected
    out.unlink()


def test_clean_manifest_in_another_folder_points_at_the_same_files(dataset, tmp_path) -> None:
    manifest, clean, _ = dataset
    out = tmp_path / "elsewhere" / "clean.csv"
    out.parent.mkdir()
    assert run([str(manifest), "--workers", "1", "--clean-manifest", str(out)]) == 1
    rows = list(csv.DictReader(out.open(encoding="utf-8"), delimiter="|"))
    assert [(out.parent / r["audio_file"]).resolve() for r in rows] == [
        (manifest.parent / row[0]).resolve() for row in clean]
    assert [r["text"] for r in rows] == [row[1] for row in clean]


def test_the_input_manifest_is_never_overwritten(dataset, capsys) -> None:
    manifest, _, _ = dataset
    before = manifest.read_bytes()
    assert run([str(manifest), "--clean-manifest", str(manifest), "--force"]) == 2
    assert manifest.read_bytes() == before
    assert "is the manifest being checked" in capsys.readouterr().err


def test_a_clean_dataset_exits_zero(tmp_path, capsys) -> None:
    manifest = write_manifest(tmp_path / "m.csv", clean_rows(tmp_path, 3))
    assert run([str(manifest), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "clips: 3  clean: 3  with errors: 0" in out


def test_unknown_tokens_under_an_xtts_vocab(tmp_path) -> None:
    from demo.xtts_tiny import train_bpe_vocab

    from patches.languages.amharic import normalize

    # no transcript has "ቡ" (ቡና -> ውሃ keeps the syllable count) but the last one, and the
    # vocabulary is trained on the normalised words without it: that one has an [UNK]
    rows = [(a, t.replace("ቡና", "ውሃ"), s) for a, t, s in clean_rows(tmp_path, 3)]
    corpus = [normalize(w + "።") for w in WORDS if w != "ቡና"]
    vocab = train_bpe_vocab(corpus, tmp_path / "vocab.json", languages=("am",),
                            vocab_size=120)
    rows.append((rows[0][0], rows[0][1] + " ቡና", "speaker0"))
    manifest = write_manifest(tmp_path / "m.csv", rows)
    report_path = tmp_path / "r.json"
    assert run([str(manifest), "--workers", "1", "--tokenizer", str(vocab),
                "--json", str(report_path)]) == 1
    clips = json.loads(report_path.read_text(encoding="utf-8"))["clips"]
    assert [[e["reason"] for e in c["errors"]] for c in clips] == [[], [], [], ["unknown_token"]]
    assert "'ቡ'" in clips[3]["errors"][0]["detail"]
    assert all(c["tokens"] > 1 for c in clips)


def test_unknown_tokens_under_a_sentencepiece_model(tmp_path) -> None:
    import sentencepiece as spm

    rows = [(a, t.replace("ቡና", "ውሃ"), s) for a, t, s in clean_rows(tmp_path, 3)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(w + "." for w in WORDS if w != "ቡና") * 20, encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=60, character_coverage=1.0,
                                   hard_vocab_limit=False, minloglevel=2)
    rows.append((rows[0][0], rows[0][1] + " ቡና", "speaker0"))
    manifest = write_manifest(tmp_path / "m.csv", rows)
    report_path = tmp_path / "r.json"
    assert run([str(manifest), "--workers", "1", "--tokenizer", str(tmp_path / "sp.model"),
                "--json", str(report_path)]) == 1
    clips = json.loads(report_path.read_text(encoding="utf-8"))["clips"]
    assert [e["reason"] for e in clips[-1]["errors"]] == ["unknown_token"]
    assert all(c["errors"] == [] for c in clips[:-1])


def test_a_vocab_without_the_language_token_fails(tmp_path, capsys) -> None:
    from demo.xtts_tiny import train_bpe_vocab

    rows = clean_rows(tmp_path, 2)
    vocab = train_bpe_vocab([r[1] for r in rows] + WORDS, tmp_path / "vocab.json",
                            languages=("en",), vocab_size=120)
    manifest = write_manifest(tmp_path / "m.csv", rows)
    assert run([str(manifest), "--workers", "1", "--tokenizer", str(vocab)]) == 1
    out = capsys.readouterr().out
    assert "error: the tokenizer" in out and "has no [am] token" in out


BAD_MANIFESTS = {
    "empty": (b"", "the file is empty"),
    "binary": (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00", "binary"),
    "latin1": ("audio_file|text|speaker_name\nwavs/a.wav|caf\u00e9|s\n".encode("latin-1"),
               "not UTF-8"),
    "utf16": ("audio_file|text|speaker_name\nwavs/a.wav|ሰላም|s\n".encode("utf-16"), "UTF-16"),
    "utf16_no_bom": ("audio_file|text|speaker_name\nwavs/a.wav|ሰላም|s\n".encode("utf-16-le"),
                     "UTF-16"),
    "comma": (b"audio_file,text,speaker_name\nwavs/a.wav,hello,s\n", "comma-separated"),
    "columns": ("path|transcript|speaker\nwavs/a.wav|ሰላም|s\n".encode(), "audio_file, text"),
    "bom": ("\ufeffaudio_file|text|speaker_name\nwavs/a.wav|ሰላም|s\n".encode(), "byte-order mark"),
    "header_only": (b"audio_file|text|speaker_name\n", "no rows"),
}


@pytest.mark.parametrize("kind", sorted(BAD_MANIFESTS))
def test_a_bad_manifest_is_one_paragraph_and_exit_2(kind, tmp_path, capsys) -> None:
    content, found = BAD_MANIFESTS[kind]
    path = tmp_path / "metadata.csv"  # not named for the kind: the message must say it
    path.write_bytes(content)
    assert run([str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert str(path) in err and found in err and "Expected" in err
    assert captured.out == ""


def test_a_missing_manifest_and_bad_workers_are_usage_errors(tmp_path, capsys) -> None:
    assert run([str(tmp_path / "nope.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run([str(tmp_path / "nope.csv"), "--workers", "0"])
    assert exit_info.value.code == 2


def test_signal_stats_measures_what_it_says() -> None:
    rate = 1000
    quiet = np.zeros((rate, 1), dtype=np.float32)
    quiet[:500, 0] = 0.5 * np.sin(np.arange(500) * 0.3)
    stats = check_data.signal_stats(quiet, rate)
    assert stats["silence_ratio"] == 0.5 and stats["clipping_ratio"] == 0.0
    clipped = np.full((rate, 2), 0.2, dtype=np.float32)
    clipped[:10, 0] = 1.0
    assert check_data.signal_stats(clipped, rate)["clipping_ratio"] == pytest.approx(10 / 2000)


def test_empty_and_letterless_transcripts_and_long_text(tmp_path) -> None:
    rows = clean_rows(tmp_path, 3)
    long_text = amharic_text(160, 4)  # over Amharic's 150-character limit: a warning
    rows += [(rows[0][0], "", "speaker0"), (rows[1][0], "። ፣ ?", "speaker1"),
             (rows[2][0], long_text, "speaker0")]
    manifest = write_manifest(tmp_path / "m.csv", rows)
    report_path = tmp_path / "r.json"
    assert run([str(manifest), "--workers", "1", "--rate-tolerance", "100",
                "--json", str(report_path)]) == 1
    clips = json.loads(report_path.read_text(encoding="utf-8"))["clips"]
    assert [[e["reason"] for e in c["errors"]] for c in clips[3:]] == [
        ["empty_text"], ["empty_text"], []]
    # the rows reuse the first three files: each is also a repeated file (a warning)
    assert [w["reason"] for w in clips[5]["warnings"]] == ["repeated_file", "over_char_limit"]


def test_undecodable_files_and_the_fallback_decoder(tmp_path) -> None:
    rows = clean_rows(tmp_path, 3)
    (tmp_path / "wavs" / "junk.wav").write_bytes(b"this is not audio" * 10)
    rows.append(("wavs/junk.wav", rows[0][1], "speaker0"))
    fallback = shutil.which("ffmpeg") is not None
    if fallback:  # AAC in MP4: soundfile cannot read it, torchcodec (coqui's decoder) can
        pytest.importorskip("torchcodec")
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i",
                        str(tmp_path / rows[0][0]), "-c:a", "aac",
                        str(tmp_path / "wavs" / "aac.m4a")], check=True)
        rows.append(("wavs/aac.m4a", rows[0][1], "speaker0"))
    manifest = write_manifest(tmp_path / "m.csv", rows)
    report_path = tmp_path / "r.json"
    assert run([str(manifest), "--workers", "1", "--json", str(report_path)]) == 1
    clips = json.loads(report_path.read_text(encoding="utf-8"))["clips"]
    assert [e["reason"] for e in clips[3]["errors"]] == ["decode_failure"]
    assert "Format not recognised" in clips[3]["errors"][0]["detail"]
    if fallback:
        assert clips[4]["errors"] == [] and clips[4]["decoder"] == "torchcodec"
        assert clips[4]["duration_s"] == pytest.approx(clips[0]["duration_s"], abs=0.05)


def test_a_missing_library_is_named_with_the_extra(dataset, monkeypatch, capsys) -> None:
    import importlib.util

    manifest, _, _ = dataset
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "soundfile" else real(name, *a))
    assert run([str(manifest)]) == 2
    err = capsys.readouterr().err
    assert "soundfile" in err and "training-patches[tools]" in err and "\n" not in err.strip()


def test_a_bad_tokenizer_file_is_a_usage_error(dataset, tmp_path, capsys) -> None:
    manifest, _, _ = dataset
    broken = tmp_path / "vocab.json"
    broken.write_text("{not json", encoding="utf-8")
    assert run([str(manifest), "--tokenizer", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(broken) in err and "could not be loaded" in err and "\n" not in err
    assert run([str(manifest), "--tokenizer", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


# -- a signal ends the command and its workers (issue 19) -------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_check_data_and_its_workers_within_seconds(tmp_path, signum,
                                                                  code) -> None:
    """check-data in a subprocess, mid-run on a big manifest, gets SIGTERM (SIGINT): it
    exits 143 (130) with one line, every pool worker is gone within seconds, stdout reaches
    EOF (a caller reading the pipe does not hang) and no output file is written."""
    psutil = pytest.importorskip("psutil")
    import os
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    name = write_wav(tmp_path, "long.wav", speech_like(20.0, 3))
    text = matching_text(20.0, 0)
    # 6000 names of one clip (hard links: no copies): each row is a file to decode (one
    # file named by many rows is decoded once)
    for i in range(6000):
        os.link(tmp_path / name, tmp_path / "wavs" / f"long_{i}.wav")
    manifest = write_manifest(tmp_path / "big.csv",
                              [(f"wavs/long_{i}.wav", text, "s") for i in range(6000)])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.Popen(
        [sys.executable, "-m", "patches", "check-data", str(manifest), "--workers", "2",
         "--json", str(tmp_path / "report.json"), "--no-progress"], cwd=root, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    command = psutil.Process(proc.pid)
    workers: list = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline:  # the pool is decoding
            workers = command.children(recursive=True)
            time.sleep(0.1)
        assert len(workers) >= 2, "the pool never started"
        time.sleep(1.0)
        assert proc.poll() is None, "the check ended before the signal: make the manifest longer"
        proc.send_signal(signum)
        started = time.monotonic()
        stdout, stderr = proc.communicate(timeout=30)  # EOF on both pipes
        gone, alive = psutil.wait_procs(workers, timeout=max(0.1, 10 - (time.monotonic()
                                                                         - started)))
        elapsed = time.monotonic() - started
    finally:
        for process in [command, *workers]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
    assert not alive, f"workers still running: {alive}"
    assert elapsed < 10, elapsed
    assert proc.returncode == code, (stdout, stderr)
    assert stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert signal.Signals(signum).name in stderr and "nothing was written" in stderr
    assert not (tmp_path / "report.json").exists()


def _one_paragraph(err: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_outputs_that_would_lose_a_file_or_crash_are_refused(dataset, tmp_path, capsys) -> None:
    """--json and --clean-manifest naming one file (the report would be lost), a folder
    (even with --force), a path under a file: exit 2, one paragraph, nothing written."""
    manifest, _, _ = dataset
    folder = tmp_path / "out"
    folder.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("mine", encoding="utf-8")
    cases = [(["--json", tmp_path / "x", "--clean-manifest", tmp_path / "x"], "the same file"),
             (["--json", folder, "--force"], "is a folder"),
             (["--clean-manifest", folder, "--force"], "is a folder"),
             (["--json", a_file / "x.json"], "does not exist (or is a file)")]
    for extra, expected in cases:
        assert run([str(manifest), "--workers", "1", *map(str, extra)]) == 2, extra
        err = capsys.readouterr().err
        _one_paragraph(err)
        assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "out"]
    assert not list(folder.iterdir()) and a_file.read_text(encoding="utf-8") == "mine"


@pytest.mark.parametrize("option,value", [
    ("--max-audio-seconds", "nan"), ("--max-audio-seconds", "-1"), ("--min-snr", "inf"),
    ("--max-text-tokens", "-5"), ("--rate-tolerance", "nan"), ("--rate-tolerance", "0.5"),
    ("--workers", "0"), ("--workers", "100000"), ("--workers", "2.5")])
def test_numbers_out_of_range_are_refused(dataset, option, value, capsys) -> None:
    """A limit no clip can fail (nan: every comparison false) is a usage error, not a pass."""
    manifest, _, _ = dataset
    with pytest.raises(SystemExit) as info:
        run([str(manifest), option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected" in err and repr(value) in err


def test_a_line_longer_than_csv_allows_is_one_paragraph(tmp_path, capsys) -> None:
    """A 9 MB one-line transcript (csv's field limit is 131072 characters): exit 2 naming the
    line, not a _csv.Error traceback."""
    path = tmp_path / "metadata.csv"
    path.write_text("audio_file|text|speaker_name\nwavs/a.wav|ሰላም|s\nwavs/b.wav|\"" + "ሀ" * 9_000_000
                    + "|s\n", encoding="utf-8")
    assert run([str(path), "--workers", "1"]) == 2
    captured = capsys.readouterr()
    _one_paragraph(captured.err)
    assert "line 3 (9,000,014 characters)" in captured.err and captured.out == ""


def test_outputs_never_replace_an_audio_file_or_the_tokenizer(dataset, tmp_path,
                                                              capsys) -> None:
    """An output naming an audio file of the manifest or the --tokenizer is an input:
    refused even with --force, the file byte for byte as it was."""
    manifest, clean, _ = dataset
    audio = manifest.parent / clean[0][0]
    before = audio.read_bytes()
    assert run([str(manifest), "--workers", "1", "--clean-manifest", str(audio),
                "--force"]) == 2
    err = capsys.readouterr().err
    _one_paragraph(err)
    assert "audio file (manifest line 2)" in err and "an input of this command" in err
    assert audio.read_bytes() == before
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}", encoding="utf-8")
    assert run([str(manifest), "--workers", "1", "--tokenizer", str(vocab), "--json",
                str(vocab), "--force"]) == 2
    assert "is the --tokenizer" in capsys.readouterr().err
    assert vocab.read_text(encoding="utf-8") == "{}"


def test_json_report_is_strict_follows_the_umask_and_can_go_to_stdout(dataset, tmp_path,
                                                                       capsys) -> None:
    """--json FILE: mode from the umask (not mkstemp's 0600); --json -: the JSON object
    alone on stdout, the table on stderr; both strict JSON, the same report."""
    import os

    manifest, _, _ = dataset
    out = tmp_path / "check.json"
    old = os.umask(0o022)
    try:
        assert run([str(manifest), "--workers", "1", "--json", str(out)]) == 1
    finally:
        os.umask(old)
    capsys.readouterr()
    assert out.stat().st_mode & 0o777 == 0o644

    def strict(text: str) -> dict:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))

    assert run([str(manifest), "--workers", "1", "--json", "-"]) == 1
    captured = capsys.readouterr()
    doc = strict(captured.out)
    assert doc == strict(out.read_text(encoding="utf-8"))
    assert doc["tool"] == "training-patches check-data" and doc["format"] == 1
    assert doc["exit_code"] == 1 and doc["summary"]["flagged_clips"] == 7
    assert "clips: 15" in captured.err and "result:" in captured.err


def test_rows_naming_one_file_count_its_audio_once(tmp_path, capsys) -> None:
    """3,000 rows naming the same 12 files were counted as 127.7 minutes of audio: each
    file counts once, each repeating row is a warning, and the table says how many."""
    files = clean_rows(tmp_path, count=3)
    rows = [files[i % 3] for i in range(30)]
    manifest = write_manifest(tmp_path / "metadata.csv", rows)
    report_path = tmp_path / "report.json"
    assert run([str(manifest), "--workers", "1", "--json", str(report_path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text(encoding="utf-8"))
    summary = report["summary"]
    seconds = sum(sf.info(tmp_path / row[0]).duration for row in files)
    assert summary["minutes"] == pytest.approx(seconds / 60, abs=0.002)
    assert summary["clean_minutes"] == pytest.approx(seconds / 60, abs=0.002)
    assert (summary["clips"], summary["audio_files"], summary["repeated_rows"]) == (30, 3, 27)
    assert summary["warnings"] == {"repeated_file": 27}
    assert report["clips"][3]["warnings"] == [
        {"reason": "repeated_file", "detail": "the same audio file as line 2"}]
    assert "in 3 audio files; 27 rows name a file an earlier row names (each file counted " \
        "once)" in out


def test_clean_manifest_dash_goes_to_stdout_alone(dataset, tmp_path, capsys,
                                                   monkeypatch) -> None:
    """``--clean-manifest -`` wrote a file named ``-``: now the manifest is stdout, alone,
    its audio paths relative to the current folder; the table goes to stderr."""
    manifest, clean, _ = dataset
    monkeypatch.chdir(tmp_path)
    assert run([str(manifest), "--workers", "1", "--clean-manifest", "-"]) == 1
    captured = capsys.readouterr()
    assert not (tmp_path / "-").exists()
    lines = captured.out.splitlines()
    assert lines[0] == "audio_file|text|speaker_name" and len(lines) == 1 + len(clean)
    assert all((tmp_path / line.split("|")[0]).is_file() for line in lines[1:])
    assert "clean manifest: stdout (8 of 15 rows)" in captured.err
    # both outputs on stdout at once: one paragraph, nothing written
    assert run([str(manifest), "--json", "-", "--clean-manifest", "-"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "both ask for stdout" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
