"""A tiny XTTS GPT training setup built from local files only (tests, demos, benchmarks).

Usage::

    from demo.xtts_tiny import build_tiny_xtts
    tiny = build_tiny_xtts(tmp_path / "tiny")                  # vocab, DVAE, mel stats, wavs, manifest
    ext = tiny.extend_vocab(["ሰላም ዓለም"], tmp_path / "ext.json")  # base ids kept, new rows appended
    config = tiny.make_config(tmp_path / "run", epochs=1)       # GPTTrainerConfig; overrides by name
    trainer = tiny.train(config)                                # real coqui Trainer.fit(); returns it
    # tests: fixtures ``tiny_xtts`` and ``tiny_xtts_extended_vocab`` (74 -> 82) in tests/conftest.py

Nothing here is downloaded: the tokenizer is a small BPE trained with ``tokenizers``,
the DVAE is freshly initialised, the mel statistics are ones and the audio is
synthetic speech-like sound (harmonics of a gliding pitch shaped by formants, in
syllables separated by pauses), deterministic from ``seed``. The GPT has 2 layers
of 64 channels: one epoch of a dozen samples takes seconds on 2 CPU cores.

Vocabulary layout (the coqui convention, see :func:`patches.vocab_freeze.frozen_rows`):
``[STOP]`` is id 0, ``[UNK]`` id 1 and ``[START]`` the LAST id, because XTTS's
``GPTTrainer`` (and our loader) carry the base model's last text-embedding row to
the new last row when a vocabulary grows. :meth:`TinyXtts.extend_vocab` keeps that
layout: base ids ``0 .. base-2`` unchanged, new tokens at ``base-1 .. new-2``,
``[START]`` moved to ``new-1``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

logger = logging.getLogger("training_patches")

SAMPLE_RATE = 22050
CLIP_SECONDS = 3.5
SPECIAL_TOKENS = ("[STOP]", "[UNK]", "[SPACE]")
START_TOKEN = "[START]"

# Short English sentences: every character is in the base vocabulary, so the XTTS
# dataset drops none of them (it drops samples with [UNK] silently).
DEFAULT_TEXTS: tuple[str, ...] = (
    "the quick brown fox jumps over the lazy dog",
    "a small model learns to speak a new language",
    "she sells sea shells by the sea shore",
    "we train the text embedding and keep the base rows",
    "one two three four five six seven eight",
    "good morning and welcome to the training run",
    "numbers and letters make the tokens of the text",
    "the weather is calm and the night is quiet",
    "every step of the optimizer moves the weights",
    "speech comes from the voice of the speaker",
    "a loss that is finite is a loss we can trust",
    "the rain in spain stays mainly in the plain",
    "birds sing in the trees at the break of day",
)


@dataclass
class TinyXtts:
    """Paths of a tiny XTTS setup and helpers to configure, build and train it."""

    root: Path
    vocab: Path
    dvae: Path
    mel_stats: Path
    audio_dir: Path
    manifest: Path
    language: str
    texts: tuple[str, ...]
    vocab_size: int
    seed: int = 0
    manifests: dict[str, Path] = field(default_factory=dict)

    # -- configuration -------------------------------------------------------

    def make_config(self, output_path: str | os.PathLike[str], *,
                    vocab: str | os.PathLike[str] | None = None,
                    manifest: str | os.PathLike[str] | None = None,
                    **overrides: Any) -> Any:
        """A ``GPTTrainerConfig`` for this setup; ``overrides`` set config fields by name
        (``model_args`` fields are accepted too, e.g. ``gpt_checkpoint=...``).

        ``vocab`` replaces the tokenizer file (e.g. one made by :meth:`extend_vocab`),
        ``manifest`` the training manifest (e.g. one made by :meth:`write_manifest`).
        """
        from TTS.config.shared_configs import BaseDatasetConfig
        from TTS.tts.configs.xtts_config import XttsAudioConfig
        from TTS.tts.layers.xtts.trainer.gpt_trainer import GPTArgs, GPTTrainerConfig

        args = GPTArgs(
            gpt_layers=2, gpt_n_model_channels=64, gpt_n_heads=2,
            gpt_num_audio_tokens=1026, gpt_start_audio_token=1024, gpt_stop_audio_token=1025,
            gpt_max_audio_tokens=605, gpt_max_text_tokens=402, gpt_max_prompt_tokens=70,
            gpt_use_perceiver_resampler=True, gpt_use_masking_gt_prompt_approach=True,
            min_conditioning_length=22050, max_conditioning_length=44100,
            max_wav_length=int(SAMPLE_RATE * 11.6), max_text_length=200,
            tokenizer_file=str(vocab or self.vocab), mel_norm_file=str(self.mel_stats),
            dvae_checkpoint=str(self.dvae), xtts_checkpoint="", gpt_checkpoint="",
        )
        dataset = BaseDatasetConfig(
            formatter="coqui", dataset_name="tiny", path=str(self.root),
            meta_file_train=Path(manifest or self.manifest).name, language=self.language)
        config = GPTTrainerConfig(
            output_path=str(output_path), run_name="tiny_xtts", project_name="tiny_xtts",
            model_args=args, audio=XttsAudioConfig(sample_rate=SAMPLE_RATE,
                                                   dvae_sample_rate=SAMPLE_RATE,
                                                   output_sample_rate=24000),
            datasets=[dataset], batch_size=2, eval_batch_size=2, num_loader_workers=0,
            num_eval_loader_workers=0, run_eval=False, test_delay_epochs=10 ** 6, epochs=1,
            print_step=10 ** 6, plot_step=10 ** 6, log_model_step=10 ** 6, save_step=10 ** 6,
            save_n_checkpoints=1, save_checkpoints=True, save_best_after=10 ** 9,
            optimizer="AdamW", optimizer_wd_only_on_weights=True,
            optimizer_params={"betas": [0.9, 0.96], "eps": 1e-8, "weight_decay": 1e-2},
            lr=1e-3, lr_scheduler=None, lr_scheduler_params={}, grad_clip=0.0,
            mixed_precision=False, precision="fp32", training_seed=self.seed,
            dashboard_logger="tensorboard", test_sentences=[],
        )
        for name, value in overrides.items():
            if hasattr(config.model_args, name) and not hasattr(config, name):
                setattr(config.model_args, name, value)
            elif hasattr(config, name):
                setattr(config, name, value)
            else:
                raise AttributeError(
                    f"make_config: {name!r} is neither a GPTTrainerConfig nor a GPTArgs field")
        return config

    def make_model(self, config: Any) -> Any:
        """The real XTTS ``GPTTrainer`` for ``config``."""
        from TTS.tts.layers.xtts.trainer.gpt_trainer import GPTTrainer

        return GPTTrainer(config)

    def samples(self, config: Any) -> list[dict[str, Any]]:
        """Training samples loaded by coqui's own ``load_tts_samples`` (no eval split)."""
        from TTS.tts.datasets import load_tts_samples

        train, _ = load_tts_samples(config, eval_split=False)
        return train

    def make_trainer(self, config: Any, model: Any = None, *, restore_path: str | None = None,
                     continue_path: str | None = None, **trainer_args: Any) -> Any:
        """A real coqui ``trainer.Trainer`` over this setup (command line not parsed)."""
        from trainer import Trainer, TrainerArgs

        args = TrainerArgs(restore_path=restore_path, continue_path=continue_path or "",
                           **trainer_args)
        if model is None:
            model = self.make_model(config)
        return Trainer(args, config, config.output_path, model=model,
                       train_samples=self.samples(config), eval_samples=None,
                       parse_command_line_args=False)

    def train(self, config: Any, model: Any = None, **kwargs: Any) -> Any:
        """Run ``Trainer.fit()`` for ``config.epochs`` epochs and return the trainer.

        coqui's ``fit`` turns any exception into ``sys.exit(1)`` after printing it;
        that is re-raised here as a RuntimeError so that a test fails with a reason.
        """
        trainer = self.make_trainer(config, model, **kwargs)
        try:
            trainer.fit()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(
                    f"tiny XTTS training failed inside the coqui Trainer (exit {exc.code}); "
                    f"its traceback is printed above") from exc
        return trainer

    def write_manifest(self, texts: Sequence[str], name: str) -> Path:
        """Another manifest over the same clips (``texts`` cycled), in the root folder."""
        clips = sorted(self.audio_dir.glob("clip_*.wav"))
        path = self.root / name
        _write_manifest(path, [(f"wavs/{clip.name}", texts[i % len(texts)], f"spk{i % 2}")
                               for i, clip in enumerate(clips)])
        self.manifests[Path(name).stem] = path
        return path

    # -- vocabulary ----------------------------------------------------------

    def extend_vocab(self, texts_or_tokens: Iterable[str], out: str | os.PathLike[str], *,
                     language: str | None = None, tokens: bool = False) -> Path:
        """Write an extended ``vocab.json``: see :func:`extend_vocab`."""
        return extend_vocab(self.vocab, texts_or_tokens, out, language=language, tokens=tokens)


