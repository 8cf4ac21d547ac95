"""The data position, a part of a checkpoint: where each rank's DataLoader stood, so that a
resumed run sees the same next batches as the stopped one, mid-epoch included.

While the ``checkpoint`` patch is applied, every ``iter()`` of a ``DataLoader`` is watched.
:func:`position_of` is what a save stores; :func:`plan` refuses a loader over other data, and
:func:`arm` makes the next ``iter()`` replay the epoch's start and skip the batches seen.

Design: docs/design/checkpoint.md
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

logger = logging.getLogger("training_patches")

KIND_PLAIN = "DataLoader"
KIND_STATEFUL = "state_dict"


class _Order:
    """The index batches one epoch drew from its sampler: how many, whether all of them (the
    sampler ended), and a running fingerprint after each (8 bytes a batch)."""

    __slots__ = ("drawn", "done", "digests", "_hash")

    def __init__(self) -> None:
        self.drawn = 0
        self.done = False
        self.digests = bytearray()
        self._hash = hashlib.blake2b(digest_size=8)

    def record(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._hash.update(_encode(batch))
            self.digests += self._hash.digest()
            self.drawn += 1
            yield batch
        self.done = True

    def at(self, batches: int) -> str | None:
        """The fingerprint of the first ``batches`` index batches (None: not drawn)."""
        if batches == 0:
            return ""
        if not 0 < batches <= self.drawn:
            return None
        return bytes(self.digests[8 * (batches - 1):8 * batches]).hex()


def _encode(batch: Any) -> bytes:
    if isinstance(batch, torch.Tensor):
        batch = batch.tolist()
    try:
        return array("q", batch if isinstance(batch, (list, tuple)) else [batch]).tobytes()
    except (TypeError, OverflowError, ValueError):  # keys that are not whole numbers
        pass
    try:
        return repr(batch).encode("utf-8", "backslashreplace")
    except Exception:  # noqa: BLE001 - never into the training loop: the type stands in
        return type(batch).__qualname__.encode()


class _Recorded:
    """The loader's index sampler as its iterator sees it: the same batches, each recorded
    in a fresh :class:`_Order` per ``iter()`` (``current``); anything else is the sampler's."""

    def __init__(self, sampler: Any) -> None:
        self._recorded_sampler = sampler
        self.current: _Order | None = None

    def __iter__(self) -> Iterator[Any]:
        self.current = _Order()
        return self.current.record(iter(self._recorded_sampler))

    def __len__(self) -> int:
        return len(self._recorded_sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "_recorded_sampler":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._recorded_sampler, name)


