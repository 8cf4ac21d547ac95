"""Issue 38's verdicts, computed: for every configuration of ``bench_speech_language`` that has
results, each rule's verdict on the Amharic audio loss, the Amharic reading gap and the English
audio loss, by the rule fixed before the runs (docs/benchmarks.md, issue 38: "best"; "ok", its
median within the best rule's [min-max] or its paired differences to the best of both signs;
"no"), and whether row_init ``auto`` meets the issue's floor (best or ok on Amharic and on the
reading gap in every configuration).

``auto`` is its own arm where a configuration ran it (through the loader) under today's
``READS_ABOVE``. Where it did not (the configurations run before it existed, or under the first
threshold, 0.17: ``mid_quick``), each base model is loaded by the library under auto
(``probe_reads_text.library``) and auto's figures are those of the rule it chose, seed by seed:
the rows auto makes are that rule's, bit for bit (``tests/test_reads_text.py``), and where
both ran the runs are identical (``mid_quick``: auto and std0.02 paired +0.000 on all three).

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/row_default_verdicts.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench_speech_language as bsl  # noqa: E402
import probe_reads_text as prt  # noqa: E402

from patches.learning import _stderr as stderr  # noqa: E402  (the library's reading's)
from patches.reads_text import READS_ABOVE  # noqa: E402

FIGURES = (("am", "Amharic audio", min), ("gap", "reading gap", max), ("en", "English audio", min))
RULES = ("auto", "spelling", "std0.02", "spread")


def runs_of(name: str) -> dict[tuple[str, int], dict[str, float]]:
    """(rule, seed) -> the last step's figures of the configuration's runs (its own folder and
    the folders of seeds run apart, ``row_defaults_NAME_s*``)."""
    steps = bsl.CONFIGS[name]["steps"]
    out = {}
    for folder in [HERE / "results" / f"row_defaults_{name}",
                   *sorted((HERE / "results").glob(f"row_defaults_{name}_s*"))]:
        path = folder / "runs.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else ():
            r = json.loads(line)
            if r.get("steps") != steps:
                continue
            rule = bsl.arm_rule(r["arm"])  # "spelling x0.5": not spelling's arm
            auto = (r.get("row_init") or {}).get("auto") or {}
            if rule == "auto" and auto.get("threshold") != READS_ABOVE:
                continue  # run under an earlier threshold: auto is mapped by today's
            last = r["curve"][-1]
            reading = r["reading"].get(str(steps)) or r["reading"].get(steps)
            out[(rule, r["seed"])] = {
                "am": last[bsl.AM_AUDIO], "en": last[bsl.EN_AUDIO], "gap": reading["gap"],
                "gaps": reading.get("per_utterance")}  # each utterance's (since 2026-11-28)
    return out


TIE_WITHIN = 2.0  # the proposed tie (not the rule of 2026-11-27): standard errors


def gap_tie(runs: dict[tuple[str, int], dict[str, Any]], seeds: list[int], rule: str,
            best: str) -> bool | None:
    """The tie proposed on 2026-11-28 (fifth stop) for the owner of issue 38 to decide, not
    the rule the verdicts apply: ``rule``'s reading gap ties with ``best``'s when their
    difference, paired by utterance and averaged over the seeds, is within TIE_WITHIN of its
    standard error. Every seed measures the same probe utterances, so each utterance's
    difference is averaged over the seeds first and the error taken over the utterances
    (the seeds' differences are correlated through them). The error is the probe's, not the
    training's: the seeds' spread is the verdicts' own rule. None where the runs did not
    record each utterance's gap, or recorded one that is not finite."""
    diffs = []
    for s in seeds:
        a, b = runs[(rule, s)].get("gaps"), runs[(best, s)].get("gaps")
        if not a or not b:
            return None
        if len(a) != len(b):
            raise ValueError(f"seed {s}: {len(a)} utterance gaps for {rule}, {len(b)} for "
                             f"{best}: not the same probe")
        diffs.append([x - y for x, y in zip(a, b)])
    per_utterance = [statistics.fmean(u) for u in zip(*diffs)]
    if not all(math.isfinite(d) for d in per_utterance):
        return None
    return abs(statistics.fmean(per_utterance)) <= TIE_WITHIN * stderr(per_utterance)


def auto_choices(name: str, seeds: list[int]) -> dict[int, tuple[str, float]]:
    """seed -> (the rule auto chooses for that base model, its text_tv), by the library."""
    c = bsl.CONFIGS[name]
    folder = HERE / c.get("work", "results/row_defaults_work")
    cfg = prt.config(c.get("preset", "quick"), c["width"], c["base_steps"], folder,
                     c.get("base_eval_every"), c.get("shuffle_text", False))
    out = {}
    for seed in seeds:
        got = prt.library(folder / f"base_{cfg['base_key']}_seed{seed}.pt", cfg)
        out[seed] = (got["lib_rule"], got["lib_text_tv"])
    return out


def verdicts(runs: dict[tuple[str, int], dict[str, float]], seeds: list[int]
             ) -> dict[str, dict[str, str]]:
    """rule -> figure -> best / ok / no, among the rules with every seed."""
    rules = [r for r in RULES if all((r, s) in runs for s in seeds)]
    out: dict[str, dict[str, str]] = {r: {} for r in rules}
    for key, _, better in FIGURES:
        vals = {r: [runs[(r, s)][key] for s in seeds] for r in rules}
        med = {r: statistics.median(v) for r, v in vals.items()}
        best = better(rules, key=lambda r: med[r])
        for r in rules:
            diffs = [a - b for a, b in zip(vals[r], vals[best])]
            if r == best or all(d == 0 for d in diffs):
                out[r][key] = "best"
            elif (min(vals[best]) <= med[r] <= max(vals[best])
                  or (any(d > 0 for d in diffs) and any(d < 0 for d in diffs))):
                out[r][key] = "ok"
            else:
                out[r][key] = "no"
    return out


def resolution(folder: Path, against: str) -> str:
    """The reading gap's resolution in a run folder whose runs recorded each utterance's gap
    (``bench_speech_language`` since 2026-11-28, fifth stop): per rule and seed, the gap ±
    its standard error over the utterances, and its difference from ``against``'s on the
    same utterances ± the standard error of that paired difference."""
    runs = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]
    steps = max(r["steps"] for r in runs)  # a folder's runs of another length are left out
    by = {(bsl.arm_rule(r["arm"]), r["seed"]): r for r in runs if r["steps"] == steps}
    rules = list(dict.fromkeys(rule for rule, _ in by))
    seeds = sorted({seed for _, seed in by})
    missing = [f"{rule} seed {s}" for rule in rules for s in seeds if (rule, s) not in by]
    if against not in rules or missing:
        raise SystemExit(f"{folder}: no runs of {against!r} (rules: {', '.join(rules)})"
                         if against not in rules else
                         f"{folder}: runs missing at step {steps}: {', '.join(missing)}")

    def gaps(rule: str, seed: int) -> list[float]:
        got = by[(rule, seed)]["reading"]
        got = got.get(str(steps)) or got[steps]
        if "per_utterance" not in got:
            raise SystemExit(f"{folder}: {rule} seed {seed} did not record each utterance's "
                             "gap (runs before 2026-11-28, fifth stop): run the configuration "
                             "again into a new folder")
        return got["per_utterance"]

    lines = [f"Step {steps}; per seed: the gap ± its standard error over the "
             f"{len(gaps(rules[0], seeds[0]))} utterances; minus `{against}`'s, paired by "
             "utterance, ± the paired difference's standard error.", "",
             "| rule | " + " | ".join(f"seed {s}: gap" for s in seeds) + " | "
             + " | ".join(f"seed {s}: minus `{against}`" for s in seeds) + " |",
             "|---|" + "---|" * 2 * len(seeds)]
    for rule in rules:
        own = [f"{statistics.fmean(gaps(rule, s)):+.4f} ± {stderr(gaps(rule, s)):.4f}"
               for s in seeds]
        diff = []
        for s in seeds:
            d = [a - b for a, b in zip(gaps(rule, s), gaps(against, s))]
            diff.append("-" if rule == against else
                        f"{statistics.fmean(d):+.4f} ± {stderr(d):.4f}")
        lines.append(f"| {rule} | " + " | ".join(own + diff) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--resolution", metavar="FOLDER", help="instead: the reading gap's "
                    "resolution in FOLDER's runs (each utterance's gap recorded)")
    ap.add_argument("--against", default="spelling", help="with --resolution: the rule the "
                    "paired differences are taken against (default spelling)")
    args = ap.parse_args()
    if args.resolution:
        print(resolution(Path(args.resolution), args.against))
        return
    lines = ["| configuration | auto's choice per base model (text_tv) | "
             + " | ".join(f"`{r}` (Amharic / gap / English)" for r in RULES) + " |",
             "|---|---|" + "---|" * len(RULES)]
    floor, ties = [], []
    for name in bsl.CONFIGS:
        c = bsl.CONFIGS[name]
        seeds = bsl.seeds_of(dict(c, seeds=3))  # as --config NAME runs it
        runs = runs_of(name)
        if not all(("spelling", s) in runs for s in seeds):
            continue
        chosen = auto_choices(name, seeds)
        ran_auto = all(("auto", s) in runs for s in seeds)
        if not ran_auto:  # auto's figures: the rule it chooses, seed by seed
            if not all((rule, s) in runs for s, (rule, _) in chosen.items()):
                continue
            for s, (rule, _) in chosen.items():
                runs[("auto", s)] = runs[(rule, s)]
        v = verdicts(runs, seeds)
        said = ", ".join(f"{s}: {rule} ({tv:.3f})" for s, (rule, tv) in chosen.items())
        said += "" if ran_auto else " [mapped]"
        lines.append(f"| `{name}` | {said} | " + " | ".join(
            " / ".join(v[r][k] for k, _, _ in FIGURES) if r in v else "not run"
            for r in RULES) + " |")
        floor.append((name, v["auto"]["am"] != "no" and v["auto"]["gap"] != "no"))
        if v["auto"]["gap"] == "no":
            best = next(r for r in v if v[r]["gap"] == "best")
            ties.append((name, gap_tie(runs, seeds, "auto", best)))
    text = "\n".join(lines) + "\n\nauto meets the floor (Amharic and reading gap best or ok): " + \
        ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in floor)
    said = {True: "ties", False: "does not tie",
            None: "cannot be judged (no gap per utterance recorded)"}
    text += "".join(f"\n{n}: auto's reading gap {said[tie]} with the best by the tie proposed "
                    f"for issue 38 (within {TIE_WITHIN:g} standard errors), not the rule the "
                    "verdicts apply" for n, tie in ties)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
