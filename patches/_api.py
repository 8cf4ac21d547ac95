"""apply / revert / applied / stats: the only doors to the patches, and the banner."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Iterable

from . import _options, _registry, grad_clip, grad_scaler, nan_guard
from ._log import logger

_RULE = "=" * 72
_activated = False
_activate_lock = threading.Lock()


def _as_names(names: str | Iterable[str]) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _check_names(names: Iterable[str], source: str) -> None:
    known = _registry.specs()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise _options.ConfigError(
            f"training-patches: {source} names unknown patch(es) {', '.join(unknown)}. "
            f"Known patches: {', '.join(known)}. Check the spelling "
            f"(TRAINING_PATCHES_README.md lists what each one does).")


def apply(names: str | Iterable[str] | None = None, **options: Any) -> dict[str, list[str]]:
    """Apply patches (the default set when ``names`` is None) with these options.

    Options come from keyword arguments, else ``TRAINING_PATCHES_*`` environment
    variables, else defaults; patches named in ``disable`` stay off. Applying a
    patch that is already applied does nothing (it is never wrapped twice).
    Returns :func:`applied`.
    """
    opts = _options.resolve(options)
    _check_names(opts.disable, "TRAINING_PATCHES_DISABLE (or disable=)")
    specs = _registry.specs()
    if names is None:
        wanted = [n for n, s in specs.items() if s.default or (n == "anomaly" and opts.anomaly)]
    else:
        wanted = _as_names(names)
        _check_names(wanted, "apply()")
    _options.set_current(opts)
    newly: list[str] = []
    already: list[str] = []
    left_off: dict[str, str] = {}
    for name, spec in specs.items():
        if name not in wanted:
            if not _registry.is_enabled(name):
                left_off[name] = spec.off_hint or "not requested"
            continue
        if name in opts.disable:
            left_off[name] = "left off by TRAINING_PATCHES_DISABLE"
            continue
        (newly if _registry.enable(spec, opts) else already).append(name)
    if newly:
        _banner(newly, left_off, opts)
    elif already:
        logger.debug("training-patches: already applied: %s", ", ".join(already))
    return applied()


def revert(names: str | Iterable[str] | None = None) -> list[str]:
    """Take patches back out (all applied ones when ``names`` is None).

    Every replaced object is restored by identity; a patch whose target module
    was never imported simply never lands. Returns the names reverted.
    """
    specs = _registry.specs()
    targets = list(specs) if names is None else _as_names(names)
    _check_names(targets, "revert()")
    done = [name for name in reversed(targets) if _registry.disable(specs[name])]
    if done:
        logger.info("training-patches: reverted %s", ", ".join(reversed(done)))
    return list(reversed(done))


def applied() -> dict[str, list[str]]:
    """Applied patch name -> where it is installed (sites still waiting for an import are
    listed with ``(on import)``)."""
    result: dict[str, list[str]] = {}
    for name, spec in _registry.specs().items():
        if not _registry.is_enabled(name):
            continue
        landed, pending = _registry.landed_sites(name)
        where = landed + [f"{site} (on import)" for site in pending]
        result[name] = where or [spec.describe(_options.current())]
    return result


def is_applied(name: str) -> bool:
    """True once the patch is applied and in effect somewhere (not only waiting)."""
    _check_names([name], "is_applied()")
    if not _registry.is_enabled(name):
        return False
    spec = _registry.specs()[name]
    return not spec.sites or bool(_registry.landed_sites(name)[0])


def get_original(module: Any, attr: str) -> Any:
    """The object ``module.attr`` held before any patch (the current one if unpatched)."""
    return _registry.original(module, attr)


def stats() -> dict[str, dict[str, float]]:
    """Counters of the runtime patches as plain numbers (reading them syncs once)."""
    return {"grad_scaler": grad_scaler.stats(), "grad_clip": grad_clip.stats(),
            "nan_guard": nan_guard.stats()}


def runtime_state() -> dict[str, dict[str, int]]:
    """The counters of the runtime patches, to save in a checkpoint (plain ints)."""
    return {"grad_clip": grad_clip.stats(), "nan_guard": nan_guard.stats()}


def load_runtime_state(state: dict[str, dict[str, int]]) -> None:
    """Restore what :func:`runtime_state` returned (unknown parts are ignored).

    The SafeGradScaler's own counters travel in its ``state_dict()``.
    """
    grad_clip.load_stats(state.get("grad_clip", {}))
    nan_guard.load_stats(state.get("nan_guard", {}))


def _banner(newly: list[str], left_off: dict[str, str], opts: _options.Options) -> None:
    from . import __version__

    level = logging.DEBUG if opts.quiet else logging.INFO
    specs = _registry.specs()
    width = max(len(name) for name in specs)
    lines = [_RULE, f"training-patches {__version__}: applying training patches", _RULE]
    for name in newly:
        lines.append(f"  [on ] {name:<{width}}  {specs[name].describe(opts)}")
    for name, why in left_off.items():
        lines.append(f"  [off] {name:<{width}}  {why}")
    lines += [_RULE, "Options: " + ", ".join(
        f"{field}={getattr(opts, field)!r}" for field in _options.OPTIONS), _RULE]
    logger.log(level, "\n".join(lines))


def _ensure_visible() -> None:
    """Show our INFO lines when nobody configured logging (the banner must be seen)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s training_patches: %(message)s",
                                           "%H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


def activate() -> dict[str, list[str]]:
    """What the one import line does: the default set, once per process."""
    global _activated
    with _activate_lock:
        if _activated:
            return applied()
        _ensure_visible()
        result = apply()
        _activated = True
        return result

