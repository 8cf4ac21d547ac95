"""A trainer's own resume into a model whose vocabulary grew after the checkpoint.

Trainers that read their checkpoints themselves (the Hugging Face Trainer, Lightning) stop
at a size mismatch when the tokenizer grew. Their integrations use three steps:
:func:`vocabulary_growth` finds the vocabulary tensors whose rows changed (nothing when any
other shape differs), :func:`load_grown` loads the weights through :func:`load_checkpoint`,
and, after the trainer loaded its optimizer state at the old shapes,
:func:`grow_loaded_moments` grows the moments of the grown rows. The load line names the
parts the trainer restores itself, and from where (:class:`TrainerResume`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from .._log import logger
from ..vocab_resize import RowPlan, grow_moment, is_second_moment
from . import _collective
from .decide import LoadOptions, decide
from .errors import TokenizerMismatchError
from .load import _say
from .parts import carry_out
from .plan import _is_vocab_key, vocab_modules_of
from .report import LoadReport

# parameter id -> (its name, how its rows grew)
Grown = dict[int, tuple[str, RowPlan]]


def saved_shapes(path: Path, key: str | None = None) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's shape in a weights file (``.safetensors``, or a ``torch.save`` file, of
    its entry ``key`` when given), read without loading the tensors; None when it cannot be."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open  # lazy: only a safetensors file needs it

            with safe_open(str(path), framework="pt") as handle:
                return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if key is not None:
            state = state.get(key) if isinstance(state, Mapping) else None
        return tensor_shapes(state or {})
    except Exception as exc:  # noqa: BLE001 - never into the trainer's resume: upstream loads
        logger.info("training-patches: the tensor shapes of %s could not be read (%s: %s); "
                    "the trainer loads it as without the patches", path, type(exc).__name__,
                    str(exc)[:200])
        return None


def tensor_shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a state dict (its other entries left out)."""
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def shape_changes(saved: Mapping[str, tuple[int, ...]], model: torch.nn.Module
                  ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """key -> (saved shape, the model's shape) for each key both have at different shapes."""
    own = model.state_dict()
    return {key: (tuple(shape), tuple(own[key].shape)) for key, shape in saved.items()
            if key in own and tuple(shape) != tuple(own[key].shape)}


def vocabulary_growth(saved: Mapping[str, tuple[int, ...]], model: torch.nn.Module
                      ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """:func:`shape_changes` when each of them is a vocabulary tensor's rows (other
    dimensions equal), else nothing: any other shape stays the trainer's business."""
    changes = shape_changes(saved, model)
    names = vocab_modules_of(model)
    rows_only = all(_is_vocab_key(key, names) and len(old) == len(new) and old[1:] == new[1:]
                    for key, (old, new) in changes.items())
    return changes if rows_only else {}


@dataclass(frozen=True)
class TrainerResume:
    """What a trainer restores itself around the weights the library loads, for the load line.

    ``trainer``: who; ``restores``: each part of :data:`patches.checkpoint.PARTS` it restores
    -> the file or key it reads it from; ``step``: the step it resumes at; ``tokenizer``: the
    grown tokenizer to spell the new tokens with, or None; ``tokenizer_source``: where it
    was found, or where the integration looked."""

    trainer: str
    restores: Mapping[str, str] = field(default_factory=dict)
    step: int | None = None
    tokenizer: Any = None
    tokenizer_source: str = ""

    def tell(self, report: LoadReport) -> None:
        """``report`` as the whole resume has it: the parts the trainer restores are
        ``restored`` by it, from where; the model part names the tokenizer."""
        for name, where in self.restores.items():
            if name == "step" and self.step is None:
                continue  # a step nothing says: the library's word stands
            after = (", then its moments of the grown rows grown by training-patches"
                     if name == "optimizer" else "")
            report.set_part(name, "restored", f"by {self.trainer} from {where}{after}",
                            in_file=True)
        if "step" in self.restores and self.step is not None:
            report.step = report.saved_step = self.step
        model = report.parts.get("model")
        if model is not None:
            spelled = (f"new tokens spelled with {self.tokenizer_source}" if self.tokenizer
                       is not None else f"no tokenizer found ({self.tokenizer_source})")
            report.set_part("model", model.status, "; ".join(
                p for p in (model.detail, spelled) if p), in_file=model.in_file)


def load_grown(path: Path, model: torch.nn.Module, saved_keys: set[str], *,
               resume: TrainerResume, strict: bool = True, ema: Any = None) -> Grown:
    """Load ``path``'s weights (and EMA weights into ``ema``) into the grown ``model`` as
    :func:`load_checkpoint` does, the load line saying what ``resume`` restores; returns the
    parameters whose rows grew. A tied alias of a saved key does not count as missing."""
    own = model.state_dict()
    by_storage: dict[int, set[str]] = {}
    for key, value in own.items():
        if value.data_ptr():  # empty and meta tensors have none: never "tied"
            by_storage.setdefault(value.data_ptr(), set()).add(key)
    missing = [key for key in own if key not in saved_keys]
    tied = bool(missing) and all(by_storage.get(own[key].data_ptr(), set()) & saved_keys
                                 for key in missing)
    options = LoadOptions(strict=strict and not tied, restore_rng=False, ema=ema,
                          tokenizer=resume.tokenizer).resolved()

    def load(gate: Any = None) -> LoadReport:  # load_checkpoint's, with the resume's line
        told = resume
        try:
            plan = decide(path, model, None, None, None, options)
        except TokenizerMismatchError as exc:
            if resume.tokenizer is None:
                raise
            # The integration found this tokenizer; the user never named it. A resume
            # upstream would make is not refused over it: the new rows start by 'spread'.
            logger.warning(
                "training-patches: %s found %s to spell the new tokens with, and it cannot "
                "be used: %s The resume goes on with the new rows started by 'spread' "
                "instead; to spell them, give the trainer the tokenizer the model was grown "
                "with.", resume.trainer, resume.tokenizer_source, exc)
            told = dataclasses.replace(resume, tokenizer=None, tokenizer_source=(
                f"{resume.tokenizer_source}, which does not fit the model"))
            plan = decide(path, model, None, None, None,
                          dataclasses.replace(options, tokenizer=None))

        def say(report: LoadReport) -> None:
            told.tell(report)
            _say(path, report, plan.model)
        return carry_out(plan.state, gate or (lambda: None), say, checkpoint=plan.checkpoint)

    report = _collective.on_every_rank(load) if _collective.active() else load()
    params = dict(model.named_parameters(remove_duplicate=False))
    grown: Grown = {}
    for key, (before, now) in report.resized.items():  # what the load grew, as it says
        if key in params:
            grown[id(params[key])] = (key, RowPlan(old_rows=before[0], new_rows=now[0]))
    return grown


def grow_loaded_moments(optimizer: Any, grown: Grown) -> list[str]:
    """Grow, in place, every loaded optimizer moment that still has the old rows of a grown
    parameter; the names of the moments grown."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's and Lightning's wrappers
    done: list[str] = []
    for group in inner.param_groups:
        for param in group["params"]:
            if id(param) not in grown:
                continue
            name, plan = grown[id(param)]
            state = inner.state.get(param, {})
            for key, value in list(state.items()):
                if (isinstance(value, torch.Tensor) and value.dim() > 0
                        and tuple(value.shape) == (plan.old_rows, *param.shape[1:])):
                    state[key] = grow_moment(value, plan, second_moment=is_second_moment(
                        key)).to(value.dtype)
                    done.append(f"{name}.{key}")
    logger.info("training-patches: optimizer moments grown with the vocabulary: %s",
                ", ".join(done) or "none held the old rows")
    return done


__all__ = ["Grown", "TrainerResume", "saved_shapes", "tensor_shapes", "shape_changes",
           "vocabulary_growth", "load_grown", "grow_loaded_moments"]
