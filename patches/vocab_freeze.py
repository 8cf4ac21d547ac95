"""``vocab_freeze``: keep the base rows of an extended text vocabulary bit-identical.

:func:`freeze_base_vocab` (a :class:`VocabFreeze` handle) zeroes the base rows' gradients
and keeps the optimizer off those rows (a row-wise optimizer steps a view of the trainable
rows: nothing stored, nothing copied), or copies the rows back after every optimizer step
(any other optimizer); :func:`frozen_rows`
and :func:`new_rows` (from :mod:`patches.vocab_rows`, with the row layouts the integrations
register: XTTS's ``[START]`` kept last) say which rows are base.
``TRAINING_PATCHES_BASE_VOCAB`` turns it on without code changes. Its step work is three
stages of the step pipeline (:mod:`patches._step`); the gradient zeroing is a gradient hook
instead, because the user's clip reads the norm before the optimizer step. Also public:
:class:`VocabFreezeError`, :func:`freeze_of`, :func:`live_freezes`, ``SPEC``.

Design: docs/design/vocab_freeze.md
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from . import _dist, _options, _run, _step
from ._log import info, logger
from ._options import INT64_MAX, Option, positive_int
from ._registry import PatchSpec, register
from .vocab_rows import (PLAIN, RowLayout, VocabFreezeError, describe_rows, frozen_rows, new_rows,
                         find_vocab_modules, owner_models, owner_paths, row_layout)

TAG = "[Extended Vocab Fix]"


# -- finding the text embedding ------------------------------------------------


@dataclass
class _Entry:
    """One frozen tensor: ``module.<name>`` and the stored copy of its base rows."""

    path: str
    module: nn.Module
    name: str
    param: nn.Parameter
    stored: torch.Tensor | None = None
    grad_hook: Any = None
    # The frozen rows as rows of this rank's tensor (of its local shard for a DTensor).
    local_rows: tuple[range, ...] = ()


def _local_rows(path: str, param: torch.Tensor, rows: Sequence[range]) -> tuple[range, ...]:
    """``rows`` (global row indices) as rows of ``param``'s local tensor on this rank: a
    DTensor's shard holds the global rows ``offset ..`` of dim 0 (FSDP2's layout); only
    ``Shard``/``Replicate`` placements are mapped, anything else is a VocabFreezeError."""
    if not _dist.is_dtensor(param):
        return tuple(rows)
    from torch.distributed.tensor import Replicate, Shard  # lazy: heavy (~0.4 s at top)
    from torch.distributed.tensor._utils import (  # lazy: heavy
        compute_local_shape_and_global_offset)
    placements = tuple(param.placements)  # type: ignore[attr-defined]
    local = _dist.local(param)
    unknown = [p for p in placements if type(p) not in (Shard, Replicate)]
    shape, offset = ((), ()) if unknown else compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, placements)  # type: ignore[attr-defined]
    if unknown or tuple(shape) != tuple(local.shape):
        raise VocabFreezeError(
            f"training-patches vocab_freeze: {path} is a DTensor with placements "
            f"{placements} on {param.device_mesh} "  # type: ignore[attr-defined]
            f"(local shard {tuple(local.shape)} of {tuple(param.shape)}), a layout whose rows "
            f"this rank cannot map to global row indices, so its base rows cannot be kept "
            f"exact. Expected Shard(dim) or "
            f"Replicate() placements (FSDP2 fully_shard shards dim 0: Shard(0)). Freeze "
            f"before applying this layout, shard the vocabulary tensors with fully_shard "
            f"(Shard(0)) or leave them replicated, or unset TRAINING_PATCHES_BASE_VOCAB.")
    start, stop = offset[0], offset[0] + shape[0]
    return tuple(range(max(r.start, start) - start, min(r.stop, stop) - start)
                 for r in rows if max(r.start, start) < min(r.stop, stop))


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP / DataParallel / accelerate wrappers keep the real model in .module
    while isinstance(getattr(model, "module", None), nn.Module) and not hasattr(
            model, "text_embedding"):
        model = model.module
    return model


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _vocab_targets(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], nn.Module] | None:
    """(the vocabulary modules with their paths, their owner): ``text_embedding``/``text_head``
    at the registered owner paths, else the registered finders' (Hugging Face, F5-TTS)."""
    for path in owner_paths():
        try:
            owner = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        if isinstance(getattr(owner, "text_embedding", None), nn.Module) and isinstance(
                getattr(owner, "text_head", None), nn.Module):
            return [(_join(path, "text_embedding"), owner.text_embedding),
                    (_join(path, "text_head"), owner.text_head)], owner
    return find_vocab_modules(model)


