"""The tiny XTTS builder: real files, a real GPTTrainer, one real coqui Trainer epoch."""

from __future__ import annotations

import json
import math

import forkserver
import pytest
import torch

pytestmark = pytest.mark.xtts


def test_files_and_vocab_layout(tiny_xtts, tiny_xtts_extended_vocab) -> None:
    import soundfile as sf
    from tokenizers import Tokenizer

    from demo.xtts_tiny import vocab_size_of

    base = Tokenizer.from_file(str(tiny_xtts.vocab))
    assert base.token_to_id("[STOP]") == 0 and base.token_to_id("[UNK]") == 1
    assert base.token_to_id("[START]") == tiny_xtts.vocab_size - 1 == 73
    ext = Tokenizer.from_file(str(tiny_xtts_extended_vocab))
    assert vocab_size_of(tiny_xtts_extended_vocab) == 82
    assert ext.token_to_id("[START]") == 81 and ext.token_to_id("[am]") == 73
    # Every base token except [START] keeps its id.
    base_vocab = base.get_vocab()
    ext_vocab = ext.get_vocab()
    assert all(ext_vocab[tok] == i for tok, i in base_vocab.items() if tok != "[START]")
    assert sorted(ext_vocab.values()) == list(range(82))

    wavs = sorted(tiny_xtts.audio_dir.glob("*.wav"))
    assert len(wavs) == 13
    audio, rate = sf.read(wavs[0])
    assert rate == 22050 and len(audio) == int(3.5 * 22050)
    assert audio.min() < 0 < audio.max() and abs(audio).max() <= 1.0
    lines = tiny_xtts.manifest.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "audio_file|text|speaker_name" and len(lines) == 14


def test_xtts_tokenizer_encodes_every_transcript(tiny_xtts) -> None:
    from TTS.tts.layers.xtts.tokenizer import VoiceBpeTokenizer

    tok = VoiceBpeTokenizer(str(tiny_xtts.vocab))
    for text in tiny_xtts.texts:
        ids = tok.encode(text, "en")
        assert 1 not in ids and 0 not in ids, text  # the dataset drops [UNK] samples silently


def test_one_epoch_through_the_real_trainer(tiny_xtts, tmp_path) -> None:
    torch.set_num_threads(1)
    config = tiny_xtts.make_config(tmp_path / "run")
    model = tiny_xtts.make_model(config)
    gpt = model.xtts.gpt
    assert gpt.text_embedding.weight.shape[0] == 74
    before = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    trainer = tiny_xtts.train(config, model)

    assert trainer.total_steps_done == 7  # 13 samples, batch size 2
    avg = trainer.keep_avg_train.avg_values
    assert math.isfinite(avg["avg_loss"]) and math.isfinite(avg["avg_loss_mel_ce"])
    after = gpt.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert not torch.equal(before["text_embedding.weight"], after["text_embedding.weight"])
    assert not torch.equal(before["mel_head.weight"], after["mel_head.weight"])


def test_make_config_overrides(tiny_xtts, tmp_path, tiny_xtts_extended_vocab) -> None:
    config = tiny_xtts.make_config(tmp_path, vocab=tiny_xtts_extended_vocab, epochs=3,
                                   gpt_checkpoint="x.pth")
    assert config.epochs == 3 and config.model_args.gpt_checkpoint == "x.pth"
    assert config.model_args.tokenizer_file == str(tiny_xtts_extended_vocab)
    with pytest.raises(AttributeError, match="no_such_field"):
        tiny_xtts.make_config(tmp_path, no_such_field=1)
    json.dumps(config.to_dict())  # serialisable, as the Trainer writes it to config.json


def test_the_never_trained_modules_are_small_here_and_in_every_child(tiny_xtts, tmp_path) -> None:
    """What keeps ``make test`` under ten minutes: the DVAE and the HiFi-GAN decoder (with
    its speaker encoder) of every tiny XTTS the suite builds are small
    (tests/small_xtts/sitecustomize.py), in the test process and in a process started with
    ``processes.child_path``; the GPT is the 2-layer, 64-channel one either way. Without the
    folder the DVAE alone is 51.6 M parameters and each checkpoint 324 MB."""
    import os
    import subprocess
    import sys

    from processes import ROOT, child_path

    model = tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "run"))
    sizes = {name: sum(p.numel() for p in module.parameters()) for name, module in (
        ("dvae", model.dvae), ("decoder", model.xtts.hifigan_decoder), ("gpt", model.xtts.gpt))}
    assert sizes["dvae"] < 200_000 and sizes["decoder"] < 1_000_000, sizes
    code = ("from TTS.tts.layers.xtts.dvae import DiscreteVAE\n"
            "d = DiscreteVAE(channels=80, normalization=None, positional_dims=1, num_tokens=1024,"
            " codebook_dim=512, hidden_dim=512, num_resnet_blocks=3, kernel_size=3, num_layers=2)\n"
            "print(sum(p.numel() for p in d.parameters()))")
    child = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=child_path(ROOT)), check=True)
    assert int(child.stdout.split()[-1]) == sizes["dvae"]
