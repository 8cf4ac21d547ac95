"""apply / revert / applied / stats: the only doors to the patches, and the banner."""

from __future__ import annotations

import difflib
import logging
import multiprocessing
import os
import sys
import threading
from typing import Any, Iterable

from . import _options, _registry, _run, _runstate
from ._version import __version__
from ._log import logger

_RULE = "=" * 72
_activated = False
_activate_lock = threading.Lock()


def _as_names(names: str | Iterable[str]) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _check_names(names: Iterable[str], source: str) -> None:
    known = list(_registry.specs()) + list(_registry.integrations())
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = [f"{name!r} -> did you mean {close[0]!r}?" for name in unknown
                 if (close := difflib.get_close_matches(name, known, n=1))]
        raise _options.ConfigError(
            f"training-patches: {source} names unknown patch(es) {', '.join(unknown)}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f". Known patches: {', '.join(_registry.specs())}; known integrations: "
            f"{', '.join(_registry.integrations())}. Check the spelling "
            f"(TRAINING_PATCHES_README.md lists what each one does).")


def check_settings(**options: Any) -> _options.Options:
    """The settings :func:`apply` would use, validated exactly as activation validates them
    (:class:`ConfigError` with its paragraph); changes nothing. ``doctor``, the headless
    pre-flight and every use before any :func:`apply` call this, so none can disagree."""
    opts = _options.resolve(options)
    _check_names(opts.disable, "TRAINING_PATCHES_DISABLE (or disable=)")
    return opts


# Without the activation line, the settings are read at their first use by this same check.
_options.read_first_use_with(check_settings)


