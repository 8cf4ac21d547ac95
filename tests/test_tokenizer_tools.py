"""``training-patches extend-tokenizer`` / ``verify-tokenizer`` and ``--extend-vocab``, on real
files made here with ``tokenizers`` and ``sentencepiece`` (and the real coqui Trainer)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest

from patches.tools import cli
from processes import child_path

pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]

# Everyday Amharic with Ethiopic punctuation and a number (the cleaner speaks it out).
AMHARIC = (
    "ሰላም፣ እንዴት ነህ፧", "ደህና ነኝ፣ አመሰግናለሁ።", "ስሜ አበበ ይባላል።", "ቡና መጠጣት እፈልጋለሁ።",
    "ዛሬ አየሩ በጣም ጥሩ ነው።", "ገበያው የት ነው፧", "ልጆቹ ወደ ትምህርት ቤት ሄዱ።",
    "እባክህ ቀስ ብለህ ተናገር።", "ይህ ዳቦ 15 ብር ነው።", "አዲስ አበባ የኢትዮጵያ ዋና ከተማ ናት።",
)
# Code-switching lines: English words in an Amharic corpus. A BPE learned on them joins
# base (Latin) tokens the base never joined ("qu" + "ick" ...): those merges must be left
# out, or base English would encode differently.
MIXED = ("ሰላም quick quick quickly brown brown", "የ weather weather lazy lazy dog")


def _english() -> list[str]:
    from demo.xtts_tiny import DEFAULT_TEXTS

    return list(DEFAULT_TEXTS)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from demo.xtts_tiny import train_bpe_vocab

    root = tmp_path_factory.mktemp("tok")
    corpus = root / "am.txt"
    corpus.write_text("\n".join(AMHARIC * 3 + MIXED) + "\n", encoding="utf-8")
    manifest = root / "am.csv"
    manifest.write_text("audio_file|text|speaker_name\n" + "".join(
        f"wavs/{i}.wav|{text}|spk{i % 2}\n" for i, text in enumerate(AMHARIC)), encoding="utf-8")
    english = root / "en.txt"
    english.write_text("\n".join(_english()) + "\n", encoding="utf-8")
    vocab = train_bpe_vocab(_english(), root / "vocab.json", languages=("en",), vocab_size=74)
    return {"root": root, "corpus": corpus, "manifest": manifest, "english": english,
            "vocab": vocab}


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- XTTS vocab.json ------------------------------------------------------------------------


def test_xtts_vocab_extended_with_amharic_keeps_ids_merges_and_english(files, tmp_path,
                                                                       capsys) -> None:
    from tokenizers import Tokenizer

    from patches.tools.tokenizer.bpe import xtts_text

    out = tmp_path / "vocab_am.json"
    before = _sha(files["vocab"])
    rc, stdout, stderr = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus",
                               files["corpus"], "--language", "am", "--output", out,
                               "--min-frequency", "1", "--base-text", files["english"])
    assert rc == 0, stderr
    assert _sha(files["vocab"]) == before  # the input is untouched
    base = json.loads(files["vocab"].read_text(encoding="utf-8"))
    ext = json.loads(out.read_text(encoding="utf-8"))
    old_tok, new_tok = Tokenizer.from_file(str(files["vocab"])), Tokenizer.from_file(str(out))
    old_ids, new_ids = old_tok.get_vocab(), new_tok.get_vocab()
    size = max(new_ids.values()) + 1
    # every base id kept; [START] (the base's last id, 73) moved to the new last id
    assert old_ids["[START]"] == 73 and new_ids["[START]"] == size - 1
    assert {t: i for t, i in new_ids.items() if t in old_ids and t != "[START]"} == \
        {t: i for t, i in old_ids.items() if t != "[START]"}
    assert sorted(new_ids.values()) == list(range(size))  # no gaps, no duplicates
    # every base merge kept, at its rank; new merges come after
    assert ext["model"]["merges"][:len(base["model"]["merges"])] == base["model"]["merges"]
    assert len(ext["model"]["merges"]) > len(base["model"]["merges"])
    # [am] is one special token, the first new id
    assert new_ids["[am]"] == 73
    assert any(t["content"] == "[am]" and t["special"] for t in ext["added_tokens"])
    assert new_tok.encode("[am]").ids == [73]
    # English encodes exactly as before (the base covers every character of these)
    for line in _english():
        assert new_tok.encode(xtts_text(line, "en")).ids == old_tok.encode(
            xtts_text(line, "en")).ids, line
    # Amharic, cleaned as the trainer does, has no [UNK]; whole words became pieces
    from patches.languages import get_language

    clean = get_language("am").cleaner
    unk = new_tok.token_to_id("[UNK]")
    for line in AMHARIC:
        assert unk not in new_tok.encode(xtts_text(clean(line), "am")).ids, line
    assert "ሰላም" in new_ids
    assert "[UNK]" in " ".join(old_tok.encode(clean(AMHARIC[0])).tokens)
    # what it printed
    assert f"size: 74 -> {size} tokens" in stdout
    assert f"base ids: 0..72   new ids: 73..{size - 2}" in stdout
    assert f"[START]: id 73 -> {size - 1}" in stdout
    assert re.search(r"left out: [1-9]\d* learned piece", stdout)  # the qu+ick kind
    assert "encode exactly as before - OK" in stdout
    assert "corpus characters covered: all" in stdout


def test_new_pieces_is_a_size_you_set(files, tmp_path, capsys) -> None:
    sizes = {}
    for pieces in (0, 5):
        out = tmp_path / f"v{pieces}.json"
        rc, stdout, _ = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus",
                              files["manifest"], "--language", "am", "-o", out,
                              "--new-pieces", pieces, "--min-frequency", "1")
        assert rc == 0
        sizes[pieces] = int(re.search(r"size: 74 -> (\d+)", stdout).group(1))
        assert f"{pieces} learned pieces" in stdout
    assert sizes[5] == sizes[0] + 5  # characters + [am] always, then exactly the pieces asked


def test_g2p_front_end_is_what_gets_covered(files, tmp_path, capsys) -> None:
    g2p = tmp_path / "my_g2p.py"
    g2p.write_text("IPA = {'ሰ': 'sə', 'ላ': 'la', 'ም': 'mɨ'}\n"
                   "def to_ipa(text, language):\n"
                   "    return ''.join(IPA.get(c, 'ʔ') for c in text)\n", encoding="utf-8")
    out = tmp_path / "vocab_ipa.json"
    rc, stdout, stderr = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus",
                               files["corpus"], "--language", "am", "-o", out,
                               "--g2p", f"{g2p}:to_ipa")
    assert rc == 0, stderr
    vocab = json.loads(out.read_text(encoding="utf-8"))["model"]["vocab"]
    assert {"ə", "ɨ", "ʔ"} <= set(vocab)          # the phonemes the trainer will see
    assert not {"ሰ", "ላ", "ም"} & set(vocab)        # not the script it never sees


# -- SentencePiece ---------------------------------------------------------------------------


def _spm_bpe_base(path: Path) -> Path:
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_english() * 4), model_writer=out, vocab_size=120,
        model_type="bpe", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    path.write_bytes(out.getvalue())
    return path


def _spm_unigram_base(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_clients import _spm_model  # 12,000 pieces through the model protobuf

    return _spm_model(path)


@pytest.mark.parametrize("make", [_spm_bpe_base, _spm_unigram_base], ids=["bpe", "unigram"])
def test_sentencepiece_extended_keeps_ids_and_encodes_amharic_without_unk(
        files, tmp_path, capsys, make) -> None:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    base = make(tmp_path / "bpe.model")
    out = tmp_path / "bpe_am.model"
    rc, stdout, stderr = _main(capsys, "extend-tokenizer", base, "--corpus", files["corpus"],
                               "--language", "am", "--output", out, "--new-pieces", "40")
    assert rc == 0, stderr
    old, new = pb.ModelProto(), pb.ModelProto()
    old.ParseFromString(base.read_bytes())
    new.ParseFromString(out.read_bytes())
    n = len(old.pieces)
    assert len(new.pieces) > n
    for i in range(n):  # same piece, score and type at every base id
        assert (new.pieces[i].piece, new.pieces[i].score, new.pieces[i].type) == \
            (old.pieces[i].piece, old.pieces[i].score, old.pieces[i].type)
    assert f"base ids: 0..{n - 1}   new ids: {n}..{len(new.pieces) - 1}" in stdout
    sp_old = spm.SentencePieceProcessor(model_file=str(base))
    sp_new = spm.SentencePieceProcessor(model_file=str(out))
    from patches.languages import get_language

    clean = get_language("am").cleaner
    ids = [i for line in AMHARIC for i in sp_new.encode(clean(line))]
    assert ids and ids.count(sp_new.unk_id()) == 0  # UNK rate 0
    assert sum(1 for i in ids if i >= n) > len(ids) // 2  # mostly new pieces
    assert sp_old.unk_id() in [i for line in AMHARIC for i in sp_old.encode(clean(line))]
    for line in _english():
        assert sp_new.encode(line) == sp_old.encode(line), line


# -- verify-tokenizer ---------------------------------------------------------------------------


def test_verify_flags_a_tokenizer_that_maps_amharic_to_unk(files, tmp_path, capsys) -> None:
    rc, stdout, _ = _main(capsys, "verify-tokenizer", files["vocab"], "--language", "am",
                          "--text", files["manifest"])
    assert rc == 1
    assert re.search(r"\[FAIL\] UNK rate\s+\d+\.\d\d% \(\d+ of \d+ tokens in 10 lines", stdout)
    assert re.search(r"\[FAIL\] characters not covered\s+\d+: .*'ነ' \(\d+\)", stdout)
    assert re.search(r"\[FAIL\] \[am\]\s+is missing", stdout)
    assert "verdict: FAILED" in stdout

    out = tmp_path / "vocab_am.json"
    assert _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", files["corpus"],
                 "--language", "am", "-o", out)[0] == 0
    rc, stdout, _ = _main(capsys, "verify-tokenizer", out, "--base", files["vocab"],
                          "--language", "am", "--text", files["manifest"])
    assert rc == 0, stdout
    size = json.loads(out.read_text(encoding="utf-8"))["added_tokens"][-1]["id"] + 1
    assert re.search(r"\[ok  \] UNK rate\s+0\.00% ", stdout)
    assert f"base 0..72 and {size - 1}..{size - 1}, extended 73..{size - 2}" in stdout
    assert re.search(r"round trip\s+10 of 10 lines", stdout)
    assert re.search(r"extended-range share\s+\d+\.\d% of tokens", stdout)
    assert "every token of" in stdout and "verdict: OK" in stdout


def test_verify_flags_sentencepiece_unk(files, tmp_path, capsys) -> None:
    base = _spm_bpe_base(tmp_path / "bpe.model")
    rc, stdout, _ = _main(capsys, "verify-tokenizer", base, "--language", "am", "--text",
                          files["corpus"])
    assert rc == 1 and re.search(r"\[FAIL\] UNK rate", stdout)


def _checkpoint(path: Path, rows: int, head_rows: int | None = None) -> Path:
    import torch

    torch.save({"model": {"gpt.text_embedding.weight": torch.zeros(rows, 8),
                          "gpt.text_head.weight": torch.zeros(head_rows or rows, 8),
                          "gpt.text_head.bias": torch.zeros(head_rows or rows)}}, path)
    return path


def test_verify_checkpoint_rows(files, tmp_path, capsys) -> None:
    out = tmp_path / "vocab_am.json"
    assert _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", files["corpus"],
                 "--language", "am", "-o", out)[0] == 0
    size = json.loads(out.read_text(encoding="utf-8"))["added_tokens"][-1]["id"] + 1
    common = ["verify-tokenizer", out, "--base", files["vocab"], "--checkpoint"]
    # the base model: the loader grows it, keeps the 74 trained rows and freezes them
    rc, stdout, _ = _main(capsys, *common, _checkpoint(tmp_path / "base.pth", 74))
    assert rc == 0, stdout
    assert f"grows 74 -> {size} rows" in stdout and "moves the last row" in stdout
    # how the loader starts the new rows: its rules, not "the mean of the old ones"
    assert ("the new rows start by row_init auto (spelling where the base model reads its "
            "text, std0.02 where it does not: the loader asks it), the head's by spread") in \
        stdout and "mean of the old" not in stdout
    assert f"rows 0..72 and {size - 1}..{size - 1} stay frozen (base); rows 73..{size - 2} " \
           f"train: set TRAINING_PATCHES_BASE_VOCAB=74 " in stdout
    # a fine-tuned checkpoint of this vocabulary: loads as is
    rc, stdout, _ = _main(capsys, *common, _checkpoint(tmp_path / "ft.pth", size))
    assert rc == 0 and "loads the rows as they are" in stdout
    # rows that fit neither vocabulary, more rows than the vocabulary, disagreeing tensors
    for name, rows, head, expected in (("other", 80, None, "match neither"),
                                       ("bigger", size + 3, None, "refuses a shrink"),
                                       ("torn", size, size - 1, "disagree")):
        rc, stdout, _ = _main(capsys, *common, _checkpoint(tmp_path / f"{name}.pth", rows, head))
        assert rc == 1, (name, stdout)
        assert expected in stdout and "verdict: FAILED" in stdout


# -- refusals and bad files ---------------------------------------------------------------------


def test_cli_never_overwrites_the_input_or_an_existing_output(files, tmp_path, capsys) -> None:
    vocab = tmp_path / "vocab.json"
    vocab.write_bytes(files["vocab"].read_bytes())
    before = _sha(vocab)
    args = ["extend-tokenizer", vocab, "--corpus", files["corpus"], "--language", "am"]
    rc, _, err = _main(capsys, *args, "--output", vocab)
    assert rc == 2 and "is the input tokenizer itself" in err and "--in-place" in err
    rc, _, err = _main(capsys, *args)
    assert rc == 2 and "no output file given" in err
    assert _sha(vocab) == before
    out = tmp_path / "taken.json"
    out.write_text("mine", encoding="utf-8")
    rc, _, err = _main(capsys, *args, "--output", out)
    assert rc == 2 and "is not an XTTS vocab.json tokenizer" in err
    rc, _, err = _main(capsys, *args, "--output", out, "--force")  # not a tokenizer: never
    assert rc == 2 and "is not an XTTS vocab.json tokenizer" in err and "untouched" in err
    assert out.read_text(encoding="utf-8") == "mine"
    out.write_bytes(files["vocab"].read_bytes())  # a tokenizer (an earlier output)
    rc, _, err = _main(capsys, *args, "--output", out)
    assert rc == 2 and "already exists" in err and "--force" in err
    assert _main(capsys, *args, "--output", out, "--force")[0] == 0
    assert json.loads(out.read_text(encoding="utf-8"))["model"]["type"] == "BPE"
    assert _sha(out) != _sha(files["vocab"])
    assert _main(capsys, *args, "--in-place")[0] == 0
    assert _sha(vocab) != before and _sha(vocab) == _sha(out)
    assert not [p for p in tmp_path.iterdir() if ".tp-tmp-" in p.name]  # no temporary left


def test_in_place_still_refuses_an_input(files, tmp_path, capsys) -> None:
    """Issue 26 item 4: --in-place skipped the input checks, so --corpus (or --base-text)
    naming the tokenizer itself got it overwritten. Refused, one paragraph, the file byte
    for byte as it was, whatever link names it."""
    vocab = tmp_path / "vocab.json"
    vocab.write_bytes(files["vocab"].read_bytes())
    link = tmp_path / "corpus.txt"
    link.symlink_to(vocab)
    before = _sha(vocab)
    for extra in (["--corpus", vocab], ["--corpus", link],
                  ["--corpus", files["corpus"], "--base-text", vocab]):
        rc, stdout, err = _main(capsys, "extend-tokenizer", vocab, "--language", "am",
                                "--in-place", "--force", *extra)
        assert rc == 2 and "written:" not in stdout, (extra, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "--in-place would write over" in err and "an input is never overwritten" in err
        assert _sha(vocab) == before
    # Control: with a corpus of its own, --in-place writes the tokenizer.
    assert _main(capsys, "extend-tokenizer", vocab, "--language", "am", "--in-place",
                 "--corpus", files["corpus"])[0] == 0
    assert _sha(vocab) != before


@pytest.mark.parametrize("fault", ["full_disk", "read_only"])
def test_a_write_the_system_refuses_is_one_paragraph_and_exit_1(fault, files, tmp_path,
                                                                capsys) -> None:
    """Issue 26 item 7: extend-tokenizer writing to a full disk or a read-only folder ended
    in a traceback. One paragraph saying which, exit 1, no temporary file, and the files
    already there byte for byte as they were."""
    from io_faults import full_disk, read_only, temporaries

    place = full_disk(tmp_path / "disk") if fault == "full_disk" else read_only(
        tmp_path / "disk", {"old.json": b"{}"})
    with place as folder:
        before = {p.name: _sha(p) for p in folder.iterdir()}
        out = folder / "vocab_am.json"
        rc, stdout, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus",
                                files["corpus"], "--language", "am", "--new-pieces", "400",
                                "--output", out)
        assert rc == 1 and "written:" not in stdout, err
        _one_paragraph(err)
        why = "the disk is full" if fault == "full_disk" else "the file system is read-only"
        assert f"could not write {out}: {why}" in err and "No partial file was left" in err
        assert not out.exists() and temporaries(folder) == []
        assert {p.name: _sha(p) for p in folder.iterdir()} == before


@pytest.mark.slow
def test_a_write_over_the_file_size_limit_is_one_paragraph_and_exit_1(files, tmp_path) -> None:
    """The same under ``ulimit -f`` (a subprocess with RLIMIT_FSIZE, SIGXFSZ ignored)."""
    from io_faults import run_with_file_limit, temporaries

    out = tmp_path / "vocab_am.json"
    done = run_with_file_limit(["-m", "patches", "extend-tokenizer", str(files["vocab"]),
                                "--corpus", str(files["corpus"]), "--language", "am",
                                "--output", str(out)], 1024, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    _one_paragraph(done.stderr)
    assert "file-size limit (ulimit -f)" in done.stderr and str(out) in done.stderr
    assert not out.exists() and temporaries(tmp_path) == []


def test_what_g2p_returns_is_checked(files, tmp_path, capsys) -> None:
    """Issue 26 item 7: --g2p returning None (or bytes, or a list of phonemes) was trained
    into the tokenizer as the text "None". Refused: one paragraph naming the function, the
    line and what it returned; nothing written."""
    (tmp_path / "g2p_none.py").write_text(
        "def g2p(text):\n    return None if 'ደህና' in text else text\n", encoding="utf-8")
    out = tmp_path / "vocab_am.json"
    for command in (["extend-tokenizer", files["vocab"], "--corpus", files["corpus"],
                     "--output", out], ["verify-tokenizer", files["vocab"], "--text",
                                        files["corpus"]]):
        rc, _, err = _main(capsys, *command, "--language", "am",
                           "--g2p", f"{tmp_path / 'g2p_none.py'}:g2p")
        assert rc == 2, err
        _one_paragraph(err)
        assert "g2p_none.py:g2p failed on" in err and "line 2" in err, err
        assert "returned NoneType 'None', not text (a str)" in err
    assert not out.exists()


def test_new_pieces_beyond_any_vocabulary_is_a_usage_error(files, tmp_path, capsys) -> None:
    """Issue 26 item 7: --new-pieces 99999999999999999999 was an OverflowError traceback
    (and 2**32 a Rust panic) inside the tokenizers trainer."""
    for flag, value in (("--new-pieces", "99999999999999999999"), ("--new-pieces", "4294967296"),
                        ("--min-frequency", "99999999999999999999")):
        with pytest.raises(SystemExit) as info:
            cli.main(["extend-tokenizer", str(files["vocab"]), "--corpus", str(files["corpus"]),
                      "--language", "am", "--output", str(tmp_path / "o.json"), flag, value])
        assert info.value.code == 2
        err = capsys.readouterr().err
        _one_paragraph(err)
        assert f"argument {flag}: expected a whole number" in err and "at most" in err
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("name,content,expected", [
    ("vocab.json", b"this is not json", "is not JSON"),
    ("vocab.json", b'{"model": {"type": "Unigram", "vocab": []}}', "is JSON but not a BPE"),
    ("bpe.model", b"\x00\x01 random bytes \xff\xfe", "is not a SentencePiece model"),
    ("bpe.model", b'{"oops": 1}', "is JSON but not a BPE tokenizer"),
])
def test_a_bad_tokenizer_file_is_one_paragraph(files, tmp_path, capsys, name, content,
                                               expected) -> None:
    bad = tmp_path / name
    bad.write_bytes(content)
    for argv in (["extend-tokenizer", bad, "--corpus", files["corpus"], "--language", "am",
                  "-o", tmp_path / "out"],
                 ["verify-tokenizer", bad, "--language", "am"]):
        rc, out, err = _main(capsys, *argv)
        assert rc == 2, (argv, out, err)
        assert expected in err and str(bad) in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not (tmp_path / "out").exists()


def test_messages_name_commands_and_flags_that_exist() -> None:
    """Every ``training-patches X --flag`` in a message of the library or the headless script
    names a real subcommand and real flags of it."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    sources = [*sorted((ROOT / "patches").rglob("*.py")), ROOT / "headlessXttsTrain.py"]
    named = 0
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"training-patches ((?:[a-z]+-)*[a-z]+)((?:[^.;)`\"\n]|\"\s*\n"
                                 r"\s*f?\")*)", text):
            command, rest = match.group(1), match.group(2)
            if "-" not in command and command not in sub.choices:
                continue  # prose: "training-patches has ...", "training-patches vocab_freeze"
            assert command in sub.choices, f"{path.name}: 'training-patches {command}'"
            named += 1
            if command == "run":
                continue  # what follows "run" is the wrapped command and its own flags
            flags = {f for a in sub.choices[command]._actions for f in a.option_strings}
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
                assert flag in flags, f"{path.name}: training-patches {command} {flag}"
    assert named >= 3


