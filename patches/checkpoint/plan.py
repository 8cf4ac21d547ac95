"""The model's part of a load plan: the checkpoint's keys matched to the model's, each
tensor checked (shape, kind of dtype, data, finite) and the text vocabulary grown (or,
on request, truncated). Pure: nothing here changes the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from .._log import logger
from ..reads_text import TextReading, probe_for, text_ids, text_tv
from ..row_init import (AUTO, AUTO_RULES, DEFAULT_HEAD_ROW_INIT, DEFAULT_ROW_INIT, SPELLED_RULES,
                        TAGS_FROM_START, RowSources, Tokens, TokenizerReadError, check_rule,
                        read_tokenizer, romanized_sources)
from ..vocab_resize import RowPlan, grow_bias, grow_rows
from ..vocab_rows import find_vocab_modules, row_layout
from .reading import _what_to_do, nonfinite_flags
from .errors import CheckpointError, CheckpointMismatchError, TokenizerMismatchError

# Parameter names (last two components) that carry the text vocabulary along dim 0.
VOCAB_SUFFIXES = ("text_embedding.weight", "text_head.weight", "text_head.bias")
# Prefixes a checkpoint's keys may carry relative to the model (DDP, torch.compile,
# Lightning). Any other first component of the checkpoint's or the model's keys (coqui's
# GPTTrainer's ``xtts.``) is tried too, by ``_align_keys_how``.
_KNOWN_PREFIXES = ("module.", "_orig_mod.", "model.")
# Where a checkpoint keeps the model's state dict (else it is the state dict itself).
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")


def model_state(ckpt: Mapping[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in a read checkpoint (under ``model`` and the like, or the
    checkpoint itself when it is a bare state dict); refused when it holds none."""
    for key in MODEL_KEYS:
        if isinstance(ckpt.get(key), Mapping):
            state = ckpt[key]
            break
    else:
        state = ckpt
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointError(
            f"training-patches: {path} has no model weights: expected a 'model' entry holding a "
            f"state dict (or a state dict itself); found the keys {sorted(map(str, ckpt))[:10]}. "
            f"{_what_to_do(path)}")
    return dict(tensors)


def align_keys(ckpt_keys: Iterable[str], model_keys: Iterable[str]) -> dict[str, str]:
    """model key -> checkpoint key, allowing one prefix difference (``module.``, ``xtts.``)."""
    return _align_keys_how(ckpt_keys, model_keys)[0]


def _align_keys_how(ckpt_keys: Iterable[str], model_keys: Iterable[str],
                    ) -> tuple[dict[str, str], str, str]:
    """:func:`align_keys` and how: (model key -> checkpoint key, the prefix stripped from
    the checkpoint's keys, the prefix added to them); both prefixes "" when none was."""
    ckpt_keys = list(ckpt_keys)
    model_set = set(model_keys)
    transforms: list[tuple[str, str]] = [("", "")]
    firsts = {k.split(".", 1)[0] + "." for k in ckpt_keys if "." in k}
    firsts |= {".".join(k.split(".")[:2]) + "." for k in ckpt_keys if k.count(".") >= 2}
    model_firsts = {k.split(".", 1)[0] + "." for k in model_set if "." in k}
    transforms += [(p, "") for p in firsts | set(_KNOWN_PREFIXES)]
    transforms += [("", q) for q in model_firsts | set(_KNOWN_PREFIXES)]
    best: dict[str, str] = {}
    how = ("", "")
    for strip, add in transforms:
        mapping: dict[str, str] = {}
        for key in ckpt_keys:
            if strip and not key.startswith(strip):
                continue
            target = add + key[len(strip):]
            if target in model_set:
                mapping[target] = key
        if len(mapping) > len(best):
            best, how = mapping, (strip, add)
    return best, how[0], how[1]


