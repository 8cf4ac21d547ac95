"""How the ``training-patches`` tools write their outputs and end on a signal.

- :func:`write_file`: a file that is complete or absent. Without ``replace`` it is created
  only if nothing is at the path *when it is written* (``os.link`` of a finished temporary
  file fails with ``EEXIST``), so two commands started together cannot both say "written";
  with ``replace`` it is swapped in with ``os.replace``. The file's mode follows the umask
  (``mkstemp`` would leave it 0600).
- :func:`same_file`: whether two paths name one file (the same path, or a link to it).
- :func:`number`: the argparse type of a numeric option, finite and in its range.
- :func:`stop_on_signals`: SIGTERM (and SIGINT) raise :class:`Interrupted` in the main
  thread, so ``finally`` blocks run (temporary files removed, worker pools ended) and the
  command exits 143 (130) with one line instead of a traceback or orphaned workers.

Nothing here imports torch: the tools' ``--help`` and their refusals stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator


class OutputExists(FileExistsError):
    """Another file appeared at the output path while the command ran (nothing written)."""


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


def write_file(path: str | os.PathLike[str], data: bytes, *, replace: bool = False) -> Path:
    """Write ``data`` to ``path`` through a fsynced temporary file in the same folder.

    ``replace=False``: create ``path`` only if it does not exist at that moment, else raise
    :class:`OutputExists` (the temporary file is removed, whatever is at ``path`` is kept).
    ``replace=True``: replace it atomically. Either way a reader never sees half a file.
    """
    path = Path(path)
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
    import math

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


__all__ = ["write_file", "same_file", "stop_on_signals", "number", "Interrupted",
           "OutputExists"]
