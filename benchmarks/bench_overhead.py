"""Step-time overhead of the patches and import overhead of the activation line.

Step time: a small transformer training step on the CPU, patched vs unpatched,
interleaved in one process (blocks alternate, order flipped each round) so that
drift of the machine hits both alike. Reported as the ratio of median step times.

Import time: ``from utils import training_patches`` after ``import torch``, in
fresh interpreters (median of several).

Run: .venv/bin/python benchmarks/bench_overhead.py [--rounds N] [--steps N] [--only TEXT]
     [--width 128] [--depth 2] [--vocab 0] [--base 12000]
     (--vocab V: a text model, V-row text_embedding and text_head, tokens as input, its
     base rows of --base tokens frozen in the patched blocks: XTTS's size is --width 1024
     --vocab 24000 --base 12000)
     .venv/bin/python benchmarks/bench_overhead.py --import-only
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import patches  # noqa: E402


class TextModel(torch.nn.Module):
    """``make_model``'s layers between a text embedding and a text head of ``vocab`` rows."""

    def __init__(self, vocab: int, body: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.text_embedding = torch.nn.Embedding(vocab, width)
        self.body = body
        self.text_head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.text_head(self.body(self.text_embedding(tokens)))


def make_model(width: int = 128, depth: int = 2, vocab: int = 0) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=width, nhead=max(1, width // 32),
                                             dim_feedforward=2 * width,
                                             batch_first=True, dropout=0.0)
    body = torch.nn.TransformerEncoder(layer, num_layers=depth)
    if vocab:
        return TextModel(vocab, body, width)
    return torch.nn.Sequential(body, torch.nn.Linear(width, width))


def make_data(width: int = 128, vocab: int = 0, generator: torch.Generator | None = None,
              batch: int = 8, length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target): floats for the plain model, token ids for a text model."""
    if vocab:
        tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    return (torch.randn(batch, length, width, generator=generator),
            torch.randn(batch, length, width, generator=generator))


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.dtype == torch.long:  # a text model's logits and token ids
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]),
                                                 y.reshape(-1))
    return torch.nn.functional.mse_loss(out.float(), y)


def block(model: torch.nn.Module, opt: torch.optim.Optimizer, amp: bool, steps: int,
          data: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    """``steps`` training steps with whatever torch names are installed now."""
    x, y = data
    scaler = torch.amp.GradScaler("cpu", init_scale=1024, growth_interval=100) if amp else None
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = loss_of(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        times.append(time.perf_counter() - start)
    return times


def step_ratio(amp: bool, rounds: int, steps: int, names: list[str] | None = None,
               fused: bool = False, width: int = 128, depth: int = 2, vocab: int = 0,
               base: int = 12000) -> dict[str, float]:
    from patches import vocab_freeze

    model = make_model(width, depth, vocab)
    # fused=True: the guard hands its flag to the kernel (found_inf) and reads nothing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    data = make_data(width, vocab)
    # a text model: its base rows frozen in the patched blocks (as BASE_VOCAB would)
    freeze = vocab and (names is None or "vocab_freeze" in names)
    patches.revert()
    block(model, opt, amp, 5, data)  # warm-up
    timed: dict[str, list[float]] = {"patched": [], "unpatched": []}
    ratios = []  # per round: the two neighbouring blocks share the machine's state
    for r in range(rounds):
        order = ["patched", "unpatched"] if r % 2 == 0 else ["unpatched", "patched"]
        block_median = {}
        for mode in order:
            if mode == "patched":
                patches.advanced.apply(names, quiet=True)
                handle = patches.advanced.freeze_base_vocab(model, base) if freeze else None
                block(model, opt, amp, 1, data)  # a new freeze's first step: one-time work
            else:
                patches.revert()
                for handle in vocab_freeze.live_freezes():
                    handle.remove()
            times = block(model, opt, amp, steps, data)
            timed[mode] += times
            block_median[mode] = statistics.median(times)
        ratios.append(block_median["patched"] / block_median["unpatched"])
    patches.revert()
    med = {k: statistics.median(v) for k, v in timed.items()}
    return {"patched_ms": med["patched"] * 1e3, "unpatched_ms": med["unpatched"] * 1e3,
            "ratio": statistics.median(ratios)}


def cuda_syncs_per_step(steps: int = 20) -> str:
    """Synchronizing calls per step reported by torch on a CUDA GPU, guard on vs off."""
    if not torch.cuda.is_available():
        return "not measured (no CUDA GPU on this machine)"
    import warnings

    results = {}
    for label, names, fused in (("off", [], False), ("on, AdamW", ["nan_guard"], False),
                                ("on, fused AdamW", ["nan_guard"], True)):
        patches.revert()
        if names:
            patches.advanced.apply(names, quiet=True)
        model = make_model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, capturable=not fused)
        x = torch.randn(8, 64, 128, device="cuda")
        block(model, opt, False, 3, (x, x))
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            block(model, opt, False, steps, (x, x))
            torch.cuda.set_sync_debug_mode(0)
        results[label] = sum("synchroniz" in str(w.message) for w in caught) / steps
    patches.revert()
    return ", ".join(f"{k}: {v:g}" for k, v in results.items())


def import_overhead(runs: int = 7) -> float:
    """Median seconds of ``from utils import training_patches`` after torch, in ``runs`` fresh
    interpreters. The package is byte-compiled first, as an installed one is: without its
    .pyc files (``PYTHONDONTWRITEBYTECODE=1`` shells) every import compiles the sources,
    which more than doubles the figure."""
    import compileall

    for folder in ("patches", "utils"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=1)
    code = ("import time; t=time.perf_counter(); from utils import training_patches; "
            "print(time.perf_counter()-t)")
    pre = "import torch; "
    env = dict(os.environ, TRAINING_PATCHES_QUIET="1")
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", pre + code], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
        samples.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def runtime_lines() -> str:
    """What ``import patches.auto`` loads (issue 40's runtime): its modules and their lines,
    counted in a fresh interpreter."""
    code = ("import sys, torch, patches.auto\n"
            "mods = [m for m in sys.modules if m == 'patches' or m.startswith('patches.')]\n"
            "files = [sys.modules[m].__file__ for m in mods if getattr(sys.modules[m], '__file__', None)]\n"
            "print(len(mods), sum(sum(1 for _ in open(f, encoding='utf-8')) for f in files))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                         env=dict(os.environ, TRAINING_PATCHES_QUIET="1"),
                         capture_output=True, text=True, check=True).stdout.split()
    return f"{out[-2]} modules, {out[-1]} lines"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier timings on a shared 2-core machine)")
    parser.add_argument("--import-only", action="store_true",
                        help="measure only the import time (median of 7 fresh interpreters)")
    parser.add_argument("--width", type=int, default=128, help="channels of the model")
    parser.add_argument("--depth", type=int, default=2, help="transformer layers")
    parser.add_argument("--vocab", type=int, default=0,
                        help="a text model of this many rows (0: the plain model)")
    parser.add_argument("--base", type=int, default=12000,
                        help="with --vocab: base tokens frozen in the patched blocks")
    parser.add_argument("--only", default="",
                        help="run only the step rows whose label contains this text "
                             "(e.g. 'fused')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__},"
          f" threads {torch.get_num_threads()}")
    if args.import_only:
        print(f"import utils.training_patches after torch: {import_overhead() * 1e3:.1f} ms "
              f"(median of 7); it loads {runtime_lines()}")
        return
    print("| step (CPU, small transformer) | unpatched ms | patched ms | ratio (median of rounds) |")
    print("|---|---|---|---|")
    for label, amp, names, fused in (
            ("fp32 + clip, all default patches", False, None, False),
            ("fp32 + clip, nan_guard only", False, ["nan_guard"], False),
            ("fp32 + clip, nan_guard + grad_clip (one shared norm)", False,
             ["nan_guard", "grad_clip"], False),
            ("fp32 + clip, fused AdamW, all default patches", False, None, True),
            ("fp32 + clip, fused AdamW, nan_guard + grad_clip", False,
             ["nan_guard", "grad_clip"], True),
            ("fp16 autocast + GradScaler + clip, all default patches", True, None, False)):
        if args.only not in label:
            continue
        r = step_ratio(amp, args.rounds, args.steps, names, fused, args.width, args.depth,
                       args.vocab, args.base)
        print(f"| {label} | {r['unpatched_ms']:.2f} | {r['patched_ms']:.2f} | {r['ratio']:.3f} |")
    if args.only:
        return
    syncs = cuda_syncs_per_step()
    print(f"\nCUDA host syncs per guarded step (set_sync_debug_mode): {syncs}")
    print(f"\nimport utils.training_patches after torch: {import_overhead() * 1e3:.1f} ms (median)")


if __name__ == "__main__":
    main()
