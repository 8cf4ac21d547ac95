"""The checkpoint's SHA-256, taken where the bytes pass anyway (issue 41).

One helper hashes a file (:func:`sha256_file`: a file's manifest check, a sharded folder's
shards). A load does not wait for it: the reader runs it in a thread while ``torch.load`` and
the loader's checks run (``hashlib`` and file reads release the GIL;
:class:`patches.checkpoint.reading.Verification`) and waits only before it changes anything.
A save hashes the bytes as ``torch.save`` writes them, a large block in a thread while it is
written (:func:`update_while`), and scans for NaN/Inf beside the write (:func:`beside`).
A hash is remembered while the file's inode, size and times are those it had when the hash
began and were older than it by more than any timestamp granularity (:data:`SETTLED_S`):
``resume('auto')`` then ``load_checkpoint`` read the file for its hash once. A write after
the hash began changes the file's change time (ctime), which no process can set back.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

# Bytes per read: large enough that hashlib releases the GIL and a read is one system call.
BLOCK = 1 << 22
# A write of at least this many bytes is hashed in a thread while it is written.
PARALLEL_BYTES = 1 << 20
# How much older than the hash a file's times must be for its result to be remembered: more
# than any file system's timestamp granularity (Linux: a clock tick; FAT: 2 s).
SETTLED_S = 3.0

# (real path, device, inode, size, mtime_ns, ctime_ns) -> SHA-256 hex of a file whose times
# were settled when it was hashed.
_verified: dict[tuple[Any, ...], str] = {}
_verified_lock = threading.Lock()
# Bytes read for a hash in this process (tests count them: a load reads its file once).
bytes_hashed = 0


def _identity(path: Path) -> tuple[tuple[Any, ...], float]:
    """(what identifies the file's content as it is now, its last change time in seconds)."""
    st = os.stat(path)
    return ((os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
             st.st_ctime_ns), max(st.st_mtime_ns, st.st_ctime_ns) / 1e9)


def _hash(path: Path, stop: threading.Event | None = None) -> str | None:
    """SHA-256 of ``path`` (None: stopped). Reads into one reused buffer."""
    global bytes_hashed
    key, changed = _identity(path)
    started = time.time()
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            if stop is not None and stop.is_set():
                return None
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
            bytes_hashed += count
    result = digest.hexdigest()
    if started - changed > SETTLED_S:
        with _verified_lock:
            _verified[key] = result
    return result


def sha256_file(path: str | os.PathLike[str], stop: threading.Event | None = None) -> str:
    """The SHA-256 (hex) of the file ``path``; remembered for a file unchanged since.
    ``stop`` set: the reading ends at the next block and "" is returned."""
    path = Path(path)
    try:
        with _verified_lock:
            known = _verified.get(_identity(path)[0])
    except OSError:
        known = None
    return known or _hash(path, stop) or ""


def beside(work: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``work`` in a thread now; the callable returned waits for its result (and
    re-raises what it raised). The save's finite scan runs beside its write so."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append((True, work()))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting thread
            done.append((False, exc))

    thread = threading.Thread(target=run, daemon=True, name="training-patches beside")
    thread.start()

    def result() -> Any:
        thread.join()
        ok, value = done[0]
        if not ok:
            raise value
        return value
    return result


def update_while(digest: Any, data: Any, write: Callable[[Any], int]) -> int:
    """``write(data)`` with ``digest.update(data)`` beside it: a large block is hashed in a
    thread while it is written (both release the GIL), a small one in turn. The data stays
    valid for the call, as ``torch.save`` promises a writer."""
    if memoryview(data).nbytes < PARALLEL_BYTES:
        digest.update(data)
        return write(data)
    hashed = beside(lambda: digest.update(data))
    try:
        return write(data)
    finally:
        hashed()  # joined before returning: the data is valid only during the call


__all__ = ["sha256_file", "beside", "update_while", "BLOCK", "PARALLEL_BYTES",
           "SETTLED_S"]
