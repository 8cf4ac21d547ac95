"""``CheckpointManager``: atomic, self-describing checkpoints in one folder, pruning of
its own files only, and the newest valid one back for a resume.

Newest means the last written: every save gets the next *generation* (in its manifest),
and pruning and ``resume("auto")`` go by it, never by the step number. Only files whose
valid manifest names them are candidates, and only those are ever pruned.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import secrets
from pathlib import Path
from typing import Any, Mapping

import torch

from .. import _run
from .._runlock import RunFolderInUse, lock_folder
from .._log import info
from . import _collective
from .digest import beside, file_record
from .reading import (FORMAT, MANIFEST_SUFFIX, Manifest, _what_to_do, check_file,
                      manager_checkpoints, manifest_path, manifest_text, read_manifest,
                      saved_nonfinite, warn_nonfinite_saved)
from .atomic import TMP_OWNER, host_name, pid_alive
from .atomic import atomic_text as _atomic_text
from .atomic import (disk_free, disk_full_error, ensure_free_space, no_room, space_needed,
                     write_atomically)
from .errors import CheckpointError, DiskFullError
from .optimizer import _as_list, scaler_enabled
from .data_position import position_or_warn
from .ema import saved_or_warn as ema_weights
from .parts import saved_state
from .rng import capture_rng_state
from .sharded import (DCP_SUFFIX, check_folder, complete_folders, is_sharded_model,
                      read_folder_manifest, remove_folder, save_sharded, sweep_incomplete)

logger = logging.getLogger("training_patches")

LATEST = "latest"


def _remove(path: Path) -> bool:
    """Delete a complete checkpoint, what vouches for it first (a file's manifest, a folder's
    commit marker): an interrupted removal leaves an incomplete checkpoint, never a manifest
    that vouches for a missing file. False (and a WARNING) when it could not."""
    try:
        if path.is_dir():
            remove_folder(path)
        else:
            manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("training-patches: could not remove the old checkpoint %s (%s)", path, exc)
        return False
    return True


def _as_step(step: Any) -> int:
    """A step number: a whole number >= 0 (ints, numpy ints, 0-d integer tensors)."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"CheckpointManager.save: step must be a whole number, got {step!r}"
                        ) from None
    if value < 0:
        raise ValueError(f"CheckpointManager.save: step must be >= 0, got {value}")
    return value