def _resolve_modules(model: nn.Module, modules: Iterable[nn.Module | str]
                     ) -> list[tuple[str, nn.Module]]:
    names = {id(mod): name for name, mod in model.named_modules()}
    found = []
    for item in modules:
        if isinstance(item, str):
            try:
                found.append((item, model.get_submodule(item)))
            except AttributeError:
                raise VocabFreezeError(
                    f"training-patches vocab_freeze: modules= names {item!r}, which is not a "
                    f"submodule of {type(model).__name__}. Expected dotted paths such as "
                    f"'gpt.text_embedding' (see model.named_modules()) or the modules "
                    f"themselves.") from None
        elif isinstance(item, nn.Module):
            found.append((names.get(id(item), type(item).__name__), item))
        else:
            raise VocabFreezeError(
                f"training-patches vocab_freeze: modules= holds {item!r}; expected nn.Module "
                f"objects or their dotted paths in the model.")
    return found


def _parent(model: nn.Module, path: str) -> nn.Module | None:
    """The module holding the tensor or module at dotted ``path`` (None: no such module)."""
    head = path.rpartition(".")[0]
    try:
        return model.get_submodule(head) if head else model
    except AttributeError:
        return None


def _entries(model: nn.Module, modules: Iterable[nn.Module | str] | None
             ) -> tuple[list[_Entry], nn.Module | None]:
    """The tensors to freeze and the module owning them (for the start-token rule)."""
    if modules is None:
        hit = _vocab_targets(model)
        if hit is None:
            paths = [f".{path}" for path in owner_paths() if path]
            where = (", ".join(paths[:-1]) + f" and {paths[-1]}" if len(paths) > 1
                     else "".join(paths))
            models = f" ({', '.join(owner_models())})" if owner_models() else ""
            raise VocabFreezeError(
                f"training-patches vocab_freeze: no text embedding found in "
                f"{type(model).__name__}. Looked for text_embedding and text_head on the model "
                f"and on {where}{models}, for a Hugging Face model's "
                f"get_input_embeddings() and for F5-TTS's text_embed. Pass the modules "
                f"explicitly, e.g. "
                f"freeze_base_vocab(model, 12000, modules=['decoder.embed', 'decoder.lm_head']).")
        targets, owner = hit
    else:
        targets = _resolve_modules(model, modules)
        if not targets:
            raise VocabFreezeError("training-patches vocab_freeze: modules= is empty; name the "
                                   "text embedding and the text head to freeze.")
        owner = _parent(model, targets[0][0])
    entries = []
    seen: set[int] = set()  # a tied head shares the embedding's tensor: frozen (and counted) once
    for path, mod in targets:
        for name in ("weight", "bias"):
            param = mod._parameters.get(name)
            if isinstance(param, nn.Parameter) and param.dim() >= 1 and id(param) not in seen:
                seen.add(id(param))
                entries.append(_Entry(_join(path, name), mod, name, param))
    if not entries:
        raise VocabFreezeError(
            f"training-patches vocab_freeze: {', '.join(p for p, _ in targets)} hold no weight "
            f"or bias parameter; expected nn.Embedding / nn.Linear modules of the vocabulary.")
    rows = {entry.path: entry.param.shape[0] for entry in entries}
    if len(set(rows.values())) != 1:
        raise VocabFreezeError(
            f"training-patches vocab_freeze: the vocabulary tensors disagree on the number of "
            f"rows: {rows}. Expected the text embedding and the text head to have one row per "
            f"token; name only those in modules=.")
    return entries, owner


# -- the freeze ------------------------------------------------------------------

_lock = threading.RLock()
# id(parameter) -> the freeze holding it (a WeakKeyDictionary would compare tensors with ==;
# a live freeze holds its parameters, so their ids are not reused while an entry exists).
_by_param: weakref.WeakValueDictionary[int, VocabFreeze] = weakref.WeakValueDictionary()


def freeze_of(param: torch.Tensor) -> VocabFreeze | None:
    """The active freeze of ``param``'s rows, if any."""
    handle = _by_param.get(id(param))
    return handle if handle is not None and not handle.released else None


def _storage(param: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """(data pointer, shape) of ``param``'s local tensor, to know one tensor under two names
    or Parameter objects; None where there is no memory (meta)."""
    local = _dist.local(param)
    ptr = local.data_ptr() if local.device.type != "meta" else 0
    return (ptr, tuple(local.shape)) if ptr else None


def _freezes_of(params: Iterable[torch.Tensor]) -> list[VocabFreeze]:
    """The live freezes holding any of ``params``, by identity or by memory."""
    found: dict[int, VocabFreeze] = {}
    storages = {key for key in map(_storage, params) if key is not None}
    for param in params:
        handle = freeze_of(param)
        if handle is not None:
            found[id(handle)] = handle
    for handle in live_freezes():
        if any(_storage(entry.param) in storages for entry in handle._entries):
            found[id(handle)] = handle
    return list(found.values())


# Every live freeze, held weakly. The step pipeline's freeze stages serve them all, set with
# the first freeze and kept (clearing them could happen inside torch's loop over the hooks).
_live: weakref.WeakSet[VocabFreeze] = weakref.WeakSet()
_stages_set = False


def _prepare_stage(optimizer: torch.optim.Optimizer, step: _step.Step) -> None:
    _put_back(optimizer)  # a step that raised left the row views in its groups
    for handle in list(_live):
        handle._follow_swaps()
    _hook_optimizer(optimizer)


def _keep_stage(optimizer: torch.optim.Optimizer, step: _step.Step) -> None:
    """After the update: the views back in the groups, the rows of an optimizer that was
    not kept off them restored, and the step counted toward ``until_step`` if taken."""
    _put_back(optimizer)
    held, step.held = step.held, set()
    holders = [handle for handle in live_freezes() if handle._holds(optimizer)]
    if holders:
        _step.context().mark("keep")
    for handle in holders:
        if id(handle) not in held:
            handle._restore()
        handle._count(step.decision)


def _set_stages() -> None:
    # Never called from inside an optimizer step: torch iterates its hook dicts there.
    global _stages_set
    with _lock:
        if not _stages_set:
            _step.set_stage("prepare_frozen", _prepare_stage)
            _step.set_stage("hold_frozen", _hold_stage)
            _step.set_stage("keep_frozen", _keep_stage)
            _stages_set = True


# -- keeping the optimizer off the frozen rows (docs/design/vocab_freeze.md) -------------
# These classes (exactly) update an element from its own gradient and state alone, so a step
# of a view of the trainable rows is bit for bit the whole tensor's step on those rows.
_ROW_WISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adamax, torch.optim.RMSprop)


