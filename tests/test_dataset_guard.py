"""xtts_dataset: coqui-tts 0.28's real XTTSDataset drops bad samples visibly and never loops."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.xtts
pytest.importorskip("TTS")

import patches  # noqa: E402
from patches.languages.amharic import normalize  # noqa: E402

from test_xtts_language import AMHARIC_TEXTS  # noqa: E402

BAD = {  # file name -> (text, expected reason)
    "wavs/undecodable.wav": ("ሰላም፣ እንዴት ነህ፧", "decode_failure"),
    "wavs/short.wav": ("ሰላም፣ እንዴት ነህ፧", "too_short"),
    "wavs/clip_000.wav": ("", "empty_text"),
    "wavs/clip_001.wav": ("ሰላም 漢字 ዓለም", "unknown_token"),
}


@pytest.fixture(scope="module")
def am_bad(tmp_path_factory: pytest.TempPathFactory):
    """Tiny Amharic setup plus a manifest of 8 good and 5 bad samples."""
    import soundfile as sf

    from demo.xtts_tiny import SAMPLE_RATE, build_tiny_xtts, speech_like

    tiny = build_tiny_xtts(tmp_path_factory.mktemp("am_bad"), language="am",
                           texts=AMHARIC_TEXTS, n_samples=8, vocab_size=200,
                           vocab_extra_texts=[normalize(t) for t in AMHARIC_TEXTS])
    (tiny.root / "wavs/undecodable.wav").write_bytes(b"this is not audio at all" * 40)
    sf.write(tiny.root / "wavs/short.wav", speech_like(0.2, 99), SAMPLE_RATE)
    rows = [(f"wavs/clip_{i:03d}.wav", AMHARIC_TEXTS[i % len(AMHARIC_TEXTS)]) for i in range(8)]
    rows += [(name, text) for name, (text, _) in BAD.items()]
    _write_manifest(tiny.root / "mixed.csv", rows)
    most_bad = [("wavs/undecodable.wav", f"ሰላም {i}") for i in range(9)] + rows[:2]
    _write_manifest(tiny.root / "most_bad.csv", most_bad)
    return tiny


def _write_manifest(path: Path, rows: list[tuple[str, str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="|", quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writerow(["audio_file", "text", "speaker_name"])
        for name, text in rows:
            writer.writerow([name, text, "spk0"])


def _config(tiny, run: Path, manifest: str, **overrides):
    from TTS.config.shared_configs import BaseDatasetConfig

    dataset = BaseDatasetConfig(formatter="coqui", dataset_name="am", path=str(tiny.root),
                                meta_file_train=manifest, meta_file_val=manifest, language="am")
    return tiny.make_config(run, datasets=[dataset], **overrides)


def _dataset(tiny, config, is_eval: bool):
    from TTS.tts.datasets import load_tts_samples
    from TTS.tts.layers.xtts.tokenizer import VoiceBpeTokenizer
    from TTS.tts.layers.xtts.trainer.dataset import XTTSDataset

    train, evals = load_tts_samples(config, eval_split=True)
    return XTTSDataset(config, evals if is_eval else train, VoiceBpeTokenizer(tiny.vocab),
                       22050, is_eval=is_eval)


@pytest.fixture
def guard(tmp_path):
    patches.advanced.apply(["xtts_language", "xtts_dataset"], output_dir=str(tmp_path))
    yield tmp_path / "dropped_samples.jsonl"


def test_each_bad_sample_listed_once_with_its_reason(am_bad, guard, tmp_path) -> None:
    import torch

    torch.set_num_threads(1)
    dataset = _dataset(am_bad, _config(am_bad, tmp_path / "run", "mixed.csv"), is_eval=False)
    items = [dataset[0] for _ in range(150)]  # coqui picks at random: enough to meet every one
    assert all(item["text"][0] == dataset.tokenizer.tokenizer.token_to_id("[am]")
               for item in items)
    entries = [json.loads(line) for line in guard.read_text(encoding="utf-8").splitlines()]
    found = {(Path(e["audio_file"]).name, e["text"]): e["reason"] for e in entries}
    expected = {(Path(name).name, text): reason for name, (text, reason) in BAD.items()}
    assert found == expected
    assert len(entries) == len(expected)  # once each, however often picked
    unknown = next(e for e in entries if e["reason"] == "unknown_token")
    assert "'漢'" in unknown["detail"] and "'字'" in unknown["detail"]


def test_eval_samples_checked_and_listed(am_bad, guard, tmp_path) -> None:
    dataset = _dataset(am_bad, _config(am_bad, tmp_path / "run", "mixed.csv"), is_eval=True)
    entries = [json.loads(line) for line in guard.read_text(encoding="utf-8").splitlines()]
    assert {e["split"] for e in entries} == {"eval"}
    assert sorted(e["reason"] for e in entries) == sorted(r for _, r in BAD.values())
    assert len(dataset.samples) == 8


def test_mostly_bad_stops_with_clear_error_and_bounded_memory(am_bad, guard, tmp_path) -> None:
    import psutil

    from patches.integrations.xtts_dataset import DatasetUnusableError

    dataset = _dataset(am_bad, _config(am_bad, tmp_path / "run", "most_bad.csv"),
                       is_eval=False)
    process = psutil.Process()
    before = process.memory_info().rss
    started = time.monotonic()
    with pytest.raises(DatasetUnusableError) as info:
        for _ in range(200):
            dataset[0]
    grew_mb = (process.memory_info().rss - before) / 2 ** 20
    message = str(info.value)
    assert "more than the limit of 50%" in message and "decode_failure" in message
    assert str(guard) in message and "TRAINING_PATCHES_MAX_DROP_SHARE" in message
    assert time.monotonic() - started < 60
    assert grew_mb < 200, f"resident memory grew by {grew_mb:.0f} MB"


def test_real_trainer_finishes_on_mixed_manifest(am_bad, guard, tmp_path) -> None:
    """GPTTrainer + coqui Trainer, train and eval on the mixed manifest, language am."""
    import torch
    from trainer import Trainer, TrainerArgs
    from TTS.tts.datasets import load_tts_samples

    torch.set_num_threads(1)
    config = _config(am_bad, tmp_path / "run", "mixed.csv", run_eval=True, epochs=1)
    train, evals = load_tts_samples(config, eval_split=True)
    model = am_bad.make_model(config)
    trainer = Trainer(TrainerArgs(), config, config.output_path, model=model,
                      train_samples=train, eval_samples=evals, parse_command_line_args=False)
    trainer.fit()
    assert trainer.total_steps_done > 0
    losses = trainer.keep_avg_train.avg_values
    assert losses and all(math.isfinite(v) for v in losses.values()), losses
    entries = [json.loads(line) for line in guard.read_text(encoding="utf-8").splitlines()]
    assert sorted(e["reason"] for e in entries if e["split"] == "eval") == sorted(
        r for _, r in BAD.values())
    assert {e["reason"] for e in entries} <= {r for _, r in BAD.values()}
