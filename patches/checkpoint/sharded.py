"""Sharded checkpoints of FSDP2 models through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a folder ``<prefix>_<step>.dcp`` written by every rank together: DCP's files
(each rank its shards of the model and optimizer), ``rng.rank<R>.pt`` and ``data.rank<R>.pt``
(each rank's RNG and data position), ``meta.pt`` (rank 0: :func:`.parts.saved_state`),
``manifest.json`` (rank 0, once every rank reported its files: the one manifest format,
:func:`.reading.parse_manifest`), then LAST ``COMMITTED`` (the manifest's SHA-256: without
it a folder is incomplete, never resumed or pruned). ``writer.json`` (rank 0, FIRST) names
the host and pid of the writer, so that the next save removes the folder of a killed one
(:func:`sweep_incomplete`). Loading goes through DCP too, so a checkpoint saved by N ranks
loads into M ranks. Every step's outcome reaches every rank (:mod:`._collective`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _dist
from .._log import info
from . import _collective, data_position
from .reading import (Manifest, entries_of, file_problem, manifest_from, manifest_text,
                      saved_nonfinite, warn_nonfinite_saved)
from .atomic import _fsync_dir, atomic_text, atomic_torch_save, host_name
from .digest import file_record
from .errors import CheckpointError, CheckpointMismatchError
from .optimizer import _as_list, scaler_enabled
from .parts import ModelSource, Source, StatePlan, carry_out, plan_state, saved_state
from .report import LoadReport
from .rng import capture_rng_state, state_for_rank

logger = logging.getLogger("training_patches")

DCP_SUFFIX = ".dcp"
MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMITTED"
META_NAME = "meta.pt"
WRITER_NAME = "writer.json"


# Each rank's own files: its RNG states and its loader's position (``.format(rank)``).
_RNG_NAME = "rng.rank{}.pt"
_DATA_NAME = "data.rank{}.pt"


def is_sharded_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` has DTensor parameters (FSDP2 ``fully_shard``, tensor parallel)."""
    return any(_dist.is_dtensor(p) for p in model.parameters())


def _on_writer(fn: Callable[[], Any]) -> Any:
    return _collective.on_writer(fn) if _collective.active() else fn()


def _on_every_rank(fn: Callable[[Callable[..., None]], Any], *, gather: bool) -> Any:
    """``fn(gate)`` on every rank; one error everywhere if any failed; else, with
    ``gather``, every rank's result in rank order (plain values only), or this rank's."""
    if not _collective.active():
        result = fn(lambda failure=None: None)
        return [result] if gather else result
    result = _collective.on_every_rank(fn)
    return _collective.all_gather(result) if gather else result


# --------------------------------------------------------------------------- reading


def read_folder_manifest(folder: Path) -> tuple[Manifest | None, str | None]:
    """(manifest, None) for a complete folder; (None, why) otherwise. Never raises."""
    marker, man = folder / COMMIT_NAME, folder / MANIFEST_NAME
    try:
        if not marker.is_file():
            return None, ("has no commit marker (its save did not complete: a rank was "
                          "stopped or failed before every rank had written its shards)")
        if not man.is_file():
            return None, f"has a commit marker but no {MANIFEST_NAME}"
        raw = man.read_bytes()
        if marker.read_text().strip() != hashlib.sha256(raw).hexdigest():
            return None, f"has a {MANIFEST_NAME} that does not match its commit marker"
    except (OSError, ValueError) as exc:
        return None, f"cannot be read ({str(exc)[:120]})"
    manifest, invalid = manifest_from(raw)
    if invalid is not None:
        return None, f"has a manifest {MANIFEST_NAME} that is not valid: {invalid}"
    return manifest, None


def check_folder(folder: str | os.PathLike[str], *, verify_hash: bool = True) -> str | None:
    """Why ``folder`` cannot be loaded (marker, manifest, every file's size and, with
    ``verify_hash``, digest), or None. Never raises."""
    folder = Path(folder)
    if not folder.is_dir():
        return "is not a folder"
    manifest, problem = read_folder_manifest(folder)
    for name, entry in manifest.files.items() if manifest is not None else ():
        found = file_problem(folder / name, entry, verify_hash=verify_hash)
        if found is not None:
            return f"does not hold what its manifest vouches for: {name} {found[1]}"
    return problem


