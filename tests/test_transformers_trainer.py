"""The Hugging Face ``transformers.Trainer`` (5.x) with its default fused AdamW
(``adamw_torch_fused``): one NaN loss at HF global step 3 is skipped exactly (the run ends
bit-identical to one whose data never had that batch), the record is in ``output_dir``
with that global step when ``train()`` returns, and ``TRAINING_PATCHES_BASE_VOCAB`` keeps
a grown, tied GPT-2's base rows bit-identical through ``Trainer.train``."""

from __future__ import annotations

import json
import logging
import pickle
import types
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch

import patches
from patches import _run, nan_guard

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # real Trainer runs: a few seconds each

BAD = 3  # the poisoned batch: HF's global_step when it starts (the guard's step 4)
BATCHES, BATCH, LENGTH, VOCAB = 8, 2, 16, 64


class PoisonableGPT2(transformers.GPT2LMHeadModel):
    """GPT-2 whose loss is NaN on a batch marked ``poison``: the NaN reaches every
    gradient through backward, as a real overflow would."""

    def forward(self, input_ids: Any = None, labels: Any = None, poison: Any = None,
                **kwargs: Any) -> Any:
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if poison is not None and bool(poison.any()):
            out.loss = out.loss * float("nan")
        return out


def _model(vocab: int = VOCAB) -> PoisonableGPT2:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    # no dropout: the skipped step's forward must draw no RNG the other run does not draw
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=vocab,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return PoisonableGPT2(config)


