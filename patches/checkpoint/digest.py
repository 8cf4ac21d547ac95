"""The checkpoint's digest, taken where the bytes pass anyway (issue 41).

A manifest's ``digest`` record: the file cut into chunks of ``chunk_bytes``, each hashed on
its own with ``"blake3"`` (about 5 GB/s on one core: the check keeps up with ``torch.load``)
or ``"sha256"`` where that package is missing; chunks let several threads hash one file and
name the bytes that changed. A load hashes beside ``torch.load``
(:class:`patches.checkpoint.reading.Verification`), a save as ``torch.save`` writes
(:func:`update_while`). A hash is remembered while the file's inode, size and times are
those it had, older than the hash by :data:`SETTLED_S` (a later write changes the ctime).
The fields: docs/reference/manifest.md.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

# The blake3 module, imported at the first digest (4 ms of `import patches.auto`); None
# where it is missing (tests set None to stand for that).
_NOT_LOADED: Any = object()
_blake3: Any = _NOT_LOADED


def _blake3_module() -> Any:
    global _blake3
    if _blake3 is _NOT_LOADED:
        try:
            import blake3  # lazy: 4 ms of the import line, needed only at a digest
        except ImportError:
            blake3 = None
        _blake3 = blake3
    return _blake3

# Bytes per read of a chunk: the buffer stays in the core's cache between the read and the
# hash (1 MiB: 0.42 s of CPU for 1.8 GB with BLAKE3 here, 4 MiB: 0.46 s).
READ_BLOCK = 1 << 20
# Bytes per hash call from a memory map: a stop is seen within one of them.
MAPPED_BLOCK = 16 << 20
# A write of at least this many bytes is hashed in a thread while it is written.
PARALLEL_BYTES = 1 << 20
# How much older than the hash a file's times must be for its result to be remembered: more
# than any file system's timestamp granularity (Linux: a clock tick; FAT: 2 s).
SETTLED_S = 3.0
# The manifest's "digest" record: its version, the chunk size saves use, the algorithms read.
DIGEST_VERSION = 1
CHUNK_BYTES = 64 << 20
ALGORITHMS = ("blake3", "sha256")
NAMES = {"blake3": "BLAKE3", "sha256": "SHA-256"}
# At most this many threads hash one file's chunks.
MAX_WORKERS = 8

# (real path, device, inode, size, mtime_ns, ctime_ns, algorithm, chunk_bytes) -> the chunks'
# digests of a file whose times were settled when it was hashed.
_verified: dict[tuple[Any, ...], Any] = {}
_verified_lock = threading.Lock()
# Bytes read for a hash in this process (tests count them: a load reads its file once).
bytes_hashed = 0
_count_lock = threading.Lock()


def _counted(count: int) -> None:
    global bytes_hashed
    with _count_lock:  # chunks are hashed by several threads at once
        bytes_hashed += count


def _identity(path: Path) -> tuple[tuple[Any, ...], float]:
    """(what identifies the file's content as it is now, its last change time in seconds)."""
    st = os.stat(path)
    return ((os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
             st.st_ctime_ns), max(st.st_mtime_ns, st.st_ctime_ns) / 1e9)


def default_algorithm() -> str:
    """The algorithm a save uses: ``"blake3"`` where the package is installed, else
    ``"sha256"``."""
    return "blake3" if _blake3_module() is not None else "sha256"


def can_check(algorithm: str) -> bool:
    """Whether this process can compute ``algorithm`` (BLAKE3 needs the blake3 package)."""
    return algorithm == "sha256" or (algorithm == "blake3" and _blake3_module() is not None)


def _hasher(algorithm: str) -> Any:
    module = _blake3_module() if algorithm == "blake3" else None
    if module is not None:
        return module.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"cannot compute the {algorithm!r} digest here")


