"""Files that are either complete or absent, and a full disk said in one paragraph.

A temporary file in the same folder is written, flushed and fsynced, renamed over the
target with ``os.replace`` and the folder is fsynced. Free space is checked before a large
write (:func:`space_needed`); a write that runs out of space is a
:class:`~patches.checkpoint.errors.DiskFullError`, any other the system refuses a
:class:`~patches.checkpoint.errors.CheckpointWriteError`, the partial file removed. A save
that fits only in the place of the file it replaces (where upstream's ``torch.save`` writes)
is one WARNING and not written; training goes on (:func:`no_room`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .digest import ChunkedDigest, update_while
from .errors import CheckpointWriteError, DiskFullError, write_refused

# Marks the temporary files of an atomic write; the writer's pid and host follow it
# (``<pid>@<host>~``), so that a sweep on a shared filesystem can tell its own host's
# stale files from another machine's save in progress.
TMP_MARK = ".tp-tmp-"
# After TMP_MARK: pid, "@", host (letters, digits, "._-"), "~", then mkstemp's random part.
TMP_OWNER = re.compile(rf"{re.escape(TMP_MARK)}(\d+)@([A-Za-z0-9._-]+)~")


def host_name() -> str:
    """This machine's name as it appears in temporary file names (other characters -> "_")."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "unknown-host"


def temp_prefix(name: str) -> str:
    """The start of a temporary name for ``name``: ``.<name>.tp-tmp-<pid>@<host>~``."""
    return f".{name}{TMP_MARK}{os.getpid()}@{host_name()}~"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs. A zombie (killed, not yet reaped by
    its parent: a launcher killed with it) has ended: its temporary files are garbage."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or a pid this system cannot have: not "gone"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"  # after "(name)": state
    except (OSError, IndexError):
        return True  # no /proc (macOS): it answered the signal


# Errors that mean "no room": the disk is full or the user's quota is spent.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# What torch.save writes beside the tensors' bytes, at most: the records every file has
# (version, byte order, the pickle's and the zip's end records: 1.3 KB for an empty dict),
# and per tensor its pickle (rebuild call, storage key, shape, stride) and its zip record
# (two headers, its name, the 64-byte alignment of its data: about 260 bytes measured).
_FILE_RECORDS = 2048
_PER_TENSOR = 512
# The free space asked for beyond the estimate: 1/MARGIN of it (proportional to the file,
# never a fixed floor: a 12 KB checkpoint needs about 12 KB).
MARGIN = 32

logger = logging.getLogger("training_patches")


@dataclass(frozen=True)
class Written:
    """A completed atomic write: where, how many bytes, and their ``digest`` record (when
    asked: :class:`.digest.ChunkedDigest`, the manifest's field)."""

    path: Path
    size: int
    digest: dict[str, Any] | None


class _Sink:
    """The file handed to the writer: counts and (optionally) hashes what is written, and
    keeps the ``OSError`` a failed write raised (torch turns it into a RuntimeError)."""

    def __init__(self, handle: Any, digest: Any) -> None:
        self._handle = handle
        self._digest = digest
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written = (self._handle.write(data) if self._digest is None
                       else update_while(self._digest, data, self._handle.write))
        except OSError as exc:
            self.error = exc
            raise
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self._handle.flush()

    # No fileno(): torch's legacy format would then write storages to the descriptor
    # directly, past the count and the hash.


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; os.replace is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_free(folder: str | os.PathLike[str]) -> int | None:
    """Bytes free for this user in ``folder`` (``shutil.disk_usage``), None if unknown."""
    try:
        return int(shutil.disk_usage(folder).free)
    except (OSError, ValueError):
        return None


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "an unknown number of bytes"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes} bytes ({nbytes / (1 << shift):.1f} {unit})"
    return f"{nbytes} bytes"