def _split(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(patch names, integration names), in the given order."""
    integrations = _registry.integrations()
    names = list(names)
    return ([n for n in names if n not in integrations], [n for n in names if n in integrations])


def apply(names: str | Iterable[str] | None = None, **options: Any) -> dict[str, list[str]]:
    """Apply patches (the default set when ``names`` is None) with these options.

    Options come from keyword arguments, else ``TRAINING_PATCHES_*`` variables, else
    defaults; those named in ``disable`` stay off. A patch already applied wraps nothing
    twice: only its own options change (logged). Returns :func:`applied`.
    """
    explicit = set(options) | {name for name, option in _options.OPTIONS.items()
                               if option.env in os.environ}
    opts = check_settings(**options)
    specs = _registry.specs()
    if names is None:
        wanted = [n for n, s in specs.items() if s.default or (n == "anomaly" and opts.anomaly)]
        wanted_integrations = list(_registry.integrations())
    else:
        _check_names(_as_names(names), "apply()")
        wanted, wanted_integrations = _split(_as_names(names))
        # naming an integration applies the generic patches it serves
        for integ in wanted_integrations:
            wanted += [n for n in _registry.integrations()[integ].patches() if n not in wanted]
    previous = _options.current() if _registry.any_applied() else None
    if previous is not None:
        opts = _options.merge(previous, opts, touched=set(wanted), explicit=explicit)
    _runstate.start()  # a new run when the last one ended (revert() of every patch)
    _options.set_current(opts)
    _registry.strict = opts.strict
    for name in wanted_integrations:
        if name not in opts.disable:
            _registry.set_integration(name, True)
    for name in _registry.integrations():
        if name in opts.disable:
            _registry.set_integration(name, False)
    newly: list[str] = []
    already: list[str] = []
    left_off: dict[str, str] = {}
    _registry.in_apply = True
    try:
        version_problems = _registry.check_versions()
        if version_problems and opts.strict:
            _registry.in_apply = False
            _registry._report(version_problems[0], None, ("", ""))
        for name, spec in specs.items():
            if name not in wanted:
                if not _registry.is_enabled(name):
                    left_off[name] = spec.off_hint or "not requested"
                continue
            if name in opts.disable:
                left_off[name] = "left off by TRAINING_PATCHES_DISABLE"
                continue
            (newly if _registry.enable(spec, opts) else already).append(name)
    finally:
        _registry.in_apply = False
    if already and previous is not None:
        _log_option_changes(previous, opts, already)
    if newly:
        _banner(newly, left_off, opts, version_problems)
    elif already:
        logger.debug("training-patches: already applied: %s", ", ".join(already))
    return applied()


def _log_option_changes(before: _options.Options, after: _options.Options,
                        patch_names: list[str]) -> None:
    for name in patch_names:
        changed = [f"{field} {getattr(before, field)!r} -> {getattr(after, field)!r}"
                   for field in _options.fields_of(name)
                   if getattr(before, field) != getattr(after, field)]
        if changed:
            logger.info("training-patches: %s options changed: %s", name, ", ".join(changed))


def revert(names: str | Iterable[str] | None = None) -> list[str]:
    """Take patches (or integrations) back out (every applied patch when ``names`` is None).

    Every replaced object is restored by identity. With no patch left applied the run ends;
    its counters (``stats()``) stay readable until the next ``apply()``. Returns the names
    reverted.
    """
    specs = _registry.specs()
    targets = list(specs) if names is None else _as_names(names)
    _check_names(targets, "revert()")
    patch_names, integration_names = _split(targets)
    done = [name for name in integration_names if _registry.set_integration(name, False)]
    done += [name for name in reversed(patch_names) if _registry.disable(specs[name])]
    if names is None:
        for name in _registry.integrations():
            _registry.set_integration(name, True)  # the next apply() starts with all of them
    if done:
        logger.info("training-patches: reverted %s", ", ".join(done))
    if not _registry.any_applied():
        _runstate.end()  # its counters stay readable until the next apply()
    return [name for name in integration_names + patch_names if name in done]


def applied() -> dict[str, list[str]]:
    """Applied patch name -> where it is installed. Sites still waiting for an import are
    listed with ``(on import)``; sites that could not land with ``(NOT APPLIED: why)``."""
    result: dict[str, list[str]] = {}
    for name, spec in _registry.specs().items():
        if not _registry.is_enabled(name):
            continue
        landed, pending = _registry.landed_sites(name)
        where = landed + [f"{site} (on import)" for site in pending]
        where += [f"{p.where} (NOT APPLIED: {p.kind})" for p in _registry.problems(name)
                  if p.kind in ("missing", "failed")]
        result[name] = where or [spec.describe(_options.current())]
    return result


def status(name: str) -> dict[str, Any]:
    """The state of one patch or integration: ``state`` is ``applied``, ``degraded`` (some
    site missing or failed, or an unsupported upstream version), ``waiting`` (nothing
    imported yet) or ``off``; with the landed and pending sites and the problems. A patch
    with no sites of its own (``vocab_freeze``) says what it has done in ``detail``,
    ``waiting`` until it could act, and ``degraded`` with the reason when it could not."""
    _check_names([name], "status()")
    problems = _registry.problems(name)
    on = _registry.is_enabled(name)
    if name in _registry.integrations():
        sites = _registry.integrations()[name].sites
        landed, pending = (sorted(str(s) for s in sites if any(
            str(s) in _registry.landed_sites(p)[i] for p in s.serves)) for i in (0, 1))
    else:
        landed, pending = _registry.landed_sites(name)
    messages = [p.message for p in problems]
    spec = _registry.specs().get(name)
    runtime = spec.state() if on and spec is not None and spec.state is not None else None
    detail = runtime[1] if runtime else ""
    if not on:
        state = "degraded" if any(p.kind == "requires" for p in problems) else "off"
    elif problems:
        state = "degraded"
    elif runtime is not None:  # a patch with no sites says what it has done
        state = {"not applied": "degraded"}.get(runtime[0], runtime[0])
        if runtime[0] == "not applied":
            messages.append(f"not applied: {runtime[1]}")
    elif not landed and pending:
        state = "waiting"
    else:
        state = "applied"
    return {"name": name, "state": state, "landed": landed, "pending": pending,
            "problems": messages, "detail": detail}


def is_applied(name: str) -> bool:
    """True once the patch (or integration) is applied, in effect somewhere, and whole: a
    patch with a missing or failed site, or an unsupported upstream, is ``degraded`` (see
    :func:`status`) and answers False."""
    _check_names([name], "is_applied()")
    if not _registry.is_enabled(name) or _registry.problems(name):
        return False
    if name in _registry.integrations():
        return True
    spec = _registry.specs()[name]
    return not spec.sites or bool(_registry.landed_sites(name)[0])


def get_original(module: Any, attr: str) -> Any:
    """The object ``module.attr`` held before any patch (the current one if unpatched)."""
    return _registry.original(module, attr)


def stats() -> dict[str, dict[str, float]]:
    """Counters of the runtime patches as plain numbers (reading them syncs once).

    Each process counts for itself. In a job of several ranks a counter is either *agreed*
    (the same on every rank: the guard's and the scaler's ``steps``/``skipped``, the clip's
    counters; a job's figure is one rank's) or *this rank's* (``nonfinite_losses``,
    ``peer_skips``, ``oom_skipped``, ...: summed over ranks); TRAINING_PATCHES_README.md,
    "Where evidence goes". ``evidence`` counts this process's records
    (:func:`patches._run.evidence_stats`).
    """
    counts = {name: spec.stats() for name, spec in _registry.specs().items()
              if spec.stats is not None}
    counts["evidence"] = _run.evidence_stats()
    return counts


def runtime_state() -> dict[str, dict[str, int]]:
    """The counters of the runtime patches, to save in a checkpoint (plain ints)."""
    return {name: spec.stats() for name, spec in _registry.specs().items()
            if spec.stats is not None and spec.load_stats is not None}


def load_runtime_state(state: dict[str, dict[str, int]]) -> None:
    """Restore what :func:`runtime_state` returned (unknown parts are ignored); the
    SafeGradScaler's own counters travel in its ``state_dict()``."""
    for name, spec in _registry.specs().items():
        if spec.load_stats is not None:
            spec.load_stats(state.get(name, {}))


