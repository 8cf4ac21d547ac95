"""Step-time ratio, patched/unpatched, of the real coqui Trainer on the tiny XTTS GPT (CPU).

The workload of ``headlessXttsTrain.py`` at its smallest: ``Trainer.train_step`` of a
2-layer, 64-channel XTTS GPT (DVAE encoding of the clips included, as in every real step),
fp32, AdamW with ``fused=True`` as the headless script builds it, gradient clipping 1.0.
A fresh Trainer per mode and round, the order flipped every round; the ratio is the median
over rounds of the per-round ratios of median step times (benchmarks/gpu/gpu_harness.py's
``compare_modes``, the comparison the GPU suite makes, here with ``device="cpu"``).

    .venv/bin/python benchmarks/bench_coqui_step.py --rounds 8 --steps 12
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "gpu")]

import torch  # noqa: E402


class _NoCount:
    """compare_modes wants a counter; step times are what this benchmark measures."""
    count = 0

    @contextlib.contextmanager
    def counting(self):
        yield self


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-fused", action="store_true", help="plain AdamW instead")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import gpu_harness as harness
    import patches
    from demo.xtts_tiny import build_tiny_xtts

    patches.revert()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_xtts(Path(tmp) / "tiny", seed=0)
        result = harness.compare_modes(
            tiny, lambda mode: harness.make_config(tiny, Path(tmp) / mode, precision="fp32",
                                                   fused=not args.no_fused),
            rounds=args.rounds, steps=args.steps, warmup=3, device="cpu", counter=_NoCount)
    label = "plain" if args.no_fused else "fused"
    print(f"machine: {os.uname().machine}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"threads 1")
    print("| step (CPU, coqui Trainer, tiny XTTS GPT, fp32) | unpatched ms | patched ms | ratio |")
    print("|---|---|---|---|")
    print(f"| AdamW {label}, all default patches | {result['unpatched']['step_ms']:.1f} | "
          f"{result['patched']['step_ms']:.1f} | {result['step_time_ratio']:.3f} |")


if __name__ == "__main__":
    main()
