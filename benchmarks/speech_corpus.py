"""Speech for the speech-shaped new-language benchmark, made offline from real text.

- **Text.** English: lower-cased sentences of Python standard-library docstrings (those of
  ``bench_new_language.english_sentences``), at most ``max_chars_en`` characters. Amharic:
  the lemma list that the ``amharicnlp`` package ships (MIT; its
  ``amharicNLP/resources/data_lemma.py``, 3,454 entries of a headword and its gloss phrases):
  each utterance is a headword followed by as many of its gloss phrases as fit in
  ``max_chars_am`` characters. Read as data (``ast.literal_eval``), never imported or copied.
- **Speech.** ``espeak-ng`` (a Debian package: ``scripts/ensure_espeak.sh``) speaks each
  utterance, English with ``en-us``, Amharic with ``am``, at 22,050 Hz as XTTS's audio.
- **Codes.** XTTS's DVAE turns 80-band log-mel frames (hop 256) into one code per 1,024
  samples (21.5 codes a second). Here a k-means codebook on the same mel frames, four
  frames (one code's span) stacked and standardised, does it: one code per 1,024 samples.
  The mel is coqui's own ``TorchMelSpectrogram`` (the DVAE's settings, no norm file).
- **Conditioning.** XTTS conditions its GPT on a mel of the speaker's reference audio.
  Each utterance gets a segment of ``cond_frames`` frames cut from other utterances of
  its language (a fixed pool per language), standardised like the codes' frames.

Everything here is a pure function of the text and the seed; the benchmark caches it.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import math
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

SAMPLE_RATE = 22050
CODE_SAMPLES = 1024  # XTTS's code_stride_len: the DVAE's 4 mel frames of hop 256
MEL_HOP = 256
FRAMES_PER_CODE = CODE_SAMPLES // MEL_HOP
VOICES = {"en": "en-us", "am": "am"}
_ETHIOPIC = re.compile(r"[\u1200-\u137f]")


class CorpusError(RuntimeError):
    """A resource the speech benchmark needs is missing (espeak-ng, amharicnlp)."""


# -- text ----------------------------------------------------------------------------------


def lemma_file() -> Path:
    """``amharicNLP/resources/data_lemma.py`` of the installed ``amharicnlp`` package, found
    without importing the package (its ``__init__`` builds tokenizers and models)."""
    spec = importlib.util.find_spec("amharicNLP")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the speech benchmark reads real Amharic text from the lemma list of the "
            "'amharicnlp' package, which is not installed. Install the benchmark extra: "
            "pip install -e '.[bench]' (or pip install amharicnlp==2.0.0 --no-deps).")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "data_lemma.py"
    if not path.is_file():
        raise CorpusError(f"amharicnlp is installed, but {path} is not there: expected its "
                          f"lemma list (amharicnlp 2.0.0 ships it). Reinstall amharicnlp==2.0.0.")
    return path


def amharic_entries() -> list[dict[str, Any]]:
    """The lemma list as data: ``[{"lemma": str, "example": [str, ...]}, ...]``."""
    tree = ast.parse(lemma_file().read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "data" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise CorpusError(f"{lemma_file()} holds no 'data = [...]' list: not the amharicnlp 2.0.0 "
                      f"lemma list this benchmark reads.")


def _ethiopic_only(text: str) -> str:
    """Ethiopic letters and single spaces (parentheses, dots, Latin and digits dropped; the
    lemma list's abbreviation marks, one letter and "...", such as "ስ..." for a noun, too)."""
    text = re.sub(r"(?<![\u1200-\u137f])[\u1200-\u137f]\s*\.\.+", " ", text)
    kept = "".join(ch if _ETHIOPIC.match(ch) and ch not in "።፣፤፥፦፧፨፡" else " "
                   for ch in text)
    # a lone letter is the list's part-of-speech mark (ስ noun, ግ verb), not a word
    return " ".join(w for w in kept.split() if len(w) > 1)


def amharic_utterances(max_chars: int) -> list[str]:
    """One utterance per lemma entry: the headword, then its gloss phrases (", " between)
    while the whole stays within ``max_chars``; entries with fewer than 2 letters dropped,
    duplicates dropped. In the package's order."""
    seen, out = set(), []
    for entry in amharic_entries():
        parts = [p for p in (_ethiopic_only(x) for x in [entry.get("lemma", "")] +
                             list(entry.get("example", []))) if p]
        if not parts or len(parts[0]) > max_chars:
            continue
        text = parts[0]
        for part in parts[1:]:
            if len(text) + 2 + len(part) > max_chars:
                break
            text = f"{text}, {part}"
        if len(text.replace(" ", "")) >= 2 and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def held_out_first(lines: list[str], n_eval: int) -> list[str]:
    """``lines`` reordered so that the first ``n_eval`` (the held-out ones) use only
    characters that some later (training) line also has: a character the tokenizer never
    saw is an unknown token, which measures the split and not the new rows. Lines are taken
    in order; a line whose character would then be left to the held-out lines alone goes to
    training instead. Where the first ``n_eval`` lines already qualify, nothing moves."""
    from collections import Counter

    left = Counter(c for line in lines for c in set(line))  # lines still holding each char
    held, train = [], []
    for line in lines:
        if len(held) < n_eval and all(left[c] > 1 for c in set(line)):
            held.append(line)
            left.subtract(set(line))
        else:
            train.append(line)
    return held + train


def english_utterances(max_chars: int) -> list[str]:
    """``bench_new_language.english_sentences`` that fit in ``max_chars``."""
    from bench_new_language import english_sentences

    return [s for s in english_sentences() if len(s) <= max_chars]


# -- speech --------------------------------------------------------------------------------


def espeak_binary() -> str:
    found = shutil.which("espeak-ng")
    if found is None:
        raise CorpusError("the speech benchmark speaks its text with espeak-ng, which is not "
                          "on PATH. Install it: scripts/ensure_espeak.sh (Debian: apt-get "
                          "install -y espeak-ng).")
    return found


def speak(text: str, language: str) -> "Any":
    """``text`` spoken by espeak-ng in ``language``'s voice: float32 samples at 22,050 Hz."""
    import numpy as np

    done = subprocess.run([espeak_binary(), "-v", VOICES[language], "--stdout", text],
                          capture_output=True, check=False)
    raw = done.stdout
    if done.returncode != 0 or raw[:4] != b"RIFF" or len(raw) <= 44:
        raise CorpusError(f"espeak-ng -v {VOICES[language]} failed on {text!r} "
                          f"(exit {done.returncode}): {done.stderr.decode(errors='replace')[:200]}")
    # espeak-ng --stdout writes a streaming header (sizes unset): the samples follow byte 44.
    return np.frombuffer(raw[44:], dtype="<i2").astype("float32") / 32768.0


def speak_all(texts: Sequence[str], language: str, jobs: int = 2) -> list[Any]:
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda t: speak(t, language), texts))


