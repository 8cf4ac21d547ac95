"""Base-vocabulary freeze: drift of the "frozen" rows and the cost per training step.

(a) drift: the common gradient-hook-only "freeze" versus ``freeze_base_vocab``, on the
    tiny XTTS GPT with an extended vocabulary (74 -> 82 rows), AdamW weight decay 0.01,
    N steps, decay on weights only (XTTS's ``optimizer_wd_only_on_weights``) and on all
    parameters. Drift = max |row now - row before| over the base rows.
(b) overhead: step time (forward, backward, AdamW step) of the tiny XTTS GPT on the CPU
    with the freeze on and off, interleaved in one process (on, off, on, off, ...),
    reported as the ratio of medians and of the fastest quarter.

(c) at a real size (``--width``): a stand-in text model with the tensors the freeze works
    on at XTTS v2's size (``text_embedding`` vocab x width, ``text_head`` width -> vocab
    with its bias) around ``--depth`` transformer layers, AdamW (weight decay 0.01, plain
    or ``--fused``), the base rows of ``--base`` tokens frozen. Blocks of steps with the
    freeze on and off alternate (the order flipped every round); reported: the step time
    on and off (median), the library's own time per step measured inside the step (every
    hook of the freeze timed: its gradient hook, its optimizer step pre- and post-hooks),
    and the memory it keeps (its stored copy of the base rows). Times inside the step are
    the thread's CPU time (``time.thread_time``): on a shared machine the wall clock also
    counts the time other processes held the core. Forward and backward are the same in
    every mode; held, the optimizer also steps only the trainable rows of the two tensors.

Run:  .venv/bin/python benchmarks/bench_vocab_freeze.py [--steps 12] [--repeats 40]
      .venv/bin/python benchmarks/bench_vocab_freeze.py --width 1024 --depth 2 \
          --vocab 24000 --base 12000 [--fused] [--rounds 4] [--block 4]
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

from patches.advanced import freeze_base_vocab  # noqa: E402
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


class StandIn(torch.nn.Module):
    """The vocabulary tensors of a text GPT at a given size around ``depth`` layers."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.text_embedding = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, max(1, width // 64), 2 * width,
                                                 dropout=0.0, batch_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, depth)
        self.text_head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.text_head(self.layers(self.text_embedding(tokens)))


_HOOK_TIMES: list[float] = []


def _timed_hooks() -> list[float]:
    """Time every hook of the freeze (those this version of it has) into one list, once per
    process and before any freeze registers them (the global hooks keep the function they
    were registered with): the library's own time inside the step."""
    from patches import vocab_freeze as vf

    sink = _HOOK_TIMES
    if getattr(vf, "_bench_timed", False):
        return sink
    vf._bench_timed = True

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.thread_time()  # CPU time: a shared machine's preemptions left out
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(time.thread_time() - start)
        return wrapper
    for name in ("_after_any_step", "_before_any_step", "_before_this_step",
                 "_after_this_step"):
        if hasattr(vf, name):
            setattr(vf, name, timed(getattr(vf, name)))
    vf.VocabFreeze._zero_grad_rows = timed(vf.VocabFreeze._zero_grad_rows)
    return sink


MODES = ("off", "copy back", "held")


def real_size(width: int, depth: int, vocab: int, base: int, fused: bool, rounds: int,
              block: int, batch: int = 2, length: int = 32) -> dict[str, dict[str, float]]:
    """Blocks of steps in three modes, interleaved (the order rotated every round): the
    freeze off; on, with every step's base rows copied back (the mechanism before issue 41,
    which this version keeps for optimizers it cannot hold off the rows: forced here by
    emptying its list of row-wise optimizers); on, with AdamW held off the frozen rows."""
    from patches import vocab_freeze as vf

    row_wise = getattr(vf, "_ROW_WISE", ())
    hooks = _timed_hooks()
    torch.manual_seed(0)
    model = StandIn(vocab, width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
    tokens = torch.randint(0, vocab, (batch, length + 1))

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                          tokens[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - start, time.thread_time() - cpu

    for _ in range(2):
        step()  # warm-up, optimizer state made
    modes = MODES if row_wise else MODES[:2]  # a version without the held path
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    library: dict[str, list[float]] = {m: [] for m in modes}
    kept: dict[str, list[int]] = {m: [] for m in modes}
    for r in range(rounds):
        medians = {}
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            vf._ROW_WISE = row_wise if mode == "held" else ()
            handle = freeze_base_vocab(model, base) if mode != "off" else None
            step()  # the first step under a new freeze (one-time work) is not timed
            hooks.clear()
            walls, cpus = zip(*(step() for _ in range(block)))
            times[mode] += walls
            cpu[mode] += cpus
            medians[mode] = statistics.median(cpus)
            library[mode].append(sum(hooks) / block)
            if handle is not None:
                kept[mode].append(sum(e.stored.numel() * e.stored.element_size()
                                      for e in handle._entries if e.stored is not None))
                handle.remove()
        for mode in modes:  # per round: neighbouring blocks share the machine's state
            ratios[mode].append(medians[mode] / medians["off"])
    vf._ROW_WISE = row_wise
    assert not vf.live_freezes()
    out = {}
    for mode in modes:
        out[mode] = {"step_ms": statistics.median(times[mode]) * 1e3,
                     "cpu_ms": statistics.median(cpu[mode]) * 1e3,
                     "ratio": statistics.median(ratios[mode]),
                     "library_ms": statistics.median(library[mode]) * 1e3,
                     "kept_mib": max(kept[mode] or [0]) / 2 ** 20}
    out["model"] = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, nargs="*", default=[],
                        help="(c) only: channels of the stand-in model (several: one row each)")
    parser.add_argument("--depth", type=int, default=2, help="(c): transformer layers")
    parser.add_argument("--vocab", type=int, default=24000, help="(c): text rows")
    parser.add_argument("--base", type=int, default=12000, help="(c): base tokens frozen")
    parser.add_argument("--fused", action="store_true", help="(c): fused AdamW")
    parser.add_argument("--rounds", type=int, default=4, help="(c): rounds of on/off blocks")
    parser.add_argument("--block", type=int, default=4, help="(c): timed steps a block")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("training_patches").setLevel(logging.WARNING)
    logging.getLogger("TTS").setLevel(logging.WARNING)
    if args.width:
        print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s), "
              f"torch {torch.__version__}; {args.vocab} rows, {args.base} base tokens frozen, "
              f"depth {args.depth}, AdamW{' fused' if args.fused else ''} wd 0.01, clip 1.0, "
              f"{args.rounds} rounds x {args.block} steps a block\n")
        print("| width | params (M) | mode | step wall (ms, median) | step CPU (ms, median) "
              "| CPU ratio to off (median of rounds) | library's own CPU time in the step "
              "(ms, median of blocks) | stored copy kept (MiB) |")
        print("|---|---|---|---|---|---|---|---|")
        for width in args.width:
            r = real_size(width, args.depth, args.vocab, args.base, args.fused, args.rounds,
                          args.block)
            for mode in MODES:
                if mode in r:
                    m = r[mode]
                    print(f"| {width} | {r['model']['params_m']:.1f} | {mode} | "
                          f"{m['step_ms']:.1f} | {m['cpu_ms']:.1f} | {m['ratio']:.3f} | "
                          f"{m['library_ms']:.2f} | {m['kept_mib']:.1f} |", flush=True)
        return

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
