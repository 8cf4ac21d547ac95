"""``benchmarks/row_default_verdicts.py`` applies issue 38's rule of the choice as fixed
(docs/benchmarks.md): "best" (the best median, or bit-identical runs), "ok" (the median
within the best rule's [min-max], or paired differences of both signs), "no". The verdicts
the closing notes quote are computed by it, so its rule is checked on runs made up here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
verdicts_mod = pytest.importorskip("row_default_verdicts")


def _runs(**rules: tuple[list[float], list[float], list[float]]) -> dict:
    """rule -> (Amharic, gap, English) per seed 1, 2, 3."""
    return {(rule, seed): {"am": am[i], "gap": gap[i], "en": en[i]}
            for rule, (am, gap, en) in rules.items() for i, seed in enumerate((1, 2, 3))}


def test_best_ok_and_no_follow_the_rule_fixed_before_the_runs() -> None:
    runs = _runs(
        spelling=([2.40, 2.41, 2.45], [0.02, 0.03, 0.02], [2.8, 2.9, 2.7]),
        # Amharic: median 2.42 inside spelling's [2.40-2.45] -> ok; gap below every seed -> no
        **{"std0.02": ([2.42, 2.43, 2.41], [0.01, 0.01, 0.00], [2.6, 2.7, 2.5])},
        # Amharic worse in every seed and outside the range -> no; gap of both signs -> ok
        spread=([2.50, 2.51, 2.52], [0.03, 0.02, 0.01], [2.9, 2.9, 2.9]))
    got = verdicts_mod.verdicts(runs, [1, 2, 3])
    assert got["spelling"] == {"am": "best", "gap": "best", "en": "no"}
    assert got["std0.02"] == {"am": "ok", "gap": "no", "en": "best"}
    assert got["spread"] == {"am": "no", "gap": "ok", "en": "no"}


def test_a_rule_identical_to_the_best_is_best_and_a_rule_missing_a_seed_is_left_out() -> None:
    runs = _runs(spelling=([2.4, 2.5, 2.6], [0.1, 0.2, 0.3], [2.0, 2.1, 2.2]),
                 auto=([2.4, 2.5, 2.6], [0.1, 0.2, 0.3], [2.0, 2.1, 2.2]),
                 **{"std0.02": ([2.0, 2.1, 2.2], [0.0, 0.0, 0.0], [3.0, 3.1, 3.2])})
    del runs[("std0.02", 3)]
    got = verdicts_mod.verdicts(runs, [1, 2, 3])
    assert set(got) == {"auto", "spelling"}
    assert got["auto"] == got["spelling"] == {"am": "best", "gap": "best", "en": "best"}
