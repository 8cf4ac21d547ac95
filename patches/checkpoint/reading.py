"""Reading a checkpoint: :func:`read_checkpoint` (weights-only ``torch.load``) and the
checks before it, none of which runs the file's code (file checks, the one manifest format
of a file and a sharded folder, pickle inspection), the checkpoints a manager wrote, the
one-paragraph diagnosis of a failed read, and the NaN/Inf scan of tensors."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickletools
import re
import threading
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from .. import _dist
from .._log import info
from .._version import __version__
from .atomic import TMP_MARK as _TMP_MARK
from .atomic import host_name
from . import digest as _digest
from .errors import CheckpointError, UnsafeCheckpointError

logger = logging.getLogger("training_patches")

# The one manifest format, of a checkpoint file and of a sharded folder alike.
MANIFEST_FORMAT = "training-patches-manifest/1"
# The format key of a checkpoint file's payload; also what earlier versions wrote in a file's
# manifest (its one file's 'file', 'bytes', 'digest' or 'sha256' at the top), as DCP_FORMAT in
# a sharded folder's (each file's whole 'sha256'): :func:`parse_manifest` converts both.
FORMAT = "training-patches-checkpoint/1"
DCP_FORMAT = "training-patches-dcp-checkpoint/1"
MANIFEST_SUFFIX = ".manifest.json"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
# A manifest is a few kilobytes (one shape per tensor); anything this large is not one.
MAX_MANIFEST_BYTES = 64 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class Manifest:
    """A manifest that passed the schema (:func:`parse_manifest`), in today's format.

    ``files``: each file's name -> ``{"bytes", "digest"}``; ``generation`` orders saves by
    when they were written (None: before generations); ``nonfinite`` names the tensors that
    held NaN/Inf (None: not recorded); ``manifest[key]``: any field of the JSON object.
    """

    step: int
    files: dict[str, dict[str, Any]] = field(repr=False, compare=False)
    generation: int | None = None
    nonfinite: tuple[str, ...] | None = None
    vocab_size: int | None = None
    data: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def order(self) -> tuple[int, int]:
        """Sort key, newest last: the generation, then the step (for old manifests)."""
        return (-1 if self.generation is None else self.generation, self.step)

    @property
    def file(self) -> str:
        """The first file it lists: a checkpoint file's manifest lists that one file."""
        return next(iter(self.files))

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_digest(record: Any, size: int, name: str) -> None:
    """``ValueError`` when the ``digest`` record of the file ``name`` is not one this version
    reads (docs/reference/manifest.md)."""
    if not isinstance(record, dict):
        raise ValueError(f"'digest' of {name} is {_shown(record)}, expected an object")
    version = record.get("version")
    if version != _digest.DIGEST_VERSION or not _is_count(version):
        raise ValueError(f"'digest' of {name} has version {_shown(version)}; this "
                         f"training-patches reads version {_digest.DIGEST_VERSION} (a newer one "
                         f"wrote it?)")
    if record.get("algorithm") not in _digest.ALGORITHMS:
        raise ValueError(f"'digest.algorithm' of {name} is {_shown(record.get('algorithm'))}, "
                         f"expected one of {', '.join(_digest.ALGORITHMS)}")
    chunk_bytes = record.get("chunk_bytes")
    if not _is_count(chunk_bytes) or chunk_bytes < 1:
        raise ValueError(f"'digest.chunk_bytes' of {name} is {_shown(chunk_bytes)}, expected a "
                         f"whole number >= 1")
    chunks = record.get("chunks")
    if not isinstance(chunks, list) or not all(
            isinstance(c, str) and _SHA256.fullmatch(c) for c in chunks):
        raise ValueError(f"'digest.chunks' of {name} is {_shown(chunks)}, expected a list of 64 "
                         f"hex digits each")
    if len(chunks) != _digest.chunk_count(size, chunk_bytes):
        raise ValueError(f"'digest.chunks' of {name} lists {len(chunks)} chunk(s), a file of "
                         f"{size} bytes has {_digest.chunk_count(size, chunk_bytes)} of "
                         f"{chunk_bytes} bytes")


