"""Peak resident memory of loading a checkpoint, against the checkpoint's size.

Target (issue 5): ``load_checkpoint`` peaks at no more than 1.3x the file's size above
the process's resident memory before the load (model and optimizer already built).

Each measurement runs in a fresh subprocess: import torch and patches, build the model
and the (empty) optimizer, reset the kernel's high-water mark (``/proc/self/clear_refs``
``5``), take ``VmRSS``, load, and read ``VmHWM``; ``ru_maxrss`` is reported beside it.
Compared: ``patches.load_checkpoint`` (``torch.load(mmap=True, weights_only=True)``, the
SHA-256 of the manifest verified and every tensor checked for NaN/Inf before anything is
touched), the same with those checks off (``verify_hash=False, allow_nonfinite=True``),
and the usual ``torch.load(weights_only=True)`` + ``load_state_dict`` of both states.
Each line also gives the load's wall time (the checks read the file once more).

Run: ``.venv/bin/python benchmarks/bench_checkpoint_memory.py [--vocab 24000] [--hidden 1024]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _build(vocab: int, hidden: int, layers: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Module()
    model.text_embedding = nn.Embedding(vocab, hidden)
    model.body = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    model.text_head = nn.Linear(hidden, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def write(path: Path, vocab: int, hidden: int, layers: int) -> int:
    import torch

    from patches.checkpoint import CheckpointManager

    model, optimizer = _build(vocab, hidden, layers)
    for p in model.parameters():  # one real step so the Adam moments exist
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    saved = CheckpointManager(path, keep=None).save(1, model, optimizer)
    return saved.stat().st_size


def measure(path: str, vocab: int, hidden: int, layers: int, how: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from patches.checkpoint import load_checkpoint

    model, optimizer = _build(vocab, hidden, layers)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if how == "load_checkpoint":
        load_checkpoint(path, model, optimizer, freeze=False)
    elif how == "load_checkpoint-unchecked":
        load_checkpoint(path, model, optimizer, freeze=False, verify_hash=False,
                        allow_nonfinite=True)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"][0])
        del state
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"how": how, "rss_before": before, "peak": peak, "peak_delta": peak - before,
            "ru_maxrss_delta": ru_after - max(ru_before, before),
            "rss_after_delta": _status("VmRSS") - before, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=24000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--child", nargs=2, metavar=("PATH", "HOW"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.vocab, args.hidden, args.layers,
                                 args.child[1])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        size = write(Path(tmp), args.vocab, args.hidden, args.layers)
        path = str(next(Path(tmp).glob("ckpt_*.pt")))
        print(f"machine: {platform.machine()} {os.cpu_count()} cpus, {platform.platform()}, "
              f"python {platform.python_version()}")
        print(f"checkpoint: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
              f"AdamW state: {size / 2**20:.1f} MiB")
        for how in ("load_checkpoint", "load_checkpoint-unchecked", "torch.load+load_state_dict"):
            out = subprocess.run(
                [sys.executable, "-W", "ignore", __file__, "--vocab", str(args.vocab),
                 "--hidden", str(args.hidden), "--layers", str(args.layers),
                 "--child", path, how],
                cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), TRAINING_PATCHES_QUIET="1"),
                check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"{how:28s} peak +{result['peak_delta'] / 2**20:7.1f} MiB = "
                  f"{result['peak_delta'] / size:.2f}x file  (ru_maxrss +"
                  f"{result['ru_maxrss_delta'] / 2**20:.1f} MiB, after +"
                  f"{result['rss_after_delta'] / 2**20:.1f} MiB), {result['seconds']:.2f} s")


if __name__ == "__main__":
    main()