@dataclass
class _Swap:
    """One frozen tensor replaced, for one step, by a view of its trainable rows."""

    group: dict[str, Any]
    index: int
    param: nn.Parameter
    view: nn.Parameter
    rows: range


# A step's swaps live in the optimizer's patches._step.Step; its state_dict hooks put them back:
_hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
    weakref.WeakKeyDictionary())


def _hook_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Once per optimizer that steps frozen tensors: its ``state_dict`` and
    ``load_state_dict`` see the frozen tensors, never a step's row views."""
    if optimizer in _hooked or not any(h._holds(optimizer) for h in live_freezes()):
        return
    _hooked[optimizer] = [optimizer.register_state_dict_pre_hook(_put_back),
                          optimizer.register_load_state_dict_pre_hook(
                              lambda opt, state: _put_back(opt))]


def _hold_stage(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any,
                step: _step.Step) -> None:
    """After the decision, before the update: a row-wise optimizer steps a view of the
    trainable rows (nothing copied); any other keeps a copy to restore after the step. The
    prepare stage put back any views a raising step left, in this same pipeline run."""
    decision = step.decision
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    # a closure's backward would make new gradients after the views took theirs, unless the
    # NaN guard ran it already (the decision comes after it)
    row_wise = type(optimizer) in _ROW_WISE and (closure is None or decision is not None)
    held: set[int] = set()
    holders = [handle for handle in live_freezes() if handle._holds(optimizer)]
    if holders:
        _step.context().mark("hold")
    for handle in holders:
        if row_wise and handle._hold(optimizer):
            held.add(id(handle))
        else:
            handle._keep_copy()  # restored after this step: the copy must exist
    step.held = held