def reset_runtime_state() -> None:
    """End the current run and start a new one: every counter, event and per-run setting
    the patches keep starts afresh, and what the integrations remember of their trainers is
    forgotten; the patches stay applied, with their options. For a script that runs two
    trainings in one process, between them.
    """
    options = _runstate.current().options if _registry.any_applied() else None
    _runstate.restart()
    _options.set_current(options)
    for unit in [*_registry.specs().values(), *_registry.integrations().values()]:
        if unit.reset is not None:
            unit.reset()


def _banner(newly: list[str], left_off: dict[str, str], opts: _options.Options,
            version_problems: list[_registry.Problem]) -> None:
    problems = [p for name in newly for p in _registry.problems(name)
                if p.kind != "version"] + version_problems
    # A banner that carries a WARNING is logged as one: quiet mode must not hide it. Helper
    # processes (DataLoader workers, torchrun ranks other than 0) show only a warning one.
    quiet = opts.quiet or _helper_process() or _asks_for_help()
    level = logging.WARNING if problems else (logging.DEBUG if quiet else logging.INFO)
    specs = _registry.specs()
    width = max(len(name) for name in list(specs) + list(_registry.integrations()))
    lines = [_RULE, f"training-patches {__version__}: applying training patches", _RULE]
    for name in newly:
        mark = "[on!]" if _registry.problems(name) else "[on ]"
        if any(p.kind == "requires" for p in _registry.problems(name)):
            mark = "[OFF]"
        lines.append(f"  {mark} {name:<{width}}  {specs[name].describe(opts)}")
    for name, why in left_off.items():
        lines.append(f"  [off] {name:<{width}}  {why}")
    for name, integ in _registry.integrations().items():
        # the version of the code this process runs (a trainer may vendor its own TTS/)
        found = _registry.checked_version(integ)
        if _registry.integration_off(name):
            lines.append(f"  [off] {name:<{width}}  left off by TRAINING_PATCHES_DISABLE")
        elif found.version is None and not found.vendored:
            lines.append(f"  [ - ] {name:<{width}}  {integ.distribution} not installed")
        else:
            lines.append(f"  [int] {name:<{width}}  {integ.distribution} "
                         f"{found.version or '(version unknown)'} [{found.source}] "
                         f"({integ.supported}): {integ.describe}")
    for problem in problems:
        lines.append(f"  WARNING {problem.patch}: {problem.message}")
    lines += [_RULE, "Options: " + ", ".join(
        f"{name}={value!r}" for name, value in opts.items()), _RULE]
    logger.log(level, "\n".join(lines))


def _asks_for_help() -> bool:
    """The trainer was started only to print its help (``-h``/``--help`` before any ``--``):
    a banner first would push the help off the screen (one with a WARNING still shows)."""
    args = sys.argv[1:]
    args = args[:args.index("--")] if "--" in args else args
    return "-h" in args or "--help" in args


def _helper_process() -> bool:
    """A process started by the trainer's own (spawned DataLoader workers) or a torchrun
    rank other than 0: the main process has shown the banner already."""
    return (multiprocessing.parent_process() is not None
            or os.environ.get("RANK", "0") not in ("", "0"))


class _FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Shows our records on stderr only while nobody has configured logging (records still
    propagate: once the user configures the root logger, this one steps aside)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        super().emit(record)


def _ensure_visible() -> None:
    """Show our INFO lines when nobody configured logging (the banner must be seen)."""
    if logger.handlers or logging.getLogger().handlers:  # ours included
        return
    handler = _FallbackHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s training_patches: %(message)s",
                                           "%H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


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