def test_help_of_both_subcommands(capsys) -> None:
    for command, needed in (("extend-tokenizer", ("--corpus", "--language", "--in-place",
                                                  "--force", "--new-pieces", "--g2p",
                                                  "--base-text", "2,000")),
                            ("verify-tokenizer", ("--base", "--text", "--checkpoint",
                                                  "--max-unk-rate", "Exit codes"))):
        with pytest.raises(SystemExit) as info:
            cli.main([command, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        for word in needed:
            assert word in out, (command, word)


# -- headlessXttsTrain.py --extend-vocab ---------------------------------------------------------


@pytest.mark.xtts
@pytest.mark.slow
def test_headless_extend_vocab_trains_amharic_with_base_rows_frozen(tmp_path) -> None:
    """A tiny English base model fine-tuned on Amharic with --extend-vocab: the vocabulary is
    extended into the output folder (the base file untouched), training runs through the real
    coqui Trainer, and the base rows of every checkpoint equal the base model.pth exactly."""
    pytest.importorskip("TTS")
    import shutil

    import torch

    from demo.xtts_demo import base_row_drift
    from demo.xtts_tiny import build_tiny_xtts, vocab_size_of

    torch.set_num_threads(1)
    tiny = build_tiny_xtts(tmp_path / "data", n_samples=6)  # English vocab of 74 tokens
    base = tmp_path / "base"
    base.mkdir()
    config = tiny.make_config(tmp_path / "scratch")
    torch.save({"model": tiny.make_model(config).xtts.state_dict()}, base / "model.pth")
    config.save_json(str(base / "config.json"))
    for name in ("vocab.json", "dvae.pth", "mel_stats.pth"):
        shutil.copy(tiny.root / name, base / name)
    manifest = tiny.write_manifest(AMHARIC, "am.csv")
    before = _sha(base / "vocab.json")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "headlessXttsTrain.py"), "--base-dir", str(base),
           "--train-manifest", str(manifest), "--extend-vocab", str(manifest), "--language",
           "am", "--output-dir", str(out), "--epochs", "1", "--batch-size", "2", "--lr",
           "1e-3", "--print-step", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT))
    result = forkserver.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert _sha(base / "vocab.json") == before
    extended = out / "vocab_am.json"
    size = vocab_size_of(extended)
    assert size > 74
    log = (out / "train.log").read_text(encoding="utf-8")
    assert f"extend-vocab: size: 74 -> {size} tokens" in log
    assert "no samples dropped" in log
    run = next(out.glob("xtts_finetune-*"))
    checkpoints = sorted(run.glob("*.pth"))
    assert checkpoints
    drift = base_row_drift(base / "model.pth", checkpoints, start_row_moved=True)
    assert drift["vocab_size"] == size
    assert drift["max"] == 0.0  # base rows bit-identical
    assert re.search(r"finished: \{'steps': 3\b", log)  # 6 clips, batch 2
    records = [json.loads(line) for line in (out / "headless_runs.jsonl").read_text(
        encoding="utf-8").splitlines()]
    start = next(r for r in records if r["event"] == "start")
    assert start["vocab"] == str(extended)
    assert start["base_weights"]["frozen_rows"] == [[0, 72], [size - 1, size - 1]]


