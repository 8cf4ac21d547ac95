"""How the ``training-patches`` tools write their outputs and end on a signal.

- :func:`write_file`: a file that is complete or absent; the system refusing the write is
  :class:`WriteFailed`, one paragraph (the commands exit 1). Without ``replace`` it is created
  only if nothing is at the path *when it is written* (``os.link`` of a finished temporary
  file fails with ``EEXIST``), so two commands started together cannot both say "written";
  with ``replace`` it is swapped in with ``os.replace``. The file's mode follows the umask
  (``mkstemp`` would leave it 0600).
- :func:`same_file`: whether two paths name one file (the same path, or a link to it).
- :func:`check_output`: the one rule every command applies to a path it is asked to
  write, before it reads or computes anything: never an input (even with ``--force``),
  never another output of the same command, never a folder, only in an existing folder,
  and an existing file only with ``--force`` and only when it is of the kind the command
  writes there (:class:`OwnKind`, e.g. :func:`tool_json`): never a checkpoint, a run's
  record or a user's own file. A command never picks a default inside a
  run's folder: its defaults are the current folder (``report``'s picture) or stdout.
- :func:`write_json` / :func:`json_text`: the ``--json`` outputs: one strict JSON object
  (NaN and infinities written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``,
  as in the run records), to stdout for ``-`` or through :func:`write_file`.
- :func:`number`: the argparse type of a numeric option, finite and in its range.
- :func:`stop_on_signals`: SIGTERM (and SIGINT) raise :class:`Interrupted` in the main
  thread, so ``finally`` blocks run (temporary files removed, worker pools ended) and the
  command exits 143 (130) with one line instead of a traceback or orphaned workers.

It lives in the tools layer (issue 40): ``import patches.auto`` never loads it; the
checkpoint writer says a refused write with the same words (:func:`patches.checkpoint.errors.
write_refused`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .._run import strict_json
from ..checkpoint.errors import write_refused


STDOUT = "-"  # --json -: the JSON object on stdout


class OutputRefused(ValueError):
    """A path a command was asked to write breaks :func:`check_output`'s rule; the message
    is one paragraph for the user and nothing was written."""


class OutputExists(FileExistsError):
    """Another file appeared at the output path while the command ran (nothing written)."""


class WriteFailed(OSError):
    """The system refused to write an output (a full disk or quota, a read-only folder, no
    permission, over this process's file-size limit). The message is one paragraph; no
    partial file was left and a file that was at the path is unchanged. The commands exit 1.
    ``cause`` is the system's error."""

    def __init__(self, message: str, cause: OSError) -> None:
        super().__init__(message)
        self.cause = cause


def write_failed(path: str | os.PathLike[str], error: OSError, *,
                 again: str = "run the command again") -> WriteFailed:
    """The :class:`WriteFailed` paragraph for ``error`` raised while writing ``path``:
    what the system said, that nothing partial is left, and what to do (then ``again``)."""
    return WriteFailed(write_refused(path, error, again=again), error)


class Interrupted(BaseException):
    """The command got SIGINT or SIGTERM; ``exit_code`` is 128 + the signal number. A
    BaseException, like KeyboardInterrupt: ``except Exception`` in a worker does not stop it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {self.name}")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """True when ``a`` and ``b`` are one file: equal resolved paths, or (both existing) the
    same inode, as a hard or symbolic link gives."""
    try:
        if Path(a).resolve() == Path(b).resolve():
            return True
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


class OwnKind:
    """What a command writes to one of its outputs, for ``--force`` to tell its own earlier
    output (which it may replace) from any other file (which it never does).

    ``name`` says it in a sentence ("a JSON report of training-patches report");
    ``test(path)`` is true for a file of that kind."""

    def __init__(self, name: str, test: Callable[[str], bool]) -> None:
        self.name = name
        self.test = test


def _starts_with(path: str, first: bytes) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(64).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(first)
    except OSError:
        return False


def tool_json(tool: str) -> OwnKind:
    """The ``--json`` output of ``tool``: a JSON object whose ``"tool"`` is ``tool``."""
    def test(path: str) -> bool:
        if not _starts_with(path, b"{"):  # a checkpoint, a picture, ...: not read further
            return False
        try:
            with open(path, encoding="utf-8") as handle:
                value = json.load(handle)
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(value, dict) and value.get("tool") == tool

    return OwnKind(f"a JSON report written by {tool}", test)


def check_output(path: str | os.PathLike[str], *, prog: str, what: str, force: bool = False,
                 inputs: Iterable[tuple[str, str | os.PathLike[str] | None]] = (),
                 others: Iterable[tuple[str, str | os.PathLike[str] | None]] = (),
                 example: str | None = None, stdout: bool = True,
                 own: OwnKind | None = None) -> bool:
    """Raise :class:`OutputRefused` unless ``path`` (the value of option ``what`` of the
    command ``prog``) may be written; return whether a file is there (to be replaced).

    Refused: any of ``inputs`` ((name, path) pairs; with ``--force`` too), any of ``others``
    (the command's other outputs), a folder (with ``--force`` too), a path whose folder is
    missing or is a file, an existing file without ``force``, and (with ``force`` too) an
    existing file that is not of the kind ``own`` the command writes there: ``--force``
    replaces the command's own earlier output, never a checkpoint, a run's records or a
    user's file. ``example`` is a file name to suggest. ``-`` means stdout where the output
    is text the command can put there (``stdout``), and is refused otherwise (never a file
    named ``-``)."""
    path = os.fspath(path)
    suggest = f" (e.g. {example})" if example else ""
    if path == STDOUT:
        if stdout:
            return False
        raise OutputRefused(
            f"{prog}: {what} - would mean stdout, but {what} is a file this command writes "
            f"whole (its stdout carries what it reports), so nothing was written. Give a file "
            f"name{suggest}.")
    for name, source in inputs:
        if source is not None and same_file(path, source):
            raise OutputRefused(
                f"{prog}: {what} {path} is the {name} ({os.fspath(source)}), an input of this "
                f"command; an input is never overwritten, with --force or without, so nothing "
                f"was written. Give a new file name{suggest}.")
    for name, other in others:
        if other is not None and os.fspath(other) != STDOUT and same_file(path, other):
            raise OutputRefused(
                f"{prog}: {what} {path} and {name} {os.fspath(other)} are the same file: one "
                f"output would replace the other, so nothing was written. Expected two "
                f"different paths; give each its own name.")
    if os.path.isdir(path):
        raise OutputRefused(
            f"{prog}: {what} {path} is a folder; nothing was written (--force never replaces "
            f"a folder). Expected a file name; give a file in it"
            + (f" (e.g. {os.path.join(path, os.path.basename(example))})." if example else "."))
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OutputRefused(
            f"{prog}: {what} {path}: its folder {parent} does not exist (or is a file); "
            f"nothing was written. Expected a file in an existing folder. Create the folder "
            f"or give another path.")
    exists = os.path.lexists(path)
    if exists and own is not None and not own.test(path):
        raise OutputRefused(
            f"{prog}: {what} {path} already exists and is not {own.name} (it may be a "
            f"checkpoint, a run's record or your own file); --force replaces only a file of "
            f"that kind, so nothing was written and the file is untouched. Expected a path "
            f"that does not exist yet, or {own.name}. Give another path{suggest}.")
    if exists and not force:
        raise OutputRefused(
            f"{prog}: {what} {path} already exists; nothing was written. Expected a path that "
            f"does not exist yet. Give another path, or pass --force to replace it.")
    return exists


def json_text(value: Any) -> str:
    """``value`` as indented strict JSON (see the module docstring), newline-terminated;
    objects JSON lacks (paths, ...) become strings."""
    return json.dumps(strict_json(value), ensure_ascii=False, indent=1, allow_nan=False,
                      default=str) + "\n"


def write_json(path: str | os.PathLike[str], value: Any, *, replace: bool = False,
               prog: str = "training-patches", what: str = "--json") -> str:
    """Write ``value`` (:func:`json_text`) to stdout for ``-``, else atomically to ``path``
    (created if absent, or replaced when ``replace``); returns where it went. Another
    program creating ``path`` meanwhile is :class:`OutputRefused`, its file kept."""
    text = json_text(value)
    path = os.fspath(path)
    if path == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return "stdout"
    try:
        write_file(path, text.encode("utf-8"), replace=replace)
    except OutputExists:
        raise OutputRefused(
            f"{prog}: {what} {path} was created by another program while this command ran; "
            f"it was left as it is and nothing was written. Run again with another path, or "
            f"pass --force to replace it.") from None
    return path


def write_file(path: str | os.PathLike[str], data: bytes, *, replace: bool = False) -> Path:
    """Write ``data`` to ``path`` through a fsynced temporary file in the same folder.

    ``replace=False``: create ``path`` only if it does not exist at that moment, else raise
    :class:`OutputExists` (the temporary file is removed, whatever is at ``path`` is kept).
    ``replace=True``: replace it atomically. Either way a reader never sees half a file.
    The system refusing the write (full, read-only, over the file-size limit, ...) is
    :class:`WriteFailed`, with the temporary file removed.
    """
    path = Path(path)
    try:
        return _write_file(path, data, replace=replace)
    except (OutputExists, IsADirectoryError):
        raise
    except OSError as exc:
        raise write_failed(path, exc) from exc


def _write_file(path: Path, data: bytes, *, replace: bool) -> Path:
    folder = path.parent if str(path.parent) else Path(".")
    mode = 0o666 & ~_umask()
    for attempt in range(100):
        tmp = folder / f".{path.name}.tp-tmp-{os.getpid()}-{threading.get_ident()}-{attempt}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - a hundred leftovers of this very pid and thread
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(tmp))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError:
                    raise
                except OSError:  # a file system without hard links: claim the name, then swap
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
                    os.replace(tmp, path)
            except FileExistsError:
                raise OutputExists(errno.EEXIST, "created by another program while this "
                                   "command ran", str(path)) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
                    ) -> Iterator[None]:
    """While inside, each of ``signals`` raises :class:`Interrupted` in the main thread
    (elsewhere, or off the main thread, this does nothing). The previous handlers come back
    on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {}
    for signum in signals:
        previous[signum] = signal.signal(signum, raise_interrupted)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def number(kind: type = float, *, low: float | None = None, high: float | None = None,
           above: float | None = None, what: str = "") -> Callable[[str], float]:
    """An argparse ``type`` for a numeric option: a finite ``kind`` (``nan`` and ``inf``
    refused), at least ``low``, above ``above``, at most ``high``. The error names the range
    (argparse prints it with the option's name and exits 2)."""
    parts = [f"at least {low:g}" if low is not None else "",
             f"greater than {above:g}" if above is not None else "",
             f"at most {high:g}" if high is not None else ""]
    wanted = ("a whole number" if kind is int else "a finite number") + (
        " " + " and ".join(p for p in parts if p) if any(parts) else "") + (
        f" ({what})" if what else "")

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if (not math.isfinite(value) or (low is not None and value < low)
                or (above is not None and value <= above) or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


__all__ = ["write_file", "same_file", "check_output", "OwnKind", "tool_json", "WriteFailed",
           "write_failed", "json_text", "write_json",
           "stop_on_signals", "number", "Interrupted", "OutputExists", "OutputRefused", "STDOUT"]
