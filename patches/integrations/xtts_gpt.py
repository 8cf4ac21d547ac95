"""Integration ``xtts_gpt``: XTTS's ``GPTTrainer`` (coqui-tts 0.28) loads and freezes
through training-patches: ``__init__`` loads ``gpt_checkpoint`` with the vocabulary-aware
loader, not coqui's ``torch.randn`` padding (patch ``checkpoint``), then freezes the base rows
with ``TRAINING_PATCHES_BASE_VOCAB`` set (``vocab_freeze``), on every start and resume;
``load_checkpoint`` (``checkpoint``) loads ``xtts_checkpoint`` with the same loader.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import _options, languages
from .._log import logger
from .._registry import Integration, Site, active, register_integration
from ..reads_text import PREFIX, TextProbe, register_text_probe
from ..row_init import tokenizer_format
from ..vocab_freeze import TAG, VocabFreezeError, freeze_base_vocab
from ..vocab_rows import describe_rows, frozen_rows, row_layout
from .coqui_checkpoint import is_local, local_path, model_tokenizer

NAME = "xtts_gpt"
DISTRIBUTION = "coqui-tts"
SUPPORTED = ">=0.24,<0.29"
GPT_TRAINER = "TTS.tts.layers.xtts.trainer.gpt_trainer"
# Keys of a GPTTrainer state dict that XTTS itself drops when loading xtts_checkpoint.
_XTTS_IGNORED = ("torch_mel_spectrogram_style_encoder", "torch_mel_spectrogram_dvae", "dvae")

# Per GPTTrainer: the load of its base weights (xtts_checkpoint or gpt_checkpoint), which the
# coqui Trainer's run records where it starts (report checks the frozen rows against it).
_base_loads: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def base_load(model: Any) -> Any:
    """The LoadReport of the base weights loaded into ``model`` (a GPTTrainer), or None."""
    try:
        return _base_loads.get(model)
    except TypeError:  # not weak-referenceable: not a GPTTrainer
        return None


def make_gpt_trainer_load_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPTTrainer.load_checkpoint`` (``xtts_checkpoint``) through :func:`load_checkpoint`."""

    @functools.wraps(original)
    def gpt_trainer_load_checkpoint(self: Any, config: Any, checkpoint_path: Any, *,
                                    eval: bool = False, strict: bool = True,  # noqa: A002
                                    **kwargs: Any) -> Any:
        if not is_local(checkpoint_path) or not local_path(checkpoint_path).is_file():
            return original(self, config, checkpoint_path, eval=eval, strict=strict, **kwargs)
        from ..checkpoint.load import load_checkpoint  # lazy: heavy (issue 41)

        # XTTS drops the DVAE and mel-spectrogram keys and loads into self.xtts (the loader
        # aligns the "xtts." prefix); weights only, before any optimizer exists.
        report = load_checkpoint(local_path(checkpoint_path), self.xtts, strict=strict,
                                 restore_rng=False,
                                 key_filter=lambda key: key.split(".")[0] not in _XTTS_IGNORED,
                                 resume_step=False, tokenizer=model_tokenizer(config))
        _base_loads[self] = report
        if eval:
            self.xtts.gpt.init_gpt_for_inference(kv_cache=self.args.kv_cache, use_deepspeed=False)
            self.eval()
        else:
            _weights_only(report, "xtts_checkpoint loads the model")
        return None

    return gpt_trainer_load_checkpoint


def _weights_only(report: Any, what: str) -> None:
    """The WARNING of a load into a fresh GPTTrainer that drops a training checkpoint's state."""
    from ..checkpoint.load import warn_weights_only  # lazy: heavy (issue 41)

    warn_weights_only(
        report, f"{what} weights only (GPTTrainer builds no optimizer before it, and the coqui "
        f"Trainer counts from step 0)", "To resume that run with its optimizer, scheduler and "
        "step, start the coqui Trainer with continue_path=<its run folder> instead; to "
        "fine-tune from its weights on purpose, nothing needs to change.")


def load_gpt_checkpoint(gpt_trainer: Any, path: str | os.PathLike[str], *,
                        freeze: bool = True) -> Any:
    """What ``GPTTrainer.__init__`` does with ``gpt_checkpoint`` (a bare GPT state dict or a
    coqui Trainer checkpoint), through the loader: a grown vocabulary's new rows by its rules,
    spelled with GPTTrainer's own ``tokenizer_file``. Returns the LoadReport."""
    from ..checkpoint.load import load_checkpoint  # lazy: heavy (issue 41)

    # a coqui Trainer checkpoint holds the whole GPTTrainer: keep xtts.gpt.* only
    report = load_checkpoint(path, gpt_trainer.xtts.gpt, restore_rng=False, freeze=freeze,
                             strict=True, resume_step=False,
                             key_filter=lambda key: key.startswith("xtts.gpt.")
                             or not key.startswith(("xtts.", *_XTTS_IGNORED)),
                             tokenizer=model_tokenizer(getattr(gpt_trainer, "config", None)))
    _base_loads[gpt_trainer] = report
    _weights_only(report, "gpt_checkpoint loads the GPT")
    return report


