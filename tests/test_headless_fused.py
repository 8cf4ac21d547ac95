"""headlessXttsTrain.py builds AdamW with fused=True where torch has the kernel (CPU and CUDA
in torch 2.14), so the NaN guard skips inside the kernel with no host read; --no-fused
turns it off."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.xtts


def _settings(tmp_path: Path, fused: bool):
    pytest.importorskip("TTS")
    from TTS.tts.configs.xtts_config import XttsConfig

    sys.path.insert(0, str(ROOT))
    import headlessXttsTrain

    files = {key: tmp_path / name for key, (name, _) in headlessXttsTrain.BASE_FILES.items()}
    XttsConfig().save_json(str(files["config"]))
    manifest = tmp_path / "train.csv"
    manifest.write_text("audio_file|text|speaker_name\n", encoding="utf-8")
    args = headlessXttsTrain.build_parser().parse_args([] if fused else ["--no-fused"])
    settings = headlessXttsTrain.Settings(
        files=files, train_manifest=manifest, eval_manifest=None, language="am",
        output_dir=tmp_path / "out", epochs=1, batch_size=2, grad_accum=1, lr=5e-6,
        precision="fp32", text_loss_weight=0.01, mel_loss_weight=1.0, max_audio_seconds=11.6,
        max_text_tokens=200, workers=0, save_step=1000, keep_checkpoints=1, resume=None,
        seed=1, print_step=25, fused=args.fused)
    return headlessXttsTrain, settings


def _coqui_optimizer(config):
    import torch
    from trainer.trainer_utils import get_optimizer

    params = [torch.nn.Parameter(torch.zeros(4))]
    return get_optimizer(config.optimizer, config.optimizer_params, config.lr, parameters=params)


def test_fused_adamw_is_the_default(tmp_path: Path) -> None:
    headless, settings = _settings(tmp_path, fused=True)
    assert headless.fused_adamw_available()  # torch 2.14 has fused AdamW on the CPU
    config = headless.build_config(settings)
    assert config.optimizer_params["fused"] is True
    assert config.optimizer_params["weight_decay"] == 1e-2  # the rest unchanged
    assert _coqui_optimizer(config).defaults["fused"] is True  # what coqui's Trainer builds


def test_no_fused_flag_builds_the_plain_adamw(tmp_path: Path) -> None:
    headless, settings = _settings(tmp_path, fused=False)
    config = headless.build_config(settings)
    assert "fused" not in config.optimizer_params
    assert not _coqui_optimizer(config).defaults.get("fused")
