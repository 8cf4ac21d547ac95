"""Options of the patches: keyword arguments, else environment variables, else defaults.

Every option is declared once in :data:`OPTIONS` with its environment variable,
its parser and its default; a bad value is a :class:`ConfigError` that names the
variable, the value found and what is expected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

ENV_PREFIX = "TRAINING_PATCHES_"


class ConfigError(ValueError):
    """An option or environment variable of training-patches has a value it cannot use."""


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _positive_float(text: Any) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("expected a finite number greater than 0")
    return value


def _positive_int(text: Any) -> int:
    if isinstance(text, float) and not text.is_integer():
        raise ValueError("expected a whole number")
    value = int(text)
    if value < 1:
        raise ValueError("expected a whole number of at least 1")
    return value


def _names(text: Any) -> tuple[str, ...]:
    if isinstance(text, str):
        items = text.split(",")
    else:
        items = list(text)
    return tuple(sorted({str(item).strip() for item in items if str(item).strip()}))


@dataclass(frozen=True)
class Options:
    """The resolved settings every patch reads (see TRAINING_PATCHES_README.md)."""

    disable: tuple[str, ...] = ()
    anomaly: bool = False
    init_scale: float = 1024.0
    growth_interval: int = 100
    log_interval: int = 500
    quiet: bool = False
    hysteresis: int = 1
    min_scale: float = 2.0 ** -14
    max_floor_skips: int = 10


# option -> (parser, example shown in errors)
OPTIONS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "disable": (_names, "a comma-separated list of patch names, e.g. 'anomaly,grad_clip'"),
    "anomaly": (_bool, "1 or 0"),
    "init_scale": (_positive_float, "a number greater than 0, e.g. 1024"),
    "growth_interval": (_positive_int, "a whole number of steps of at least 1, e.g. 100"),
    "log_interval": (_positive_int, "a whole number of steps of at least 1, e.g. 500"),
    "quiet": (_bool, "1 or 0"),
    "hysteresis": (_positive_int, "a whole number of at least 1 (1 = back off on every overflow)"),
    "min_scale": (_positive_float, "a number greater than 0, e.g. 6.1e-05"),
    "max_floor_skips": (_positive_int, "a whole number of steps of at least 1, e.g. 10"),
}


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def _parse(option: str, value: Any, source: str) -> Any:
    parser, expected = OPTIONS[option]
    if option in ("anomaly", "quiet") and isinstance(value, bool):
        return value
    try:
        return parser(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"training-patches: {source} is {value!r}, which is not usable ({exc}). "
            f"Expected {expected}. Fix the value or leave it out to use the default "
            f"({getattr(Options(), option)!r})."
        ) from None


def resolve(overrides: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None) -> Options:
    """Keyword overrides first, then ``TRAINING_PATCHES_*`` variables, then defaults."""
    overrides = dict(overrides or {})
    environ = os.environ if environ is None else environ
    unknown = sorted(set(overrides) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"training-patches: unknown option(s) {', '.join(unknown)} passed to apply(). "
            f"Known options: {', '.join(OPTIONS)}. Check the spelling; every option is "
            f"described in TRAINING_PATCHES_README.md."
        )
    values: dict[str, Any] = {}
    for option in OPTIONS:
        if option in overrides:
            values[option] = _parse(option, overrides[option], f"the option {option}=")
        elif env_name(option) in environ:
            values[option] = _parse(
                option, environ[env_name(option)], f"the environment variable {env_name(option)}")
    return replace(Options(), **values)


_current = Options()


def current() -> Options:
    """The options of the latest ``apply()`` (defaults before any)."""
    return _current


def set_current(options: Options) -> None:
    global _current
    _current = options


__all__ = ["ConfigError", "Options", "OPTIONS", "resolve", "current", "env_name"]