def make_gpt_trainer_init(original: Callable[..., None]) -> Callable[..., None]:
    """``GPTTrainer.__init__`` for ``checkpoint`` (:func:`load_gpt_checkpoint` after upstream's
    ``__init__``), then ``vocab_freeze`` (:func:`check_vocab_layout`, then the freeze), each
    part run while its patch is applied."""

    @functools.wraps(original)
    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        with contextlib.ExitStack() as parts:
            if active("checkpoint"):
                parts.enter_context(_gpt_checkpoint_loaded(self, config))
            original(self, config, *args, **kwargs)
        base = _options.current().base_vocab
        if base and active("vocab_freeze"):
            check_vocab_layout(self, base)
            freeze_base_vocab(self, base)
    return __init__


@contextlib.contextmanager
def _gpt_checkpoint_loaded(trainer: Any, config: Any) -> Iterator[None]:
    """Upstream's ``__init__`` inside runs without a local ``gpt_checkpoint`` (coqui would
    load it and pad new rows with randn), which is then loaded with the loader."""
    model_args = getattr(config, "model_args", None)
    path = getattr(model_args, "gpt_checkpoint", "") if model_args is not None else ""
    if not path or not is_local(path):
        yield
        return
    model_args.gpt_checkpoint = ""
    try:
        yield
    finally:
        model_args.gpt_checkpoint = path
    load_gpt_checkpoint(trainer, local_path(path))  # the loader logs what it did


def vocab_layout_problems(tokenizer_file: str | os.PathLike[str], gpt: Any,
                          base_tokens: int, data_languages: Sequence[str] = ()) -> list[str]:
    """What is wrong between the tokenizer, the XTTS ``GPT`` and a freeze of the first
    ``base_tokens`` tokens (special tokens, each of ``data_languages``' ``[lang]``, start/stop
    ids, rows against ids, a frozen row kept for another token); empty when all agree."""
    from .xtts_vocab import FAIL, XttsVocab, parse_vocab_json  # lazy: only for a freeze check

    try:
        if tokenizer_format(tokenizer_file) != "json":
            return []  # a SentencePiece model: not an XTTS vocabulary
        tok = XttsVocab.of(parse_vocab_json(tokenizer_file))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"the tokenizer {tokenizer_file} could not be read to check it ({exc})"]
    problems = [f"{what} {detail}" for status, what, detail in tok.special_findings(None)
                if status == FAIL]
    for given in dict.fromkeys(languages.base_code(lang) for lang in data_languages if lang):
        registered = languages.get_language(given)
        # XTTS writes Chinese as [zh-cn] (VoiceBpeTokenizer.encode)
        codes = [given, *(["zh-cn"] if given == "zh" else [])] + [
            c for c in (registered.codes if registered else ()) if c != given]
        if not any(f"[{code}]" in tok.specials for code in codes):
            problems += [f"dataset language {given!r}: {what} {detail}"
                         for status, what, detail in tok.special_findings(given)
                         if status == FAIL and what == f"[{given}]"]
    for attr, token in (("start_text_token", "[START]"), ("stop_text_token", "[STOP]")):
        model_id, tok_id = getattr(gpt, attr, None), tok.vocab.get(token)
        if tok_id is not None and model_id != tok_id:
            problems.append(f"the model's {attr} is {model_id}, but the tokenizer's {token} "
                            f"is id {tok_id}")
    rows = int(gpt.text_embedding.weight.shape[0])
    if rows != tok.size:
        problems.append(f"the text embedding has {rows} rows, the tokenizer {tok.size} ids")
    if not 0 < base_tokens < rows:
        return problems
    names = {i: t for t, i in tok.vocab.items()}
    layout = row_layout(gpt, rows)
    frozen = frozen_rows(rows, layout.base_rows(base_tokens), start_row_last=layout.last_row_kept)
    start, last_base = tok.vocab.get("[START]"), base_tokens - 1
    kept = (f"rows {describe_rows(frozen)} are frozen at the base model's rows, so row "
            f"{last_base} ({names.get(last_base, 'no token')}) keeps the base model's row "
            f"{last_base}, its last base row, where XTTS keeps [START]")
    if start is None:
        problems.append(f"{kept}: with [START] missing, the token that took its id would keep "
                        f"[START]'s weights and never train")
    elif start >= base_tokens and start != rows - 1:
        problems.append(f"[START] is id {start}, a new row that trains, and not the last row "
                        f"(XTTS's layout); {kept}")
    return problems


