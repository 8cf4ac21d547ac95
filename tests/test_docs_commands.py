"""Every shell command shown in the user docs (README.md, TRAINING_PATCHES_README.md and
docs/index.md, docs/quickstart/, docs/howto/, docs/reference/: their ```bash blocks) runs as
the docs say: in doc order, each doc in its own copy of one folder holding small real files
under the names the docs use (a tiny XTTS-style vocab.json and checkpoint, a SentencePiece
model, an Amharic dataset with speech-like clips, a run with TensorBoard scalars), through the
``training-patches`` command of this checkout and this interpreter as ``python``, each
checked for the exit code the docs give.

A ```python block right after a line ``<!-- file: NAME -->`` is a whole script: it is written
into the doc's folder as NAME before the doc's commands run, so ``python NAME`` in the doc
runs it as printed. Every other ```python block of README.md and docs/ must at least parse;
one that needs a GPU, a hub download or a user's data says so in a ``<!-- syntax only: why -->``
line above it.

A command added to the docs fails this test until it is listed in EXPECTED (with its exit
code) or in SKIP (with why it cannot run here).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from processes import child_path

pytest.importorskip("tokenizers")
pytest.importorskip("soundfile")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
# The docs a user reads, in the order a reader meets them.
DOCS = ("README.md", "TRAINING_PATCHES_README.md", "docs/index.md",
        *sorted(p.relative_to(ROOT).as_posix() for folder in ("quickstart", "howto", "reference")
                for p in (ROOT / "docs" / folder).glob("*.md")))
# Where a ```python block must at least parse (TRAINING_PATCHES_README.md has fragments).
PARSED = tuple(name for name in DOCS if name != "TRAINING_PATCHES_README.md")
FILE_MARK = re.compile(r"^<!-- file: ([\w.-]+) -->\n```python\n(.*?)^```", re.S | re.M)
SYNTAX_ONLY = re.compile(r"^<!-- syntax only: (.+?) -->\n```python\n", re.M)

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
    "python headlessXttsTrain.py --base-dir xtts_v2/ --train-manifest data/train.csv "
    "--eval-manifest data/eval.csv --language am --output-dir runs/am --extend-vocab data/am.txt":
        "needs the XTTS v2 base files (hub download); tests/test_headless*.py run the script "
        "on a tiny base, --extend-vocab included",
    # Installs into the environment that runs this test: the suite runs from such an install.
    "pip install -e '.[xtts]'": "installs into the running environment (make test does it)",
    "pip install -c constraints.txt -e '.[xtts]'":
        "installs into the running environment (make test does it, with the same constraints)",
    # The user's own trainer, named in the XTTS recipe: tests/test_clients.py runs one of
    # that shape (an xtts-finetune-webui fork) with the line, BASE_VOCAB and continue_path.
    "python train_gpt.py": "the user's own XTTS trainer (tests/test_clients.py runs one)",
    "training-patches run python -m trainer.distribute --script train_gpt.py --gpus 0,1":
        "needs 2 GPUs and the user's trainer (tests/distributed/test_launch_coqui_ddp.py runs "
        "trainer.distribute through the launcher on the CPU)",
    "training-patches report ckpts/am": "needs an F5-TTS run's folder (tests/test_report_trainers.py "
        "reads one)",
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
    # the README's and the XTTS quickstart's N: the size of the original tokenizer
    "training-patches verify-tokenizer xtts_v2/vocab.json": 0,
    'export TRAINING_PATCHES_BASE_VOCAB=$(python -c "import sys, tokenizers; '
    'print(tokenizers.Tokenizer.from_file(sys.argv[1]).get_vocab_size())" xtts_v2/vocab.json)': 0,
    "python headlessXttsTrain.py --help": 0,
    # the quickstarts' scripts (their ```python file blocks), run as printed: a NaN batch is
    # skipped and recorded, so report says "skipped steps" (exit 1) where the script has one
    "python train_plain.py 2": 0,
    "python train_plain.py 3": 0,
    "training-patches report runs/plain": 1,
    "python train_hf.py 4": 0,
    "python train_hf.py 8 --resume": 0,
    "training-patches report runs/hf": 0,
    "python train_lightning.py 8": 0,
    "python train_lightning.py 16 --resume": 0,
    "training-patches report runs/lightning": 1,
    "python train_accelerate.py": 0,
    "python train_accelerate.py --resume": 0,
    "training-patches report runs/accelerate": 1,
    "torchrun --nproc-per-node 2 train_ddp.py": 0,
    "training-patches run torchrun --nproc-per-node 2 train_ddp.py": 0,
    "training-patches report runs/ddp": 1,
}
# What a command's output must hold besides its exit code (the docs' comments say so).
SAYS = {
    "training-patches report runs/plain": "verdict: skipped steps",
    "training-patches report runs/hf": "verdict: healthy",
    "training-patches report runs/lightning": "verdict: skipped steps",
    "training-patches report runs/accelerate": "verdict: skipped steps",
    "training-patches report runs/ddp": "verdict: skipped steps",
    "python train_plain.py 3": "resume_check: resume at",
    "python train_hf.py 8 --resume": "resume_check: resume at step 4",
    "python train_accelerate.py --resume": "resume_check: resume at",
    "torchrun --nproc-per-node 2 train_ddp.py": "because another rank saw a non-finite",
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


def doc_files(name: str) -> dict[str, str]:
    """The scripts a doc prints whole (``<!-- file: NAME -->`` above a ```python block)."""
    return dict(FILE_MARK.findall((ROOT / name).read_text(encoding="utf-8")))


def python_blocks(name: str) -> list[tuple[int, str]]:
    """(line, code) of every ```python block of a doc."""
    text = (ROOT / name).read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def test_every_python_block_of_the_user_docs_parses() -> None:
    """A script the docs print whole is run below; every other block parses, and one that
    cannot run here says why in a ``<!-- syntax only: ... -->`` line."""
    bad = []
    for name in PARSED:
        for line, code in python_blocks(name):
            try:
                ast.parse(code)
            except SyntaxError as exc:
                bad.append(f"{name}:{line + (exc.lineno or 1) - 1}: {exc.msg}")
    assert not bad, f"python blocks that do not parse: {bad}"
    scripts = {script for name in DOCS for script in doc_files(name)}
    assert {"train_plain.py", "train_hf.py", "train_lightning.py", "train_accelerate.py",
            "train_ddp.py"} <= scripts
    said = [why for name in DOCS for why in SYNTAX_ONLY.findall(
        (ROOT / name).read_text(encoding="utf-8"))]
    assert all(len(why) > 20 for why in said), said  # the reason, not a bare marker


def _env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    # `training-patches` is this checkout's command; `python`, `torchrun`, `accelerate` this
    # interpreter's (its folder first on PATH)
    env.update(PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable),
                                     env.get("PATH", "")]),
               PYTHONPATH=child_path(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false")
    return env


# What a command says it writes (checked after it ran), besides its exit code.
WRITES = {
    "training-patches doctor --json doctor.json": ("doctor.json",),
    "training-patches report runs/am": ("training_report_am.png",),
    "training-patches report runs/am --out am.png": ("am.png",),
    "training-patches check-data data/metadata_train.csv --language am --tokenizer "
    "xtts_v2/vocab.json --json check.json --clean-manifest data/train.clean.csv":
        ("check.json", "data/train.clean.csv"),
    "training-patches extend-tokenizer xtts_v2/vocab.json --corpus data/am.txt --language am "
    "--output vocab_am.json": ("vocab_am.json",),
    "training-patches extend-tokenizer checkpoints/bpe.model --corpus data/train.csv "
    "--language am --output bpe_am.model": ("bpe_am.model",),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs' files, built once; each doc runs in its own copy."""
    root = tmp_path_factory.mktemp("world")
    make_world(root)
    (root / "headlessXttsTrain.py").symlink_to(ROOT / "headlessXttsTrain.py")
    return root


def _bin(folder: Path) -> dict[str, str]:
    """The environment of the docs' commands, with `training-patches` and `python` of this
    checkout and interpreter in ``folder`` first on PATH."""
    folder.mkdir(exist_ok=True)
    for name, command in (("training-patches", "-m patches "), ("python", "")):
        shim = folder / name
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {command}\"$@\"\n")
        shim.chmod(0o755)
    return _env(folder)