@contextlib.contextmanager
def _recording(loader: Any) -> Iterator[None]:
    """While ``loader``'s iterator is made, its index sampler is a :class:`_Recorded` (the
    iterator keeps it; the loader gets its own back at once). An ``IterableDataset`` is not
    recorded (its order is its own)."""
    name = "batch_sampler" if getattr(loader, "batch_sampler", None) is not None else "sampler"
    inner = getattr(loader, "__dict__", {}).get(name)
    if inner is None or isinstance(inner, _Recorded) or isinstance(
            getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        yield
        return
    try:
        object.__setattr__(loader, name, _Recorded(inner))  # DataLoader's own setattr refuses
    except (AttributeError, TypeError):  # a loader class that will not take it: not recorded
        yield
        return
    try:
        yield
    finally:
        object.__setattr__(loader, name, inner)


@dataclass(slots=True)
class _Watch:
    """What is known of one loader: the epochs begun, the RNG of the current one's start,
    its iterator (weakly), the batches skipped into it by a resume, the index batches its
    sampler drew (:class:`_Order`) and its number of workers."""

    epochs: int = 0
    start_rng: dict[str, Any] | None = None
    iterator: Callable[[], Any] = lambda: None
    skipped: int = 0
    base: int = 0  # the iterator's own count when the resume's skipping ended
    order: _Order | None = None
    workers: int = 0


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

    def start(self: Any, watch: _Watch, epochs: int | None = None) -> Any:
        """A plain start of an epoch, watched (``epochs`` begun, counting it: one more)."""
        begin = _rng_of(self)
        with _recording(self):
            iterator = original(self)
        watch.epochs = watch.epochs + 1 if epochs is None else epochs
        watch.start_rng, watch.skipped, watch.base = begin, 0, 0
        _follow(watch, self, iterator)
        return iterator

    def __iter__(self: Any) -> Any:
        try:
            watch = _WATCHED.get(self)
            if watch is None:
                watch = _WATCHED[self] = _Watch()
        except TypeError:  # a loader class that cannot be weakly referenced: never watched
            return original(self)
        armed = _ARMED.pop(self, None)
        if armed is None:
            return start(self, watch)
        if armed.get("complete"):  # the saved epoch had ended: the next one, counted on
            return start(self, watch, int(armed["epoch"]) + 2)
        now = _rng_of(self)
        failed: Exception | None = None
        try:
            _set_rng(self, armed["rng"])
            with _recording(self):
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
            _tell(armed, f"could not continue epoch {armed.get('epoch')} at batch "
                         f"{armed.get('batches')} ({type(failed).__name__}): the epoch started "
                         f"from its beginning")
            return __iter__(self)  # disarmed now: a plain, watched start of the epoch
        order = _order_of(iterator)
        expected, found = armed.get("order"), (order.at(int(armed["batches"]))
                                               if order is not None else None)
        if expected is not None and found is not None and found != expected:
            logger.warning(
                "training-patches: the data loader does not continue epoch %s at batch %s: the "
                "samples of the %s batches it would skip are not the ones the saved run trained "
                "on (the fingerprint of their order differs: other data, another sampler or "
                "seed), so skipping them would train some samples twice and others never. The "
                "epoch starts from its beginning instead.", armed["epoch"], armed["batches"],
                armed["batches"])
            _tell(armed, f"the samples before batch {armed['batches']} of epoch "
                         f"{armed['epoch']} were not the saved run's (their order's fingerprint "
                         f"differs): the epoch started from its beginning")
            return __iter__(self)
        watch.epochs = int(armed["epoch"]) + 1
        watch.start_rng, watch.skipped, watch.base = dict(armed["rng"]), int(armed["batches"]), base
        _follow(watch, self, iterator)
        logger.info("training-patches: the data loader resumes epoch %d at batch %d of %s (the "
                    "batches before it %s)", armed["epoch"], armed["batches"], armed.get("length"),
                    "loaded and dropped by its workers" if getattr(self, "num_workers", 0)
                    else "skipped at the sampler, none loaded")
        return iterator

    __iter__.__wrapped__ = original  # type: ignore[attr-defined]
    __iter__._tp_data_position = True  # type: ignore[attr-defined]
    return __iter__


def _order_of(iterator: Any) -> _Order | None:
    sampler = getattr(iterator, "_index_sampler", None)
    return sampler.current if isinstance(sampler, _Recorded) else None


def _follow(watch: _Watch, loader: Any, iterator: Any) -> None:
    """The watch follows this epoch's ``iterator`` (weakly) and its recorded order."""
    watch.order = _order_of(iterator)
    watch.workers = int(getattr(loader, "num_workers", 0) or 0)
    try:
        watch.iterator = weakref.ref(iterator)
    except TypeError:
        watch.iterator = lambda: iterator


def _tell(armed: Mapping[str, Any], why: str) -> None:
    """Tell the load that armed this position that it was not continued."""
    told = armed.get("_told")
    if callable(told):
        try:
            told(why)
        except Exception:  # noqa: BLE001 - a report that cannot be updated: the log said it
            pass


def _skip(iterator: Any, batches: int) -> int:
    """Advance a fresh DataLoader iterator by ``batches`` (skipped at the sampler in one
    process; loaded and dropped with workers, whose RNG must move); returns its count."""
    source = iterator if getattr(iterator, "_num_workers", 0) > 0 else iterator._sampler_iter
    for _ in range(batches):
        next(source)
    return int(iterator._num_yielded)


def _inner(loader: Any) -> Any:
    """The DataLoader under accelerate's prepared loader (``base_dataloader``), else
    ``loader``: the one whose ``iter()`` this module watches."""
    base = vars(loader).get("base_dataloader") if hasattr(loader, "__dict__") else None
    return base if base is not None else loader


def _stateful(loader: Any) -> bool:
    """Whether ``loader`` keeps its own position (``state_dict``/``load_state_dict``).
    accelerate's prepared loader has both methods whatever it wraps; it keeps a position
    only when the loader it wraps does (its ``use_stateful_dataloader``)."""
    inner = _inner(loader)
    if inner is not loader:
        return _stateful(inner)
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _sampler_chain(index: Any) -> str:
    """``BatchSampler(RandomSampler)``: the index sampler's class and those it wraps."""
    names: list[str] = []
    seen: set[int] = set()
    while index is not None and id(index) not in seen and len(names) < 5:
        seen.add(id(index))
        names.append(type(index).__name__)
        index = getattr(index, "sampler", None) or getattr(index, "batch_sampler", None)
    return "(".join(names) + ")" * (len(names) - 1)


def identity(loader: Any) -> dict[str, Any]:
    """What identifies the data ``loader`` hands out: the number of samples, the batch size,
    ``drop_last``, the sampler (its class and those it wraps), whether it shuffles, and the
    dataset's own ``_fingerprint`` when it has one (a Hugging Face dataset's)."""
    inner = _inner(loader)
    batches = getattr(inner, "batch_sampler", None)
    index = batches if batches is not None else getattr(inner, "sampler", None)
    sampler = getattr(index, "sampler", index) if batches is not None else index
    while getattr(sampler, "sampler", None) is not None and not hasattr(sampler, "shuffle") \
            and not isinstance(sampler, (torch.utils.data.RandomSampler,
                                         torch.utils.data.SequentialSampler)):
        sampler = sampler.sampler  # down to the sampler that orders the samples
    torch_samplers = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler)
    shuffle = (isinstance(sampler, torch.utils.data.RandomSampler)
               if isinstance(sampler, torch_samplers) else getattr(sampler, "shuffle", None))
    batch_size = getattr(inner, "batch_size", None)
    drop_last = getattr(inner, "drop_last", None)
    if batch_size is None and batches is not None:  # a batch sampler of the user's own
        batch_size = getattr(batches, "batch_size", None)
        drop_last = getattr(batches, "drop_last", None)
    fingerprint = getattr(getattr(inner, "dataset", None), "_fingerprint", None)
    return {"samples": _length(getattr(inner, "dataset", None)),
            "batch_size": batch_size if isinstance(batch_size, int) else None,
            "drop_last": drop_last if isinstance(drop_last, bool) else None,
            "sampler": _sampler_chain(index),
            "shuffle": shuffle if isinstance(shuffle, bool) else None,
            "dataset": fingerprint if isinstance(fingerprint, str) else None}


