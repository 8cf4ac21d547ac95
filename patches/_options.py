"""Options of the patches: keyword arguments, else environment variables, else defaults.

Each option is an :class:`Option` declared by its unit (``PatchSpec.options``,
``Integration.options``; the library-wide ones here). :class:`Options`, the banner, ``doctor``,
the did-you-mean and the options table all read :data:`OPTIONS`, filled by :func:`declare`.
A bad value is a :class:`ConfigError` naming the variable, the value and what is expected.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from . import _runstate

ENV_PREFIX = "TRAINING_PATCHES_"


class ConfigError(ValueError):
    """An option or environment variable of training-patches has a value it cannot use."""


# -- value types shared by the units' declarations -----------------------------
# A number's bounds are its Option's ``low``/``high``, checked once (Option.out_of_range).


def flag(text: Any) -> bool:
    """1/0, true/false, yes/no, on/off (a bool passes as it is)."""
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def share(text: Any) -> float:
    """A finite number (a share, a scale, a factor)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def whole(text: Any) -> int:
    """A whole number."""
    if isinstance(text, float) and not text.is_integer():
        raise ValueError("expected a whole number")
    return int(text)


# The names the units declare with: their sign is the Option's ``low``.
positive_float = nonnegative_float = share
positive_int = nonnegative_int = whole


# What the machine can honour: a loss scale in a float32 tensor, the scaler's growth tracker
# and hysteresis in int32 tensors, every other count in patches._counters' int64.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0 ** -126  # the smallest normal float32
INT32_MAX = 2 ** 31 - 1
INT64_MAX = 2 ** 63 - 1


def names(text: Any) -> tuple[str, ...]:
    """A comma-separated list (or an iterable) of names, sorted, without repeats."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(sorted({str(item).strip() for item in items if str(item).strip()}))


# -- declarations --------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One setting: ``name`` (the keyword of :func:`patches.advanced.apply`), read from
    ``TRAINING_PATCHES_<NAME>``. ``parse`` raises ValueError with what is wrong; ``expected``
    is shown in the error, ``help`` in the options table (``shown_default`` where the repr is
    not how a user writes it). ``low``/``high`` bound a number to what the machine can honour,
    ``bound_why`` says why. ``also``: other patches that read it (applying any sets it);
    ``owners`` is filled by :func:`declare` (empty: the whole library)."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    expected: str
    help: str
    shown_default: str = ""
    also: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the value must be above ``low``, not equal to it
    bound_why: str = ""  # why the range is what it is, for the error

    @property
    def env(self) -> str:
        return env_name(self.name)

    def out_of_range(self, value: Any) -> str | None:
        """Why a parsed ``value`` is outside ``low``..``high``, or None."""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"{'at or ' if self.low_open else ''}below {number_text(self.low)}"
        if self.high is not None and value > self.high:
            return f"above {number_text(self.high)}"
        return None

    @property
    def range_text(self) -> str:
        """The accepted range as the table and the errors say it ("" when unbounded)."""
        if self.low is None and self.high is None:
            return ""
        low = "" if self.low is None else \
            f"{'above' if self.low_open else 'at least'} {number_text(self.low)}"
        high = "" if self.high is None else f"at most {number_text(self.high)}"
        if low and high and not self.low_open:
            return f"{number_text(self.low)} to {number_text(self.high)}"
        return ", ".join(part for part in (low, high) if part)


def number_text(value: float) -> str:
    """A bound as a user reads it: ``100,000``, ``2^31-1``, ``3.4e+38``."""
    named = {INT32_MAX: "2^31-1", INT64_MAX: "2^63-1", FLOAT32_TINY: "2^-126"}
    if value in named:
        return named[value]
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:.2g}"


# A check of values unusable together; ``where(name)`` names the option's source in its error.
Check = Callable[["Options", Callable[[str], str]], None]

# Every declared option, in declaration order: the banner's and the table's order.
OPTIONS: dict[str, Option] = {}
_checks: dict[str, Check] = {}


def declare(owner: str | None, options: tuple[Option, ...] = (),
            check: Check | None = None) -> tuple[Option, ...]:
    """Declare the options of the unit ``owner`` (None: library-wide) and its cross-option
    ``check``; returns them with their owners filled. A name declared twice is an error."""
    declared = []
    for option in options:
        owners = () if owner is None else (owner, *option.also)
        option = Option(**{**option.__dict__, "owners": owners})
        known = OPTIONS.get(option.name)
        if known is not None and known.owners != owners:  # (a reload redeclares its own)
            raise ValueError(f"option {option.name!r} is declared twice ({known.owners} and "
                             f"{owners})")
        OPTIONS[option.name] = option
        declared.append(option)
    if check is not None:
        _checks[owner or ""] = check
    return tuple(declared)


class Options:
    """The resolved settings: one attribute per declared option (``opts.init_scale``), its
    default unless given. Immutable; :meth:`replace` makes a changed copy."""

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(OPTIONS))
        if unknown:
            raise TypeError(f"Options() got unknown option(s) {', '.join(unknown)}; "
                            f"declared: {', '.join(OPTIONS)}")
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        option = OPTIONS.get(name)
        if option is None:
            raise AttributeError(f"Options has no option {name!r}")
        return option.default

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Options is immutable; use .replace(...)")

    def replace(self, **changes: Any) -> Options:
        return Options(**{**object.__getattribute__(self, "_values"), **changes})

    def items(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of every declared option, in declaration order."""
        return ((name, getattr(self, name)) for name in OPTIONS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and dict(self.items()) == dict(other.items())

    def __hash__(self) -> int:
        return hash(tuple(self.items()))

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{name}={value!r}" for name, value in self.items()) + ")"


