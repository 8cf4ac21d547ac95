"""Issue 27: the data position, a checkpoint part (``patches/checkpoint/data_position.py``).

A run stopped mid-epoch and resumed with ``loader=`` sees exactly the batches, sample
noise and RNG draws the uninterrupted run saw after that step, in one process with and
without DataLoader workers, and from a sharded folder; without ``loader=`` it does not
(the check that the test can fail). A position that does not fit is refused before
anything changes; what cannot be resumed exactly is said. Real DataLoaders, real files.
"""

from __future__ import annotations

import logging

import pytest
import torch
from data_position_loop import NoisyData, train

import patches
from patches.checkpoint import CheckpointManager, CheckpointMismatchError, load_checkpoint

LOGGER = "training_patches"


@pytest.fixture
def checkpoint_patch():
    was = patches.advanced.is_applied("checkpoint")
    patches.advanced.apply(["checkpoint"])
    yield
    if not was:
        patches.revert(["checkpoint"])


@pytest.mark.parametrize("stop_after", [5, 14])
def test_a_resumed_run_sees_the_batches_the_uninterrupted_one_saw(tmp_path, checkpoint_patch,
                                                                  stop_after):
    """44 samples, batch 4: 11 batches an epoch. Stopped at step 5 (epoch 0, batch 5) and
    at 14 (epoch 1, batch 3)."""
    full, _ = train(tmp_path / "full")
    first, _ = train(tmp_path / "run", stop_after=stop_after)
    assert first == full[:stop_after]
    rest, report = train(tmp_path / "run", resume=True)
    assert rest == full[stop_after:]
    part = report.parts["data"]
    assert part.status == "restored" and f"batch {stop_after % 11} of 11" in part.detail


def test_a_completed_epoch_starts_the_next_one(tmp_path, checkpoint_patch):
    """Saved after the last batch of epoch 0: the loader's next iter() is a fresh epoch
    drawn from the restored RNG, as in the uninterrupted run."""
    full, _ = train(tmp_path / "full")
    train(tmp_path / "run", stop_after=11)
    model, opt = torch.nn.Linear(1, 1), None
    loader = torch.utils.data.DataLoader(NoisyData(44), batch_size=4, shuffle=True)
    report = load_checkpoint(CheckpointManager(tmp_path / "run").resume(), model, opt,
                             loader=loader)
    assert report.parts["data"].status == "restored"
    assert "epoch 0 was complete" in report.parts["data"].detail
    assert [batch[0].tolist() for batch in loader][0] == full[11][1]


def test_without_the_loader_the_resumed_run_sees_other_batches(tmp_path, checkpoint_patch):
    """What the part is for: the same resume without ``loader=`` repeats the epoch from a
    new order (and the report says the file's position was dropped)."""
    full, _ = train(tmp_path / "full")
    train(tmp_path / "run", stop_after=5)
    rest, report = train(tmp_path / "run", resume=True, loader_on_resume=False)
    assert rest[:6] != full[5:11]
    assert report.parts["data"].status == "dropped"
    assert report.parts["data"].detail == "no loader passed"


@pytest.mark.slow
def test_with_workers_the_resumed_run_sees_the_same_batches(tmp_path, checkpoint_patch):
    """Two worker processes: the samples' noise comes from the workers' RNG (seeded from
    the base seed the epoch drew), and the workers had prefetched batches at the resume."""
    full, _ = train(tmp_path / "full", workers=2)
    train(tmp_path / "run", stop_after=14, workers=2)
    rest, report = train(tmp_path / "run", resume=True, workers=2)
    assert rest == full[14:]


def test_a_sharded_folder_holds_the_data_position(tmp_path, checkpoint_patch):
    """A DCP folder (here written by one process) keeps each rank's position in its own
    file, and a resume from it continues the same way."""
    from data_position_loop import NoisyData as Data

    from patches.checkpoint.sharded import save_sharded

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Data(44), batch_size=4, shuffle=True)
    model = torch.nn.Linear(1, 1)
    iterator = iter(loader)
    first = [next(iterator)[0].tolist() for _ in range(3)]
    folder = save_sharded(CheckpointManager(tmp_path / "run"), 3, model, None, None, None,
                          {"epoch": 0}, loader=loader)
    expected = [batch[0].tolist() for batch in iterator]
    assert (folder / "data.rank0.pt").is_file() and len(first) == 3
    again = torch.utils.data.DataLoader(Data(44), batch_size=4, shuffle=True)
    report = load_checkpoint(folder, torch.nn.Linear(1, 1), loader=again)
    assert report.parts["data"].status == "restored"
    assert [batch[0].tolist() for batch in again] == expected