# -- extend-tokenizer never loses a file, never learns a table, never runs for hours (issue 19)


def _one_paragraph(err: str) -> None:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_output_that_is_an_input_is_refused_even_with_force(files, tmp_path, capsys) -> None:
    """-o naming the corpus (by its path, a hard link or a symbolic link) or the base text,
    or a folder: exit 2, one paragraph, every file byte for byte as it was."""
    corpus = tmp_path / "am.txt"
    corpus.write_bytes(files["corpus"].read_bytes())
    base_text = tmp_path / "en.txt"
    base_text.write_bytes(files["english"].read_bytes())
    hard = tmp_path / "hard.json"
    os.link(corpus, hard)
    soft = tmp_path / "soft.json"
    soft.symlink_to(corpus)
    folder = tmp_path / "outdir"
    folder.mkdir()
    before = {p: _sha(p) for p in (corpus, base_text, files["vocab"])}
    listing = sorted(p.name for p in tmp_path.iterdir())
    for out in (corpus, hard, soft, base_text, folder):
        rc, stdout, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", corpus,
                                "--language", "am", "--base-text", base_text, "-o", out,
                                "--force")
        assert rc == 2, (out, stdout, err)
        _one_paragraph(err)
        assert str(out) in err and "written" not in stdout
        assert ("is a folder" in err) if out == folder else ("an input of this command" in err)
    assert {p: _sha(p) for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing and not list(folder.iterdir())


BARRIER_G2P = '''
import os, pathlib, time
DIR = pathlib.Path(os.environ["BARRIER_DIR"])
_waited = False

def g2p(text):
    """Hold every run after its output check until all (BARRIER_N) runs are past it."""
    global _waited
    if not _waited:
        _waited = True
        (DIR / f"ready_{os.getpid()}").touch()
        deadline = time.time() + float(os.environ.get("BARRIER_WAIT", "60"))
        while len(list(DIR.glob("ready_*"))) < int(os.environ["BARRIER_N"]):
            if time.time() > deadline:
                break
            time.sleep(0.05)
    return text
'''


def _tool(argv: list, env_extra: dict) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_path(ROOT), **env_extra)
    return forkserver.popen([sys.executable, "-m", "patches", *map(str, argv)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_runs_writing_the_same_new_output_cannot_both_write(files, tmp_path) -> None:
    """Two extend-tokenizer runs started together, both past the "output exists?" check
    before either writes (a barrier in --g2p): exactly one writes, the other is refused in
    one paragraph, and the file is the winner's, whole."""
    g2p = tmp_path / "barrier_g2p.py"
    g2p.write_text(BARRIER_G2P, encoding="utf-8")
    gates = tmp_path / "gates"
    gates.mkdir()
    extra = tmp_path / "am_extra.txt"  # letters only this run's vocabulary gets
    extra.write_text(files["corpus"].read_text(encoding="utf-8") + "ቐቑቒ ቓቔቕ ቐቑቒ ቓቔቕ\n",
                     encoding="utf-8")
    out = tmp_path / "vocab_am.json"
    runs = {name: _tool(["extend-tokenizer", files["vocab"], "--corpus", corpus, "--language",
                         "am", "--g2p", f"{g2p}:g2p", "-o", out],
                        {"BARRIER_DIR": str(gates), "BARRIER_N": "2"})
            for name, corpus in (("plain", files["corpus"]), ("extra", extra))}
    results = {}
    for name, proc in runs.items():
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        results[name] = (proc.returncode, stdout, stderr)
    assert len(list(gates.iterdir())) == 2  # both were past the check before either wrote
    winners = [name for name, (rc, stdout, _) in results.items() if rc == 0]
    losers = [name for name, (rc, _, _) in results.items() if rc == 2]
    assert len(winners) == 1 and len(losers) == 1, results
    rc, stdout, stderr = results[losers[0]]
    assert "written:" not in stdout
    _one_paragraph(stderr)
    assert "created by another program" in stderr and str(out) in stderr
    assert f"written: {out}" in results[winners[0]][1]
    vocab = json.loads(out.read_text(encoding="utf-8"))["model"]["vocab"]
    assert ("ቐ" in vocab) == (winners[0] == "extra")
    assert not [p for p in tmp_path.iterdir() if ".tp-tmp-" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_extend_tokenizer_with_nothing_written(files, tmp_path, signum,
                                                              code) -> None:
    """SIGTERM (Ctrl-C) mid-corpus: exit 143 (130), one line, no traceback, no file."""
    g2p = tmp_path / "barrier_g2p.py"
    g2p.write_text(BARRIER_G2P, encoding="utf-8")
    gates = tmp_path / "gates"
    gates.mkdir()
    out = tmp_path / "vocab_am.json"
    proc = _tool(["extend-tokenizer", files["vocab"], "--corpus", files["corpus"], "--language",
                  "am", "--g2p", f"{g2p}:g2p", "-o", out],
                 {"BARRIER_DIR": str(gates), "BARRIER_N": "2", "BARRIER_WAIT": "600"})
    try:
        deadline = time.monotonic() + 120
        while not list(gates.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(gates.iterdir()), "the run never reached its corpus"
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == code, (stdout, stderr)
    _one_paragraph(stderr)
    assert signal.Signals(signum).name in stderr and "nothing was written" in stderr
    # (__pycache__: Python's cache of the --g2p module it imported, where bytecode is written)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()
                                       if p.name != "__pycache__") == ["barrier_g2p.py", "gates"]


def test_a_manifest_with_a_bom_is_read_as_its_text_column(files, tmp_path, capsys) -> None:
    """A coqui manifest saved with a UTF-8 BOM (Windows editors do) gives the very vocabulary
    its transcripts give as plain text: no path, header, '|' or speaker name learned."""
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(AMHARIC) + "\n", encoding="utf-8")
    manifest = tmp_path / "bom.csv"
    manifest.write_bytes(b"\xef\xbb\xbf" + files["manifest"].read_bytes())
    outs = {}
    for name, corpus in (("text", texts), ("bom", manifest)):
        outs[name] = tmp_path / f"vocab_{name}.json"
        rc, stdout, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", corpus,
                                "--language", "am", "-o", outs[name])
        assert rc == 0, err
        assert f"corpus: {len(AMHARIC)} lines" in stdout
    assert _sha(outs["bom"]) == _sha(outs["text"])
    vocab = json.loads(outs["bom"].read_text(encoding="utf-8"))["model"]["vocab"]
    assert not [t for t in vocab if any(bad in t for bad in ("|", "/", "wav", "spk", "\ufeff"))]


@pytest.mark.parametrize("table", [
    "wavs/0.wav|ሰላም፣ እንዴት ነህ፧|spk0\nwavs/1.wav|ደህና ነኝ፣ አመሰግናለሁ።|spk1\n",   # no header
    "LJ001-0001|ሰላም፣ እንዴት ነህ፧|ሰላም እንዴት ነህ\nLJ001-0002|ስሜ አበበ ይባላል።|ስሜ አበበ\n",  # LJSpeech
    "wav,text\nclips/a.wav,ሰላም\nclips/b.wav,ቡና\n",                                  # csv
])
def test_a_table_that_is_not_a_coqui_manifest_is_refused(files, tmp_path, capsys,
                                                        table) -> None:
    corpus = tmp_path / "metadata.csv"
    corpus.write_text(table, encoding="utf-8")
    out = tmp_path / "out.json"
    rc, _, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", corpus,
                       "--language", "am", "-o", out)
    assert rc == 2 and not out.exists()
    _one_paragraph(err)
    assert "looks like a dataset table" in err and str(corpus) in err


