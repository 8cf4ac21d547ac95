"""The errors a checkpoint can raise; every message is one paragraph naming the file,
what was found, what was expected and what to do."""

from __future__ import annotations


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


__all__ = ["CheckpointError", "UnsafeCheckpointError", "CheckpointMismatchError",
           "TokenizerMismatchError", "CheckpointWriteError", "DiskFullError"]