def test_a_position_that_does_not_fit_is_refused_before_anything_changes(tmp_path,
                                                                        checkpoint_patch):
    train(tmp_path / "run", stop_after=5)
    path = CheckpointManager(tmp_path / "run").resume()
    model = torch.nn.Linear(1, 1)
    before = model.weight.detach().clone()
    smaller = torch.utils.data.DataLoader(NoisyData(40), batch_size=4, shuffle=True)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(path, model, loader=smaller)
    message = str(info.value)
    assert "11 batches per epoch; loader= has 10" in message and "Nothing was loaded" in message
    assert torch.equal(model.weight, before)


def test_an_iterable_dataset_is_said_not_resumed(tmp_path, checkpoint_patch, caplog):
    train(tmp_path / "run", stop_after=5)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = load_checkpoint(CheckpointManager(tmp_path / "run").resume(),
                                 torch.nn.Linear(1, 1), loader=loader)
    assert report.parts["data"].status == "dropped"
    assert "IterableDataset" in caplog.text and "restarts from the beginning" in caplog.text


def test_the_position_of_a_loader_never_iterated_under_the_patch_is_left_out_and_said(
        tmp_path, caplog):
    """Without the checkpoint patch, where the epoch began is unknown: the save says so in
    one WARNING (a second save of the same loader does not repeat it) and writes the
    checkpoint without the data position; the run goes on (it used to end with a
    ValueError)."""
    was = patches.advanced.is_applied("checkpoint")
    patches.revert(["checkpoint"])
    try:
        loader = torch.utils.data.DataLoader(NoisyData(8), batch_size=4, shuffle=True)
        next(iter(loader))
        manager = CheckpointManager(tmp_path / "run")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            path = manager.save(1, torch.nn.Linear(1, 1), loader=loader)
            manager.save(2, torch.nn.Linear(1, 1), loader=loader)
    finally:
        if was:
            patches.advanced.apply(["checkpoint"])
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "the checkpoint of step 1 is saved without the data position" in said[0]
    assert "was not iterated while the checkpoint patch was applied" in said[0]
    assert "data_ranks" not in torch.load(path, weights_only=True)


def test_a_stateful_loader_is_saved_and_restored_through_its_own_state_dict(tmp_path):
    """A loader with state_dict()/load_state_dict() (torchdata's StatefulDataLoader's
    protocol) keeps its own position; the checkpoint carries it."""

    class Stateful:
        def __init__(self) -> None:
            self.position = 0

        def state_dict(self) -> dict:
            return {"position": self.position}

        def load_state_dict(self, state: dict) -> None:
            self.position = state["position"]

    saving = Stateful()
    saving.position = 7
    path = CheckpointManager(tmp_path / "run").save(1, torch.nn.Linear(1, 1), loader=saving)
    loading = Stateful()
    report = load_checkpoint(path, torch.nn.Linear(1, 1), loader=loading)
    assert loading.position == 7 and report.parts["data"].status == "restored"


def test_a_position_that_cannot_be_replayed_never_raises_into_the_loop(checkpoint_patch,
                                                                       caplog):
    """A loader armed with a position whose RNG state cannot be set (a damaged value): its
    next iter() says so in a WARNING and starts the epoch from its beginning, as if it had
    not been armed; nothing is raised into the training loop."""
    from patches.checkpoint import data_position

    loader = torch.utils.data.DataLoader(NoisyData(8), batch_size=4, shuffle=False)
    data_position.arm(loader, {"kind": data_position.KIND_PLAIN, "epoch": 0, "batches": 1,
                               "length": 2, "rng": {"torch": torch.zeros(3, dtype=torch.uint8),
                                                    "generator": None}})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        batches = [batch[0].tolist() for batch in loader]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "could not continue epoch 0 at batch 1" in caplog.text
    assert "starts from its beginning" in caplog.text


def test_the_count_read_after_each_step_is_none_for_a_loader_it_cannot_watch() -> None:
    """data_position.yielded runs after every coqui training step: a trainer whose loader is
    a plain list (not weak-referenceable) gets None, never an error in its step."""
    from patches.checkpoint import data_position

    assert data_position.yielded([[1, 2], [3, 4]]) is None
    assert data_position.yielded(None) is None
