"""Every shell command shown in README.md and TRAINING_PATCHES_README.md (its ```bash
blocks) runs as the docs say: in doc order, in one folder holding small real files under
the names the docs use (a tiny XTTS-style vocab.json and checkpoint, a SentencePiece model,
an Amharic dataset with speech-like clips, a run with TensorBoard scalars), through the
``training-patches`` command of this checkout, each checked for the exit code the docs give.

A command added to the docs fails this test until it is listed in EXPECTED (with its exit
code) or in SKIP (with why it cannot run here).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from processes import child_path

pytest.importorskip("tokenizers")
pytest.importorskip("soundfile")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "TRAINING_PATCHES_README.md")

# Commands that cannot run in a test, and why.
SKIP = {
    # `make demo` / `make test` set up .venv (pip install) and run the demo and the whole
    # suite: the demo is tests/test_demo.py, and the suite runs this test.
    "make demo": "installs the venv and runs the demo (tests/test_demo.py runs the demo)",
    "make test": "installs the venv and runs the whole suite, this test included",
    # Needs the real XTTS v2 base (a hub download: model.pth, dvae.pth, mel_stats.pth) and
    # `--preset t4` is a GPU preset; tests/test_headless*.py run the script on a tiny base.
    "python headlessXttsTrain.py --base-dir xtts_v2/ --train-manifest data/train.csv "
    "--eval-manifest data/eval.csv --language am --output-dir runs/am --preset t4":
        "needs the XTTS v2 base files (hub download) and a GPU preset",
}

# Command (comments dropped, lines joined) -> the exit code the docs give, and what is
# checked besides it. The folder (make_world) is a case where each should succeed.
EXPECTED: dict[str, int] = {
    # "exit 1 when something required is missing": everything is installed here
    "training-patches doctor": 0,
    "training-patches doctor --json doctor.json": 0,
    "training-patches options": 0,
    # a healthy run (falling loss, no event): 0
    "training-patches report runs/am": 0,
    "training-patches report runs/am --out am.png": 0,
    "training-patches report runs/am --json - --no-picture": 0,
    # clean clips, a vocabulary with [am] covering every letter: 0 (no errors)
    "training-patches check-data data/metadata_train.csv --language am --tokenizer "
    "xtts_v2/vocab.json --json check.json --clean-manifest data/train.clean.csv": 0,
    # "Exit 0 written"
    "training-patches extend-tokenizer xtts_v2/vocab.json --corpus data/am.txt --language am "
    "--output vocab_am.json": 0,
    "training-patches extend-tokenizer checkpoints/bpe.model --corpus data/train.csv "
    "--language am --output bpe_am.model": 0,
    # every check passes: the extended vocabulary keeps the base ids, encodes the
    # transcripts without [UNK], and the base checkpoint's rows can be grown to it
    "training-patches verify-tokenizer vocab_am.json --base xtts_v2/vocab.json --language am "
    "--text data/train.csv --checkpoint xtts_v2/model.pth": 0,
}


def doc_commands() -> list[tuple[str, int, str]]:
    """(file, line, command) for every command of every ```bash block, in doc order:
    continuation lines joined, comments dropped."""
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text(encoding="utf-8")
        for block in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
            first = text[:block.start()].count("\n") + 2
            pending, start = "", first
            for offset, line in enumerate(block.group(1).splitlines()):
                if not pending:
                    start = first + offset
                code = line.split(" #", 1)[0].rstrip() if " #" in line else line.rstrip()
                if code.lstrip().startswith("#"):
                    code = ""
                if code.endswith("\\"):
                    pending += code[:-1] + " "
                    continue
                command = " ".join((pending + code).split())
                pending = ""
                if command:
                    found.append((name, start, command))
    return found


def test_every_doc_command_is_listed() -> None:
    """Each command of the docs is run below or skipped with a reason; nothing listed here
    is missing from the docs (a renamed command is noticed)."""
    commands = {command for _, _, command in doc_commands()}
    unknown = sorted(commands - set(EXPECTED) - set(SKIP))
    assert not unknown, ("commands in the docs that this test does not know: add each to "
                         f"EXPECTED with its exit code, or to SKIP with why: {unknown}")
    assert not (set(EXPECTED) | set(SKIP)) - commands, "listed here, gone from the docs"


def make_world(root: Path) -> None:
    """The files the docs' commands name, small and real."""
    import io

    import sentencepiece as spm
    import torch

    from demo.xtts_tiny import DEFAULT_TEXTS, train_bpe_vocab, vocab_size_of
    from patches.languages.amharic import normalize
    from test_check_data import clean_rows, write_manifest
    from test_report import _tensorboard
    from test_tokenizer_tools import AMHARIC

    data = root / "data"
    data.mkdir()
    rows = clean_rows(data, 6)
    write_manifest(data / "metadata_train.csv", rows)
    write_manifest(data / "train.csv", rows)
    (data / "am.txt").write_text("\n".join(AMHARIC * 3) + "\n", encoding="utf-8")
    base = root / "xtts_v2"
    base.mkdir()
    # an XTTS-style base that knows [am] and every Amharic letter of the transcripts (few
    # Amharic pieces: extend-tokenizer has some to add)
    amharic = [normalize(text) for _, text, _ in rows] + [normalize(t) for t in AMHARIC]
    vocab = train_bpe_vocab(list(DEFAULT_TEXTS) + amharic, base / "vocab.json",
                            languages=("en", "am"), vocab_size=160)
    size = vocab_size_of(vocab)
    torch.save({"model": {"gpt.text_embedding.weight": torch.zeros(size, 8),
                          "gpt.text_head.weight": torch.zeros(size, 8),
                          "gpt.text_head.bias": torch.zeros(size)}}, base / "model.pth")
    (root / "checkpoints").mkdir()
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(DEFAULT_TEXTS) * 4), model_writer=out, vocab_size=120,
        model_type="bpe", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    (root / "checkpoints" / "bpe.model").write_bytes(out.getvalue())
    _tensorboard(root / "runs" / "am", [5.0 - 0.3 * i for i in range(12)])


@pytest.mark.slow
def test_every_doc_command_exits_as_the_docs_say(tmp_path) -> None:
    make_world(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "training-patches"  # this checkout's command, this interpreter
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m patches \"$@\"\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=child_path(ROOT),
               OMP_NUM_THREADS="1")
    ran = []
    for doc, line, command in doc_commands():
        if command in SKIP:
            continue
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        expected = EXPECTED[command]
        assert done.returncode == expected, (f"{doc}:{line}: `{command}` exited "
                                             f"{done.returncode}, the docs say {expected}\n"
                                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        assert "Traceback" not in done.stderr, done.stderr
        ran.append(command)
        if "--json -" in command:  # stdout is the JSON object alone
            json.loads(done.stdout)
    assert len(ran) == len(EXPECTED)
    # what the commands say they wrote is there
    for name in ("doctor.json", "check.json", "data/train.clean.csv", "vocab_am.json",
                 "bpe_am.model", "am.png", "training_report_am.png"):
        assert (tmp_path / name).is_file(), name
    assert not [p.name for p in (tmp_path / "runs" / "am").iterdir()
                if not p.name.startswith("events.out.tfevents.")]  # the run folder untouched