def _put_back(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The frozen tensors back in the optimizer's groups, the views' state written into
    theirs (one-time copies only where the step created state: its first step)."""
    step = _step.step_of(optimizer)
    swaps, step.swaps = step.swaps, []
    if not swaps:
        return
    state = optimizer.state
    for swap in swaps:
        if swap.index < len(swap.group["params"]) and \
                swap.group["params"][swap.index] is swap.view:
            swap.group["params"][swap.index] = swap.param
        view_state = state.pop(swap.view, None)
        if not view_state:
            continue
        full = state[swap.param]
        for key, value in view_state.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(swap.view.shape):
                whole = full.get(key)
                if isinstance(whole, torch.Tensor) and whole.shape == swap.param.shape:
                    if value.data_ptr() == whole[swap.rows.start].data_ptr():
                        continue  # a view of the tensor's own state: updated in place
                else:  # created by this step (the first): the frozen rows' state is zero
                    whole = full[key] = torch.zeros(swap.param.shape, dtype=value.dtype,
                                                    device=value.device)
                with torch.no_grad():
                    whole[swap.rows.start:swap.rows.stop].copy_(value)
            else:
                full[key] = value


def live_freezes() -> list[VocabFreeze]:
    """The freezes in effect now (for tests and reports)."""
    return [handle for handle in list(_live) if not handle.released]


class VocabFreeze:
    """A handle on the freeze of one model's base vocabulary rows.

    ``remove()`` takes every hook out (the rows train from the next step on);
    ``refresh()`` takes the current base rows as the ones to keep (done by itself
    after a ``load_state_dict`` of the modules); ``steps`` counts the optimizer steps
    taken under the freeze; ``released`` tells whether it is over.
    """

    def __init__(self, entries: list[_Entry], vocab_size: int, base_vocab_size: int,
                 start_row_last: bool, until_step: int | None, root: nn.Module,
                 layout: RowLayout) -> None:
        self.layout = layout
        self._root = weakref.ref(root)
        self.vocab_size = vocab_size
        self.base_vocab_size = base_vocab_size
        self.start_row_last = start_row_last
        self.rows = frozen_rows(vocab_size, base_vocab_size, start_row_last=start_row_last)
        self.until_step = until_step
        self._steps = 0  # steps known on the host to be taken
        # fused steps whose skip flags stay on the device, and their sum (read only when
        # the count could reach until_step)
        self._device_steps = 0
        self._device_skips: torch.Tensor | None = None
        self._copy_dropped = False  # a held step dropped the stored copy (no longer needed)
        self.released = False
        self._entries = entries
        self._ids = {id(entry.param) for entry in entries}
        self._load_hooks: list[Any] = []
        self._holders: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]] = (
            weakref.WeakKeyDictionary())

    # -- state ---------------------------------------------------------------

    @property
    def paths(self) -> list[str]:
        """Dotted names of the frozen tensors."""
        return [entry.path for entry in self._entries]

    @property
    def new_rows(self) -> range:
        return new_rows(self.vocab_size, self.base_vocab_size, start_row_last=self.start_row_last)

    def frozen_values(self) -> dict[str, torch.Tensor]:
        """The base rows of each tensor (the values they are kept at)."""
        return {} if self.released else {e.path: self._kept(e) for e in self._entries}

    def kept_rows(self) -> list[tuple[nn.Parameter, list[tuple[range, torch.Tensor]]]]:
        """Each frozen tensor with this rank's rows of it and their kept values,
        ``(param, [(rows, values)])`` (for DeepSpeed's fp32 master partitions)."""
        return [(e.param, list(self._pieces(e, self._kept(e))))
                for e in (self._entries if not self.released else ())]

    def _kept(self, entry: _Entry) -> torch.Tensor:
        """The stored copy, or where held steps made it unneeded, the rows themselves."""
        return entry.stored if entry.stored is not None else self._base(entry)

    @staticmethod
    def _pieces(entry: _Entry, stored: torch.Tensor) -> Iterable[tuple[range, torch.Tensor]]:
        start = 0
        for r in entry.local_rows:
            yield r, stored[start:start + len(r)]
            start += len(r)

    def covers_same(self, other: VocabFreeze) -> bool:
        """True when ``other`` freezes the same tensors (by memory) at the same rows."""
        mine = {_storage(entry.param) for entry in self._entries}
        theirs = {_storage(entry.param) for entry in other._entries}
        return (None not in mine and mine == theirs and self.rows == other.rows
                and self.until_step == other.until_step and not self.released)

    def frozen_numel(self) -> int:
        """Frozen elements over all ranks (whole tensors, not this rank's shards)."""
        rows = sum(len(r) for r in self.rows)
        return 0 if self.released else sum(rows * math.prod(entry.param.shape[1:])
                                           for entry in self._entries)

    @staticmethod
    def _base(entry: _Entry) -> torch.Tensor:
        """A copy of the entry's frozen rows of this rank's tensor (its shard)."""
        tensor = _dist.local(entry.param.detach())
        parts = [tensor[r.start:r.stop] for r in entry.local_rows]
        return torch.cat(parts) if parts else tensor[:0].clone()

    def _store(self, entry: _Entry) -> None:
        """Map the frozen rows to this rank's tensor and keep a copy of them."""
        entry.local_rows = _local_rows(entry.path, entry.param, self.rows)
        entry.stored = self._base(entry)

    def refresh(self) -> None:
        """Store the current base rows (after a load, or to accept a deliberate edit)."""
        with torch.no_grad():
            for entry in self._entries:
                current = entry.module._parameters.get(entry.name)
                if current is not entry.param and isinstance(current, nn.Parameter):
                    self._rehook(entry, current)
                self._store(entry)
        self._copy_dropped = False

    # -- hooks ---------------------------------------------------------------

    def _hook(self, entry: _Entry) -> None:
        # torch keeps tensor hooks alive from C++, out of the garbage collector's sight: held
        # weakly (the modules' load-state-dict hooks keep the freeze as long as the model).
        ref = weakref.ref(self)

        def zero_base_rows(param: torch.Tensor) -> None:
            handle = ref()
            if handle is not None:
                handle._zero_grad_rows(param)
        entry.grad_hook = entry.param.register_post_accumulate_grad_hook(zero_base_rows)
        _by_param[id(entry.param)] = self

    def _unhook(self, entry: _Entry) -> None:
        if entry.grad_hook is not None:
            entry.grad_hook.remove()
            entry.grad_hook = None
        if _by_param.get(id(entry.param)) is self:
            del _by_param[id(entry.param)]

    def _attach(self) -> None:
        for entry in self._entries:
            self._hook(entry)
        owners = {id(entry.module): entry.module for entry in self._entries}
        self._load_hooks = [mod.register_load_state_dict_post_hook(self._after_load)
                            for mod in owners.values()]
        with _lock:
            _live.add(self)
        _set_stages()

    def _rehook(self, entry: _Entry, param: nn.Parameter) -> None:
        """The module got a new Parameter object (``load_state_dict(assign=True)``)."""
        self._unhook(entry)
        self._ids.discard(id(entry.param))
        entry.param = param
        self._ids.add(id(param))
        self._hook(entry)
        self._holders = weakref.WeakKeyDictionary()
        logger.debug("%s %s was replaced by a new parameter; the freeze follows it", TAG,
                     entry.path)

    def _zero_grad_rows(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None or grad.is_sparse:
            return  # sparse gradients: the restore after the step still keeps the rows exact
        entry = next((entry for entry in self._entries if entry.param is param), None)
        rows = entry.local_rows if entry is not None else self.rows
        grad = _dist.local(grad)  # a DTensor slice is a copy: zero the shard's own rows
        for r in rows:
            grad[r.start:r.stop].zero_()

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        # the coqui Trainer restores weights after the freeze: keep what was loaded
        self.refresh()
        logger.debug("%s stored base rows refreshed after load_state_dict", TAG)

    def _follow_swaps(self) -> None:
        """A trainer may swap in new embedding/head modules after the freeze (an extended
        vocabulary loaded by hand): follow the module at its path, before the step."""
        root = self._root()
        if root is None or self.released:
            return
        for entry in self._entries:
            current = _parent(root, entry.path)
            param = None if current is None else current._parameters.get(entry.name)
            if current is None or current is entry.module or not isinstance(param, nn.Parameter):
                continue
            entry.module = current
            self._rehook(entry, param)
            self._load_hooks.append(current.register_load_state_dict_post_hook(self._after_load))
            rows = param.shape[0]
            if rows != self.vocab_size:
                self.vocab_size = rows
                self.rows = frozen_rows(rows, self.base_vocab_size,
                                        start_row_last=self.start_row_last)
            logger.info("%s %s was replaced by a new module after the freeze; the freeze "
                        "follows it (%d rows, base rows %s frozen)", TAG,
                        entry.path.rpartition(".")[0], rows, describe_rows(self.rows))
            with torch.no_grad():
                self._store(entry)
                self._zero_grad_rows(param)  # this step's backward ran before the hook

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        size = sum(len(group["params"]) for group in optimizer.param_groups)
        cached = self._holders.get(optimizer)
        if cached is not None and cached[0] == size:
            return cached[1]
        held = any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])
        self._holders[optimizer] = (size, held)
        return held

    def _hold(self, optimizer: torch.optim.Optimizer) -> bool:
        """For this step, put a view of each frozen tensor's trainable rows in the
        optimizer's group in its place (see ``_ROW_WISE``). False, and nothing changed,
        where that cannot be exact: a DTensor, a sparse gradient, trainable rows that are
        not one block, a tensor the optimizer holds twice."""
        trained = self.new_rows
        if not len(trained):
            return False  # every row frozen: nothing to step
        where: dict[int, tuple[dict[str, Any], int]] = {}
        for group in optimizer.param_groups:
            for index, p in enumerate(group["params"]):
                if id(p) in self._ids:
                    if id(p) in where:
                        return False
                    where[id(p)] = (group, index)
        swaps = []
        for entry in self._entries:
            param = entry.param
            if id(param) not in where:
                continue
            grad = param.grad
            if _dist.is_dtensor(param) or (grad is not None and grad.is_sparse) or \
                    entry.local_rows != tuple(self.rows) or param.shape[0] != self.vocab_size:
                return False
            group, index = where[id(param)]
            view = nn.Parameter(param.detach()[trained.start:trained.stop])
            if grad is not None:
                view.grad = grad[trained.start:trained.stop]
            swaps.append(_Swap(group, index, param, view, trained))
        state = optimizer.state
        for swap in swaps:
            full = state.get(swap.param)
            if full:
                state[swap.view] = {
                    key: (value[trained.start:trained.stop]
                          if isinstance(value, torch.Tensor) and value.shape == swap.param.shape
                          else value) for key, value in full.items()}
            swap.group["params"][swap.index] = swap.view
        _step.step_of(optimizer).swaps.extend(swaps)
        if self._entries and all(entry.stored is not None for entry in self._entries):
            # Nothing moves the frozen rows now: the copy of them is no longer needed.
            self._copy_dropped = True
            for entry in self._entries:
                entry.stored = None
        return True

    def _keep_copy(self) -> None:
        """The stored copy of the base rows, taken now if an earlier held step dropped it
        (the rows are still exactly the kept ones: only held steps ran since)."""
        if self._copy_dropped:
            with torch.no_grad():
                for entry in self._entries:
                    if entry.stored is None:
                        entry.stored = self._base(entry)
            self._copy_dropped = False

    def _restore(self) -> None:
        """Copy the stored base rows back (an optimizer that was not kept off them)."""
        self._keep_copy()
        with torch.no_grad():
            for entry in self._entries:
                stored = entry.stored
                param = _dist.local(entry.param)  # the shard this rank restores in place
                if stored is None:
                    continue
                if stored.device != param.device or stored.dtype != param.dtype:
                    # the model moved (.cuda(), .half()) after the freeze: move the copy once
                    stored = entry.stored = stored.to(param.device, param.dtype)
                for r, values in self._pieces(entry, stored):
                    param[r.start:r.stop].copy_(values)

    def _count(self, skipped: Any) -> None:
        """Count a step toward ``until_step`` if it was taken. ``skipped``: the step's
        decision (None: no one decided, taken; a device flag, a fused step's: kept on the
        device and read only when the count could reach ``until_step``)."""
        if skipped is None or skipped is False:
            self._steps += 1
        elif isinstance(skipped, torch.Tensor):
            flag = skipped.detach().reshape(-1)[:1].to(torch.int64)
            self._device_skips = flag if self._device_skips is None else self._device_skips + flag
            self._device_steps += 1
        if self.until_step is None or self._steps + self._device_steps < self.until_step:
            return
        if self.steps >= self.until_step:
            self.remove()
            info("%s Released the base vocabulary after %d optimizer steps: all %d rows train "
                 "from now on", TAG, self.steps, self.vocab_size)

    @property
    def steps(self) -> int:
        """Optimizer steps taken under the freeze (a skipped step does not count)."""
        if self._device_skips is not None:
            skips, self._device_skips = self._device_skips, None
            self._steps += self._device_steps - int(skips.item())
            self._device_steps = 0
        return self._steps

    def remove(self) -> None:
        """Stop freezing: take every hook out and drop the stored rows."""
        with _lock:
            _live.discard(self)
            for hook in self._load_hooks:
                hook.remove()
            self._load_hooks = []
            for entry in self._entries:
                self._unhook(entry)
                entry.stored = None
            self.released = True

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.steps} steps"
        return (f"VocabFreeze(base={self.base_vocab_size}, vocab={self.vocab_size}, "
                f"rows={describe_rows(self.rows)}, {state})")