def test_a_huge_piece_without_spaces_is_refused_at_once(files, tmp_path, capsys) -> None:
    """A one-line corpus of 100,000 letters without a space: refused with the limit named
    in seconds, where learning from it would take many seconds (minutes at 9 MB)."""
    corpus = tmp_path / "one_line.txt"
    corpus.write_text("ሰላምእንዴትነህደህናነኝ" * 8000 + "\n", encoding="utf-8")
    out = tmp_path / "out.json"
    started = time.monotonic()
    rc, _, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", corpus,
                       "--language", "am", "-o", out)
    assert rc == 2 and not out.exists(), err
    assert time.monotonic() - started < 30
    _one_paragraph(err)
    assert "--max-word-chars" in err and "without a space" in err


def test_a_g2p_that_raises_is_one_paragraph(files, tmp_path, capsys) -> None:
    g2p = tmp_path / "bad_g2p.py"
    g2p.write_text("def g2p(text):\n    raise KeyError(text[:3])\n", encoding="utf-8")
    rc, _, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus", files["corpus"],
                       "--language", "am", "--g2p", f"{g2p}:g2p", "-o", tmp_path / "o.json")
    assert rc == 2 and not (tmp_path / "o.json").exists()
    _one_paragraph(err)
    assert "line 1" in err and "KeyError" in err


