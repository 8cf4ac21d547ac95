"""The data position, a part of a checkpoint: where each rank's DataLoader stood, so that a
resumed run sees the same next batches as the run that was stopped, mid-epoch included.

While the ``checkpoint`` patch is applied, every ``iter()`` of a torch ``DataLoader`` is
watched (the site ``DataLoader.__iter__``): the RNG states the epoch starts from (torch's
global RNG and the loader's own ``generator``: what ``RandomSampler`` and the workers' base
seed draw from) and the iterator, whose count of batches handed out is the position.
``CheckpointManager.save(..., loader=)`` stores ``{"epoch", "batches", "length", "rng"}``
for each rank; ``load_checkpoint(..., loader=)`` arms the loader, and its next ``iter()``
replays the start of that epoch from the saved RNG states, skips the batches already seen
(at the sampler in one process, none of them loaded; with workers by loading and dropping
them, so that the workers' RNG ends where it was), then puts the RNG back as the
checkpoint left it. A loader with its own
``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``) is saved and
restored through them instead.

What cannot be resumed exactly is said, never skipped silently: an ``IterableDataset``
(the dataset, not a sampler, decides the order), another number of ranks, a loader that
was never iterated under the patch.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping

import torch

logger = logging.getLogger("training_patches")

KIND_PLAIN = "DataLoader"
KIND_STATEFUL = "state_dict"


class _Watch:
    """What is known of one loader: the epochs begun, the RNG of the current one's start,
    its iterator (weakly) and the batches skipped into it by a resume."""

    __slots__ = ("epochs", "start_rng", "iterator", "skipped", "base")

    def __init__(self) -> None:
        self.epochs = 0
        self.start_rng: dict[str, Any] | None = None
        self.iterator: Callable[[], Any] = lambda: None
        self.skipped = 0
        self.base = 0  # the iterator's own count when the resume's skipping ended


_WATCHED: "weakref.WeakKeyDictionary[Any, _Watch]" = weakref.WeakKeyDictionary()
_ARMED: "weakref.WeakKeyDictionary[Any, Mapping[str, Any]]" = weakref.WeakKeyDictionary()


def _rng_of(loader: Any) -> dict[str, Any]:
    generator = getattr(loader, "generator", None)
    return {"torch": torch.get_rng_state(),
            "generator": generator.get_state() if generator is not None else None}


def _set_rng(loader: Any, state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    generator = getattr(loader, "generator", None)
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])


def make_iter(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The replacement of ``DataLoader.__iter__``: watch the epoch's start, and replay it
    for a loader armed by a resume."""

    def __iter__(self: Any) -> Any:
        try:
            watch = _WATCHED.get(self)
            if watch is None:
                watch = _WATCHED[self] = _Watch()
        except TypeError:  # a loader class that cannot be weakly referenced: never watched
            return original(self)
        armed = _ARMED.pop(self, None)
        if armed is None:
            start = _rng_of(self)
            iterator = original(self)
            watch.epochs += 1
            watch.start_rng, watch.skipped, watch.base = start, 0, 0
            try:
                watch.iterator = weakref.ref(iterator)
            except TypeError:
                watch.iterator = lambda: iterator
            return iterator
        now = _rng_of(self)
        failed: Exception | None = None
        try:
            _set_rng(self, armed["rng"])
            iterator = original(self)
            base = _skip(iterator, int(armed["batches"]))
        except Exception as exc:  # noqa: BLE001 - never into the training loop (below)
            failed = exc
        finally:
            _set_rng(self, now)  # the RNG as the checkpoint left it
        if failed is not None:
            logger.warning("training-patches: the data loader could not continue epoch %s at "
                           "batch %s (%s: %s); the epoch starts from its beginning (batches "
                           "already trained on come again)", armed.get("epoch"),
                           armed.get("batches"), type(failed).__name__, str(failed)[:200])
            return __iter__(self)  # disarmed now: a plain, watched start of the epoch
        watch.epochs = int(armed["epoch"]) + 1
        watch.start_rng, watch.skipped, watch.base = dict(armed["rng"]), int(armed["batches"]), base
        watch.iterator = weakref.ref(iterator)
        logger.info("training-patches: the data loader resumes epoch %d at batch %d of %s (the "
                    "batches before it %s)", armed["epoch"], armed["batches"], armed.get("length"),
                    "loaded and dropped by its workers" if getattr(self, "num_workers", 0)
                    else "skipped at the sampler, none loaded")
        return iterator

    __iter__.__wrapped__ = original  # type: ignore[attr-defined]
    __iter__._tp_data_position = True  # type: ignore[attr-defined]
    return __iter__


def _skip(iterator: Any, batches: int) -> int:
    """Advance a fresh DataLoader iterator by ``batches``; returns its count of batches
    handed out afterwards.

    In one process the batches are skipped at the sampler, none of them loaded: what their
    loading drew from the RNG is in the RNG state the checkpoint restores. With workers
    each batch is loaded and dropped: a worker's RNG (seeded from the epoch's base seed)
    advances with every sample it reads, and only reading them again puts it where the
    stopped run had it (XTTS's dataset draws its samples from ``random`` in the workers)."""
    if getattr(iterator, "_num_workers", 0) > 0:
        for _ in range(batches):
            next(iterator)
        return int(iterator._num_yielded)
    for _ in range(batches):  # the sampler's own order, nothing loaded (draws its seed now)
        next(iterator._sampler_iter)
    return int(iterator._num_yielded)