# A command without shell syntax: its words are the argv the shell would run
PLAIN_COMMAND = re.compile(r"[^$|&;<>()`\\'\"*?~{}=]+")


def _argv(command: str) -> list[str] | None:
    """The argv a plain ``python ...`` or ``training-patches ...`` line runs through its
    shim (:func:`_bin`); None for anything else (bash runs it)."""
    if not PLAIN_COMMAND.fullmatch(command):
        return None
    first, *rest = shlex.split(command)
    prefix = {"python": [sys.executable], "training-patches": [sys.executable, "-m", "patches"]}
    return [*prefix[first], *rest] if first in prefix else None


def _docs_that_run() -> list[str]:
    return [doc for doc in DOCS
            if any(d == doc and c not in SKIP for d, _, c in doc_commands())]


@pytest.mark.slow
@pytest.mark.parametrize("doc", _docs_that_run())
def test_every_doc_command_exits_as_the_docs_say(doc: str, world: Path, tmp_path) -> None:
    """The doc's commands in order, in a copy of the world holding the scripts it prints."""
    env = _bin(tmp_path / "bin")
    cwd = tmp_path / "here"
    shutil.copytree(world, cwd, symlinks=True)
    for script, code in doc_files(doc).items():
        (cwd / script).write_text(code, encoding="utf-8")
    ran = []
    for name, line, command in doc_commands():
        if name != doc or command in SKIP:
            continue
        argv = _argv(command)
        if argv is None:
            done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=300)
        else:  # what the shim would exec, forked where it can be (tests/forkserver.py)
            done = forkserver.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=300)
        expected = EXPECTED[command]
        assert done.returncode == expected, (f"{doc}:{line}: `{command}` exited "
                                             f"{done.returncode}, the docs say {expected}\n"
                                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        assert "Traceback" not in done.stderr, done.stderr
        if command in SAYS:
            assert SAYS[command] in done.stdout + done.stderr, (
                f"{doc}:{line}: `{command}` did not say {SAYS[command]!r}\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        for written in WRITES.get(command, ()):
            assert (cwd / written).is_file(), f"{doc}:{line}: `{command}` wrote no {written}"
        if "--json -" in command:  # stdout is the JSON object alone
            json.loads(done.stdout)
        ran.append(command)
    assert ran
    # the run folder the report commands read is untouched
    assert not [p.name for p in (cwd / "runs" / "am").iterdir()
                if not p.name.startswith("events.out.tfevents.")]


@pytest.mark.slow
def test_the_base_vocab_line_prints_what_verify_tokenizer_counts(world: Path, tmp_path) -> None:
    """The README's N (the export line) is the size verify-tokenizer prints for the file."""
    env = _bin(tmp_path / "bin")
    found = subprocess.run(["bash", "-c", "training-patches verify-tokenizer xtts_v2/vocab.json "
                            "--json -"], cwd=world, env=env, capture_output=True, text=True)
    detail = json.loads(found.stdout)["findings"][0]["detail"]
    export = next(c for d, _, c in doc_commands()
                  if d == "README.md" and c.startswith("export TRAINING_PATCHES_BASE_VOCAB="))
    printed = subprocess.run(["bash", "-c", export + ' && echo "$TRAINING_PATCHES_BASE_VOCAB"'],
                             cwd=world, env=env, capture_output=True, text=True).stdout.strip()
    assert printed.isdigit() and re.search(rf"\b{printed} tokens\b", detail), (printed, detail)


def test_every_listed_command_is_known_to_the_checks() -> None:
    assert set(SAYS) <= set(EXPECTED) and set(WRITES) <= set(EXPECTED)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block, read fence by fence."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        if info is None and line.startswith("```"):
            info, body = line[3:].strip(), []
        elif info is not None and line.strip() == "```":
            blocks.append((info, "\n".join(body)))
            info = None
        elif info is not None:
            body.append(line)
    return blocks


def _banner_block(text: str) -> list[str]:
    """The lines of the README's banner picture (the plain ``` block holding the banner's
    title), without its closing ``...``."""
    for info, body in fenced_blocks(text):
        if not info and "applying training patches" in body:
            return [line for line in body.splitlines() if line != "..."]
    raise AssertionError("README.md shows no banner")


@pytest.mark.slow
def test_the_readme_banner_is_what_the_line_prints(tmp_path) -> None:
    """Each line of the README's banner is a line the one line prints with the setting the
    README names (run from another folder, as a user's trainer is); the title first."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = _banner_block(readme)
    assert "TRAINING_PATCHES_BASE_VOCAB=6681" in readme
    env = _env(tmp_path)
    env["TRAINING_PATCHES_BASE_VOCAB"] = "6681"
    done = subprocess.run([sys.executable, "-c", "from utils import training_patches"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # the log record's first line carries its time: "14:04:04 training_patches: ===..."
    printed = [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in done.stderr.splitlines()]
    missing = [line for line in shown if line not in printed]
    assert not missing, f"the README's banner shows lines the line does not print: {missing}"
    assert printed.index(shown[1]) < min(printed.index(line) for line in shown[3:])
