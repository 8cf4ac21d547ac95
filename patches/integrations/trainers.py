"""What the integrations of the trainers that run their own loop share (the Hugging Face
Trainer, Lightning, F5-TTS): :func:`claim` (one run per folder: it is locked for this
process, a second run is :class:`patches.RunFolderInUse`), :class:`RunRecord` (each run's
start and end in ``trainer_runs.jsonl``, with the host and process, kept with the lock in the
hidden ``.<name>.training-patches`` folder beside it) and :func:`spelling_tokenizer` (the
tokenizer a trainer holds, to spell a grown vocabulary's new tokens). The coqui Trainer's
are :mod:`.coqui_checkpoint` and :mod:`.coqui_interrupt`.

Design: docs/design/trainers.md
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator

from .. import _run, _runlock
from .._interrupt import TrainingInterrupted
from .._registry import active


def claim(folder: Any, *, trainer: str, overwritten: str) -> None:
    """Lock ``folder`` (made when missing) for this process: :class:`patches.RunFolderInUse`
    when another process holds it. Call it on the one process that writes there."""
    if not folder or "://" in str(folder):
        return  # no local folder: nothing to lock
    Path(folder).mkdir(parents=True, exist_ok=True)
    _runlock.lock_folder(folder, what=f"{trainer}'s output folder", overwritten=overwritten,
                         beside=True)


def signal_of(exc: BaseException | None) -> str | None:
    """The signal an exception (or one it was raised while handling) stands for: Ctrl-C's
    ``KeyboardInterrupt``, the library's :class:`TrainingInterrupted`, Lightning's
    ``SIGTERMException``; None for any other error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TrainingInterrupted):
            return exc.name
        if isinstance(exc, KeyboardInterrupt):
            return "SIGINT"
        if type(exc).__name__ == "SIGTERMException":
            return "SIGTERM"
        exc = exc.__context__
    return None


def _record(folder: Any, event: str, **fields: Any) -> None:
    if folder and os.path.isdir(folder):
        _run.record_in(_runlock.ensure_side_folder(folder), _run.TRAINER_RUNS_FILE, event,
                       run_folder=str(folder), host=socket.gethostname(), **fields)


class RunRecord:
    """One run of a trainer in its folder: :meth:`start` claims it and records ``start``;
    :meth:`ending` records ``finished``, ``interrupted`` (the signal, the step, the newest
    ``checkpoint()``, ``continue_with``) or ``failed`` (the error). ``said``: the trainer as
    the refusal names it; ``overwritten``: what two runs in the folder would overwrite;
    ``writes``: False on the processes that do not write there (nothing is recorded)."""

    def __init__(self, *, trainer: str, said: str, overwritten: str, step: Callable[[], int],
                 checkpoint: Callable[[], Any], continue_with: str, writes: bool = True) -> None:
        self.trainer, self.said, self.overwritten = trainer, said, overwritten
        self.step, self.checkpoint, self.continue_with = step, checkpoint, continue_with
        self.writes = writes
        self.folder: Any = None  # set by start()

    @staticmethod
    def _safely(read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception:  # noqa: BLE001 - a record never stops the trainer's own end
            return None

    def start(self, folder: Any) -> None:
        """Claim ``folder`` for this run (:class:`patches.RunFolderInUse` when another
        process trains there) and record the start."""
        if not self.writes or self.folder is not None:
            return
        claim(folder, trainer=self.said, overwritten=self.overwritten)
        self.folder = folder
        _record(folder, "start", trainer=self.trainer, step=self._safely(self.step),
                continue_with=self.continue_with)

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """Record how the run inside ended, once it started; its exception is raised again
        as it was."""
        try:
            yield
        except BaseException as exc:
            if self.folder is not None:
                self._end(exc)
            raise
        if self.folder is not None:
            self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        step = self._safely(self.step)
        said = signal_of(exc)
        if exc is None or (isinstance(exc, SystemExit) and said is None
                           and exc.code in (0, None)):
            _record(self.folder, "finished", step=step)
        elif said is not None:
            found = self._safely(self.checkpoint)
            _record(self.folder, "interrupted", signal=said, step=step,
                    checkpoint=str(found) if found else None, continue_with=self.continue_with)
        else:
            _record(self.folder, "failed", step=step,
                    error=f"{type(exc).__name__}: {str(exc)[:500]}")
        self.folder = None


def run_parts(original: Any, recorded_run: Callable[[Any], ContextManager[Any]],
              counted: Callable[[Any], ContextManager[Any]]) -> Any:
    """A trainer's ``train``/``fit`` for two patches, each part run while its patch is
    applied. ``checkpoint``: ``recorded_run(trainer)``, its folder claimed for this run and
    the start and end recorded (:class:`RunRecord`). ``nan_guard``: ``counted(trainer)``, the
    patches told where the trainer writes and how it counts its steps."""
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as parts:
            if active("checkpoint"):
                parts.enter_context(recorded_run(self))
            if active("nan_guard"):
                parts.enter_context(counted(self))
            return original(self, *args, **kwargs)
    return run


def growing_moments(original: Any, optimizers: Callable[[Any], Iterable[Any]]) -> Any:
    """``original(self, checkpoint)`` (a trainer's load of its optimizers' states) that then
    grows the loaded moments of the rows its grown load grew (``_training_patches_grown``):
    torch's ``load_state_dict`` takes them at the old shape, and a step then fails (torch
    2.14's fused AdamW reads past them and corrupts the heap)."""
    @functools.wraps(original)
    def load(self: Any, checkpoint: Any) -> Any:
        result = original(self, checkpoint)
        rows = getattr(self, "_training_patches_grown", None)
        if checkpoint is not None and rows:
            from ..checkpoint import grown  # lazy: heavy (issue 41)

            for optimizer in optimizers(self):
                if optimizer is not None:
                    grown.grow_loaded_moments(optimizer, rows)
        return result
    return load


def _reads(tokenizer: Any) -> bool:
    """Whether the loader reads ``tokenizer`` as it is (a ``tokenizers.Tokenizer``, a
    SentencePiece processor, or an object with their two methods)."""
    return (hasattr(tokenizer, "id_to_token") or hasattr(tokenizer, "id_to_piece")) and \
        hasattr(tokenizer, "encode")


def spelling_tokenizer(held: Any) -> tuple[Any, str]:
    """``held`` (what a trainer or its model holds as its tokenizer) as the loader's
    ``tokenizer=`` reads it, and what it is: a ``tokenizers.Tokenizer`` or SentencePiece
    processor as it is; a Hugging Face tokenizer's ``backend_tokenizer`` (a fast one) or
    ``sp_model`` (a SentencePiece one); a processor's ``tokenizer``'s; a path to a
    ``vocab.json`` or ``.model`` file. (None, why not) for anything else."""
    if held is None:
        return None, "none"
    inner = getattr(held, "tokenizer", None)
    if inner is not None and not isinstance(inner, str) and not _reads(held):
        held = inner
    name = type(held).__name__
    if _reads(held):
        return held, name
    for attr, kind in (("backend_tokenizer", "its tokenizers backend"),
                       ("sp_model", "its SentencePiece model")):
        found = getattr(held, attr, None)
        if found is not None and _reads(found):
            return found, f"{name}, {kind}"
    if isinstance(held, (str, os.PathLike)) and str(held).endswith((".json", ".model")) \
            and os.path.isfile(held):
        return os.fspath(held), os.fspath(held)
    return None, (f"a {name}, which has no tokenizers backend or SentencePiece model to "
                  f"spell with")


__all__ = ["RunRecord", "claim", "growing_moments", "run_parts", "signal_of",
           "spelling_tokenizer"]
