"""Lightning (2.6) automatic optimization: ``optimizer.step(closure)``, with forward,
backward and clipping inside the closure. One NaN loss at step 3: the guard skips that
step on its own gradients, in fp32 and bf16-mixed: every parameter ends equal to the run
that never had that batch (unpatched, every parameter ends NaN)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch

import patches
from patches import nan_guard

lightning = pytest.importorskip("lightning")

pytestmark = pytest.mark.slow  # a real Trainer: a few seconds each

BAD_STEP = 3  # the guard's 1-based count; Lightning's global_step is 2 there


class Tiny(lightning.LightningModule):
    """Batch BAD_STEP - 1 (of 8 batches of 8) has a NaN loss; ``leave_out``: that batch is
    not in the data at all (the run a skipped step must equal)."""

    def __init__(self, leave_out: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.leave_out = leave_out
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == BAD_STEP - 1 and not self.leave_out:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        if self.leave_out:
            keep = [i for i in range(64) if i // 8 != BAD_STEP - 1]
            x, y = x[keep], y[keep]
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(tmp_path: Path, precision: str, leave_out: bool = False) -> Tiny:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    model = Tiny(leave_out)
    trainer = lightning.Trainer(max_steps=7 if leave_out else 8, accelerator="cpu", devices=1,
                                precision=precision,
                                logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                gradient_clip_val=1.0, default_root_dir=str(tmp_path))
    trainer.fit(model)
    return model


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_nan_step_is_skipped_on_its_own_gradients(tmp_path,
                                                             precision: str) -> None:
    nan_guard.reset()
    patches.advanced.apply(["nan_guard", "grad_clip"], output_dir=str(tmp_path / "evidence"))
    model = _fit(tmp_path, precision)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    stats = patches.stats()["nan_guard"]
    assert stats["steps"] == 8 and stats["skipped"] == 1, stats
    events = [json.loads(line) for line in
              (tmp_path / "evidence" / "nonfinite_events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"], e["loss"]) for e in events] == \
        [(BAD_STEP, "nonfinite_loss", "NaN")], events
    assert events[0]["nonfinite_grads"] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    # exact: every parameter as in the run that never had that batch
    nan_guard.reset()
    clean = _fit(tmp_path / "clean", precision, leave_out=True)
    assert nan_guard.stats()["skipped"] == 0
    got, want = model.state_dict(), clean.state_dict()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []


def test_lightning_unpatched_nan_step_ruins_every_parameter(tmp_path) -> None:
    """The control: the same run without the guard."""
    model = _fit(tmp_path, "32-true")
    assert not any(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_lightning_records_go_to_the_trainers_folder_with_its_step(tmp_path,
                                                                    monkeypatch) -> None:
    """With no output folder set, the records go where the Trainer writes (its log_dir:
    default_root_dir without a logger), and each carries the Trainer's global_step."""
    from patches import _run

    monkeypatch.delenv("TRAINING_PATCHES_OUTPUT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # ./training_patches would land here: it must stay absent
    patches.advanced.reset_runtime_state()
    nan_guard.reset()
    patches.advanced.apply(["nan_guard", "grad_clip"])
    assert patches.status("lightning")["state"] in ("applied", "waiting")
    try:
        _fit(tmp_path / "root", "32-true")
    finally:
        patches.advanced.reset_runtime_state()
    events = [json.loads(line) for line in
              (tmp_path / "root" / "nonfinite_events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["trainer_step"]) for e in events] == [(BAD_STEP, BAD_STEP - 1)]
    assert not (tmp_path / "training_patches").exists()


class TinyFused(Tiny):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def test_lightning_fused_skip_is_on_disk_at_the_next_checkpoint(tmp_path) -> None:
    """Fused AdamW: the guard reads its skip flags in batches, not per step. Lightning's
    save_checkpoint reads them first, so the skip of step 3 is on disk when the checkpoint of
    step 4 is written, not only at the end of the run (step 8)."""
    nan_guard.reset()
    patches.advanced.apply(["nan_guard", "grad_clip"], output_dir=str(tmp_path / "evidence"))
    logging.getLogger("lightning").setLevel(logging.ERROR)
    every4 = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"),
                                                         every_n_train_steps=4, save_top_k=-1)
    trainer = lightning.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False,
                                callbacks=[every4], enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    model = TinyFused()
    trainer.fit(model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    (event,) = [json.loads(line) for line in
                (tmp_path / "evidence" / "nonfinite_events.jsonl").read_text().splitlines()]
    assert (event["step"], event["kind"]) == (BAD_STEP, "nonfinite_loss")
    assert event["read_at_step"] == 4, event


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_a_checkpoint_that_does_not_fit_leaves_the_last_one_whole(tmp_path,
                                                                  applied) -> None:
    """The checkpoint folder on its own small disk (a tmpfs: not the system temp folder's
    disk). Lightning's TorchCheckpointIO saves last.ckpt, then a second save does not fit.
    Upstream moves its temporary file from /tmp by copying it over last.ckpt: the copy stops
    at the full disk and the good checkpoint is torn (the control). Patched, the free space
    is checked first and the old file is left whole."""
    from io_faults import full_disk
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    if applied:
        patches.advanced.apply(["checkpoint"])
    # 4 MB, then 8 MB, on a disk with 6 MB free: the second does not fit even in the place
    # of the first
    first = {"state_dict": {"w": torch.arange(1 << 20, dtype=torch.float32)}, "step": 1}
    second = {"state_dict": {"w": torch.ones(2 << 20)}, "step": 2}
    with full_disk(tmp_path / "ckpts", size="16m", free=6_000_000) as folder:
        io = TorchCheckpointIO()
        io.save_checkpoint(first, folder / "last.ckpt")
        with pytest.raises(Exception):
            io.save_checkpoint(second, folder / "last.ckpt")
        if applied:
            kept = torch.load(folder / "last.ckpt", weights_only=True)
            assert kept["step"] == 1 and torch.equal(kept["state_dict"]["w"],
                                                     first["state_dict"]["w"])
            assert sorted(p.name for p in folder.iterdir()) == ["filler", "last.ckpt"]
        else:
            with pytest.raises(Exception):
                torch.load(folder / "last.ckpt", weights_only=True)


class TinyText(lightning.LightningModule):
    """A text model (``text_embedding`` -> ``text_head``) over ``vocab`` tokens, next-token
    loss on fixed random sequences of its tokens."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        from tiny_models import TinyTextModel

        torch.manual_seed(0)
        self.vocab = vocab
        self.model = TinyTextModel(vocab, 8, "tanh")

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randint(0, self.vocab, (64, 12),
                                                                 generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_fit_from_a_checkpoint_into_a_grown_vocabulary(tmp_path,
                                                       applied) -> None:
    """The vocabulary grew from 20 to 24 tokens after a 4-step checkpoint: ``fit(ckpt_path=)``
    continues to step 8 from the saved rows and the saved Adam moments (the new rows'
    moments grown: first 0, second the old rows' mean), the trained rows frozen. Upstream
    stops at a size mismatch (the control)."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    if applied:
        patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])

    def trainer(steps: int, callbacks=()) -> lightning.Trainer:
        return lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, default_root_dir=str(tmp_path),
                                 callbacks=list(callbacks))

    first = trainer(4)
    first.fit(TinyText(20))
    path = tmp_path / "step4.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    trained = saved["state_dict"]["model.text_embedding.weight"]
    moments = saved["optimizer_states"][0]["state"][0]  # the embedding: the first parameter
    seen: dict = {}

    class Look(lightning.Callback):
        def on_train_start(self, trainer, module) -> None:
            emb = module.model.text_embedding.weight
            state = trainer.optimizers[0].state[emb]
            seen.update(weight=emb.detach().clone(), step=trainer.global_step,
                        state={k: v.clone() for k, v in state.items()})

    module = TinyText(24)
    second = trainer(8, [Look()])
    if not applied:
        with pytest.raises(RuntimeError, match="size mismatch for model.text_embedding.weight"):
            second.fit(module, ckpt_path=str(path))
        return
    second.fit(module, ckpt_path=str(path))
    assert second.global_step == 8 and seen["step"] == 4
    assert torch.equal(seen["weight"][:20], trained)
    state = seen["state"]
    assert state["exp_avg"].shape == (24, 8)
    assert torch.equal(state["exp_avg"][:20], moments["exp_avg"])
    assert torch.equal(state["exp_avg_sq"][:20], moments["exp_avg_sq"])
    assert not state["exp_avg"][20:].any()
    mean = moments["exp_avg_sq"].double().mean(0).float()
    assert torch.allclose(state["exp_avg_sq"][20:], mean.expand(4, -1))
    emb = module.model.text_embedding.weight
    assert torch.equal(emb[:20], trained)  # frozen after the growth, through 4 more steps
    assert not torch.equal(emb[20:], seen["weight"][20:])  # the new rows trained


class GrowingBuffer(TinyText):
    """A module whose buffer grows while it trains (one entry a step) and whose own
    ``load_state_dict`` takes the saved size: a shape change that is not the vocabulary's."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.register_buffer("seen", torch.empty(0))

    def training_step(self, batch, batch_idx):
        self.seen = torch.cat([self.seen, torch.ones(1)])
        return super().training_step(batch, batch_idx)

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        self.seen = state_dict["seen"].clone()
        return super().load_state_dict(state_dict, strict=strict, **kwargs)


def test_a_shape_change_that_is_not_the_vocabulary_is_left_to_the_model(
        tmp_path) -> None:
    """Only a vocabulary's rows are adapted: a grown buffer that the module's own
    load_state_dict reads back resumes exactly as upstream resumes it (the patched loader,
    taking any shape change for a grown vocabulary, refused the checkpoint)."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])

    def trainer(steps: int) -> lightning.Trainer:
        return lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, default_root_dir=str(tmp_path))

    first = trainer(2)
    first.fit(GrowingBuffer(20))
    path = tmp_path / "step2.ckpt"
    first.save_checkpoint(path)
    module = GrowingBuffer(20)
    trainer(4).fit(module, ckpt_path=str(path))
    assert module.seen.shape == (4,)  # 2 saved, 2 more steps


