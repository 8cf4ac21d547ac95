"""The reading gap in the coqui Trainer, for XTTS's GPTTrainer (patch ``learning``), at
sites of :mod:`.coqui_trainer` (``trainer.trainer``):

``Trainer.eval_step`` keeps up to ``reading_probe`` utterances per language (the language is
the text's first token, ``[am]``) from the first evaluation's formatted batches;
``Trainer.eval_epoch`` measures the reading gap on them after each evaluation, with the
evaluation loss (``avg_loss``) for the no-improvement verdict, rank 0 only, no collective;
``Trainer.fit`` says once when nothing is measured (:func:`say_if_unmeasured`). The loss is
XTTS's own ``loss_mel``, per utterance (:func:`audio_losses`). Design: docs/design/learning.md
"""

from __future__ import annotations

import functools
import math
import re
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .. import _run, learning
from .._log import info

# A language tag as XTTS's tokenizer writes it: [en], [am], [zh-cn]
_TAG = re.compile(r"^\[([a-z]{2,3}(?:-[a-z]{2,4})?)\]$")

_monitors: "weakref.WeakKeyDictionary[Any, learning.LearningMonitor]" = weakref.WeakKeyDictionary()


def _model(trainer: Any) -> Any:
    model = trainer.model
    return getattr(model, "module", model)


def _gpt(model: Any) -> Any | None:
    """XTTS's GPT when ``model`` is a GPTTrainer (``model.xtts.gpt``), else None."""
    gpt = getattr(getattr(model, "xtts", None), "gpt", None)
    return gpt if isinstance(gpt, torch.nn.Module) and hasattr(gpt, "set_mel_padding") else None


def _language(model: Any, token: int) -> str:
    tokenizer = getattr(getattr(getattr(model, "xtts", None), "tokenizer", None), "tokenizer", None)
    name = tokenizer.id_to_token(int(token)) if tokenizer is not None else None
    found = _TAG.match(name or "")
    return found.group(1) if found else "?"


def _is_rank0(trainer: Any) -> bool:
    return getattr(getattr(trainer, "args", None), "rank", 0) in (None, 0)


def monitor_of(trainer: Any) -> learning.LearningMonitor:
    """The Trainer's own monitor (one per Trainer)."""
    if trainer not in _monitors:
        _monitors[trainer] = learning.LearningMonitor()
    return _monitors[trainer]


# -- XTTS's GPT: the probe's utterances and their own audio loss --------------------------------
def keep_utterances(model: Any, batch: dict[str, Any], probe: learning.ReadingProbe) -> None:
    """Keep the utterances of a formatted GPTTrainer batch that ``probe`` still wants (CPU
    copies: the text ids, the codes, the wav length and the conditioning mels)."""
    gpt = _gpt(model)
    needed = ("text_inputs", "text_lengths", "audio_codes", "wav_lengths", "cond_mels")
    if gpt is None or any(not isinstance(batch.get(k), torch.Tensor) for k in needed):
        return
    cond_lens = batch.get("cond_lens")
    for i in range(batch["text_inputs"].shape[0]):
        length = int(batch["text_lengths"][i])
        ids = batch["text_inputs"][i, :length].detach().to("cpu", torch.long).clone()
        language = _language(model, int(ids[0])) if length else "?"
        if not probe.wants(language):
            continue
        wav = int(batch["wav_lengths"][i])
        codes = math.ceil(wav / gpt.code_stride_len) + 3
        probe.add(language, ids, {
            "codes": batch["audio_codes"][i, :codes].detach().to("cpu", torch.long).clone(),
            "wav_length": wav,
            "cond_mels": batch["cond_mels"][i].detach().to("cpu").clone(),
            "cond_len": None if not isinstance(cond_lens, torch.Tensor)
            else int(cond_lens[i])})


def _pad(rows: list[torch.Tensor], value: float = 0) -> torch.Tensor:
    longest = max(r.shape[-1] for r in rows)
    return torch.stack([F.pad(r, (0, longest - r.shape[-1]), value=value) for r in rows])


