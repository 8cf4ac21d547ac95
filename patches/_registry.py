"""The single record of what training-patches has applied and what it replaced.

Every patch is a :class:`PatchSpec`: a name, a line for the banner, the attribute
sites it replaces and, for patches that are not attribute swaps (anomaly mode),
an ``enable``/``disable`` pair. ``apply``/``revert`` in :mod:`patches` are the only
doors; nothing else in the library writes to a third-party module.

How a site lands (the wrapt habit, see STYLE.md): a post-import hook is registered
for the site's module, so it runs now if the module is already imported and
otherwise once when it is. wrapt hooks cannot be unregistered, so each hook holds
the activation token it was made for and does nothing once that activation is
reverted: a patch reverted before its target is imported never lands.

Several patches may want one site (``autocast`` modernises the deprecated
``torch.cuda.amp.GradScaler``; ``grad_scaler`` makes it a SafeGradScaler;
``checkpoint`` and ``vocab_freeze`` both wrap ``GPTTrainer.__init__``). Each site
keeps a stack of layers ordered by priority; each layer's ``make`` receives the
layer below (the original at the bottom), so wrappers compose, and the top is
installed. Removing a layer rebuilds the stack above the original, which is kept
first-wins and restored by identity when the last layer goes.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import wrapt

logger = logging.getLogger("training_patches")

_MISSING = object()
# Sweeping rebinds copies of an original that other modules took with
# ``from x import name``; torch's own modules keep theirs (they define the names).
_SWEEP_SKIP_PREFIXES = ("torch", "patches", "wrapt")


@dataclass(frozen=True)
class Site:
    """One place where a name is bound: ``module.attr``.

    ``attr`` may be dotted, ``"Class.method"``: the last part is replaced on the object
    the rest names (a class), and the original is taken from that class's own
    ``__dict__`` (not ``getattr``, which would hand back a bound or inherited object).
    ``make(original)`` builds the replacement from the unpatched object. With
    ``sweep`` the replacement is also installed in every already-imported module
    (outside torch) that holds the original under the same name, and taken back
    out of them on revert.
    """

    module: str
    attr: str
    make: Callable[[Any], Any]
    sweep: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.attr)

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class PatchSpec:
    """What one patch changes. ``describe(options)`` gives its banner line."""

    name: str
    describe: Callable[[Any], str]
    sites: tuple[Site, ...] = ()
    default: bool = True
    priority: int = 0
    enable: Callable[[Any], None] | None = None
    disable: Callable[[], None] | None = None
    off_hint: str = ""


@dataclass
class _Layer:
    priority: int
    patch: str
    make: Callable[[Any], Any]
    replacement: Any = None


@dataclass
class _SiteState:
    original: Any
    layers: list[_Layer] = field(default_factory=list)

    def top(self) -> Any:
        return self.layers[-1].replacement if self.layers else self.original

    def rebuild(self) -> None:
        """Make every layer again over the one below it, bottom to top."""
        below = self.original
        for layer in self.layers:
            _replacements.pop(id(layer.replacement), None)
            layer.replacement = layer.make(below)
            _replacements[id(layer.replacement)] = (layer.replacement, self.original)
            below = layer.replacement


@dataclass
class _Activation:
    token: object
    landed: set[tuple[str, str]] = field(default_factory=set)
    pending: set[tuple[str, str]] = field(default_factory=set)


_lock = threading.RLock()
_specs: dict[str, PatchSpec] = {}
_active: dict[str, _Activation] = {}
_sites: dict[tuple[str, str], _SiteState] = {}
# id(replacement) -> (replacement, original): keeps the replacement alive so the id
# is never reused, and lets a copy of a replacement be traced back to the original.
_replacements: dict[int, tuple[Any, Any]] = {}


def register(spec: PatchSpec) -> PatchSpec:
    """Declare a patch (done once by each patch module when :mod:`patches` loads)."""
    with _lock:
        _specs[spec.name] = spec
    return spec


def specs() -> dict[str, PatchSpec]:
    return dict(_specs)


def is_enabled(name: str) -> bool:
    return name in _active


def _unpatched(value: Any) -> Any:
    """The object ``value`` would be without our patches.

    coqui-tts-trainer binds ``functools.partial(torch.GradScaler, device="cuda")``
    at import time: if torch was patched first, that partial wraps our class and
    its unpatched form is the same partial over the original.
    """
    entry = _replacements.get(id(value))
    if entry is not None and entry[0] is value:
        return entry[1]
    if isinstance(value, functools.partial):
        func = _unpatched(value.func)
        if func is not value.func:
            return functools.partial(func, *value.args, **value.keywords)
    return value


def _owner(site: Site, module: ModuleType) -> tuple[Any, str]:
    """The object that holds the site's name, and the name (``Class.method`` -> Class)."""
    *path, name = site.attr.split(".")
    owner: Any = module
    for part in path:
        owner = vars(owner).get(part, _MISSING) if owner is not _MISSING else _MISSING
    return owner, name


