"""Shared fixtures: the tiny XTTS setup (real coqui-tts, local files only).

Building it takes about 2 s (BPE vocab, DVAE state dict, 13 synthetic wavs), so it
is session-scoped; tests must treat its files as read-only and train into their
own ``tmp_path`` (``tiny.make_config(tmp_path / "run")``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Seven Amharic characters plus the [am] language token: 74 base tokens -> 82.
AMHARIC_NEW_TOKENS: tuple[str, ...] = ("ሰ", "ላ", "ም", "ዓ", "ለ", "እ", "ን")


@pytest.fixture(scope="session")
def tiny_xtts(tmp_path_factory: pytest.TempPathFactory):
    """A :class:`demo.xtts_tiny.TinyXtts` (English, 74 tokens, 13 clips)."""
    pytest.importorskip("TTS")
    from demo.xtts_tiny import build_tiny_xtts

    return build_tiny_xtts(tmp_path_factory.mktemp("tiny_xtts"), seed=0)


@pytest.fixture(scope="session")
def tiny_xtts_extended_vocab(tiny_xtts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An extended vocab.json for :func:`tiny_xtts`: 74 base tokens + 8 new = 82 ids.

    Base ids 0..72 unchanged, new tokens at 73..80, [START] moved from 73 to 81
    (the layout XTTS's GPTTrainer resize assumes).
    """
    out = tmp_path_factory.mktemp("tiny_xtts_ext") / "vocab_extended.json"
    return tiny_xtts.extend_vocab(AMHARIC_NEW_TOKENS, out, language="am", tokens=True)


@pytest.fixture(scope="session")
def tiny_xtts_mixed_manifest(tiny_xtts, tiny_xtts_extended_vocab) -> Path:
    """A manifest whose English transcripts also use the new tokens (ids 74..80), so that
    the new embedding rows get gradients; language stays "en" (coqui knows it)."""
    words = ("ሰላም", "እን", "ለም", "ዓለም")
    texts = [f"{text} {words[i % len(words)]}" for i, text in enumerate(tiny_xtts.texts)]
    return tiny_xtts.write_manifest(texts, "metadata_mixed.csv")


def write_amharic_base(root: Path):
    """A tiny Amharic XTTS setup for headlessXttsTrain.py: ``root/data`` (6 Amharic clips,
    metadata.csv, a vocab.json with [am]) and ``root/base`` (model.pth and config.json of a
    fresh tiny GPTTrainer, dvae.pth, mel_stats.pth, vocab.json). Returns (tiny, base)."""
    import shutil

    import torch

    import patches
    from demo.xtts_tiny import build_tiny_xtts
    from patches.languages.amharic import normalize
    from test_xtts_language import AMHARIC_TEXTS

    tiny = build_tiny_xtts(root / "data", language="am", texts=AMHARIC_TEXTS, n_samples=6,
                           vocab_size=200,
                           vocab_extra_texts=[normalize(t) for t in AMHARIC_TEXTS])
    base = root / "base"
    base.mkdir()
    was = patches.is_applied("xtts_language")
    patches.apply(["xtts_language"])  # coqui's tokenizer must know "am" to build the model
    try:
        config = tiny.make_config(root / "scratch")
        model = tiny.make_model(config)
        torch.save({"model": model.xtts.state_dict()}, base / "model.pth")
        config.save_json(str(base / "config.json"))
    finally:
        if not was:
            patches.revert(["xtts_language"])
    for name in ("vocab.json", "dvae.pth", "mel_stats.pth"):
        shutil.copy(tiny.root / name, base / name)
    return tiny, base


DISTRIBUTED = Path(__file__).resolve().parent / "distributed"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The many-process tier: every test in tests/distributed is marked ``distributed``
    (``-m distributed`` runs only them) and skips where torch has no gloo. (No conftest of
    its own there: a second ``conftest`` module would shadow this one's helpers.)"""
    import torch

    gloo = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    for item in items:
        if DISTRIBUTED in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.distributed)
            if not gloo:
                item.add_marker(pytest.mark.skip(reason="torch.distributed with gloo is not available"))
