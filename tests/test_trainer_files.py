"""A trainer's own checkpoint files load under the weights-only rules: numpy RNG state and
numpy scalars are data, through torch's safe-globals mechanism; code is still refused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import patches
from patches.checkpoint import read_checkpoint


def _latest(path: Path, model: torch.nn.Module) -> None:
    """What the IndexTTS trainer writes as latest.pth."""
    np.random.seed(3)
    torch.save({"model": model.state_dict(), "global_step": 12,
                "rng_state": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()},
                "best_loss": np.float64(2.5)}, path)


def test_numpy_rng_state_in_a_trainers_file_loads(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    _latest(tmp_path / "latest.pth", model)
    fresh = torch.nn.Linear(4, 4)
    patches.load_checkpoint(tmp_path / "latest.pth", fresh, restore_rng=False)
    assert torch.equal(fresh.weight, model.weight)
    loaded = read_checkpoint(tmp_path / "latest.pth")
    state = loaded["rng_state"]["numpy"]
    np.random.seed(3)
    expected = np.random.get_state()
    assert state[0] == "MT19937" and np.array_equal(state[1], expected[1])
    assert loaded["best_loss"] == 2.5


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_code_running_pickle_is_still_refused(tmp_path: Path) -> None:
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "evil": _RunsCode()},
               tmp_path / "evil.pth")
    with pytest.raises(patches.UnsafeCheckpointError, match="os.system|posix.system"):
        patches.load_checkpoint(tmp_path / "evil.pth", torch.nn.Linear(2, 2))


class LegacyConfig:
    """A trainer's own config object, pickled into its old checkpoints."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_trusted_true_loads_a_users_legacy_object_pickle_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 3)
    torch.save({"model": model.state_dict(), "config": LegacyConfig(0.1)}, tmp_path / "old.pth")
    fresh = torch.nn.Linear(3, 3)
    with pytest.raises(patches.UnsafeCheckpointError, match="LegacyConfig"):
        patches.load_checkpoint(tmp_path / "old.pth", fresh)  # refused by default
    assert not torch.equal(fresh.weight, model.weight)
    caplog.set_level("WARNING", logger="training_patches")
    patches.load_checkpoint(tmp_path / "old.pth", fresh, trusted=True, restore_rng=False)
    assert torch.equal(fresh.weight, model.weight)
    assert "trusted=True" in caplog.text and "old.pth" in caplog.text