class CheckpointManager:
    """Atomic, self-describing checkpoints in ``output_dir``, and the newest valid one back.

    Files: ``ckpt_<step>.pt``, its manifest ``ckpt_<step>.pt.manifest.json`` (written
    last: a checkpoint without one is incomplete, never chosen or deleted) and ``latest``.
    The ``keep`` most recently written complete checkpoints are kept (by generation, not
    by step; ``keep=None`` prunes nothing); only files this class wrote are ever pruned.

    Many processes: with a process group of more than one rank, call :meth:`save` and
    :meth:`resume` from EVERY rank (``collective=None`` detects the group): rank 0 writes,
    every rank returns the same path or raises the same error, and every rank's RNG state
    is saved. An FSDP2 (DTensor) model is saved sharded into a folder ``ckpt_<step>.dcp``
    (:mod:`patches.checkpoint.sharded`). ``collective=False`` makes every call local.
    """

    PATTERN = re.compile(r"^ckpt_(\d+)\.pt$")

    def __init__(self, output_dir: str | os.PathLike[str], keep: int | None = 3,
                 prefix: str = "ckpt", *, collective: bool | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointManager: keep must be at least 1 or None, got {keep}")
        self.output_dir = Path(output_dir)
        self.keep = keep
        self.prefix = prefix
        self.collective = collective
        self.pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)\.pt$")
        self.folder_pattern = re.compile(rf"^{re.escape(prefix)}_(\d+){re.escape(DCP_SUFFIX)}$")
        self._shared_checked = False  # whether every rank was shown to see this folder
        self._claimed = False  # whether this process (the writer) holds the folder's lock
        # A plain loop's reports go beside its checkpoints, unless set_output_dir says otherwise
        _run.saw_checkpoint_folder(self.output_dir)

    def path_for(self, step: int) -> Path:
        """The file of ``step``'s checkpoint (it may not exist)."""
        return self.output_dir / f"{self.prefix}_{step:09d}.pt"

    def folder_for(self, step: int) -> Path:
        """The folder of ``step``'s sharded (FSDP2/DCP) checkpoint (it may not exist)."""
        return self.output_dir / f"{self.prefix}_{step:09d}{DCP_SUFFIX}"

    def _collective(self) -> bool:
        return self.collective is not False and _collective.active()

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None,
             scheduler: Any = None, scaler: Any = None, *, loader: Any = None,
             ema: Any = None, **extra: Any) -> Path | None:
        """Write the checkpoint of ``step``; returns its path once it is complete, or None
        when the disk had no room for it (below: nothing written, training goes on).

        ``loader``: the DataLoader the loop iterates: its position is saved, and
        ``load_checkpoint(..., loader=)`` continues there (:mod:`.data_position`). ``ema``:
        the model's EMA: its weights are saved (:mod:`.ema`). A loader or EMA whose state
        cannot be read is one WARNING and that part left out. ``extra`` (e.g. ``epoch=``)
        must be tensors or plain values; it comes back as ``LoadReport.extra``.

        The free space is checked first (the estimate and 1/32 of it); when short, the
        checkpoints this save would prune go first. A checkpoint that fits only in the place
        of those it replaces is not written: one WARNING, None returned, training goes on.
        One that would not fit even there (or a disk that fills during the write) is a
        :class:`DiskFullError`. A failed save leaves none of its files behind.

        Under a process group call it from every rank: rank 0 writes, every rank
        returns the same path (or None) or raises the same error. FSDP2 models are saved
        sharded (every rank writes its shards) into :meth:`folder_for` ``(step)``.
        """
        step = _as_step(step)
        _run.saw_checkpoint_folder(self.output_dir)  # the folder of the newest save wins
        if self._collective():
            self._check_shared()
            _collective.on_writer(self._claim)
        else:
            self._claim()
        if is_sharded_model(model):
            if ema is not None:
                logger.warning(
                    "training-patches: the EMA weights are left out of the checkpoint of step "
                    "%d: CheckpointManager.save(ema=) of an FSDP2 (sharded) model is not "
                    "supported (its EMA copy would be saved whole on every rank). The model and "
                    "the other parts are saved. Save the EMA weights yourself "
                    "(torch.distributed.checkpoint), or leave ema= out.", step)
            return save_sharded(self, step, model, optimizer, scheduler, scaler, extra,
                                loader=loader)

        def position() -> Any:
            return (position_or_warn(loader, f"the checkpoint of step {step}")
                    if loader is not None else None)

        if not self._collective():
            data = position()
            return self._write(step, model, optimizer, scheduler, scaler, extra, None,
                               [data] if data is not None else None, ema)
        # one gather for both: each rank's RNG and its loader's position
        ranks = _collective.gather_checked(lambda: (capture_rng_state(), position()))
        rng_ranks = [rng for rng, _ in ranks]
        data_ranks = [data for _, data in ranks]
        data = data_ranks if any(d is not None for d in data_ranks) else None
        return _collective.on_writer(
            lambda: self._write(step, model, optimizer, scheduler, scaler, extra, rng_ranks, data,
                                ema))

    def _write(self, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any,
               scaler: Any, extra: dict[str, Any], rng_ranks: list[Any] | None,
               data_ranks: list[Any] | None = None, ema: Any = None) -> Path | None:
        """One process writes the file, its manifest, ``latest``; then prunes. None: the
        disk had no room and training goes on (:func:`.atomic.no_room`)."""
        model_state = model.state_dict()
        optimizer_states = [o.state_dict() for o in _as_list(optimizer)]
        schedulers = [s for s in _as_list(scheduler) if s is not None]
        payload = {
            "format": FORMAT,
            "model": model_state,
            "optimizer": optimizer_states or None,
            # "rng" is the writer's (what older readers restore); "rng_ranks" every rank's.
            "rng": rng_ranks[0] if rng_ranks else capture_rng_state(),
            # step, scheduler, scaler, runtime counters, classes, extra: what a sharded
            # folder's meta.pt holds too (one set of keys, one load path: .parts)
            **saved_state(step, _as_list(optimizer), schedulers, scaler, extra, data_ranks),
        }
        if rng_ranks:
            payload["rng_ranks"] = rng_ranks
        if ema is not None:
            weights = ema_weights(ema, f"the checkpoint of step {step}")
            if weights is not None:
                payload["ema"] = weights
        path = self.path_for(step)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        generation = self._next_generation(self._sweep_temp())
        if generation is None:
            return None
        needed, least = space_needed(payload)
        try:
            self._make_room(path, needed)
            ensure_free_space(path, needed)
            return self._write_files(path, step, generation, payload, model, model_state,
                                     optimizer_states, scaler, rng_ranks, needed)
        except DiskFullError as exc:
            if no_room(exc, path, least, self._files(self._replaced_by(path))):
                return None
            raise

    def _write_files(self, path: Path, step: int, generation: int, payload: dict[str, Any],
                     model: torch.nn.Module, model_state: Mapping[str, torch.Tensor],
                     optimizer_states: list[Any], scaler: Any, rng_ranks: list[Any] | None,
                     needed: int) -> Path:
        """The checkpoint file, its manifest, ``latest``; then the pruning. The finite scan
        runs in a thread beside the write (both read every tensor; issue 41)."""
        scan = beside(lambda: self._nonfinite(model, model_state, {
            f"optimizer.{index}": state for index, state in enumerate(optimizer_states)}))
        # A write that fails leaves the scan to end by itself (it only reads; its result unused).
        written = write_atomically(path, lambda handle: torch.save(payload, handle),
                                   digest=True, needed=needed)
        try:
            nonfinite = scan()
            size, record = written.size, written.digest
            if path.stat().st_size != size:  # torch wrote out of order: hash the file itself
                size, record = path.stat().st_size, file_record(path)
            _atomic_text(manifest_path(path), manifest_text(
                step, generation, {path.name: {"bytes": size, "digest": record}},
                {k: list(v.shape) for k, v in model_state.items()}, nonfinite,
                amp=scaler_enabled(scaler), world_size=len(rng_ranks) if rng_ranks else 1,
                has_optimizer=bool(optimizer_states)))
        except BaseException as exc:
            # The checkpoint is ours and has no manifest of its own: remove it (and a
            # manifest of an earlier save of this step, which no longer describes it).
            manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            if isinstance(exc, DiskFullError):
                raise disk_full_error(path, needed, disk_free(self.output_dir),
                                      written=written.size) from exc
            raise
        self._point_latest(path)
        info("training-patches: checkpoint step %d written to %s", step, path)
        warn_nonfinite_saved(step, path, nonfinite)
        self._prune(keep_path=path)
        return path

    def _replaced_by(self, path: Path) -> list[Path]:
        """The checkpoints a save of ``path`` replaces: an earlier file of the same step, and
        those the pruning after it removes (``keep``), oldest first."""
        owned = [p for p, _ in self._own() if p != path]
        doomed = owned[:max(len(owned) + 1 - self.keep, 0)] if self.keep is not None else []
        return ([path] if path.is_file() else []) + doomed

    @staticmethod
    def _files(checkpoints: list[Path]) -> list[Path]:
        """The files of ``checkpoints``: each file and its manifest, a folder's files."""
        files: list[Path] = []
        for path in checkpoints:
            if path.is_dir():
                files += [p for p in sorted(path.rglob("*")) if p.is_file()]
            else:
                files += [p for p in (path, manifest_path(path)) if p.is_file()]
        return files

    def _make_room(self, path: Path, needed: int) -> None:
        """When the folder has less than ``needed`` bytes free, remove first the checkpoints
        the pruning after this save would remove anyway, never the newest one (which stays
        until the new one is complete)."""
        free = disk_free(self.output_dir)
        if self.keep is None or free is None or free >= needed:
            return
        owned = [p for p, _ in self._own() if p != path]
        early = [p for p in self._replaced_by(path) if p != path and owned and p != owned[-1]]
        for old in early:
            if _remove(old):
                info("training-patches: removed %s before writing %s, not after: the folder has "
                     "%d bytes free and the new checkpoint needs about %d (keep=%d would remove "
                     "it once the new one is written)", old.name, path.name, free, needed,
                     self.keep)

    _nonfinite = staticmethod(saved_nonfinite)  # here: tests time it against the write

    def _next_generation(self, unlisted: OSError | None = None) -> int | None:
        """One more than the newest checkpoint's. Where the folder cannot be listed
        (``unlisted``: why, as :meth:`_sweep_temp` found), one more than the checkpoint
        ``latest`` names, read by name; None, said, where it names none readable: numbered 0 the save would pass for
        older than those it cannot see, so it is not made (as a full disk's: training goes
        on, the next save tries again)."""
        generations = [m.generation for _, m in self._all() if m.generation is not None]
        if unlisted is not None and not generations:
            named, manifest = "", None
            try:
                named = (self.output_dir / LATEST).read_text(encoding="utf-8").strip()
                target = self.output_dir / named
                if named:
                    manifest = (read_folder_manifest(target) if target.is_dir()
                                else read_manifest(target))[0]
            except OSError:
                pass
            if manifest is None or manifest.generation is None:
                logger.warning(
                    "training-patches: checkpoint NOT saved into %s: the folder cannot be "
                    "listed (%s) and its %r file names no readable checkpoint, so this one "
                    "could not be numbered after those already there (a resume would take it "
                    "for older). Nothing was written; training goes on. Make the folder "
                    "readable again (its permissions, its network disk).",
                    self.output_dir, unlisted, LATEST)
                return None
            generations = [manifest.generation]
            if _run.current().first_time(f"checkpoint.unlisted:{self.output_dir}"):
                logger.warning("training-patches: the checkpoint folder %s cannot be listed "
                               "(%s): the temporary files of interrupted saves are not "
                               "removed, and the checkpoints already there are neither seen "
                               "nor pruned; the save goes on, numbered after %s, which its "
                               "%r file names", self.output_dir, unlisted, named, LATEST)
        return max(generations, default=-1) + 1

    def _point_latest(self, path: Path) -> None:
        latest = self.output_dir / LATEST
        try:
            _atomic_text(latest, path.name + "\n")
        except (OSError, CheckpointError) as exc:
            # The checkpoint is complete; a stale pointer would name an older (or pruned) file.
            try:
                latest.unlink(missing_ok=True)
            except OSError:
                pass
            logger.warning("training-patches: %s is saved, but %s could not be updated (%s); "
                           "resume('auto') does not need it", path, latest, exc)

    def _sweep_temp(self) -> OSError | None:
        """Remove the temporary files and incomplete sharded folders of this manager's saves
        (its names only) written on THIS host by a pid that no longer runs: another host's
        save in progress is never touched. Runs on the writer, at the start of a save.
        Returns why the folder could not be listed (for :meth:`_next_generation`), or None."""
        if not self.output_dir.is_dir():
            return None
        sweep_incomplete(self.output_dir, self.folder_pattern, pid_alive)
        # The ``latest`` pointer is written the same way: its temporary file too.
        own = rf"{re.escape(self.prefix)}_\d+\.pt(?:{re.escape(MANIFEST_SUFFIX)})?"
        mark = re.compile(rf"^\.(?:{own}|{re.escape(LATEST)}){TMP_OWNER.pattern}")
        here = host_name()
        try:
            entries = list(self.output_dir.iterdir())
        except OSError as exc:
            return exc  # _next_generation: go on after ``latest``'s, or skip
        for entry in entries:
            match = mark.match(entry.name)
            if match is None:
                continue
            pid, host = int(match.group(1)), match.group(2)
            if host != here or (pid != os.getpid() and pid_alive(pid)):
                continue
            try:
                entry.unlink(missing_ok=True)
            except OSError as exc:
                if _run.current().first_time(f"checkpoint.unremovable:{entry}"):
                    logger.warning("training-patches: could not remove %s, left by an "
                                   "interrupted save (%s)", entry, exc)
                continue
            logger.debug("training-patches: removed %s, left by an interrupted save", entry.name)
        return None

    def _all(self) -> list[tuple[Path, Manifest]]:
        """Complete checkpoints in the folder, newest first (by generation): files with a valid
        manifest (any name) and folders with their commit marker (this manager's names)."""
        found = manager_checkpoints(self.output_dir) + [
            (folder, manifest) for folder, manifest in complete_folders(self.output_dir)
            if self.folder_pattern.match(folder.name)]
        return sorted(found, key=lambda item: item[1].order(), reverse=True)

    def _own(self) -> list[tuple[Path, Manifest]]:
        """Complete checkpoints this manager wrote (files with a valid manifest and folders
        with their commit marker, by its name patterns), oldest first by generation."""
        return [(path, manifest) for path, manifest in reversed(self._all())
                if path.is_dir() or self.pattern.match(path.name)]

    def _prune(self, keep_path: Path | None = None) -> None:
        if self.keep is None:
            return
        owned = self._own()
        for path, _ in owned[: max(len(owned) - self.keep, 0)]:
            if path != keep_path and _remove(path):
                logger.debug("training-patches: pruned checkpoint %s", path)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints written by this manager, oldest first by generation (the
        order they were written; not hash-checked)."""
        return [path for path, _ in self._own()]

    def resume(self, which: str | int | os.PathLike[str] = "auto", *,
               verify_hash: bool = True, allow_nonfinite: bool = False) -> Path | None:
        """The checkpoint to resume from, or None when there is none yet (under a process
        group call it from every rank: every rank gets rank 0's answer).

        ``"auto"``: the most recently written checkpoint in ``output_dir`` whose manifest and
        files validate and that held no NaN/Inf when it was saved (unless
        ``allow_nonfinite``); others are passed over with a warning and left on disk. A
        step number or a path: that checkpoint, which must validate. A folder that exists
        but cannot be listed is a :class:`CheckpointError` (not None: that would start over).
        """
        if self._collective():
            self._check_shared()
            return _collective.on_writer(
                lambda: self._resume(which, verify_hash=verify_hash,
                                     allow_nonfinite=allow_nonfinite))
        return self._resume(which, verify_hash=verify_hash, allow_nonfinite=allow_nonfinite)

    def _claim(self) -> None:
        """The writer's lock on the folder, taken at its first save and held until the
        process ends (:func:`patches._runlock.lock_folder`): a second process saving there
        gets :class:`CheckpointError` before it writes anything. Reading takes no lock."""
        if self._claimed:
            return
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return  # the save itself says why the folder cannot be written
        try:
            lock_folder(self.output_dir, what="checkpoint folder", overwritten="checkpoints")
        except RunFolderInUse as exc:
            raise CheckpointError(str(exc)) from None
        self._claimed = True

    def _check_shared(self) -> None:
        """Under a process group, once per manager: ``output_dir`` must be one folder that
        every rank sees. Rank 0 writes a file of a fresh random name and every rank looks for
        it (a read-only folder: every rank's list of checkpoints must agree); else
        :class:`CheckpointError` on every rank."""
        if self._shared_checked:
            return
        planted: list[Path] = []  # rank 0's probe, removed whatever happens below

        def plant() -> str | None:
            name = f".training_patches_shared_{host_name()}_{os.getpid()}_{secrets.token_hex(8)}"
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                (self.output_dir / name).write_text(name, encoding="utf-8")
            except OSError:
                return None
            planted.append(self.output_dir / name)
            return name

        def look(name: str | None) -> list[Any]:
            if name is None:
                return [sorted(path.name for path, _ in self._own()), host_name()]
            try:
                return [(self.output_dir / name).read_text(encoding="utf-8") == name,
                        host_name()]
            except OSError:
                return [False, host_name()]

        try:
            name = _collective.on_writer(plant)
            views = _collective.gather_checked(lambda: look(name))
        finally:
            for path in planted:  # every rank has looked (or the collective failed)
                path.unlink(missing_ok=True)
        if name is not None:
            apart = [rank for rank, (seen, _) in enumerate(views) if not seen]
            found = (f"a file rank 0 (host {views[0][1]}) wrote there is not visible to "
                     + ", ".join(f"rank {r} (host {views[r][1]})" for r in apart))
        else:
            apart = [rank for rank, (seen, _) in enumerate(views) if seen != views[0][0]]
            found = (f"rank 0 (host {views[0][1]}) sees the checkpoints "
                     f"{', '.join(views[0][0]) or 'none'}, while "
                     + "; ".join(f"rank {r} (host {views[r][1]}) sees "
                                 f"{', '.join(views[r][0]) or 'none'}" for r in apart))
        if apart:
            raise CheckpointError(
                f"training-patches: the checkpoint folder {self.output_dir} is not one folder "
                f"shared by every rank: {found}. Under a process group CheckpointManager saves "
                f"from rank 0 (FSDP2 shards from every rank) and resumes from what rank 0 "
                f"sees, so a folder local to each node would lose the run: a resume would "
                f"start over from step 0, a sharded checkpoint would miss the other nodes' "
                f"shards. Nothing was written or loaded. Point output_dir at a filesystem "
                f"every node mounts at the same path (NFS, Lustre, a bucket mount), or keep "
                f"one folder per node on purpose with CheckpointManager(..., collective=False), "
                f"saving and resuming from one rank yourself.")
        self._shared_checked = True

    def _resume(self, which: str | int | os.PathLike[str], *, verify_hash: bool,
                allow_nonfinite: bool) -> Path | None:
        if which != "auto":
            if isinstance(which, int):
                folder = self.folder_for(which)
                path = folder if folder.exists() else self.path_for(which)
            else:
                path = Path(which)
            problem = (check_folder(path, verify_hash=verify_hash) if path.is_dir()
                       else check_file(path, verify_hash=verify_hash))
            if problem is not None:
                raise CheckpointError(
                    f"training-patches: cannot resume from {path}: the file {problem}. "
                    f"{_what_to_do(path)}")
            return path
        skipped: list[str] = []
        for candidate, manifest in self._all():
            problem = (check_folder(candidate, verify_hash=verify_hash) if candidate.is_dir()
                       else check_file(candidate, verify_hash=verify_hash))
            if problem is None and manifest.nonfinite and not allow_nonfinite:
                problem = (f"held NaN or Inf when it was saved "
                           f"({', '.join(manifest.nonfinite[:3])})")
            if problem is None:
                if skipped:
                    logger.warning(
                        "training-patches: resuming from %s; passed over newer checkpoint(s) that "
                        "cannot be used (left on disk): %s", candidate, "; ".join(skipped))
                self._note_unfinished()  # listed just now: an error here loses only the note
                return candidate
            skipped.append(f"{candidate.name} {problem}")
        unlisted = self._note_unfinished()
        if unlisted is not None:
            raise CheckpointError(
                f"training-patches: cannot resume from {self.output_dir}: the folder cannot be "
                f"listed ({unlisted}), so none of its checkpoints was seen. Nothing was loaded; "
                f"going on as if it held none would start the run over from step 0. Make the "
                f"folder readable again (its permissions, its network disk) and resume.")
        if skipped:
            logger.warning("training-patches: no valid checkpoint in %s to resume from: %s",
                           self.output_dir, "; ".join(skipped))
        return None

    def _note_unfinished(self) -> OSError | None:
        """Say which files named like this manager's were not considered, and why; the
        error when the folder cannot be listed (then nothing is said)."""
        if not self.output_dir.is_dir():
            return None
        try:
            entries = sorted(self.output_dir.iterdir())
        except OSError as exc:
            return exc
        notes = []
        for entry in entries:
            if self.folder_pattern.match(entry.name) and entry.is_dir():
                problem = read_folder_manifest(entry)[1]
                if problem is not None:
                    notes.append(f"{entry.name} {problem}")
                continue
            if not self.pattern.match(entry.name):
                continue
            manifest, invalid = read_manifest(entry)
            if manifest is None and invalid is None:
                notes.append(f"{entry.name} has no manifest (its save did not complete, or "
                             f"another program wrote it)")
            elif invalid is not None:
                notes.append(f"{entry.name} has a manifest that is not valid ({invalid})")
        if notes:
            logger.warning("training-patches: not considered for resuming (left on disk): %s",
                           "; ".join(notes))
        return None


__all__ = ["CheckpointManager", "LATEST"]