# -- building blocks ---------------------------------------------------------


def speech_like(seconds: float, seed: int, sample_rate: int = SAMPLE_RATE) -> Any:
    """Deterministic speech-like audio: voiced syllables with formants, and pauses."""
    import numpy as np

    rng = np.random.RandomState(seed)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    # A gliding pitch around a speaker's base f0, integrated to a phase.
    f0_base = rng.uniform(95, 210)
    f0 = f0_base * (1 + 0.12 * np.sin(2 * np.pi * rng.uniform(0.3, 0.9) * t + rng.uniform(0, 6)))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    # Formant targets change per syllable (~4 per second).
    syllable = np.floor(t * rng.uniform(3.5, 5.0)).astype(int)
    n_syl = int(syllable.max()) + 1
    formants = np.stack([rng.uniform(300, 900, n_syl), rng.uniform(900, 2300, n_syl),
                         rng.uniform(2300, 3200, n_syl)], axis=1)
    wave = np.zeros(n)
    for k in range(1, 30):
        fk = k * f0
        gain = sum(np.exp(-0.5 * ((fk - formants[syllable, j]) / (80 + 40 * j)) ** 2) / (j + 1)
                   for j in range(3))
        wave += gain * np.sin(k * phase) / math.sqrt(k)
    # Syllable envelope with random pauses (about one syllable in five silent).
    local = (t * 4.2) % 1.0
    envelope = np.sin(np.pi * local) ** 2
    silent = rng.rand(n_syl) < 0.2
    envelope[silent[syllable]] = 0.0
    wave = wave * envelope + 0.003 * rng.randn(n)
    wave = 0.5 * wave / (np.abs(wave).max() + 1e-9)
    wave[0] = -0.01  # coqui's load_audio logs an error for audio with no negative sample
    return wave.astype(np.float32)


