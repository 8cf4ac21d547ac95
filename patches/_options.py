"""Options of the patches: keyword arguments, else environment variables, else defaults.

Every option is declared once in :data:`OPTIONS` with its environment variable,
its parser and its default; a bad value is a :class:`ConfigError` that names the
variable, the value found and what is expected.
"""

from __future__ import annotations

import difflib
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


def _window(text: Any) -> int:
    value = _positive_int(text)
    if value < 2:
        raise ValueError("expected a whole number of at least 2")
    return value


def _share(text: Any) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError("expected a fraction above 0 and at most 1")
    return value


def _nonnegative_float(text: Any) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError("expected a finite number of at least 0")
    return value


def _base_vocab(text: Any) -> int | None:
    """Rows of the original vocabulary to freeze; 0, empty or None leave it off."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "0", "off", "none")):
        return None
    if isinstance(text, (int, float)) and text == 0:
        return None
    return _positive_int(text.strip() if isinstance(text, str) else text)


def _names(text: Any) -> tuple[str, ...]:
    if isinstance(text, str):
        items = text.split(",")
    else:
        items = list(text)
    return tuple(sorted({str(item).strip() for item in items if str(item).strip()}))


def _resume_policy(text: Any) -> str:
    value = str(text).strip().lower()
    if value not in ("remap", "reset"):
        raise ValueError("expected remap or reset")
    return value


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
    base_vocab: int | None = None
    max_bad_steps: int = 25
    spike_k: float = 0.0
    spike_window: int = 100
    lr_step_on_skip: bool = True
    replay: bool = True
    max_drop_share: float = 0.5
    output_dir: str = ""
    amharic_homophones: bool = False
    resume_policy: str = "remap"
    strict: bool = False
    clip_unscale_first: bool = False
    max_oom_skips: int = 3


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
    "base_vocab": (_base_vocab, "a whole number of base tokens, e.g. 12000 (0 or empty = off)"),
    "max_bad_steps": (_positive_int, "a whole number of steps of at least 1, e.g. 25"),
    "spike_k": (_nonnegative_float, "a number of standard deviations, e.g. 6 (0 = off)"),
    "spike_window": (_window, "a whole number of steps of at least 2, e.g. 100"),
    "lr_step_on_skip": (_bool, "1 or 0"),
    "replay": (_bool, "1 or 0"),
    "max_drop_share": (_share, "a fraction above 0 and at most 1, e.g. 0.5 (stop when more "
                               "than half the samples cannot be loaded)"),
    "output_dir": (str, "a directory for the run's reports (e.g. dropped_samples.jsonl); empty "
                        "means the coqui Trainer's output folder, else the working directory"),
    "amharic_homophones": (_bool, "1 or 0"),
    "resume_policy": (_resume_policy, "remap (keep optimizer, scheduler and scaler; grow moments "
                                      "of resized rows) or reset (start all three fresh)"),
    "clip_unscale_first": (_bool, "1 or 0 (1: clip_grad_norm_ on gradients a SafeGradScaler has "
                                  "not unscaled yet treats max_norm as a limit on the true "
                                  "gradients; 0: clips them as torch does)"),
    "max_oom_skips": (_positive_int, "a whole number of batches of at least 1, e.g. 3"),
    "strict": (_bool, "1 or 0 (1: a patch site that is missing, fails, or sits in an "
                      "unsupported upstream version is an error instead of a warning)"),
}

# The patch each option belongs to (None: the whole library). Applying one patch sets only
# its own options and the library-wide ones given explicitly; see :func:`merge`.
OWNERS: dict[str, tuple[str, ...]] = {
    "anomaly": ("anomaly",),
    "init_scale": ("grad_scaler",), "growth_interval": ("grad_scaler",),
    "hysteresis": ("grad_scaler",), "min_scale": ("grad_scaler",),
    "max_floor_skips": ("grad_scaler",), "log_interval": ("grad_scaler", "nan_guard"),
    "base_vocab": ("vocab_freeze",),
    "max_bad_steps": ("nan_guard",), "spike_k": ("nan_guard",), "spike_window": ("nan_guard",),
    "lr_step_on_skip": ("nan_guard",), "replay": ("nan_guard",),
    "max_drop_share": ("dataset_guard",), "amharic_homophones": ("languages",),
    "resume_policy": ("checkpoint",), "clip_unscale_first": ("grad_clip",),
    "max_oom_skips": ("oom_guard",),
}

# TRAINING_PATCHES_* variables that are not options but are read by the library.
OTHER_ENV: set[str] = {
    "TRAINING_PATCHES_LAUNCHED",  # set by `training-patches run` in the processes it starts
    "TRAINING_PATCHES_RUN_ID",  # the run_id of every record (_run.run_id)
}


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def _parse(option: str, value: Any, source: str) -> Any:
    parser, expected = OPTIONS[option]
    if parser is _bool and isinstance(value, bool):
        return value
    try:
        return parser(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"training-patches: {source} is {value!r}, which is not usable ({exc}). "
            f"Expected {expected}. Fix the value or leave it out to use the default "
            f"({getattr(Options(), option)!r})."
        ) from None


def fields_of(patch: str) -> list[str]:
    """The options that belong to one patch."""
    return [option for option, owners in OWNERS.items() if patch in owners]


def merge(current: Options, new: Options, *, touched: set[str], explicit: set[str]) -> Options:
    """``current`` with the options of the ``touched`` patches taken from ``new``, and the
    library-wide options taken from ``new`` only where they were given explicitly."""
    changes = {}
    for option in OPTIONS:
        owners = OWNERS.get(option)
        if (owners is None and option in explicit) or (owners and touched & set(owners)):
            changes[option] = getattr(new, option)
    return replace(current, **changes)


def _check_unknown_env(environ: Mapping[str, str]) -> None:
    known = {env_name(option) for option in OPTIONS} | OTHER_ENV
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


def _check_together(options: Options, source: Mapping[str, str]) -> None:
    """Cross-field rules: values each valid alone, unusable together."""
    def name(option: str) -> str:
        return source.get(option, f"the option {option}=")

    if options.min_scale > options.init_scale:
        raise ConfigError(
            f"training-patches: {name('min_scale')} is {options.min_scale!r}, above "
            f"{name('init_scale')} {options.init_scale!r}. Expected the loss-scale floor at or "
            f"below the initial scale (the defaults are 6.1e-05 and 1024). Lower the floor or "
            f"raise the initial scale.")
    if options.spike_k > 0 and options.spike_window < 2:
        raise ConfigError(
            f"training-patches: {name('spike_window')} is {options.spike_window!r}; the loss "
            f"spike test needs a standard deviation, so expected a window of at least 2 steps "
            f"(default 100). Raise it, or turn the spike test off with spike_k=0.")
    if options.output_dir:
        problem = output_dir_problem(options.output_dir)
        if problem:
            raise ConfigError(
                f"training-patches: {name('output_dir')} is {options.output_dir!r}, which "
                f"{problem}. Expected a folder where the run's reports (nonfinite_events.jsonl, "
                f"dropped_samples.jsonl) can be written. Point it at a writable folder, or unset "
                f"it to use the trainer's output folder.")


def output_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written into the folder ``path`` (created if missing), or None.

    Nothing is created: the nearest existing folder on the way is checked instead, and
    an existing folder is probed by creating and removing a temporary file (``os.access``
    alone says yes to root on a read-only mount)."""
    import tempfile

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
        raise ConfigError(
            f"training-patches: unknown option(s) {', '.join(unknown)} passed to apply(). "
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
    options = replace(Options(), **values)
    _check_together(options, sources)
    return options


_current = Options()


def current() -> Options:
    """The options of the latest ``apply()`` (defaults before any)."""
    return _current


def set_current(options: Options) -> None:
    global _current
    _current = options


__all__ = ["ConfigError", "Options", "OPTIONS", "OWNERS", "resolve", "merge", "fields_of",
           "current", "env_name", "output_dir_problem"]
