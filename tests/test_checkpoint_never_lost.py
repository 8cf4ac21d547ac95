"""A save is never the end of a run that upstream would finish (issue "Never the cause of a
lost run", item 1).

- The disk: an atomic save writes the new file beside the old one, where upstream writes
  over it in place. On a real small disk (a tmpfs, ``io_faults.full_disk``) with room for
  one checkpoint, F5-TTS's own Trainer trains every update as upstream does (the old
  ``model_last.pt`` kept whole, one WARNING a skipped save), Lightning keeps the five small
  checkpoints upstream keeps (the free space asked for is proportional to the file, not a
  1 MiB floor), and ``CheckpointManager`` goes on beside its last checkpoint (``keep=1``) or
  makes room by pruning first what the save would prune after (``keep=3``).
- What the user hands a save: accelerate's prepared loader (``accelerator.prepare``, how
  F5-TTS and accelerate loops hold theirs) is saved and resumed through the DataLoader it
  wraps; a loader or EMA whose state cannot be read is one WARNING and that part left out.

Upstream is the control wherever there is one: the patched run trains at least as many
steps.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from io_faults import full_disk, temporaries
from test_data_position import checkpoint_patch  # noqa: F401 (the fixture)

import patches
from patches.checkpoint import CheckpointManager, DiskFullError, load_checkpoint

LOGGER = "training_patches"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == LOGGER]


# ----------------------------------------------------------------- F5-TTS: room for one


def _f5_run(folder: Path) -> tuple[int, BaseException | None]:
    """F5's Trainer, 2 epochs of 8 updates, ``model_last.pt`` every 4 updates (no numbered
    checkpoints): (the updates Adam took, the error that ended train() or None)."""
    from test_f5_tts import BATCH, FRAMES, Clips, _f5, _model

    logging.getLogger("accelerate").setLevel(logging.ERROR)
    trainer = _f5().Trainer(_model(), epochs=2, learning_rate=1e-2, num_warmup_updates=100,
                            save_per_updates=4, last_per_updates=4, keep_last_n_checkpoints=0,
                            checkpoint_path=str(folder), batch_size_per_gpu=BATCH * FRAMES,
                            batch_size_type="frame", max_samples=BATCH, logger=None,
                            max_grad_norm=1.0,
                            ema_kwargs=dict(beta=0.5, update_after_step=0, update_every=1))
    failed = None
    try:
        trainer.train(Clips(), num_workers=1)
    except Exception as exc:  # noqa: BLE001 - what ended the run is the finding
        failed = exc
    states = trainer.optimizer.state_dict()["state"].values()
    return int(max((float(s["step"]) for s in states), default=0)), failed


F5_LAST = 574_118  # bytes of this tiny model's model_last.pt (measured; checked below)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("f5_tts") is None, reason="f5-tts not installed")
def test_f5_with_room_for_one_checkpoint_trains_every_update_as_upstream(trainer_env, tmp_path,
                                                                        caplog):
    """Room for one ``model_last.pt`` and half of another. Upstream writes over it in place
    and trains all 16 updates. Patched, the saves at updates 8, 12 and 16 do not fit beside
    it: each is one WARNING, the file of update 4 stays whole, and all 16 updates train (the
    save at 8 used to raise DiskFullError out of train())."""
    room = int(F5_LAST * 1.5)
    with full_disk(tmp_path / "upstream", size="2m", free=room) as folder:
        upstream, failed = _f5_run(folder)
        assert failed is None and upstream == 16
        last = torch.load(folder / "model_last.pt", weights_only=True)
        assert last["update"] == 16
        assert abs((folder / "model_last.pt").stat().st_size - F5_LAST) < 4096
    patches.advanced.apply(["checkpoint", "nan_guard"])
    with full_disk(tmp_path / "patched", size="2m", free=room) as folder:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            patched, failed = _f5_run(folder)
        assert failed is None, failed
        assert patched >= upstream
        kept = torch.load(folder / "model_last.pt", weights_only=True)  # whole, readable
        assert kept["update"] == 4
        assert temporaries(folder) == []
    said = [m for m in _warnings(caplog) if "model_last.pt was NOT written" in m]
    assert len(said) == 4, _warnings(caplog)  # updates 8, 12, 16 and the save at the end
    assert all("Training goes on; the next save tries again" in m and "\n" not in m
               for m in said)
    assert "needs about" in said[0] and "beside model_last.pt" in said[0]


# ----------------------------------------------------------------- Lightning: 12 KB files


def _lightning_run(root: Path, folder: Path) -> tuple[int, list[str], BaseException | None]:
    lightning = pytest.importorskip("lightning")
    from test_lightning import Tiny

    logging.getLogger("lightning").setLevel(logging.ERROR)
    every = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1,
                                                        save_top_k=-1)
    trainer = lightning.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False,
                                callbacks=[every], enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(root))
    failed = None
    try:
        trainer.fit(Tiny(leave_out=True))
    except Exception as exc:  # noqa: BLE001 - what ended the run is the finding
        failed = exc
    return trainer.global_step, sorted(p.name for p in folder.glob("*.ckpt")), failed


@pytest.mark.slow
def test_lightning_keeps_the_small_checkpoints_upstream_keeps(tmp_path):
    """200 KB free, five checkpoints of about 12 KB each. Upstream writes all five. Patched,
    each asked for the 1 MiB floor the free-space check used to add and the first save ended
    the run with no checkpoint; now the margin is 1/32 of the file, and the run keeps all
    five."""
    with full_disk(tmp_path / "upstream", size="1m", free=200_000) as folder:
        steps, upstream, failed = _lightning_run(tmp_path / "root-u", folder)
        assert failed is None and steps == 5 and len(upstream) == 5
        size = max((folder / name).stat().st_size for name in upstream)
        assert size < 32_000  # small files: the case of the floor
    patches.advanced.apply(["checkpoint"])
    with full_disk(tmp_path / "patched", size="1m", free=200_000) as folder:
        steps, kept, failed = _lightning_run(tmp_path / "root-p", folder)
        assert failed is None, failed
        assert steps == 5 and kept == upstream
        assert all(torch.load(folder / name, weights_only=True)["global_step"] >= 1
                   for name in kept)


# ----------------------------------------------------------------- CheckpointManager


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)  # 257 KB of weights: a checkpoint of about 260 KB


def test_a_manager_with_room_for_one_checkpoint_goes_on_beside_it(tmp_path, caplog):
    """keep=1 and room for one checkpoint and a half: the second save does not fit beside
    the first. It returns None after one WARNING (what was not written, the room it needs),
    the first stays whole and resumable, and once there is room the next save is written
    and the first pruned."""
    model = _model()
    with full_disk(tmp_path / "run", size="2m", free=400_000) as folder:
        manager = CheckpointManager(folder, keep=1)
        first = manager.save(1, model)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert manager.save(2, model) is None
        (said,) = _warnings(caplog)
        assert said.startswith("training-patches: ckpt_000000002.pt was NOT written: ")
        assert f"beside {first.name}, {first.name}.manifest.json" in said
        assert "needs about" in said and "free" in said and "\n" not in said
        assert manager.resume("auto") == first and manager.checkpoints() == [first]
        assert temporaries(folder) == []
        (folder / "filler").unlink()  # room again: the next save tries and is written
        third = manager.save(3, model)
        assert manager.checkpoints() == [third] and manager.resume("auto") == third


def test_a_manager_makes_room_by_pruning_first_what_it_prunes_after(tmp_path, caplog):
    """keep=3 and room for three checkpoints and a half: the fourth save removes the oldest
    first (keep=3 removes it after the write anyway), then writes; the newest is never
    removed before the new one is complete."""
    model = _model()
    with full_disk(tmp_path / "run", size="2m", free=950_000) as folder:
        manager = CheckpointManager(folder, keep=3)
        saved = [manager.save(step, model) for step in (1, 2, 3)]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            fourth = manager.save(4, model)
        assert fourth is not None and _warnings(caplog) == []
        assert manager.checkpoints() == saved[1:] + [fourth]
        assert manager.resume("auto") == fourth


def test_a_save_that_fits_nowhere_is_the_disk_full_error_upstream_gets_too(tmp_path):
    """Less room than the checkpoint's own tensors: no save could be written there, not even
    over the old file in place (upstream's would fail too), so it is DiskFullError, nothing
    left behind."""
    with full_disk(tmp_path / "run", size="1m", free=100_000) as folder:
        with pytest.raises(DiskFullError, match="needs about"):
            CheckpointManager(folder, keep=1).save(1, _model())
        assert sorted(p.name for p in folder.iterdir()) == [".training-patches.lock", "filler"]


def test_atomic_torch_save_over_a_file_goes_on_when_it_fits_only_in_its_place(tmp_path,
                                                                           caplog):
    """The writer the integrations save through (F5's accelerator.save, Lightning's
    _atomic_save, coqui's save_fsspec): the file it replaces is kept, None returned."""
    from patches.checkpoint import atomic_torch_save

    state = {"model": _model().state_dict()}
    with full_disk(tmp_path / "run", size="2m", free=400_000) as folder:
        assert atomic_torch_save(state, folder / "last.pt") == folder / "last.pt"
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert atomic_torch_save({"model": _model().state_dict(), "step": 2},
                                     folder / "last.pt") is None
        assert "last.pt was NOT written" in _warnings(caplog)[0]
        assert "step" not in torch.load(folder / "last.pt", weights_only=True)
        with pytest.raises(DiskFullError):  # a new name replaces nothing: as upstream's
            atomic_torch_save(state, folder / "other.pt")


def test_the_free_space_asked_for_is_proportional_to_the_file():
    """The margin is 1/32 of the estimate, no floor: a 12 KB checkpoint asks for about
    12 KB, a 4 MB one for about 4 MB (it used to be each plus 1 MiB)."""
    import io

    from patches.checkpoint.atomic import space_needed

    for state in ({"w": torch.ones(3000)}, {"w": torch.ones(1 << 20)},
                  torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(20)]).state_dict()):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        size = len(buffer.getvalue())
        needed, least = space_needed(state)
        assert least <= size <= needed <= 1.25 * size + 8192, (size, needed, least)


