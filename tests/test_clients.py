"""The one line inside trainers we did not write (tests/clients/, shaped as the users' own
projects are; tests/clients/README.md): the user's XTTS project with its own ``utils/`` and
an IndexTTS2-style plain loop, each run unchanged in a fresh process with the patches
activated the documented ways: the card's line, ``import patches.auto``, and
``training-patches run`` with no line."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from processes import child_path

REPO = Path(__file__).resolve().parents[1]
CLIENTS = Path(__file__).resolve().parent / "clients"
LAUNCHER = [sys.executable, "-m", "patches", "run"]

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINING_PATCHES_", "CLIENT_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=child_path(), **extra)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    done = forkserver.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _events(folder: Path) -> list[dict]:
    path = folder / "nonfinite_events.jsonl"
    assert path.is_file(), sorted(p.name for p in folder.iterdir())
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- the user's XTTS project ------------------------------------------------------------

BASE_TOKENS = 74  # the tiny base vocabulary: 73 tokens, then [START] last
NAN_AT = 3  # the micro-batch (of 16 accumulated) whose loss comes out NaN
GROWN_TOKENS = ("ሀ", "ሁ", "ሂ", "ሃ", "ሄ")  # a second growth: 82 -> 87 ids


@pytest.fixture(scope="module")
def xtts_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Base files (model.pth saved from a base-vocabulary GPTTrainer, dvae, mel stats,
    vocab), an extended vocab with [am], and 20 clips of mixed English/Amharic text."""
    pytest.importorskip("TTS")
    from demo.xtts_tiny import build_tiny_xtts
    from conftest import AMHARIC_NEW_TOKENS

    root = tmp_path_factory.mktemp("xtts_client")
    tiny = build_tiny_xtts(root / "base", n_samples=20)
    config = tiny.make_config(root / "unused")
    torch.manual_seed(0)
    model = tiny.make_model(config)
    torch.save({"model": model.xtts.state_dict()}, tiny.root / "model.pth")
    ext = tiny.extend_vocab(AMHARIC_NEW_TOKENS, root / "vocab_am.json", language="am",
                            tokens=True)
    from demo.xtts_tiny import extend_vocab
    grown = extend_vocab(ext, GROWN_TOKENS, root / "vocab_am_grown.json", tokens=True)
    words = ("ሰላም", "እን", "ለም", "ዓለም")
    manifest = tiny.write_manifest(
        [f"{text} {words[i % 4]}" for i, text in enumerate(tiny.texts)], "train_am.csv")
    return {"base": tiny.root, "vocab": ext, "grown": grown, "manifest": manifest,
            "root": root}


def _xtts_project(tmp_path: Path, *, regular_utils: bool = False,
                  drop_line: bool = False) -> Path:
    project = tmp_path / "project"
    shutil.copytree(CLIENTS / "xtts_project", project)
    if regular_utils:  # a regular package: our file is copied into it, as documented
        (project / "utils" / "__init__.py").write_text("")
        shutil.copy(REPO / "utils" / "training_patches.py", project / "utils")
    if drop_line:
        script = project / "headlessXttsTrain.py"
        lines = script.read_text().splitlines(keepends=True)
        assert lines[0].startswith("from utils import training_patches")
        script.write_text("".join(lines[1:]))
    return project


def _run_xtts(project: Path, base: dict[str, Path], out: Path, *, launcher: bool = False,
              pythonpath: str | None = None, vocab: str = "vocab",
              extra: tuple[str, ...] = ("--grad-accum", "16"), **env: str) -> dict:
    argv = [sys.executable, "headlessXttsTrain.py", "--base-dir", str(base["base"]),
            "--vocab", str(base[vocab]), "--train-csv", str(base["manifest"]),
            "--language", "amh", "--out", str(out), *extra]
    environment = _env(TRAINING_PATCHES_BASE_VOCAB=str(BASE_TOKENS), **env)
    if pythonpath is not None:
        environment["PYTHONPATH"] = child_path(pythonpath)
    output = _run(LAUNCHER + argv if launcher else argv, project, environment)
    harness = json.loads((out / "harness.json").read_text())
    harness["output"] = output
    return harness


