"""The single record of what training-patches has applied and what it replaced.

Every patch is a :class:`PatchSpec`, every upstream package an :class:`Integration`. A site
lands from a post-import hook (:func:`patches._imports.when_imported`) holding its
activation's token, so it does nothing once that activation is reverted. One upstream name is
one :class:`Site` with one replacement, whose wrapper does the work of every patch it serves
(asking :func:`active` per call); it is made again when one comes or goes. The original is
kept first-wins and restored by identity.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterator

from . import _options
from ._imports import when_imported
from ._log import logger
from ._upstream import UpstreamVersion, distribution_version, upstream_version, version_in

_MISSING = object()
# Sweeping rebinds copies of an original that other modules took with
# ``from x import name``; torch's own modules keep theirs (they define the names).
_SWEEP_SKIP_PREFIXES = ("torch", "patches", "wrapt")


@dataclass(frozen=True)
class Site:
    """One place where a name is bound: ``module.attr`` (``"Class.method"``: from the class's
    own ``__dict__``). ``make(original)`` builds its one replacement; ``sweep`` also replaces
    every copy of the original in imported modules outside torch. ``patch``: the patch it
    serves, or a tuple of them (each one's part runs while :func:`active` says so). ``lost``:
    what goes unprotected when it cannot land (one text, or one per patch)."""

    module: str
    attr: str
    make: Callable[[Any], Any]
    sweep: bool = False
    patch: str | tuple[str, ...] = ""
    lost: str | dict[str, str] = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.module, self.attr)

    @property
    def serves(self) -> tuple[str, ...]:
        """The patches this site does the work of."""
        return (self.patch,) if isinstance(self.patch, str) else tuple(self.patch)

    def lost_for(self, patch: str) -> str:
        return self.lost.get(patch, "") if isinstance(self.lost, dict) else self.lost

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class PatchSpec:
    """Everything one generic patch is: its banner line (``describe(options)``), its sites or
    an ``enable``/``disable`` pair, its options and their ``check``, its ``reset`` and its
    counters (``stats``/``load_stats``). ``requires()`` lists what it needs and this process
    lacks: anything listed keeps the patch off, loudly."""

    name: str
    describe: Callable[[Any], str]
    sites: tuple[Site, ...] = ()
    default: bool = True
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
    """What one upstream package adds to the generic patches: its sites, its distribution
    and supported versions (PEP 440, checked at apply)."""

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
        return sorted({patch for site in self.sites for patch in site.serves})


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
class _SiteState:
    """A landed site: the original (first-wins), the replacement, the patches it serves now."""

    original: Any
    replacement: Any
    patches: set[str] = field(default_factory=set)


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
    """Declare a generic patch, with its options (each patch module, once). Its own sites
    that name no patch serve it."""
    with _lock:
        spec = dataclasses.replace(spec, sites=tuple(
            site if site.patch else dataclasses.replace(site, patch=spec.name)
            for site in spec.sites))
        _check_one_site_per_name(spec.name, spec.sites)
        _options.declare(spec.name, spec.options, spec.check)
        _specs[spec.name] = spec
    return spec


def register_integration(integration: Integration) -> Integration:
    """Declare an upstream integration, with its options."""
    with _lock:
        _check_one_site_per_name(integration.name, integration.sites)
        _options.declare(integration.name, integration.options)
        _integrations[integration.name] = integration
    return integration


def _declared() -> Iterator[tuple[Site, str | None, str]]:
    """Every declared site, with its integration (None: a generic patch's own) and owner."""
    for spec in _specs.values():
        yield from ((site, None, spec.name) for site in spec.sites)
    for integ in _integrations.values():
        yield from ((site, integ.name, integ.name) for site in integ.sites)


def _check_one_site_per_name(owner: str, sites: tuple[Site, ...]) -> None:
    """One Site per upstream name: a second would be a second wrapper over the first."""
    seen = {site.key: other for site, _, other in _declared() if other != owner}
    for site in sites:
        if site.key in seen:
            raise ValueError(
                f"training-patches: {owner} declares {site}, which {seen[site.key]} declares "
                f"already. Expected one Site per upstream name: declare it once, naming every "
                f"patch it serves (patch=(...)), and do each one's part in its one wrapper")
        seen[site.key] = owner


def specs() -> dict[str, PatchSpec]:
    return dict(_specs)


def integrations() -> dict[str, Integration]:
    return dict(_integrations)


def any_applied() -> bool:
    """True while any patch is applied (the run lasts as long)."""
    return bool(_active)


def active(patch: str) -> bool:
    """True while ``patch`` is applied: a wrapper serving several patches asks it per call."""
    return patch in _active


def is_enabled(name: str) -> bool:
    """True while the patch (or the integration) is applied and not left off."""
    if name in _integrations:
        return name not in _integrations_off and any(
            patch in _active for patch in _integrations[name].patches())
    return name in _active


def sites_of(name: str) -> tuple[Site, ...]:
    """Every site that serves a patch: its own, another patch's it shares, and those its
    integrations contribute (all of them, left off or not); for an integration, its sites."""
    if name in _integrations:
        return _integrations[name].sites
    return tuple(site for site, _, _ in _declared() if name in site.serves)


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
        found = _checked_versions[integ.name] = upstream_version(integ)
        if (found.version is not None or found.vendored) and integ.module and \
                integ.module not in sys.modules:
            _watch_import(integ)
        problem = _record_version(integ, found)
        if problem is not None:
            problems.append(problem)
    return problems


def _record_version(integ: Integration, found: UpstreamVersion) -> Problem | None:
    """The integration's version problem, if any, recorded (or forgotten) and returned."""
    problem = version_problem(integ, found)
    if problem is None:
        _version_problems.pop(integ.name, None)
    else:
        _version_problems[integ.name] = problem
    return problem


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
                patch in _active for patch in integ.patches()):
            return
        before = _checked_versions.get(integ.name)
        found = _checked_versions[integ.name] = upstream_version(integ)
        if before is not None and before.version == found.version:
            return  # what the banner said holds
        problem = _record_version(integ, found)
        if problem is not None:
            _report(problem, None, ("", integ.name))
            return
        logger.info("training-patches: %s is %s (%s), not %s as read before the import",
                    integ.distribution, found.version, found.detail,
                    before.version if before is not None else "known")

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
    lost = site.lost_for(spec.name) or f"what {spec.name} does at this site"
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
    """Install the site's replacement for ``spec``: made now, over the original, whether it
    is the first patch the site serves or one more (the site is then made again)."""
    # Inside the user's own ``import``: a failure must never break it (unless strict).
    with _lock:
        activation = _active.get(spec.name)
        if activation is None or activation.token is not token:
            return  # reverted (or re-applied) since this hook was registered
        activation.pending.discard(site.key)
        if integration is not None and integration in _integrations_off:
            return
        current = _current(site, module)
        if current is _MISSING:
            _report(_site_problem(spec, site, integration, "missing",
                                  "does not exist in this version"), activation, site.key)
            return
        state = _sites.get(site.key)
        if state is not None and spec.name in state.patches:
            return
        original = _unpatched(current) if state is None else state.original
        try:
            replacement = site.make(original)
        except Exception as exc:  # noqa: BLE001 - any failure: leave what is there in place
            kept = ("the original is left in place" if state is None else
                    f"its replacement for {', '.join(sorted(state.patches))} is left in place")
            _report(_site_problem(spec, site, integration, "failed",
                                  f"could not be patched ({type(exc).__name__}: {exc}); "
                                  f"{kept}"), activation, site.key)
            return
        if state is None:
            state = _sites[site.key] = _SiteState(original, replacement=current)
        state.patches.add(spec.name)
        _install(spec, site, module, state, replacement)
        activation.landed.add(site.key)


def _install(spec: PatchSpec, site: Site, module: ModuleType, state: _SiteState,
             new: Any) -> None:
    """Put ``new`` at the site in place of ``state.replacement``, the object put there for
    the site's patches; an object someone else put there since is left in place, loudly."""
    current = _current(site, module)
    if current is not state.replacement:
        logger.warning(
            "%s: %s was replaced by someone else after training-patches patched it; "
            "leaving their object in place", spec.name, site)
        return
    _forget(current)
    _rebind(site, module, current, new)
    state.replacement = new
    if new is not state.original:
        _replacements[id(new)] = (new, state.original)


def _forget(replacement: Any) -> None:
    entry = _replacements.get(id(replacement))
    if entry is not None and entry[0] is replacement:
        del _replacements[id(replacement)]


def _unland(spec: PatchSpec, site: Site) -> None:
    """Take ``spec`` out of the site: the original back when no other patch it serves is
    applied, else the replacement made again for those."""
    state = _sites.get(site.key)
    module = sys.modules.get(site.module)
    if state is None or module is None or spec.name not in state.patches:
        return
    state.patches.discard(spec.name)
    if not state.patches:
        _install(spec, site, module, state, state.original)
        _forget(state.replacement)  # someone else's object left in place: ours is gone
        del _sites[site.key]
        return
    try:
        _install(spec, site, module, state, site.make(state.original))
    except Exception as exc:  # noqa: BLE001 - revert never fails on a site's make
        logger.warning("training-patches: %s: %s could not be made again without it "
                       "(%s: %s); what it holds is left in place", spec.name, site,
                       type(exc).__name__, exc)


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
        wanted = [(site, integ) for site, integ, _ in _declared()  # what it lands now
                  if spec.name in site.serves and integ not in _integrations_off]
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
                for patch, activation in _activations(site):
                    activation.problems.pop(site.key, None)
                    activation.pending.discard(site.key)
                    if site.key in activation.landed:
                        _unland(_specs[patch], site)
                        activation.landed.discard(site.key)
            return True
        _integrations_off.discard(name)
        for site in integ.sites:
            for patch, activation in _activations(site):
                activation.pending.add(site.key)
                when_imported(
                    functools.partial(_land, _specs[patch], activation.token, site, name),
                    site.module)
        return True


def _activations(site: Site) -> list[tuple[str, _Activation]]:
    """(patch, its activation) for each applied patch the site serves."""
    return [(patch, _active[patch]) for patch in site.serves if patch in _active]


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
