"""F5-TTS 1.1's own ``Trainer`` (accelerate, an ``ema_pytorch`` EMA, fused AdamW) with a
tiny real ``CFM``/``DiT`` on the CPU: a NaN batch skipped exactly and recorded in the
checkpoint folder when ``train()`` returns, ``TRAINING_PATCHES_BASE_VOCAB`` freezing
F5's ``text_embed`` (filler row 0, ids shifted by one) bit-identically in the model and
its EMA, checkpoints that a failed save leaves whole, and a resume into a grown vocabulary.
Each test also runs with the integration (or the layout) off, where upstream's behaviour
shows."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import patches
from patches import _run, nan_guard

# f5_tts.model is imported by the first test, not at collection: it brings x_transformers,
# wandb and pypinyin (3 s in every pytest worker)
pytestmark = [pytest.mark.slow,  # real Trainer runs: a few seconds each
              pytest.mark.skipif(importlib.util.find_spec("f5_tts") is None,
                                 reason="f5-tts is not installed (make test installs it)")]

CHARS = "abcdefghijklmnopqrstuvwxyz"
TOKENS = 26  # F5's text_embed has TOKENS + 1 rows: the filler row 0, then token i at i + 1
BATCHES, BATCH, FRAMES, MELS = 8, 2, 12, 16
POISON = "poison"  # the text of the batch whose loss is NaN


@functools.cache
def _f5() -> Any:
    import f5_tts.model

    return f5_tts.model


@functools.cache
def _poisonable() -> type:
    class PoisonableCFM(_f5().CFM):
        """F5's CFM whose forward draws the same noise for a batch whatever ran before it
        (seeded by its text: a run without one batch draws as the full run does for the
        others), and whose loss is NaN on the batch of text ``POISON``, as a real
        overflow's would be in every gradient."""

        def forward(self, inp: Any, text: Any, **kwargs: Any) -> Any:
            seed = zlib.crc32("|".join(text).encode())
            torch.manual_seed(seed)
            random.seed(seed)
            loss, cond, pred = super().forward(inp, text=text, **kwargs)
            if POISON in text:
                loss = loss * float("nan")
            return loss, cond, pred

    return PoisonableCFM


def _model(tokens: int = TOKENS, cfm: type | None = None) -> torch.nn.Module:
    """The tiny model: a PoisonableCFM, or a ``cfm`` class (F5's own CFM)."""
    torch.manual_seed(0)
    vocab = {c: i for i, c in enumerate((CHARS + "0123456789")[:tokens])}
    dit = _f5().DiT(dim=32, depth=1, heads=2, dim_head=16, ff_mult=2, mel_dim=MELS,
                       text_num_embeds=tokens, text_dim=16, conv_layers=0, dropout=0.0)
    return (cfm or _poisonable())(transformer=dit, mel_spec_kwargs=dict(n_mel_channels=MELS),
                                  vocab_char_map=vocab)


class Clips(torch.utils.data.Dataset):
    """``BATCHES`` batches of two clips of equal length, in order (F5's frame sampler,
    no seed); batch ``poison`` has the text POISON, batch ``leave_out`` is left out."""

    def __init__(self, poison: int | None = None, leave_out: int | None = None,
                 high: int = TOKENS) -> None:
        g = torch.Generator().manual_seed(1)
        items = []
        for i in range(BATCHES * BATCH):
            mel = torch.randn(1, MELS, FRAMES, generator=g)
            text = "".join(CHARS[j] for j in torch.randint(0, min(high, 26), (6,), generator=g))
            if i // BATCH == poison:
                text = POISON
            if i // BATCH != leave_out:
                items.append({"mel_spec": mel, "text": text})
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]

    def get_frame_len(self, index: int) -> int:
        return FRAMES


def _trainer(model: torch.nn.Module, folder: Path, epochs: int = 1,
             save_per_updates: int = 1000) -> Any:
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    # warmup longer than the run: the LR rises by the same step per applied update in every
    # run; the EMA averages from the first update on (F5's default copies for 100 updates)
    return _f5().Trainer(model, epochs=epochs, learning_rate=1e-2, num_warmup_updates=100,
                         save_per_updates=save_per_updates, checkpoint_path=str(folder),
                         batch_size_per_gpu=BATCH * FRAMES, batch_size_type="frame",
                         max_samples=BATCH, logger=None, max_grad_norm=1.0,
                         ema_kwargs=dict(beta=0.5, update_after_step=0, update_every=1))


def _train(folder: Path, data: Clips, model: torch.nn.Module | None = None,
           epochs: int = 1) -> Any:
    trainer = _trainer(model if model is not None else _model(), folder, epochs)
    trainer.train(data, num_workers=1)
    return trainer


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _embed(module: torch.nn.Module) -> torch.Tensor:
    return module.transformer.text_embed.text_embed.weight.detach().clone()