def _check_library(options: Options, where: Callable[[str], str]) -> None:
    if options.output_dir:
        problem = output_dir_problem(options.output_dir)
        if problem:
            raise ConfigError(
                f"training-patches: {where('output_dir')} is {options.output_dir!r}, which "
                f"{problem}. Expected a folder where the run's reports (nonfinite_events.jsonl, "
                f"dropped_samples.jsonl) can be written. Point it at a writable folder, or unset "
                f"it to use the trainer's output folder.")


declare(None, (
    Option("disable", names, (),
           "a comma-separated list of patch names, e.g. 'anomaly,grad_clip'",
           "comma-separated patch or integration names to leave off", shown_default="none"),
    Option("strict", flag, False,
           "1 or 0 (1: a patch site that is missing, fails, or sits in an unsupported "
           "upstream version is an error instead of a warning)",
           "1: a missing or failing site, or an unsupported upstream version, is an error"),
    Option("quiet", flag, False, "1 or 0", "1: banner and routine lines at DEBUG"),
    Option("output_dir", str, "",
           "a directory for the run's reports (e.g. dropped_samples.jsonl); empty means the "
           "coqui Trainer's output folder, else the working directory",
           "where `nonfinite_events.jsonl` and `dropped_samples.jsonl` go",
           shown_default='see "Where reports go"'),
), check=_check_library)

# TRAINING_PATCHES_* variables that are not options but are read by the library.
OTHER_ENV: set[str] = {
    "TRAINING_PATCHES_LAUNCHED",  # set by `training-patches run` in the processes it starts
    "TRAINING_PATCHES_RUN_ID",  # the run_id of every record (_run.run_id)
}


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def _parse(option: str, value: Any, source: str) -> Any:
    declared = OPTIONS[option]
    try:
        parsed = declared.parse(value)
    except (TypeError, ValueError, OverflowError) as exc:
        why = f"not usable ({exc})"
        expected = declared.expected + (f" ({declared.range_text})" if declared.range_text else "")
    else:
        if (out := declared.out_of_range(parsed)) is None:
            return parsed
        why = f"out of range ({out})"
        expected = f"{declared.expected}: {declared.range_text}" + (
            f" ({declared.bound_why})" if declared.bound_why else "")
    raise ConfigError(f"training-patches: {source} is {value!r}, which is {why}. Expected "
                      f"{expected}. Fix the value or leave it out to use the default "
                      f"({declared.default!r}).")


def fields_of(patch: str) -> list[str]:
    """The options that belong to one patch."""
    return [name for name, option in OPTIONS.items() if patch in option.owners]


def owner_text(option: Option) -> str:
    """Who reads the option, as the table and ``doctor`` say it."""
    return ", ".join(option.owners) or "all"


def merge(current: Options, new: Options, *, touched: set[str], explicit: set[str]) -> Options:
    """``current`` with the options of the ``touched`` patches taken from ``new``, and the
    library-wide options taken from ``new`` only where they were given explicitly."""
    changes = {}
    for name, option in OPTIONS.items():
        if (not option.owners and name in explicit) or touched & set(option.owners):
            changes[name] = getattr(new, name)
    return current.replace(**changes)


