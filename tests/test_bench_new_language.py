"""``benchmarks/bench_new_language.py --quick`` runs end to end with a tiny step count and
writes its table, JSON and plot with every kind of arm (two of the six rule arms). The
figures belong to the benchmark; only what is exact is checked here (every arm ran clean
and with its NaN, the library arms skipped the NaN step and kept the base rows
bit-identical, the unguarded arms died)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from processes import child_path

pytestmark = pytest.mark.slow
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
# the arms run once clean and once with a NaN, and those run clean only (one per rule)
NAN_ARMS = ("upstream", "notes", "notes_stale", "library", "library_unfrozen", "library_resume")
# The rule arms run one code path with another TRAINING_PATCHES_(HEAD_)ROW_INIT each (the
# rules themselves: tests/test_row_init.py): two of them, one spelled and one drawn, stand
# for the six here, and the std-0.02 baseline with the notes' hooks for the two sane
# baselines (plain_std002 is the same worker without the hooks); each arm is a process of
# its own, seconds of imports.
CLEAN_ARMS = ("hooks_std002", "library_std002", "library_romanized")
ARMS = NAN_ARMS + CLEAN_ARMS


def test_quick_run_writes_table_json_and_plot_with_every_kind_of_arm(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = forkserver.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_new_language.py"), "--quick",
         "--steps", "8", "--base-steps", "8", "--seeds", "1", "--arms", ",".join(ARMS),
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_path(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert set(result["summary"]["arms"]) == set(ARMS)
    # every NaN arm ran once clean and once with its injected NaN, the rule arms clean
    assert sorted((r["arm"], r["nan_at"] is None) for r in result["runs"]) == sorted(
        [(arm, clean) for arm in NAN_ARMS for clean in (True, False)]
        + [(arm, True) for arm in CLEAN_ARMS])
    table = (out / "table.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 2 + len(ARMS) + 3  # two headers, one row per arm, three resume rows
    assert result["rows"]["base"] < result["rows"]["v1"] < result["rows"]["v2"]
    assert (out / "new_language.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "work").exists()  # checkpoints and the base model are not left behind
    runs = {(r["arm"], r["nan_at"] is None): r for r in result["runs"]}
    for arm in ("library", "library_resume", *CLEAN_ARMS[1:]):  # unfrozen trains every row
        assert runs[arm, True]["base_row_drift"] == 0.0, arm  # freeze_base_vocab: exact
    # each rule arm started its new rows by its rule, read back from the load report
    assert "embedding romanized (" in runs["library_romanized", True]["load"]
    # the library arm by the defaults: spelled rows, [am] as [START]
    assert ("embedding spelling (" in runs["library", True]["load"]
            and "1 language tag(s) as the start token ('[am]')" in runs["library", True]["load"])
    assert "embedding std0.02, head std0.02" in runs["library_std002", True]["load"]
    assert runs["library_unfrozen", True]["base_row_drift"] > 0.0
    for arm in ("library", "library_unfrozen", "library_resume"):
        assert runs[arm, False]["guard"]["skipped"] == 1, arm  # the NaN step was skipped
        assert runs[arm, False]["nonfinite_tensors"] == 0, arm
    for arm in ("upstream", "notes", "notes_stale"):
        assert runs[arm, False]["nonfinite_tensors"] > 0, arm  # no guard: the NaN stays
    resume = result["summary"]["arms"]["library_resume"]["resume"]
    assert "policy remap" in resume["load"] and resume["lr_after"] == resume["lr_before"]