def disk_full_error(path: Path, needed: int, free: int | None, *,
                    written: int | None = None) -> DiskFullError:
    """The one paragraph for a save that does not fit (before or during the write)."""
    folder = path.parent
    if written is None:
        what = (f"training-patches: not enough free space to write {path.name} in {folder}: "
                f"this save needs about {_size(needed)} and the folder has {_size(free)} free. "
                f"Nothing was written")
    else:
        what = (f"training-patches: the disk filled up while writing {path.name} in {folder}: "
                f"the system reported no space left after {_size(written)}; this save needs "
                f"about {_size(needed)} and the folder now has {_size(free)} free. The partial "
                f"file was removed")
    return DiskFullError(
        f"{what}, and the files already in {folder} are unchanged. Free space there (delete "
        f"old runs or checkpoints, or keep fewer with CheckpointManager(keep=...)), or write "
        f"to a folder on a larger disk, then save again.",
        folder=str(folder), needed=needed, free=free)


def ensure_free_space(path: str | os.PathLike[str], needed: int) -> None:
    """Raise :class:`DiskFullError` when ``path``'s folder has fewer than ``needed`` bytes
    (:class:`CheckpointWriteError` when it is on a read-only file system)."""
    path = Path(path)
    try:  # a read-only mount reports no free space: say what it is
        read_only = bool(os.statvfs(path.parent).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    if read_only:
        raise _write_error(path, OSError(errno.EROFS, os.strerror(errno.EROFS), str(path)),
                           needed, written=0)
    free = disk_free(path.parent)
    if free is not None and free < needed:
        raise disk_full_error(path, needed, free)


def _sizes(obj: Any) -> tuple[int, int]:
    """(the bytes of ``obj``'s tensors, every storage once; about how many bytes
    ``torch.save(obj)`` writes, an upper estimate: those plus the records and the pickle)."""
    seen_storages: set[tuple[str, int, int]] = set()
    seen_objects: set[int] = set()  # containers of obj (alive as long as obj: ids stay theirs)
    data, total = 0, _FILE_RECORDS
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += _PER_TENSOR
            try:
                storage = item.untyped_storage()
                key = (str(item.device), storage.data_ptr(), storage.nbytes())
                if key[1] == 0 or key not in seen_storages:
                    seen_storages.add(key)
                    data += storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse and other layouts
                data += item.element_size() * item.numel()
        elif isinstance(item, (dict, list, tuple, set, frozenset)):
            if id(item) in seen_objects:
                continue
            seen_objects.add(id(item))
            if isinstance(item, dict):  # keys and values themselves: no pairs made here
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
            total += 8 + 2 * len(item)
        elif isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass")) + 5
        elif isinstance(item, (bytes, bytearray)):
            total += len(item) + 5
        elif isinstance(item, (bool, type(None))):
            total += 1
        elif isinstance(item, (int, float)):
            total += 9 if isinstance(item, float) or -(2**63) <= item < 2**63 else 9 + (
                item.bit_length() // 8)
        elif isinstance(getattr(item, "nbytes", None), int):  # numpy arrays (RNG states)
            total += item.nbytes + 128
        else:
            total += 64
    return data, total + data


def space_needed(obj: Any) -> tuple[int, int]:
    """(the free space a save of ``obj`` asks for: the estimate and 1/:data:`MARGIN` of it
    more; the least its file can be: the tensors' own bytes)."""
    least, estimate = _sizes(obj)
    return estimate + estimate // MARGIN, least


def file_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    """The bytes of the files among ``paths`` that exist."""
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_size
        except OSError:
            pass
    return total


def no_room(error: DiskFullError, path: Path, least: int, replaced: list[Path]) -> bool:
    """Whether a save that found no room for ``path`` is skipped (True: one WARNING said so)
    or raised (False: re-raise ``error``): skipped when its tensors' bytes (``least``) would
    fit in the place of the files it replaces (``replaced``), as upstream's in-place save."""
    folder = path.parent
    free = disk_free(folder)
    old = file_bytes(replaced)
    if not replaced or old == 0 or free is None or free + old < least:
        return False
    kept = ", ".join(p.name for p in replaced)
    short = error.needed - free
    logger.warning(
        "training-patches: %s was NOT written: %s has %s free and this save needs about %s "
        "beside %s (%s, kept whole: an atomic save writes the new file next to the old one "
        "and replaces it only once the new one is complete, so that a run stopped during the "
        "write still has a good checkpoint). Training goes on; the next save tries again. "
        "Free %s in %s (old runs, other files), or write the checkpoints to a larger disk.",
        path.name, folder, _size(free), _size(error.needed), kept, _size(old),
        f"about {_size(short)}" if short > 0 else "more room", folder)
    return True


def _write_error(path: Path, error: OSError, needed: int | None, *,
                 written: int) -> CheckpointWriteError:
    """The one paragraph of a write the system refused: :class:`DiskFullError` for a full
    disk or quota, else (read-only, no permission, over ``ulimit -f``, ...) what it said."""
    if error.errno in _NO_SPACE:
        return disk_full_error(path, max(needed or 0, written), disk_free(path.parent),
                               written=written)
    said = write_refused(path, error, again="save again")
    return CheckpointWriteError(f"training-patches: {said} The files already in {path.parent} "
                                f"are unchanged.")


def write_atomically(path: str | os.PathLike[str], write: Callable[[Any], Any], *,
                     digest: bool = False, needed: int | None = None) -> Written:
    """:func:`atomic_write` that also returns the size and (``digest``) the digest record of
    the bytes as they are written; ``needed`` goes into the paragraph of a full disk."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The pid and host in the name tell a killed writer's file (CheckpointManager._sweep_temp)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
    except OSError as exc:  # a read-only or full folder refuses even the temporary file
        raise _write_error(path, exc, needed, written=0) from exc
    sink: _Sink | None = None
    try:
        with os.fdopen(fd, "wb") as handle:
            sink = _Sink(handle, ChunkedDigest() if digest else None)
            write(sink)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        error = sink.error if sink is not None and sink.error is not None else exc
        if isinstance(error, OSError):  # torch reports it as "[enforce fail at ...]"
            raise _write_error(path, error, needed,
                               written=sink.size if sink is not None else 0) from exc
        raise
    _fsync_dir(path.parent)
    size = sink.size
    record = sink._digest.record() if sink._digest is not None else None
    return Written(path, size, record)


def atomic_write(path: str | os.PathLike[str], write: Any) -> Path:
    """Write ``path`` through ``write(file)`` so that it is either complete or absent (on
    any error ``path`` keeps its previous content; a full disk raises
    :class:`~patches.checkpoint.errors.DiskFullError`)."""
    return write_atomically(path, write).path


def atomic_torch_save(obj: Any, path: str | os.PathLike[str], *, check_space: bool = True,
                      **kwargs: Any) -> Path | None:
    """``torch.save`` that never leaves a torn file at ``path`` (see :func:`atomic_write`).

    With ``check_space`` the free space is checked first (:func:`space_needed`). ``kwargs``
    go to ``torch.save``. Returns ``path``, or None when the new file fits only in the place
    of the one it replaces (:func:`no_room`: one WARNING, the old file kept whole).
    """
    path = Path(path)
    needed, least = space_needed(obj)
    try:
        if check_space:
            path.parent.mkdir(parents=True, exist_ok=True)
            ensure_free_space(path, needed)
        return write_atomically(path, lambda handle: torch.save(obj, handle, **kwargs),
                                needed=needed).path
    except DiskFullError as exc:
        if no_room(exc, path, least, [path] if path.is_file() else []):
            return None
        raise


def atomic_text(path: Path, text: str) -> None:
    """A small text file written with :func:`atomic_write` (UTF-8)."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


__all__ = ["atomic_write", "atomic_torch_save", "atomic_text", "write_atomically",
           "space_needed", "no_room", "file_bytes", "ensure_free_space",
           "disk_free", "Written", "TMP_MARK", "TMP_OWNER", "host_name", "temp_prefix", "MARGIN",
           "pid_alive"]