def freeze_base_vocab(model: nn.Module, base_vocab_size: int, *,
                      modules: Sequence[nn.Module | str] | None = None,
                      until_step: int | None = None,
                      start_row_last: bool | None = None,
                      leading_rows: int = 0) -> VocabFreeze:
    """Keep rows of the base vocabulary bit-identical while the new rows train.

    Args:
        model: an XTTS ``GPTTrainer`` or ``GPT``, an IndexTTS-style ``UnifiedVoice``
            (``text_embedding``/``text_head``), a DDP wrapper of one, a Hugging Face or
            F5-TTS model, or any model whose vocabulary modules are named in ``modules``.
        base_vocab_size: tokens of the original (pretrained) tokenizer, e.g. 12000 (an
            IndexTTS ``UnifiedVoice``'s extra slot row after them is kept last and frozen).
        modules: the embedding/head modules (objects or dotted paths) whose ``weight`` and
            ``bias`` are frozen row-wise. Default: ``text_embedding`` and ``text_head``.
        until_step: release the freeze after this many optimizer steps (new rows first,
            then everything); skipped steps do not count.
        start_row_last: whether the base's start-text row sits in the last row (XTTS);
            ``None`` decides with the owner's layout (:func:`patches.vocab_rows.row_layout`).
        leading_rows: rows before token 0 that are no token, frozen with the base (``1``
            for F5-TTS's ``text_embed``, token ``i`` at row ``i + 1``).

    Returns the :class:`VocabFreeze` handle; ``handle.remove()`` ends the freeze.
    Freezing rows already frozen replaces the earlier freeze.
    """
    if isinstance(base_vocab_size, bool) or not isinstance(base_vocab_size, int):
        raise VocabFreezeError(
            f"training-patches vocab_freeze: base_vocab_size is {base_vocab_size!r}; expected a "
            f"whole number of base tokens such as 12000.")
    if until_step is not None and (isinstance(until_step, bool) or int(until_step) < 1):
        raise VocabFreezeError(
            f"training-patches vocab_freeze: until_step is {until_step!r}; expected a whole "
            f"number of optimizer steps of at least 1, or None to freeze for the whole run.")
    model = _unwrap(model)
    entries, owner = _entries(model, modules)
    vocab_size = entries[0].param.shape[0]
    if isinstance(leading_rows, bool) or not isinstance(leading_rows, int) or leading_rows < 0:
        raise VocabFreezeError(
            f"training-patches vocab_freeze: leading_rows is {leading_rows!r}; expected the "
            f"whole number of rows before token 0 that are no token (0, or 1 for F5-TTS).")
    layout = row_layout(owner, vocab_size) if modules is None else PLAIN
    if start_row_last is not None:
        layout = RowLayout("explicit", last_row_kept=bool(start_row_last))
    if leading_rows:
        layout = dataclasses.replace(layout, name="explicit", leading_rows=leading_rows)
    base_vocab_size = layout.base_rows(base_vocab_size)
    with _lock:
        previous = _freezes_of([entry.param for entry in entries])
        handle = VocabFreeze(entries, vocab_size, base_vocab_size, layout.last_row_kept,
                             None if until_step is None else int(until_step), model, layout)
        # the same tensors and rows frozen again (XTTS's loader, then its GPTTrainer hook)
        same = len(previous) == 1 and previous[0].covers_same(handle)
        for earlier in previous:
            logger.debug("%s replacing the earlier freeze of %s", TAG, ", ".join(earlier.paths))
            earlier.remove()
        handle.refresh()
        handle._attach()
    if same:
        logger.debug("%s %s: the same tensors and rows were frozen already (as %s); the freeze "
                     "is renewed, nothing else changes", TAG, ", ".join(handle.paths),
                     ", ".join(previous[0].paths))
    else:
        _log_start(handle, model, previous)
    return handle