@pytest.mark.parametrize("command,option,value", [
    ("verify-tokenizer", "--max-unk-rate", "nan"), ("verify-tokenizer", "--max-unk-rate", "1.5"),
    ("extend-tokenizer", "--new-pieces", "-5"), ("extend-tokenizer", "--max-word-chars", "0")])
def test_numbers_out_of_range_are_refused(files, capsys, command, option, value) -> None:
    """--max-unk-rate nan would make the check impossible to fail: a usage error instead."""
    argv = [command, str(files["vocab"]), option, value]
    if command == "extend-tokenizer":
        argv += ["--corpus", str(files["corpus"]), "-o", "never.json"]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert f"argument {option}: expected" in capsys.readouterr().err
    assert not Path("never.json").exists()


def test_a_g2p_that_raises_in_verify_tokenizer_is_one_paragraph(files, tmp_path,
                                                                  capsys) -> None:
    """verify-tokenizer --text with a --g2p that raises: exit 2, one paragraph naming the
    function, the text file and its line, no traceback, no --json written."""
    g2p = tmp_path / "bad_g2p.py"
    g2p.write_text("def g2p(text):\n    if 'ቡና' in text:\n        raise KeyError(text[:3])\n"
                   "    return text\n", encoding="utf-8")
    rc, out, err = _main(capsys, "verify-tokenizer", files["vocab"], "--text", files["corpus"],
                         "--language", "am", "--g2p", f"{g2p}:g2p", "--json",
                         tmp_path / "v.json")
    assert rc == 2 and out == "" and not (tmp_path / "v.json").exists()
    _one_paragraph(err)
    assert f"--g2p {g2p}:g2p failed on --text {files['corpus']}, text line 4" in err, err
    assert "KeyError" in err


