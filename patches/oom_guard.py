"""``oom_guard``: a CUDA out-of-memory error in one batch skips that batch; repeated ones
stop the run with sizes that fit.

A long clip in an unattended run can exhaust GPU memory once: without the guard the whole run
dies on it. With it, the batch's gradients are dropped (under gradient accumulation those
already accumulated too: a backward that ran out of memory half-way leaves them partial), its
tensors released, the allocator's cache emptied, and the batch counted and logged with its
shapes and sample ids; the run goes on. After ``max_oom_skips`` such batches in a row the run
stops with :class:`OutOfMemoryTrainingError`, which suggests a batch size and a maximum audio
length that fit, from the shapes of the batches that failed. It wraps one batch, not the
optimizer step, so it is no stage of the step pipeline (patches._step): the coqui Trainer's
``train_step`` (the ``coqui_trainer`` integration); a plain loop uses :func:`skip_on_oom`.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterable, Iterator

import torch

from . import _options, _run
from ._log import logger
from ._options import INT64_MAX, Option, positive_int
from ._registry import PatchSpec, register

# torch >= 2.5 has the device-generic name; torch.cuda.OutOfMemoryError is the same class.
OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
     torch.cuda.OutOfMemoryError})
# Batch keys that hold a length per sample in audio samples (coqui XTTS: wav_lengths).
AUDIO_LENGTH_KEYS = ("wav_lengths", "audio_lengths", "wave_lengths")


class OutOfMemoryTrainingError(RuntimeError):
    """Too many consecutive batches ran out of GPU memory."""


class _State:
    """The run's out-of-memory batches: the counts and the streak's descriptions."""

    def __init__(self) -> None:
        self.counts = {"oom_skipped": 0, "consecutive_ooms": 0}
        self.failed: list[dict[str, Any]] = []  # descriptions of the current streak


def _oom() -> _State:
    return _run.current().part(_State)


def stats() -> dict[str, int]:
    """``oom_skipped`` (batches skipped in the run) and ``consecutive_ooms``."""
    return dict(_oom().counts)


def describe_batch(batch: Any) -> dict[str, Any]:
    """Shapes of the batch's tensors, its sample ids, its size and longest audio."""
    shapes: dict[str, list[int]] = {}
    size = None
    longest = None
    if isinstance(batch, dict):
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                shapes[str(key)] = list(value.shape)
                if value.dim() >= 1 and size is None:
                    size = int(value.shape[0])
        for key in AUDIO_LENGTH_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.numel():
                longest = int(value.max())
                break
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            if isinstance(value, torch.Tensor):
                shapes[str(index)] = list(value.shape)
                size = size if size is not None else int(value.shape[0]) if value.dim() else None
    return {"shapes": shapes, "samples": _run.sample_ids(batch), "batch_size": size,
            "longest_audio": longest}


def _release(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    # Garbage that still holds device blocks must go before the cache is emptied. Without a
    # CUDA context there is no device memory to give back, and a full collection costs
    # ~0.1 s once torch and a model are in memory.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def _advice(failed: list[dict[str, Any]], sample_rate: int | None) -> str:
    sizes = [d["batch_size"] for d in failed if d.get("batch_size")]
    longest = [d["longest_audio"] for d in failed if d.get("longest_audio")]
    parts = []
    if sizes:
        parts.append(f"a batch size of {max(1, min(sizes) // 2)} (the failing batches had "
                     f"{min(sizes)})")
    if longest:
        fit = int(min(longest) * 0.75)
        if sample_rate:
            parts.append(f"a maximum audio length of {fit / sample_rate:.1f} s ({fit} samples; "
                         f"the shortest failing batch's longest clip was "
                         f"{min(longest) / sample_rate:.1f} s)")
        else:
            parts.append(f"a maximum audio length of {fit} samples (the shortest failing "
                         f"batch's longest clip was {min(longest)})")
    if not parts:
        return "Lower the batch size, or the longest clip trained on."
    return ("Try " + " and ".join(parts) + ", with gradient accumulation raised to keep the "
            "effective batch.")


def on_oom(exc: BaseException, batch: Any, optimizers: Iterable[torch.optim.Optimizer], *,
           step: int | None = None, sample_rate: int | None = None) -> None:
    """Handle one out-of-memory batch: release, count, log; raise when they repeat."""
    _release(optimizers)
    described = describe_batch(batch)
    state = _oom()
    state.failed.append(described)
    state.counts["oom_skipped"] += 1
    state.counts["consecutive_ooms"] += 1
    limit = _options.current().max_oom_skips
    streak = state.counts["consecutive_ooms"]
    first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    event = {"kind": "out_of_memory", "trainer_step": step, **described, "error": first_line}
    path = _run.append_jsonl(_run.OOM_FILE, event)
    logger.warning(
        "oom_guard: %s ran out of GPU memory (%s); the batch is skipped and its gradients "
        "dropped (%d in a row, the limit is %d); shapes: %s; samples: %s; %s",
        f"trainer step {step}" if step is not None else "a batch", first_line, streak, limit,
        described["shapes"], ", ".join(described["samples"][:4]) or "unknown",
        _run.where_recorded(path))
    if streak >= limit:
        failed = list(state.failed)
        state.failed.clear()
        raise OutOfMemoryTrainingError(
            f"oom_guard: {streak} consecutive batches ran out of GPU memory (the limit is "
            f"{limit}, TRAINING_PATCHES_MAX_OOM_SKIPS), so the run stops: the batches do not "
            f"fit this GPU. The last one had the shapes {failed[-1]['shapes']} and the "
            f"samples {', '.join(failed[-1]['samples'][:4]) or 'unknown'}. "
            f"{_advice(failed, sample_rate)} Every skipped batch is listed in {path}.") from exc


def on_success() -> None:
    """A batch went through: the streak ends."""
    state = _oom()
    if state.counts["consecutive_ooms"]:
        state.counts["consecutive_ooms"] = 0
        state.failed.clear()


@contextlib.contextmanager
def skip_on_oom(batch: Any, *optimizers: torch.optim.Optimizer) -> Iterator[None]:
    """For a plain loop: run one batch's forward and backward inside it; an out-of-memory
    error skips the batch as in the coqui Trainer (and stops the run when they repeat)."""
    try:
        yield
    except OOM_ERRORS as exc:
        on_oom(exc, batch, optimizers)
    else:
        on_success()


SPEC = register(PatchSpec(
    name="oom_guard",
    describe=lambda o: (f"a batch that runs out of GPU memory is skipped, listed and freed "
                        f"(stop after {o.max_oom_skips} in a row, with sizes that fit)"),
    stats=stats,
    options=(Option("max_oom_skips", positive_int, 3,
                    "a whole number of batches of at least 1, e.g. 3",
                    "consecutive out-of-memory batches skipped before the run stops",
                    low=1, high=INT64_MAX, bound_why="batches are counted in int64"),),
))


__all__ = ["OutOfMemoryTrainingError", "on_oom", "on_success", "skip_on_oom", "stats",
           "describe_batch", "OOM_ERRORS"]
