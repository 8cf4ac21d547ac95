"""Vocabulary-aware checkpoints: load safely, grow the vocabulary, save atomically, resume.

Two public doors:

- :func:`load_checkpoint` reads a checkpoint with ``weights_only=True`` (a file whose
  unpickling would run code is refused before any of it runs), memory-mapped where the
  file allows it, validates it, grows the text vocabulary when the model's tokenizer grew
  (see :mod:`patches.vocab_resize`), refuses every other shape mismatch, and restores the
  optimizer, scheduler and scaler as one matched set under ``policy="remap"`` or starts
  all three fresh under ``policy="reset"``. It returns a :class:`LoadReport`.
- :class:`CheckpointManager` writes checkpoints atomically (temporary file in the same
  folder, fsync of the file and the folder, ``os.replace``), a small manifest last, a
  ``latest`` pointer, prunes only the checkpoints it wrote itself, and ``resume("auto")``
  finds the newest checkpoint whose manifest and file validate.

A checkpoint written by :class:`CheckpointManager` is a dict with ``model``,
``optimizer``, ``scheduler``, ``scaler``, ``step``, ``rng`` (torch, CUDA, numpy, python),
``training_patches`` (the runtime counters of :func:`patches._api.runtime_state`) and
``extra`` (whatever the caller passed, e.g. the data position). coqui Trainer checkpoints
(``model``/``optimizer`` lists/``scheduler`` lists/``scaler``/``step``/``epoch``) and bare
state dicts load through the same function.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickletools
import random
import re
import tempfile
import time
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ._log import info
from .vocab_resize import RowPlan, grow_bias, grow_moment, grow_rows, is_second_moment

logger = logging.getLogger("training_patches")

FORMAT = "training-patches-checkpoint/1"
MANIFEST_SUFFIX = ".manifest.json"
LATEST = "latest"
POLICIES = ("remap", "reset")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
_TMP_MARK = ".tp-tmp-"
# Parameter names (last two components) that carry the text vocabulary along dim 0.
VOCAB_SUFFIXES = ("text_embedding.weight", "text_head.weight", "text_head.bias")
# Prefixes a checkpoint's keys may carry relative to the model (DDP, torch.compile,
# coqui's GPTTrainer, Lightning).
_KNOWN_PREFIXES = ("module.", "_orig_mod.", "xtts.", "model.")


class CheckpointError(ValueError):
    """A checkpoint file cannot be used as it is; the message says why and what to do."""


class UnsafeCheckpointError(CheckpointError):
    """The file needs arbitrary code to unpickle; it was refused and none of it ran."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model/optimizer (other than a vocabulary growth)."""


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    ``step`` is the step to resume at: the checkpoint's step under ``remap``, 0 under
    ``reset``. ``resized`` maps each grown tensor to (old shape, new shape);
    ``kept_rows`` counts the trained rows copied unchanged into each of them.
    """

    path: str
    policy: str
    step: int
    epoch: int | None = None
    resized: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    kept_rows: dict[str, int] = field(default_factory=dict)
    base_vocab_size: int | None = None
    vocab_size: int | None = None
    start_row_moved: bool = False
    loaded: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    optimizer_moments_resized: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    rng_restored: bool = False
    runtime_state_restored: bool = False
    freeze: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    checkpoint: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def vocab_grew(self) -> bool:
        return bool(self.resized)

    def summary(self) -> str:
        """One paragraph for the log."""
        parts = [f"loaded {self.path} (step {self.step}, policy {self.policy})"]
        if self.resized:
            parts.append(
                f"vocabulary {self.base_vocab_size} -> {self.vocab_size} rows: " + ", ".join(
                    f"{name} {list(old)}->{list(new)} ({self.kept_rows[name]} trained rows kept)"
                    for name, (old, new) in self.resized.items()))
            if self.start_row_moved:
                parts.append("start-text token row moved to the new last row")
        if self.restored:
            parts.append("restored: " + ", ".join(self.restored))
        if self.reset:
            parts.append("fresh: " + ", ".join(self.reset))
        if self.optimizer_moments_resized:
            parts.append(f"optimizer moments resized for {len(self.optimizer_moments_resized)} "
                         "parameter(s) (new rows: first moment 0, second moment = old rows' mean)")
        if self.missing_keys or self.unexpected_keys:
            parts.append(f"not in checkpoint: {len(self.missing_keys)} key(s); "
                         f"not in model: {len(self.unexpected_keys)} key(s) (strict=False)")
        return "; ".join(parts)


# --------------------------------------------------------------------------- reading


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _step_from_name(path: Path) -> int | None:
    found = re.findall(r"(\d+)", path.stem)
    return int(found[-1]) if found else None


def manifest_path(checkpoint: str | os.PathLike[str]) -> Path:
    path = Path(checkpoint)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def check_file(path: str | os.PathLike[str], *, verify_hash: bool = True) -> str | None:
    """Why ``path`` is not a loadable checkpoint, or None when it looks complete.

    With a manifest beside it (written last by :class:`CheckpointManager`) the size and,
    with ``verify_hash``, the SHA-256 must match. Without one, the file must be a zip
    archive whose directory (written at the very end) is intact, or a legacy pickle.
    Nothing is unpickled here.
    """
    path = Path(path)
    if not path.is_file():
        return "does not exist"
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    man = manifest_path(path)
    if man.is_file():
        try:
            manifest = json.loads(man.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"has an unreadable manifest {man.name} ({exc})"
        if manifest.get("bytes") != size:
            return f"has {size} bytes but its manifest says {manifest.get('bytes')}"
        if verify_hash and manifest.get("sha256") and _sha256(path) != manifest["sha256"]:
            return "does not match the SHA-256 in its manifest (changed or damaged on disk)"
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                if not any(name.endswith("data.pkl") for name in archive.namelist()):
                    return "is a zip archive but not a torch checkpoint (no data.pkl inside)"
        except (zipfile.BadZipFile, OSError) as exc:
            return f"is a truncated or damaged torch zip archive ({exc})"
        return None
    if head[:1] == b"\x80":
        return None  # legacy (pre-1.6) torch.save format or a plain pickle: checked on load
    return f"is not a torch checkpoint (starts with bytes {head!r})"


def _candidates(folder: Path, exclude: Path | None = None) -> list[Path]:
    """Checkpoint-looking files in ``folder``, newest first (manifest step, name, mtime)."""
    found: list[tuple[float, float, Path]] = []
    if not folder.is_dir():
        return []
    for entry in folder.iterdir():
        if (not entry.is_file() or _TMP_MARK in entry.name
                or not entry.name.endswith(CHECKPOINT_SUFFIXES)
                or (exclude is not None and entry.resolve() == exclude.resolve())):
            continue
        step: float | None = None
        man = manifest_path(entry)
        if man.is_file():
            try:
                step = float(json.loads(man.read_text(encoding="utf-8"))["step"])
            except (OSError, ValueError, KeyError, TypeError):
                step = None
        if step is None:
            from_name = _step_from_name(entry)
            step = float(from_name) if from_name is not None else -1.0
        found.append((step, entry.stat().st_mtime, entry))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [entry for _, _, entry in found]


def newest_valid_beside(path: str | os.PathLike[str]) -> Path | None:
    """The newest other checkpoint in the same folder that passes :func:`check_file`."""
    path = Path(path)
    for candidate in _candidates(path.parent, exclude=path):
        if check_file(candidate) is None:
            return candidate
    return None


def _pickle_globals(data: bytes) -> list[str]:
    """The globals a pickle would import, read with pickletools (nothing is executed)."""
    names: list[str] = []
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(f"{strings[-2]}.{strings[-1]}")
        elif isinstance(arg, str):
            strings.append(arg)
    return names


def _what_to_do(path: Path) -> str:
    beside = newest_valid_beside(path)
    if beside is not None:
        return (f"The newest valid checkpoint beside it is {beside}: resume from that one "
                f"(CheckpointManager.resume('auto') picks it by itself). {path} was left as it is.")
    return (f"No other valid checkpoint was found in {path.parent}. {path} was left as it is; "
            "restore it from a copy or start from the base model.")


_BENIGN_GLOBALS = ("torch.", "collections.OrderedDict", "_codecs.encode", "builtins.set",
                   "builtins.frozenset", "numpy.")


def _foreign_globals(path: Path) -> list[str]:
    """Globals the file's pickle would import beyond tensors and containers (not run)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                data = archive.read(name)
        else:
            data = path.read_bytes()
        found = _pickle_globals(data)
    except Exception:  # noqa: BLE001 - not a readable pickle: reported as garbage instead
        return []
    return sorted({g for g in found if not g.startswith(_BENIGN_GLOBALS)})