def test_verify_json_is_strict_and_names_each_finding(files, tmp_path, capsys) -> None:
    """--json -: stdout is one strict JSON object with the same findings the text shows and
    the exit code; --json never replaces an input, even with --force."""
    rc, text, _ = _main(capsys, "verify-tokenizer", files["vocab"], "--language", "am")
    rc_json, out, _ = _main(capsys, "verify-tokenizer", files["vocab"], "--language", "am",
                            "--json", "-")
    assert rc == rc_json == 1  # the base vocab has no [am] token
    doc = json.loads(out, parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))
    assert doc["tool"] == "training-patches verify-tokenizer" and doc["format"] == 1
    assert doc["ok"] is False and doc["exit_code"] == 1
    statuses = {f["what"]: f["status"] for f in doc["findings"]}
    for finding in doc["findings"]:
        assert f"{finding['what']}" in text and finding["detail"] in text
    assert "FAIL" in statuses.values()
    before = _sha(files["corpus"])
    rc, _, err = _main(capsys, "verify-tokenizer", files["vocab"], "--text", files["corpus"],
                       "--no-cleaner", "--json", files["corpus"], "--force")
    assert rc == 2 and "an input of this command" in err and _sha(files["corpus"]) == before
    _one_paragraph(err)


def test_extended_tokenizer_file_mode_follows_the_umask(files, tmp_path, capsys) -> None:
    out = tmp_path / "vocab_am.json"
    old = os.umask(0o027)
    try:
        rc, _, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus",
                           files["corpus"], "--language", "am", "-o", out)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert out.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("reader,expected", [
    ("verify.open_tokenizer", "an XTTS vocab.json or a SentencePiece .model"),
    ("spm.load_model_proto", "a SentencePiece .model file (the IndexTTS bpe.model)"),
    ("bpe.load_vocab_json", "the XTTS vocab.json (a Hugging Face tokenizers BPE file)"),
    ("text.read_lines", "a UTF-8 text file with one sentence a line"),
])
def test_a_missing_file_is_one_paragraph_naming_it(tmp_path: Path, reader: str,
                                                   expected: str) -> None:
    import importlib

    from patches.tools.tokenizer import TokenizerToolError

    module, function = reader.split(".")
    read = getattr(importlib.import_module(f"patches.tools.tokenizer.{module}"), function)
    missing = tmp_path / "absent.file"
    with pytest.raises(TokenizerToolError) as raised:
        read(missing)
    message = str(raised.value)
    assert f"{missing} was not found" in message and expected in message
    assert message.endswith("Check the path.") and "\n" not in message
    assert not missing.exists()


