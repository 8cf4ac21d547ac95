"""What the ``transformers_trainer`` integration's sites do (declared in
:mod:`patches.integrations.transformers_trainer`, which imports this module when one lands),
and :func:`reading_callback`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ... import _run, learning, nan_guard
from ..._log import logger
from .. import trainers
from . import NAME

if TYPE_CHECKING:  # imported where used: heavy (issue 41)
    from ...checkpoint import grown

NAME_SAID = "the Hugging Face Trainer"


@functools.cache
def _classes() -> dict[str, type]:
    """The integration's TrainerCallbacks, made once on first use (so "already added" is an
    isinstance test) and named as its own (``__getattr__``) so that they pickle."""
    from transformers import TrainerCallback  # lazy: transformers is imported by now

    class TrainingPatchesCallback(TrainerCallback):
        """Hands the Trainer's step to the records; settles the guard's waiting flags."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _run.current().trainer_step = int(state.global_step)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            nan_guard.settle()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            nan_guard.settle()

    class ReadingCallback(TrainerCallback):
        """Measures the reading gap at each evaluation, on the main process."""

        def __init__(self, monitor: learning.LearningMonitor) -> None:
            self.monitor = monitor

        def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None,
                        metrics: Any = None, **kwargs: Any) -> None:
            if not state.is_world_process_zero or model is None:
                return
            from transformers.modeling_utils import unwrap_model  # lazy: imported by now

            if _run.output_dir() is None:  # beside the Trainer's files, as train()'s site puts them
                _run.set_trainer_dir(getattr(args, "output_dir", None))
            loss = (metrics or {}).get("eval_loss")
            learning.evaluate_once(self.monitor, unwrap_model(model), int(state.global_step),
                                   eval_loss=float(loss) if isinstance(loss, (int, float))
                                   else None)

    made = {"TrainingPatchesCallback": TrainingPatchesCallback, "ReadingCallback": ReadingCallback}
    for name, cls in made.items():
        cls.__module__, cls.__qualname__ = __package__, name
    return made


def reading_callback(monitor: learning.LearningMonitor) -> Any:
    """A ``TrainerCallback`` that measures the reading gap (:mod:`patches.learning`) at each
    of the Trainer's evaluations, at its ``global_step``, with its ``eval_loss``::

        monitor = patches.advanced.LearningMonitor(probe, loss_fn)  # loss_fn(model, texts, audios)
        args = TrainingArguments(..., eval_strategy="steps", eval_steps=500)
        Trainer(model, args, ..., callbacks=[transformers_trainer.reading_callback(monitor)])

    On the main process alone (so not with FSDP or ZeRO-3's sharded parameters), into
    ``learning_health.jsonl`` in ``output_dir``. A monitor without ``loss_fn`` is a TypeError."""
    checked = learning.checked_monitor(monitor, "transformers_trainer.reading_callback")
    return _classes()["ReadingCallback"](checked)


