"""The errors a checkpoint can raise; every message is one paragraph naming the file,
what was found, what was expected and what to do."""

from __future__ import annotations

import errno
import os


class CheckpointError(ValueError):
    """A checkpoint file cannot be used as it is; the message says why and what to do."""


class UnsafeCheckpointError(CheckpointError):
    """The file needs arbitrary code to unpickle; it was refused and none of it ran."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model/optimizer (other than a vocabulary growth)."""


class TokenizerMismatchError(CheckpointMismatchError):
    """The tokenizer given for the spelled new rows cannot be read, or does not fit the
    model; nothing was loaded."""


class CheckpointWriteError(CheckpointError):
    """The system refused to write a checkpoint (a read-only folder, no permission, over
    the process's file-size limit, a full disk: :class:`DiskFullError`). Nothing of the save
    was left behind and the files already in the folder are unchanged."""


class DiskFullError(CheckpointWriteError):
    """Not enough free space in the checkpoint folder; nothing of the save was left behind.

    ``folder``, ``needed`` and ``free`` (bytes) say where and how much.
    """

    def __init__(self, message: str, *, folder: str, needed: int, free: int | None) -> None:
        super().__init__(message)
        self.folder = folder
        self.needed = needed
        self.free = free


# Why a write failed, by errno, and what to do about it (the tools' outputs say it alike).
_WRITE_FAILURES = {
    errno.ENOSPC: ("the disk is full", "Free space there, or write to another disk"),
    errno.EDQUOT: ("your disk quota is spent", "Free space in your quota, or write elsewhere"),
    errno.EROFS: ("the file system is read-only", "Write to a writable folder"),
    errno.EACCES: ("permission was denied", "Write to a folder you may write to"),
    errno.EPERM: ("the operation is not permitted", "Write to a folder you may write to"),
    errno.EFBIG: ("the file would pass this process's file-size limit (ulimit -f)",
                  "Raise the limit (ulimit -f unlimited), or write a smaller output"),
}


def write_refused(path: str | os.PathLike[str], error: OSError, *, again: str) -> str:
    """The paragraph for ``error`` raised while writing ``path``: what the system said,
    that nothing partial is left, and what to do (then ``again``)."""
    why, todo = _WRITE_FAILURES.get(error.errno or 0, (
        error.strerror or str(error) or type(error).__name__, "Write to another place"))
    return (f"could not write {os.fspath(path)}: {why} ({error.strerror or error}). No partial "
            f"file was left, and a file that was at that path is unchanged. {todo}, then "
            f"{again}.")


__all__ = ["write_refused", "CheckpointError", "UnsafeCheckpointError", "CheckpointMismatchError",
           "TokenizerMismatchError", "CheckpointWriteError", "DiskFullError"]