BAD = 3  # the poisoned batch: F5's update count when it starts (the guard's step 4)


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "integration_off"])
def test_nan_batch_is_skipped_exactly_and_recorded_in_the_checkpoint_folder(
        trainer_env, tmp_path, applied: bool) -> None:
    """The run with the NaN batch ends with the model and Adam's state bit-identical to the
    run that never had it (the fused kernel skipped that step whole), the EMA finite, and
    the record in F5's checkpoint folder when train() returns, with F5's update count
    (integration off: none)."""
    patches.advanced.apply(["nan_guard", "grad_clip"], lr_step_on_skip=False,
                           disable=[] if applied else ["f5_tts"])
    poisoned = _train(tmp_path / "ckpts", Clips(poison=BAD))
    events_file = tmp_path / "ckpts" / _run.EVENTS_FILE
    assert patches.stats()["nan_guard"]["skipped"] == 1
    model = poisoned.accelerator.unwrap_model(poisoned.model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert all(bool(torch.isfinite(t).all()) for t in poisoned.ema_model.state_dict().values()
               if t.is_floating_point())
    events = _events(events_file)  # beside F5's checkpoints, with or without the integration
    assert [(e["step"], e["kind"], e["loss"]) for e in events] == \
        [(BAD + 1, "nonfinite_loss", "NaN")], events
    if not applied:  # the generic guard does not know F5's update count
        assert events[0]["trainer_step"] is None
        return
    assert events[0]["trainer_step"] == BAD
    assert poisoned.optimizer.optimizer.defaults["fused"] is True  # F5's AdamW
    assert not (tmp_path / "training_patches").exists()

    nan_guard.reset()
    clean = _train(tmp_path / "clean", Clips(leave_out=BAD))
    got = model.state_dict()
    want = clean.accelerator.unwrap_model(clean.model).state_dict()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    start = _model().state_dict()
    assert not torch.equal(got["transformer.proj_out.weight"], start["transformer.proj_out.weight"])
    steps = {float(s["step"]) for s in poisoned.optimizer.state_dict()["state"].values()}
    assert steps == {BATCHES - 1.0}  # the skipped step did not advance Adam's count


def test_unpatched_nan_batch_ruins_the_model_and_its_ema(trainer_env, tmp_path) -> None:
    """The control: without the guard every parameter and the EMA end NaN."""
    trainer = _train(tmp_path / "ckpts", Clips(poison=BAD))
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert not any(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not any(bool(torch.isfinite(p).all()) for p in trainer.ema_model.ema_model.parameters())


@pytest.mark.parametrize("mode", ["patched", "integration_off", "layout_off"])
def test_base_vocab_freezes_the_filler_and_base_rows_in_model_and_ema(
        trainer_env, tmp_path, monkeypatch, caplog, mode: str) -> None:
    """A first run trains every row (its EMA averages them apart from the model's); the
    resumed run sets TRAINING_PATCHES_BASE_VOCAB=20 on F5's text_embed (26 tokens, 27
    rows): the filler row 0 and tokens 0-19 (rows 0-20) stay bit-identical from the
    resume on, in the model and in its EMA, and the new rows train. Integration off: the
    model's rows are kept, the EMA's drift toward them. F5's layout off: nothing is
    frozen, and it is said."""
    from patches import vocab_rows
    from patches.integrations import layouts

    if mode == "layout_off":
        monkeypatch.setattr(vocab_rows, "_finders", [f for f in vocab_rows._finders
                                                     if f is not layouts.f5_vocab_modules])
    patches.advanced.apply(["nan_guard", "vocab_freeze", "checkpoint"],
                           disable=["f5_tts"] if mode == "integration_off" else [])
    _train(tmp_path / "ckpts", Clips())
    saved = torch.load(tmp_path / "ckpts" / "model_last.pt", weights_only=True)
    key = "transformer.text_embed.text_embed.weight"
    model_rows = saved["model_state_dict"][key]
    ema_rows = saved["ema_model_state_dict"]["ema_model." + key]
    assert not torch.equal(model_rows[:21], ema_rows[:21])  # the EMA lags the model

    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", "20")
    patches.advanced.apply(["nan_guard", "vocab_freeze", "checkpoint"],
                           disable=["f5_tts"] if mode == "integration_off" else [])
    model = _model()
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        trainer = _train(tmp_path / "ckpts", Clips(), model, epochs=2)
    after, ema_after = _embed(model), _embed(trainer.ema_model.ema_model)
    if mode == "layout_off":
        assert not torch.equal(after[:21], model_rows[:21])
        assert "NOTHING IS FROZEN" in caplog.text
        status = patches.status("vocab_freeze")
        assert status["state"] == "degraded" and "NOTHING IS FROZEN" in status["problems"][-1]
        return
    assert torch.equal(after[:21], model_rows[:21])
    assert not torch.equal(after[21:], model_rows[21:])  # the new rows trained
    assert not torch.equal(ema_after[21:], ema_rows[21:])
    assert "NOTHING IS FROZEN" not in caplog.text
    if mode == "integration_off":
        assert not torch.equal(ema_after[:21], ema_rows[:21])  # the EMA's base rows drift
        return
    assert torch.equal(ema_after[:21], ema_rows[:21])
    assert patches.status("vocab_freeze")["detail"] == \
        "frozen 21 rows of 27 in transformer.text_embed.text_embed.weight"


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "integration_off"])
def test_a_failed_save_leaves_the_last_checkpoint_whole(trainer_env, tmp_path, monkeypatch,
                                                        applied: bool) -> None:
    """A save that fails half-way (here: an object that cannot be pickled, as a full disk
    or a kill would) leaves the previous model_last.pt readable, so the next start resumes
    from it; upstream writes in place and leaves a torn file that the next start picks."""
    patches.advanced.apply(["checkpoint"], disable=[] if applied else ["f5_tts"])
    trainer = _train(tmp_path / "ckpts", Clips())
    last = tmp_path / "ckpts" / "model_last.pt"
    saved = torch.load(last, weights_only=True)
    real = trainer.ema_model.state_dict
    monkeypatch.setattr(trainer.ema_model, "state_dict",
                        lambda: {**real(), "zz_unpicklable": (lambda: None)})
    with pytest.raises(Exception):
        trainer.save_checkpoint(99, last=True)
    if not applied:
        with pytest.raises(Exception):
            torch.load(last, weights_only=True)
        return
    again = torch.load(last, weights_only=True)
    assert again["update"] == saved["update"] == BATCHES
    # no temporary file left: the checkpoint only (the run's lock and start/end records are
    # beside the folder)
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["model_last.pt"]


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "integration_off"])
def test_resume_into_a_grown_vocabulary(trainer_env, tmp_path, applied: bool,
                                        monkeypatch) -> None:
    """F5 saved model_last.pt with 26 tokens; the tokenizer grew to 30 and the model was
    built with it. Patched: the resume loads the model and the EMA, every trained row
    kept, the new rows trained from the library's start, Adam's moments grown, F5's
    update count resumed; the base rows (BASE_VOCAB=26: rows 0-26) stay bit-identical in
    both through the next epoch. Integration off: upstream's size mismatch."""
    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", str(TOKENS))
    patches.advanced.apply(["nan_guard", "checkpoint", "vocab_freeze"],
                           disable=[] if applied else ["f5_tts"])
    first = _train(tmp_path / "ckpts", Clips())
    saved = torch.load(tmp_path / "ckpts" / "model_last.pt", weights_only=True)
    key = "transformer.text_embed.text_embed.weight"
    old_model, old_ema = saved["model_state_dict"][key], saved["ema_model_state_dict"][
        "ema_model." + key]
    assert old_model.shape[0] == TOKENS + 1
    del first
    grown = _model(TOKENS + 4)
    trainer = _trainer(grown, tmp_path / "ckpts", epochs=1)
    if not applied:
        with pytest.raises(RuntimeError, match="size mismatch"):
            trainer.train(Clips(high=TOKENS + 4), num_workers=1)
        return
    trainer.train(Clips(high=TOKENS + 4), num_workers=1)
    after, ema_after = _embed(grown), _embed(trainer.ema_model.ema_model)
    assert after.shape[0] == TOKENS + 5
    assert torch.equal(after[:TOKENS + 1], old_model)
    assert torch.equal(ema_after[:TOKENS + 1], old_ema)
    assert bool(torch.isfinite(after).all()) and bool(torch.isfinite(ema_after).all())
    resumed = torch.load(tmp_path / "ckpts" / "model_last.pt", weights_only=True)
    assert resumed["update"] == 2 * BATCHES  # F5's count went on from 8
    moments = resumed["optimizer_state_dict"]["state"]
    assert {tuple(s["exp_avg"].shape) for s in moments.values() if s["exp_avg"].dim() == 2
            and s["exp_avg"].shape[1] == 16 and s["exp_avg"].shape[0] > 16} == {(TOKENS + 5, 16)}