def _assert_xtts_run(harness: dict, base: dict[str, Path], out: Path) -> None:
    # one NaN micro-batch: no tensor is non-finite, the micro-batch alone was left out
    assert harness["nonfinite_tensors"] == 0 and harness["tensors"] > 100
    stats = harness["stats"]["nan_guard"]
    assert stats["nonfinite_losses"] == 1 and stats["skipped_micro_batches"] == 1
    assert stats["skipped"] == 0  # no optimizer step was dropped
    run_dir = Path(harness["run_dir"])
    (event,) = _events(run_dir)
    assert event["micro_batch"] is True and math.isnan(float(event["loss"]))
    assert event["samples"] == harness["faulty_samples"] and len(event["samples"]) == 1
    assert event["trainer_step"] == NAN_AT - 1  # coqui counts micro-batches from 0
    assert event["source"]["module"].endswith("gpt.text_embedding")  # the swapped module
    assert "left out of the accumulated gradient" in harness["output"]
    assert str(run_dir / "nonfinite_events.jsonl") in harness["output"]
    # TRAINING_PATCHES_BASE_VOCAB alone: base rows bit-identical to model.pth, even though
    # the trainer swapped text_embedding/text_head after GPTTrainer was built
    base_state = torch.load(base["base"] / "model.pth")["model"]
    final = torch.load(out / "final_xtts.pth")
    for name in ("gpt.text_embedding.weight", "gpt.text_head.weight", "gpt.text_head.bias"):
        old, new = base_state[name], final[name]
        assert torch.equal(new[:BASE_TOKENS - 1], old[:BASE_TOKENS - 1]), name
        assert torch.equal(new[-1], old[-1]), name  # [START], moved to the new last row
        moved = (new[BASE_TOKENS - 1:-1] - old[:BASE_TOKENS - 1].mean(0)).abs()
        assert moved.sum() > 0, name  # the new Amharic rows trained