def _diagnose(path: Path, exc: BaseException) -> CheckpointError:
    """Turn torch.load's failure into one paragraph naming the file and the way out."""
    text = str(exc)
    unsafe = _foreign_globals(path) if "Weights only load failed" in text else []
    if not unsafe and "Weights only load failed" in text:
        named = re.search(r"GLOBAL ([\w.]+)", text)
        unsafe = [named.group(1)] if named else []
    if unsafe:
        return UnsafeCheckpointError(
            f"training-patches: refused to load {path}: unpickling it would import and run "
            f"{', '.join(unsafe[:5])}, which a checkpoint of weights never needs. It was not "
            f"loaded and none of its code ran (torch.load with weights_only=True). If you made "
            f"this file yourself from trusted code, re-save only tensors and plain values "
            f"(model.state_dict(), optimizer.state_dict()). {_what_to_do(path)}")
    reason = check_file(path, verify_hash=False) or f"cannot be read by torch.load ({text[:200]})"
    if "Weights only load failed" in text and reason.startswith("cannot be read"):
        reason = "is not a checkpoint torch can read (random bytes or another format)"
    return CheckpointError(
        f"training-patches: cannot load the checkpoint {path}: the file {reason}. Expected a "
        f"complete file written by torch.save. A save interrupted half-way leaves such a file. "
        f"{_what_to_do(path)}")