def complete_folders(output_dir: str | os.PathLike[str]) -> list[tuple[Path, Manifest]]:
    """Folders in ``output_dir`` with a commit marker and a valid manifest, newest first."""
    found = []
    for entry in entries_of(output_dir):
        if not entry.name.endswith(DCP_SUFFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        manifest, _ = read_folder_manifest(entry)
        if manifest is not None:
            found.append((entry, manifest))
    found.sort(key=lambda item: item[1].order(), reverse=True)
    return found


def remove_folder(folder: Path) -> None:
    """Delete a checkpoint folder, its commit marker first (an interrupted removal leaves an
    incomplete folder, never a marker that vouches for missing shards)."""
    (folder / COMMIT_NAME).unlink(missing_ok=True)
    _fsync_dir(folder)
    shutil.rmtree(folder)


def sweep_incomplete(output_dir: Path, pattern: "re.Pattern[str]",
                     pid_alive: Callable[[int], bool]) -> None:
    """Remove the folders named by ``pattern`` in ``output_dir`` that have no commit marker
    and whose ``writer.json`` names THIS host and a pid that no longer runs (a killed save)
    or this process (a failed save). Any other folder is left as it is."""
    here = host_name()
    for entry in entries_of(output_dir):
        if not pattern.match(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        if (entry / COMMIT_NAME).exists():
            continue  # complete, or damaged after its commit: never an interrupted save
        try:
            writer = json.loads((entry / WRITER_NAME).read_text(encoding="utf-8"))
            host, pid = str(writer["host"]), int(writer["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no writer record (an older version): who writes it is unknown
        if host != here or (pid != os.getpid() and pid_alive(pid)):
            continue
        try:
            shutil.rmtree(entry)
        except OSError as exc:
            logger.warning("training-patches: could not remove %s, left by an interrupted "
                           "sharded save (%s)", entry, exc)
            continue
        info("training-patches: removed %s: a sharded checkpoint folder without its commit "
             "marker, whose writer (pid %d on this host) %s", entry, pid,
             "is this process (an earlier save failed)" if pid == os.getpid()
             else "no longer runs (its save was stopped)")


# --------------------------------------------------------------------------- saving


def _dcp_call(what: str, folder: Path, call: Callable[[], Any]) -> Any:
    """A DCP save/load whose failure becomes one paragraph, the same on every rank.

    DCP's ``CheckpointException`` derives from BaseException and holds every failing
    rank's exception; it is said once, by its lowest failing rank."""
    from torch.distributed.checkpoint.api import CheckpointException  # lazy: heavy (DCP)

    try:
        return call()
    except CheckpointException as exc:
        failures = exc.failures
        source = min(failures) if failures else None
        cause = failures[source][0] if source is not None else exc
        text = f"{type(cause).__name__}: {str(cause)[:300]}"
        if what == "save":
            after = (f"The folder {folder} has no commit marker, so it is never resumed; the "
                     f"checkpoints already in {folder.parent} are unchanged. Fix the cause (free "
                     f"space, permissions) and save again.")
        else:
            after = ("The model and optimizer may be partly loaded: build them again (or "
                     "restart the job) before resuming from another checkpoint.")
        raise CheckpointError(
            f"training-patches: the sharded (DCP) {what} of {folder} failed on rank {source} "
            f"({text}). {after}") from cause


def _own_files(folder: Path, rank: int) -> list[str]:
    names = [p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_")]
    names.append(_RNG_NAME.format(rank))
    if (folder / _DATA_NAME.format(rank)).exists():
        names.append(_DATA_NAME.format(rank))
    if rank == 0:
        names += [".metadata", META_NAME]
    return sorted(names)


def _state_dicts(model: torch.nn.Module, optimizers: list[Any]) -> tuple[dict, dict | None]:
    from torch.distributed.checkpoint.state_dict import (  # lazy: heavy, only for sharded saves
        get_model_state_dict, get_state_dict)

    if optimizers:
        return get_state_dict(model, optimizers)
    return get_model_state_dict(model), None


def save_sharded(manager: Any, step: int, model: torch.nn.Module, optimizer: Any,
                 scheduler: Any, scaler: Any, extra: dict[str, Any], loader: Any = None
                 ) -> Path | None:
    """Every rank writes its shards of ``step`` into ``manager.folder_for(step)``; rank 0
    writes the manifest and then the commit marker; every rank returns the folder (None on
    every rank where the manager cannot number it: nothing written, said)."""
    import torch.distributed.checkpoint as dcp  # lazy: heavy, only for sharded saves

    folder = manager.folder_for(step)
    optimizers = _as_list(optimizer)

    def prepare() -> int | None:
        # incomplete folders of killed saves (this host's only); numbered before any write:
        # None, nothing written
        generation = manager._next_generation(manager._sweep_temp())
        if generation is None:
            return None
        if folder.exists():  # an earlier save of this step (another branch) or a torn one
            remove_folder(folder)
        folder.mkdir(parents=True)
        # Who will write the commit marker: what the sweep of a later save judges by. No
        # fsync: a record lost or torn by a crash only means the folder is never swept.
        (folder / WRITER_NAME).write_text(json.dumps(
            {"host": host_name(), "pid": os.getpid(), "step": step}), encoding="utf-8")
        return generation

    generation = _on_writer(prepare)
    if generation is None:
        return None

    def write_rank(gate: Callable[..., None]) -> dict[str, Any]:
        rank = _dist.rank()
        msd, osd = _state_dicts(model, optimizers)
        nonfinite = saved_nonfinite(model, msd, {} if osd is None else {"optimizer": osd})
        state = {"model": msd} if osd is None else {"model": msd, "optimizer": osd}
        _dcp_call("save", folder, lambda: dcp.save(state, checkpoint_id=str(folder)))
        atomic_torch_save(capture_rng_state(), folder / _RNG_NAME.format(rank), check_space=False)
        position = data_position.position_or_warn(loader, f"the save into {folder}") \
            if loader is not None else None
        if position is not None:  # a loader it cannot read: one WARNING, that part left out
            atomic_torch_save(position, folder / _DATA_NAME.format(rank), check_space=False)
        if rank == 0:
            meta = saved_state(step, optimizers, [s for s in _as_list(scheduler)
                                                  if s is not None], scaler, extra)
            meta["data_world"] = _dist.world_size() if position is not None else None
            atomic_torch_save(meta, folder / META_NAME, check_space=False)
        files = {name: {"bytes": (folder / name).stat().st_size,
                        "digest": file_record(folder / name)} for name in _own_files(folder, rank)}
        return {"files": files, "nonfinite": nonfinite,
                "shapes": {k: list(v.shape) for k, v in msd.items()
                           if isinstance(v, torch.Tensor)},
                "has_optimizer": osd is not None}

    reports = _on_every_rank(write_rank, gather=True)

    def commit() -> Path:
        files: dict[str, Any] = {}
        nonfinite: list[str] = []
        for report in reports:
            files.update(report["files"])
            nonfinite += [n for n in report["nonfinite"] if n not in nonfinite]
        text = manifest_text(step, generation, files, reports[0]["shapes"],
                             nonfinite, amp=scaler_enabled(scaler), world_size=len(reports),
                             has_optimizer=reports[0]["has_optimizer"])
        atomic_text(folder / MANIFEST_NAME, text)
        # The commit marker LAST: every rank has reported its files; it vouches for the
        # manifest by its hash.
        atomic_text(folder / COMMIT_NAME, hashlib.sha256(text.encode("utf-8")).hexdigest() + "\n")
        manager._point_latest(folder)
        info("training-patches: sharded checkpoint step %d written to %s by %d rank(s)",
             step, folder, len(reports))
        warn_nonfinite_saved(step, folder, nonfinite)
        manager._prune(keep_path=folder)
        return folder

    return _on_writer(commit)


# --------------------------------------------------------------------------- loading


class ShardedModel(ModelSource):
    """The model part of a sharded folder: the model's tensors (sharded or plain) checked
    against the shapes the manifest names, then loaded by DCP in the saved shapes, with the
    optimizer moments under ``remap`` (DCP reshards: a folder of N ranks loads into M)."""

    def __init__(self, path: Path, model: torch.nn.Module, manifest: Manifest,
                 optimizers: list[Any]) -> None:
        self.path, self.model, self.manifest, self.optimizers = path, model, manifest, optimizers

    def plan(self, plan: StatePlan) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (  # lazy: heavy, only for sharded loads
            get_model_state_dict)

        path, saved = self.path, self.manifest["param_shapes"]
        msd = get_model_state_dict(self.model)  # (the optimizer's state dict would create moments)
        shapes = {k: list(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
        if shapes != saved:
            differ = sorted(k for k in set(shapes) | set(saved) if shapes.get(k) != saved.get(k))
            raise CheckpointMismatchError(
                f"training-patches: cannot load the sharded checkpoint {path} into this model: "
                f"{len(differ)} tensor(s) differ in name or shape ({', '.join(differ[:4])}; e.g. "
                f"{differ[0]} is {saved.get(differ[0])} in the checkpoint and "
                f"{shapes.get(differ[0])} in the model). Nothing was loaded. A sharded checkpoint "
                f"loads only into the same architecture; to grow the vocabulary, load the model "
                f"unsharded first (a single-file checkpoint through load_checkpoint before "
                f"fully_shard), then shard it.")
        return msd

    def apply(self, plan: StatePlan, report: LoadReport, undo: list[Callable[[], None]]) -> None:
        import torch.distributed.checkpoint as dcp  # lazy: heavy, only for sharded loads
        from torch.distributed.checkpoint.state_dict import (  # lazy: heavy, only for sharded loads
            set_model_state_dict, set_state_dict)

        model, optimizers, path = self.model, self.optimizers, self.path
        state = {"model": plan.model_plan}
        if plan.effective == "remap" and optimizers:
            state["model"], state["optimizer"] = _state_dicts(model, optimizers)
        # DCP's load cannot be undone: every rank passed the gate before it.
        _dcp_call("load", path, lambda: dcp.load(state, checkpoint_id=str(path)))
        if "optimizer" in state:
            set_state_dict(model, optimizers, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            set_model_state_dict(model, state["model"])
        report.loaded.append("model")

    def report(self, plan: StatePlan, report: LoadReport) -> None:
        report.set_part("model", "restored", f"{len(plan.model_plan)} tensor(s)", in_file=True)


# The one-file weights a folder may hold instead of DCP shards (zero_to_fp32, save_pretrained).
CONSOLIDATED = ("pytorch_model.bin", "model.safetensors", "pytorch_model.pt", "model.pt")


def consolidated_weights(folder: Path) -> list[Path]:
    """The one-file weights in ``folder`` when it is no DCP save (it has no ``.metadata``)."""
    if (folder / ".metadata").exists():
        return []
    return [folder / name for name in CONSOLIDATED if (folder / name).is_file()]


def load_sharded(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                 scaler: Any, *, policy: str, restore_rng: bool | None, verify_hash: bool,
                 allow_nonfinite: bool, loader: Any = None) -> Any:
    """Load a sharded checkpoint folder into ``model`` (FSDP2 or plain; any world size):
    the folder's checks, then every part planned and carried out as a file's are
    (:func:`.parts.plan_state`, :func:`.parts.carry_out`), the model through DCP."""
    problem = _on_writer(lambda: check_folder(path, verify_hash=verify_hash))
    weights = consolidated_weights(path) if problem is not None else []
    if weights:  # DeepSpeed's zero_to_fp32 output, an HF save: one file, not shards
        raise CheckpointError(
            f"training-patches: cannot load the folder {path} as a sharded checkpoint: it is "
            f"no DCP save (no .metadata, no commit marker) but holds the whole weights in "
            f"{', '.join(w.name for w in weights)} (what DeepSpeed's zero_to_fp32 and "
            f"save_pretrained write). Nothing was loaded. Pass the file itself: "
            f"load_checkpoint('{weights[0]}', model, ...).")
    if problem is not None:
        raise CheckpointError(
            f"training-patches: cannot load the sharded checkpoint {path}: the folder {problem}. "
            f"Nothing was loaded. Resume from another checkpoint (CheckpointManager.resume('auto') "
            f"picks the newest complete one by itself); {path} was left as it is.")
    manifest, _ = read_folder_manifest(path)
    if manifest.nonfinite and not allow_nonfinite:
        raise CheckpointError(
            f"training-patches: cannot load {path}: it held NaN or Inf when it was saved "
            f"({', '.join(manifest.nonfinite[:5])}). Nothing was loaded. Resume from an "
            f"earlier checkpoint, or pass allow_nonfinite=True to load it anyway.")
    optimizers = _as_list(optimizer)
    schedulers = [s for s in _as_list(scheduler) if s is not None]
    rank, world = _dist.rank(), max(_dist.world_size(), 1)

    def read_rng() -> Any:
        states: list[Any] = [None] * manifest["world_size"]
        if rank < manifest["world_size"]:
            states[rank] = torch.load(path / _RNG_NAME.format(rank), weights_only=True)
        return state_for_rank(states, rank, world, str(path))

    def say(report: LoadReport) -> None:
        info("training-patches: %s (sharded, saved by %d rank(s), loaded on %d)",
             report.summary(), manifest["world_size"], world)

    def load_rank(gate: Callable[..., None]) -> Any:
        meta = torch.load(path / META_NAME, weights_only=True)
        saved_world = meta.get("data_world")
        source = Source(path=path, kind="folder", meta=meta,
                        has_optimizer=bool(manifest.data.get("has_optimizer")), read_rng=read_rng,
                        rng_in_file=True, model=ShardedModel(path, model, manifest, optimizers),
                        data_in_file=isinstance(saved_world, int),
                        read_data=lambda: [
                            torch.load(path / _DATA_NAME.format(r), weights_only=True)
                            if r == rank else None for r in range(saved_world)])
        plan = plan_state(source, policy=policy, restore_rng=restore_rng, optimizers=optimizers,
                          schedulers=schedulers, scaler=scaler, remap_optimizers=None,
                          loader=loader)
        return carry_out(plan, gate, say)

    return _on_every_rank(load_rank, gather=False)


__all__ = ["DCP_SUFFIX", "is_sharded_model", "save_sharded", "load_sharded",
           "ShardedModel",
           "check_folder", "complete_folders", "remove_folder",
           "read_folder_manifest"]