def log_mel(wavs: Sequence[Any]) -> list[Any]:
    """Log-mel frames (80 x frames, hop 256) of each wav: coqui's TorchMelSpectrogram with
    the DVAE's settings and no norm file."""
    import torch
    from TTS.tts.layers.tortoise.arch_utils import TorchMelSpectrogram  # lazy: coqui-tts extra

    mel = TorchMelSpectrogram(mel_norm_file=None, sampling_rate=SAMPLE_RATE)
    out = []
    with torch.no_grad():
        for wav in wavs:
            out.append(mel(torch.from_numpy(wav)[None])[0].numpy())
    return out


def n_codes(samples: int) -> int:
    """XTTS's count of codes for a clip: ceil(samples / 1024)."""
    return max(1, math.ceil(samples / CODE_SAMPLES))


def code_frames(mel: Any, codes: int) -> Any:
    """(codes, 4 * 80): each code's four mel frames side by side (the last padded by
    repeating the final frame)."""
    import numpy as np

    need = codes * FRAMES_PER_CODE
    frames = mel.T
    if frames.shape[0] < need:
        frames = np.concatenate([frames, np.repeat(frames[-1:], need - frames.shape[0], 0)])
    return frames[:need].reshape(codes, FRAMES_PER_CODE * mel.shape[0])


def fit_codebook(vectors: Any, size: int, seed: int) -> Any:
    """k-means centres (``size`` x dim) of standardised code vectors (scikit-learn)."""
    from sklearn.cluster import MiniBatchKMeans  # lazy: the bench extra

    km = MiniBatchKMeans(n_clusters=size, random_state=seed, batch_size=4096, n_init=3,
                         max_iter=200)
    km.fit(vectors)
    return km.cluster_centers_.astype("float32")


def quantize(vectors: Any, centres: Any) -> list[int]:
    """The nearest centre of each vector."""
    import numpy as np

    d = (vectors ** 2).sum(1, keepdims=True) - 2 * vectors @ centres.T + (centres ** 2).sum(1)
    return np.argmin(d, axis=1).astype("int64").tolist()


def text_key(*parts: Any) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode("utf-8")).hexdigest()[:16]


__all__ = ["CODE_SAMPLES", "CorpusError", "SAMPLE_RATE", "VOICES", "amharic_entries",
           "amharic_utterances", "code_frames", "english_utterances", "espeak_binary",
           "fit_codebook", "lemma_file", "log_mel", "n_codes", "quantize", "speak", "speak_all",
           "text_key"]
