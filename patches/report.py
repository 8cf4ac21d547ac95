"""``training-patches report RUN_DIR``: a run's health from the files the patches wrote."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any

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


def _report(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.run_dir):
        print(f"training-patches report: {args.run_dir} is not a folder. Give the run's output "
              f"folder (the one holding nonfinite_events.jsonl or the checkpoints).",
              file=sys.stderr)
        return 2
    lines, healthy = report(args.run_dir)
    print("\n".join(lines))
    print("health:", "OK" if healthy else "needs a look (see above)")
    return 0 if healthy else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``report`` to the ``training-patches`` command."""
    rep = sub.add_parser("report", help="summarise a run from the files the patches wrote")
    rep.add_argument("run_dir", help="the run's output folder")
    rep.set_defaults(handler=_report)
