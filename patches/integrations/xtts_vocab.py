"""XTTS's ``vocab.json`` as the runtime reads it: its ids and special tokens, and the rules
the special tokens must follow ([STOP] id 0, [UNK] id 1, [SPACE], [START], each language's
``[lang]``). The XTTS integration checks a freeze against them
(:func:`patches.integrations.xtts_gpt.vocab_layout_problems`); ``training-patches
verify-tokenizer`` (:mod:`patches.tools.tokenizer.verify`) reports the same findings. Plain
JSON: no ``tokenizers``, nothing of the tools (issue 40: the runtime never reaches them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START, UNK, STOP, SPACE = "[START]", "[UNK]", "[STOP]", "[SPACE]"
OK, FAIL = "ok  ", "FAIL"


def parse_vocab_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``vocab.json``, checked to be a BPE tokenizer in XTTS's shape; ValueError
    (one paragraph) otherwise, OSError when it cannot be read."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"the tokenizer {path} is not JSON ({type(exc).__name__}: {exc}). Expected the "
            f"XTTS vocab.json that came with the base model (a Hugging Face tokenizers file "
            f"with a BPE \"model\"); a SentencePiece model is a binary file.") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or \
            not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list):
        found = (f"a model of type {model.get('type')!r}" if isinstance(model, dict)
                 else "no \"model\" section")
        raise ValueError(
            f"the tokenizer {path} is JSON but not a BPE tokenizer: it has {found}. Expected "
            f"a Hugging Face tokenizers file whose \"model\" has \"type\": \"BPE\", a \"vocab\" "
            f"and \"merges\" (the XTTS vocab.json). Name the vocab.json of the base model.")
    data.setdefault("added_tokens", [])
    if UNK not in all_ids(data):
        raise ValueError(
            f"the tokenizer {path} has no {UNK} token. XTTS's tokenizer needs {STOP} (id 0) and "
            f"{UNK}; this does not look like an XTTS vocab.json.")
    return data


def all_ids(data: dict[str, Any]) -> dict[str, int]:
    """Every token's id: the BPE vocabulary and the added tokens."""
    ids = dict(data["model"]["vocab"])
    ids.update({tok["content"]: tok["id"] for tok in data["added_tokens"]})
    return ids


@dataclass(frozen=True)
class XttsVocab:
    """The ids of a vocab.json: ``vocab`` (token -> id), ``specials`` (the added special
    tokens), ``size`` (the rows of XTTS's text embedding: max id + 1)."""

    vocab: dict[str, int]
    specials: dict[str, int]

    @property
    def size(self) -> int:
        return max(self.vocab.values()) + 1

    @classmethod
    def of(cls, data: dict[str, Any]) -> "XttsVocab":
        return cls(all_ids(data), {t["content"]: t["id"] for t in data["added_tokens"]
                                   if t.get("special")})

    def special_findings(self, language: str | None) -> list[tuple[str, str, str]]:
        """(status, token, detail) for XTTS's special tokens and ``language``'s ``[lang]``."""
        found = []
        for token, want in ((STOP, 0), (UNK, 1), (SPACE, None), (START, None)):
            got = self.vocab.get(token)
            if got is None or token not in self.specials:
                found.append((FAIL, token, "missing" if got is None else
                              f"id {got} is a plain BPE entry, not a special token"))
            elif want is not None and got != want:
                found.append((FAIL, token, f"id {got}; XTTS expects id {want}"))
        langs = sorted(t for t in self.specials if len(t) <= 8
                       and t[1:-1].replace("-", "").isalpha() and t[1:-1].islower())
        found.append((OK, "special tokens", ", ".join(
            f"{t} {self.vocab[t]}" for t in sorted(self.specials, key=self.vocab.get))))
        if language:
            token = f"[{language}]"
            if token not in self.specials:
                state = "is a plain BPE entry" if token in self.vocab else "is missing"
                found.append((FAIL, token, f"{state}; XTTS starts every text with it, so "
                                           f"it must be one special token (training-patches "
                                           f"extend-tokenizer --language {language} adds it). "
                                           f"Language tokens here: {', '.join(langs) or 'none'}"))
            else:
                found.append((OK, token, f"special token, id {self.vocab[token]}"))
        return found


__all__ = ["START", "UNK", "STOP", "SPACE", "OK", "FAIL", "parse_vocab_json", "all_ids",
           "XttsVocab"]