def test_a_checkpoint_the_library_cannot_read_cheaply_is_upstreams_to_load(trainer_env,
                                                                          tmp_path) -> None:
    """A model_last.pt in torch's old (non-zip) format cannot be memory-mapped to read its
    shapes: the resume is F5's own load, as without the patches (it raised before)."""
    patches.advanced.apply(["nan_guard", "checkpoint"])
    _train(tmp_path / "ckpts", Clips())
    last = tmp_path / "ckpts" / "model_last.pt"
    torch.save(torch.load(last, weights_only=True), last, _use_new_zipfile_serialization=False)
    _train(tmp_path / "ckpts", Clips())  # resumed from update 8
    assert torch.load(tmp_path / "ckpts" / "model_last.pt", weights_only=True)["update"] == \
        2 * BATCHES


# -- what a grown resume says; one run per folder (issue 38, item 5) --------------------------

AMHARIC = ["ሰ", "ላ", "ም", "ሀ"]  # 4 new tokens: se, la, m, he (letters of the base vocabulary)


def _amharic_model() -> torch.nn.Module:
    """The tiny model with the base vocabulary and the 4 Amharic characters after it, its
    vocab_char_map as F5 reads it from a vocab.txt of those lines."""
    torch.manual_seed(0)
    chars = list((CHARS + "0123456789")[:TOKENS]) + AMHARIC
    dit = _f5().DiT(dim=32, depth=1, heads=2, dim_head=16, ff_mult=2, mel_dim=MELS,
                    text_num_embeds=len(chars), text_dim=16, conv_layers=0, dropout=0.0)
    return _poisonable()(transformer=dit, mel_spec_kwargs=dict(n_mel_channels=MELS),
                         vocab_char_map={c: i for i, c in enumerate(chars)})


