"""What row_init ``auto``'s reading probe costs at XTTS v2's size, against the load it is part
of: coqui's XTTS ``GPT`` (30 layers x 1024, 16 heads, 6,681 text tokens grown by 1,000, 1,026
audio tokens, perceiver conditioning; random weights), its checkpoint loaded into the grown
model with ``row_init="spelling"`` (no probe) and with ``"auto"`` (the probe), in the same
process; the ratio of the two loads' seconds and the probe's own seconds (its report).

Run: OMP_NUM_THREADS=N .venv/bin/python benchmarks/bench_reads_text_cost.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

BASE_TOKENS = 6681
ADDED = 1000


def gpt(rows: int):
    from TTS.tts.layers.xtts.gpt import GPT  # lazy: the coqui-tts extra

    return GPT(start_text_token=rows - 1, stop_text_token=0, layers=30, model_dim=1024, heads=16,
               max_text_tokens=402, max_mel_tokens=605, max_prompt_tokens=70,
               number_text_tokens=rows, num_audio_tokens=1026, start_audio_token=1024,
               stop_audio_token=1025, use_perceiver_resampler=True)


def vocab(path: Path, tokens: int) -> None:
    """A WordLevel tokenizer of ``tokens`` ids in XTTS's layout ([STOP], [UNK], [SPACE], [en],
    words, [START] last)."""
    from tokenizers import Tokenizer, models  # lazy: --help needs none of it

    words = ["[STOP]", "[UNK]", "[SPACE]", "[en]"]
    words += [f"w{i}" for i in range(tokens - len(words) - 1)] + ["[START]"]
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
              ).save(str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import torch  # lazy: --help needs none of it

    import patches

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base.pt"
        torch.save({"model": gpt(BASE_TOKENS).state_dict()}, base)
        tok = Path(tmp) / "vocab.json"
        vocab(tok, BASE_TOKENS + ADDED)
        model = gpt(BASE_TOKENS + ADDED)
        params = sum(p.numel() for p in model.parameters())
        rows = []
        for _ in range(args.repeats):
            for rule in ("spelling", "auto"):
                t = time.perf_counter()
                report = patches.load_checkpoint(base, model, freeze=False, row_init=rule,
                                                 tokenizer=str(tok))
                rows.append({"rule": rule, "seconds": time.perf_counter() - t,
                             "probe": (report.row_init.get("auto") or {}).get("seconds"),
                             "text_tv": (report.row_init.get("auto") or {}).get("text_tv"),
                             "chose": report.row_init["embedding"]})
    plain = min(r["seconds"] for r in rows if r["rule"] == "spelling")
    auto = min(r["seconds"] for r in rows if r["rule"] == "auto")
    probe = min(r["probe"] for r in rows if r["rule"] == "auto")
    print(json.dumps(rows, indent=1))
    print(f"{params / 1e6:.0f} M parameters, {torch.get_num_threads()} thread(s): load "
          f"{plain:.1f} s without the probe, {auto:.1f} s with it ({auto / plain:.2f}x); the "
          f"probe itself {probe:.1f} s (best of {args.repeats}); {platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")


if __name__ == "__main__":
    main()