def test_a_patched_trainer_can_be_pickled_as_ddp_spawn_does(tmp_path) -> None:
    """``strategy="ddp_spawn"`` pickles the Trainer with its callbacks; the integration's
    callback was a class local to a function and made every ddp_spawn fit fail (found by
    Lightning's test_model_torch_save_ddp_cpu with the patches on)."""
    import pickle

    patches.advanced.apply(["nan_guard", "grad_clip"], output_dir=str(tmp_path / "evidence"))
    trainer = lightning.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny())
    ours = [c for c in trainer.callbacks if type(c).__module__.startswith("patches.")]
    assert len(ours) == 1
    again = pickle.loads(pickle.dumps(ours[0]))
    assert type(again) is type(ours[0])


# -- what a grown resume says; one run per folder; a stopped run named (issue 38, item 5) ----

BASE_CHARS = "abcdefghijklmnopqrs"  # 19 characters and [UNK]: TinyText(20)'s tokens
AMHARIC = ["ሰ", "ላ", "ም", "ሀ"]  # the 4 new tokens: se, la, m, he, spelled from BASE_CHARS


def _char_tokenizer(extra: list[str] = ()) -> Any:
    """A ``tokenizers`` tokenizer of BASE_CHARS and [UNK] (a BPE without merges: one id per
    character), with ``extra`` added tokens after them."""
    from tokenizers import Tokenizer, models

    vocab = {c: i for i, c in enumerate(BASE_CHARS)}
    vocab["[UNK]"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tokenizer.add_tokens(list(extra))
    return tokenizer


def _quiet_trainer(tmp_path: Path, steps: int, **kwargs: Any) -> lightning.Trainer:
    return lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path), **kwargs)