def test_a_grown_resume_says_what_f5_restores_and_spells_with_its_vocabulary(
        trainer_env, tmp_path, caplog) -> None:
    """A resume into a vocabulary grown by 4 Amharic characters: the load line names what
    F5's Trainer restores itself (its optimizer and scheduler states, update 8), never
    ``optimizer absent`` or ``resuming at 0``; the new rows of the model and of the EMA are
    spelled with the model's vocab_char_map (each from the rows of its latin spelling)."""
    patches.advanced.apply(["nan_guard", "checkpoint"])
    _train(tmp_path / "ckpts", Clips())
    trainer = _trainer(_amharic_model(), tmp_path / "ckpts", epochs=1)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        trainer.train(Clips(), num_workers=1)
    (line,) = [r.getMessage() for r in caplog.records if "model_last.pt (policy" in
               r.getMessage()]
    said = "by F5's Trainer from the checkpoint's"
    assert f"optimizer restored ({said} 'optimizer_state_dict', then its moments of the " \
           "grown rows grown by training-patches)" in line, line
    assert f"scheduler restored ({said} 'scheduler_state_dict')" in line, line
    assert f"step {BATCHES} restored ({said} 'update')" in line, line
    assert "optimizer absent" not in line and "resuming at 0" not in line, line
    assert "(4 from their spelling)" in line, line
    assert f"new tokens spelled with the model's vocab_char_map ({TOKENS + 4} entries)" in line


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "integration_off"])
def test_a_second_run_into_a_checkpoint_path_in_use_is_refused(trainer_env, tmp_path,
                                                               applied) -> None:
    """Another process trains in ``checkpoint_path``: this run is refused in one paragraph
    naming it, before any model_last.pt is written (upstream trains on and the two
    overwrite each other's checkpoints, exit 0: the control)."""
    import os
    import subprocess
    import sys

    from processes import child_path

    patches.advanced.apply(["nan_guard", "checkpoint"], disable=[] if applied else ["f5_tts"])
    folder = tmp_path / "ckpts"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from patches import _runlock; "
         "_runlock.lock_folder(sys.argv[1], beside=True); print('held', flush=True); "
         "sys.stdin.read()",
         str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=child_path(Path(__file__).parents[1])))
    try:
        assert holder.stdout.readline().strip() == "held"
        if not applied:
            _train(folder, Clips())
            assert (folder / "model_last.pt").is_file()
            return
        with pytest.raises(patches.RunFolderInUse) as refused:
            _train(folder, Clips())
        assert f"F5's Trainer's output folder {folder} is in use by process {holder.pid}" in \
            str(refused.value) and "model_last.pt" in str(refused.value)
        assert not (folder / "model_last.pt").exists()
    finally:
        holder.communicate("", timeout=30)
    _train(folder, Clips())
    side = patches._runlock.side_folder(folder)
    runs = [json.loads(line) for line in (side / "trainer_runs.jsonl").open()]
    assert [(r["event"], r["step"]) for r in runs] == [("start", 0), ("finished", BATCHES)]
