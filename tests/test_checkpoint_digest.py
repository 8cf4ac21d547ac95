"""The manifest's chunked digest (issue 41): a save records each chunk's BLAKE3 (SHA-256
without the blake3 package) as it writes; a load checks them in threads beside torch.load and
refuses a changed chunk, naming the file and the bytes, before anything is changed. A manifest
written before the record (the whole file's ``sha256``) is still read and checked: the one
parser takes it for the record of one SHA-256 chunk."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
from pathlib import Path

import blake3
import pytest
import torch

from patches.checkpoint import (CheckpointError, CheckpointManager, check_file, digest,
                                load_checkpoint, manifest_path, read_manifest)
from patches.checkpoint.atomic import write_atomically
from test_checkpoint_cost import _objects  # an embedding and a head, AdamW after one step

CHUNK = 4096  # small chunks: a checkpoint of a few tens of KB has several


def _state(model: torch.nn.Module, opt) -> list[torch.Tensor]:
    return ([v.detach().clone() for v in model.state_dict().values()]
            + [v.clone() for s in opt.state.values() for v in s.values()])


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _flip_at(path: Path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` in place (same inode and size)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def _offset_of(path: Path, tensor: torch.Tensor) -> int:
    offset = path.read_bytes().find(tensor.detach().numpy().tobytes())
    assert offset > 0
    return offset


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(digest, "CHUNK_BYTES", CHUNK)


def test_the_manifest_records_each_chunks_blake3_of_the_bytes_written(tmp_path, small_chunks):
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    record = json.loads(manifest_path(path).read_text())["files"][path.name]["digest"]
    data = path.read_bytes()
    assert record["version"] == 1 and record["algorithm"] == "blake3"
    assert record["chunk_bytes"] == CHUNK and len(record["chunks"]) > 3
    assert record["chunks"] == [blake3.blake3(data[i:i + CHUNK]).hexdigest()
                                for i in range(0, len(data), CHUNK)]
    assert "sha256" not in json.loads(manifest_path(path).read_text())


def test_a_changed_chunk_is_refused_naming_the_file_and_its_bytes(tmp_path, small_chunks):
    """Switching the verification off fails this test: the flipped byte is a finite weight
    that loads without complaint otherwise."""
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    offset = _offset_of(path, model[1].weight) + 4 * 9
    _flip_at(path, offset)
    chunk = offset // CHUNK
    target = _objects(seed=1)
    before = _state(*target)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, *target, freeze=False)
    text = str(info.value)
    assert str(path) in text and "does not match the BLAKE3 digest in its manifest" in text
    assert f"bytes {chunk * CHUNK} to {chunk * CHUNK + CHUNK - 1} (chunk {chunk + 1} of " in text
    assert _same(_state(*target), before)
    assert "BLAKE3" in check_file(path)
    assert CheckpointManager(tmp_path / "run").resume("auto") is None


def test_a_file_replaced_after_its_manifest_is_refused(tmp_path, small_chunks):
    """Another save of the same shapes (same size, other weights) put in its place."""
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    other = CheckpointManager(tmp_path / "other", keep=None).save(1, *_objects(seed=5))
    assert other.stat().st_size == path.stat().st_size
    path.write_bytes(other.read_bytes())
    target = _objects(seed=1)
    before = _state(*target)
    with pytest.raises(CheckpointError, match="does not match the BLAKE3 digest"):
        load_checkpoint(path, *target, freeze=False)
    assert _same(_state(*target), before)


def test_bytes_appended_after_the_last_chunk_are_refused(tmp_path, small_chunks):
    """The last chunk is read to the end of the file: the size is checked before, and the
    hash would see bytes added while it runs."""
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    record = read_manifest(path)[0].files[path.name]["digest"]
    with open(path, "ab") as handle:
        handle.write(b"more")
    assert digest.mismatch(path, record) is not None


def test_an_old_manifest_with_the_whole_files_sha256_is_still_checked(tmp_path):
    """A manifest as training-patches wrote it before the digest record (format
    training-patches-checkpoint/1, the file's facts at the top, its whole SHA-256)."""
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest_path(path).write_text(json.dumps({
        "format": "training-patches-checkpoint/1", "file": path.name, "step": 1,
        "generation": 0, "bytes": path.stat().st_size, "sha256": sha, "nonfinite": [],
        "vocab_size": None, "amp": False, "time": "2024-01-01T00:00:00+0000"}, indent=1))
    assert read_manifest(path)[0].files == {path.name: {"bytes": path.stat().st_size, "digest": {
        "version": 1, "algorithm": "sha256", "chunk_bytes": path.stat().st_size,
        "chunks": [sha]}}}
    target = _objects(seed=1)
    load_checkpoint(path, *target, freeze=False)
    assert torch.equal(target[0][1].weight, model[1].weight)
    _flip_at(path, _offset_of(path, model[1].weight) + 4 * 9)
    target = _objects(seed=1)
    before = _state(*target)
    with pytest.raises(CheckpointError, match="does not match the SHA-256 digest in its manifest"):
        load_checkpoint(path, *target, freeze=False)
    assert _same(_state(*target), before)


def test_without_blake3_a_save_records_sha256_chunks_and_they_are_checked(
        tmp_path, small_chunks, monkeypatch):
    monkeypatch.setattr(digest, "_blake3", None)
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    record = read_manifest(path)[0].files[path.name]["digest"]
    data = path.read_bytes()
    assert record["algorithm"] == "sha256"
    assert record["chunks"] == [hashlib.sha256(data[i:i + CHUNK]).hexdigest()
                                for i in range(0, len(data), CHUNK)]
    load_checkpoint(path, *_objects(seed=1), freeze=False)
    _flip_at(path, _offset_of(path, model[1].weight) + 4 * 9)
    with pytest.raises(CheckpointError, match="does not match the SHA-256 digest"):
        load_checkpoint(path, *_objects(seed=1), freeze=False)


def test_a_blake3_manifest_where_the_package_is_missing_is_refused_saying_how_to_go_on(
        tmp_path, monkeypatch):
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    monkeypatch.setattr(digest, "_blake3", None)
    target = _objects(seed=1)
    before = _state(*target)
    with pytest.raises(CheckpointError, match="pip install blake3") as info:
        load_checkpoint(path, *target, freeze=False)
    assert str(path) in str(info.value) and "verify_hash=False" in str(info.value)
    assert _same(_state(*target), before)
    load_checkpoint(path, *target, freeze=False, verify_hash=False)
    assert torch.equal(target[0][1].weight, model[1].weight)


@pytest.mark.parametrize("change, reason", [
    (lambda r: r.update(version=2), "version 2"),
    (lambda r: r.update(algorithm="md5"), "digest.algorithm"),
    (lambda r: r.update(chunk_bytes=0), "digest.chunk_bytes"),
    (lambda r: r["chunks"].pop(), "chunk(s)"),
    (lambda r: r["chunks"].__setitem__(0, "zz"), "digest.chunks"),
])
def test_a_digest_record_this_version_cannot_read_makes_the_manifest_invalid(
        tmp_path, small_chunks, change, reason):
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    data = json.loads(manifest_path(path).read_text())
    change(data["files"][path.name]["digest"])
    manifest_path(path).write_text(json.dumps(data))
    manifest, invalid = read_manifest(path)
    assert manifest is None and reason in invalid
    with pytest.raises(CheckpointError, match="not valid"):
        load_checkpoint(path, *_objects(seed=1), freeze=False)


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("workers", [1, 3])
def test_chunks_hashed_by_several_threads_are_the_streams_digest(tmp_path, monkeypatch, workers,
                                                                 mapped):
    """The record written from the stream (writes of any size, across chunk boundaries)
    equals the file's chunks hashed by ``workers`` threads, read or memory-mapped; a changed
    chunk ends them."""
    monkeypatch.setattr(digest, "_workers", lambda count, beside_load=True: min(workers, count))
    monkeypatch.setattr(digest, "MAPPED_BLOCK", 1000)  # several calls per chunk
    data = bytes(range(256)) * 97  # 24,832 bytes: 7 chunks of 4096, the last one short
    stream = digest.ChunkedDigest(chunk_bytes=CHUNK)
    for start, end in [(0, 10), (10, 5000), (5000, 5001), (5001, 20000), (20000, len(data))]:
        stream.update(memoryview(data)[start:end])
    record = stream.record()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert len(record["chunks"]) == 7 == digest.chunk_count(len(data), CHUNK)
    assert digest.file_chunks(path, "blake3", CHUNK, mapped=mapped) == record["chunks"]
    assert digest.mismatch(path, record, mapped=mapped) is None
    _flip_at(path, 3 * CHUNK + 17)
    assert "(chunk 4 of 7)" in digest.mismatch(path, record, mapped=mapped)


def test_a_write_of_a_whole_number_of_chunks_has_no_empty_last_chunk(tmp_path):
    data = bytes(2 * CHUNK)
    written = write_atomically(tmp_path / "f.bin", lambda handle: handle.write(data),
                               digest=True)
    assert written.digest["chunk_bytes"] == digest.CHUNK_BYTES
    record = digest.ChunkedDigest(chunk_bytes=CHUNK)
    record.update(data)
    assert record.record()["chunks"] == [blake3.blake3(bytes(CHUNK)).hexdigest()] * 2
    empty = digest.ChunkedDigest(chunk_bytes=CHUNK).record()
    assert empty["chunks"] == [blake3.blake3(b"").hexdigest()]


def test_a_stopped_check_reads_no_further(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(8 * CHUNK))
    stop = threading.Event()
    stop.set()
    assert digest.file_chunks(path, "blake3", CHUNK, stop) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mapping is read from "
                    "/proc/self/maps")