def _rows(leave_out: int | None = None, poison: int | None = None,
          high: int = VOCAB) -> list[dict[str, torch.Tensor]]:
    """``BATCHES`` batches of samples in order (sequential sampler); batch ``poison``
    marked, batch ``leave_out`` left out."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, high, (BATCHES * BATCH, LENGTH), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i],
             "poison": torch.tensor(float(i // BATCH == poison))}
            for i in range(BATCHES * BATCH) if i // BATCH != leave_out]


def _train(output_dir: Path, rows: list[dict[str, torch.Tensor]],
           model: torch.nn.Module | None = None) -> Any:
    model = model if model is not None else _model()
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=len(rows) // BATCH,
        per_device_train_batch_size=BATCH, report_to=[], save_strategy="no", use_cpu=True,
        logging_steps=1000, seed=0, learning_rate=1e-2, lr_scheduler_type="constant",
        train_sampling_strategy="sequential", disable_tqdm=True)
    assert args.optim == "adamw_torch_fused"  # transformers' default with torch >= 2.8
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return trainer


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_nan_step_is_skipped_exactly_and_recorded_in_output_dir(trainer_env, tmp_path) -> None:
    """The run with the poisoned batch ends bit-identical to the run that never had it:
    the fused kernel skipped that step whole (parameters, moments, Adam's step count).
    The scheduler did step on the skipped step (HF gates it only on accelerate's fp16
    scaler; the guard's default lr_step_on_skip=1 lets it): with a constant LR it changes
    nothing, with a decaying one the two runs could not be compared."""
    patches.advanced.apply(["nan_guard", "grad_clip"])
    assert patches.status("transformers_trainer")["state"] in ("applied", "waiting")
    poisoned = _train(tmp_path / "out", _rows(poison=BAD))
    # (b) on disk when train() returns (the fused flags are read at on_train_end, not at exit)
    events = _events(tmp_path / "out" / _run.EVENTS_FILE)
    assert [(e["step"], e["trainer_step"], e["kind"], e["loss"]) for e in events] == \
        [(BAD + 1, BAD, "nonfinite_loss", "NaN")], events
    # the fused fast path: the flag waited on the device until on_train_end read it
    assert poisoned.optimizer.optimizer.defaults["fused"] is True
    assert events[0]["read_at_step"] == BATCHES
    assert not (tmp_path / "training_patches").exists()
    assert patches.stats()["nan_guard"]["skipped"] == 1
    assert poisoned.lr_scheduler.last_epoch == BATCHES  # the scheduler stepped on the skip
    # the integration's callback pickles (a Trainer is pickled and copied with its callbacks)
    ours = [c for c in poisoned.callback_handler.callbacks
            if type(c).__module__.startswith("patches.")]
    assert len(ours) == 1 and type(pickle.loads(pickle.dumps(ours[0]))) is type(ours[0])

    nan_guard.reset()
    clean = _train(tmp_path / "clean", _rows(leave_out=BAD))
    assert not (tmp_path / "clean" / _run.EVENTS_FILE).exists()
    # (a) exact: every parameter, and Adam's state, as if the batch had never been there
    got, want = poisoned.model.state_dict(), clean.model.state_dict()
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    start = _model().state_dict()
    assert all(not torch.equal(got[k], start[k]) for k in got if "weight" in k)  # it trained
    steps = {float(s["step"]) for s in poisoned.optimizer.state_dict()["state"].values()}
    assert steps == {BATCHES - 1.0}  # the skipped step did not advance the step count


class _EventsAt(transformers.TrainerCallback):
    """Notes, at each step's start, whether the events file is in output_dir."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen[state.global_step] = (Path(args.output_dir) / _run.EVENTS_FILE).exists()


def test_a_skip_before_a_save_is_recorded_by_the_save(trainer_env, tmp_path) -> None:
    """A save right after the bad step (global step BAD + 1) reads the fused flags: the
    record is on disk before the next step, not only every 25 steps or at the end."""
    patches.advanced.apply(["nan_guard", "grad_clip"])
    model, probe = _model(), _EventsAt()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=BATCHES, per_device_train_batch_size=BATCH,
        report_to=[], save_strategy="steps", save_steps=BAD + 1, use_cpu=True,
        logging_steps=1000, seed=0, lr_scheduler_type="constant",
        train_sampling_strategy="sequential", disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=_rows(poison=BAD),
                         callbacks=[probe]).train()
    assert probe.seen == {step: step >= BAD + 1 for step in range(BATCHES)}
    assert (tmp_path / "out" / f"checkpoint-{BAD + 1}").is_dir()


def test_unpatched_nan_step_ruins_the_model(trainer_env, tmp_path) -> None:
    """The control: upstream steps the fused AdamW on the NaN gradients (it filters the NaN
    out of the logged loss only)."""
    trainer = _train(tmp_path / "out", _rows(poison=BAD))
    assert all(not bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_integration_off_records_go_elsewhere_with_no_trainer_step(trainer_env, tmp_path) -> None:
    """With the integration left off, the generic guard still skips the step, but nothing
    is in output_dir when train() returns; the record, written at the next read of the
    flags, lands in ./training_patches with no trainer step."""
    patches.advanced.apply(["nan_guard", "grad_clip"], disable=["transformers_trainer"])
    _train(tmp_path / "out", _rows(poison=BAD))
    assert not (tmp_path / "out" / _run.EVENTS_FILE).exists()
    assert patches.stats()["nan_guard"]["skipped"] == 1  # reads the flags: the record is written
    events = _events(tmp_path / "training_patches" / _run.EVENTS_FILE)
    assert [(e["step"], e["trainer_step"]) for e in events] == [(BAD + 1, None)]


def test_base_vocab_rows_stay_bit_identical_through_trainer_train(
        trainer_env, tmp_path) -> None:
    """TRAINING_PATCHES_BASE_VOCAB on a grown, tied GPT-2 trained by Trainer.train (fused
    AdamW): the base rows of wte (which is lm_head) bit-identical, the new rows learn."""
    grown = VOCAB + 8
    patches.advanced.apply(["nan_guard", "grad_clip", "vocab_freeze"], base_vocab=VOCAB)
    model = _model()
    model.resize_token_embeddings(grown)
    wte = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is wte  # tied
    before = wte.detach().clone()
    _train(tmp_path / "out", _rows(high=grown), model)
    assert torch.equal(wte[:VOCAB], before[:VOCAB])
    assert (wte[VOCAB:] - before[VOCAB:]).abs().min().item() > 0  # every new row learned
    assert patches.status("vocab_freeze")["detail"] == \
        f"frozen {VOCAB} rows of {grown} in transformer.wte.weight"


def _saving_args(output_dir: Path, max_steps: int) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=BATCH,
        report_to=[], save_strategy="steps", save_steps=2, use_cpu=True, logging_steps=1000,
        seed=0, learning_rate=1e-2, lr_scheduler_type="constant",
        train_sampling_strategy="sequential", disable_tqdm=True)


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_a_torn_checkpoint_folder_is_never_resumed(trainer_env, tmp_path, caplog,
                                                   applied) -> None:
    """A run killed while writing checkpoint-6 (its model file cut short, no completion
    marker): ``resume_from_checkpoint=True`` resumes from checkpoint-4, the newest complete
    one, with a WARNING naming the torn folder. Upstream takes the highest number and fails
    reading it (the control)."""
    if applied:
        patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    out = tmp_path / "out"
    transformers.Trainer(model=_model(), args=_saving_args(out, 4), train_dataset=_rows()).train()
    assert (out / "checkpoint-4" / "training_patches_complete.json").is_file() == applied
    torn = out / "checkpoint-6"
    torn.mkdir()
    for name in ("config.json", "trainer_state.json"):
        (torn / name).write_bytes((out / "checkpoint-4" / name).read_bytes())
    weights = (out / "checkpoint-4" / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    trainer = transformers.Trainer(model=_model(), args=_saving_args(out, 8),
                                   train_dataset=_rows())
    if not applied:
        with pytest.raises(Exception):
            trainer.train(resume_from_checkpoint=True)
        return
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        trainer.train(resume_from_checkpoint=True)
    assert f"{torn} has no completion marker" in caplog.text
    assert trainer.state.global_step == 8
    assert torn.exists()  # left as it is
    log = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert log["global_step"] == 8


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_resume_from_checkpoint_into_a_grown_vocabulary(trainer_env, tmp_path,
                                                        applied) -> None:
    """The tokenizer grew after checkpoint-4 was written (64 -> 72 tokens, the model resized
    with ``resize_token_embeddings``): ``resume_from_checkpoint=True`` continues to step 8
    with the 64 trained rows and their saved Adam moments as saved, the new rows' moments
    grown (first 0, second the old rows' mean), the schedule and step count where they
    were, and the trained rows frozen through the rest of training. Upstream stops at a
    size mismatch (the control)."""
    from safetensors.torch import load_file

    if applied:
        patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    out = tmp_path / "out"
    transformers.Trainer(model=_model(), args=_saving_args(out, 4), train_dataset=_rows()).train()
    saved = out / "checkpoint-4"
    trained = load_file(str(saved / "model.safetensors"))["transformer.wte.weight"]
    moments = torch.load(saved / "optimizer.pt", weights_only=True)
    grown = VOCAB + 8
    model = _model()
    model.resize_token_embeddings(grown)
    seen: dict[str, Any] = {}

    class Look(transformers.TrainerCallback):
        """What the resumed run starts from, once the Trainer loaded the checkpoint."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
            inner = getattr(optimizer, "optimizer", optimizer)
            wte = model.get_input_embeddings().weight
            order = [p for g in inner.param_groups for p in g["params"]]
            seen.update(weight=wte.detach().clone(), index=order.index(wte),
                        state={k: v.clone() for k, v in inner.state[wte].items()},
                        step=state.global_step, lr_step=lr_scheduler.last_epoch)

    trainer = transformers.Trainer(model=model, args=_saving_args(out, 8),
                                   train_dataset=_rows(high=grown), callbacks=[Look()])
    if not applied:
        with pytest.raises(RuntimeError, match="size mismatch for transformer.wte.weight"):
            trainer.train(resume_from_checkpoint=True)
        return
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 8
    assert (seen["step"], seen["lr_step"]) == (4, 4)
    assert torch.equal(seen["weight"][:VOCAB], trained)
    old = moments["state"][seen["index"]]
    state = seen["state"]
    assert state["exp_avg"].shape == (grown, 32)
    assert torch.equal(state["exp_avg"][:VOCAB], old["exp_avg"])
    assert torch.equal(state["exp_avg_sq"][:VOCAB], old["exp_avg_sq"])
    assert not state["exp_avg"][VOCAB:].any()
    mean = old["exp_avg_sq"].double().mean(0).float()
    assert torch.allclose(state["exp_avg_sq"][VOCAB:], mean.expand(8, -1))
    wte = trainer.model.get_input_embeddings().weight
    assert torch.equal(wte[:VOCAB], trained)  # frozen after the growth, through 4 more steps
    assert not torch.equal(wte[VOCAB:], seen["weight"][VOCAB:])  # the new rows trained


# -- what a grown resume says; one run per folder; a killed run found (issue 38, item 5) -----

AMHARIC = ["ሰ", "ላ", "ም", "ሀ", "ለ", "መ", "ረ", "በ"]  # the 8 new tokens, each spelled in latin


def _char_tokenizer(extra: list[str] = ()) -> Any:
    """A fast HF tokenizer of VOCAB characters (its tokenizers backend a BPE without merges:
    one id per character), with ``extra`` added tokens after them."""
    from tokenizers import Tokenizer, models

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["[UNK]"] = len(vocab)
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.add_tokens(list(extra))
    return tokenizer


def test_a_grown_resume_says_what_the_trainer_restores_and_spells_its_new_tokens(
        trainer_env, tmp_path, caplog) -> None:
    """The load line of ``resume_from_checkpoint`` into a grown vocabulary names what the
    Trainer restores itself from checkpoint-4 (optimizer, scheduler, RNG, step 4), never
    ``optimizer absent`` or ``resuming at 0``; the new rows are spelled with the Trainer's
    ``processing_class`` (each Amharic token from the rows of its latin spelling), and the
    line says so."""
    patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    out = tmp_path / "out"
    transformers.Trainer(model=_model(), args=_saving_args(out, 4), train_dataset=_rows(),
                         processing_class=_char_tokenizer(),
                         data_collator=transformers.default_data_collator).train()
    model = _model()
    model.resize_token_embeddings(VOCAB + len(AMHARIC))
    trainer = transformers.Trainer(
        model=model, args=_saving_args(out, 6), train_dataset=_rows(),
        processing_class=_char_tokenizer(AMHARIC), data_collator=transformers.default_data_collator)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        trainer.train(resume_from_checkpoint=True)
    (line,) = [r.getMessage() for r in caplog.records if "checkpoint-4/model.safetensors (policy"
               in r.getMessage()]
    said = "by the Hugging Face Trainer from checkpoint-4/"
    assert f"optimizer restored ({said}optimizer.pt, then its moments of the grown rows " \
           "grown by training-patches)" in line, line
    assert f"scheduler restored ({said}scheduler.pt)" in line, line
    assert f"step 4 restored ({said}trainer_state.json)" in line, line
    assert f"RNG restored ({said}rng_state.pth)" in line, line
    assert "absent (resuming at 0)" not in line and "optimizer absent" not in line, line
    assert "(8 from their spelling)" in line, line
    assert "new tokens spelled with the Hugging Face Trainer's processing_class" in line, line
    assert trainer.state.global_step == 6


def test_a_grown_resume_without_a_tokenizer_says_where_it_looked(
        trainer_env, tmp_path, caplog) -> None:
    """No processing_class: the new rows start by spread, and the line says the Trainer was
    given none (not only that no tokenizer was given to the loader)."""
    patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    out = tmp_path / "out"
    transformers.Trainer(model=_model(), args=_saving_args(out, 2), train_dataset=_rows()).train()
    model = _model()
    model.resize_token_embeddings(VOCAB + 8)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        transformers.Trainer(model=model, args=_saving_args(out, 4),
                             train_dataset=_rows()).train(resume_from_checkpoint=True)
    assert "no tokenizer found (the Hugging Face Trainer was given no processing_class)" in \
        caplog.text


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_a_second_run_into_an_output_dir_in_use_is_refused(trainer_env, tmp_path,
                                                           applied) -> None:
    """Another process trains in ``output_dir`` (it holds the folder's lock): this run is
    refused in one paragraph naming that process, before it writes a checkpoint (upstream
    trains on and the two overwrite each other's checkpoint-N, exit 0: the control). The
    same process training there again (a resume) is no other run."""
    import subprocess
    import sys

    if applied:
        patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from patches import _runlock; "
         "_runlock.lock_folder(sys.argv[1], beside=True); print('held', flush=True); "
         "sys.stdin.read()",
         str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        trainer = transformers.Trainer(model=_model(), args=_saving_args(out, 2),
                                       train_dataset=_rows())
        if not applied:
            trainer.train()
            assert (out / "checkpoint-2").is_dir()
            return
        with pytest.raises(patches.RunFolderInUse) as refused:
            trainer.train()
        message = str(refused.value)
        assert f"the Hugging Face Trainer's output folder {out} is in use by process " \
               f"{holder.pid}" in message and "checkpoint-N folders" in message
        assert "\n" not in message and not (out / "checkpoint-2").exists()
    finally:
        holder.communicate("", timeout=30)
    transformers.Trainer(model=_model(), args=_saving_args(out, 2), train_dataset=_rows()).train()
    transformers.Trainer(model=_model(), args=_saving_args(out, 4),
                         train_dataset=_rows()).train(resume_from_checkpoint=True)
    side = patches._runlock.side_folder(out)
    runs = [json.loads(line)["event"] for line in (side / "trainer_runs.jsonl").open()]
    assert runs == ["start", "finished", "start", "finished"]
    # the lock and the records are beside output_dir: it holds what the HF Trainer wrote
    # (upstream's own tests list it exactly)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4"]


def _child_env() -> dict[str, str]:
    """The environment of a process a test starts: this checkout's library first."""
    import os

    from processes import child_path

    return dict(os.environ, PYTHONPATH=child_path(Path(__file__).parents[1]))


KILLED = '''
import os, signal, sys
{auto}
sys.path.insert(0, {tests!r})
import transformers
from test_transformers_trainer import _model, _rows, _saving_args

class Kill(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # no handler: the process dies at once

args = _saving_args({out!r}, 8)
args.logging_steps = 1
transformers.Trainer(model=_model(), args=args, train_dataset=_rows(),
                     callbacks=[Kill()]).train()
'''


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_a_run_killed_by_sigterm_is_found_and_called_interrupted(tmp_path, applied) -> None:
    """An HF run killed by SIGTERM at step 5 (the Trainer has no handler: no word, no end):
    ``report`` finds it (its trainer_runs.jsonl, its checkpoints' trainer_state.json),
    calls it interrupted, exit 1, and reads the losses the Trainer logged. (It was "no run
    found", exit 2.) Without the patches (the control) the run is found by its
    trainer_state.json, and the report says it cannot tell how the run ended."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    script = tmp_path / "train.py"
    script.write_text(KILLED.format(tests=str(Path(__file__).parent), out=str(out),
                                    auto="import patches.auto" if applied else ""))
    done = forkserver.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=_child_env())
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    report = forkserver.run([sys.executable, "-m", "patches", "report", str(out),
                             "--no-picture"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=_child_env())
    if not applied:  # found, by its trainer_state.json, but nothing says how it ended
        assert report.returncode == 1 and "verdict: checks not run" in report.stdout
        assert "interrupted" not in report.stdout and "whether the run ended" in report.stdout
        return
    assert report.returncode == 1, report.stdout + report.stderr
    assert "verdict: interrupted" in report.stdout, report.stdout
    assert "recorded no end, and that process is gone" in report.stdout, report.stdout
    assert ("continue it from its newest checkpoint (checkpoint-4) with "
            "trainer.train(resume_from_checkpoint=True) (trainer_runs.jsonl)") in report.stdout
    assert "(4 logged" in report.stdout and "checkpoint-4/trainer_state.json" in report.stdout, \
        report.stdout


def test_a_hyperparameter_trials_checkpoint_is_marked_in_its_run_folder(trainer_env,
                                                                        tmp_path) -> None:
    """In a hyperparameter search the Trainer saves a trial's checkpoint with
    ``self._save_checkpoint(model, trial)`` (the trial by position) into
    ``output_dir/run-<trial number>/checkpoint-N``: that folder is marked complete, and a
    torn ``output_dir/checkpoint-N`` an earlier run left is not vouched for."""
    patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    out = tmp_path / "out"
    args = _saving_args(out, 2)
    args.save_strategy = "no"
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_rows())
    trainer.train()
    torn = out / "checkpoint-2"  # an earlier run's, killed while writing its weights
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"cut short")
    # as hyperparameter_search() sets it
    trainer.hp_search_backend = transformers.trainer_utils.HPSearchBackend.OPTUNA
    trainer._save_checkpoint(trainer.model, types.SimpleNamespace(number=7))
    trial = out / "run-7" / "checkpoint-2"
    assert not (torn / "training_patches_complete.json").exists()
    assert (trial / "model.safetensors").is_file()
    assert (trial / "training_patches_complete.json").is_file()