@pytest.fixture(scope="module")
def card_line_nan_run(xtts_base, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The card's line, our checkout on the path, one NaN micro-batch: one run, read by the
    two tests below (each a claim of its own about the same run; a run is ~half a minute)."""
    root = tmp_path_factory.mktemp("card_line")
    project = _xtts_project(root)
    out = root / "nan"
    harness = _run_xtts(project, xtts_base, out, pythonpath=str(REPO),
                        CLIENT_NAN_MICRO_BATCH=str(NAN_AT))
    return {"project": project, "out": out, "harness": harness}


@pytest.mark.xtts
def test_xtts_card_line_with_the_projects_namespace_utils(xtts_base, card_line_nan_run) -> None:
    """The card's ``from utils import training_patches`` with our checkout on the path:
    ``utils`` merges with the project's, so ``utils.gpt_train`` is still theirs."""
    project, out = card_line_nan_run["project"], card_line_nan_run["out"]
    harness = card_line_nan_run["harness"]
    assert str(project / "utils") in harness["utils_paths"]
    assert str(REPO / "utils") in harness["utils_paths"]
    assert {"nan_guard", "vocab_freeze", "languages"} <= set(harness["applied"])
    _assert_xtts_run(harness, xtts_base, out)


@pytest.mark.xtts
def test_xtts_a_nan_micro_batch_is_exactly_the_run_without_it(xtts_base, card_line_nan_run,
                                                              tmp_path) -> None:
    """The 15 other micro-batches are used: the guarded run (its replay that finds the
    source included) ends bit-identical to a run in which that micro-batch's loss was
    multiplied by 0."""
    project = _xtts_project(tmp_path)
    nan_run = card_line_nan_run["harness"]  # the same command as the NaN run here
    zero_run = _run_xtts(project, xtts_base, tmp_path / "zero", pythonpath=str(REPO),
                         CLIENT_ZERO_MICRO_BATCH=str(NAN_AT))
    assert "source" in _events(Path(nan_run["run_dir"]))[0]
    assert nan_run["faulty_samples"] == zero_run["faulty_samples"]
    assert zero_run["stats"]["nan_guard"]["nonfinite_losses"] == 0
    guarded = torch.load(card_line_nan_run["out"] / "final_xtts.pth")
    reference = torch.load(tmp_path / "zero" / "final_xtts.pth")
    start = torch.load(xtts_base["base"] / "model.pth")["model"]
    differ = [k for k in reference if not torch.equal(guarded[k], reference[k])]
    assert differ == []
    assert not torch.equal(guarded["gpt.gpt.h.0.mlp.c_fc.weight"],
                           start["gpt.gpt.h.0.mlp.c_fc.weight"])  # the step did happen


@pytest.mark.xtts
def test_xtts_regular_utils_with_the_copied_file(xtts_base, tmp_path) -> None:
    project = _xtts_project(tmp_path, regular_utils=True)
    out = tmp_path / "out"
    harness = _run_xtts(project, xtts_base, out, CLIENT_NAN_MICRO_BATCH=str(NAN_AT))
    assert harness["utils_paths"] == [str(project / "utils")]
    _assert_xtts_run(harness, xtts_base, out)


@pytest.mark.xtts
def test_xtts_launcher_with_no_line(xtts_base, tmp_path) -> None:
    project = _xtts_project(tmp_path, drop_line=True)
    out = tmp_path / "out"
    harness = _run_xtts(project, xtts_base, out, launcher=True,
                        CLIENT_NAN_MICRO_BATCH=str(NAN_AT))
    assert "training_patches" not in (project / "headlessXttsTrain.py").read_text()
    _assert_xtts_run(harness, xtts_base, out)


GROWTH_ACCUM, GROWTH_CLIPS = 4, 20


@pytest.fixture(scope="module")
def first_run_before_growth(xtts_base, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The first run of the growth test, one NaN micro-batch included: the same for both
    loaders, so made once (each case continues a copy of its run folder)."""
    root = tmp_path_factory.mktemp("before_growth")
    project = _xtts_project(root)
    out = root / "first"
    harness = _run_xtts(project, xtts_base, out, pythonpath=str(REPO),
                        extra=("--grad-accum", str(GROWTH_ACCUM), "--lr-milestones", "2,4",
                               "--save-step", str(GROWTH_CLIPS)),
                        CLIENT_NAN_MICRO_BATCH="3")
    return {"project": project, "out": out, "harness": harness}


@pytest.mark.xtts
@pytest.mark.parametrize("loader", ["patches", "upstream"])
def test_xtts_continue_after_growth_keeps_every_row_and_the_lr_schedule(
        xtts_base, first_run_before_growth, tmp_path, loader) -> None:
    """The project's own resume (coqui ``continue_path``) after the vocabulary grew
    82 -> 87 ids: the rows trained in the first run are kept in place, the base rows stay
    bit-identical to model.pth, the Amharic rows train on, and the restored LR is the
    MultiStepLR schedule's at the restored optimizer step (one NaN micro-batch in the
    first run included)."""
    project = first_run_before_growth["project"]
    # the control: coqui's own restore (the checkpoint patch off) loses the trained rows
    off = {"TRAINING_PATCHES_DISABLE": "checkpoint"} if loader == "upstream" else {}
    accum, clips = GROWTH_ACCUM, GROWTH_CLIPS
    first = first_run_before_growth["harness"]
    # coqui continues inside the folder it is given: each case continues its own copy
    run_dir = tmp_path / "first_run"
    shutil.copytree(first["run_dir"], run_dir)
    steps = clips // accum  # optimizer steps in the first run: the NaN micro-batch costs none
    assert first["stats"]["nan_guard"]["skipped"] == 0
    assert first["scheduler_epoch"] == steps
    trained = torch.load(first_run_before_growth["out"] / "final_xtts.pth")
    grown = _run_xtts(project, xtts_base, tmp_path / "grown", pythonpath=str(REPO),
                      vocab="grown",
                      extra=("--grad-accum", str(accum), "--lr-milestones", "2,4",
                             "--epochs", "2", "--continue-path", str(run_dir)), **off)
    start = grown["start"]
    rows = torch.load(tmp_path / "grown" / "start_text_rows.pth")
    base_state = torch.load(xtts_base["base"] / "model.pth")["model"]
    final = torch.load(tmp_path / "grown" / "final_xtts.pth")
    from conftest import AMHARIC_NEW_TOKENS
    amharic = slice(BASE_TOKENS - 1, BASE_TOKENS + len(AMHARIC_NEW_TOKENS))  # + [am]
    # the seed-style check: the LR is the schedule's at the restored step
    lr_matches = (start["scheduler_epoch"] == steps == start["optimizer_steps"]
                  and start["lr"] == pytest.approx(5e-4 * 0.5 ** sum(m <= steps for m in (2, 4)),
                                                   rel=1e-12))
    kept = all(torch.equal(rows[key][:-len(GROWN_TOKENS) - 1], trained[name][:-1])
               and torch.equal(rows[key][-1], trained[name][-1])
               for key, name in (("text_embedding", "gpt.text_embedding.weight"),
                                 ("text_head", "gpt.text_head.weight")))
    if loader == "upstream":
        # coqui's partial load drops the grown text tensors (the rows of the first run are
        # gone) and, with the optimizer not loaded, the schedule starts again at 0
        assert start["scheduler_epoch"] == 0 and not lr_matches and not kept
        return
    assert lr_matches, start
    assert grown["scheduler_epoch"] == 2 * steps
    assert kept  # every trained row in place, [START] moved to the new last row
    for name in ("gpt.text_embedding.weight", "gpt.text_head.weight"):
        assert final[name].shape[0] == trained[name].shape[0] + len(GROWN_TOKENS)
        # base rows bit-identical to model.pth at the end of both runs
        assert torch.equal(final[name][:BASE_TOKENS - 1], base_state[name][:BASE_TOKENS - 1])
        # the Amharic rows trained in the first run (moved from the project's mean init)
        # train on in the second; the old loader froze every row of the checkpoint
        begun = rows["text_embedding" if "embedding" in name else "text_head"]
        init = base_state[name][:BASE_TOKENS - 1].mean(dim=0)
        trained_first = (trained[name][amharic] != init).any(1)
        trained_again = (final[name][amharic] != begun[amharic]).any(1)
        assert trained_first.sum() >= 4 and torch.equal(trained_again, trained_first), name


# -- the IndexTTS2-style loop -------------------------------------------------------------

SPM_BASE = 12000
AMHARIC = "ሀለሐመሠረሰሸቀበተቸኀነኘአከኸወዐዘዠየደጀገጠጨጰጸፀፈፐ"
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "we", "train", "new", "words")


def _spm_model(path: Path, extra: str = "") -> Path:
    """A SentencePiece unigram model of 12,000 base pieces (+ one per extra character),
    written through the model protobuf sentencepiece ships."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    kinds = pb.ModelProto.SentencePiece
    for piece, kind in (("<unk>", kinds.UNKNOWN), ("<s>", kinds.CONTROL), ("</s>", kinds.CONTROL)):
        proto.pieces.add(piece=piece, type=kind, score=0.0)
    for char in "▁abcdefghijklmnopqrstuvwxyz":
        proto.pieces.add(piece=char, score=-8.0)
    for word in WORDS:
        proto.pieces.add(piece="▁" + word, score=-1.0)
    filler = 0
    while len(proto.pieces) < SPM_BASE:
        proto.pieces.add(piece=f"▁zz{filler}q", score=-20.0)
        filler += 1
    for char in extra:
        proto.pieces.add(piece=char, score=-8.0)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    path.write_bytes(proto.SerializeToString())
    return path


@pytest.fixture(scope="module")
def indextts_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("indextts_client")
    lines = []
    for i in range(48):
        english = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3))
        amharic = "".join(AMHARIC[(i * 3 + j) % len(AMHARIC)] for j in range(3))
        lines.append(f"utt{i:03d}|{english} {amharic}")
    (root / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"root": root, "data": root / "train.txt",
            "base": _spm_model(root / "bpe_base.model"),
            "ext": _spm_model(root / "bpe_am.model", AMHARIC[:24]),
            "ext2": _spm_model(root / "bpe_am2.model", AMHARIC)}


