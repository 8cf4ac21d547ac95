"""One outcome for every rank: a checkpoint step run on the writer (global rank 0) or on
every rank, whose result or first error reaches all ranks through a collective.

An exception always reaches the collective before it is raised, so a failure on one rank
never leaves the others waiting. The collectives run on the default group when it is gloo,
else on one gloo group made once (object collectives over NCCL need the right device).
"""

from __future__ import annotations

import builtins
import io
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _dist
from . import errors

_GROUP: Any = None


def active() -> bool:
    """Whether a process group of more than one rank is up (collective checkpoints)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group() -> Any:
    global _GROUP
    if dist.get_backend() == "gloo":
        return None
    if _GROUP is None:  # every rank reaches this together (inside a collective call)
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def _describe(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
    attrs = {k: getattr(exc, k) for k in ("folder", "needed", "free") if hasattr(exc, k)}
    return type(exc).__name__, str(exc), attrs


def _rebuild(described: tuple[str, str, dict[str, Any]], source: int) -> BaseException:
    """The same error on another rank: our checkpoint errors and builtin exceptions by
    class, anything else as a CheckpointError with the class named in the text."""
    name, message, attrs = described
    cls = getattr(errors, name, None)
    if cls is errors.DiskFullError:
        exc: BaseException = cls(message, folder=attrs.get("folder", ""),
                                 needed=attrs.get("needed", 0), free=attrs.get("free"))
    elif isinstance(cls, type) and issubclass(cls, errors.CheckpointError):
        exc = cls(message)
    else:
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, Exception):
            try:
                exc = builtin(message)
            except Exception:  # noqa: BLE001 - a builtin that wants other arguments
                exc = errors.CheckpointError(f"{name}: {message}")
        else:
            exc = errors.CheckpointError(f"{name}: {message}")
    exc.add_note(f"training-patches: raised on rank {source} and passed to every rank")
    return exc


def _waited_too_long(exc: RuntimeError) -> errors.CheckpointError:
    return errors.CheckpointError(
        f"training-patches: rank {_dist.rank()} waited for the other ranks inside a checkpoint "
        f"save/resume/load until the process group's timeout ({str(exc)[:200]}). Under a "
        f"process group CheckpointManager.save/resume and load_checkpoint must be called on "
        f"EVERY rank at the same point (rank 0 writes, the others wait for its outcome). If "
        f"your loop calls them on rank 0 only (`if rank == 0: manager.save(...)`), either call "
        f"them on every rank, or pass CheckpointManager(..., collective=False) (and "
        f"load_checkpoint(..., collective=False)) to keep the one-process behaviour. If every "
        f"rank does call them, the writer took longer than the timeout: raise it with "
        f"init_process_group(timeout=...).")


def _collective_call(call: Callable[[], None]) -> None:
    try:
        call()
    except RuntimeError as exc:
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            raise _waited_too_long(exc) from exc
        raise


def _as_agreed(failure: BaseException) -> BaseException:
    """The error the failing rank itself raises: its own when the others rebuild the same
    class (our checkpoint errors, builtin exceptions), else the same CheckpointError the
    others raise, caused by the original."""
    name = type(failure).__name__
    if type(failure) in (getattr(errors, name, None), getattr(builtins, name, None)):
        return failure
    agreed = _rebuild(_describe(failure), _dist.rank())
    agreed.__cause__ = failure
    return agreed


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    _collective_call(lambda: dist.all_gather_object(out, obj, group=_group()))
    return out


def gather_checked(fn: Callable[[], Any]) -> list[Any]:
    """Every rank's ``fn()`` (rank order), or the first failing rank's error on every rank.
    The value is ``torch.save``d on its own rank first, so a failure while pickling cannot
    leave the others waiting."""
    failure: BaseException | None = None
    try:
        buffer = io.BytesIO()
        torch.save(fn(), buffer)
        mine: Any = ("ok", buffer.getvalue())
    except BaseException as exc:  # noqa: BLE001 - it must reach the others first
        failure = exc
        mine = ("error", _describe(exc))
    outcomes = all_gather(mine)
    first = next(((r, o[1]) for r, o in enumerate(outcomes) if o[0] == "error"), None)
    if first is not None:
        if failure is not None and first[0] == _dist.rank():
            raise _as_agreed(failure)
        raise _rebuild(first[1], first[0])
    return [torch.load(io.BytesIO(blob), weights_only=True) for _, blob in outcomes]


def on_writer(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on global rank 0 only; every rank returns its result or raises its error."""
    failure: BaseException | None = None
    outcome: Any = None
    if _dist.rank() == 0:
        try:
            outcome = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - it must reach the others first
            failure = exc
            outcome = ("error", _describe(exc))
    box = [outcome]
    _collective_call(lambda: dist.broadcast_object_list(box, src=0, group=_group()))
    kind, value = box[0]
    if kind == "ok":
        return value
    if failure is not None:
        raise _as_agreed(failure)
    raise _rebuild(value, 0)


class Gate:
    """A point every rank passes together: each says whether it failed so far; if any
    did, every rank raises the first failing rank's error (its own, on that rank). ``agree``
    (a decision, how it was made, what to do when they differ): a decision each rank made on
    its own that must be the same on all (in the same gather); where it differs, every rank
    raises one CheckpointError naming each rank's."""

    def __init__(self) -> None:
        self.passed = False

    def __call__(self, failure: BaseException | None = None,
                 agree: tuple[str, str, str] | None = None) -> None:
        self.passed = True
        outcomes = all_gather((None if failure is None else _describe(failure), agree))
        first = next(((r, o) for r, (o, _) in enumerate(outcomes) if o is not None), None)
        if first is not None:
            source, described = first
            if failure is not None and source == _dist.rank():
                raise _as_agreed(failure)
            raise _rebuild(described, source)
        decided = [(r, a) for r, (_, a) in enumerate(outcomes) if a is not None]
        if len({a[0] for _, a in decided}) > 1:
            raise errors.CheckpointError(
                f"training-patches: the ranks decided differently before changing anything ("
                + "; ".join(f"rank {r}: {a[1]}" for r, a in decided)
                + f"), so nothing was loaded on any rank: the replicas would have started "
                  f"apart. {decided[0][1][2]}")


def on_every_rank(fn: Callable[[Gate], Any]) -> Any:
    """Run ``fn(gate)`` on every rank; its results, or the first failing rank's error on
    every rank. ``fn`` may call ``gate()`` once before it changes anything, so that a
    refusal on one rank stops all of them before any has changed its state."""
    gate = Gate()
    final: BaseException | None = None
    result: Any = None
    try:
        result = fn(gate)
    except BaseException as exc:  # noqa: BLE001 - it must reach the others first
        final = exc
    if not gate.passed:  # fn failed (or returned) before its gate: pass it now
        try:
            gate(final)
        except BaseException as exc:  # noqa: BLE001 - the agreed error
            final = exc
    # The second point: every rank takes part in it whatever happened, so no rank leaves
    # while another still waits; the first failing rank's error is raised on all.
    Gate()(final)
    return result


__all__ = ["active", "all_gather", "gather_checked", "on_writer", "on_every_rank", "Gate"]