def __getattr__(name: str) -> Any:
    """The callback classes, made on first use (pickle's way back to them, in any process)."""
    if name in ("TrainingPatchesCallback", "ReadingCallback"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_train(original: Any) -> Any:
    """``Trainer.train`` (:func:`.trainers.run_parts`): ``output_dir`` claimed for this run;
    the records told where it writes and its steps (its callback)."""
    return trainers.run_parts(original, _recorded_run, _steps_counted)


@contextlib.contextmanager
def _steps_counted(trainer: Any) -> Iterator[None]:
    _run.set_trainer_dir(getattr(trainer.args, "output_dir", None))
    callback = _classes()["TrainingPatchesCallback"]
    if not any(isinstance(c, callback) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(callback())
    yield


def _recorded_run(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """Claim the Trainer's ``output_dir`` and record the start; the context records the end."""
    folder = getattr(trainer.args, "output_dir", None)
    run = trainers.RunRecord(
        trainer=NAME, said=NAME_SAID, overwritten="checkpoint-N folders",
        step=lambda: int(trainer.state.global_step),
        checkpoint=lambda: next((path for _, path in _checkpoints(folder)
                                 if _complete(path) is None), None),
        continue_with="trainer.train(resume_from_checkpoint=True)",
        writes=bool(getattr(trainer.args, "should_save", True)))
    run.start(folder)
    return run.ending()


COMPLETE = "training_patches_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _files_of(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != COMPLETE}


def make_save_checkpoint(original: Any) -> Any:
    """``Trainer._save_checkpoint`` that ends by marking the folder complete (last, atomic)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        step = getattr(getattr(self, "state", None), "global_step", None)
        try:  # the trial by keyword or by position (transformers passes (model, trial))
            trial = signature.bind(self, *args, **kwargs).arguments.get("trial")
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{step}"
            if folder.is_dir() and self.args.should_save:
                from ...checkpoint.atomic import atomic_text  # lazy: heavy (issue 41)

                atomic_text(folder / COMPLETE, json.dumps(
                    {"step": int(step), "files": _files_of(folder)}, indent=1))
        except Exception as exc:  # noqa: BLE001 - the checkpoint is written: never raise here
            logger.warning("training-patches: checkpoint-%s could not be marked complete (%s: "
                           "%s); resume_from_checkpoint=True will pass over it, training goes "
                           "on", step, type(exc).__name__, str(exc)[:200])
        return result
    return _save_checkpoint


def _complete(folder: Path) -> str | None:
    """None when ``folder``'s marker vouches for every file it lists; else why not."""
    marker = folder / COMPLETE
    try:
        saved = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return "has no completion marker (its save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has a completion marker that cannot be read ({exc})"
    for name, size in saved.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"has {name} of another size than its save wrote (torn or changed)"
    return None


def _checkpoints(folder: Any) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders in ``folder``, the newest first (OSError: unreadable)."""
    found = [(int(m.group(1)), Path(folder) / name) for name in os.listdir(folder)
             if (m := _CHECKPOINT.match(name)) and (Path(folder) / name).is_dir()]
    return sorted(found, reverse=True)


def make_get_last_checkpoint(original: Any) -> Any:
    """``get_last_checkpoint(folder)``: the newest complete checkpoint folder where the
    folder holds completion markers; upstream's answer otherwise."""
    @functools.wraps(original)
    def get_last_checkpoint(folder: Any) -> Any:
        try:
            found = _checkpoints(folder)
        except OSError:
            return original(folder)
        if not any((path / COMPLETE).exists() for _, path in found):
            return original(folder)  # saved without the patches: judged as upstream does
        for step, path in found:
            why = _complete(path)
            if why is None:
                return str(path)
            logger.warning("training-patches: %s %s; resume_from_checkpoint passes over it to "
                           "an earlier complete checkpoint (the folder is left as it is)",
                           path, why)
        return None
    return get_last_checkpoint


WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # a checkpoint folder's one-file weights


def _tokenizer_of(trainer: Any) -> tuple[Any, str]:
    """The tokenizer the Trainer holds (``processing_class``) as the loader reads it, and
    where; (None, where it looked) when there is none it can read."""
    held = getattr(trainer, "processing_class", None)
    if held is None:
        return None, f"{NAME_SAID} was given no processing_class"
    found, what = trainers.spelling_tokenizer(held)
    return found, f"{NAME_SAID}'s processing_class ({what})"


def _resume_of(trainer: Any, folder: Path) -> grown.TrainerResume:
    """What the Trainer restores itself from ``folder`` after the weights (the files there),
    the step of its trainer_state.json, and the tokenizer."""
    world = int(getattr(trainer.args, "world_size", 1) or 1)
    rng = f"rng_state_{trainer.args.process_index}.pth" if world > 1 else "rng_state.pth"
    files = {"optimizer": ("optimizer.pt", "optimizer.bin"), "scheduler": ("scheduler.pt",),
             "scaler": ("scaler.pt",), "rng": (rng,), "step": ("trainer_state.json",)}
    restores = {}
    for part, names in files.items():
        name = next((n for n in names if (folder / n).is_file()), None)
        if name is not None:
            restores[part] = f"{folder.name}/{name}"
    try:
        step = int(json.loads((folder / "trainer_state.json").read_text(
            encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        step = None
    from ...checkpoint import grown  # lazy: heavy (issue 41)

    tokenizer, source = _tokenizer_of(trainer)
    return grown.TrainerResume(NAME_SAID, restores, step, tokenizer, source)


def _grown_load(trainer: Any, folder: Path, model: Any) -> grown.Grown | None:
    """Load ``folder``'s one-file weights into ``model`` through the library when a shape
    differs; None (upstream loads) otherwise."""
    path = next((folder / name for name in WEIGHTS if (folder / name).is_file()), None)
    if path is None:
        return None
    from ...checkpoint import grown  # lazy: heavy (issue 41)

    shapes = grown.saved_shapes(path)
    changes = grown.vocabulary_growth(shapes, model) if shapes else {}
    if not changes:
        return None
    # non-strict, as upstream's own load (missing keys are said in the load report)
    return grown.load_grown(path, model, set(shapes), resume=_resume_of(trainer, folder),
                            strict=False)


def make_load_from_checkpoint(original: Any) -> Any:
    """``Trainer._load_from_checkpoint`` that also loads into a model whose vocabulary grew
    since the save (upstream: a size mismatch)."""
    @functools.wraps(original)
    def _load_from_checkpoint(self: Any, resume_from_checkpoint: str, model: Any = None) -> Any:
        self._training_patches_grown = None
        target = model if model is not None else self.model
        if not (getattr(self, "is_fsdp_enabled", False) or getattr(
                self, "is_deepspeed_enabled", False)):
            rows = _grown_load(self, Path(resume_from_checkpoint), target)
            if rows is not None:
                self._training_patches_grown = rows
                return None
        return original(self, resume_from_checkpoint, model)
    return _load_from_checkpoint


def make_load_optimizer_and_scheduler(original: Any) -> Any:
    """``Trainer._load_optimizer_and_scheduler`` that grows the loaded moments of the
    parameters whose rows grew (:func:`.trainers.growing_moments`)."""
    return trainers.growing_moments(original, lambda trainer: [trainer.optimizer])
