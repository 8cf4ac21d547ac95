"""``training-patches check-data``: what in a coqui dataset will hurt a fine-tune.

:mod:`.manifest` reads the manifest, :mod:`.audio` decodes and measures the clips (in
worker processes), :mod:`.text` holds the script tables, cleaners and the tokenizer,
:mod:`.checks` turns what was found into errors, warnings and the report, and
:mod:`.command` is the command line (what it checks, in its ``--help``).
"""

from __future__ import annotations

from .audio import analyse_audio, signal_stats
from .checks import CheckDataOptions, Clip, check_manifest
from .manifest import ManifestError, Row, read_data_manifest

__all__ = ["CheckDataOptions", "Clip", "ManifestError", "Row", "analyse_audio",
           "check_manifest", "read_data_manifest", "signal_stats"]