def _indextts_script(tmp_path: Path, line: str | None) -> Path:
    project = tmp_path / "indextts"
    if not project.exists():
        shutil.copytree(CLIENTS / "indextts", project)
    script = project / "trainers" / "train_gpt_v2.py"
    if line is not None and not script.read_text().startswith(line):
        script.write_text(line + "\n" + script.read_text())
    return script


def _run_indextts(script: Path, files: dict[str, Path], out: Path, *, bpe: str = "ext",
                  launcher: bool = False, extra: tuple[str, ...] = (), **env: str) -> dict:
    argv = [sys.executable, str(script), "--bpe", str(files[bpe]), "--data", str(files["data"]),
            "--out", str(out), *extra]
    environment = _env(**env)
    environment["PYTHONPATH"] = child_path(REPO)  # the library, as if installed
    output = _run(LAUNCHER + argv if launcher else argv, script.parents[1], environment)
    harness = json.loads((out / "harness.json").read_text())
    harness["output"] = output
    return harness


@pytest.mark.parametrize("how", ["line", "launcher"])
def test_indextts_nan_step_evidence_and_step_accounting(indextts_files, tmp_path, how) -> None:
    """``import patches.auto`` (or the launcher): a NaN step is skipped, its event sits
    beside the checkpoints with the loss, the step and the samples; the trainer's step,
    the scheduler and the checkpoint agree, so its resume LR check passes."""
    script = _indextts_script(tmp_path, "import patches.auto" if how == "line" else None)
    out = tmp_path / "run"
    harness = _run_indextts(script, indextts_files, out, launcher=how == "launcher",
                            extra=("--steps", "8"), CLIENT_NAN_MICRO_BATCH="6")
    assert harness["nonfinite_tensors"] == 0
    stats = harness["stats"]["nan_guard"]
    assert stats["skipped"] == 1 and stats["nonfinite_losses"] == 1 and stats["steps"] == 8
    (event,) = _events(out)  # beside model_step4.pth / latest.pth, with no setting
    assert event["step"] == 6 and math.isnan(float(event["loss"]))
    assert event["samples"] == harness["faulty_samples"]
    assert any(name.startswith("text_embedding") for name in event["nonfinite_grads"])
    assert str(out / "nonfinite_events.jsonl") in harness["output"]
    # the rule: the scheduler follows the trainer's count (lr_step_on_skip=1)
    assert harness["global_step"] == harness["scheduler_epoch"] == 8
    assert harness["lr"] == pytest.approx(harness["expected_lr"], rel=1e-12)

    for loader in ("own", "patches"):
        resumed = _run_indextts(script, indextts_files, tmp_path / f"resumed_{loader}",
                                launcher=how == "launcher",
                                extra=("--steps", "10", "--resume", str(out / "latest.pth"),
                                       "--loader", loader))
        assert "LR mismatch" not in resumed["output"]
        (check,) = resumed["lr_checks"]
        assert check["step"] == 8 and check["actual"] == pytest.approx(check["expected"],
                                                                       rel=1e-12)
        assert resumed["global_step"] == resumed["scheduler_epoch"] == 10


