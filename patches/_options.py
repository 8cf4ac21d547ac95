"""Options of the patches: keyword arguments, else environment variables, else defaults.

Each option is an :class:`Option` declared by the unit it belongs to (a patch's
``PatchSpec.options``, an integration's ``Integration.options``), with its parser, default,
one-line help and the text shown when a value is bad; the library-wide ones are declared
here. :class:`Options`, the owner of each option, the banner's options line, ``doctor``,
the did-you-mean for a misspelled variable and the options table of
TRAINING_PATCHES_README.md (``training-patches options --markdown``) all read
:data:`OPTIONS`, filled by :func:`declare`. A bad value is a :class:`ConfigError` that
names the variable, the value found and what is expected.
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


def positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("expected a finite number greater than 0")
    return value


def _whole(text: Any, least: int) -> int:
    if isinstance(text, float) and not text.is_integer():
        raise ValueError("expected a whole number")
    value = int(text)
    if value < least:
        raise ValueError(f"expected a whole number of at least {least}")
    return value


def positive_int(text: Any) -> int:
    return _whole(text, 1)


def nonnegative_int(text: Any) -> int:
    return _whole(text, 0)


def share(text: Any) -> float:
    """A finite number; a share's bounds (above 0, at most 1) are its Option's ``low``/``high``."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def nonnegative_float(text: Any) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError("expected a finite number of at least 0")
    return value


# What the machine can honour: a loss scale lives in a float32 tensor (finite, and not
# rounded to 0), the scaler's growth tracker and hysteresis counter in int32 tensors, every
# other count in the int64 counters of patches._counters.
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
    """One setting: ``name`` (the keyword of :func:`patches.advanced.apply`), read from the
    environment variable ``TRAINING_PATCHES_<NAME>``.

    ``parse`` turns a keyword value or the variable's text into the value (raising
    ValueError with what is wrong); ``expected`` is shown in the error; ``help`` is the
    options table's one line; ``shown_default`` is the table's default where the value's
    repr is not how a user writes it (``2^-14``, ``off``). ``low``/``high`` bound a
    number to what the machine can honour (a window it can allocate, a scale finite in
    float32, a count in int64), ``bound_why`` says why: validation, ``doctor`` and the
    table's range column all read them. ``also`` names other patches that read the option: applying any of them
    sets it. ``owners`` is filled by :func:`declare` (empty: the whole library).
    """

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
        low = "" if self.low is None else (
            f"above {number_text(self.low)}" if self.low_open else f"at least {number_text(self.low)}")
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


# A check of values each valid alone but unusable together: (options, where) where
# ``where(name)`` names the option's source in the error; raises ConfigError.
Check = Callable[["Options", Callable[[str], str]], None]

# Every declared option, in declaration order (library-wide first, then each unit as
# :mod:`patches` imports it): the order of the banner's options line and of the table.
OPTIONS: dict[str, Option] = {}
_checks: dict[str, Check] = {}


def declare(owner: str | None, options: tuple[Option, ...] = (),
            check: Check | None = None) -> tuple[Option, ...]:
    """Declare the options of the unit ``owner`` (None: library-wide) and its cross-option
    ``check``; returns them with their owners filled. Called by
    :func:`patches._registry.register`; a name declared twice is a programming error."""
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
    """The resolved settings every patch reads: one attribute per declared option
    (``opts.init_scale``), its default unless given. Immutable; :meth:`replace` makes a
    changed copy. See TRAINING_PATCHES_README.md for every option."""

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
        raise ConfigError(
            f"training-patches: {source} is {value!r}, which is not usable ({exc}). "
            f"Expected {declared.expected}"
            + (f" ({declared.range_text})" if declared.range_text else "")
            + f". Fix the value or leave it out to use the default ({declared.default!r})."
        ) from None
    why = declared.out_of_range(parsed)
    if why is not None:
        raise ConfigError(
            f"training-patches: {source} is {value!r}, which is out of range ({why}). "
            f"Expected {declared.expected}: {declared.range_text}"
            + (f" ({declared.bound_why})" if declared.bound_why else "")
            + f". Fix the value or leave it out to use the default ({declared.default!r}).")
    return parsed


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


def _check_unknown_env(environ: Mapping[str, str]) -> None:
    known = known_env()
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise ConfigError(
        f"training-patches: unknown environment variable(s) {', '.join(hints)}. "
        f"training-patches reads only these: {', '.join(sorted(known))}. A misspelled "
        f"variable would silently leave its setting at the default, so this is an error: "
        f"fix the name or unset it.")


def output_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written into the folder ``path`` (created if missing), or None.

    Nothing is created: the nearest existing folder on the way is checked instead, and
    an existing folder is probed by creating and removing a temporary file (``os.access``
    alone says yes to root on a read-only mount)."""
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

    Unknown options and unknown ``TRAINING_PATCHES_*`` variables are errors (with a
    did-you-mean), and so are values that cannot be used together."""
    overrides = dict(overrides or {})
    environ = os.environ if environ is None else environ
    _check_unknown_env(environ)
    unknown = sorted(set(overrides) - set(OPTIONS))
    if unknown:
        hints = [f"{name} (did you mean {close[0]}?)"
                 if (close := difflib.get_close_matches(name, list(OPTIONS), n=1)) else name
                 for name in unknown]
        raise ConfigError(
            f"training-patches: unknown option(s) {', '.join(hints)} passed to apply(). "
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


# How a use before any apply() reads the settings: patches._api installs check_settings, so
# that they are read and validated exactly as activation reads them (resolve() until then).
_first_use: Callable[[], Options] = resolve
# (what the environment's settings were read from, the options read)
_from_environment: tuple[Any, Options] | None = None


def current() -> Options:
    """The options of the current run's ``apply()``; before any (a library used without the
    activation line: ``load_checkpoint`` in a plain loop, a tool), the ``TRAINING_PATCHES_*``
    variables read and validated as ``apply()`` reads them, again whenever they change.
    Either way a setting means the same; a bad or unknown variable raises the
    :class:`ConfigError` activation would stop with, at the first use."""
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
           "env_name", "output_dir_problem",
           "flag", "positive_float", "positive_int", "nonnegative_int", "window", "share",
           "nonnegative_float",
           "names", "FLOAT32_MAX", "FLOAT32_TINY", "INT32_MAX", "INT64_MAX"]
