"""The single record of what training-patches has applied and what it replaced.

Every patch is a :class:`PatchSpec` (its sites, or an ``enable``/``disable`` pair), every
upstream package an :class:`Integration`; ``apply``/``revert`` in :mod:`patches` are the only
doors. A site lands from a post-import hook (:func:`patches._imports.when_imported`: now, or
once its module's import ends), which holds its activation's token and does nothing once that
activation is reverted (hooks cannot be unregistered). Several patches may want one site:
each site keeps a stack of layers ordered by priority, each made over the one below, the
original at the bottom (kept first-wins, restored by identity when the last layer goes).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from . import _options
from ._imports import when_imported
from ._upstream import UpstreamVersion, distribution_version, upstream_version, version_in

logger = logging.getLogger("training_patches")

_MISSING = object()
# Sweeping rebinds copies of an original that other modules took with
# ``from x import name``; torch's own modules keep theirs (they define the names).
_SWEEP_SKIP_PREFIXES = ("torch", "patches", "wrapt")


@dataclass(frozen=True)
class Site:
    """One place where a name is bound: ``module.attr`` (``"Class.method"``: the original
    taken from the class's own ``__dict__``). ``make(original)`` builds the replacement; with
    ``sweep`` it also replaces every copy of the original in imported modules outside torch.
    An integration's site names the generic ``patch`` it serves; ``lost`` says what goes
    unprotected when the site cannot land."""

    module: str
    attr: str
    make: Callable[[Any], Any]
    sweep: bool = False
    patch: str = ""
    lost: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.attr)

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class PatchSpec:
    """Everything one generic patch is, declared in one place: its name, its banner line
    (``describe(options)``), its sites or an ``enable``/``disable`` pair, its options and
    their cross-option ``check``, its ``reset`` (runtime state between runs) and its
    counters (``stats``, saved in checkpoints with ``load_stats``). ``requires()`` lists what
    it needs and this process lacks: anything listed keeps the patch off, loudly."""

    name: str
    describe: Callable[[Any], str]
    sites: tuple[Site, ...] = ()
    default: bool = True
    priority: int = 0
    enable: Callable[[Any], None] | None = None
    disable: Callable[[], None] | None = None
    off_hint: str = ""
    requires: Callable[[], list[str]] | None = None
    reset: Callable[[], None] | None = None
    options: tuple[_options.Option, ...] = ()
    check: _options.Check | None = None
    stats: Callable[[], dict[str, Any]] | None = None
    load_stats: Callable[[dict[str, Any]], None] | None = None
    # for patches.status(): ("applied" | "waiting" | "not applied", a sentence) or None
    state: Callable[[], tuple[str, str] | None] | None = None


@dataclass(frozen=True)
class Integration:
    """What one upstream package adds to the generic patches: its sites (each serving one
    generic patch), its distribution and supported versions (PEP 440, checked at apply)."""

    name: str
    distribution: str
    supported: str
    sites: tuple[Site, ...]
    describe: str = ""
    reset: Callable[[], None] | None = None
    # the top-level package imported for the distribution ("TTS"): its version is checked
    module: str = ""
    options: tuple[_options.Option, ...] = ()

    def patches(self) -> list[str]:
        return sorted({site.patch for site in self.sites})


@dataclass(frozen=True)
class Problem:
    """A part of a patch that is not in effect, and what that leaves unprotected."""

    patch: str
    kind: str  # "missing" | "failed" | "version" | "requires"
    where: str
    message: str


class PatchSiteError(RuntimeError):
    """A patch site is missing, failed, or its upstream version is unsupported (strict mode)."""


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
    problems: dict[tuple[str, str], Problem] = field(default_factory=dict)


_lock = threading.RLock()
_specs: dict[str, PatchSpec] = {}
_integrations: dict[str, Integration] = {}
_integrations_off: set[str] = set()
_active: dict[str, _Activation] = {}
_sites: dict[tuple[str, str], _SiteState] = {}
# Problems found outside any activation (an unsupported upstream version).
_version_problems: dict[str, Problem] = {}
# id(replacement) -> (replacement, original): keeps its id unique, traces a copy back.
_replacements: dict[int, tuple[Any, Any]] = {}
_requires_problems: dict[str, Problem] = {}
# Set by the API from the options: problems raise instead of warning.
strict = False
# True while apply() runs: problems found then go into its banner instead of their own line.
in_apply = False


def register(spec: PatchSpec) -> PatchSpec:
    """Declare a generic patch, with its options (each patch module, once)."""
    with _lock:
        _options.declare(spec.name, spec.options, spec.check)
        _specs[spec.name] = spec
    return spec


def register_integration(integration: Integration) -> Integration:
    """Declare an upstream integration, with its options."""
    with _lock:
        _options.declare(integration.name, integration.options)
        _integrations[integration.name] = integration
    return integration


def specs() -> dict[str, PatchSpec]:
    return dict(_specs)


def integrations() -> dict[str, Integration]:
    return dict(_integrations)


def any_applied() -> bool:
    """True while any patch is applied (the run lasts as long)."""
    return bool(_active)


def is_enabled(name: str) -> bool:
    """True while the patch (or the integration) is applied and not left off."""
    if name in _integrations:
        return name not in _integrations_off and any(
            site.patch in _active for site in _integrations[name].sites)
    return name in _active


def sites_of(name: str) -> tuple[Site, ...]:
    """Every site of a patch: its own and those its integrations contribute (all of them,
    left off or not); for an integration, its sites."""
    if name in _integrations:
        return _integrations[name].sites
    own = _specs[name].sites
    return own + tuple(site for integ in _integrations.values() for site in integ.sites
                       if site.patch == name)


def _wanted_sites(spec: PatchSpec) -> list[tuple[Site, str | None]]:
    """(site, integration name or None) this patch lands now."""
    found: list[tuple[Site, str | None]] = [(site, None) for site in spec.sites]
    for integ in _integrations.values():
        if integ.name in _integrations_off:
            continue
        found += [(site, integ.name) for site in integ.sites if site.patch == spec.name]
    return found


def version_problem(integ: Integration, found: UpstreamVersion) -> Problem | None:
    """A Problem when the upstream this process runs is outside the integration's range
    (or a vendored copy whose version cannot be read)."""
    if found.version is None and not found.vendored:
        return None  # not installed: the banner says so, nothing lands
    try:
        ok = found.version is not None and version_in(found.version, integ.supported)
    except ValueError:  # packaging's InvalidVersion
        ok = False
    if ok:
        return None
    return Problem(
        ", ".join(integ.patches()), "version", integ.name,
        f"{integ.distribution} {found.version or '(version unknown)'} is what this process "
        f"runs ({found.detail}); integration {integ.name} supports {integ.distribution} "
        f"{integ.supported}. Its sites are applied where they exist, but behaviour inside "
        f"{integ.distribution} is unverified")


def check_versions() -> list[Problem]:
    """Each integration whose upstream, as this process runs it, is outside its range."""
    problems = []
    for integ in _integrations.values():
        if integ.name in _integrations_off:
            _version_problems.pop(integ.name, None)
            continue
        found = upstream_version(integ)
        _checked_versions[integ.name] = found
        if (found.version is not None or found.vendored) and integ.module and \
                integ.module not in sys.modules:
            _watch_import(integ)
        problem = version_problem(integ, found)
        if problem is None:
            _version_problems.pop(integ.name, None)
            continue
        _version_problems[integ.name] = problem
        problems.append(problem)
    return problems


# What check_versions() read for each integration (the banner shows it).
_checked_versions: dict[str, UpstreamVersion] = {}
_watched: set[str] = set()


def _watch_import(integ: Integration) -> None:
    """Check the version again once the module is imported: its ``__version__`` decides."""
    if integ.name in _watched:
        return
    _watched.add(integ.name)

    def on_import(module: ModuleType) -> None:
        _watched.discard(integ.name)
        if integ.name in _integrations_off or not any(
                site.patch in _active for site in integ.sites):
            return
        before = _checked_versions.get(integ.name)
        found = upstream_version(integ)
        _checked_versions[integ.name] = found
        if before is not None and before.version == found.version:
            return  # what the banner said holds
        problem = version_problem(integ, found)
        if problem is None:
            _version_problems.pop(integ.name, None)
            logger.info("training-patches: %s is %s (%s), not %s as read before the import",
                        integ.distribution, found.version, found.detail,
                        before.version if before is not None else "known")
            return
        _version_problems[integ.name] = problem
        _report(problem, None, ("", integ.name))

    when_imported(on_import, integ.module)


def checked_version(integ: Integration) -> UpstreamVersion:
    """What the last :func:`check_versions` read for ``integ`` (read now if never)."""
    return _checked_versions.get(integ.name) or upstream_version(integ)


def _report(problem: Problem, activation: _Activation | None, key: tuple[str, str]) -> None:
    """Record a problem; log it as a WARNING (it is also in the banner); raise when strict."""
    if activation is not None:
        activation.problems[key] = problem
    if not in_apply:  # during apply() the banner carries it
        logger.warning("training-patches WARNING: %s: %s", problem.patch, problem.message)
    if strict:
        raise PatchSiteError(
            f"training-patches (TRAINING_PATCHES_STRICT=1): {problem.patch}: {problem.message}. "
            f"Install a supported version, or leave the patch or integration off with "
            f"TRAINING_PATCHES_DISABLE, or unset TRAINING_PATCHES_STRICT to run degraded.")


def _site_problem(spec: PatchSpec, site: Site, integration: str | None, kind: str,
                  detail: str) -> Problem:
    owner = f"integration {integration}" if integration else f"patch {spec.name}"
    dist = _integrations[integration].distribution if integration else "torch"
    version = (upstream_version(_integrations[integration]).version if integration
               else distribution_version(dist)) or "?"
    lost = site.lost or f"what {spec.name} does at this site"
    return Problem(spec.name, kind, str(site),
                   f"{site} {detail} ({dist} {version}, {owner}); therefore NOT protected: {lost}")


def subclass_site(factory: Callable[[type], type], module: str, name: str
                  ) -> Callable[[type], type]:
    """A site's ``make`` that installs ``factory(original)``, a subclass: made once per
    original (apply/revert/apply installs the same class) and bound as ``module.name``, so that
    pickling finds it (DataLoader workers under spawn)."""
    made: dict[int, type] = {}

    def make(original: type) -> type:
        cls = made.get(id(original))
        if cls is None or cls.__bases__[0] is not original:
            cls = made[id(original)] = factory(original)
            cls.__module__, cls.__qualname__, cls.__name__ = module, name, name
            setattr(sys.modules[module], name, cls)
        return cls
    return make


def _unpatched(value: Any) -> Any:
    """The object ``value`` would be without our patches (a partial over our class, as
    coqui-tts-trainer binds at import: the same partial over the original)."""
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


def _land(spec: PatchSpec, token: object, site: Site, integration: str | None,
          module: ModuleType) -> None:
    # Inside the user's own ``import``: a failure must never break it (unless strict).
    with _lock:
        activation = _active.get(spec.name)
        if activation is None or activation.token is not token:
            return  # reverted (or re-applied) since this hook was registered
        if integration is not None and integration in _integrations_off:
            activation.pending.discard(site.key)
            return
        activation.pending.discard(site.key)
        current = _current(site, module)
        if current is _MISSING:
            _report(_site_problem(spec, site, integration, "missing",
                                  "does not exist in this version"), activation, site.key)
            return
        state = _sites.get(site.key)
        created = state is None
        if state is None:
            state = _sites[site.key] = _SiteState(original=_unpatched(current))
        if any(layer.patch == spec.name for layer in state.layers):
            return
        state.layers.append(_Layer(spec.priority, spec.name, site.make))
        state.layers.sort(key=lambda layer: layer.priority)
        try:
            state.rebuild()
        except Exception as exc:  # noqa: BLE001 - any failure: leave the original in place
            state.layers = [layer for layer in state.layers if layer.patch != spec.name]
            state.rebuild()
            if created and not state.layers:
                del _sites[site.key]
            _report(_site_problem(spec, site, integration, "failed",
                                  f"could not be patched ({type(exc).__name__}: {exc}); the "
                                  f"original is left in place"), activation, site.key)
            return
        _rebind(site, module, current, state.top())
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
    """Apply one patch; False if it was already applied (never wraps twice). A patch whose
    ``requires()`` lists something stays off with a problem recorded, and True returned."""
    with _lock:
        if spec.name in _active:
            return False
        missing = spec.requires() if spec.requires is not None else []
        if missing:
            problem = Problem(spec.name, "requires", spec.name,
                              f"NOT APPLIED: this process lacks {', '.join(missing)}")
            _requires_problems[spec.name] = problem
            _report(problem, None, ("", spec.name))
            return True
        _requires_problems.pop(spec.name, None)
        token = object()
        activation = _active[spec.name] = _Activation(token=token)
        wanted = _wanted_sites(spec)
        activation.pending.update(site.key for site, _ in wanted)
        if spec.enable is not None:
            spec.enable(options)
    for site, integration in wanted:
        when_imported(functools.partial(_land, spec, token, site, integration), site.module)
    return True


def disable(spec: PatchSpec) -> bool:
    """Revert one patch; False if it was not applied."""
    with _lock:
        _requires_problems.pop(spec.name, None)
        activation = _active.pop(spec.name, None)
        if activation is None:
            return False
        for site in sites_of(spec.name):
            if site.key in activation.landed:
                _unland(spec, site)
        if spec.disable is not None:
            spec.disable()
    return True


def set_integration(name: str, on: bool) -> bool:
    """Turn one integration on or off for every applied patch; False if nothing changed."""
    with _lock:
        integ = _integrations[name]
        if on == (name not in _integrations_off):
            return False
        if not on:
            _integrations_off.add(name)
            _version_problems.pop(name, None)
            for site in integ.sites:
                activation = _active.get(site.patch)
                if activation is None:
                    continue
                activation.problems.pop(site.key, None)
                activation.pending.discard(site.key)
                if site.key in activation.landed:
                    _unland(_specs[site.patch], site)
                    activation.landed.discard(site.key)
            return True
        _integrations_off.discard(name)
        for site in integ.sites:
            activation = _active.get(site.patch)
            if activation is None:
                continue
            activation.pending.add(site.key)
            when_imported(
                functools.partial(_land, _specs[site.patch], activation.token, site, name),
                site.module)
        return True


def integration_off(name: str) -> bool:
    return name in _integrations_off


def problems(name: str | None = None) -> list[Problem]:
    """What is not in effect: of one patch or integration, or of everything applied."""
    with _lock:
        found = list(_requires_problems.values()) + list(_version_problems.values())
        for activation in _active.values():
            found += list(activation.problems.values())
    if name is None:
        return found
    if name in _integrations:
        keys = {str(site) for site in _integrations[name].sites}
        return [p for p in found if p.where in keys or p.where == name]
    return [p for p in found if p.patch == name or name in p.patch.split(", ")]


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
