"""One source of settings: every ``TRAINING_PATCHES_*`` variable means the same with or
without the activation line. ``load_checkpoint`` in a loop of one's own (the README's snippet,
no ``import patches.auto``) ignored ``TRAINING_PATCHES_ROW_INIT``, even a bogus value; now a
use before any ``apply()`` reads the variables and validates them as activation does
(``patches._options.current``). Each case runs both ways in fresh processes."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import forkserver
import pytest

import patches
from patches import _options
from processes import child_path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from patches.advanced import ConfigError
    try:
        if sys.argv[1] == "activated":
            import patches.auto  # the activation line
        import patches
        from tiny_models import TinyTextModel
        torch.manual_seed(0)
        torch.save({"model": TinyTextModel(vocab=20, dim=8).state_dict()}, sys.argv[2])
        report = patches.load_checkpoint(sys.argv[2], TinyTextModel(vocab=24, dim=8))
        out = {"row_init": report.row_init, "frozen": report.freeze.base_vocab_size}
    except ConfigError as exc:
        out = {"error": str(exc)}
    print(json.dumps(out))
""")


def _run(how: str, env: dict[str, str], tmp_path: Path) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    result = forkserver.run(
        [sys.executable, "-c", SCRIPT, how, str(tmp_path / f"{how}.pt")], capture_output=True,
        text=True, timeout=300, cwd=tmp_path,
        env={**clean, **env, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": child_path(ROOT, ROOT / "tests")})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env,expected", [
    ({"TRAINING_PATCHES_ROW_INIT": "std0.02", "TRAINING_PATCHES_HEAD_ROW_INIT": "randn",
      "TRAINING_PATCHES_BASE_VOCAB": "18"},
     {"row_init": {"embedding": "std0.02", "head": "randn"}, "frozen": 18}),
    ({"TRAINING_PATCHES_ROW_INIT": "fvt"},
     "training-patches: the environment variable TRAINING_PATCHES_ROW_INIT is 'fvt', which is "
     "not usable"),
    ({"TRAINING_PATCHES_BASEVOCAB": "18"},
     "unknown environment variable(s) TRAINING_PATCHES_BASEVOCAB (did you mean "
     "TRAINING_PATCHES_BASE_VOCAB?)"),
], ids=["read", "bad value", "misspelled"])
@pytest.mark.slow  # two Python processes each (3 s): not in the unit tier
def test_a_setting_means_the_same_with_or_without_the_activation_line(
        tmp_path: Path, env: dict[str, str], expected: dict | str) -> None:
    without = _run("plain", env, tmp_path)
    activated = _run("activated", env, tmp_path)
    assert without == activated
    if isinstance(expected, str):
        assert expected in without["error"]
    else:
        assert without == expected


def test_without_apply_the_settings_follow_the_environment(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Before any apply() the variables are read at each use (again when they change);
    apply() fixes them as activation always did."""
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "mean")
    assert _options.current().row_init == "mean"
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "spread")
    assert _options.current().row_init == "spread"
    monkeypatch.setenv("TRAINING_PATCHES_DISABLE", "nope")  # checked as apply() checks it
    with pytest.raises(patches.advanced.ConfigError, match="names unknown patch"):
        _options.current()
    monkeypatch.delenv("TRAINING_PATCHES_DISABLE")
    patches.advanced.apply(["checkpoint"])
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "randn")
    assert _options.current().row_init == "spread"