def check_vocab_layout(gpt_trainer: Any, base_tokens: int) -> list[str]:
    """Check the GPTTrainer's tokenizer and model before its base rows are frozen: each
    problem is a WARNING (one paragraph), an error under ``TRAINING_PATCHES_STRICT=1``."""
    path = getattr(getattr(gpt_trainer, "args", None), "tokenizer_file", "") or ""
    gpt = getattr(getattr(gpt_trainer, "xtts", None), "gpt", None)
    if not path or gpt is None or not hasattr(gpt, "text_embedding"):
        return []
    datasets = getattr(getattr(gpt_trainer, "config", None), "datasets", None) or []
    data_languages = [str(getattr(d, "language", "") or "") for d in datasets]
    problems = vocab_layout_problems(path, gpt, base_tokens, data_languages)
    if not problems:
        return []
    text = (f"the vocabulary {path} and the model do not fit a freeze of the first "
            f"{base_tokens} tokens (TRAINING_PATCHES_BASE_VOCAB): " + "; ".join(problems)
            + f". Expected [STOP] 0, [UNK] 1, [SPACE], [START] and each dataset language's "
            f"[lang] as special tokens, the model's start/stop ids equal to them, and [START] "
            f"either kept at its base id or moved to the last id. `training-patches "
            f"verify-tokenizer {path} --base-size {base_tokens}` shows the layout; fix the "
            f"vocabulary (extend-tokenizer keeps it) or the base size")
    if _options.current().strict:
        raise VocabFreezeError(f"training-patches (TRAINING_PATCHES_STRICT=1): {text}.")
    logger.warning("%s WARNING: %s; training goes on (TRAINING_PATCHES_STRICT=1 stops here).",
                   TAG, text)
    return problems


# The reading probe's random conditioning: a mel segment of this many frames (N(0, 1): XTTS's
# mels are normalised), as the benchmark's reading base models were conditioned.
PROBE_COND_FRAMES = 128


@register_text_probe
def coqui_gpt_probe(owner: Any) -> TextProbe | None:
    """coqui's XTTS ``GPT``'s side of :func:`patches.reads_text.text_tv`: a random
    conditioning mel and audio prefix, then its own forward's next-audio-code logits."""
    kind = type(owner)
    if kind.__name__ != "GPT" or not kind.__module__.startswith("TTS.tts.layers.xtts."):
        return None

    def context(gen: Any) -> tuple[Any, Any]:
        cond = torch.randn(1, 1, 80, PROBE_COND_FRAMES, generator=gen)
        codes = min(owner.start_audio_token, owner.stop_audio_token)
        prefix = torch.randint(0, codes, (1, PREFIX), generator=gen)
        torch.randint(0, codes, (1, PREFIX), generator=gen)  # the benchmark's second prefix
        return cond, prefix

    def probs(params: Any, texts: Any, drawn: tuple[Any, Any]) -> Any:
        weight = params["text_embedding.weight"]  # the conditioning in the model's dtype
        cond, prefix = drawn[0].to(weight.device, weight.dtype), drawn[1].to(weight.device)
        device = weight.device
        b, texts = texts.shape[0], texts.to(device)
        args = (texts, torch.full((b,), texts.shape[1], device=device),
                prefix.expand(b, -1).contiguous(),
                torch.full((b,), PREFIX * owner.code_stride_len, device=device))
        _, _, logits = torch.func.functional_call(
            owner, dict(params), args, {"cond_mels": cond.expand(b, -1, -1, -1)}, strict=False)
        return torch.softmax(logits[:, :, :PREFIX + 1].float(), dim=1)

    return TextProbe(context, probs)


INTEGRATION = register_integration(Integration(
    name=NAME,
    distribution=DISTRIBUTION,
    supported=SUPPORTED,
    module="TTS",
    describe="gpt_checkpoint/xtts_checkpoint through the vocabulary-aware loader; "
             "TRAINING_PATCHES_BASE_VOCAB freezes every GPTTrainer",
    sites=(
        Site(GPT_TRAINER, "GPTTrainer.__init__", make_gpt_trainer_init,
             patch=("checkpoint", "vocab_freeze"),
             lost={"checkpoint": "gpt_checkpoint pads new vocabulary rows with torch.randn "
                                 "(std 1)",
                   "vocab_freeze": "TRAINING_PATCHES_BASE_VOCAB does not freeze XTTS "
                                   "GPTTrainer models"}),
        Site(GPT_TRAINER, "GPTTrainer.load_checkpoint", make_gpt_trainer_load_checkpoint,
             patch="checkpoint",
             lost="xtts_checkpoint fails on a grown vocabulary instead of resizing it"),
    ),
))