def mel_targets(gpt: Any, codes: torch.Tensor, wav_lengths: torch.Tensor) -> torch.Tensor:
    """The audio-code targets XTTS's ``GPT.forward`` builds for ``codes`` (its own steps:
    the stop code after each utterance's codes, -1 past it)."""
    code_lengths = torch.ceil(wav_lengths / gpt.code_stride_len).long() + 3
    longest = int(code_lengths.max())
    if longest > codes.shape[-1]:
        codes = F.pad(codes, (0, longest - codes.shape[-1]))
    codes = F.pad(codes[:, :longest], (0, 1), value=gpt.stop_audio_token)
    codes = gpt.set_mel_padding(codes, code_lengths - 3)
    _, targets = gpt.set_inputs_and_targets(codes, gpt.start_audio_token, gpt.stop_audio_token)
    for index, length in enumerate(code_lengths):
        targets[index, int(length) + 1:] = -1
    return targets


def audio_losses(model: Any, texts: list[torch.Tensor], audios: list[dict[str, Any]]) -> Any:
    """XTTS's audio-code loss of each (text, audio) pair: nats per code, per utterance; the
    batch's ``loss_mel`` alone (one number) when the per-utterance figures do not add up to
    it, so that :func:`patches.learning.reading_gap` measures one utterance at a time."""
    gpt = _gpt(model)
    device = next(gpt.parameters()).device
    text = _pad(texts).to(device)
    text_lengths = torch.tensor([len(t) for t in texts], device=device)
    codes = _pad([a["codes"] for a in audios]).to(device)
    wav_lengths = torch.tensor([a["wav_length"] for a in audios], device=device)
    cond = _pad([a["cond_mels"] for a in audios]).to(device)
    cond_lens = None if any(a["cond_len"] is None for a in audios) else torch.tensor(
        [a["cond_len"] for a in audios], device=device)
    _, loss_mel, logits = gpt(text, text_lengths, codes, wav_lengths, cond_mels=cond,
                              cond_idxs=None, cond_lens=cond_lens)
    if len(texts) == 1:
        return loss_mel
    targets = mel_targets(gpt, codes, wav_lengths)
    nats = F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction="none",
                           label_smoothing=getattr(gpt, "label_smoothing", 0.0))
    counted = (targets != -1).sum(1)
    if not math.isclose(float(nats.sum() / counted.sum()), float(loss_mel), rel_tol=1e-3,
                        abs_tol=1e-5):
        if _run.current().first_time("coqui_learning.batch_fallback"):
            info("learning: XTTS's per-utterance audio losses do not add up to its loss_mel "
                 "in this coqui-tts version; the probe measures one utterance at a time")
        return loss_mel
    return nats.sum(1) / counted


# -- the Trainer's sites ----------------------------------------------------------------------
def make_eval_step(original: Any) -> Any:
    @functools.wraps(original)
    def eval_step(self: Any, batch: Any, step: int) -> Any:
        result = original(self, batch, step)
        if _is_rank0(self) and isinstance(batch, dict):
            probe = monitor_of(self).probe
            if not probe.frozen:
                keep_utterances(_model(self), batch, probe)
        return result
    return eval_step


def make_eval_epoch(original: Any) -> Any:
    @functools.wraps(original)
    def eval_epoch(self: Any) -> None:
        original(self)
        if not _is_rank0(self):
            return
        model = _model(self)
        if _gpt(model) is None:
            learning.say_not_measured(
                f"the coqui model {type(model).__name__} has no (text, audio) loss the library "
                f"can measure (only XTTS's GPTTrainer)")
            return
        averages = getattr(getattr(self, "keep_avg_eval", None), "avg_values", None) or {}
        loss = averages.get("avg_loss")
        monitor_of(self).evaluate(
            model, step=int(getattr(self, "total_steps_done", 0) or 0),
            eval_loss=float(loss) if isinstance(loss, (int, float)) else None, loss_fn=audio_losses)
    return eval_epoch


def say_if_unmeasured(trainer: Any) -> None:
    """At ``Trainer.fit`` (:mod:`.coqui_trainer`'s one ``fit`` wrapper): a run with
    ``run_eval`` off is told once that nothing is measured."""
    if _is_rank0(trainer) and not getattr(getattr(trainer, "config", None), "run_eval", True):
        learning.say_not_measured(
            "the coqui Trainer's run_eval is off, so there are no evaluations to measure "
            "it at (set run_eval=True with evaluation samples; headlessXttsTrain.py: "
            "--eval-manifest)")


def reset() -> None:
    _monitors.clear()


__all__ = ["keep_utterances", "audio_losses", "mel_targets", "monitor_of", "make_eval_step",
           "make_eval_epoch", "say_if_unmeasured"]