def test_the_loaded_optimizer_state_is_not_the_files_mapping(tmp_path):
    """The loaded moments are copies of their own (their pages of the memory-mapped file
    dropped, not rewritten one copy-on-write fault at a time): a rewrite of the file in
    place after the load does not change them."""
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    target = _objects(seed=1)
    load_checkpoint(path, *target, freeze=False)
    expected = [v.clone() for s in opt.state.values() for v in s.values()]
    with open(path, "r+b") as handle:  # the same inode: a private mapping would see this
        handle.write(bytes(path.stat().st_size))
    loaded = [v for s in target[1].state.values() for v in s.values()]
    assert _same(loaded, expected)


def test_the_manifest_page_lists_every_field_a_save_writes(tmp_path):
    """docs/reference/manifest.md is checked against a real save of each kind (a file, a
    one-process sharded folder): every field of the manifest, of a file's entry and of its
    digest record is in the page's tables, and the page names no field the schema does not
    know but those of earlier versions' manifests."""
    from patches.checkpoint.sharded import MANIFEST_NAME, save_sharded

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "manifest.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE))
    model, opt = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    folder = save_sharded(CheckpointManager(tmp_path / "dcp"), 1, model, opt, None, None, {})
    for written in (json.loads(manifest_path(path).read_text()),
                    json.loads((folder / MANIFEST_NAME).read_text())):
        entries = list(written["files"].values())
        assert {key for entry in entries for key in entry} == {"bytes", "digest"}
        assert set(written) | {"bytes", "digest", "file", "sha256"} | set(
            entries[0]["digest"]) == documented