def _file_entry(name: Any, entry: Any) -> dict[str, Any]:
    """One file's entry of ``files`` as today's format has it: ``bytes`` and ``digest`` (an
    earlier ``sha256`` of the whole file: the record of one SHA-256 chunk)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name:
        raise ValueError(f"'files' names {_shown(name)}, expected a file name")
    if not isinstance(entry, dict):
        raise ValueError(f"the entry of {name} is {_shown(entry)}, expected an object")
    size = entry.get("bytes")
    if not _is_count(size):
        raise ValueError(f"'bytes' of {name} is {_shown(size)}, expected a whole number >= 0")
    if "digest" in entry:
        _check_digest(entry["digest"], size, name)
        return {"bytes": size, "digest": entry["digest"]}
    sha = entry.get("sha256")
    if sha is None:
        raise ValueError(f"{name} has no 'digest' (nor the 'sha256' of older manifests)")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise ValueError(f"'sha256' of {name} is {_shown(sha)}, expected 64 hex digits")
    return {"bytes": size, "digest": {"version": _digest.DIGEST_VERSION, "algorithm": "sha256",
                                      "chunk_bytes": max(size, 1), "chunks": [sha]}}


def parse_manifest(data: Any) -> Manifest:
    """A :class:`Manifest` from parsed JSON; ``ValueError`` (short reason) when the shape is
    wrong (the fields: docs/reference/manifest.md). The formats of earlier versions
    (:data:`FORMAT`, :data:`DCP_FORMAT`) are converted."""
    if not isinstance(data, dict):
        raise ValueError(f"it is a JSON {type(data).__name__}, expected an object")
    form = data.get("format")
    if form not in (MANIFEST_FORMAT, FORMAT, DCP_FORMAT):
        raise ValueError(f"'format' is {_shown(form)}, expected {MANIFEST_FORMAT!r}")
    required = ("file", "step", "bytes") if form == FORMAT else (
        "step", "generation", "world_size", "files")
    for name in required:
        if name not in data:
            raise ValueError(f"it has no {name!r}")
    files = data.get("files")
    if form == FORMAT:  # its one file's facts at the top
        if not isinstance(data["file"], str):
            raise ValueError(f"'file' is {_shown(data['file'])}, expected a file name")
        files = {data["file"]: {k: data[k] for k in ("bytes", "digest", "sha256") if k in data}}
    if not isinstance(files, dict) or not files:
        raise ValueError(f"'files' is {_shown(files)}, expected an object of file name -> "
                         f"bytes and digest")
    files = {name: _file_entry(name, entry) for name, entry in files.items()}
    for name in ("step", "generation", "world_size", "vocab_size"):  # null: only if optional
        if name in data and not _is_count(data[name]) and (data[name] is not None
                                                           or name in required):
            raise ValueError(f"{name!r} is {_shown(data[name])}, expected a whole number >= 0")
    nonfinite = data.get("nonfinite")
    if nonfinite is not None and (not isinstance(nonfinite, list)
                                  or not all(isinstance(n, str) for n in nonfinite)):
        raise ValueError(f"'nonfinite' is {_shown(nonfinite)}, expected a list of names")
    shapes = data.get("param_shapes")
    if shapes is not None and (not isinstance(shapes, dict) or not all(
            isinstance(v, list) and all(_is_count(d) for d in v) for v in shapes.values())):
        raise ValueError("'param_shapes' is not an object of name -> list of sizes")
    for name, kind, expected in (("amp", bool, "true or false"), ("written_by", str, "text"),
                                 ("has_optimizer", bool, "true or false"), ("time", str, "text")):
        if name in data and not isinstance(data[name], kind):
            raise ValueError(f"{name!r} is {_shown(data[name])}, expected {expected}")
    return Manifest(step=data["step"], files=files, generation=data.get("generation"),
                    nonfinite=tuple(nonfinite) if nonfinite is not None else None,
                    vocab_size=data.get("vocab_size"), data={**data, "files": files})


def manifest_text(step: int, generation: int, files: dict[str, Any],
                  shapes: dict[str, list[int]], nonfinite: list[str], *, amp: bool,
                  world_size: int, has_optimizer: bool) -> str:
    """The JSON of a new manifest (both writers'), checked by :func:`parse_manifest`: a writer
    never writes what its readers refuse."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "written_by": f"training-patches {__version__} CheckpointManager",
        "step": step, "generation": generation, "world_size": world_size,
        "vocab_size": next((int(v[0]) for k, v in shapes.items()
                            if k.endswith("text_embedding.weight")), None),
        "param_shapes": shapes, "has_optimizer": has_optimizer, "nonfinite": nonfinite,
        "amp": amp, "files": files,
        "writer": {"rank": _dist.rank(), "host": host_name(), "pid": os.getpid()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    parse_manifest(manifest)
    return json.dumps(manifest, indent=1)


def warn_nonfinite_saved(step: int, where: str | os.PathLike[str], nonfinite: list[str]) -> None:
    """The WARNING of a checkpoint written with NaN/Inf tensors (its manifest names them), said
    once it and its manifest are written."""
    if nonfinite:
        logger.warning(
            "training-patches: the checkpoint of step %d written to %s holds NaN or Inf in %d "
            "tensor(s) (%s): resume('auto') will pass over it and load_checkpoint refuses it "
            "unless allow_nonfinite=True", step, where, len(nonfinite), ", ".join(nonfinite[:5]))


def manifest_path(checkpoint: str | os.PathLike[str]) -> Path:
    """Where the manifest of ``checkpoint`` is: ``<name>.manifest.json`` beside it."""
    path = Path(checkpoint)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def manifest_from(raw: bytes) -> tuple[Manifest | None, str | None]:
    """(manifest, None) from a manifest file's bytes, or (None, why it is not valid)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        return None, f"it is over {MAX_MANIFEST_BYTES} bytes, far more than a manifest"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        return None, f"it cannot be read as JSON ({str(exc)[:120]})"
    try:
        return parse_manifest(data), None
    except ValueError as exc:
        return None, str(exc)


def read_manifest(checkpoint: str | os.PathLike[str]) -> tuple[Manifest | None, str | None]:
    """(manifest, None) when a valid one is beside ``checkpoint``; (None, None) when there is
    none; (None, reason) when there is one that is not valid. Never raises."""
    man = manifest_path(checkpoint)
    try:
        if not man.is_file():
            return None, None
        with open(man, "rb") as handle:
            manifest, invalid = manifest_from(handle.read(MAX_MANIFEST_BYTES + 1))
    except OSError as exc:
        return None, f"it cannot be read ({str(exc)[:120]})"
    if manifest is not None and len(manifest.files) != 1:
        return None, f"it lists {len(manifest.files)} files, a checkpoint file's manifest one"
    return manifest, invalid


# --------------------------------------------------------------------------- files


# What the first pickle of torch's legacy (pre-1.6) format may contain: its magic number.
_MAGIC_OPS = {"PROTO", "FRAME", "LONG1", "LONG4", "LONG", "INT", "BININT", "MEMOIZE", "STOP"}


def _legacy_problem(path: Path) -> str | None:
    """Why a file starting with a pickle opcode is not torch's legacy format, whose first
    pickle holds its magic number (None if it is); read with :mod:`pickletools`."""
    try:
        with open(path, "rb") as handle, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pickletools warns on odd escapes in junk
            ops: list[tuple[str, Any]] = []
            for opcode, arg, _ in pickletools.genops(handle):
                ops.append((opcode.name, arg))
                if opcode.name == "STOP" or len(ops) > 8:
                    break
    except Exception:  # noqa: BLE001 - any parse failure means "not a pickle"
        return "is not a torch checkpoint (it starts like a pickle but is not one)"
    names = {name for name, _ in ops}
    if names <= _MAGIC_OPS and any(arg == torch.serialization.MAGIC_NUMBER for _, arg in ops):
        return None
    return ("is a plain pickle, not a file written by torch.save (torch's magic number is "
            "missing)")


def _zip_crc_problem(path: Path) -> str | None:
    """Read every record of a torch zip archive and check the CRC-32 torch stored for it
    (about 2.5 GB/s); a damaged local header shows up here too. Records saved without a
    CRC (torch's ``compute_crc32=False`` writes 0) are read but not compared."""
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if member.CRC == 0 and member.file_size:
                    member.CRC = None  # no CRC was written: zipfile then skips the compare
                with archive.open(member) as handle:
                    while handle.read(1 << 22):
                        pass
    except Exception as exc:  # noqa: BLE001 - zipfile raises many types on damage
        return f"is damaged: a record does not match its CRC-32 or header ({str(exc)[:160]})"
    return None


# safetensors: an 8-byte little-endian header length, then that many bytes of JSON, then the
# tensor data; the package refuses headers over 100 MB, so nothing longer is one.
_SAFETENSORS_MAX_HEADER = 100_000_000


def _safetensors_check(path: Path, size: int) -> tuple[bool, str | None]:
    """(is it a safetensors file, why it cannot be loaded as one or None). Reads the header
    only; the tensor data is not read."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
            length = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
            if head[8:9] != b"{" or not 2 <= length <= _SAFETENSORS_MAX_HEADER:
                return False, None
            if length > size - 8:
                return True, (f"is a safetensors file cut short: its header alone declares "
                              f"{length + 8} bytes, the file has {size}")
            handle.seek(8)
            header = json.loads(handle.read(length).decode("utf-8"))
    except OSError:
        return False, None
    except (ValueError, RecursionError):
        return True, "is a safetensors file whose JSON header cannot be read (damaged)"
    entries = ([v for k, v in header.items() if k != "__metadata__"]
               if isinstance(header, dict) else None)
    if entries is None or not all(
            isinstance(e, dict) and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2 and all(_is_count(o) for o in e["data_offsets"])
            for e in entries):
        return True, ("is a safetensors file whose header does not list tensors as safetensors "
                      "writes them")
    end = 8 + length + max((e["data_offsets"][1] for e in entries), default=0)
    if size < end:
        return True, (f"is a safetensors file cut short: its header declares {end} bytes, the "
                      f"file has {size}")
    return True, None


def _safetensors_installed() -> bool:
    try:
        return importlib.util.find_spec("safetensors") is not None
    except (ImportError, ValueError):
        return False


def file_problem(path: Path, entry: dict[str, Any], *, verify_hash: bool = True,
                 stop: threading.Event | None = None, beside_load: bool = False,
                 mapped: bool = False) -> tuple[str, str] | None:
    """(kind, reason) when ``path`` is not the file its manifest's ``entry`` vouches for
    (its size, then with ``verify_hash`` its digest: :func:`.digest.mismatch`), else None."""
    record = entry["digest"]
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            return "size", f"has {size} bytes but its manifest says {entry['bytes']}"
        if not verify_hash:
            return None
        if not _digest.can_check(record["algorithm"]):
            return "unverifiable", (f"cannot be verified here: its manifest's digest is "
                                    f"{_digest.NAMES[record['algorithm']]} and the "
                                    f"{record['algorithm']} package is not installed")
        reason = _digest.mismatch(path, record, stop, mapped=mapped, beside_load=beside_load)
    except OSError as exc:
        return "missing", f"cannot be read ({exc.strerror or exc})"
    return None if reason is None else ("hash", reason)


def _check(path: Path, verify_hash: bool, *, hash_now: bool = True) -> tuple[str, str] | None:
    """(kind, reason) of the first problem of ``path``, or None (see :func:`check_file`).
    ``hash_now=False``: the digest (or the zip's CRC-32s) is left to a :class:`Verification`."""
    try:  # the checks below catch their own OSErrors: this one is of the file itself
        if not path.is_file():
            return "missing", "does not exist"
        size = path.stat().st_size
        if size == 0:
            return "empty", "is empty (0 bytes)"
        manifest, invalid = read_manifest(path)
        if invalid is not None:
            return "manifest", (f"has a manifest {manifest_path(path).name} that is not valid: "
                                f"{invalid}")
        if manifest is not None:
            problem = file_problem(path, manifest.files[manifest.file],
                                   verify_hash=verify_hash and hash_now)
            if problem is not None:
                return problem
        is_st, problem = _safetensors_check(path, size)
        if is_st:
            if problem is not None:
                return "safetensors", problem
            if not _safetensors_installed():
                return "safetensors-missing", ("is a safetensors file, and the safetensors "
                                               "package is not installed in this environment")
            return None
        with open(path, "rb") as handle:
            head = handle.read(4)
        if head.startswith(b"PK"):
            try:
                with zipfile.ZipFile(path) as archive:
                    if not any(name.endswith("data.pkl") for name in archive.namelist()):
                        return "format", ("is a zip archive but not a torch checkpoint (no "
                                          "data.pkl inside)")
            except Exception as exc:  # noqa: BLE001 - zipfile raises many types on damage
                return "format", f"is a truncated or damaged torch zip archive ({exc})"
            if verify_hash and hash_now and manifest is None:
                problem = _zip_crc_problem(path)
                if problem is not None:
                    return "crc", problem
            return None
    except OSError as exc:
        return "missing", f"cannot be read ({exc})"
    if head[:1] == b"\x80":
        problem = _legacy_problem(path)
        return None if problem is None else ("format", problem)
    return "format", f"is not a torch checkpoint (starts with bytes {head!r})"


def check_file(path: str | os.PathLike[str], *, verify_hash: bool = True) -> str | None:
    """Why ``path`` is not a loadable checkpoint, or None when it looks complete.

    With a manifest beside it, the manifest must be valid, the size match and, with
    ``verify_hash``, the digest. Without one, the file must be a complete zip archive (with
    ``verify_hash``, its records matching their CRC-32s), torch's legacy format, or a
    complete safetensors file. Nothing is unpickled; this never raises.
    """
    found = _check(Path(path), verify_hash)
    return None if found is None else found[1]


def manager_checkpoints(folder: str | os.PathLike[str],
                        exclude: str | os.PathLike[str] | None = None,
                        ) -> list[tuple[Path, Manifest]]:
    """Files in ``folder`` with a valid manifest naming them (a :class:`CheckpointManager`
    wrote them; not checked here), newest (highest generation) first; symlinks ignored."""
    skip = Path(exclude).absolute() if exclude is not None else None
    found: list[tuple[tuple[int, int], float, Path, Manifest]] = []
    for entry in entries_of(folder):
        if (_TMP_MARK in entry.name or not entry.name.endswith(CHECKPOINT_SUFFIXES)
                or (skip is not None and entry.absolute() == skip)):
            continue
        try:
            if (entry.is_symlink() or not entry.is_file()
                    or manifest_path(entry).is_symlink()):
                continue
            manifest, _ = read_manifest(entry)
            if manifest is None or manifest.file != entry.name:
                continue
            found.append((manifest.order(), entry.stat().st_mtime, entry, manifest))
        except OSError:
            continue
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [(entry, manifest) for _, _, entry, manifest in found]


def entries_of(folder: str | os.PathLike[str]) -> list[Path]:
    """The entries of ``folder`` ([] when it is no folder or cannot be read)."""
    try:
        return list(Path(folder).iterdir()) if Path(folder).is_dir() else []
    except OSError:
        return []


def newest_valid_beside(path: str | os.PathLike[str]) -> Path | None:
    """The newest other checkpoint in the same folder that a manager wrote, that passes
    :func:`check_file` (hash included) and held no NaN/Inf when saved."""
    path = Path(path)
    for candidate, manifest in manager_checkpoints(path.parent, exclude=path):
        if manifest.nonfinite:
            continue
        if check_file(candidate) is None:
            return candidate
    return None


def _what_to_do(path: Path) -> str:
    beside = newest_valid_beside(path)
    if beside is not None:
        return (f"The newest valid checkpoint beside it is {beside}: resume from that one "
                f"(CheckpointManager.resume('auto') picks it by itself). {path} was left as it is.")
    return (f"No other valid checkpoint was found in {path.parent}. {path} was left as it is; "
            "restore it from a copy or start from the base model.")


# --------------------------------------------------------------------------- pickles


def _pickle_globals(data: bytes) -> list[str]:
    """The globals a pickle would import, read with pickletools (nothing is executed)."""
    names: list[str] = []
    strings: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickletools warns on odd escapes in junk
        ops = list(pickletools.genops(data))
    for opcode, arg, _ in ops:
        if opcode.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(f"{strings[-2]}.{strings[-1]}")
        elif isinstance(arg, str):
            strings.append(arg)
    return names


_BENIGN_GLOBALS = ("torch.", "collections.OrderedDict", "_codecs.encode", "builtins.set",
                   "builtins.frozenset", "numpy.")


def _foreign_globals(path: Path) -> list[str]:
    """Globals the file's pickle would import beyond tensors and containers (not run)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                data = archive.read(name)
        else:
            data = path.read_bytes()
        found = _pickle_globals(data)
    except Exception:  # noqa: BLE001 - not a readable pickle: reported as garbage instead
        return []
    return sorted({g for g in found if not g.startswith(_BENIGN_GLOBALS)})


def _unsafe_error(path: Path, unsafe: list[str]) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"training-patches: refused to load {path}: unpickling it would import and run "
        f"{', '.join(unsafe[:5])}, which a checkpoint of weights never needs. It was not "
        f"loaded and none of its code ran (torch.load with weights_only=True). If you made "
        f"this file yourself from trusted code, re-save only tensors and plain values "
        f"(model.state_dict(), optimizer.state_dict()). {_what_to_do(path)}")


def _diagnose(path: Path, exc: BaseException) -> CheckpointError:
    """Turn torch.load's failure into one paragraph naming the file and the way out."""
    text = str(exc)
    unsafe = _foreign_globals(path) if "Weights only load failed" in text else []
    if not unsafe and "Weights only load failed" in text:
        named = re.search(r"GLOBAL ([\w.]+)", text)
        unsafe = [named.group(1)] if named else []
    if unsafe:
        return _unsafe_error(path, unsafe)
    reason = check_file(path, verify_hash=False) or f"cannot be read by torch.load ({text[:200]})"
    if "Weights only load failed" in text and reason.startswith("cannot be read"):
        reason = "is not a checkpoint torch can read (random bytes or another format)"
    return CheckpointError(
        f"training-patches: cannot load the checkpoint {path}: the file {reason}. Expected a "
        f"complete file written by torch.save. A save interrupted half-way leaves such a file. "
        f"{_what_to_do(path)}")


# After "the file <reason>." of a file that failed :func:`check_file`, by kind: whether it
# was "refused" (else "cannot load"), then what to do ({todo}: :func:`_what_to_do`).
_REFUSALS = {
    "hash": (True, "Expected exactly the bytes its manifest {man} vouches for; a file changed "
                   "after it was saved, damaged on disk or in a copy does not match. Nothing was "
                   "loaded. {todo} If you changed it on purpose and trust it, load it with "
                   "verify_hash=False (the size is still checked) or move the manifest away."),
    "unverifiable": (True, "Nothing was loaded; {path} was left as it is. Install it (pip "
                           "install blake3, a dependency of training-patches) and load again, "
                           "or load it with verify_hash=False (the size is still checked)."),
    "crc": (True, "Expected every record to match the CRC-32 torch.save stored for it; a file "
                  "damaged on disk or in a copy does not. Nothing was loaded. {todo} If you "
                  "trust it, load it with verify_hash=False."),
    "safetensors-missing": (
        False, "The loader reads files written by torch.save itself and safetensors files "
               "through that package (its header was read and is complete). Nothing was "
               "loaded; {path} was left as it is. Install it (pip install safetensors) and load "
               "again, or convert the file once with safetensors.torch.load_file and torch.save "
               "where it is installed."),
    "safetensors": (False, "Expected a complete safetensors file (an 8-byte header length, a "
                           "JSON header, then every tensor's bytes); a copy or download "
                           "interrupted half-way leaves such a file. Nothing was loaded. {todo}"),
    "manifest": (True, f"Expected the JSON manifest CheckpointManager writes (format "
                       f"{MANIFEST_FORMAT!r}: 'step', 'generation', 'world_size', 'files' with "
                       f"the file's 'bytes' and 'digest'; or an earlier version's); without a "
                       f"valid one the file cannot be verified. Nothing was loaded. {{todo}} If "
                       f"you trust the file, move {{man}} away and load it again."),
}
_NOT_SAVED = (False, "Expected a complete file written by torch.save; a save interrupted "
                     "half-way leaves such a file. {todo}")


def _problem_error(path: Path, kind: str, reason: str) -> CheckpointError:
    """The paragraph for a file that failed :func:`check_file` before torch.load."""
    if kind == "missing":
        return CheckpointError(f"training-patches: the checkpoint {path} {reason}. "
                               f"{_what_to_do(path)}")
    refused, tail = _REFUSALS.get(kind, _NOT_SAVED)
    todo = _what_to_do(path) if "{todo}" in tail else ""
    said = "refused to load" if refused else "cannot load"
    return CheckpointError(
        f"training-patches: {said} the checkpoint {path}: the file {reason}. "
        + tail.format(path=path, man=manifest_path(path).name, todo=todo))


def _numpy_data_globals() -> list[Any]:
    """numpy's data-only constructors (arrays, scalars, dtypes from bytes: trainers save
    ``np.random.get_state()``), allowed under torch's weights-only unpickler."""
    try:
        import numpy as np  # lazy: numpy is optional (ImportError handled)
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray,
                          np.dtype]
    for code in ("?", "b", "B", "h", "H", "i", "I", "l", "L", "q", "Q", "e", "f", "d", "g"):
        allowed.append(type(np.dtype(code)))
    return allowed


class Verification:
    """The integrity check of a file being loaded (its manifest's digest, else its zip's
    CRC-32s), run in threads beside the load. :meth:`wait` before changing anything: it
    raises the refusal a changed or damaged file always got."""

    def __init__(self, path: Path, expected: Manifest | None, crc: bool,
                 mapped: bool = False) -> None:
        self.path = path
        self._stop = threading.Event()
        self._expected = expected
        self._mapped = mapped
        self._found: list[tuple[str, str] | None] = []
        self._thread = None
        if expected is not None or crc:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"training-patches verify {path.name}")
            self._thread.start()

    def _run(self) -> None:
        try:
            if self._expected is None:
                crc = _zip_crc_problem(self.path)
                self._found.append(None if crc is None else ("crc", crc))
            else:
                self._found.append(file_problem(
                    self.path, self._expected.files[self._expected.file], stop=self._stop,
                    beside_load=True, mapped=self._mapped))
        except Exception as exc:  # noqa: BLE001 - a check that could not run is a refusal
            self._found.append(("missing", f"cannot be read to verify it ({exc})"))

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        found = self._found[0] if self._found else ("missing", "could not be verified")
        if found is not None:
            raise _problem_error(self.path, *found)

    def around(self, work: Callable[[], Any]) -> Any:
        """``work()``; when it fails, the hash is waited for first (a changed file is refused
        as changed, whatever failed with it); an interrupt stops the hash."""
        try:
            return work()
        except Exception:
            self.wait()
            raise
        except BaseException:
            self._stop.set()
            raise


def read_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True,
                    verify_hash: bool = True, trusted: bool = False) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``, memory-mapped when the file is a zip archive.

    With a manifest beside the file, its schema and the file's size are checked, and
    with ``verify_hash`` (the default) its digest (each 64 MiB chunk's BLAKE3, or SHA-256;
    an older manifest's SHA-256 of the whole file): a file that changed after it was
    saved is refused. Without a manifest, ``verify_hash`` checks the CRC-32 of every record
    of the zip archive instead, in a thread while ``torch.load`` runs. ``verify_hash=False``
    skips both and logs that it did. Raises :class:`UnsafeCheckpointError` for a file that
    needs code to unpickle and :class:`CheckpointError` for a missing, empty, truncated,
    changed or foreign file; both name the newest valid checkpoint beside it.

    ``trusted=True`` is for a user's own legacy files whose pickle holds objects (a
    config class, an argparse Namespace): it unpickles with ``weights_only=False``, which
    runs whatever code the file names, and logs a WARNING saying so. Never use it on a
    file you did not make.

    A safetensors file (recognised by its header, whatever its name) is read through the
    ``safetensors`` package as a bare state dict; without the package it is refused with a
    paragraph saying so, and a safetensors file cut short is refused as such.
    """
    loaded, verification = open_checkpoint(path, mmap=mmap, verify_hash=verify_hash,
                                           trusted=trusted)
    verification.wait()
    return loaded


def open_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True,
                    verify_hash: bool = True, trusted: bool = False,
                    ) -> tuple[dict[str, Any], Verification]:
    """:func:`read_checkpoint` that does not wait for the digest: (the loaded dict, its
    :class:`Verification`, still running: ``wait()`` before changing anything)."""
    path = Path(path)
    found = _check(path, verify_hash, hash_now=False)
    if found is not None and trusted and found[0] == "format" and _foreign_globals(path):
        found = None  # only the pickle's globals were in the way, and the user vouched
    if found is not None:
        kind, reason = found
        if kind == "format":
            unsafe = _foreign_globals(path)
            if unsafe:
                raise _unsafe_error(path, unsafe)
        raise _problem_error(path, kind, reason)
    manifest, _ = read_manifest(path)
    is_zip = zipfile.is_zipfile(path)
    verification = Verification(
        path, manifest if manifest is not None and verify_hash else None,
        crc=verify_hash and manifest is None and is_zip, mapped=mmap and is_zip)
    return verification.around(lambda: _load(path, mmap=mmap, verify_hash=verify_hash,
                                             trusted=trusted, has_manifest=manifest is not None)
                               ), verification


def _load(path: Path, *, mmap: bool, verify_hash: bool, trusted: bool,
          has_manifest: bool) -> dict[str, Any]:
    """The file's dict through torch.load (or safetensors); the checks have passed."""
    if not verify_hash and (has_manifest or zipfile.is_zipfile(path)):
        info("training-patches: the %s of %s was not checked (verify_hash=False)",
             "digest" if has_manifest else "CRC-32", path)
    if _safetensors_check(path, path.stat().st_size)[0]:
        return _read_safetensors(path)
    use_mmap = mmap and zipfile.is_zipfile(path)
    if trusted:
        logger.warning("training-patches: loading %s with trusted=True: its pickle may import "
                       "and run code (%s); the weights-only rules are off for this file only",
                       path, ", ".join(_foreign_globals(path)[:5]) or "none found")
    try:
        with torch.serialization.safe_globals(_numpy_data_globals()):
            loaded = torch.load(path, map_location="cpu", weights_only=not trusted,
                                mmap=use_mmap)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise _diagnose(path, exc) from exc
    if not isinstance(loaded, Mapping):
        raise CheckpointError(
            f"training-patches: {path} holds a {type(loaded).__name__}, not a dict of states. "
            f"Expected a dict with 'model' (a state dict) or a state dict itself. "
            f"{_what_to_do(path)}")
    return dict(loaded)


def _read_safetensors(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file (a bare state dict); reading it runs no code."""
    from safetensors.torch import load_file  # lazy: safetensors is optional

    try:
        loaded = load_file(str(path), device="cpu")
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
        raise CheckpointError(
            f"training-patches: cannot load the checkpoint {path}: the safetensors package "
            f"refused it ({type(exc).__name__}: {str(exc)[:200]}). Expected a complete "
            f"safetensors file. Nothing was loaded. {_what_to_do(path)}") from exc
    info("training-patches: %s is a safetensors file: read its %d tensor(s) through the "
         "safetensors package (a bare state dict: no optimizer, step or RNG)", path, len(loaded))
    return dict(loaded)


# --------------------------------------------------------------------------- tensors


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in nested dicts, lists and tuples."""
    stack: list[tuple[str, Any]] = [(prefix, tree)]
    seen: set[int] = set()
    while stack:
        name, item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield name, item
        elif isinstance(item, (Mapping, list, tuple)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            pairs = item.items() if isinstance(item, Mapping) else enumerate(item)
            for key, value in pairs:
                stack.append((f"{name}.{key}" if name else str(key), value))


# Elements per chunk of the finite check: isfinite makes temporaries as large as its input
# (abs, two masks): a 24k x 1024 embedding checked at once would cost ~150 MB of host
# memory on top of the checkpoint; small chunks keep a load at ~1.0x the file's size. (Only
# dtypes outside _MINMAX_DTYPES go this way.)
_CHUNK = {"cpu": 1 << 16}
_CHUNK_OTHER = 1 << 24


# Real dtypes whose NaN/Inf torch.aminmax propagates: one reduction, no temporaries, about
# 6x the chunked isfinite's speed on the CPU (issue 41: 3.9 against 0.7 GB/s, one thread).
_MINMAX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _has_bad(tensor: torch.Tensor, nan_only: bool) -> torch.Tensor:
    """A 0-d bool tensor on the tensor's device: does it hold NaN (or, unless ``nan_only``,
    +-Inf)? Read by its minimum and maximum (NaN propagates into both, +Inf is the maximum,
    -Inf the minimum); other dtypes in chunks. No host read."""
    if tensor.dtype in _MINMAX_DTYPES:
        low, high = torch.aminmax(tensor.reshape(-1))
        if nan_only:
            return torch.isnan(low) | torch.isnan(high)
        return ~(torch.isfinite(low) & torch.isfinite(high))
    flat = tensor.reshape(-1)
    bad = torch.zeros((), dtype=torch.bool, device=tensor.device)
    for chunk in flat.split(_CHUNK.get(tensor.device.type, _CHUNK_OTHER)):
        found = torch.isnan(chunk).any() if nan_only else ~torch.isfinite(chunk).all()
        bad = bad | found
    return bad


def nonfinite_flags(named: list[tuple[str, torch.Tensor, bool]]) -> list[str]:
    """Names of the tensors that are not finite: ``(name, tensor, nan_only)`` each, where
    ``nan_only`` lets +-Inf pass (attention masks hold -inf); one host read per device."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor, nan_only in named:
        if (tensor.is_meta or not (tensor.is_floating_point() or tensor.is_complex())
                or tensor.numel() == 0):
            continue
        by_device.setdefault(tensor.device, []).append((name, _has_bad(tensor, nan_only)))
    names: list[str] = []
    for flags in by_device.values():
        values = torch.stack([bad for _, bad in flags]).tolist()
        names += [name for (name, _), value in zip(flags, values) if value]
    return sorted(names)


def saved_nonfinite(model: torch.nn.Module, model_state: Mapping[str, Any],
                    optimizer_states: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Names of the NaN/Inf tensors of a state being saved, by the loader's rule (parameters
    and optimizer moments finite, buffers free of NaN); ``optimizer_states``: name prefix ->
    an optimizer's state dict. The manifest records them, so that resume passes over them."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    named = [(f"model.{k}", _dist.local(v), k not in params) for k, v in model_state.items()
             if isinstance(v, torch.Tensor)]
    for prefix, state in optimizer_states.items():
        named += [(f"{prefix}.state.{name}", _dist.local(value), False)
                  for name, value in iter_tensors(state.get("state", {}))]
    return nonfinite_flags(named)


__all__ = ["check_file", "read_checkpoint", "open_checkpoint", "Verification", "read_manifest",
           "parse_manifest", "manifest_from", "manifest_text", "warn_nonfinite_saved", "file_problem", "Manifest",
           "manifest_path", "manager_checkpoints", "newest_valid_beside", "FORMAT",
           "MANIFEST_FORMAT", "DCP_FORMAT", "MANIFEST_SUFFIX", "CHECKPOINT_SUFFIXES"]