def _kind(tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.bool:
        return "bool"
    if tensor.is_complex():
        return "complex"
    return "floating" if tensor.is_floating_point() else "integer"


def _check_tensor_kinds(path: Path, source: Mapping[str, torch.Tensor], aligned: Mapping[str, str],
                        target: Mapping[str, torch.Tensor]) -> None:
    """Every tensor to load holds data (not meta), is a plain dense tensor, and its dtype can
    be copied into the model's (a float into a float, an integer into an integer)."""
    empty, layout, kinds = [], [], []
    for key, ckpt_key in aligned.items():
        value = source[ckpt_key]
        if value.is_meta:
            empty.append(ckpt_key)
        elif value.layout != torch.strided or value.is_quantized:
            layout.append(f"{ckpt_key} ({value.layout})")
        elif _kind(value) != _kind(target[key]):
            kinds.append(f"{ckpt_key}: checkpoint {value.dtype}, model {target[key].dtype}")
    if empty:
        raise CheckpointError(
            f"training-patches: refused to load {path}: {len(empty)} tensor(s) hold no data "
            f"({', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''}): they were saved from "
            f"a model on the 'meta' device (built without weights). Expected every tensor to "
            f"hold its values. Nothing was loaded. Save the checkpoint again from a model whose "
            f"weights exist. {_what_to_do(path)}")
    if layout or kinds:
        found = layout + kinds
        raise CheckpointMismatchError(
            f"training-patches: refused to load {path}: {len(found)} tensor(s) do not fit the "
            f"model's ({'; '.join(found[:5])}{'; ...' if len(found) > 5 else ''}). Expected dense "
            f"tensors of the model's kind of dtype (floating point into floating point, integer "
            f"into integer). Nothing was loaded. Build the model with the configuration the "
            f"checkpoint was trained with.")


def check_finite(path: Path, plan: "ModelPlan", model: torch.nn.Module) -> None:
    """Refuse NaN/Inf in what would be loaded: parameters must be finite; buffers must not
    hold NaN (an attention mask may hold -inf on purpose)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    bad = nonfinite_flags([(f"{plan.aligned.get(key, key)}", value, key not in params)
                           for key, value in plan.state.items()])
    if bad:
        raise CheckpointError(
            f"training-patches: refused to load {path}: {len(bad)} tensor(s) hold NaN or Inf "
            f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}). Expected finite weights; "
            f"training from these gives NaN losses. Nothing was loaded. {_what_to_do(path)} "
            f"To load it anyway (e.g. to inspect it), pass allow_nonfinite=True.")


def vocab_modules_of(model: torch.nn.Module, named: Sequence[str] = ()) -> list[str]:
    """The modules whose rows are ``model``'s vocabulary, beside the ``text_embedding`` /
    ``text_head`` keys: those ``named``, and the registered finders' (a Hugging Face model's
    get_input/output_embeddings(), F5-TTS's text_embed)."""
    found = find_vocab_modules(model)
    return [*named, *(name for name, _ in (found[0] if found else ()))]


def _is_vocab_key(key: str, vocab_modules: Sequence[str]) -> bool:
    if any(key.endswith(suffix) for suffix in VOCAB_SUFFIXES):
        return True
    return any(key in (f"{name}.weight", f"{name}.bias") for name in vocab_modules)


def _owner(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
    except AttributeError:
        return None


def _vocab_owner(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    """The module owning a vocabulary tensor's module: ``gpt`` for
    ``gpt.text_embedding.weight``, the model for ``text_embedding.weight`` (the module
    :func:`row_layout` reads)."""
    owner_path = _owner_path(key)
    return _owner(model, owner_path + ".x") if owner_path else model


def _owner_path(key: str) -> str:
    """The path of the module owning a vocabulary tensor's module: ``gpt`` for
    ``gpt.text_embedding.weight``, "" for ``text_embedding.weight``."""
    return key.rsplit(".", 2)[0] if key.count(".") >= 2 else ""


def _start_row_last(model: torch.nn.Module, keys: Sequence[str], new_rows: int,
                    ckpt: Mapping[str, Any], setting: str | bool) -> bool:
    """Whether the vocabulary's last row must stay last when it grows (a start token kept at
    the last id, or a slot row): ``"auto"`` asks the owner's layout (:mod:`patches.vocab_rows`),
    and the checkpoint confirms it where it records it."""
    if isinstance(setting, bool):
        return setting
    for key in keys:
        # "gpt.text_embedding.weight" -> the module "gpt", which owns the start token
        layout = row_layout(_vocab_owner(model, key), new_rows)
        if layout.last_row_kept:  # a start token kept last, or a slot row that is no token
            confirm = layout.checkpoint_last_row_kept
            said = confirm(ckpt) if confirm is not None else None
            return True if said is None else said
    return False


@dataclass
class ModelPlan:
    """What :func:`plan_model` decided: ``state`` (model key -> the tensor to load, rows
    grown), ``aligned`` (model key -> checkpoint key), ``resized`` (key -> (old shape, new
    shape)), ``rows`` (the vocabulary's :class:`RowPlan`, None when it did not change)."""

    aligned: dict[str, str]
    state: dict[str, torch.Tensor]
    resized: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    rows: RowPlan | None
    missing: list[str]
    unexpected: list[str]
    prefix_stripped: str = ""
    prefix_added: str = ""
    # model key -> (saved dtype, model dtype) where they differ: load_state_dict casts them
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)
    # how the new rows started, when rows were added
    new_rows: "NewRows | None" = None


@dataclass(frozen=True)
class NewRows:
    """How the new rows of a grown vocabulary started: the rule of the embedding and of the
    head, the part of each grown key, the spelled rows (``sources``; None: no tokenizer)."""

    embedding: str
    head: str
    sources: RowSources | None
    parts: dict[str, str]  # grown model key -> "embedding" or "head"
    added: int = 0  # new rows in each grown tensor
    # new language tags started as the start token in every grown tensor (row_init.TAGS_FROM_START)
    tag_rows: tuple[int, ...] = ()
    # under row_init "auto": whether the base model reads its text, which chose ``embedding``
    reading: TextReading | None = None

    def rule_of(self, key: str) -> str:
        return self.head if self.parts[key] == "head" else self.embedding

    def describe(self) -> str:
        """``embedding romanized (118 from their spelling, 2 by spread ('።')), head mean;
        spelled by the library's Amharic table ('am'): 118``."""
        out = []
        for part, rule in (("embedding", self.embedding), ("head", self.head)):
            if part not in self.parts.values():
                continue
            if rule not in SPELLED_RULES:
                out.append(f"{part} {rule}")
            elif self.sources is None:
                out.append(f"{part} {rule}: no tokenizer was given to spell the "
                           f"new tokens: all by spread")
            else:
                out.append(f"{part} {rule} "
                           f"({self.sources.describe(tags_from_start=bool(self.tag_rows))})")
        spellers = self.sources.spellers() if self.sources is not None else ""
        why = f"; {self.why_auto()}" if self.reading is not None else ""
        return ", ".join(out) + (f"; {spellers}" if spellers else "") + why

    def why_auto(self) -> str:
        """Why row_init ``auto`` chose the embedding's rule, from the probe's answer."""
        reading = self.reading
        if reading is None:
            return ""
        if reading.failed:
            found = f"could not tell whether the base model reads its text ({reading.why})"
            then = "the rule where it reads"
        elif reading.reads is None:
            found, then = f"not probed ({reading.why})", "the rule where the base model reads"
        elif reading.reads:
            found = f"the base model reads its text ({reading.why}, in {reading.seconds:.1f} s)"
            then = "spelled rows, which make it read the new language"
        else:
            found = (f"the base model does not read its text ({reading.why}, in "
                     f"{reading.seconds:.1f} s)")
            then = ("near-zero rows, which keep the base language; "
                    "TRAINING_PATCHES_ROW_INIT=spelling forces spelled rows")
        return (f"embedding rule auto: {found} -> {self.embedding}, {then} "
                f"(docs/design/row_init.md)")


def _shrink_error(path: Path, model: torch.nn.Module, keys: Sequence[str],
                  rows: RowPlan) -> CheckpointMismatchError:
    """A smaller vocabulary, explained in the tokens users count (not rows)."""
    layout = row_layout(_vocab_owner(model, keys[0]), rows.new_rows)
    old_tokens = rows.old_rows - layout.extra_rows - layout.leading_rows
    new_tokens = rows.new_rows - layout.extra_rows - layout.leading_rows
    first = rows.new_rows - 1 if rows.start_row_last and not layout.extra_rows else new_tokens
    last = first + (old_tokens - new_tokens) - 1
    return CheckpointMismatchError(
        f"training-patches: the model's tokenizer has {new_tokens} tokens and the checkpoint "
        f"{path} was trained with {old_tokens}: {old_tokens - new_tokens} token(s) fewer "
        f"(text embedding rows {rows.new_rows} vs {rows.old_rows}, layout "
        f"'{layout.name}'). Loading would throw away the trained rows of those tokens, so "
        f"nothing was loaded. Use the tokenizer the checkpoint was trained with, or an "
        f"extension of it. If you removed the last token ids (ids {first}..{last} of the "
        f"checkpoint) on purpose, load with truncate=True to drop exactly those rows.")


def _is_head(model: torch.nn.Module, key: str) -> bool:
    """A vocabulary tensor of the output head (a Linear's weight, any bias), not of the
    input embedding."""
    owner = _owner(model, key)
    return key.endswith(".bias") or not isinstance(owner, torch.nn.Embedding)


def plan_model(path: Path, ckpt: Mapping[str, Any], model: torch.nn.Module, *,
               strict: bool, vocab_modules: Sequence[str], start_token_row: str | bool,
               seed: int, key_filter: Callable[[str], bool] | None = None,
               truncate: bool = False, row_init: str = DEFAULT_ROW_INIT,
               head_row_init: str = DEFAULT_HEAD_ROW_INIT,
               tokenizer: Any = None) -> ModelPlan:
    """The :class:`ModelPlan` of loading ``ckpt`` into ``model``: keys matched, shapes and
    dtypes checked, vocabulary rows grown. Raises before anything is changed."""
    source = model_state(ckpt, path)
    if key_filter is not None:
        source = {k: v for k, v in source.items() if key_filter(k)}
    target = model.state_dict()
    vocab_modules = vocab_modules_of(model, vocab_modules)
    aligned, stripped, added = _align_keys_how(source, target)
    missing = sorted(set(target) - set(aligned))
    unexpected = sorted(set(source) - set(aligned.values()))
    vocab: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    wrong: list[str] = []
    for key, ckpt_key in aligned.items():
        old, new = tuple(source[ckpt_key].shape), tuple(target[key].shape)
        if old == new:
            continue
        if (_is_vocab_key(key, vocab_modules) and len(old) == len(new) and old[1:] == new[1:]
                and len(old) >= 1):
            vocab[key] = (old, new)
        else:
            wrong.append(f"{key}: checkpoint {list(old)}, model {list(new)}")
    _check_tensor_kinds(path, source, aligned, target)
    if wrong:
        raise CheckpointMismatchError(
            f"training-patches: the checkpoint {path} does not fit this model: "
            f"{len(wrong)} tensor(s) have other shapes ({'; '.join(wrong[:6])}"
            f"{'; ...' if len(wrong) > 6 else ''}). Only a grown text vocabulary "
            f"(rows of {', '.join(VOCAB_SUFFIXES)}) is adapted; anything else means a different "
            f"model configuration. Nothing was loaded (no partial load). Build the model with the "
            f"configuration the checkpoint was trained with.")
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"training-patches: the checkpoint {path} does not fit this model: "
            f"{len(missing)} model key(s) are not in it ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}) and {len(unexpected)} of its keys are not in "
            f"the model ({', '.join(unexpected[:5])}{', ...' if len(unexpected) > 5 else ''}). "
            f"Nothing was loaded. Use the model class and configuration it was trained with, or "
            f"pass strict=False to load the keys that match.")
    rows: RowPlan | None = None
    state: dict[str, torch.Tensor] = {key: source[ck] for key, ck in aligned.items()}
    casts = {key: (_dtype_name(source[ck].dtype), _dtype_name(target[key].dtype))
             for key, ck in aligned.items() if source[ck].dtype != target[key].dtype}
    if vocab:
        olds = {old[0] for old, _ in vocab.values()}
        news = {new[0] for _, new in vocab.values()}
        if len(olds) != 1 or len(news) != 1:
            raise CheckpointMismatchError(
                f"training-patches: the vocabulary tensors of {path} disagree: "
                + "; ".join(f"{k}: checkpoint {list(o)}, model {list(n)}"
                            for k, (o, n) in vocab.items())
                + ". Expected the text embedding and text head to have the same number of rows. "
                  "Nothing was loaded.")
        old_rows, new_rows = olds.pop(), news.pop()
        move = _start_row_last(model, list(vocab), new_rows, ckpt, start_token_row)
        rows = RowPlan(old_rows, new_rows, start_row_last=move)
        if new_rows < old_rows and not truncate:
            raise _shrink_error(path, model, list(vocab), rows)
        new_rows = None
        if rows.added > 0:
            new_rows = _new_rows(path, model, list(vocab), rows, check_rule(row_init),
                                 check_rule(head_row_init, "head_row_init"), tokenizer,
                                 functools.partial(_reads_text, model, vocab, state, rows))
        generator = torch.Generator().manual_seed(seed)
        for key in vocab:
            old = state[key]
            rule = new_rows.rule_of(key) if new_rows is not None else "mean"
            sources = new_rows.sources if new_rows is not None else None
            grown = _grown(old, rows, generator, rule, sources)
            if new_rows is not None and new_rows.tag_rows:
                grown[list(new_rows.tag_rows)] = old[rows.old_rows - 1]  # the start token's
            state[key] = grown.to(dtype=target[key].dtype)
        _one_value_for_tied(state, target, vocab, new_rows)
    return ModelPlan(aligned, state, vocab, rows, missing, unexpected, stripped, added, casts,
                     new_rows if vocab else None)


def _one_value_for_tied(state: dict[str, torch.Tensor], target: Mapping[str, torch.Tensor],
                        vocab: Mapping[str, Any], new_rows: NewRows | None) -> None:
    """A head tied to the embedding (GPT-2's ``lm_head`` is ``wte``) is one tensor under two
    keys: it gets the embedding's grown value, or loading both would leave whichever came
    last (the head's rule) in the embedding."""
    embeddings = {target[k].data_ptr(): k for k in vocab
                  if new_rows is None or new_rows.parts.get(k) == "embedding"}
    for key in vocab:
        twin = embeddings.get(target[key].data_ptr())
        if twin is not None and twin != key:
            state[key] = state[twin]


class _NotProbed(Exception):
    """Why the probe is not asked (said on the load line, no WARNING)."""


def _reads_text(model: torch.nn.Module, vocab: Mapping[str, Any],
                state: Mapping[str, torch.Tensor], rows: RowPlan, tokens: Tokens | None,
                key: str, lead_rows: int) -> TextReading:
    """Whether the base model reads its text (:func:`patches.reads_text.text_tv`), asked of
    the module owning the text embedding ``key`` with the checkpoint's tensors (the new rows
    made by a throwaway rule: the probe's texts hold base ids only, token ``i`` at row ``i +
    lead_rows``); the model is not changed."""
    if tokens is None:
        return TextReading(None, None, "no tokenizer was given to draw the probe's texts from")
    owner = _vocab_owner(model, key)
    probe = probe_for(owner)
    if probe is None:
        return TextReading(None, None, f"no reading probe for a {type(owner).__name__}")
    try:
        path = _owner_path(key)
        params = _probe_params(owner, f"{path}." if path else "", vocab, state, rows)
        ids, lead = text_ids(tokens, rows.base_rows - lead_rows)
    except _NotProbed as exc:
        return TextReading(None, None, str(exc))
    except Exception as exc:  # noqa: BLE001 - a probe never stops a load: said, spelled rows
        return TextReading(None, None, f"its inputs could not be made: {type(exc).__name__}: "
                                       f"{' '.join(str(exc).split())[:200]}", failed=True)
    return text_tv(owner, params, [i + lead_rows for i in ids],
                   None if lead is None else lead + lead_rows, probe=probe)


def _probe_params(owner: torch.nn.Module, prefix: str, vocab: Mapping[str, Any],
                  state: Mapping[str, torch.Tensor], rows: RowPlan) -> dict[str, torch.Tensor]:
    """``owner``'s tensors for the probe, by its own names: every one from the checkpoint (one
    missing: not probed, the model's own would be measured), floating point in float32 (a
    half-precision model's forward on the CPU), the grown ones with throwaway new rows, one
    value per tied tensor; its non-persistent buffers its own, beside them."""
    own = owner.state_dict(keep_vars=True)
    missing = [name for name in own if prefix + name not in state]
    if missing:
        raise _NotProbed(f"the checkpoint lacks {len(missing)} of its tensors "
                         f"({', '.join(prefix + n for n in missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''})")
    weights = {name for name, _ in owner.named_parameters(remove_duplicate=False)}
    throwaway = torch.Generator().manual_seed(0)
    params: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, mine in own.items():
        if id(mine) in seen:  # tied: functional_call gives the other name the same value
            continue
        seen.add(id(mine))
        value = state[prefix + name]
        if prefix + name in vocab:
            value = _grown(value, rows, throwaway, "std0.02")
        params[name] = value.float() if value.is_floating_point() else value
    bad = nonfinite_flags([(prefix + n, v, False) for n, v in params.items() if n in weights])
    if bad:
        raise _NotProbed(f"the checkpoint's {bad[0]} holds NaN or Inf")
    device = next(iter(params.values())).device
    for name, buffer in owner.named_buffers():
        if name not in params:  # non-persistent: the module's own, where the others are
            params[name] = (buffer.float() if buffer.is_floating_point() else buffer).to(device)
    return params


def _grown(old: torch.Tensor, rows: RowPlan, generator: torch.Generator, rule: str,
           sources: RowSources | None = None) -> torch.Tensor:
    """A vocabulary tensor grown by ``rule``: a bias (1-D) or rows."""
    grow = grow_bias if old.dim() == 1 else grow_rows
    return grow(old, rows, generator, rule, sources)


def _new_rows(path: Path, model: torch.nn.Module, keys: Sequence[str], rows: RowPlan,
              row_init: str, head_row_init: str, tokenizer: Any,
              reads_text: Callable[[Tokens | None, str, int], TextReading]) -> NewRows:
    """The rule of each grown tensor (``auto`` chosen by ``reads_text``), and for a spelled
    rule the rows spelled with the tokenizer (checked against the model's rows first)."""
    parts = {key: "head" if _is_head(model, key) else "embedding" for key in keys}
    used = {head_row_init if part == "head" else row_init for part in parts.values()}
    sources = None
    tokens = None
    lead = 0
    if used & {*SPELLED_RULES, AUTO} and tokenizer is not None:
        spelled = " and ".join(map(repr, sorted(used & {*SPELLED_RULES, AUTO})))
        layout = row_layout(_vocab_owner(model, keys[0]), rows.new_rows)
        # rows before token 0 (F5-TTS's filler): token i is row i + lead
        lead = layout.leading_rows
        new_ids = [r - lead for r in rows.new_row_indices()]
        try:
            tokens = read_tokenizer(tokenizer)
            why = tokens.mismatch(rows.new_rows - lead - layout.extra_rows,
                                  rows.old_rows - lead - layout.extra_rows, new_ids,
                                  rows.start_row_last)
            if why is None:
                sources = romanized_sources(tokens, new_ids,
                                            trained=lambda i: 0 <= i < rows.base_rows - lead
                                            ).shifted(lead)
        except TokenizerReadError as exc:
            raise TokenizerMismatchError(
                f"training-patches: cannot start the new rows of {path} from their spelling "
                f"(row_init {spelled}): the tokenizer given could not be read ({exc}). "
                f"Nothing was loaded. Pass tokenizer= the grown tokenizer the model was built "
                f"with (a vocab.json or a SentencePiece .model), or another row_init.") from None
        if why is not None:
            raise TokenizerMismatchError(
                f"training-patches: cannot start the new rows of {path} from their spelling "
                f"(row_init {spelled}): the tokenizer {tokens.name} does not fit the model "
                f"({keys[0]}: {rows.new_rows} rows, layout '{layout.name}'): {why}. Spelled "
                f"with it, the new rows would start from the rows of unrelated tokens. Nothing "
                f"was loaded. Pass tokenizer= the grown tokenizer the model was built with, or "
                f"another row_init ('spread' needs none).")
    reading = None
    if row_init == AUTO and "embedding" in parts.values():
        embedding = next(key for key, part in parts.items() if part == "embedding")
        reading = reads_text(tokens, embedding, lead)
        if reading.failed:
            logger.warning("training-patches: %s: row_init auto could not tell whether the base "
                           "model reads its text (%s); its new embedding rows start by %s, the "
                           "rule where it reads. Set TRAINING_PATCHES_ROW_INIT to choose.",
                           path, reading.why, AUTO_RULES[None])
        row_init = AUTO_RULES[reading.reads]
    elif row_init == AUTO:
        row_init = AUTO_RULES[None]  # no embedding grew: the head's rule is its own
    if not {row_init, head_row_init} & set(SPELLED_RULES):
        sources = None  # auto chose unspelled rows: nothing was spelled
    tags = ()
    if row_init in TAGS_FROM_START and sources is not None and rows.start_row_last:
        tags = tuple(sources.tags)
    return NewRows(row_init, head_row_init, sources, parts, rows.added, tags, reading)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