def yielded(loader: Any) -> int | None:
    """How many batches the epoch's iterator of ``loader`` has handed out (None when not
    known): read after a step, it is what :func:`position_of` counts then (``yielded=``)."""
    try:  # read after every coqui step: whatever a trainer's loader is, never an error
        watch = _WATCHED.get(_inner(loader)) if loader is not None else None
    except TypeError:  # not weak-referenceable (a list, a generator's owner): not watched
        return None
    iterator = watch.iterator() if watch is not None else None
    count = getattr(iterator, "_num_yielded", None)
    return None if count is None else int(count)


def position_of(loader: Any, *, yielded: int | None = None) -> dict[str, Any]:
    """The position of ``loader`` now as a checkpoint stores it, with :func:`identity` and the
    fingerprint of the sample order up to it; ``yielded``: the count of batches handed out to
    use instead of the iterator's now. A one-paragraph ValueError when it cannot be known."""
    if _stateful(loader):
        return {"kind": KIND_STATEFUL, "state": loader.state_dict()}
    inner = _inner(loader)
    if not isinstance(inner, torch.utils.data.DataLoader):
        raise ValueError(
            f"training-patches: cannot read the data position of loader={type(loader).__name__}: "
            f"expected a torch DataLoader (or accelerate's prepared one), or a loader with "
            f"state_dict()/load_state_dict() (such as torchdata's StatefulDataLoader). Pass the "
            f"DataLoader the training loop iterates, or leave loader= out.")
    watch = _WATCHED.get(inner)
    if watch is None or watch.start_rng is None:
        raise _unreadable("it was not iterated while the checkpoint patch was applied, so where "
                          "its epoch began is unknown", "Apply the patches before the loader's "
                          "first iter() (import patches.auto at the top of the script), or "
                          "leave loader= out.")
    length = _length(inner)
    # accelerate's prepared loader draws one batch ahead of the one it hands out, except at
    # the end of the epoch (its end_of_dataloader)
    ahead = 0 if inner is loader or vars(loader).get("end_of_dataloader", True) else 1
    order, iterator = watch.order, watch.iterator()
    if iterator is not None:
        if yielded is None:
            yielded = getattr(iterator, "_num_yielded", None)
        if yielded is None:  # torch's DataLoader iterator no longer counts what it handed out
            raise _unreadable(f"its iterator ({type(iterator).__name__}) has no count of the "
                              f"batches it handed out in this torch version")
        batches = watch.skipped + max(int(yielded) - watch.base - ahead, 0)
    elif order is None:  # not recorded (an IterableDataset's, which a load drops anyway)
        batches = watch.skipped
    elif order.done:  # the epoch's iterator ran to its end and is gone
        batches = length if length is not None else order.drawn
    elif watch.workers == 0:  # one process draws what it hands out
        batches = max(order.drawn - ahead, 0)
    else:
        raise _unreadable("the iterator of its epoch is gone before the end of the epoch and "
                          "its workers had read batches ahead, so how many of them were trained "
                          "on is unknown", "Save while the epoch's loop runs (inside it) or "
                          "after it ends, or leave loader= out.")
    # the fingerprint of the order of the epoch's first ``batches`` batches (a resume's
    # replay records the batches it skips too); None when not recorded
    return {"kind": KIND_PLAIN, "epoch": watch.epochs - 1, "batches": batches,
            "length": length, "rng": dict(watch.start_rng), **identity(loader),
            "order": order.at(batches) if order is not None else None}