# ----------------------------------------------------------------- what the user hands a save


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        return index


def _prepared(accelerator: Any) -> Any:
    torch.manual_seed(0)
    return accelerator.prepare(torch.utils.data.DataLoader(Numbers(), batch_size=4, shuffle=True))


def test_an_accelerate_prepared_loader_is_saved_and_resumed(tmp_path, checkpoint_patch):
    """``accelerator.prepare(loader)`` has a state_dict() that raises AttributeError
    ('dl_state_dict') unless it wraps a stateful loader: the first save used to end the run.
    Its position is the DataLoader it wraps (one batch behind it: the prepared loader reads
    ahead), and a resumed, freshly prepared loader hands out the batches the uninterrupted
    one did."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    full = [batch.tolist() for batch in _prepared(accelerator)]
    loader = _prepared(accelerator)
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(2)]
    assert first == full[:2]
    path = CheckpointManager(tmp_path / "run").save(2, torch.nn.Linear(1, 1), loader=loader,
                                                    epoch=0)
    position = torch.load(path, weights_only=True)["data_ranks"][0]
    assert (position["epoch"], position["batches"], position["length"]) == (0, 2, 6)
    again = _prepared(accelerator)
    report = load_checkpoint(path, torch.nn.Linear(1, 1), loader=again)
    assert str(report.parts["data"]) == "restored (epoch 0 continues at batch 2 of 6)"
    assert [batch.tolist() for batch in again] == full[2:]


def test_a_loader_or_ema_the_library_cannot_read_is_one_warning_and_the_save_goes_on(
        tmp_path, checkpoint_patch, caplog):
    """A loader whose state_dict() raises, an object passed as the EMA that has no state:
    each is one WARNING naming the save and what was left out; the checkpoint is written
    with the other parts and loads."""

    class Broken:
        def state_dict(self):
            raise AttributeError("'Broken' object has no attribute 'dl_state_dict'")

        def load_state_dict(self, state):
            pass

    model = torch.nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        path = manager.save(1, model, loader=Broken(), ema=object(), epoch=0)
    said = _warnings(caplog)
    assert len(said) == 2 and all("\n" not in m for m in said), said
    assert said[0].startswith("training-patches: the checkpoint of step 1 is saved without the "
                              "data position") and "dl_state_dict" in said[0]
    assert said[1].startswith("training-patches: the checkpoint of step 1 is saved without the "
                              "EMA weights") and "ema=object" in said[1]
    saved = torch.load(path, weights_only=True)
    assert "data_ranks" not in saved and "ema" not in saved
    report = load_checkpoint(path, torch.nn.Linear(2, 2))
    assert report.parts["model"].status == "restored"