def _current(site: Site, module: ModuleType) -> Any:
    owner, name = _owner(site, module)
    return _MISSING if owner is _MISSING else vars(owner).get(name, _MISSING)


def _rebind(site: Site, module: ModuleType, old: Any, new: Any) -> None:
    """Install ``new`` at the site and, for sweeping sites, in every copy of ``old``."""
    owner, name = _owner(site, module)
    setattr(owner, name, new)
    if not site.sweep:
        return
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is module or mod_name.startswith(_SWEEP_SKIP_PREFIXES):
            continue
        namespace = getattr(mod, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(site.attr, _MISSING) is old:
            namespace[site.attr] = new
            logger.debug("rebound %s.%s (%s)", mod_name, site.attr, site)


def _land(spec: PatchSpec, token: object, site: Site, module: ModuleType) -> None:
    with _lock:
        activation = _active.get(spec.name)
        if activation is None or activation.token is not token:
            return  # reverted (or re-applied) since this hook was registered
        current = _current(site, module)
        if current is _MISSING:
            activation.pending.discard(site.key)
            logger.debug("%s: %s does not exist in this version; skipped", spec.name, site)
            return
        state = _sites.get(site.key)
        if state is None:
            state = _sites[site.key] = _SiteState(original=_unpatched(current))
        if any(layer.patch == spec.name for layer in state.layers):
            return
        state.layers.append(_Layer(spec.priority, spec.name, site.make))
        state.layers.sort(key=lambda layer: layer.priority)
        state.rebuild()
        _rebind(site, module, current, state.top())
        activation.pending.discard(site.key)
        activation.landed.add(site.key)


def _unland(spec: PatchSpec, site: Site) -> None:
    state = _sites.get(site.key)
    module = sys.modules.get(site.module)
    if state is None or module is None:
        return
    layer = next((lay for lay in state.layers if lay.patch == spec.name), None)
    if layer is None:
        return
    old_top = state.top()
    state.layers.remove(layer)
    _replacements.pop(id(layer.replacement), None)
    current = _current(site, module)
    if current is not old_top:
        logger.warning(
            "%s: %s was replaced by someone else after training-patches patched it; "
            "leaving their object in place", spec.name, site)
    else:
        state.rebuild()
        _rebind(site, module, old_top, state.top())
    if not state.layers:
        del _sites[site.key]


def enable(spec: PatchSpec, options: Any) -> bool:
    """Apply one patch; False if it was already applied (never wraps twice)."""
    with _lock:
        if spec.name in _active:
            return False
        token = object()
        activation = _active[spec.name] = _Activation(token=token)
        activation.pending.update(site.key for site in spec.sites)
        if spec.enable is not None:
            spec.enable(options)
    for site in spec.sites:
        wrapt.register_post_import_hook(
            functools.partial(_land, spec, token, site), site.module)
    return True


def disable(spec: PatchSpec) -> bool:
    """Revert one patch; False if it was not applied."""
    with _lock:
        activation = _active.pop(spec.name, None)
        if activation is None:
            return False
        for site in spec.sites:
            if site.key in activation.landed:
                _unland(spec, site)
        if spec.disable is not None:
            spec.disable()
    return True


def landed_sites(name: str) -> tuple[list[str], list[str]]:
    """(installed sites, sites waiting for their module's import) of an applied patch."""
    activation = _active.get(name)
    if activation is None:
        return [], []
    fmt = lambda keys: sorted(f"{m}.{a}" for m, a in keys)  # noqa: E731
    return fmt(activation.landed), fmt(activation.pending)


def original(module: str | ModuleType, attr: str) -> Any:
    """The unpatched object at ``module.attr`` (the current one if not patched)."""
    mod_name = module if isinstance(module, str) else module.__name__
    with _lock:
        state = _sites.get((mod_name, attr))
        if state is not None:
            return state.original
    mod = sys.modules.get(mod_name) if isinstance(module, str) else module
    if mod is None:
        raise LookupError(
            f"get_original: module {mod_name!r} is not imported, so it has no "
            f"{attr!r} yet; import it first")
    value = _current(Site(mod_name, attr, make=lambda o: o), mod)
    if value is _MISSING:
        raise LookupError(f"get_original: {mod_name}.{attr} does not exist")
    return _unpatched(value)