def test_indextts_without_the_rule_the_resume_lr_check_fails(indextts_files, tmp_path) -> None:
    """The control: with the scheduler held on the skip (lr_step_on_skip=0) the checkpoint
    records step 8 with scheduler 7, and the trainer's own check warns."""
    script = _indextts_script(tmp_path, "import patches.auto")
    out = tmp_path / "run"
    _run_indextts(script, indextts_files, out, extra=("--steps", "8"),
                  CLIENT_NAN_MICRO_BATCH="6", TRAINING_PATCHES_LR_STEP_ON_SKIP="0")
    resumed = _run_indextts(script, indextts_files, tmp_path / "resumed",
                            extra=("--steps", "9", "--resume", str(out / "latest.pth")))
    assert "LR mismatch" in resumed["output"]


def test_indextts_base_vocab_alone_and_a_nan_micro_batch(indextts_files, tmp_path) -> None:
    """TRAINING_PATCHES_BASE_VOCAB=12000 alone freezes the 12,000 base rows of UnifiedVoice
    (vocab+1 rows) exactly while the Amharic rows train; with accumulation 4, a NaN
    micro-batch is left out and no step is lost."""
    script = _indextts_script(tmp_path, "import patches.auto")
    out = tmp_path / "run"
    harness = _run_indextts(script, indextts_files, out,
                            extra=("--steps", "6", "--accum", "4"),
                            CLIENT_NAN_MICRO_BATCH="7", TRAINING_PATCHES_BASE_VOCAB="12000")
    moved = torch.tensor(harness["rows_moved"])
    assert moved.shape[0] == SPM_BASE + 24 + 1
    assert moved[:SPM_BASE].max().item() == 0.0
    assert (moved[SPM_BASE:SPM_BASE + 24] > 0).all()
    stats = harness["stats"]["nan_guard"]
    assert stats["skipped_micro_batches"] == 1 and stats["skipped"] == 0
    (event,) = _events(out)
    assert event["micro_batch"] is True and event["samples"] == harness["faulty_samples"]