def test_a_grown_fit_says_what_lightning_restores_and_spells_with_the_modules_tokenizer(
        tmp_path, caplog) -> None:
    """``fit(ckpt_path=)`` into a grown vocabulary: the load line names what Lightning
    restores itself (its optimizer states, the step), and the new rows are spelled with the
    LightningModule's ``tokenizer`` (each Amharic token from the rows of its latin
    spelling), the line saying where that tokenizer came from."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    first = _quiet_trainer(tmp_path, 4)
    first.fit(TinyText(20))
    path = tmp_path / "step4.ckpt"
    first.save_checkpoint(path)
    module = TinyText(24)
    module.tokenizer = _char_tokenizer(AMHARIC)
    with caplog.at_level(logging.INFO, logger="training_patches"):
        _quiet_trainer(tmp_path, 6).fit(module, ckpt_path=str(path))
    (line,) = [r.getMessage() for r in caplog.records
               if f"{path} (policy" in r.getMessage()]
    assert ("optimizer restored (by Lightning's Trainer from the checkpoint's "
            "'optimizer_states', then its moments of the grown rows grown") in line, line
    assert "step 4 restored (by Lightning's Trainer from the checkpoint's 'global_step')" \
        in line, line
    assert "optimizer absent" not in line and "resuming at 0" not in line, line
    assert "(4 from their spelling)" in line, line
    assert "new tokens spelled with the LightningModule TinyText's tokenizer" in line, line


def test_a_second_fit_into_a_log_dir_in_use_is_refused(tmp_path) -> None:
    """Another process trains in the Trainer's folder: ``fit`` is refused in one paragraph
    naming it, before anything is written; this process fitting there again is no other
    run, and each fit's start and end are in trainer_runs.jsonl."""
    import subprocess
    import sys

    logging.getLogger("lightning").setLevel(logging.ERROR)
    patches.advanced.apply(["nan_guard", "grad_clip", "checkpoint"])
    (tmp_path / "run").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from patches import _runlock; "
         "_runlock.lock_folder(sys.argv[1], beside=True); print('held', flush=True); "
         "sys.stdin.read()",
         str(tmp_path / "run")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=_child_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(patches.RunFolderInUse, match=f"in use by process {holder.pid}"):
            _quiet_trainer(tmp_path / "run", 2).fit(TinyText(20))
        assert not (side := patches._runlock.side_folder(tmp_path / "run")).exists() or \
            not (side / "trainer_runs.jsonl").exists()
    finally:
        holder.communicate("", timeout=30)
    _quiet_trainer(tmp_path / "run", 2).fit(TinyText(20))
    _quiet_trainer(tmp_path / "run", 2).fit(TinyText(20))
    runs = [json.loads(line) for line in (side / "trainer_runs.jsonl").open()]
    assert [(r["event"], r["step"]) for r in runs] == [("start", 0), ("finished", 2)] * 2
    # the lock and the records are beside the folder: it holds what Lightning wrote
    # (upstream's own tests list default_root_dir exactly)
    assert not [p.name for p in (tmp_path / "run").rglob("*")
                if "training-patches" in p.name or p.name == "trainer_runs.jsonl"]


