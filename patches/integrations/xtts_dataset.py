"""``xtts_dataset``: the XTTS dataset drops bad samples visibly and never loops.

coqui-tts 0.28's ``XTTSDataset.__getitem__`` catches every exception and recurses into
``self[1]`` with no bound (measured: 24 GB resident and killed when nothing loads). The
module binding ``XTTSDataset`` (and ``gpt_trainer``'s copy) becomes a subclass that picks as
coqui does in at most :data:`MAX_PICKS` picks, records each dropped sample once with its
reason in ``dropped_samples.jsonl`` (:func:`patches._run.output_dir`) and a log line, and
raises :class:`DatasetUnusableError` when more than ``max_drop_share`` of the samples fail. A
vocabulary without the ``[lang]`` token is a bad setup, not a bad sample: that error stops the
run at once. The user's view: TRAINING_PATCHES_README.md, "Dataset guard".
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from typing import Any, NoReturn

import torch

from .. import _options, _run
from .._log import logger
from .._registry import Integration, Site, is_enabled, register_integration, subclass_site
from ..dataset_guard import (  # noqa: F401  (re-exported: the XTTS guard's public names)
    REPORT_NAME, DatasetUnusableError, log_summary, read_report, record_drop, report_path,
    sample_key, summary)

NAME = "xtts_dataset"
DISTRIBUTION = "coqui-tts"
SUPPORTED = ">=0.27,<0.29"
MODULE = "TTS.tts.layers.xtts.trainer.dataset"
# Picks per item before giving up. With half the samples bad, 100 failed picks in a
# row happen with probability 2**-100; known-bad picks cost nothing.
MAX_PICKS = 100
_LOGGED_EACH = 10      # the first drops are logged one by one ...
_LOG_EVERY = 100       # ... then every 100th, with running totals
_UNK_ID, _STOP_ID = 1, 0  # coqui's XTTS vocabulary convention ([STOP] 0, [UNK] 1)

REASONS = {
    "decode_failure": "the audio file could not be read or decoded",
    "too_short": "the audio is shorter than 0.5 s",
    "too_long_audio": "the audio is longer than max_wav_length",
    "too_long_text": "the text has more tokens than max_text_length",
    "unknown_token": "the text has characters the vocabulary lacks ([UNK])",
    "stop_token": "the text encodes to the [STOP] token",
    "empty_text": "the transcript is empty",
    "unsupported_language": "the tokenizer does not know the sample's language",
    "load_error": "loading failed for another reason",
}
_HINTS = {
    "decode_failure": "check that the files exist and that FFmpeg's shared libraries are "
                      "installed (torchcodec needs them: apt-get install -y ffmpeg)",
    "too_short": "remove clips shorter than 0.5 s from the manifest",
    "too_long_audio": "split long clips or raise model_args.max_wav_length",
    "too_long_text": "split long transcripts or raise model_args.max_text_length",
    "unknown_token": "extend the tokenizer with text of this language (training-patches "
                     "extend-tokenizer VOCAB --corpus TEXT --language CODE --output NEW_VOCAB, "
                     "or headlessXttsTrain.py --extend-vocab TEXT) or check the language column",
    "stop_token": "remove the [STOP] marker from the transcripts",
    "empty_text": "fill in or remove the empty transcripts",
    "unsupported_language": "register the language (patches.advanced.register_language) with the "
                            "xtts_language patch applied",
    "load_error": "see the detail of each entry",
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _unknown_characters(tokenizer: Any, text: str, lang: str) -> list[str]:
    """The characters of the cleaned text that encode to [UNK] on their own."""
    try:
        cleaned = tokenizer.preprocess_text(text, lang.split("-")[0])
    except Exception:  # noqa: BLE001 - only a detail for the report
        cleaned = text
    backend = getattr(tokenizer, "tokenizer", None)
    if backend is None:
        return []
    return [char for char in dict.fromkeys(cleaned)
            if char != " " and _UNK_ID in backend.encode(char).ids][:20]


def _diagnose(dataset: Any, sample: dict[str, Any], exc: BaseException) -> tuple[str, str]:
    """(reason, detail) for a sample whose ``load_item`` raised ``exc``."""
    text = "" if sample.get("text") is None else str(sample["text"])
    lang = str(sample.get("language", ""))
    if not text.strip():
        return "empty_text", "the transcript is empty"
    try:
        tokens = list(dataset.tokenizer.encode(text, lang))
    except NotImplementedError as err:
        return "unsupported_language", _first_line(err)
    except Exception as err:  # noqa: BLE001 - any tokenizer failure is this sample's reason
        if _is_setup_error(err):
            raise
        return "load_error", f"tokenizing the text failed: {_first_line(err)}"
    if _UNK_ID in tokens:
        chars = _unknown_characters(dataset.tokenizer, text, lang)
        shown = " ".join(repr(c) for c in chars) or "(not found one by one)"
        return "unknown_token", f"characters not in the vocabulary: {shown}"
    if _STOP_ID in tokens:
        return "stop_token", "the text encodes to the [STOP] token (id 0)"
    dataset_module = sys.modules[type(dataset).__mro__[1].__module__]
    try:
        wav = dataset_module.load_audio(sample["audio_file"], dataset.sample_rate)
    except Exception as err:  # noqa: BLE001 - any decoder failure is this sample's reason
        return "decode_failure", _first_line(err)
    if wav is None or wav.shape[-1] < 0.5 * dataset.sample_rate:
        seconds = 0.0 if wav is None else wav.shape[-1] / dataset.sample_rate
        return "too_short", f"{seconds:.2f} s of audio, at least 0.5 s needed"
    return "load_error", _first_line(exc)


def _is_setup_error(exc: BaseException) -> bool:
    """Errors about the setup, not the sample (e.g. the vocabulary lacks ``[am]``)."""
    return type(exc).__name__ == "LanguageTokenMissingError"


def _size_problem(dataset: Any, wav: Any, tseq: Any) -> tuple[str, str] | None:
    if wav is None:
        return "decode_failure", "the audio loader returned nothing"
    if dataset.max_wav_len is not None and wav.shape[-1] > dataset.max_wav_len:
        rate = dataset.sample_rate
        return "too_long_audio", (f"{wav.shape[-1] / rate:.2f} s of audio, "
                                  f"max_wav_length allows {dataset.max_wav_len / rate:.2f} s")
    if dataset.max_text_len is not None and tseq.shape[0] > dataset.max_text_len:
        return "too_long_text", (f"{tseq.shape[0]} text tokens, max_text_length allows "
                                 f"{dataset.max_text_len}")
    return None


# -- the dataset --------------------------------------------------------------

def _dataset_class(original: type) -> type:
    class GuardedXTTSDataset(original):  # type: ignore[misc,valid-type]
        __doc__ = (f"coqui's XTTSDataset with bounded retries and a report of dropped "
                   f"samples (training-patches {NAME}).")

        # -- bookkeeping ----------------------------------------------------
        def _tp_state(self) -> dict[str, Any]:
            return self.__dict__.setdefault("_tp", {"dropped": {}, "path": None})

        def _tp_total(self) -> int:
            return max(len(self), 1)

        def _tp_split(self) -> str:
            return "eval" if self.is_eval else "train"

        def _tp_drop(self, sample: dict[str, Any], sample_id: str | None, reason: str,
                     detail: str, total: int | None = None) -> None:
            state = self._tp_state()
            if sample_id is not None:
                self.failed_samples.add(sample_id)
            key = sample_key(self._tp_split(), sample)
            if key in state["dropped"]:
                return
            state["dropped"][key] = reason
            path = state["path"] = state["path"] or report_path()
            entry = {"split": self._tp_split(), "audio_file": str(sample.get("audio_file")),
                     "text": str(sample.get("text")), "language": sample.get("language"),
                     "reason": reason, "detail": detail, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
            record_drop(path, key, entry)
            dropped = len(state["dropped"])
            total = self._tp_total() if total is None else total
            if dropped <= _LOGGED_EACH or dropped % _LOG_EVERY == 0:
                logger.warning(
                    "training-patches: dropped %s sample %s (%s: %s); %d of %d %s samples "
                    "dropped so far (%.0f%%), %s", self._tp_split(),
                    entry["audio_file"], reason, detail, dropped, total, self._tp_split(),
                    100.0 * dropped / max(total, 1), _run.where_recorded(str(path)))
            share = _options.current().max_drop_share
            if dropped > share * total:
                self._tp_raise(f"{dropped} of {total} {self._tp_split()} samples "
                               f"({100.0 * dropped / max(total, 1):.0f}%) could not be loaded, "
                               f"more than the limit of {100 * share:.0f}%")

        def _tp_raise(self, what: str) -> NoReturn:
            state = self._tp_state()
            reasons = Counter(state["dropped"].values())
            listed = ", ".join(f"{REASONS.get(r, r)} ({r}): {n}" for r, n in reasons.most_common())
            hints = "; ".join(_HINTS[r] for r, _ in reasons.most_common() if r in _HINTS)
            raise DatasetUnusableError(
                f"training-patches: {what}. Reasons: {listed or 'none recorded'}. Each dropped "
                f"sample is listed with its reason in {state['path'] or report_path()}. coqui's "
                f"XTTS dataset would retry forever here. Expected most samples to load. What to "
                f"do: {hints or 'check the manifest'}. To tolerate more bad samples raise "
                f"TRAINING_PATCHES_MAX_DROP_SHARE (now {_options.current().max_drop_share:g}).")

        # -- coqui's entry points ---------------------------------------------
        def check_eval_samples(self) -> None:
            if not is_enabled(NAME):
                return super().check_eval_samples()
            logger.info("Filtering invalid eval samples!!")
            kept = []
            total = len(self.samples)
            for sample in self.samples:
                problem = self._tp_examine(sample)
                if len(problem) == 2:
                    self._tp_drop(sample, None, *problem, total=total)
                else:
                    kept.append(sample)
            self.samples = kept
            logger.info("Total eval samples after filtering: %d", len(self.samples))
            return None

        def _tp_examine(self, sample: dict[str, Any]) -> Any:
            """The loaded item's parts, or (reason, detail) why the sample is dropped."""
            try:
                loaded = self.load_item(sample)
            except Exception as exc:  # noqa: BLE001 - coqui's loader raises anything
                if _is_setup_error(exc):
                    raise
                return _diagnose(self, sample, exc)
            tseq, _, wav, *_ = loaded
            problem = _size_problem(self, wav, tseq)
            return problem if problem is not None else loaded

        def _tp_pick(self, index: int, attempt: int) -> tuple[dict[str, Any], str]:
            if self.is_eval:
                # coqui falls back to self[1]; the next sample in order keeps eval
                # reproducible and cannot pick the same bad sample forever.
                position = (index + attempt) % len(self.samples)
                return self.samples[position], str(position)
            lang = random.choice(list(self.samples.keys()))
            position = random.randint(0, len(self.samples[lang]) - 1)
            return self.samples[lang][position], f"{lang}_{position}"

        def __getitem__(self, index: int) -> dict[str, Any]:
            if not is_enabled(NAME):
                return super().__getitem__(index)
            for attempt in range(MAX_PICKS):
                sample, sample_id = self._tp_pick(index, attempt)
                if sample_id in self.failed_samples:
                    continue
                loaded = self._tp_examine(sample)
                if isinstance(loaded, tuple) and len(loaded) == 2:
                    self._tp_drop(sample, sample_id, *loaded)
                    continue
                return self._tp_item(loaded)
            self._tp_raise(f"no loadable sample found in {MAX_PICKS} picks "
                           f"({len(self._tp_state()['dropped'])} of {self._tp_total()} "
                           f"{self._tp_split()} samples dropped so far)")

        @staticmethod
        def _tp_item(loaded: tuple[Any, ...]) -> dict[str, Any]:
            # The dict coqui-tts 0.28's __getitem__ builds from load_item's result.
            tseq, audiopath, wav, cond, cond_len, cond_idxs = loaded
            return {
                "text": tseq,
                "text_lengths": torch.tensor(tseq.shape[0], dtype=torch.long),
                "wav": wav,
                "wav_lengths": torch.tensor(wav.shape[-1], dtype=torch.long),
                "filenames": audiopath,
                "conditioning": cond.unsqueeze(1),
                "cond_lens": (torch.tensor(cond_len, dtype=torch.long)
                              if cond_len is not torch.nan else torch.tensor([cond_len])),
                "cond_idxs": (torch.tensor(cond_idxs)
                              if cond_idxs is not torch.nan else torch.tensor([cond_idxs])),
            }

    return GuardedXTTSDataset


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="TTS",
    describe=f"XTTS dataset: at most {MAX_PICKS} picks per item, every dropped sample listed",
    sites=(Site(MODULE, "XTTSDataset", subclass_site(_dataset_class, __name__,
                                                     "GuardedXTTSDataset"),
                sweep=True, patch="dataset_guard",
                lost="XTTSDataset retries a bad sample forever (unbounded recursion) and "
                     "drops samples without a word"),),
))
