"""The optimizer, scheduler and scaler as one matched set. For the plan (pure): the saved
optimizer state validated and remapped onto a grown vocabulary (moments grown, see
:mod:`patches.vocab_resize`), the scheduler's and scaler's states checked. For the apply
step: snapshot and restore of an optimizer, and the restart of all three together."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from .. import vocab_resize
from .reading import nonfinite_flags
from .errors import CheckpointError, CheckpointMismatchError
from .plan import ModelPlan


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _not_a_state(path: Path, what: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"training-patches: the optimizer state in {path} is not an optimizer state_dict "
        f"({what}; expected 'state' and 'param_groups' as torch writes them). Nothing was "
        f"loaded. Use policy='reset' to start the optimizer, scheduler and scaler fresh.")


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_meta and bool(torch.isfinite(value).all())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_group(path: Path, index: int, saved: Mapping[Any, Any],
                 group: Mapping[str, Any]) -> None:
    """The saved hyperparameters have the types of this optimizer's (finite numbers where it
    has numbers): torch would accept anything and fail later, at step()."""
    for key, current in group.items():
        if key in ("params", "param_names", "initial_lr") or key not in saved:
            continue
        value = saved[key]
        if _fits(current, value, (int, float, torch.Tensor), (tuple, list)) is False:
            raise _not_a_state(path, f"group {index} has {key}={str(value)[:40]!r} where this "
                                     f"optimizer has {current!r}")


def _fits(current: Any, value: Any, numbers: tuple[type, ...],
          sequences: tuple[type, ...]) -> bool | None:
    """Whether the saved ``value`` has the type of ``current`` (finite numbers where it has
    numbers, as many of them in a sequence); None: a type not compared."""
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, numbers):
        return _is_number(value)
    if isinstance(current, sequences):
        return (isinstance(value, sequences) and len(value) == len(current)
                and all(_is_number(v) for v in value))
    return None


# What a parameter group holds besides its hyperparameters.
_GROUP_BOOKKEEPING = frozenset({"params", "param_names", "initial_lr"})
# Flags torch added to its optimizers over its versions: a state saved before one existed
# lacks it and torch fills in the default, so its absence says nothing about the class.
_OPTIMIZER_VERSION_FLAGS = frozenset({"foreach", "maximize", "capturable", "differentiable",
                                      "fused", "decoupled_weight_decay"})
# A scheduler's private attributes (``_step_count``, ...) change with torch's versions, and
# "verbose" was an argument of every scheduler until torch removed it: neither tells classes
# apart. Its public ones (``gamma``, ``milestones``, ``lr_lambdas``, ``T_max``, ...) do.
_SCHEDULER_VERSION_KEYS = frozenset({"verbose"})


def class_names(objects: list[Any]) -> list[str]:
    """``module.QualName`` of each object: what :class:`CheckpointManager` records beside
    the optimizer and scheduler states, for :func:`check_kinds` to compare at load."""
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in objects]


def _recorded_class(meta: Mapping[str, Any], part: str, index: int) -> str | None:
    ours = meta.get("training_patches")
    classes = ours.get("classes") if isinstance(ours, Mapping) else None
    names = classes.get(part) if isinstance(classes, Mapping) else None
    if isinstance(names, list) and index < len(names) and isinstance(names[index], str):
        return names[index]
    return None


def _other_kind(path: Path, part: str, obj: Any, found: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"training-patches: the {part} state in {path} was saved from another kind of {part} "
        f"than this {type(obj).__name__}: {found}. torch would load it anyway and then step "
        f"with another algorithm's settings (or fail at step()). Nothing was loaded. Build the "
        f"{part} the way the run that saved it did, or use policy='reset' to start the "
        f"optimizer, scheduler and scaler fresh.")


def _keys_found(saved: set[str], own: set[str], where: str, obj: Any) -> str:
    extra, missing = sorted(saved - own), sorted(own - saved)
    said = ([f"{', '.join(extra)}, which this {type(obj).__name__} has not"] if extra else []) + (
        [f"no {', '.join(missing)}"] if missing else [])
    return f"{where} has {' and '.join(said)}"


def check_kinds(path: Path, meta: Mapping[str, Any], optimizers: list[Any], saved_opts: list[Any],
                schedulers: list[Any], saved_scheds: list[Any]) -> None:
    """:class:`CheckpointMismatchError` unless each saved optimizer and scheduler state
    comes from the class that is to take it (the class recorded with it, else the names of
    its settings): torch would load an SGD state into AdamW and step with it."""
    for index, opt in enumerate(optimizers):
        # the recorded class is checked even where the states travel apart (a DCP folder's
        # moments are in its shards, its classes in meta.pt)
        recorded = _recorded_class(meta, "optimizer", index)
        if recorded is not None and recorded != class_names([opt])[0]:
            raise _other_kind(path, "optimizer", opt, f"it was recorded as a {recorded}")
        saved = saved_opts[index] if index < len(saved_opts) else None
        groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
        for number, (group, current) in enumerate(zip(groups if isinstance(groups, list)
                                                      else [], opt.param_groups)):
            if not isinstance(group, Mapping):
                continue  # not a state_dict at all: _remap_optimizer_state says so
            ignored = _GROUP_BOOKKEEPING | _OPTIMIZER_VERSION_FLAGS
            keys = {str(k) for k in group} - ignored
            own = set(current) - ignored
            if keys != own:
                raise _other_kind(path, "optimizer", opt,
                                  _keys_found(keys, own, f"its parameter group {number}", opt))
            # Adam and AdamW share every key; this flag is what tells them apart.
            flag = "decoupled_weight_decay"
            if flag in group and flag in current and bool(group[flag]) != bool(current[flag]):
                raise _other_kind(path, "optimizer", opt,
                                  f"its parameter group {number} has {flag}={group[flag]!r}, "
                                  f"this {type(opt).__name__} has {current[flag]!r}")
    for index, (saved, sched) in enumerate(zip(saved_scheds, schedulers)):
        recorded = _recorded_class(meta, "scheduler", index)
        if recorded is not None and recorded != class_names([sched])[0]:
            raise _other_kind(path, "scheduler", sched, f"it was recorded as a {recorded}")
        if not isinstance(saved, Mapping) or not hasattr(sched, "state_dict"):
            continue  # not a state_dict: _check_plain_state says so
        keys = {str(k) for k in saved if not str(k).startswith("_")} - _SCHEDULER_VERSION_KEYS
        own = {k for k in sched.state_dict() if not k.startswith("_")} - _SCHEDULER_VERSION_KEYS
        if keys != own:
            raise _other_kind(path, "scheduler", sched, _keys_found(keys, own, "it", sched))


def _remap_optimizer_state(path: Path, saved: Any, optimizer: torch.optim.Optimizer,
                           names: dict[int, str], plan: ModelPlan, *, allow_nonfinite: bool = False,
                           ) -> tuple[dict[str, Any], list[str]]:
    """The saved optimizer state with resized moments, validated against ``optimizer``
    (structure, hyperparameters' types, every moment's shape and data, finite values)."""
    if not isinstance(saved, Mapping):
        raise _not_a_state(path, f"found a {type(saved).__name__}")
    groups = saved.get("param_groups")
    states = saved.get("state")
    if not isinstance(groups, list) or not isinstance(states, Mapping):
        raise _not_a_state(path, "'state' or 'param_groups' is missing")
    for group in groups:
        if (not isinstance(group, Mapping) or not isinstance(group.get("params"), list)
                or not all(isinstance(i, int) and not isinstance(i, bool)
                           for i in group["params"])):
            raise _not_a_state(path, "a parameter group without a list of parameter ids")
    ids = [i for group in groups for i in group["params"]]
    if len(set(ids)) != len(ids):
        raise _not_a_state(path, "a parameter id appears twice")
    stray = [key for key in states if key not in set(ids)]
    if stray or not all(isinstance(entry, Mapping) for entry in states.values()):
        raise _not_a_state(path, f"state for unknown parameter ids {stray[:5]}" if stray
                           else "a parameter's state is not a dict")
    current = optimizer.param_groups
    saved_counts = [len(g["params"]) for g in groups]
    current_counts = [len(g["params"]) for g in current]
    if saved_counts != current_counts:
        raise CheckpointMismatchError(
            f"training-patches: the optimizer state in {path} has parameter groups of sizes "
            f"{saved_counts}, this optimizer has {current_counts}: it was built for other "
            f"parameters (frozen modules or a different model). Nothing was loaded. Build the "
            f"optimizer the same way, or use policy='reset' to start the optimizer, scheduler and "
            f"scaler fresh.")
    for index, (saved_group, group) in enumerate(zip(groups, current)):
        _check_group(path, index, saved_group, group)
    new_state: dict[Any, Any] = {}
    resized_names: list[str] = []
    problems: list[str] = []
    empty: list[str] = []
    checked: list[tuple[str, torch.Tensor, bool]] = []
    for saved_group, group in zip(groups, current):
        for index, param in zip(saved_group["params"], group["params"]):
            entry = states.get(index)
            if entry is None:
                continue
            name = names.get(id(param), f"parameter #{index}")
            grown = plan.resized.get(name)
            fixed: dict[str, Any] = {}
            for skey, value in entry.items():
                if isinstance(value, torch.Tensor) and (value.is_meta
                                                        or value.layout != torch.strided):
                    empty.append(f"{name}.{skey}")
                    continue
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    fixed[skey] = value
                elif tuple(value.shape) == tuple(param.shape):
                    fixed[skey] = value
                elif grown is not None and tuple(value.shape) == grown[0] and plan.rows is not None:
                    # through the module: tests swap grow_moment to show its effect
                    fixed[skey] = vocab_resize.grow_moment(
                        value, plan.rows,
                        second_moment=vocab_resize.is_second_moment(skey)).to(value.dtype)
                    if name not in resized_names:
                        resized_names.append(name)
                else:
                    problems.append(f"{name}.{skey}: saved {list(value.shape)}, "
                                    f"parameter {list(param.shape)}")
                if isinstance(fixed.get(skey), torch.Tensor):
                    checked.append((f"{name}.{skey}", fixed[skey], False))
                elif isinstance(value, float) and not math.isfinite(value):
                    problems.append(f"{name}.{skey}: {value}")
            new_state[index] = fixed
    if empty:
        raise CheckpointError(
            f"training-patches: refused to load {path}: {len(empty)} optimizer tensor(s) hold "
            f"no data ({', '.join(empty[:5])}): saved from the 'meta' device or in a layout "
            f"torch cannot restore. Nothing was loaded. Use policy='reset' to start the "
            f"optimizer, scheduler and scaler fresh.")
    if problems:
        raise CheckpointMismatchError(
            f"training-patches: the optimizer state in {path} does not fit the parameters: "
            f"{'; '.join(problems[:6])}. torch would accept it and fail later, at step(). "
            f"Nothing was loaded. Use policy='reset' to start the optimizer, scheduler and scaler "
            f"fresh.")
    if not allow_nonfinite:
        bad = nonfinite_flags(checked)
        if bad:
            raise CheckpointError(
                f"training-patches: refused to load {path}: the optimizer state holds NaN or Inf "
                f"in {len(bad)} tensor(s) ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}). "
                f"Expected finite moments; every step from them would be NaN. Nothing was "
                f"loaded. Use policy='reset' to keep the weights and start the optimizer, "
                f"scheduler and scaler fresh, or pass allow_nonfinite=True to load it anyway.")
    return {"state": new_state, "param_groups": groups}, resized_names


def _check_plain_state(path: Path, what: str, saved: Any, obj: Any) -> None:
    """A scheduler's or scaler's saved state is a dict whose values have the types of the
    object's own attributes (finite numbers where it has numbers)."""
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        raise CheckpointMismatchError(
            f"training-patches: the {what} state in {path} is a {type(saved).__name__}, not a "
            f"state_dict. Nothing was loaded. Use policy='reset' to start the optimizer, "
            f"scheduler and scaler fresh.")
    own = dict(getattr(obj, "__dict__", {}))
    if what == "scaler" and hasattr(obj, "state_dict") and scaler_enabled(obj):
        own = {**own, **dict(obj.state_dict())}
    for key, value in saved.items():
        current = own.get(key)
        ok = _fits(current, value, (int, float), (list,) if key in ("base_lrs", "_last_lr")
                   else ())
        if ok is None:
            continue
        if not ok or (key == "scale" and float(value) <= 0):
            raise CheckpointMismatchError(
                f"training-patches: the {what} state in {path} has {key}={str(value)[:40]!r} "
                f"where the {what} has {current!r}. Nothing was loaded. Use policy='reset' to "
                f"start the optimizer, scheduler and scaler fresh.")


