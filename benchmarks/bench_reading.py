"""Is it learning? The reading gap and its verdicts against sabotaged fine-tunes (issue 37).

On the speech-shaped benchmark of ``bench_speech_language.py`` (coqui-tts's XTTS GPT,
espeak-ng speech codes of English and Amharic, a base model that reads English), an
Amharic fine-tune with the library's default rows, healthy and sabotaged, each watched by
the library's own :class:`patches.learning.LearningMonitor` (the probe: up to 32 held-out
utterances per language, Amharic and English) and its resume check:

- ``healthy``: the default rows, the base rows frozen, 10% English mixed in, the high LR;
- ``healthy_resume``: the same, stopped half-way and resumed as it should be (model,
  optimizer and scheduler loaded): a control for the resume check;
- ``shuffled``: the Amharic transcripts shuffled across the manifest (train and held-out
  alike: audio and text do not match);
- ``two_tokens``: every Amharic text cut to its first two tokens (``[am]`` and one);
- ``unk``: every Amharic character encoded as ``[UNK]`` (a tokenizer that does not know
  the script; spaces stay ``[SPACE]``);
- ``lr_small``: the LR 100 times too small;
- ``resume_fresh_optimizer``: half-way, a fresh optimizer with the old scheduler loaded
  (seed 004's bug);
- ``resume_restart_scheduler``: half-way, the old optimizer loaded and a fresh scheduler.

For each run: the first evaluation at which each verdict fires, and when the audio loss
alone would have shown anything (its own plateau rule, and the step at which it leaves the
healthy runs' range). The thresholds are the library's defaults, fixed before these runs.

Run:  .venv/bin/python benchmarks/bench_reading.py [--quick] [--seeds N] [--first-seed S]
Writes OUT/results.json, OUT/table.md and OUT/reading.png (default OUT:
benchmarks/results/reading[_quick]); OUT/work is bench_speech_language's cache.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import bench_speech_language as bsl  # noqa: E402

HEALTHY = ("healthy", "healthy_resume")
SABOTAGED = ("shuffled", "two_tokens", "unk", "lr_small", "resume_fresh_optimizer",
             "resume_restart_scheduler")
ARMS = HEALTHY + SABOTAGED
PROBE = 32


# -- sabotage ----------------------------------------------------------------------------------


def sabotage(data: dict[str, Any], arm: str, seed: int) -> dict[str, Any]:
    """The Amharic data of ``arm`` (training and held-out alike: the run's data pipeline)."""
    if arm not in ("shuffled", "two_tokens", "unk"):
        return data
    data = dict(data)
    rng = random.Random(7_000 + seed)
    unk, space = 1, 2  # XTTS's layout: [STOP] 0, [UNK] 1, [SPACE] 2
    for split in ("am_train", "am_eval"):
        items = [dict(x) for x in data[split]]
        if arm == "shuffled":
            texts = [x["ids"] for x in items]
            rng.shuffle(texts)
            for x, ids in zip(items, texts):
                x["ids"] = ids
        elif arm == "two_tokens":
            for x in items:
                x["ids"] = x["ids"][:2]
        else:
            for x in items:
                x["ids"] = x["ids"][:1] + [space if ch == " " else unk for ch in x["text"]]
        data[split] = items
    return data


# -- the model's own audio loss, one per utterance ---------------------------------------------


def audio_losses(model, texts: list[list[int]], audios: list[dict[str, Any]]):
    """Nats per audio code of each (text, audio) pair, the stop code included: the
    benchmark's audio loss, per utterance (the LearningMonitor's loss function)."""
    import torch.nn.functional as F

    items = [dict(a, ids=t) for t, a in zip(texts, audios)]
    langs = [a["lang"] for a in audios]
    order = [a["order"] for a in audios]
    text, t_len, codes, wav_len, cond = bsl.collate(items, langs, audios[0]["pools"], order)
    _, _, mel_logits = model(text, t_len, codes, wav_len, cond_mels=cond)
    targets = codes.new_full((codes.shape[0], mel_logits.shape[-1]), -100)
    for i, x in enumerate(items):
        n = len(x["codes"])
        targets[i, :n] = codes[i, :n]
        targets[i, n] = model.stop_audio_token
    nats = F.cross_entropy(mel_logits, targets, ignore_index=-100, reduction="none")
    return nats.sum(1) / (targets != -100).sum(1)


def probe_of(data: dict[str, Any]):
    from patches.learning import ReadingProbe

    probe = ReadingProbe(per_language=PROBE)
    for lang in ("am", "en"):
        for i, x in enumerate(data[f"{lang}_eval"][:PROBE]):
            probe.add(lang, x["ids"], {"codes": x["codes"], "lang": lang, "order": i,
                                       "pools": data["pools"]})
    return probe


# -- one fine-tune ------------------------------------------------------------------------------


def run_arm(arm: str, seed: int, cfg: dict[str, Any], work: Path, out: Path) -> dict[str, Any]:
    import logging

    import torch

    import patches
    from bench_new_language import make_scheduler
    from patches import learning

    torch.set_num_threads(1)
    folder = out / "runs" / f"{arm}_seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.jsonl"):
        old.unlink()
    patches.advanced.set_output_dir(folder)
    log = logging.getLogger("training_patches")
    handler = logging.FileHandler(folder / "training_patches.log", mode="w")
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # every evaluation measured (the verdicts' resolution); the time budget is its own figure
    patches.advanced.apply(["learning", "resume_check"], reading_budget=1.0)

    data = sabotage(torch.load(work / f"data_{cfg['data_key']}.pt", weights_only=False), arm, seed)
    base_path = work / f"base_{cfg['base_key']}_seed{seed}.pt"
    torch.manual_seed(seed)
    rows = data["rows"]["grown"]
    model = bsl.build_gpt(rows, cfg)
    patches.load_checkpoint(base_path, model, freeze=False, seed=seed,
                            tokenizer=data["vocab"]["grown"])
    steps = cfg["steps"]
    lr = bsl.HIGH_LR / (100 if arm == "lr_small" else 1)
    warm = max(1, steps // 10)
    opt = bsl.make_optimizer(model, lr)
    sched = make_scheduler(opt, steps, warm)
    patches.advanced.freeze_base_vocab(model, data["rows"]["base"])
    pools = data["pools"]
    monitor = learning.LearningMonitor(probe_of(data), audio_losses)
    points: list[dict[str, Any]] = []

    def evaluate(step: int) -> None:
        am_audio, _ = bsl.evaluate(model, data["am_eval"], "am", pools)
        readings = monitor.evaluate(model, step=step)
        points.append({"step": step, "am_audio": am_audio,
                       "readings": {k: r.record() for k, r in readings.items()}})

    resume_at = steps // 2 if arm.startswith(("resume_", "healthy_resume")) else None
    evaluate(0)
    t0 = time.perf_counter()
    for step, batch in enumerate(bsl.schedule(cfg, data, seed, bsl.MIX), start=1):
        if resume_at is not None and step == resume_at + 1:
            opt, sched = resume(arm, model, opt, sched, lr, steps, warm)
        items = [data[f"{lang}_train"][i] for lang, i in batch]
        bsl.train_step(model, opt, items, [lang for lang, _ in batch], pools,
                       [i for _, i in batch])
        sched.step()
        if step % cfg["eval_every"] == 0 or step == steps:
            evaluate(step)
    log.removeHandler(handler)
    handler.close()
    # what the run's user saw: the monitor's WARNINGs and the resume checks, as recorded
    records = [json.loads(line) for line in (folder / "learning_health.jsonl")
               .read_text().splitlines()]
    warned: dict[str, int] = {}
    for r in records:
        if r["event"] == "verdict":
            name = r["kind"] + (f" ({r['language']})" if r.get("language") else "")
            warned.setdefault(name, r["step"])
    return {"arm": arm, "seed": seed, "points": points, "verdicts": warned,
            "resume": [r for r in records if r["event"] == "resume"],
            "resume_step": None if resume_at is None else resume_at + 1,
            "seconds": time.perf_counter() - t0, "probe_seconds": monitor.seconds,
            "steps": steps}


def resume(arm: str, model, opt, sched, lr: float, steps: int, warm: int):
    """A resume in this process, as a user's loop writes one: build the optimizer and the
    scheduler anew, then load what the arm loads."""
    from bench_new_language import make_scheduler

    opt_state, sched_state = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    new_opt = bsl.make_optimizer(model, lr)
    new_sched = make_scheduler(new_opt, steps, warm)
    if arm in ("healthy_resume", "resume_restart_scheduler"):
        new_opt.load_state_dict(opt_state)
    if arm in ("healthy_resume", "resume_fresh_optimizer"):
        new_sched.load_state_dict(sched_state)
    return new_opt, new_sched


def _run(args: tuple[str, int, dict[str, Any], str, str]) -> dict[str, Any]:
    arm, seed, cfg, work, out = args
    return run_arm(arm, seed, cfg, Path(work), Path(out))


# -- summary -----------------------------------------------------------------------------------


def loss_only_alarm(points: list[dict[str, Any]], patience: int) -> int | None:
    """Where a loss-only monitor (the no-improvement rule on the held-out Amharic audio loss,
    as EarlyStopping watches it) fires: the step of the evaluation ``patience`` evaluations
    after the last new low; None: never."""
    best = None
    for i, p in enumerate(points):
        if best is None or p["am_audio"] < points[best]["am_audio"]:
            best = i
        elif i - best >= patience:
            return p["step"]
    return None


def leaves_healthy(run: dict[str, Any], healthy: dict[str, Any] | None, margin: float = 0.01
                   ) -> int | None:
    """The first step after 0 at which the run's Amharic audio loss is above the healthy run
    of its seed (same base model, same data order) by more than ``margin``: an oracle, since
    a user has no healthy twin to compare with."""
    if healthy is None or healthy is run:
        return None
    theirs = {q["step"]: q["am_audio"] for q in healthy["points"]}
    for p in run["points"]:
        if p["step"] > 0 and p["step"] in theirs and p["am_audio"] > theirs[p["step"]] * (1 + margin):
            return p["step"]
    return None


def named(run: dict[str, Any]) -> tuple[str, int | None]:
    """The run's first finding: a verdict (its first WARNING's step) or a resume problem."""
    found = [(step, name) for name, step in run["verdicts"].items()]
    found += [(run.get("resume_step"), "resume: " + ", ".join(r["problems"]))
              for r in run["resume"] if r["problems"]]
    if not found:
        return "-", None
    step, name = min(found, key=lambda f: (f[0] is None, f[0] or 0))
    return name, step


def table(runs: list[dict[str, Any]], patience: int) -> str:
    healthy = {r["seed"]: r for r in runs if r["arm"] == "healthy"}
    lines = ["| run | seed | named by | at step | loss-only alarm (no new low in "
             f"{patience} evaluations) | audio loss >1% above the healthy run of its seed from |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        name, step = named(r)
        alarm = loss_only_alarm(r["points"], patience)
        leaves = leaves_healthy(r, healthy.get(r["seed"]))
        twin = "-" if r["arm"] == "healthy" else leaves if leaves is not None else "never"
        lines.append(f"| {r['arm']} | {r['seed']} | {name} | {step if step is not None else '-'} "
                     f"| {alarm if alarm is not None else 'never'} | {twin} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path, min_gap: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), dpi=72)
    cmap = plt.get_cmap("tab10")
    for n, arm in enumerate(dict.fromkeys(r["arm"] for r in runs)):
        mine = [r for r in runs if r["arm"] == arm]
        steps = [p["step"] for p in mine[0]["points"]]
        for ax, value in ((axes[0], lambda p: 100 * p["readings"].get("am", {}).get(
                "relative", float("nan"))), (axes[1], lambda p: p["am_audio"])):
            vals = [[value(r["points"][i]) for r in mine] for i in range(len(steps))]
            ax.plot(steps, [statistics.median(v) for v in vals], color=cmap(n % 10), lw=1.4,
                    label=arm)
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                            color=cmap(n % 10), alpha=0.12)
    axes[0].axhline(100 * min_gap, color="grey", ls=":", lw=1, label="reading_min_gap")
    axes[0].set(title="Amharic reading gap (% of its audio loss), median [min-max]",
                xlabel="step")
    later = [p["am_audio"] for r in runs for p in r["points"] if p["step"] > 0]
    axes[1].set(title="Amharic audio loss (nats/code)", xlabel="step",
                ylim=(min(later) - 0.05, max(later) + 0.1))
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small preset (d_model 64)")
    ap.add_argument("--out", help="output folder (default benchmarks/results/reading[_quick])")
    ap.add_argument("--steps", type=int, help="fine-tune steps per run")
    ap.add_argument("--base-steps", type=int, default=2000,
                    help="at most this many base-model steps (default 2000)")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    ap.add_argument("--seeds", type=int, default=3, help="seeds (base models)")
    ap.add_argument("--first-seed", type=int, default=0, help="the first seed")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 2)))
    preset = "quick" if args.quick else "full"
    cfg = dict(bsl.PRESETS[preset])
    cfg.update(seeds=args.seeds, first_seed=args.first_seed, eval_every=args.eval_every,
               base_max_steps=args.base_steps)
    cfg["steps"] = args.steps or (300 if args.quick else 400)
    out = Path(args.out).resolve() if args.out else HERE / "results" / (
        "reading" + ("_quick" if args.quick else ""))
    work = out / "work"
    t0 = time.perf_counter()
    data, bases = bsl.ready(cfg, work, args.jobs)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    jobs = [(arm, seed, cfg, str(work), str(out)) for arm in arms for seed in seeds]
    runs = []
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for result in pool.map(_run, jobs):
            runs.append(result)
            print(f"{result['arm']} seed {result['seed']}: verdicts {result['verdicts']}; "
                  f"resume {[r.get('problems') for r in result['resume']]} "
                  f"({result['seconds']:.0f} s, probe {result['probe_seconds']:.1f} s)",
                  flush=True)
    from patches import _options

    opts = _options.Options()
    text = table(runs, int(opts.reading_patience))
    print("\n" + text)
    (out / "table.md").write_text(text + "\n", encoding="utf-8")
    plot(runs, out / "reading.png", float(opts.reading_min_gap))
    result = {"preset": preset, "config": cfg, "bases": bases, "runs": runs,
              "seconds": time.perf_counter() - t0,
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpus": os.cpu_count(), "platform": platform.platform()}}
    (out / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {out / 'results.json'} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