def _clean(text: str, language: str) -> str:
    """What XTTS's tokenizer will see: its own cleaners where the language is known."""
    try:
        from TTS.tts.layers.xtts.tokenizer import multilingual_cleaners

        return multilingual_cleaners(text, language)
    except (NotImplementedError, KeyError, ImportError):
        return text.lower()


def train_bpe_vocab(texts: Sequence[str], out: str | os.PathLike[str], *,
                    languages: Sequence[str] = ("en",), vocab_size: int = 74) -> Path:
    """Train a small BPE ``vocab.json`` in XTTS's layout.

    Special tokens ``[STOP]`` (0), ``[UNK]`` (1), ``[SPACE]``, ``[lang]`` for each
    language, then the BPE alphabet and merges, and ``[START]`` as the last id.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = [*SPECIAL_TOKENS, *(f"[{lang}]" for lang in languages)]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # One id is kept free for [START], which goes last (see the module docstring).
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=specials,
                                  show_progress=False)
    cleaned = [_clean(text, languages[0]) for text in texts]
    tokenizer.train_from_iterator(cleaned, trainer=trainer)
    tokenizer.add_special_tokens([START_TOKEN])
    out = Path(out)
    tokenizer.save(str(out))
    return out


def extend_vocab(base_vocab: str | os.PathLike[str], texts_or_tokens: Iterable[str],
                 out: str | os.PathLike[str], *, language: str | None = None,
                 tokens: bool = False) -> Path:
    """Write ``out``: ``base_vocab`` plus new tokens, in the coqui resize layout.

    New tokens are the characters of ``texts_or_tokens`` the base vocabulary lacks
    (or, with ``tokens=True``, the given strings themselves), plus ``[language]`` as
    a special token when given. Base ids ``0 .. base-2`` keep their ids, the new
    tokens take ``base-1 ..`` and ``[START]`` moves from ``base-1`` to the new last id,
    which is what XTTS's ``GPTTrainer`` does with the embedding rows when it loads a
    smaller ``gpt_checkpoint``.
    """
    data = json.loads(Path(base_vocab).read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {tok["content"]: tok for tok in data["added_tokens"]}
    known = set(vocab) | set(added)
    start = added.get(START_TOKEN)
    base_size = max([*vocab.values(), *(tok["id"] for tok in added.values())]) + 1
    if start is None or start["id"] != base_size - 1:
        raise ValueError(
            f"extend_vocab: {base_vocab} does not have [START] as its last id ({base_size - 1}); "
            f"build it with train_bpe_vocab, which uses the layout XTTS's GPTTrainer assumes")
    new_plain: list[str] = []
    for item in texts_or_tokens:
        for tok in ([item] if tokens else list(item.replace(" ", ""))):
            if tok and tok not in known and tok not in new_plain:
                new_plain.append(tok)
    new_special = [f"[{language}]"] if language and f"[{language}]" not in known else []
    next_id = base_size - 1
    for tok in new_special:
        data["added_tokens"].append({"id": next_id, "content": tok, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": True})
        # tokenizers numbers added tokens the model vocab lacks after it: list it there too.
        vocab[tok] = next_id
        next_id += 1
    for tok in new_plain:  # whole tokens of the BPE model: reachable without merges
        vocab[tok] = next_id
        next_id += 1
    start["id"] = next_id
    data["added_tokens"].sort(key=lambda tok: tok["id"])
    out = Path(out)
    out.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return out


def _write_manifest(path: Path, rows: Iterable[tuple[str, str, str]]) -> Path:
    """A coqui-format manifest: ``audio_file|text|speaker_name`` header, one clip a line."""
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, delimiter="|", quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writerow(["audio_file", "text", "speaker_name"])
        writer.writerows(rows)
    return path


def vocab_size_of(vocab_file: str | os.PathLike[str]) -> int:
    """Rows of the text embedding XTTS builds for this vocab (max id + 1)."""
    from tokenizers import Tokenizer

    return max(Tokenizer.from_file(str(vocab_file)).get_vocab().values()) + 1


def build_tiny_xtts(workdir: str | os.PathLike[str], *, language: str = "en",
                    texts: Sequence[str] | None = None,
                    vocab_extra_texts: Sequence[str] = (), n_samples: int = 13,
                    vocab_size: int = 74, seed: int = 0,
                    languages: Sequence[str] | None = None) -> TinyXtts:
    """Write every file a tiny XTTS GPT training needs into ``workdir`` and describe them.

    ``texts`` are the transcripts (cycled to ``n_samples``; default English
    sentences); ``vocab_extra_texts`` only feed the BPE training. ``languages``
    lists the ``[lang]`` special tokens (default: just ``language``).
    """
    import soundfile as sf
    import torch

    root = Path(workdir)
    audio_dir = root / "wavs"
    audio_dir.mkdir(parents=True, exist_ok=True)
    texts = tuple(texts or DEFAULT_TEXTS)
    langs = list(languages or [language])
    if language not in langs:
        langs.insert(0, language)

    vocab = train_bpe_vocab([*texts, *vocab_extra_texts], root / "vocab.json",
                            languages=langs, vocab_size=vocab_size)

    from TTS.tts.layers.xtts.dvae import DiscreteVAE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dvae = DiscreteVAE(channels=80, normalization=None, positional_dims=1, num_tokens=1024,
                           codebook_dim=512, hidden_dim=512, num_resnet_blocks=3, kernel_size=3,
                           num_layers=2, use_transposed_convs=False)
    dvae_path = root / "dvae.pth"
    torch.save(dvae.state_dict(), dvae_path)
    mel_path = root / "mel_stats.pth"
    torch.save(torch.ones(80), mel_path)

    rows = []
    for i in range(n_samples):
        name = f"wavs/clip_{i:03d}.wav"
        sf.write(root / name, speech_like(CLIP_SECONDS, seed * 1000 + i), SAMPLE_RATE,
                 subtype="PCM_16")
        rows.append((name, texts[i % len(texts)], f"spk{i % 2}"))
    manifest = _write_manifest(root / "metadata.csv", rows)
    return TinyXtts(root=root, vocab=vocab, dvae=dvae_path, mel_stats=mel_path,
                    audio_dir=audio_dir, manifest=manifest, language=language, texts=texts,
                    vocab_size=vocab_size_of(vocab), seed=seed, manifests={"train": manifest})


__all__ = ["TinyXtts", "build_tiny_xtts", "extend_vocab", "train_bpe_vocab", "speech_like",
           "vocab_size_of", "DEFAULT_TEXTS"]