def _percent(part: int, whole: int) -> str:
    """``part`` of ``whole`` as a percentage that is never rounded to a false 0.0%."""
    share = 100.0 * part / max(whole, 1)
    return f"{share:.1f}%" if share >= 0.1 or share == 0 else f"{share:.2g}%"


def _log_start(handle: VocabFreeze, model: nn.Module,
               replaced: Sequence[VocabFreeze] = ()) -> None:
    vocab, base = handle.vocab_size, handle.base_vocab_size
    for earlier in replaced:
        info("%s Replacing the earlier freeze of %s (rows %s frozen)", TAG,
             ", ".join(earlier.paths), describe_rows(earlier.rows))
    if base == vocab:
        info("%s Vocabulary not extended (%d tokens = base size): all text rows frozen",
             TAG, vocab)
    else:
        info("%s Detected extended vocabulary: %d tokens", TAG, vocab)
    base_rows = describe_rows(handle.rows)
    lead = handle.layout.leading_rows
    if lead:
        base_rows += (f" (row 0 is the model's filler row, no token)" if lead == 1 else
                      f" (rows 0-{lead - 1} are no token)")
    if handle.layout.extra_rows:
        base_rows += f" (row {vocab - 1} is the model's extra slot, no token; kept last)"
    elif handle.start_row_last and base < vocab:
        base_rows += f" (row {vocab - 1} is the start-text token, kept last)"
    info("%s Base tokens: %s (frozen)", TAG, base_rows)
    if base < vocab:
        info("%s New tokens: %s (trainable)", TAG, describe_rows([handle.new_rows]))
    total = sum(p.numel() for p in model.parameters())
    frozen = handle.frozen_numel()
    frozen_rows_n = sum(len(r) for r in handle.rows)
    until = (f", released after {handle.until_step} optimizer steps"
             if handle.until_step is not None else "")
    info("%s Freezing %d of %d rows (%s; %d rows train, %s) of %s: %s parameters, %s of the "
         "model's %s; gradients zeroed, rows held out of torch's optimizers' steps (restored "
         "after the step of any other optimizer)%s", TAG,
         frozen_rows_n, vocab, _percent(frozen_rows_n, vocab), vocab - frozen_rows_n,
         _percent(vocab - frozen_rows_n, vocab), ", ".join(handle.paths), f"{frozen:,}",
         _percent(frozen, total), f"{total:,}", until)
    sharded = [entry for entry in handle._entries if _dist.is_dtensor(entry.param)]
    if sharded:
        info("%s Sharded tensors (%s): rank %d freezes and restores its own rows %s", TAG,
             ", ".join(f"{entry.path} {tuple(entry.param.placements)}"  # type: ignore[attr-defined]
                       for entry in sharded), _dist.rank(),
             "; ".join(f"{entry.path}: {describe_rows(entry.local_rows) or 'none'} (local)"
                       for entry in sharded))


