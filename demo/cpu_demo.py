"""A one-minute CPU demo of the patches at work: ``python -m demo.cpu_demo``.

Trains a small transformer in fp16 autocast on the CPU with the trainer-style code
most fine-tuning scripts have (a GradScaler built with defaults, clipping), with
overflows injected at known steps, and prints what the patches did. Every figure in
the summary is read from the run.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import patches


def main(argv: list[str] | None = None) -> int:
    """Activate the patches (what the one import line does), then train and summarise."""
    patches.advanced.activate()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--inject", type=int, nargs="*", default=[12, 13, 40],
                        help="steps whose loss is multiplied by inf")
    args = parser.parse_args(argv)
    logging.getLogger("training_patches").setLevel(logging.INFO)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")  # what a trainer writes: becomes a SafeGradScaler
    x = torch.randn(16, 32, 64)
    y = x.roll(1, dims=-1)
    losses = []
    initial_scale = scaler.get_scale()
    start = time.time()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        losses.append(loss.item())
        if step in args.inject:
            loss = loss * float("inf")  # an fp16 overflow, as a T4 produces it
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # then clip the true gradients (torch's documented order)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    stats = patches.stats()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print("\n" + "=" * 64)
    print("training-patches demo summary (CPU, fp16 autocast)")
    print("=" * 64)
    print(f"scaler built by torch.amp.GradScaler(): {type(scaler).__name__}")
    print(f"steps: {stats['grad_scaler']['steps']}, skipped: {stats['grad_scaler']['skipped']} "
          f"(overflows injected at {sorted(args.inject)})")
    print(f"loss scale: started {initial_scale:g}, now {stats['grad_scaler']['scale']:g}")
    print(f"clip calls: {stats['grad_clip']['calls']}, clips of still-scaled gradients: "
          f"{stats['grad_clip']['scaled_clips']}, non-finite norms survived: "
          f"{stats['grad_clip']['nonfinite_norms']}")
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}; every parameter finite: {finite}")
    print(f"time: {time.time() - start:.1f} s")
    ok = finite and stats["grad_scaler"]["skipped"] == len(set(args.inject)) \
        and losses[-1] < losses[0]
    print("result:", "OK" if ok else "UNEXPECTED (see the log above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
