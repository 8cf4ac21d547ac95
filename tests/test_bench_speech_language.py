"""``benchmarks/bench_speech_language.py --quick`` runs end to end with a tiny step count:
real espeak-ng speech, the real XTTS GPT, the real extend-tokenizer, two rules' arms
loaded through ``patches.load_checkpoint``. The figures belong to the benchmark; only
what is exact is checked here (every arm ran and recorded its rule, the frozen base rows
did not move, the romanised rows were placed by their spelling, the files were written)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from processes import child_path

pytestmark = [pytest.mark.slow, pytest.mark.xtts]
pytest.importorskip("TTS")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
# One code path with another row rule each (the rules themselves: tests/test_row_init.py):
# the default spelled rule and one drawn rule stand for the six (each arm is a process of its
# own).
RULES = ("spelling", "std0.02")


@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="espeak-ng is not installed (scripts/ensure_espeak.sh; make setup runs it)")
def test_quick_run_writes_table_json_and_plot_with_two_rules(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = forkserver.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_speech_language.py"), "--quick",
         "--steps", "4", "--base-steps", "4", "--utterances", "160", "--arms",
         ",".join(f"{rule}/{rule} " for rule in RULES), "--out", str(out), "--clean"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_path(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {r["spec"]["emb"]: r for r in result["runs"]}
    assert set(runs) == set(RULES)
    for rule, run in runs.items():
        assert run["row_init"]["embedding"] == rule == run["row_init"]["head"]
        assert run["base_row_drift"] == 0.0, rule  # freeze_base_vocab: exact
        assert [p[0] for p in run["curve"]] == [0, 1, 2, 3, 4]
        for step, read in run["reading"].items():  # each utterance's gap, as the library's
            each = read["per_utterance"]
            assert len(each) > 1 and sum(each) / len(each) == pytest.approx(read["gap"], abs=1e-6)
            mean = sum(each) / len(each)
            spread = (sum((g - mean) ** 2 for g in each) / (len(each) - 1) / len(each)) ** 0.5
            assert read["stderr"] == pytest.approx(spread, rel=1e-6), (rule, step)
    spelled = runs["spelling"]["row_init"]
    rows = result["rows"]
    # every new token spelled, fallen back, or (the [am] tag) started as [START]
    assert spelled["tags_from_start"] == ["[am]"]
    assert spelled["spelled"] + spelled["fallback"] + 1 == rows["grown"] - rows["base"]
    assert spelled["spelled"] > spelled["fallback"]  # most new Amharic tokens spell
    assert result["corpus"]["amharic_utterances"] > 0 and result["corpus"]["unk_tokens_amharic"] == 0
    table = (out / "table.md").read_text(encoding="utf-8")
    assert sum(line.startswith("| spelling/") or line.startswith("| std0.02/")
               for line in table.splitlines()) == 2
    assert (out / "speech_language.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "work").exists()  # --clean removes speech, codes and base models