def read_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``, memory-mapped when the file is a zip archive.

    Raises :class:`UnsafeCheckpointError` for a file that needs code to unpickle and
    :class:`CheckpointError` for a missing, empty, truncated or foreign file; both name
    the newest valid checkpoint beside it.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"training-patches: the checkpoint {path} does not exist. {_what_to_do(path)}")
    problem = check_file(path, verify_hash=False)
    if problem is not None and not problem.startswith("does not match"):
        raise CheckpointError(
            f"training-patches: cannot load the checkpoint {path}: the file {problem}. Expected a "
            f"complete file written by torch.save; a save interrupted half-way leaves such a "
            f"file. {_what_to_do(path)}")
    use_mmap = mmap and zipfile.is_zipfile(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise _diagnose(path, exc) from exc
    if not isinstance(loaded, Mapping):
        raise CheckpointError(
            f"training-patches: {path} holds a {type(loaded).__name__}, not a dict of states. "
            f"Expected a dict with 'model' (a state dict) or a state dict itself. "
            f"{_what_to_do(path)}")
    return dict(loaded)


def _model_state(ckpt: Mapping[str, Any], path: Path) -> dict[str, torch.Tensor]:
    for key in ("model", "state_dict", "model_state_dict", "module"):
        if isinstance(ckpt.get(key), Mapping):
            state = ckpt[key]
            break
    else:
        state = ckpt
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointError(
            f"training-patches: {path} has no model weights: expected a 'model' entry holding a "
            f"state dict (or a state dict itself); found the keys {sorted(ckpt)[:10]}. "
            f"{_what_to_do(path)}")
    return dict(tensors)


# --------------------------------------------------------------------------- matching


def _align_keys(ckpt_keys: Iterable[str], model_keys: Iterable[str]) -> dict[str, str]:
    """model key -> checkpoint key, allowing one prefix difference (``module.``, ``xtts.``)."""
    ckpt_keys = list(ckpt_keys)
    model_set = set(model_keys)
    transforms: list[tuple[str, str]] = [("", "")]
    firsts = {k.split(".", 1)[0] + "." for k in ckpt_keys if "." in k}
    firsts |= {".".join(k.split(".")[:2]) + "." for k in ckpt_keys if k.count(".") >= 2}
    model_firsts = {k.split(".", 1)[0] + "." for k in model_set if "." in k}
    transforms += [(p, "") for p in firsts | set(_KNOWN_PREFIXES)]
    transforms += [("", q) for q in model_firsts | set(_KNOWN_PREFIXES)]
    best: dict[str, str] = {}
    for strip, add in transforms:
        mapping: dict[str, str] = {}
        for key in ckpt_keys:
            if strip and not key.startswith(strip):
                continue
            target = add + key[len(strip):]
            if target in model_set:
                mapping[target] = key
        if len(mapping) > len(best):
            best = mapping
    return best


def _is_vocab_key(key: str, vocab_modules: Sequence[str]) -> bool:
    if any(key.endswith(suffix) for suffix in VOCAB_SUFFIXES):
        return True
    return any(key in (f"{name}.weight", f"{name}.bias") for name in vocab_modules)


def _owner(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
    except AttributeError:
        return None


def _start_row_last(model: torch.nn.Module, keys: Sequence[str], new_rows: int,
                    ckpt: Mapping[str, Any], setting: str | bool) -> bool:
    """Whether the vocabulary's last row is XTTS's start-text token (and so must move).

    ``"auto"``: yes when the module owning the text embedding is an XTTS GPT (it has a
    ``start_text_token``) and that token is the new vocabulary's last id; a coqui
    checkpoint's config then confirms it for the old vocabulary when it records it.
    """
    if isinstance(setting, bool):
        return setting
    for key in keys:
        # "gpt.text_embedding.weight" -> the module "gpt", which owns the start token
        owner_path = key.rsplit(".", 2)[0] if key.count(".") >= 2 else ""
        owner = _owner(model, owner_path + ".x") if owner_path else model
        start = getattr(owner, "start_text_token", None)
        if isinstance(start, int):
            if start != new_rows - 1:
                return False
            config = ckpt.get("config")
            args = config.get("model_args") if isinstance(config, Mapping) else None
            old_start = args.get("gpt_start_text_token") if isinstance(args, Mapping) else None
            old_rows = args.get("gpt_number_text_tokens") if isinstance(args, Mapping) else None
            if isinstance(old_start, int) and isinstance(old_rows, int):
                return old_start == old_rows - 1
            return True
    return False


@dataclass
class _Plan:
    aligned: dict[str, str]
    state: dict[str, torch.Tensor]
    resized: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    rows: RowPlan | None
    missing: list[str]
    unexpected: list[str]


def _plan_model(path: Path, ckpt: Mapping[str, Any], model: torch.nn.Module, *,
                strict: bool, vocab_modules: Sequence[str], start_token_row: str | bool,
                seed: int, key_filter: Callable[[str], bool] | None = None) -> _Plan:
    source = _model_state(ckpt, path)
    if key_filter is not None:
        source = {k: v for k, v in source.items() if key_filter(k)}
    target = model.state_dict()
    aligned = _align_keys(source, target)
    missing = sorted(set(target) - set(aligned))
    unexpected = sorted(set(source) - set(aligned.values()))
    vocab: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    wrong: list[str] = []
    for key, ckpt_key in aligned.items():
        old, new = tuple(source[ckpt_key].shape), tuple(target[key].shape)
        if old == new:
            continue
        if (_is_vocab_key(key, vocab_modules) and len(old) == len(new) and old[1:] == new[1:]
                and len(old) >= 1):
            vocab[key] = (old, new)
        else:
            wrong.append(f"{key}: checkpoint {list(old)}, model {list(new)}")
    if wrong:
        raise CheckpointMismatchError(
            f"training-patches: the checkpoint {path} does not fit this model: "
            f"{len(wrong)} tensor(s) have other shapes ({'; '.join(wrong[:6])}"
            f"{'; ...' if len(wrong) > 6 else ''}). Only a grown text vocabulary "
            f"(rows of {', '.join(VOCAB_SUFFIXES)}) is adapted; anything else means a different "
            f"model configuration. Nothing was loaded (no partial load). Build the model with the "
            f"configuration the checkpoint was trained with.")
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"training-patches: the checkpoint {path} does not fit this model: "
            f"{len(missing)} model key(s) are not in it ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}) and {len(unexpected)} of its keys are not in "
            f"the model ({', '.join(unexpected[:5])}{', ...' if len(unexpected) > 5 else ''}). "
            f"Nothing was loaded. Use the model class and configuration it was trained with, or "
            f"pass strict=False to load the keys that match.")
    rows: RowPlan | None = None
    state: dict[str, torch.Tensor] = {key: source[ck] for key, ck in aligned.items()}
    if vocab:
        olds = {old[0] for old, _ in vocab.values()}
        news = {new[0] for _, new in vocab.values()}
        if len(olds) != 1 or len(news) != 1:
            raise CheckpointMismatchError(
                f"training-patches: the vocabulary tensors of {path} disagree: "
                + "; ".join(f"{k}: checkpoint {list(o)}, model {list(n)}" for k, (o, n) in vocab.items())
                + ". Expected the text embedding and text head to have the same number of rows. "
                  "Nothing was loaded.")
        old_rows, new_rows = olds.pop(), news.pop()
        if new_rows < old_rows:
            raise CheckpointMismatchError(
                f"training-patches: the model's vocabulary ({new_rows} rows) is smaller than the "
                f"checkpoint's ({old_rows} rows, {path}). Shrinking would throw away trained rows, "
                f"so nothing was loaded. Use the tokenizer the checkpoint was trained with (or an "
                f"extension of it).")
        move = _start_row_last(model, list(vocab), new_rows, ckpt, start_token_row)
        rows = RowPlan(old_rows, new_rows, start_row_last=move)
        generator = torch.Generator().manual_seed(seed)
        for key in vocab:
            old = state[key]
            grown = grow_bias(old, rows, generator) if old.dim() == 1 else grow_rows(old, rows, generator)
            state[key] = grown.to(dtype=target[key].dtype)
    return _Plan(aligned, state, vocab, rows, missing, unexpected)


# --------------------------------------------------------------------------- optimizer


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _remap_optimizer_state(path: Path, saved: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                           names: dict[int, str], plan: _Plan) -> tuple[dict[str, Any], list[str]]:
    """The saved optimizer state with resized moments, validated against ``optimizer``."""
    groups = saved.get("param_groups")
    states = saved.get("state")
    if not isinstance(groups, list) or not isinstance(states, Mapping):
        raise CheckpointMismatchError(
            f"training-patches: the optimizer state in {path} is not an optimizer state_dict "
            f"(expected 'state' and 'param_groups'). Nothing was loaded. Use policy='reset' to "
            f"start the optimizer, scheduler and scaler fresh.")
    current = optimizer.param_groups
    saved_counts = [len(g.get("params", [])) for g in groups]
    current_counts = [len(g["params"]) for g in current]
    if saved_counts != current_counts:
        raise CheckpointMismatchError(
            f"training-patches: the optimizer state in {path} has parameter groups of sizes "
            f"{saved_counts}, this optimizer has {current_counts}: it was built for other "
            f"parameters (frozen modules or a different model). Nothing was loaded. Build the "
            f"optimizer the same way, or use policy='reset' to start the optimizer, scheduler and "
            f"scaler fresh.")
    new_state: dict[Any, Any] = {}
    resized_names: list[str] = []
    problems: list[str] = []
    for saved_group, group in zip(groups, current):
        for index, param in zip(saved_group["params"], group["params"]):
            entry = states.get(index)
            if entry is None:
                continue
            name = names.get(id(param), f"parameter #{index}")
            grown = plan.resized.get(name)
            fixed: dict[str, Any] = {}
            for skey, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    fixed[skey] = value
                elif tuple(value.shape) == tuple(param.shape):
                    fixed[skey] = value
                elif grown is not None and tuple(value.shape) == grown[0] and plan.rows is not None:
                    fixed[skey] = grow_moment(value, plan.rows,
                                              second_moment=is_second_moment(skey)).to(value.dtype)
                    if name not in resized_names:
                        resized_names.append(name)
                else:
                    problems.append(f"{name}.{skey}: saved {list(value.shape)}, "
                                    f"parameter {list(param.shape)}")
            new_state[index] = fixed
    if problems:
        raise CheckpointMismatchError(
            f"training-patches: the optimizer state in {path} does not fit the parameters: "
            f"{'; '.join(problems[:6])}. torch would accept it and fail later, at step(). "
            f"Nothing was loaded. Use policy='reset' to start the optimizer, scheduler and scaler "
            f"fresh.")
    return {"state": new_state, "param_groups": groups}, resized_names


def _detach_from_file(state: Mapping[Any, Any]) -> None:
    """Rewrite memory-mapped optimizer tensors in place, bit for bit.

    They stay in the checkpoint's private mapping, but each page becomes the process's
    own copy: a later in-place rewrite of that file cannot change or fault them, and the
    memory is counted once (no second copy as ``clone()`` would make).
    """
    for entry in state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.numel() > 0 and value.device.type == "cpu":
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


def _restart_scaler(scaler: Any) -> None:
    if not getattr(scaler, "_enabled", False):
        return
    scaler.load_state_dict({
        "scale": float(scaler._init_scale), "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor, "growth_interval": scaler._growth_interval,
        "_growth_tracker": 0})


# --------------------------------------------------------------------------- rng


def capture_rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and python RNG states in types ``weights_only`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": _to_plain(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the library
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _to_plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Undo :func:`capture_rng_state` (parts that are absent are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        random.setstate(_to_tuple(state["python"]))
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state((saved["kind"], saved["keys"].numpy().astype("uint32"),
                             saved["pos"], saved["has_gauss"], saved["cached"]))


# --------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    *,
    policy: str = "remap",
    freeze: bool = True,
    strict: bool = True,
    restore_rng: bool | None = None,
    vocab_modules: Sequence[str] = (),
    start_token_row: str | bool = "auto",
    mmap: bool = True,
    seed: int = 0,
    key_filter: Callable[[str], bool] | None = None,
) -> LoadReport:
    """Load ``path`` into ``model`` (and the optimizer, scheduler, scaler) safely.

    Args:
        path: a checkpoint written by :class:`CheckpointManager`, the coqui Trainer, or
            ``torch.save(model.state_dict())``.
        model: the model to fill; its text vocabulary may be larger than the checkpoint's.
        optimizer, scheduler, scaler: one object or a list of them (coqui keeps lists).
        policy: ``"remap"`` keeps the optimizer state (moments of grown parameters are
            grown), the scheduler and the scaler; ``"reset"`` starts all three fresh, the
            scheduler at step 0 with its warmup, and resumes at step 0. Never a mix.
        freeze: after a vocabulary growth, freeze the base rows (``patches.vocab_freeze``).
        strict: refuse keys present on one side only (shape mismatches are always refused).
        restore_rng: restore the saved RNG states (default: yes under ``remap``).
        vocab_modules: names of further modules whose rows are the vocabulary.
        start_token_row: ``"auto"`` (XTTS: move the last row when it is the start token),
            True or False.
        mmap: memory-map the file instead of reading it into memory.
        seed: seed of the noise of new rows (the result is reproducible).
        key_filter: keep only the checkpoint's model keys for which it returns True
            (e.g. drop the DVAE of an XTTS GPTTrainer checkpoint).

    Raises:
        UnsafeCheckpointError, CheckpointError, CheckpointMismatchError: before anything
        in the model or optimizer was changed.
    """
    if policy not in POLICIES:
        raise ValueError(f"load_checkpoint: policy must be one of {POLICIES}, got {policy!r}")
    path = Path(path)
    ckpt = read_checkpoint(path, mmap=mmap)
    plan = _plan_model(path, ckpt, model, strict=strict, vocab_modules=vocab_modules,
                       start_token_row=start_token_row, seed=seed, key_filter=key_filter)
    optimizers = _as_list(optimizer)
    schedulers = [s for s in _as_list(scheduler) if s is not None]
    saved_opts = _as_list(ckpt.get("optimizer"))
    saved_scheds = _as_list(ckpt.get("scheduler"))
    saved_scaler = ckpt.get("scaler")
    step = int(ckpt.get("step", 0) or 0)
    report = LoadReport(path=str(path), policy=policy, step=step,
                        epoch=ckpt.get("epoch") if isinstance(ckpt.get("epoch"), int) else None,
                        extra=dict(ckpt.get("extra") or {}), checkpoint=ckpt)

    # Decide everything before changing anything: a refusal leaves the user's objects as they were.
    effective = policy
    remapped: list[dict[str, Any]] = []
    if policy == "remap" and optimizers:
        if not saved_opts:
            effective = "reset"  # nothing to keep: the matched set starts fresh together
            info("training-patches: %s has no optimizer state; optimizer, scheduler and scaler "
                 "start fresh together", path)
        elif len(saved_opts) != len(optimizers):
            raise CheckpointMismatchError(
                f"training-patches: {path} holds the state of {len(saved_opts)} optimizer(s), "
                f"{len(optimizers)} were given. Nothing was loaded. Pass the same optimizers, or "
                f"use policy='reset' to start the optimizer, scheduler and scaler fresh.")
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            for saved, opt in zip(saved_opts, optimizers):
                state, resized = _remap_optimizer_state(path, saved, opt, names, plan)
                remapped.append(state)
                report.optimizer_moments_resized += [r for r in resized
                                                     if r not in report.optimizer_moments_resized]
    if effective == "remap" and schedulers and saved_scheds and len(saved_scheds) < len(schedulers):
        raise CheckpointMismatchError(
            f"training-patches: {path} holds {len(saved_scheds)} scheduler state(s), "
            f"{len(schedulers)} schedulers were given. Nothing was loaded. Use policy='reset'.")

    # Apply.
    missing, unexpected = model.load_state_dict(plan.state, strict=False)
    report.missing_keys = sorted(set(missing) | set(plan.missing))
    report.unexpected_keys = list(plan.unexpected)
    report.loaded.append("model")
    if plan.rows is not None:
        report.resized = dict(plan.resized)
        report.kept_rows = {key: plan.rows.base_rows + int(plan.rows.start_row_last)
                            for key in plan.resized}
        report.base_vocab_size, report.vocab_size = plan.rows.old_rows, plan.rows.new_rows
        report.start_row_moved = plan.rows.start_row_last
    if effective == "remap":
        for state, opt in zip(remapped, optimizers):
            opt.load_state_dict(state)
            _detach_from_file(opt.state)
        if optimizers:
            report.restored.append("optimizer")
        if schedulers and saved_scheds:
            for state, sched in zip(saved_scheds, schedulers):
                sched.load_state_dict(state)
            report.restored.append("scheduler")
        elif schedulers:
            report.reset.append("scheduler (not in the checkpoint)")
        if scaler is not None and getattr(scaler, "_enabled", True):
            if saved_scaler:
                scaler.load_state_dict(saved_scaler)
                report.restored.append("scaler")
            else:
                report.reset.append("scaler (not in the checkpoint)")
    else:
        for opt in optimizers:
            opt.state = defaultdict(dict)
            for group in opt.param_groups:
                if "initial_lr" in group:
                    group["lr"] = group["initial_lr"]
        for sched in schedulers:
            _restart_scheduler(sched)
        if scaler is not None:
            _restart_scaler(scaler)
        report.reset += [name for name, objs in
                         (("optimizer", optimizers), ("scheduler", schedulers),
                          ("scaler", [scaler] if scaler is not None else [])) if objs]
        report.step = 0
    report.policy = effective if policy == "remap" else policy
    if restore_rng is None:
        restore_rng = effective == "remap"
    if restore_rng and isinstance(ckpt.get("rng"), Mapping):
        restore_rng_state(ckpt["rng"])
        report.rng_restored = True
    ours = ckpt.get("training_patches")
    if effective == "remap" and isinstance(ours, Mapping) and isinstance(ours.get("runtime"), Mapping):
        from . import _api

        _api.load_runtime_state(dict(ours["runtime"]))
        report.runtime_state_restored = True
    if plan.rows is not None and freeze:
        report.freeze = _enable_freeze(model, plan, vocab_modules)
    info("training-patches: %s", report.summary())
    return report


def _enable_freeze(model: torch.nn.Module, plan: _Plan, vocab_modules: Sequence[str]) -> Any:
    """Freeze the base rows of the grown vocabulary (lazy: vocab_freeze may be absent)."""
    try:
        from . import vocab_freeze
    except ImportError:
        logger.warning(
            "training-patches: the vocabulary grew from %d to %d rows but patches.vocab_freeze is "
            "not available, so the base rows are not frozen.", plan.rows.old_rows, plan.rows.new_rows)
        return None
    modules = sorted({key.rsplit(".", 1)[0] for key in plan.resized})
    return vocab_freeze.freeze_base_vocab(model, plan.rows.old_rows, modules=modules,
                                          start_row_last=plan.rows.start_row_last)


# --------------------------------------------------------------------------- writing


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; os.replace is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Any) -> Path:
    """Write ``path`` through ``write(file)`` so that it is either complete or absent.

    A temporary file in the same folder is written, flushed and fsynced, renamed over
    ``path`` with ``os.replace`` and the folder is fsynced; on any error the temporary
    file is removed and ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The pid in the name tells a stale temporary file (its writer was killed) from one
    # being written right now by another process: see CheckpointManager._sweep_temp.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_TMP_MARK}{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """``torch.save`` that never leaves a torn file at ``path`` (see :func:`atomic_write`)."""
    return atomic_write(path, lambda handle: torch.save(obj, handle, **kwargs))


def _atomic_text(path: Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def _vocab_size(state: Mapping[str, torch.Tensor]) -> int | None:
    for key, value in state.items():
        if key.endswith("text_embedding.weight"):
            return int(value.shape[0])
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointManager:
    """Atomic, self-describing checkpoints in ``output_dir``, and the newest valid one back.

    Files: ``ckpt_<step>.pt``, its manifest ``ckpt_<step>.pt.manifest.json`` (written
    last: a checkpoint without one is incomplete) and ``latest`` (the newest name).
    ``keep`` newest complete checkpoints are kept; only files this class wrote (with
    its manifest, named by its pattern) are ever pruned; ``keep=None`` prunes nothing.
    """

    PATTERN = re.compile(r"^ckpt_(\d+)\.pt$")

    def __init__(self, output_dir: str | os.PathLike[str], keep: int | None = 3,
                 prefix: str = "ckpt") -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointManager: keep must be at least 1 or None, got {keep}")
        self.output_dir = Path(output_dir)
        self.keep = keep
        self.prefix = prefix
        self.pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)\.pt$")

    def path_for(self, step: int) -> Path:
        return self.output_dir / f"{self.prefix}_{step:09d}.pt"

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None,
             scheduler: Any = None, scaler: Any = None, **extra: Any) -> Path:
        """Write the checkpoint of ``step``; returns its path once it is complete.

        ``extra`` (e.g. ``epoch=``, ``batch_in_epoch=``, the data position) must be
        tensors or plain values; it comes back as ``LoadReport.extra``.
        """
        from . import __version__, _api

        model_state = model.state_dict()
        payload = {
            "format": FORMAT,
            "step": int(step),
            "model": model_state,
            "optimizer": [o.state_dict() for o in _as_list(optimizer)] or None,
            "scheduler": [s.state_dict() for s in _as_list(scheduler) if s is not None] or None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": capture_rng_state(),
            "training_patches": {"version": __version__, "runtime": _api.runtime_state()},
            "extra": extra,
        }
        if isinstance(extra.get("epoch"), int):
            payload["epoch"] = extra["epoch"]
        path = self.path_for(step)
        self._sweep_temp()
        atomic_torch_save(payload, path)
        manifest = {
            "format": FORMAT,
            "written_by": f"training-patches {__version__} CheckpointManager",
            "file": path.name,
            "step": int(step),
            "bytes": path.stat().st_size,
            "sha256": _sha256(path),
            "vocab_size": _vocab_size(model_state),
            "param_shapes": {k: list(v.shape) for k, v in model_state.items()},
            "amp": bool(scaler is not None and getattr(scaler, "_enabled", False)),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _atomic_text(manifest_path(path), json.dumps(manifest, indent=1))
        _atomic_text(self.output_dir / LATEST, path.name + "\n")
        info("training-patches: checkpoint step %d written to %s", step, path)
        self._prune()
        return path

    def _sweep_temp(self) -> None:
        """Remove temporary files of this manager's saves whose writer is dead (killed).

        Only names this class makes (``.<prefix>_<step>.pt<mark><pid>-...``) are touched;
        a live writer's file (its pid still runs) is left alone.
        """
        if not self.output_dir.is_dir():
            return
        mark = re.compile(rf"^\.{re.escape(self.prefix)}_\d+\.pt(?:{re.escape(MANIFEST_SUFFIX)})?"
                          rf"{re.escape(_TMP_MARK)}(\d+)-")
        for entry in self.output_dir.iterdir():
            match = mark.match(entry.name)
            if match is None:
                continue
            pid = int(match.group(1))
            if pid != os.getpid() and _pid_alive(pid):
                continue
            entry.unlink(missing_ok=True)
            logger.debug("training-patches: removed %s, left by an interrupted save", entry.name)

    def _own(self) -> list[tuple[int, Path]]:
        """(step, path) of complete checkpoints this class wrote, oldest first."""
        owned: list[tuple[int, Path]] = []
        if not self.output_dir.is_dir():
            return owned
        for entry in self.output_dir.iterdir():
            match = self.pattern.match(entry.name)
            man = manifest_path(entry)
            if match is None or not man.is_file():
                continue
            try:
                manifest = json.loads(man.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if manifest.get("format") == FORMAT and manifest.get("file") == entry.name:
                owned.append((int(manifest["step"]), entry))
        return sorted(owned)

    def _prune(self) -> None:
        if self.keep is None:
            return
        owned = self._own()
        for step, path in owned[: max(len(owned) - self.keep, 0)]:
            # Manifest first: an interrupted prune leaves an incomplete checkpoint, never a
            # manifest that vouches for a missing file.
            manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            logger.debug("training-patches: pruned checkpoint step %d (%s)", step, path)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints written by this manager, oldest first (not hash-checked)."""
        return [path for _, path in self._own()]

    def resume(self, which: str | int | os.PathLike[str] = "auto", *,
               verify_hash: bool = True) -> Path | None:
        """The checkpoint to resume from, or None when there is none yet.

        ``"auto"``: the newest checkpoint in ``output_dir`` whose manifest and file
        validate; torn or damaged ones are passed over with a warning (and left on disk).
        A step number or a path: that checkpoint, which must validate.
        """
        if which != "auto":
            path = self.path_for(which) if isinstance(which, int) else Path(which)
            problem = check_file(path, verify_hash=verify_hash)
            if problem is not None:
                raise CheckpointError(
                    f"training-patches: cannot resume from {path}: the file {problem}. "
                    f"{_what_to_do(path)}")
            return path
        skipped: list[str] = []
        for candidate in _candidates(self.output_dir):
            has_manifest = manifest_path(candidate).is_file()
            problem = check_file(candidate, verify_hash=verify_hash)
            if problem is None and not has_manifest and self.pattern.match(candidate.name):
                problem = "has no manifest (its save was interrupted before completing)"
            if problem is None:
                if skipped:
                    logger.warning(
                        "training-patches: resuming from %s; passed over newer file(s) that are "
                        "not complete checkpoints (left on disk): %s", candidate, "; ".join(skipped))
                return candidate
            skipped.append(f"{candidate.name} {problem}")
        if skipped:
            logger.warning("training-patches: no valid checkpoint in %s to resume from: %s",
                           self.output_dir, "; ".join(skipped))
        return None


# The generic ``checkpoint`` patch: the loader and the manager above are its API; its sites
# come from the integrations (the coqui Trainer's restore/save/continue, XTTS's
# gpt_checkpoint/xtts_checkpoint).
from ._registry import PatchSpec, register  # noqa: E402

SPEC = register(PatchSpec(
    name="checkpoint",
    describe=lambda o: (f"vocabulary-aware restore (policy {o.resume_policy}), atomic saves, "
                        f"continue from the newest valid checkpoint"),
))

__all__ = [
    "load_checkpoint", "LoadReport", "CheckpointManager", "CheckpointError",
    "UnsafeCheckpointError", "CheckpointMismatchError", "read_checkpoint", "check_file",
    "newest_valid_beside", "atomic_write", "atomic_torch_save", "capture_rng_state",
    "restore_rng_state",
]