# -- the patch: activation by TRAINING_PATCHES_BASE_VOCAB ---------------------------


def _describe_patch(opts: _options.Options) -> str:
    base = getattr(opts, "base_vocab", None)
    if not base:
        return "idle: set TRAINING_PATCHES_BASE_VOCAB to freeze the base text rows"
    return (f"waiting: at the first optimizer step, freeze the text rows of the first {base} "
            f"tokens of the model it trains (XTTS, IndexTTS UnifiedVoice, any with "
            f"text_embedding/text_head, Hugging Face models through get_input_embeddings; "
            f"gradients zeroed, rows held out of the optimizer's step or restored after it), or "
            f"warn that no such model was found")


# The paragraph of the "not applied" warning, for status(); None while there was none.
_not_applied: str | None = None


def _state() -> tuple[str, str] | None:
    """What the freeze has done so far, for :func:`patches.status`: ``("applied", "frozen N
    rows of M in ...")``, ``("waiting", ...)`` before the first optimizer step, or
    ``("not applied", why)``; None when nothing was asked (no BASE_VOCAB, no live freeze)."""
    live = live_freezes()
    if live:
        return "applied", "; ".join(
            f"frozen {sum(len(r) for r in h.rows)} rows of {h.vocab_size} in "
            f"{', '.join(h.paths)}" + ("" if h.until_step is None
                                       else f" (released after {h.until_step} steps)")
            for h in live)
    base = _options.current().base_vocab
    if not base:
        return None
    if _not_applied is not None:
        return "not applied", _not_applied
    return "waiting", (f"TRAINING_PATCHES_BASE_VOCAB={base}: the model is found at the first "
                       f"optimizer step")


