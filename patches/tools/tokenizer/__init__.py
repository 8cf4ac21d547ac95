"""Tokenizer tools: extend and verify the tokenizer of a new language.

- :mod:`.bpe`: an XTTS ``vocab.json`` (Hugging Face ``tokenizers`` BPE) extended with
  ``[lang]``, every character and learned pieces of a corpus; base ids and merges kept.
- :mod:`.spm`: a SentencePiece ``.model`` (IndexTTS) with pieces appended; ids kept.
- :mod:`.verify`: sizes, id ranges, special tokens, UNK rate and coverage on a text or a
  manifest, and whether a checkpoint's text-embedding rows fit the vocabulary.
- :mod:`.text`: the corpus as the trainer sees it (cleaner, G2P) and safe output.

The command-line doors are ``training-patches extend-tokenizer`` and ``verify-tokenizer``;
``headlessXttsTrain.py`` extends a run's vocabulary with :func:`.bpe.extend_for_run`. It is
a tool (issue 40: moved from ``patches.integrations.tokenizer``, which stays as a deprecated
alias for one release): ``import patches.auto`` never loads it. The special-token rules it
reports are the runtime's (:mod:`patches.integrations.xtts_vocab`). ``tokenizers`` and
``sentencepiece`` load only when a function needs them.
"""

from __future__ import annotations

from .errors import TokenizerToolError

__all__ = ["TokenizerToolError"]