def _child_env() -> dict[str, str]:
    """The environment of a process a test starts: this checkout's library first."""
    import os

    from processes import child_path

    return dict(os.environ, PYTHONPATH=child_path(Path(__file__).parents[1]))


STOPPED = '''
import logging, os, signal, sys
{auto}
sys.path.insert(0, {tests!r})
import lightning
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from test_lightning import TinyText

class Logged(TinyText):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

class Term(lightning.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler: stop after the batch

logging.getLogger("lightning").setLevel(logging.ERROR)
trainer = lightning.Trainer(
    max_steps=40, accelerator="cpu", devices=1, log_every_n_steps=1,
    logger=TensorBoardLogger({logs!r}, name="", version=0), enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[Term(), ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
trainer.fit(Logged(20))
'''


@pytest.mark.parametrize("applied", [True, False], ids=["patched", "upstream"])
def test_a_run_stopped_by_sigterm_is_named_interrupted_with_its_logged_loss(
        tmp_path, applied) -> None:
    """Lightning stopped by SIGTERM at step 5 (its own handler ends ``fit`` with
    SIGTERMException, a SystemExit: exit code 0): ``report`` names the run interrupted at
    step 5 with its newest checkpoint, exit 1, and reads the ``train_loss`` it logged to
    TensorBoard. (It said "healthy", "steps: at least 0", no loss logged.) Without the
    patches (the control) the losses are read, and nothing says the run was stopped."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(STOPPED.format(tests=str(Path(__file__).parent),
                                     logs=str(tmp_path / "logs"),
                                     auto="import patches.auto" if applied else ""))
    done = forkserver.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=_child_env())
    # SIGTERMException is a SystemExit(None): the stopped run exits 0, as a finished one
    assert done.returncode == 0 and "Received SIGTERM" in done.stderr, done.stderr[-3000:]
    report = forkserver.run([sys.executable, "-m", "patches", "report", str(tmp_path / "logs"),
                             "--no-picture"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env=_child_env())
    out = report.stdout
    assert "(5 logged, from TensorBoard)" in out or "(6 logged, from TensorBoard)" in out, out
    assert "steps: at least 6" in out or "steps: at least 5" in out, out
    if not applied:
        assert "interrupted" not in out, out
        return
    assert report.returncode == 1 and "verdict: interrupted" in out, out
    assert ("interrupted: stopped by SIGTERM at trainer step 5 and not continued since; its "
            "newest checkpoint is epoch=0-step=4.ckpt: continue it with trainer.fit(model, "
            "ckpt_path=<that checkpoint>) (trainer_runs.jsonl)") in out, out
