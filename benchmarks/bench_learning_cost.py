"""What the reading gap costs (issue 37, item 6): one measurement against one training step
and one evaluation of the real coqui XTTS GPT at XTTS v2's width, and as a share of a
training hour at the coqui Trainer's default cadence (one evaluation per epoch).

The model is coqui-tts's own ``GPT`` (``TTS.tts.layers.xtts.gpt``) at 1,024 channels, 16
heads, perceiver conditioning, 6,681 text rows and 1,026 audio codes (XTTS v2's sizes; the
layer count is ``--layers``: 30 in XTTS v2, fewer here for a CPU). The utterances are
XTTS-shaped: 7 s of audio (151 codes), 90 text tokens, a 6 s conditioning clip. In one
process, interleaved: a training step (batch 2, AdamW, what the T4 preset runs), the
coqui evaluation of ``--eval`` utterances (batch 2, forward only) and the probe of
:mod:`patches.learning` (32 utterances of one language, own and other texts, batch 16,
through :func:`patches.integrations.coqui_learning.audio_losses`).

From them: the probe as a share of one evaluation, and of a training hour for datasets of
several sizes when the Trainer evaluates once per epoch, with and without the library's
time budget (``reading_budget``, 2%: an evaluation that comes sooner than 50 x the last
measurement's time after it is left out). Nothing of the probe runs inside a step: it
runs after the Trainer's evaluation (tests/test_learning_coqui.py checks that).

Run:  .venv/bin/python benchmarks/bench_learning_cost.py [--layers N] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

CODE_SAMPLES = 1024  # audio samples per XTTS code at 22.05 kHz
SECONDS, TEXT_TOKENS, COND_FRAMES = 7.0, 90, 517


def build(layers: int):
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from TTS.tts.layers.xtts.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(start_text_token=6680, stop_text_token=0, layers=layers, model_dim=1024, heads=16,
              max_text_tokens=402, max_mel_tokens=605, max_prompt_tokens=70,
              number_text_tokens=6681, num_audio_tokens=1026, start_audio_token=1024,
              stop_audio_token=1025, use_perceiver_resampler=True)

    class Holder(torch.nn.Module):  # what coqui_learning reads: model.xtts.gpt
        def __init__(self) -> None:
            super().__init__()
            self.xtts = torch.nn.Module()
            self.xtts.gpt = gpt
    return Holder()


def utterance(seed: int) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    wav = int(SECONDS * 22050) - seed * 997
    codes = -(-wav // CODE_SAMPLES) + 3
    text = torch.randint(1, 6680, (TEXT_TOKENS - seed % 7,), generator=g)
    return text, {"codes": torch.randint(0, 1024, (codes,), generator=g), "wav_length": wav,
                  "cond_mels": torch.randn(1, 80, COND_FRAMES, generator=g), "cond_len": None}


def batch_of(items):
    from patches.integrations.coqui_learning import _pad

    texts, audios = [t for t, _ in items], [a for _, a in items]
    return (_pad(texts), torch.tensor([len(t) for t in texts]),
            _pad([a["codes"] for a in audios]), torch.tensor([a["wav_length"] for a in audios]),
            _pad([a["cond_mels"] for a in audios]))


def train_step(model, opt, items) -> None:
    text, t_len, codes, wav, cond = batch_of(items)
    model.train()
    loss_text, loss_mel, _ = model.xtts.gpt(text, t_len, codes, wav, cond_mels=cond)
    (0.01 * loss_text + loss_mel).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def evaluation(model, items) -> None:
    model.eval()
    with torch.no_grad():
        for start in range(0, len(items), 2):
            text, t_len, codes, wav, cond = batch_of(items[start:start + 2])
            model.xtts.gpt(text, t_len, codes, wav, cond_mels=cond)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="GPT layers (XTTS v2: 30)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--eval", type=int, default=32, help="utterances in one evaluation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from patches import learning
    from patches.integrations.coqui_learning import audio_losses

    model = build(args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6)
    pool = [utterance(i) for i in range(64)]
    probe = learning.ReadingProbe({"am": pool[:32]})
    train_step(model, opt, pool[:2])  # warm-up: allocations, AdamW's state
    times: dict[str, list[float]] = {"step": [], "evaluation": [], "probe": []}
    for r in range(args.rounds):
        jobs = [("step", lambda: train_step(model, opt, pool[2 * r:2 * r + 2])),
                ("evaluation", lambda: evaluation(model, pool[32:32 + args.eval])),
                ("probe", lambda: learning.reading_gap(model, probe, audio_losses))]
        for name, job in (jobs if r % 2 == 0 else jobs[::-1]):
            start = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"coqui XTTS GPT, {args.layers} layers x 1024 ({params / 1e6:.0f} M parameters), "
          f"{torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}; medians of "
          f"{args.rounds} interleaved rounds")
    print(f"\n| what | seconds | |\n|---|---|---|\n"
          f"| one training step (batch 2, 7 s clips) | {med['step']:.2f} | |\n"
          f"| one evaluation ({args.eval} utterances, batch 2) | {med['evaluation']:.2f} | |\n"
          f"| the reading gap (32 utterances, own + other text) | {med['probe']:.2f} | "
          f"{med['probe'] / med['evaluation']:.0%} of the evaluation, "
          f"{med['probe'] / med['step']:.1f} training steps |")
    print("\nShare of a training hour, one evaluation per epoch (the coqui default), batch 2:\n")
    print("| clips in the training set | epoch | probe share, every evaluation | with "
          "reading_budget 2% |\n|---|---|---|---|")
    for clips in (250, 1000, 5000, 20000):
        epoch = clips / 2 * med["step"] + med["evaluation"]
        share = med["probe"] / (epoch + med["probe"])
        print(f"| {clips:,} | {epoch / 60:.0f} min | {share:.2%} | {min(share, 0.02):.2%} |")


if __name__ == "__main__":
    main()