def snapshot_optimizer(optimizer: torch.optim.Optimizer) -> tuple[Any, Any, list[dict[str, Any]]]:
    """What :func:`restore_optimizer` needs to undo a ``load_state_dict`` or a reset: the
    state and group objects (load_state_dict replaces them) and each group's values."""
    groups = optimizer.param_groups
    return optimizer.state, groups, [dict(group) for group in groups]


def restore_optimizer(optimizer: torch.optim.Optimizer,
                      snapshot: tuple[Any, Any, list[dict[str, Any]]]) -> None:
    state, groups, values = snapshot
    for group, saved in zip(groups, values):
        group.clear()
        group.update(saved)
    optimizer.state = state
    optimizer.param_groups = groups


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` privately (torch.load's
    ``mmap=True``), read from ``/proc/self/maps``, matched by path or by device and inode;
    [] where there is no such file (not Linux)."""
    try:
        st = os.stat(path)
        real = os.path.realpath(path)
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[1][3:] != "p":
            continue
        major, minor = (int(part, 16) for part in fields[3].split(":"))
        same_inode = (int(fields[4]) == st.st_ino
                      and (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)))
        if same_inode or (len(fields) == 6 and fields[5] == real):
            low, high = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def _release(start: int, end: int) -> None:
    """Drop this process's view of the mapped pages wholly inside [start, end): a private
    file mapping reads them from the file again if touched, so nothing is lost."""
    page = mmap.PAGESIZE
    low, high = -(-start // page) * page, end // page * page
    if high > low:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), mmap.MADV_DONTNEED)


# Bytes of a mapped tensor copied before their pages are dropped: the load's peak resident
# memory stays the file's size and this much.
_SLICE_BYTES = 16 << 20


def _copied_out(value: torch.Tensor) -> torch.Tensor:
    """A copy of the mapped ``value`` in memory of its own, its mapped pages dropped slice by
    slice as they are copied."""
    if not value.is_contiguous():
        copy = value.clone()
        _release(value.data_ptr(), value.data_ptr() + value.numel() * value.element_size())
        return copy
    copy = torch.empty_like(value, memory_format=torch.contiguous_format)
    source, target = value.view(-1), copy.view(-1)
    step = max(1, _SLICE_BYTES // value.element_size())
    for first in range(0, source.numel(), step):
        piece = source[first:first + step]
        target[first:first + step].copy_(piece)
        _release(piece.data_ptr(), piece.data_ptr() + piece.numel() * piece.element_size())
    return copy


def _detach_from_file(state: Mapping[Any, Any], path: Path | None = None) -> None:
    """Give the CPU tensors of a loaded optimizer state memory of their own, not the
    checkpoint's memory-mapped file (a later rewrite of that file cannot change them). On
    Linux each is copied and its mapped pages dropped as they are (peak about 1.0x the file;
    3x faster than a copy-on-write per page, issue 41); elsewhere rewritten in place."""
    ranges = (_file_mappings(path) if path is not None and sys.platform.startswith("linux")
              and hasattr(mmap, "MADV_DONTNEED") else [])
    for entry in state.values():
        for key, value in list(entry.items()):
            if not isinstance(value, torch.Tensor) or value.numel() == 0 \
                    or value.device.type != "cpu":
                continue
            storage = value.untyped_storage()
            start = storage.data_ptr()
            end = start + storage.nbytes()
            if any(low <= start and end <= high for low, high in ranges):
                entry[key] = _copied_out(value)
            elif not ranges and value.is_contiguous():
                value.view(-1).view(torch.uint8).bitwise_or_(0)


def _restart_scheduler(scheduler: Any) -> None:
    """Back to step 0 of its schedule (warmup included), as a freshly built scheduler."""
    optimizer = getattr(scheduler, "optimizer", None)
    base = getattr(scheduler, "base_lrs", None)
    if optimizer is not None and base is not None:
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr
    if hasattr(scheduler, "last_epoch"):
        scheduler.last_epoch = -1
    if hasattr(scheduler, "_initial_step"):
        scheduler._initial_step()
    elif hasattr(scheduler, "step"):
        scheduler.step()


def scaler_enabled(scaler: Any) -> bool:
    """Whether ``scaler`` scales (and so has a state to save, restore and compare): the one
    answer every checkpoint module asks for. None: no. A torch GradScaler (any of the
    patches' too): its ``is_enabled()``. Any other object with a ``state_dict``: yes."""
    if scaler is None:
        return False
    is_enabled = getattr(scaler, "is_enabled", None)
    if callable(is_enabled):
        return bool(is_enabled())
    return bool(getattr(scaler, "_enabled", hasattr(scaler, "state_dict")))


def _restart_scaler(scaler: Any) -> None:
    if not scaler_enabled(scaler) or not hasattr(scaler, "_init_scale"):
        return
    scaler.load_state_dict({
        "scale": float(scaler._init_scale), "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor, "growth_interval": scaler._growth_interval,
        "_growth_tracker": 0})
