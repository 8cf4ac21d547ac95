"""Test-only: the XTTS modules a GPT fine-tune carries but never trains, at tiny sizes.

coqui's ``GPTTrainer`` builds its DVAE (51.6 M parameters) and ``Xtts`` its HiFi-GAN
decoder with its speaker encoder (26 M) at hard-coded sizes, whatever the config. In a GPT
fine-tune they are frozen feature extractors (the DVAE turns mel frames into audio codes)
or unused (the decoder), yet every tiny test model carried them: 324 MB per checkpoint
for a 0.75 M-parameter GPT, written, hashed and read hundreds of times per ``make test``.
Here the same upstream classes are built with small widths (the real code paths, as the
2-layer, 64-channel GPT is the real GPT). Only the test suite puts this folder on
``PYTHONPATH`` (``tests/conftest.py``), so it reaches every process a test starts and
nothing a user runs.
"""

from __future__ import annotations

from typing import Any

import wrapt

SMALL_DVAE = {"hidden_dim": 32, "codebook_dim": 32, "num_resnet_blocks": 1}
SMALL_DECODER = {"upsample_initial_channel_decoder": 32}
SMALL_SPEAKER_ENCODER = {"layers": [1, 1, 1, 1], "num_filters": [8, 8, 16, 16]}


def _with(sizes: dict[str, Any]):
    def init(wrapped, instance, args, kwargs):
        return wrapped(*args, **{**kwargs, **sizes})
    return init


def _dvae(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, "DiscreteVAE.__init__", _with(SMALL_DVAE))


def _decoder(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, "HifiDecoder.__init__", _with(SMALL_DECODER))


def _speaker_encoder(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, "ResNetSpeakerEncoder.__init__",
                                _with(SMALL_SPEAKER_ENCODER))


wrapt.register_post_import_hook(_dvae, "TTS.tts.layers.xtts.dvae")
wrapt.register_post_import_hook(_decoder, "TTS.tts.layers.xtts.hifigan_decoder")
wrapt.register_post_import_hook(_speaker_encoder, "TTS.encoder.models.resnet")


def _scan_once() -> None:
    """coqui's ``import TTS`` scans every installed distribution twice
    (``importlib.metadata.packages_distributions()`` in ``TTS/__init__.py`` and
    ``TTS/utils/import_utils.py``, 0.2-0.4 s each here): the answer cannot change while the
    process runs, so it is read once (and inherited by a child of tests/forkserver.py)."""
    import functools
    import importlib.metadata

    scan = functools.cache(importlib.metadata.packages_distributions)
    importlib.metadata.packages_distributions = lambda: {  # type: ignore[assignment]
        name: list(found) for name, found in scan().items()}


_scan_once()
