"""A part is ``restored`` only when it is the same thing (issue "Nothing lost silently, every
message true", item 2).

- The data position records what identifies the data (the number of samples, the batch
  size, ``drop_last``, the sampler, whether it shuffles, a dataset's own fingerprint, the
  fingerprint of the sample order up to the position) and refuses a loader whose data
  differs even when its number of batches is the same; an order that differs only at the
  replay starts the epoch over, in a WARNING and in the report.
- An epoch-boundary save resumes at the next epoch in the user guide's own loop, run here as
  it is written; a save after the epoch's loop ended is an ended epoch too.
- The EMA: each documented form (ema_pytorch's ``EMA``, torch's ``AveragedModel``, the
  averaged copy) loads a file saved from any other, ``strict=False`` included, never as
  ``restored (0 tensors)``; an EMA built before the model was resized is refused (its copy
  would stay at the old size); forgetting ``ema=`` is a WARNING.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from tiny_models import TinyTextModel
from test_data_position import checkpoint_patch  # noqa: F401 (the fixture)

from patches.checkpoint import CheckpointManager, CheckpointMismatchError, load_checkpoint

LOGGER = "training_patches"
ROOT = Path(__file__).resolve().parents[1]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == LOGGER]


class Clips(torch.utils.data.Dataset):
    """``n`` samples; sample i is i. ``fingerprint``: the dataset's own (as a Hugging Face
    dataset has one)."""

    def __init__(self, n: int = 64, fingerprint: str | None = None) -> None:
        self.n = n
        if fingerprint is not None:
            self._fingerprint = fingerprint

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _loader(n: int = 64, batch_size: int = 16, shuffle: bool = True, **kwargs):
    return torch.utils.data.DataLoader(Clips(n, kwargs.pop("fingerprint", None)),
                                       batch_size=batch_size, shuffle=shuffle, **kwargs)


def _save_at(folder: Path, loader, epoch: int, batch: int) -> Path:
    """Iterate ``loader`` to ``batch`` batches into ``epoch`` and save there."""
    for _ in range(epoch):
        for _ in loader:
            pass
    iterator = iter(loader)
    for _ in range(batch):
        next(iterator)
    return CheckpointManager(folder).save(10, torch.nn.Linear(1, 1), loader=loader, epoch=epoch)


# ----------------------------------------------------------------- the data position


OTHER_DATA = {
    # 62 samples in batches of 16: 4 batches, as 64 were (14 samples trained twice, 16 never)
    "two clips removed": (dict(n=62), "samples 64 saved; loader= has 62"),
    "batch size 17": (dict(batch_size=17), "batch size 16 saved; loader= has 17"),
    "shuffle off": (dict(shuffle=False), "shuffle True saved; loader= has False"),
    "another dataset": (dict(fingerprint="b"), "dataset fingerprint 'a' saved; loader= has 'b'"),
}


@pytest.mark.parametrize("case", list(OTHER_DATA))
def test_a_loader_over_other_data_is_refused_though_its_batches_are_as_many(
        tmp_path, checkpoint_patch, case):
    """Saved at epoch 1, batch 2 of 4 over 64 samples in batches of 16, shuffled. Each
    loader below also has 4 batches an epoch: the load used to say ``restored (epoch 1
    continues at batch 2 of 4)`` and skip 2 batches of other samples."""
    changes, found = OTHER_DATA[case]
    torch.manual_seed(0)
    saved_with = dict(fingerprint="a") if case == "another dataset" else {}
    path = _save_at(tmp_path / "run", _loader(**saved_with), epoch=1, batch=2)
    loader = _loader(**{**saved_with, **changes})
    assert len(loader) == 4
    model = torch.nn.Linear(1, 1)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, model, loader=loader)
    message = str(info.value)
    assert found in message and str(path) in message and "\n" not in message, message
    assert "Nothing was loaded" in message and "load without loader=" in message
    assert torch.equal(model.weight, before)
    same = load_checkpoint(path, torch.nn.Linear(1, 1), loader=_loader(**saved_with))
    assert str(same.parts["data"]) == "restored (epoch 1 continues at batch 2 of 4)"


def _seeded(seed: int):
    data = Clips(64)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True,
                                                  seed=seed)
    return torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler)


def test_an_order_that_differs_at_the_replay_starts_the_epoch_over_and_says_so(
        tmp_path, checkpoint_patch, caplog):
    """The same samples, batch size and sampler class, another seed: nothing the load can
    compare before the replay differs, but the samples the replay would skip are not the ones
    the saved run trained on (their order's fingerprint). The epoch starts from its
    beginning, one WARNING says why, and the report's data part says ``reset``."""
    path = _save_at(tmp_path / "run", _seeded(0), epoch=0, batch=2)
    loader = _seeded(1)
    report = load_checkpoint(path, torch.nn.Linear(1, 1), loader=loader)
    assert report.parts["data"].status == "restored"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        batches = [batch.tolist() for batch in loader]
    assert batches == [batch.tolist() for batch in _seeded(1)]  # the whole epoch, its order
    (said,) = _warnings(caplog)
    assert "does not continue epoch 0 at batch 2" in said and "fingerprint" in said
    assert report.parts["data"].status == "reset"
    assert "were not the saved run's" in report.parts["data"].detail
    # the same seed: the replay's fingerprint matches and the epoch continues
    again = _seeded(0)
    report = load_checkpoint(path, torch.nn.Linear(1, 1), loader=again)
    assert len(list(again)) == 2 and report.parts["data"].status == "restored"


def _readme_loop() -> str:
    """The ``In your own loop`` block of the user guide, as it is written."""
    text = (ROOT / "TRAINING_PATCHES_README.md").read_text(encoding="utf-8")
    section = text[text.index("### In your own loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class Stop(Exception):
    """The run stops here (a kill after the save)."""


def _run_readme_loop(folder: Path, monkeypatch, stop_after: int | None) -> list[list[int]]:
    """The guide's loop over 2 epochs of 4 batches (16 samples, batch 4, shuffled), in
    ``folder``; stopped right after the save of step ``stop_after``. Returns the batches
    it trained on."""
    monkeypatch.chdir(folder)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained: list[list[int]] = []

    def train_step(batch):
        loss = model(batch.float()[:, None]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        trained.append(batch.tolist())

    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    real = CheckpointManager.save

    def save(self, step, *args, **kwargs):
        path = real(self, step, *args, **kwargs)
        if step == stop_after:
            raise Stop
        return path

    monkeypatch.setattr(CheckpointManager, "save", save)
    namespace = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
                     train_loader=_loader(16, 4), epochs=2, train_step=train_step)
    try:
        exec(compile(_readme_loop(), "TRAINING_PATCHES_README.md", "exec"), namespace)
    except Stop:
        pass
    finally:
        monkeypatch.setattr(CheckpointManager, "save", real)
    return trained


def test_the_guides_loop_resumed_after_a_save_at_an_epochs_end_trains_the_next_epoch(
        tmp_path, checkpoint_patch, monkeypatch):
    """The user guide's loop, run as written: stopped after the save at epoch 0's last batch
    (step 4), then started again. The resume says ``epoch 0 was complete`` and the loop
    trains epoch 1 only: 8 steps in all, the batches of the run never stopped (it used to
    read the saved epoch and train epoch 0 again: 12 steps)."""
    (tmp_path / "full").mkdir()
    (tmp_path / "run").mkdir()
    full = _run_readme_loop(tmp_path / "full", monkeypatch, stop_after=None)
    assert len(full) == 8
    first = _run_readme_loop(tmp_path / "run", monkeypatch, stop_after=4)
    rest = _run_readme_loop(tmp_path / "run", monkeypatch, stop_after=None)
    assert len(first) + len(rest) == 8
    assert first + rest == full
    # the loader counted the resumed epoch as epoch 1: its last save says so
    last = CheckpointManager(tmp_path / "run" / "runs" / "am").resume("auto")
    position = torch.load(last, weights_only=True)["data_ranks"][0]
    assert (position["epoch"], position["batches"]) == (1, 4)


def test_a_save_after_the_epochs_loop_ended_is_an_ended_epoch(tmp_path, checkpoint_patch):
    """Saved once the ``for batch in loader`` loop is over (its iterator gone): the epoch
    handed out all its batches. It used to be saved as batch 0, and the resume trained the
    whole epoch again."""
    torch.manual_seed(0)
    loader = _loader(16, 4)
    for _ in loader:
        pass
    path = CheckpointManager(tmp_path / "run").save(4, torch.nn.Linear(1, 1), loader=loader,
                                                    epoch=0)
    report = load_checkpoint(path, torch.nn.Linear(1, 1), loader=_loader(16, 4))
    assert str(report.parts["data"]) == ("restored (epoch 0 was complete: the next one starts "
                                         "at its beginning)")
    assert report.resume_epoch == 1 and report.epoch == 0


# ----------------------------------------------------------------- the EMA

OLD, NEW = 20, 24


def _make(form: str, model: torch.nn.Module):
    """(the object passed as ema=, the averaged copy inside it) for each documented form."""
    if form in ("EMA", "EMA.ema_model"):
        ema_pytorch = pytest.importorskip("ema_pytorch")
        ema = ema_pytorch.EMA(model, beta=0.5, update_after_step=0, update_every=1)
        return (ema if form == "EMA" else ema.ema_model), ema.ema_model
    averaged = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    return (averaged if form == "AveragedModel" else averaged.module), averaged.module


def _averaged_once(form: str, model: torch.nn.Module):
    """An EMA of ``form`` that has averaged the model twice, the model trained between."""
    outer, copy = _make(form.split(".")[0], model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        if hasattr(outer, "update_parameters"):
            outer.update_parameters(model)
        else:
            outer.update()
        model(torch.arange(OLD)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    passed = copy if "." in form else outer
    return passed, copy


FORMS = ["EMA", "AveragedModel", "EMA.ema_model", "AveragedModel.module"]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "strict_False"])
@pytest.mark.parametrize("saved_as", ["EMA", "AveragedModel", "EMA.ema_model"])
@pytest.mark.parametrize("loaded_as", FORMS)
def test_each_ema_form_loads_a_file_saved_from_any_other(tmp_path, saved_as, loaded_as, strict):
    """The averaged weights land in the averaged copy whatever form saved and loaded them:
    ``restored (N tensor(s))`` with N the copy's tensors, never 0; the documented
    ``ema=ema.ema_model`` is not refused, nor blamed on the model."""
    torch.manual_seed(0)
    trained = TinyTextModel(OLD, 8, "tanh")
    passed, copy = _averaged_once(saved_as, trained)
    path = CheckpointManager(tmp_path / "run").save(3, trained, ema=passed)
    want = {k: v.clone() for k, v in copy.state_dict().items()}
    model = TinyTextModel(OLD, 8, "tanh")
    target, inner = _make(loaded_as.split(".")[0], model)
    target = inner if "." in loaded_as else target
    report = load_checkpoint(path, model, ema=target, strict=strict)
    part = report.parts["ema"]
    assert str(part).startswith(f"restored ({len(want)} tensor(s)"), str(part)
    assert all(torch.equal(inner.state_dict()[k], v) for k, v in want.items())


def test_an_ema_pytorch_loaded_from_another_form_averages_at_its_next_update(tmp_path):
    """A file saved from an AveragedModel holds no ``initted``: a fresh ema_pytorch EMA
    would copy the model over the loaded average at its first update(). The load sets it,
    and says so."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    torch.manual_seed(0)
    trained = TinyTextModel(OLD, 8, "tanh")
    passed, copy = _averaged_once("AveragedModel", trained)
    path = CheckpointManager(tmp_path / "run").save(3, trained, ema=passed)
    model = TinyTextModel(OLD, 8, "tanh")
    ema = ema_pytorch.EMA(model, beta=0.5, update_after_step=0, update_every=1)
    report = load_checkpoint(path, model, ema=ema)
    assert "initted set" in report.parts["ema"].detail
    loaded = ema.ema_model.text_embedding.weight.detach().clone()
    ema.update()
    now = ema.ema_model.text_embedding.weight.detach()
    assert torch.allclose(now, 0.5 * loaded + 0.5 * model.text_embedding.weight.detach())


@pytest.mark.parametrize("form", ["EMA", "AveragedModel"])
def test_an_ema_built_before_the_model_was_resized_is_refused(tmp_path, form):
    """The model grew from 20 to 24 tokens after its EMA was made: the EMA's copy still has
    20 rows. The load used to grow (or restore) what it planned and say ``remapped ...
    grown`` (ema_pytorch: its online model grew) while the copy stayed at 20 rows, and the
    first update crashed. Now it is refused, nothing changed, with what to do."""
    torch.manual_seed(0)
    trained = TinyTextModel(OLD, 8, "tanh")
    passed, _ = _averaged_once(form, trained)
    path = CheckpointManager(tmp_path / "run").save(3, trained, ema=passed)
    model = TinyTextModel(OLD, 8, "tanh")
    ema, _ = _make(form, model)
    model.text_embedding = torch.nn.Embedding(NEW, 8)  # the resize, after the EMA was made
    model.text_head = torch.nn.Linear(8, NEW)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, model, ema=ema, row_init="spread")
    message = str(info.value)
    assert "built before the model was resized" in message and "Nothing was loaded" in message
    assert "text_embedding.weight: EMA [20, 8], model [24, 8]" in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # built after the resize, the same file loads and the EMA's rows grow with the model's
    ema, copy = _make(form, model)
    report = load_checkpoint(path, model, ema=ema, row_init="spread")
    assert report.parts["ema"].status == "remapped"
    assert copy.text_embedding.weight.shape[0] == NEW


def test_a_resume_that_forgets_the_ema_is_a_warning(tmp_path, caplog, monkeypatch):
    """The file holds EMA weights and no ``ema=`` was passed: a WARNING (shown under
    TRAINING_PATCHES_QUIET=1 too), not an INFO line."""
    torch.manual_seed(0)
    trained = TinyTextModel(OLD, 8, "tanh")
    passed, _ = _averaged_once("AveragedModel", trained)
    path = CheckpointManager(tmp_path / "run").save(3, trained, ema=passed)
    monkeypatch.setenv("TRAINING_PATCHES_QUIET", "1")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        report = load_checkpoint(path, TinyTextModel(OLD, 8, "tanh"))
    assert str(report.parts["ema"]) == "dropped (no ema passed)"
    (said,) = [m for m in _warnings(caplog) if "EMA" in m]
    assert str(path) in said and "Pass ema=" in said and "\n" not in said