def _unreadable(why: str, do: str = "Leave loader= out.") -> ValueError:
    return ValueError(f"training-patches: cannot read the data position of this DataLoader: "
                      f"{why}. {do}")


_TOLD: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


def position_or_warn(loader: Any, where: str) -> dict[str, Any] | None:
    """:func:`position_of`, or None after one WARNING (once per loader and reason) saying
    that ``where`` is saved without it."""
    try:
        return position_of(loader)
    except Exception as exc:  # noqa: BLE001 - any loader the user hands: said, left out
        why = str(exc).removeprefix("training-patches: ") or type(exc).__name__
        try:
            told = _TOLD.setdefault(_inner(loader), set())
        except TypeError:  # not weakly referable: said every time
            told = set()
        if why not in told:
            told.add(why)
            logger.warning("training-patches: %s is saved without the data position (the other "
                           "parts are saved; a resume from it starts the loader's epoch from its "
                           "beginning): %s%s", where, why if isinstance(exc, ValueError) else
                           f"{type(exc).__name__}: {why[:300]}",
                           "" if isinstance(exc, ValueError) else
                           ". Pass the DataLoader the training loop iterates, or leave loader= out")
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
    inner = _inner(loader)
    if _stateful(loader) or not isinstance(inner, torch.utils.data.DataLoader):
        raise ValueError(f"training-patches: {where} holds the position of a torch DataLoader, "
                         f"and loader= is a {type(loader).__name__}. Nothing was loaded. Pass "
                         f"a torch DataLoader over the same data.")
    if isinstance(inner.dataset, torch.utils.data.IterableDataset):
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
            f"patches.advanced.apply(['checkpoint'])), or load without loader=.")
    length = _length(inner)
    epoch, batches = int(saved["epoch"]), int(saved["batches"])
    differs = _differences(saved, length, identity(loader))
    if differs:
        raise ValueError(
            f"training-patches: {where} was saved with a data loader over other data than "
            f"loader=: {'; '.join(differs)}. Its position (epoch {epoch}, batch {batches} of "
            f"{saved.get('length')}) names batches of that data: continuing there would train "
            f"some samples twice and others never. Nothing was loaded. Resume with the same "
            f"data, batch size, sampler, shuffle and number of ranks, or load without loader= "
            f"to start the data from an epoch's beginning.")
    if length is not None and batches >= length:
        return ({**saved, "complete": True}, "restored",
                f"epoch {epoch} was complete: the next one starts at its beginning")
    return saved, "restored", f"epoch {epoch} continues at batch {batches} of {length}"


# What identifies the data, as the message says it: (key of the saved position, its words).
_IDENTITY = (("samples", "samples"), ("batch_size", "batch size"), ("drop_last", "drop_last"),
             ("sampler", "sampler"), ("shuffle", "shuffle"), ("dataset", "dataset fingerprint"))


def _differences(saved: Mapping[str, Any], length: int | None,
                 now: Mapping[str, Any]) -> list[str]:
    """What differs between the saved loader and this one, in words (a position written
    before these were recorded is compared by its length alone)."""
    found = []
    saved_length = saved.get("length")
    if saved_length is not None and length != saved_length:
        found.append(f"{saved_length} batches per epoch; loader= has {length}")
    for key, words in _IDENTITY:
        if key in saved and saved[key] != now.get(key):
            found.append(f"{words} {saved[key]!r} saved; loader= has {now.get(key)!r}")
    return found


def patched() -> bool:
    """Whether ``DataLoader.__iter__`` is this module's (the checkpoint patch is applied)."""
    return getattr(torch.utils.data.DataLoader.__dict__.get("__iter__"), "_tp_data_position",
                   False)


def arm(loader: Any, position: Mapping[str, Any],
        told: Callable[[str], None] | None = None) -> Callable[[], None]:
    """Make ``loader``'s next ``iter()`` continue from ``position``; returns the undo.
    ``told(why)`` is called if that ``iter()`` starts the epoch from its beginning instead."""
    if position["kind"] == KIND_STATEFUL:
        before = loader.state_dict()
        loader.load_state_dict(position["state"])
        return lambda: loader.load_state_dict(before)
    inner = _inner(loader)
    previous = _ARMED.get(inner)
    _ARMED[inner] = {**position, "_told": told} if told is not None else position

    def undo() -> None:
        if previous is None:
            _ARMED.pop(inner, None)
        else:
            _ARMED[inner] = previous
    return undo


__all__ = ["position_of", "position_or_warn", "identity", "plan", "arm", "make_iter", "patched",
           "KIND_PLAIN", "KIND_STATEFUL"]
