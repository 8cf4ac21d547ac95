"""``training-patches``: the tools around a training run.

    training-patches doctor              what this machine can train with, and what is missing
    training-patches report RUN_DIR      a run's health from the files the patches wrote

Both print for a person and exit non-zero when something needs attention.
"""

from __future__ import annotations

import argparse
import collections
import ctypes.util
import importlib.metadata
import json
import os
import sys
from typing import Any, Sequence

OK, WARN, FAIL = "ok  ", "warn", "FAIL"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_checks() -> list[tuple[str, str, str]]:
    """(status, what, detail) for each thing a fine-tune needs."""
    import torch

    checks: list[tuple[str, str, str]] = []
    checks.append((OK, "python", sys.version.split()[0]))
    checks.append((OK, "torch", torch.__version__))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            major, minor = torch.cuda.get_device_capability(i)
            bf16 = torch.cuda.is_bf16_supported()
            precision = "bf16" if bf16 else "fp16 with SafeGradScaler (no bf16 on this GPU)"
            checks.append((OK, f"cuda:{i}", f"{name}, compute {major}.{minor}, "
                                            f"use {precision}"))
    else:
        checks.append((WARN, "cuda", "no CUDA GPU: training runs on the CPU in fp32 (demo and "
                                     "tests only; a real fine-tune needs a GPU)"))
    for dist, why in (("wrapt", "patching"), ("numpy", "data"), ("sentencepiece", "tokenizers"),
                      ("coqui-tts", "XTTS (extra 'xtts')"),
                      ("coqui-tts-trainer", "the coqui Trainer"),
                      ("torchaudio", "audio (extra 'xtts')"), ("torchcodec", "audio decoding"),
                      ("six", "imported by coqui-tts, not declared by it")):
        version = _version(dist)
        required = dist in ("wrapt", "numpy", "sentencepiece")
        status = OK if version else (FAIL if required else WARN)
        checks.append((status, dist, version or f"missing: needed for {why}"))
    ffmpeg = ctypes.util.find_library("avutil")
    checks.append((OK if ffmpeg else WARN, "ffmpeg",
                   ffmpeg or "FFmpeg shared libraries missing: audio cannot be decoded "
                             "(Debian/Ubuntu: apt-get install ffmpeg)"))
    import patches

    applied = patches.applied()
    checks.append((OK, "patches", ", ".join(applied) if applied else
                   "none applied in this process (the trainer applies them with "
                   "`from utils import training_patches`)"))
    env = {k: v for k, v in os.environ.items() if k.startswith("TRAINING_PATCHES_")}
    if env:
        checks.append((OK, "settings", ", ".join(f"{k}={v}" for k, v in sorted(env.items()))))
    return checks


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], int]:
    """Records of a JSON-lines file and the number of lines that were not JSON."""
    records, broken = [], 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                broken += 1
    return records, broken


def report(run_dir: str) -> tuple[list[str], bool]:
    """Lines describing a run's health, and whether it looks healthy."""
    lines = [f"run: {run_dir}"]
    healthy = True
    events_path = os.path.join(run_dir, "nonfinite_events.jsonl")
    if os.path.exists(events_path):
        events, broken = _read_jsonl(events_path)
        kinds = collections.Counter(e.get("kind", "?") for e in events)
        lines.append(f"skipped steps: {len(events)} ({', '.join(f'{k} {n}' for k, n in kinds.items())})")
        if events:
            first, last = events[0], events[-1]
            lines.append(f"first bad step: {first.get('step')} (trainer step "
                         f"{first.get('trainer_step')}), last: {last.get('step')}")
            samples = collections.Counter(s for e in events for s in e.get("samples") or [])
            if samples:
                lines.append("samples seen most in bad batches: " + ", ".join(
                    f"{s} ({n})" for s, n in samples.most_common(5)))
            sources = [e["source"] for e in events if e.get("source")]
            if sources:
                lines.append(f"where the first NaN appeared: {sources[0]}")
            longest = max(int(e.get("consecutive") or 1) for e in events)
            lines.append(f"longest streak of skipped steps: {longest}")
            healthy = healthy and longest < 5
        if broken:
            lines.append(f"{broken} unreadable line(s) in {events_path}")
    else:
        lines.append("skipped steps: none recorded (no nonfinite_events.jsonl)")
    dropped_path = os.path.join(run_dir, "dropped_samples.jsonl")
    if os.path.exists(dropped_path):
        dropped, _ = _read_jsonl(dropped_path)
        reasons = collections.Counter(d.get("reason", "?") for d in dropped)
        lines.append(f"dropped samples: {len(dropped)} ("
                     + ", ".join(f"{r} {n}" for r, n in reasons.items()) + ")")
        healthy = healthy and not dropped
    return lines, healthy


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="training-patches", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check this machine for what a fine-tune needs")
    rep = sub.add_parser("report", help="summarise a run from the files the patches wrote")
    rep.add_argument("run_dir", help="the run's output folder")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        checks = doctor_checks()
        width = max(len(what) for _, what, _ in checks)
        for status, what, detail in checks:
            print(f"[{status}] {what:<{width}}  {detail}")
        return 1 if any(status == FAIL for status, _, _ in checks) else 0
    if not os.path.isdir(args.run_dir):
        print(f"training-patches report: {args.run_dir} is not a folder. Give the run's output "
              f"folder (the one holding nonfinite_events.jsonl or the checkpoints).",
              file=sys.stderr)
        return 2
    lines, healthy = report(args.run_dir)
    print("\n".join(lines))
    print("health:", "OK" if healthy else "needs a look (see above)")
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
