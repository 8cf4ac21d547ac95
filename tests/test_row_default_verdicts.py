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


def test_a_scaled_arm_is_read_as_its_own_rule_not_as_the_rule_it_scales(tmp_path, monkeypatch
                                                                        ) -> None:
    """``--rules spelling*0.5`` writes arms named like spelling's plus `` emb x0.5``: read as
    spelling's, they would replace its figures in the verdicts."""
    import json

    bsl = verdicts_mod.bsl
    steps = bsl.CONFIGS["wide"]["steps"]
    folder = tmp_path / "results" / "row_defaults_wide"
    folder.mkdir(parents=True)
    lines = []
    for spec, am in ((bsl.arm("spelling", "spread", lr=5e-4), 2.36),
                     (bsl.arm("spelling", "spread", lr=5e-4, scale=0.5), 2.30)):
        curve = [[0, 4.3, 3.0, 0, 0], [steps, am, 3.1, 0, 0]]
        lines.append(json.dumps({"arm": spec["name"], "seed": 120, "steps": steps,
                                 "curve": curve, "reading": {str(steps): {"gap": 0.001}}}))
    (folder / "runs.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(verdicts_mod, "HERE", tmp_path)
    got = verdicts_mod.runs_of("wide")
    assert got[("spelling", 120)]["am"] == pytest.approx(2.36)
    assert got[("spelling x0.5", 120)]["am"] == pytest.approx(2.30)


def test_the_resolution_table_gives_each_gap_and_each_paired_difference_its_error(tmp_path
                                                                                 ) -> None:
    import json
    import statistics

    bsl = verdicts_mod.bsl
    own = {"spelling": [0.010, 0.030, 0.020, 0.040], "std0.02": [0.000, 0.030, 0.010, 0.010]}
    lines = [json.dumps({"arm": bsl.arm(rule, "spread", lr=5e-4)["name"], "seed": 7,
                         "steps": 100, "reading": {"100": {"per_utterance": gaps}}})
             for rule, gaps in own.items()]
    (tmp_path / "runs.jsonl").write_text("\n".join(lines) + "\n")
    text = verdicts_mod.resolution(tmp_path, "spelling")
    se = statistics.stdev(own["spelling"]) / 2
    diff = [a - b for a, b in zip(own["std0.02"], own["spelling"])]
    assert f"| spelling | +0.0250 ± {se:.4f} | - |" in text
    assert (f"| std0.02 | +0.0125 ± {statistics.stdev(own['std0.02']) / 2:.4f} | "
            f"{statistics.fmean(diff):+.4f} ± {statistics.stdev(diff) / 2:.4f} |") in text


def test_the_proposed_tie_pools_the_paired_differences_over_the_seeds() -> None:
    """Not the rule the verdicts apply: the tie proposed for issue 38's owner. Every seed
    measures the same utterances, so their differences are averaged over the seeds first:
    differing by the same amount on every seed (perfectly correlated), a difference of 0.015
    is within 2 standard errors (0.0183) and ties, where pooling the seeds as independent
    (0.0105) would not; 0.02 does not tie; runs without each utterance's gap, or with one
    not finite, cannot be judged; two probes of different sizes are refused."""
    noise = [0.01, -0.01, 0.02, -0.02]
    runs = {}
    for seed in (1, 2, 3):
        runs[("spelling", seed)] = {"gaps": [0.030 + n for n in noise]}
        runs[("near", seed)] = {"gaps": [0.015] * 4}
        runs[("far", seed)] = {"gaps": [0.010] * 4}
        runs[("old", seed)] = {"gaps": None}
        runs[("nan", seed)] = {"gaps": [float("nan")] * 4}
        runs[("short", seed)] = {"gaps": [0.0] * 3}
    assert verdicts_mod.gap_tie(runs, [1, 2, 3], "near", "spelling") is True
    assert verdicts_mod.gap_tie(runs, [1, 2, 3], "far", "spelling") is False
    assert verdicts_mod.gap_tie(runs, [1, 2, 3], "old", "spelling") is None
    assert verdicts_mod.gap_tie(runs, [1, 2, 3], "nan", "spelling") is None
    with pytest.raises(ValueError, match="not the same probe"):
        verdicts_mod.gap_tie(runs, [1, 2, 3], "short", "spelling")
