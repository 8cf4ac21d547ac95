"""The checkpoint's checks cost no pass of their own (issue 41): a load hashes the file's
chunks in threads beside ``torch.load`` and the checks, ``resume('auto')`` then
``load_checkpoint`` read the file for its hash once, a save hashes the bytes as they are
written and scans for NaN/Inf beside the write, the scan is one min/max reduction per tensor;
a changed file is still refused, whichever check meets it first."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import blake3
import pytest
import torch
from torch import nn

from patches.checkpoint import CheckpointError, CheckpointManager, digest, load_checkpoint


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _saved(folder: Path) -> tuple[Path, nn.Module]:
    model, opt = _objects()
    return CheckpointManager(folder, keep=None).save(3, model, opt), model


def _flip(path: Path, tensor: torch.Tensor) -> None:
    """Flip the lowest bit of one element of ``tensor``'s bytes in ``path``, in place (the
    same inode and size: only the content and the change time differ)."""
    data = path.read_bytes()
    offset = data.find(tensor.detach().numpy().tobytes())
    assert offset > 0
    with open(path, "r+b") as handle:
        handle.seek(offset + 4 * 5)
        byte = handle.read(1)
        handle.seek(offset + 4 * 5)
        handle.write(bytes([byte[0] ^ 0x01]))


def test_the_hash_is_read_while_torch_load_runs(tmp_path, monkeypatch):
    """The hash thread is still hashing when torch.load starts: it waits there (up to 30 s)
    for torch.load to be entered, which a hash taken before the load never sees."""
    path, _ = _saved(tmp_path / "run")
    loading = threading.Event()
    seen: list[bool] = []
    real_hash, real_load = digest._hash_chunks, torch.load

    def hash_after_load_began(*args, **kwargs):
        seen.append(loading.wait(timeout=30))
        return real_hash(*args, **kwargs)

    def load(*args, **kwargs):
        loading.set()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(digest, "_hash_chunks", hash_after_load_began)
    monkeypatch.setattr(torch, "load", load)
    model, opt = _objects(seed=1)
    load_checkpoint(path, model, opt, freeze=False)
    assert seen == [True]


def test_resume_then_load_reads_the_file_for_its_hash_once(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "SETTLED_S", 0.05)  # the file is "old" after 50 ms here
    path, _ = _saved(tmp_path / "run")
    time.sleep(0.1)
    before = digest.bytes_hashed
    found = CheckpointManager(tmp_path / "run").resume("auto")
    load_checkpoint(found, *_objects(seed=1), freeze=False)
    assert found == path
    assert digest.bytes_hashed - before == path.stat().st_size


def test_a_file_changed_after_its_hash_was_remembered_is_refused(tmp_path, monkeypatch):
    """The remembered hash is keyed on the file's change time: a byte flipped in place after
    ``resume`` (same inode, same size) is hashed again and refused."""
    monkeypatch.setattr(digest, "SETTLED_S", 0.05)
    path, model = _saved(tmp_path / "run")
    time.sleep(0.1)
    assert CheckpointManager(tmp_path / "run").resume("auto") == path
    _flip(path, model[0].weight)
    target = _objects(seed=1)
    kept = target[0][0].weight.detach().clone()
    with pytest.raises(CheckpointError, match="BLAKE3 digest in its manifest"):
        load_checkpoint(path, *target, freeze=False)
    assert torch.equal(target[0][0].weight, kept)


def test_a_changed_file_that_also_fails_to_plan_is_refused_as_changed(tmp_path, monkeypatch):
    """A load that fails for another reason while the hash runs waits for the hash: a
    changed file is named as changed, not as what it became."""
    path, model = _saved(tmp_path / "run")
    _flip(path, model[0].weight)
    other = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))  # does not fit either
    with pytest.raises(CheckpointError, match="BLAKE3 digest in its manifest"):
        load_checkpoint(path, other, freeze=False)


def test_a_large_block_is_hashed_in_a_thread_while_it_is_written() -> None:
    threads: list[int] = []

    class Digest:
        def __init__(self) -> None:
            self.inner = hashlib.sha256()

        def update(self, data) -> None:
            threads.append(threading.get_ident())
            self.inner.update(data)

    written: list[int] = []
    block = bytes(digest.PARALLEL_BYTES)
    found = Digest()
    assert digest.update_while(found, block, lambda data: written.append(len(data)) or len(data)) \
        == len(block)
    digest.update_while(found, b"small", lambda data: len(data))
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()
    assert written == [len(block)]
    assert found.inner.hexdigest() == hashlib.sha256(block + b"small").hexdigest()


def test_the_manifest_hash_is_the_files_with_blocks_over_the_parallel_size(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)  # 4 MiB of weights: one block hashed beside its write
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model)
    from patches.checkpoint.reading import read_manifest

    manifest, _ = read_manifest(path)
    assert manifest.files[path.name]["digest"]["chunks"] == [
        blake3.blake3(path.read_bytes()).hexdigest()]


def test_the_save_scans_for_nonfinite_tensors_while_it_writes(tmp_path, monkeypatch):
    """The finite scan waits (up to 30 s) for torch.save to be entered: a scan run before
    the write never sees it. The manifest still names a NaN tensor."""
    writing = threading.Event()
    seen: list[bool] = []
    real_scan, real_save = CheckpointManager._nonfinite, torch.save

    def scan_after_write_began(*args):
        seen.append(writing.wait(timeout=30))
        return real_scan(*args)

    def save(*args, **kwargs):
        writing.set()
        return real_save(*args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "_nonfinite", staticmethod(scan_after_write_began))
    monkeypatch.setattr(torch, "save", save)
    model, opt = _objects()
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, model, opt)
    from patches.checkpoint.reading import read_manifest

    assert seen == [True]
    assert read_manifest(path)[0].nonfinite == ("model.1.bias",)


def test_the_saved_file_is_hashed_as_it_is_written_beside_each_large_block(tmp_path, monkeypatch):
    from patches.checkpoint import atomic

    calls: list[int] = []
    real = atomic.update_while

    def counted(found, data, write):
        calls.append(memoryview(data).nbytes)
        return real(found, data, write)

    monkeypatch.setattr(atomic, "update_while", counted)
    block = bytes(range(256)) * (digest.PARALLEL_BYTES // 256 + 1)
    written = atomic.write_atomically(tmp_path / "f.bin", lambda handle: handle.write(block),
                                      digest=True)
    assert calls == [len(block)]
    assert written.digest["chunks"] == [blake3.blake3(block).hexdigest()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_finite_scan_is_one_reduction_and_finds_every_nan_and_inf(dtype, monkeypatch):
    """No elementwise isfinite over the data (its temporaries and its 6x slower passes): the
    scan reads each tensor's minimum and maximum, and still names every NaN and +-Inf
    (+-Inf allowed where ``nan_only``)."""
    from patches.checkpoint.reading import nonfinite_flags

    sizes: list[int] = []
    real = torch.isfinite

    def isfinite(tensor):
        sizes.append(tensor.numel())
        return real(tensor)

    monkeypatch.setattr(torch, "isfinite", isfinite)
    clean = torch.randn(300_000).to(dtype)
    named = [("clean", clean, False)]
    for i, value in enumerate((float("nan"), float("inf"), float("-inf"))):
        bad = clean.clone()
        bad[123_456 + i] = value
        named += [(f"bad{i}", bad, False), (f"mask{i}", bad, True)]
    assert nonfinite_flags(named) == ["bad0", "bad1", "bad2", "mask0"]
    assert max(sizes) <= 1


def test_a_hash_that_cannot_run_refuses_the_load(tmp_path, monkeypatch):
    """The hash thread failing (here a MemoryError) is a refusal, never a file let through
    unverified."""
    path, _ = _saved(tmp_path / "run")

    def fails(*args, **kwargs):
        raise MemoryError("no room for the buffer")

    monkeypatch.setattr(digest, "_hash_chunks", fails)
    target = _objects(seed=1)
    kept = target[0][0].weight.detach().clone()
    with pytest.raises(CheckpointError, match="verify"):
        load_checkpoint(path, *target, freeze=False)
    assert torch.equal(target[0][0].weight, kept)