def test_output_dash_is_refused_never_a_file_named_dash(files, tmp_path, capsys,
                                                        monkeypatch) -> None:
    """``--output -`` wrote a file named ``-``; the extended tokenizer is a file the command
    writes whole (its stdout carries its report): one paragraph, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = _main(capsys, "extend-tokenizer", files["vocab"], "--corpus",
                            files["corpus"], "--language", "am", "--output", "-")
    assert rc == 2 and "written" not in stdout
    _one_paragraph(err)
    assert "--output - would mean stdout" in err and "Give a file name" in err
    assert list(tmp_path.iterdir()) == []


def test_verify_an_input_that_cannot_be_read_names_it(files, tmp_path, capsys,
                                                      monkeypatch) -> None:
    """An input that exists and cannot be read was reported as 'could not write --json
    None'."""
    from patches.tools import verify_tokenizer

    def unreadable(*args, **kwargs):
        raise OSError(5, "Input/output error", str(tmp_path / "lines.txt"))

    monkeypatch.setattr(verify_tokenizer, "verify", unreadable)
    rc, stdout, err = _main(capsys, "verify-tokenizer", files["vocab"])
    assert rc == 2 and stdout == ""
    _one_paragraph(err)
    assert f"could not read {tmp_path / 'lines.txt'} (Input/output error)" in err
    assert "--json" not in err and "None" not in err
