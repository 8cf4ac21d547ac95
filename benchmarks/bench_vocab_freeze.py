"""Base-vocabulary freeze: drift of the "frozen" rows and the cost per training step.

(a) drift: the common gradient-hook-only "freeze" versus ``freeze_base_vocab``, on the
    tiny XTTS GPT with an extended vocabulary (74 -> 82 rows), AdamW weight decay 0.01,
    N steps, decay on weights only (XTTS's ``optimizer_wd_only_on_weights``) and on all
    parameters. Drift = max |row now - row before| over the base rows.
(b) overhead: step time (forward, backward, AdamW step) of the tiny XTTS GPT on the CPU
    with the freeze on and off, interleaved in one process (on, off, on, off, ...),
    reported as the ratio of medians and of the fastest quarter.

Run:  .venv/bin/python benchmarks/bench_vocab_freeze.py [--steps 12] [--repeats 40]
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patches import freeze_base_vocab  # noqa: E402
from demo.xtts_tiny import build_tiny_xtts  # noqa: E402
from patches.integrations.layouts import start_row_is_last  # noqa: E402
from patches.vocab_rows import frozen_rows  # noqa: E402

BASE = 74
NEW_TOKENS = ("ሰ", "ላ", "ም", "ዓ", "ለ", "እ", "ን")


def _setup(workdir: Path, wd_only_on_weights: bool):
    tiny = build_tiny_xtts(workdir / "tiny")
    vocab = tiny.extend_vocab(NEW_TOKENS, workdir / "ext.json", language="am", tokens=True)
    words = ("ሰላም", "እን", "ለም", "ዓለም")
    manifest = tiny.write_manifest(
        [f"{t} {words[i % 4]}" for i, t in enumerate(tiny.texts)], "metadata_mixed.csv")
    config = tiny.make_config(workdir / "run", vocab=vocab, manifest=manifest,
                              optimizer_wd_only_on_weights=wd_only_on_weights)
    return tiny, config


def _batches(tiny, config, model, n: int) -> list[dict]:
    loader = model.get_data_loader(config, samples=tiny.samples(config))
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(model.format_batch_on_device(batch))
            if len(out) == n:
                break
    return out


def _step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    _, losses = model.train_step(dict(batch), None)
    losses["loss"].backward()
    opt.step()


def _hook_only(gpt, rows) -> list:
    """The common fix: a gradient hook that zeroes the base rows' gradients."""
    handles = []
    for p in (gpt.text_embedding.weight, gpt.text_head.weight, gpt.text_head.bias):
        def mask(g, rows=rows):
            g = g.clone()
            for r in rows:
                g[r.start:r.stop] = 0
            return g
        handles.append(p.register_hook(mask))
    return handles


def drift(workdir: Path, steps: int, wd_only_on_weights: bool) -> dict[str, dict[str, float]]:
    result = {}
    for method in ("none", "grad hook only", "freeze_base_vocab"):
        tiny, config = _setup(workdir / f"d{int(wd_only_on_weights)}_{method[:4]}",
                              wd_only_on_weights)
        torch.manual_seed(0)
        model = tiny.make_model(config)
        gpt = model.xtts.gpt
        vocab = gpt.text_embedding.weight.shape[0]
        rows = frozen_rows(vocab, BASE, start_row_last=start_row_is_last(gpt, vocab))
        batches = _batches(tiny, config, model, steps)
        model.eval()
        gpt.train()
        opt = model.get_optimizer()
        tensors = {"text_embedding.weight": gpt.text_embedding.weight,
                   "text_head.weight": gpt.text_head.weight, "text_head.bias": gpt.text_head.bias}
        before = {k: torch.cat([v.detach()[r.start:r.stop] for r in rows]).clone()
                  for k, v in tensors.items()}
        if method == "grad hook only":
            _hook_only(gpt, rows)
        elif method == "freeze_base_vocab":
            freeze_base_vocab(model, BASE)
        for batch in batches:
            _step(model, opt, batch)
        result[method] = {
            k: (torch.cat([v.detach()[r.start:r.stop] for r in rows]) - before[k]).abs().max().item()
            for k, v in tensors.items()}
    return result


def overhead(workdir: Path, repeats: int) -> dict[str, float]:
    tiny, config = _setup(workdir / "overhead", True)
    torch.manual_seed(0)
    model = tiny.make_model(config)
    gpt = model.xtts.gpt
    batch = _batches(tiny, config, model, 1)[0]
    model.eval()
    gpt.train()
    opt = model.get_optimizer()
    for _ in range(5):  # warm-up
        _step(model, opt, batch)
    times: dict[str, list[float]] = {"on": [], "off": []}
    handle = None
    for i in range(2 * repeats):
        mode = "on" if i % 2 == 0 else "off"
        if mode == "on":
            handle = freeze_base_vocab(model, BASE)
        start = time.perf_counter()
        _step(model, opt, batch)
        times[mode].append(time.perf_counter() - start)
        if handle is not None:
            handle.remove()
            handle = None
    med = {m: statistics.median(t) for m, t in times.items()}
    q = {m: statistics.mean(sorted(t)[: max(1, len(t) // 4)]) for m, t in times.items()}
    return {"median_on_ms": med["on"] * 1e3, "median_off_ms": med["off"] * 1e3,
            "ratio_median": med["on"] / med["off"],
            "fast_quarter_on_ms": q["on"] * 1e3, "fast_quarter_off_ms": q["off"] * 1e3,
            "ratio_fast_quarter": q["on"] / q["off"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("training_patches").setLevel(logging.WARNING)
    logging.getLogger("TTS").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"machine: {platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}\n")
        print(f"## (a) drift of base rows after {args.steps} AdamW steps (lr 1e-3, wd 0.01), "
              f"tiny XTTS GPT, vocabulary 74 -> 82\n")
        print("| weight decay on | method | text_embedding.weight | text_head.weight "
              "| text_head.bias |")
        print("|---|---|---|---|---|")
        for wd_only in (True, False):
            res = drift(work, args.steps, wd_only)
            for method, d in res.items():
                print(f"| {'weights only' if wd_only else 'all parameters'} | {method} | "
                      f"{d['text_embedding.weight']:.3g} | {d['text_head.weight']:.3g} | "
                      f"{d['text_head.bias']:.3g} |")
        res = overhead(work, args.repeats)
        print(f"\n## (b) step time, freeze on vs off, interleaved ({args.repeats} pairs, "
              f"forward + backward + AdamW step, batch 2)\n")
        print("| statistic | freeze on (ms) | freeze off (ms) | ratio on/off |")
        print("|---|---|---|---|")
        print(f"| median | {res['median_on_ms']:.2f} | {res['median_off_ms']:.2f} | "
              f"{res['ratio_median']:.3f} |")
        print(f"| fastest quarter (floor) | {res['fast_quarter_on_ms']:.2f} | "
              f"{res['fast_quarter_off_ms']:.2f} | {res['ratio_fast_quarter']:.3f} |")


if __name__ == "__main__":
    main()
