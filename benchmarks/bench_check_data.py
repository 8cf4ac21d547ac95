"""``training-patches check-data`` throughput: clips per second on 1 worker and on all cores.

Generates ``--clips`` speech-like 22.05 kHz 16-bit mono clips (WAV, or ``--format flac``) (2-10 s, slices of
demo.xtts_tiny.speech_like) with Amharic transcripts and a coqui manifest in a temporary
folder, then runs :func:`patches.tools.check_data.check_manifest` on it with 1 worker and with
``--workers`` (default: all cores), ``--rounds`` times each, alternating. Also measured on
1 core: decoding alone (soundfile), to show how much of a clip's time is decoding. The CPU
seconds of all processes (the parent and the pool's workers) show what the pool costs: on a
machine whose cores are busy with other work, wall time cannot show the scaling.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ["ሰላም", "እንዴት", "ነህ", "ዛሬ", "ጥሩ", "ቀን", "ነው", "አዲስ", "አበባ", "ከተማ", "ቤት",
         "ትምህርት", "መጽሐፍ", "ውሃ", "ቡና", "እናት", "አባት", "ልጅ", "ገበያ", "መንገድ"]


def make_dataset(folder: Path, clips: int, fmt: str = "wav", seed: int = 0) -> tuple[Path, float]:
    """``clips`` WAV files and their manifest; returns the manifest and the audio seconds."""
    import numpy as np
    import soundfile as sf

    from demo.xtts_tiny import SAMPLE_RATE, speech_like

    rng = np.random.RandomState(seed)
    source = np.concatenate([speech_like(30.0, seed + k) for k in range(4)])
    (folder / "wavs").mkdir(parents=True, exist_ok=True)
    total = 0.0
    manifest = folder / "metadata.csv"
    with manifest.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="|", lineterminator="\n")
        writer.writerow(["audio_file", "text", "speaker_name"])
        for i in range(clips):
            seconds = float(rng.uniform(2.0, 10.0))
            n = int(seconds * SAMPLE_RATE)
            start = rng.randint(0, len(source) - n)
            name = f"wavs/clip_{i:05d}.{fmt}"
            sf.write(folder / name, source[start:start + n], SAMPLE_RATE, subtype="PCM_16")
            words: list[str] = []
            while sum(map(len, words)) < 3.5 * seconds:
                words.append(WORDS[rng.randint(len(WORDS))])
            writer.writerow([name, " ".join(words) + "።", f"speaker{i % 4}"])
            total += n / SAMPLE_RATE
    return manifest, total


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--format", choices=("wav", "flac"), default="wav",
                        help="audio files to generate (FLAC costs more to decode)")
    args = parser.parse_args()

    import soundfile as sf

    from patches.tools.check_data import CheckDataOptions, check_manifest

    with tempfile.TemporaryDirectory(prefix="bench_check_data_") as tmp:
        manifest, audio_seconds = make_dataset(Path(tmp), args.clips, args.format)
        paths = [str(p) for p in sorted((Path(tmp) / "wavs").glob(f"*.{args.format}"))]
        times: dict[str, list[float]] = {"1": [], str(args.workers): [], "decode": []}
        cpu: dict[str, list[float]] = {"1": [], str(args.workers): []}
        for _ in range(args.rounds):
            for workers in (1, args.workers):
                start, cpu_start = time.perf_counter(), _cpu_seconds()
                report, _ = check_manifest(str(manifest), CheckDataOptions(workers=workers,
                                                                             progress=False))
                times[str(workers)].append(time.perf_counter() - start)
                cpu[str(workers)].append(_cpu_seconds() - cpu_start)
                assert report["summary"]["clips"] == args.clips
            start = time.perf_counter()
            for path in paths:
                sf.read(path, dtype="float32", always_2d=True)
            times["decode"].append(time.perf_counter() - start)
    one = statistics.median(times["1"])
    many = statistics.median(times[str(args.workers)])
    decode = statistics.median(times["decode"])
    print(f"{args.clips} {args.format.upper()} clips, {audio_seconds / 60:.1f} min of audio, median of "
          f"{args.rounds} rounds, {os.cpu_count()} CPU cores\n")
    cpu_one = statistics.median(cpu["1"])
    cpu_many = statistics.median(cpu[str(args.workers)])
    print("| run | seconds | clips/s | audio s/s | CPU s (all processes) |")
    print("|---|---|---|---|---|")
    print(f"| check-data, 1 worker | {one:.2f} | {args.clips / one:.0f} | "
          f"{audio_seconds / one:.0f} | {cpu_one:.2f} |")
    print(f"| check-data, {args.workers} workers | {many:.2f} | {args.clips / many:.0f} | "
          f"{audio_seconds / many:.0f} | {cpu_many:.2f} |")
    print(f"| soundfile decode only, 1 core | {decode:.2f} | {args.clips / decode:.0f} | "
          f"{audio_seconds / decode:.0f} | |")
    print(f"\nspeed-up with {args.workers} workers: {one / many:.2f}x; decoding is "
          f"{100 * decode / one:.0f}% of the 1-worker time; the pool costs "
          f"{100 * (cpu_many / cpu_one - 1):+.0f}% CPU time over 1 worker")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