def _embeddings_of(params: set[int]) -> list[str]:
    """``name (rows x dim)`` of every embedding, and of every Linear as wide as one (a
    head), in the outermost live modules that hold any of ``params``."""
    modules = list(_run.live_modules())
    holders = {id(m) for m in modules
               if any(id(p) in params for p in m.parameters(recurse=False))}
    roots = [m for m in modules if any(id(sub) in holders for sub in m.modules())]
    found: list[str] = []
    for root in _run.outermost(roots):
        embeddings = {m.num_embeddings for m in root.modules() if isinstance(m, nn.Embedding)}
        for name, module in root.named_modules():
            if isinstance(module, nn.Embedding):
                found.append(f"{name} ({module.num_embeddings} x {module.embedding_dim})")
            elif isinstance(module, nn.Linear) and module.out_features in embeddings:
                found.append(f"{name} (Linear {module.in_features} -> {module.out_features})")
    return found


_seen_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _discover(optimizer: torch.optim.Optimizer) -> None:
    """``TRAINING_PATCHES_BASE_VOCAB`` on any model: at each optimizer's first step, freeze
    the base rows of every model it trains that has a text embedding and head (XTTS,
    IndexTTS ``UnifiedVoice``, ...), unless they are frozen already. Every start and every
    resume builds a new optimizer, so the freeze comes back by itself. No such model and no
    freeze anywhere: a WARNING (an error under STRICT), never silence."""
    base = _options.current().base_vocab
    if not base or optimizer in _seen_optimizers:
        return
    _seen_optimizers.add(optimizer)
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    # the live modules holding any of params whose vocabulary a known layout finds (a plain
    # loop never names its model), the outermost of them
    found = [module for module in _run.live_modules()
             if (hit := _vocab_targets(module)) is not None
             and any(id(p) in params for p in hit[0][0][1].parameters())]
    for model in _run.outermost(found):
        hit = _vocab_targets(model)
        if hit is None or freeze_of(hit[0][0][1].weight) is not None:
            continue
        handle = freeze_base_vocab(model, base)
        with torch.no_grad():  # this step's backward ran before the freeze existed
            for entry in handle._entries:
                handle._zero_grad_rows(entry.param)
    _hook_optimizer(optimizer)  # this very step is held already
    if not live_freezes() and _not_applied is None:
        embeddings = _embeddings_of(params)
        names = [item.split(" (")[0] for item in embeddings][:2]
        not_applied(
            f"TRAINING_PATCHES_BASE_VOCAB={base} is set, but the model that "
            f"{type(optimizer).__name__} trains has no vocabulary layout the freeze knows "
            f"(text_embedding and text_head, as XTTS's GPT and IndexTTS's UnifiedVoice have, a "
            f"Hugging Face model's get_input_embeddings(), F5-TTS's text_embed): "
            f"NOTHING IS FROZEN, every base row trains. Its embeddings: "
            f"{', '.join(embeddings) or 'none found'}. Name them after building the model: "
            f"patches.advanced.freeze_base_vocab(model, {base}, modules={names or ['...']!r})")


def discover_in(model: nn.Module) -> VocabFreeze | None:
    """``TRAINING_PATCHES_BASE_VOCAB`` on ``model`` now (for a trainer whose optimizer
    holds copies of the weights, not the model's parameters, so the discovery at the
    optimizer's first step cannot see the model): its freeze, an existing one, or None
    when BASE_VOCAB is not set or the model has no known layout."""
    base = _options.current().base_vocab
    hit = _vocab_targets(model) if base else None
    if hit is None:
        return None
    return freeze_of(hit[0][0][1].weight) or freeze_base_vocab(model, base)


def not_applied(why: str) -> None:
    """A freeze asked for cannot be carried out where it is (said by an integration): a
    WARNING (an error under STRICT), and ``status("vocab_freeze")`` says ``not applied``."""
    global _not_applied
    _not_applied = why
    message = f"{TAG} {why}"
    if _options.current().strict:
        raise VocabFreezeError(message + " (TRAINING_PATCHES_STRICT=1 makes this an error)")
    logger.warning(message)


def _enable(options: Any) -> None:
    global _not_applied
    _not_applied = None
    _set_stages()  # before discovery: a freeze made inside a step changes no hook
    _step.set_stage("find_frozen", _discover)


def _disable() -> None:
    global _not_applied
    _not_applied = None
    _step.set_stage("find_frozen", None)


def _base_vocab(text: Any) -> int | None:
    """Rows of the original vocabulary to freeze; 0, empty or None leave it off."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "0", "off", "none")):
        return None
    if isinstance(text, (int, float)) and text == 0:
        return None
    return positive_int(text.strip() if isinstance(text, str) else text)


SPEC = register(PatchSpec(
    name="vocab_freeze",
    describe=_describe_patch,
    enable=_enable,
    disable=_disable,
    state=_state,
    options=(Option("base_vocab", _base_vocab, None,
                    "a whole number of base tokens, e.g. 12000 (0 or empty = off)",
                    "freeze the rows of the first N tokens of every model trained that has a "
                    "text embedding and head", shown_default="off", low=1, high=INT64_MAX,
                    bound_why="token ids are int64"),),
))

__all__ = ["freeze_base_vocab", "freeze_of", "frozen_rows", "new_rows",
           "VocabFreeze", "VocabFreezeError"]