def known_env() -> set[str]:
    """Every ``TRAINING_PATCHES_*`` variable the library reads."""
    return {option.env for option in OPTIONS.values()} | OTHER_ENV


def _did_you_mean(unknown: list[str], known: list[str], cutoff: float = 0.6) -> str:
    """``name (did you mean NAME?)`` for each unknown name with a close known one."""
    return ", ".join(f"{name} (did you mean {close[0]}?)" if (
        close := difflib.get_close_matches(name, known, n=1, cutoff=cutoff)) else name
        for name in unknown)


def _check_unknown_env(environ: Mapping[str, str]) -> None:
    known = known_env()
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    if not unknown:
        return
    raise ConfigError(
        f"training-patches: unknown environment variable(s) "
        f"{_did_you_mean(unknown, sorted(known), 0.75)}. "
        f"training-patches reads only these: {', '.join(sorted(known))}. A misspelled "
        f"variable would silently leave its setting at the default, so this is an error: "
        f"fix the name or unset it.")


def output_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written into the folder ``path`` (created if missing), or None.
    Nothing is created: the nearest existing folder is probed with a temporary file
    (``os.access`` alone says yes to root on a read-only mount)."""
    path = os.fspath(path)
    probe = path
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe.rstrip(os.sep))
        probe = parent or ("." if not os.path.isabs(probe) else os.sep)
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a folder"
    if probe and not os.path.isdir(probe):
        return f"cannot be created ({probe} is a file, not a folder)"
    if probe and not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot be written ({probe} is not writable)"
    try:
        with tempfile.TemporaryFile(dir=probe or "."):
            pass
    except OSError as exc:
        return f"cannot be written ({probe}: {exc.strerror or exc})"
    return None


def resolve(overrides: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None) -> Options:
    """Keyword overrides first, then ``TRAINING_PATCHES_*`` variables, then defaults.
    Unknown options and variables are errors (with a did-you-mean), and so are values that
    cannot be used together."""
    overrides = dict(overrides or {})
    environ = os.environ if environ is None else environ
    _check_unknown_env(environ)
    unknown = sorted(set(overrides) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"training-patches: unknown option(s) {_did_you_mean(unknown, list(OPTIONS))} "
            f"passed to apply(). "
            f"Known options: {', '.join(OPTIONS)}. Check the spelling; every option is "
            f"described in TRAINING_PATCHES_README.md."
        )
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        if option in overrides:
            values[option] = _parse(option, overrides[option], f"the option {option}=")
        elif env_name(option) in environ:
            sources[option] = f"the environment variable {env_name(option)}"
            values[option] = _parse(option, environ[env_name(option)], sources[option])
    options = Options(**values)

    def where(option: str) -> str:
        return sources.get(option, f"the option {option}=")

    for check in _checks.values():  # the units' rules for values unusable together
        check(options, where)
    return options


# How a use before any apply() reads the settings (patches._api installs check_settings),
# and (what the environment's settings were read from, the options read).
_first_use: Callable[[], Options] = resolve
_from_environment: tuple[Any, Options] | None = None


def current() -> Options:
    """The options of the current run's ``apply()``; before any, the ``TRAINING_PATCHES_*``
    variables read and validated as ``apply()`` reads them (again whenever they change), so
    a bad or unknown variable raises the :class:`ConfigError` activation would stop with."""
    options = _runstate.current().options
    if options is not None:
        return options
    global _from_environment
    key = (sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIX)),
           list(OPTIONS), list(_checks))
    found = _from_environment
    if found is None or found[0] != key:
        found = _from_environment = (key, _first_use())
    return found[1]


def set_current(options: Options | None) -> None:
    """Make ``options`` the current run's (``apply()``); None: as before any ``apply()``, the
    environment's at each use."""
    _runstate.current().options = options


def read_first_use_with(reader: Callable[[], Options]) -> None:
    """How :func:`current` reads the settings before any ``apply()``: ``reader()`` returns
    them validated (``patches._api.check_settings``: the very check of activation)."""
    global _first_use, _from_environment
    _first_use, _from_environment = reader, None


__all__ = ["ConfigError", "Option", "Options", "OPTIONS", "declare", "resolve", "merge",
           "fields_of", "owner_text", "known_env", "current", "set_current", "read_first_use_with",
           "env_name", "output_dir_problem", "flag", "positive_float", "positive_int",
           "nonnegative_int", "share", "whole", "nonnegative_float", "names", "FLOAT32_MAX",
           "FLOAT32_TINY", "INT32_MAX", "INT64_MAX"]