def position_of(loader: Any) -> dict[str, Any]:
    """The position of ``loader`` now, as stored in a checkpoint (plain values and tensors).

    Raises ValueError (one paragraph) when it cannot be known."""
    if _stateful(loader):
        return {"kind": KIND_STATEFUL, "state": loader.state_dict()}
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ValueError(
            f"training-patches: cannot save the data position of loader={type(loader).__name__}: "
            f"expected a torch DataLoader, or a loader with state_dict()/load_state_dict() (such "
            f"as torchdata's StatefulDataLoader). Nothing was written. Pass the DataLoader the "
            f"training loop iterates, or leave loader= out.")
    watch = _WATCHED.get(loader)
    if watch is None or watch.start_rng is None:
        raise ValueError(
            "training-patches: cannot save the data position of this DataLoader: it was not "
            "iterated while the checkpoint patch was applied, so where its epoch began is "
            "unknown. Nothing was written. Apply the patches before the loader's first iter() "
            "(import patches.auto at the top of the script), or leave loader= out.")
    iterator = watch.iterator()
    yielded = getattr(iterator, "_num_yielded", None) if iterator is not None else 0
    if yielded is None:  # torch's DataLoader iterator no longer counts what it handed out
        raise ValueError(
            f"training-patches: cannot save the data position of this DataLoader: its "
            f"iterator ({type(iterator).__name__}) has no count of the batches it handed out "
            f"in this torch version. Nothing was written. Leave loader= out.")
    done = int(yielded) - watch.base
    return {"kind": KIND_PLAIN, "epoch": watch.epochs - 1, "batches": watch.skipped + done,
            "length": _length(loader), "rng": dict(watch.start_rng)}


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def plan(loader: Any, saved: Any, where: str) -> tuple[Mapping[str, Any] | None, str, str]:
    """(the position to arm ``loader`` with or None, the report's status, its detail).
    Raises ValueError for a position that does not fit the loader; changes nothing."""
    if not isinstance(saved, Mapping) or saved.get("kind") not in (KIND_PLAIN, KIND_STATEFUL):
        raise ValueError(f"training-patches: the data position in {where} is not one this "
                         f"library wrote (found {str(saved)[:60]!r}). Nothing was loaded. Load "
                         f"without loader= to start the data from the epoch's beginning.")
    if saved["kind"] == KIND_STATEFUL:
        if not _stateful(loader):
            raise ValueError(f"training-patches: {where} holds the state_dict of a stateful data "
                             f"loader, and loader= is a {type(loader).__name__} without "
                             f"load_state_dict. Nothing was loaded. Pass the same kind of loader.")
        return saved, "restored", "the loader's own state_dict"
    if _stateful(loader) or not isinstance(loader, torch.utils.data.DataLoader):
        raise ValueError(f"training-patches: {where} holds the position of a torch DataLoader, "
                         f"and loader= is a {type(loader).__name__}. Nothing was loaded. Pass "
                         f"a torch DataLoader over the same data.")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        logger.warning("training-patches: the data position in %s is not restored: the loader "
                       "reads an IterableDataset, which decides its own order, so its epoch "
                       "restarts from the beginning (batches already trained on come again)",
                       where)
        return None, "dropped", ("an IterableDataset decides its own order: the epoch restarts "
                                 "from its beginning")
    if not patched():
        raise ValueError(
            f"training-patches: cannot restore the data position in {where}: the checkpoint "
            f"patch is not applied, so DataLoader.__iter__ cannot continue mid-epoch. Nothing "
            f"was loaded. Apply the patches first (import patches.auto, or "
            f"patches.apply(['checkpoint'])), or load without loader=.")
    length, saved_length = _length(loader), saved.get("length")
    if saved_length is not None and length != saved_length:
        raise ValueError(f"training-patches: {where} was saved with a data loader of "
                         f"{saved_length} batches per epoch; loader= has {length}. Nothing was "
                         f"loaded. Resume with the same data, batch size and number of ranks, "
                         f"or load without loader= to start the data from an epoch's beginning.")
    epoch, batches = int(saved["epoch"]), int(saved["batches"])
    if length is not None and batches >= length:
        return None, "restored", f"epoch {epoch} was complete: the next one starts at its beginning"
    return saved, "restored", f"epoch {epoch} continues at batch {batches} of {length}"


def patched() -> bool:
    """Whether ``DataLoader.__iter__`` is this module's (the checkpoint patch is applied)."""
    return getattr(torch.utils.data.DataLoader.__dict__.get("__iter__"), "_tp_data_position",
                   False)


def arm(loader: Any, position: Mapping[str, Any]) -> Callable[[], None]:
    """Make ``loader``'s next ``iter()`` continue from ``position``; returns the undo."""
    if position["kind"] == KIND_STATEFUL:
        before = loader.state_dict()
        loader.load_state_dict(position["state"])
        return lambda: loader.load_state_dict(before)
    previous = _ARMED.get(loader)
    _ARMED[loader] = position

    def undo() -> None:
        if previous is None:
            _ARMED.pop(loader, None)
        else:
            _ARMED[loader] = previous
    return undo


__all__ = ["position_of", "plan", "arm", "make_iter", "patched", "KIND_PLAIN", "KIND_STATEFUL"]