def test_indextts_resume_after_growth_keeps_every_row(indextts_files, tmp_path) -> None:
    """12,000+24 -> 12,000+34 through the library's loader in the resume block: every
    trained row kept in place (the +1 slot stays last), the Amharic rows trained before
    the growth train on, the base rows stay bit-identical."""
    script = _indextts_script(tmp_path, "import patches.auto")
    first = tmp_path / "first"
    _run_indextts(script, indextts_files, first, extra=("--steps", "4"),
                  TRAINING_PATCHES_BASE_VOCAB="12000")
    trained = torch.load(first / "latest.pth", weights_only=False)["model"]
    grown = _run_indextts(script, indextts_files, tmp_path / "grown", bpe="ext2",
                          extra=("--steps", "8", "--resume", str(first / "latest.pth"),
                                 "--loader", "patches"),
                          TRAINING_PATCHES_BASE_VOCAB="12000")
    start = torch.load(tmp_path / "grown" / "start_embedding.pt")
    old = trained["text_embedding.weight"]
    assert start.shape[0] == SPM_BASE + len(AMHARIC) + 1
    assert torch.equal(start[:SPM_BASE + 24], old[:-1]) and torch.equal(start[-1], old[-1])
    moved = torch.tensor(grown["rows_moved"])
    assert moved[:SPM_BASE].max().item() == 0.0
    assert (moved[SPM_BASE:SPM_BASE + 24] > 0).all()  # trained before the growth: train on
    assert "LR mismatch" not in grown["output"]


# -- the launcher reaches every process ---------------------------------------------------

WORKER_PROBE = """
import sys, torch
from torch.utils.data import DataLoader, Dataset

class Probe(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        patches = sys.modules.get("patches")
        return int(bool(patches and patches.advanced.applied()))

if __name__ == "__main__":
    loader = DataLoader(Probe(), batch_size=1, num_workers=2, multiprocessing_context="spawn")
    print("workers patched:", [int(b) for b in loader])
    patches = sys.modules.get("patches")
    print("main patched:", int(bool(patches and patches.advanced.applied())))
"""

RANK_PROBE = """
import os, sys, torch
patches = sys.modules.get("patches")
# one file per rank: two ranks printing to one pipe interleave their lines
with open(f"rank{os.environ['RANK']}.txt", "w") as out:
    applied = bool(patches and patches.advanced.applied())
    out.write(f"rank {os.environ['RANK']} patched {int(applied)}")
"""


def test_launcher_reaches_spawned_workers_and_torchrun_ranks(tmp_path) -> None:
    (tmp_path / "probe.py").write_text(WORKER_PROBE)
    output = _run(LAUNCHER + [sys.executable, "probe.py"], tmp_path, _env())
    assert "workers patched: [1, 1]" in output and "main patched: 1" in output
    # without the launcher the same workers are not patched (the control)
    plain = _run([sys.executable, "probe.py"], tmp_path, _env())
    assert "workers patched: [0, 0]" in plain and "main patched: 0" in plain

    (tmp_path / "ranks.py").write_text(RANK_PROBE)
    torchrun = Path(sys.executable).with_name("torchrun")
    _run(LAUNCHER + [str(torchrun), "--standalone", "--nproc_per_node", "2", "ranks.py"],
         tmp_path, _env())
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)] == [
        "rank 0 patched 1", "rank 1 patched 1"]