def chunk_count(size: int, chunk_bytes: int) -> int:
    """How many chunks a digest record of a ``size``-byte file lists (one for an empty one)."""
    return max(1, -(-size // chunk_bytes))


class ChunkedDigest:
    """The ``digest`` record of a stream of bytes fed in order through :meth:`update` (a
    save: the bytes as torch.save writes them; the file is not read back)."""

    def __init__(self, algorithm: str | None = None, chunk_bytes: int | None = None) -> None:
        self.algorithm = algorithm or default_algorithm()
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._chunks: list[str] = []
        self._current = _hasher(self.algorithm)
        self._filled = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(self.chunk_bytes - self._filled, view.nbytes)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._chunks.append(self._current.hexdigest())
                self._current, self._filled = _hasher(self.algorithm), 0

    def record(self) -> dict[str, Any]:
        """The manifest's ``digest``: version, algorithm, chunk size, each chunk's hex."""
        chunks = list(self._chunks)
        if self._filled or not chunks:
            chunks.append(self._current.hexdigest())
        return {"version": DIGEST_VERSION, "algorithm": self.algorithm,
                "chunk_bytes": self.chunk_bytes, "chunks": chunks}


def _workers(count: int, beside_load: bool = True) -> int:
    """Threads for ``count`` chunks: every core, but the one the load runs on when the hash
    runs beside it."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, min(count, cpus - beside_load, MAX_WORKERS))


def _read_chunk(handle: Any, view: memoryview, hasher: Any, start: int, length: int | None,
                stop: threading.Event | None) -> bool:
    """Hash ``length`` bytes (None: to the end) of the file from ``start``, read into
    ``view``; False: stopped."""
    handle.seek(start)
    while length is None or length > 0:
        if stop is not None and stop.is_set():
            return False
        read = handle.readinto(view if length is None or length >= len(view)
                               else view[:length])
        if not read:
            break
        hasher.update(view[:read])
        _counted(read)
        if length is not None:
            length -= read
    return True


def _mapped_chunk(mapping: mmap.mmap, mapped: memoryview, hasher: Any, start: int,
                  length: int | None, stop: threading.Event | None) -> bool:
    """:func:`_read_chunk` from the file's mapping (no copy); each block's pages are dropped
    from the mapping once hashed, so the resident size does not count the file twice."""
    end = len(mapped) if length is None else min(start + length, len(mapped))
    for low in range(start, end, MAPPED_BLOCK):
        if stop is not None and stop.is_set():
            return False
        high = min(low + MAPPED_BLOCK, end)
        with mapped[low:high] as block:  # released: the map closes after
            hasher.update(block)
            _counted(len(block))
        if hasattr(mapping, "madvise"):  # not on Windows
            aligned = low - low % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_DONTNEED, aligned, high - aligned)
    return True


def _hash_chunks(path: Path, algorithm: str, chunk_bytes: int, count: int,
                 stop: threading.Event | None, expected: list[str] | None,
                 mapped: bool = False, beside_load: bool = False) -> list[str | None] | None:
    """Each chunk's digest, hashed by :func:`_workers` threads (the last chunk reads to the
    end, so bytes appended show); None: ``stop`` was set. With ``expected``, a chunk that
    differs ends the others (those not hashed then are None). ``mapped``: read through a
    memory map (only where the load maps it too); ``beside_load``: leave one core free."""
    found: list[str | None] = [None] * count
    order = itertools.count()  # next() of it is atomic: each chunk is taken once
    differs = threading.Event()
    errors: list[BaseException] = []

    def work() -> None:
        mapping: mmap.mmap | None = None
        view: memoryview | None = None
        try:
            with open(path, "rb", buffering=0) as handle:
                if mapped and os.fstat(handle.fileno()).st_size:
                    mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                    view = memoryview(mapping)
                else:
                    view = memoryview(bytearray(READ_BLOCK))
                while True:
                    index = next(order)
                    if index >= count or differs.is_set() or (stop is not None
                                                              and stop.is_set()):
                        return
                    hasher = _hasher(algorithm)
                    length = chunk_bytes if index < count - 1 else None
                    hash_chunk = (lambda *args: _mapped_chunk(mapping, *args)) if mapping \
                        is not None else (lambda *args: _read_chunk(handle, *args))
                    if not hash_chunk(view, hasher, index * chunk_bytes, length, stop):
                        return
                    found[index] = hasher.hexdigest()
                    if expected is not None and (index >= len(expected)
                                                 or found[index] != expected[index]):
                        differs.set()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the calling thread
            errors.append(exc)
            differs.set()
        finally:
            if view is not None:
                view.release()
            if mapping is not None:
                mapping.close()

    threads = [threading.Thread(target=work, daemon=True, name="training-patches digest")
               for _ in range(_workers(count, beside_load) - 1)]
    for thread in threads:
        thread.start()
    work()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    if stop is not None and stop.is_set():
        return None
    return found


def file_chunks(path: str | os.PathLike[str], algorithm: str, chunk_bytes: int,
                stop: threading.Event | None = None, expected: list[str] | None = None,
                mapped: bool = False, beside_load: bool = False,
                ) -> list[str | None] | None:
    """The digests of the file's chunks (see :func:`_hash_chunks`); remembered, when all
    were hashed, for a file unchanged since."""
    path = Path(path)
    key, changed = _identity(path)
    key += (algorithm, chunk_bytes)
    with _verified_lock:
        known = _verified.get(key)
    if known is not None:
        return list(known)
    started = time.time()
    found = _hash_chunks(path, algorithm, chunk_bytes, chunk_count(key[3], chunk_bytes), stop,
                         expected, mapped, beside_load)
    if found is not None and None not in found and started - changed > SETTLED_S:
        with _verified_lock:
            _verified[key] = tuple(found)
    return found


def sha256_file(path: str | os.PathLike[str], stop: threading.Event | None = None) -> str:
    """The SHA-256 (hex) of the file ``path``: one chunk as long as the file
    (:func:`file_chunks`, remembered so). ``stop`` set: "" is returned."""
    found = file_chunks(path, "sha256", max(os.path.getsize(path), 1), stop)
    return str(found[0] or "") if found else ""


def file_record(path: str | os.PathLike[str], algorithm: str | None = None) -> dict[str, Any]:
    """The ``digest`` record of a file already written (a save whose writer seeked)."""
    algorithm = algorithm or default_algorithm()
    chunk_bytes = CHUNK_BYTES
    chunks = file_chunks(path, algorithm, chunk_bytes) or []  # no stop: every chunk hashed
    return {"version": DIGEST_VERSION, "algorithm": algorithm, "chunk_bytes": chunk_bytes,
            "chunks": [str(chunk) for chunk in chunks]}


def mismatch(path: str | os.PathLike[str], record: dict[str, Any],
             stop: threading.Event | None = None, *, mapped: bool = False,
             beside_load: bool = False) -> str | None:
    """Why the file's bytes are not those its ``digest`` record vouches for (a chunk that
    differs, by its byte range), or None: they are, or ``stop`` was set. ``mapped`` and
    ``beside_load``: see :func:`_hash_chunks`."""
    algorithm, chunk_bytes, chunks = record["algorithm"], record["chunk_bytes"], record["chunks"]
    found = file_chunks(path, algorithm, chunk_bytes, stop, expected=chunks, mapped=mapped,
                        beside_load=beside_load)
    if found is None:
        return None
    name = NAMES[algorithm]
    if len(found) != len(chunks):
        return (f"does not match the {name} digest in its manifest: it has {len(found)} "
                f"chunk(s) of {chunk_bytes} bytes, the manifest lists {len(chunks)}")
    for index, (have, want) in enumerate(zip(found, chunks)):
        if have is not None and have != want:
            start = index * chunk_bytes
            end = f"{start + chunk_bytes - 1}" if index < len(chunks) - 1 else "the end"
            where = (f": bytes {start} to {end} (chunk {index + 1} of {len(chunks)}) differ"
                     if len(chunks) > 1 else "")
            return (f"does not match the {name} digest in its manifest{where} (changed or "
                    f"damaged on disk)")
    return None


def beside(work: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``work`` in a thread now; the callable returned waits for its result (and
    re-raises what it raised)."""
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
    thread while it is written (both release the GIL), a small one in turn."""
    if memoryview(data).nbytes < PARALLEL_BYTES:
        digest.update(data)
        return write(data)
    hashed = beside(lambda: digest.update(data))
    try:
        return write(data)
    finally:
        hashed()  # joined before returning: the data is valid only during the call


__all__ = ["sha256_file", "file_chunks", "file_record", "mismatch", "ChunkedDigest",
           "default_algorithm", "can_check", "chunk_count", "beside", "update_while",
           "READ_BLOCK", "PARALLEL_BYTES", "SETTLED_S", "DIGEST_VERSION", "CHUNK_BYTES",
           "ALGORITHMS"]
