"""One manifest format (issue 40, item 5): a checkpoint file's ``<name>.manifest.json`` and a
sharded folder's ``manifest.json`` have the same fields, are read by one parser
(``reading.parse_manifest``) and refused in the same words; the manifests earlier versions
wrote, of each kind, written here literally as they wrote them, still load, verify, resume
and prune. Real tiny models, real files, a real one-process DCP save."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import torch
from tiny_models import TinyTextModel

from patches.checkpoint import (CheckpointManager, check_file, load_checkpoint, manifest_path,
                                read_manifest, reading)
from patches.checkpoint.sharded import (COMMIT_NAME, MANIFEST_NAME, check_folder,
                                        read_folder_manifest, save_sharded)

VOCAB = 20


def _objects(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyTextModel(VOCAB, 8, "tanh")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(VOCAB)).logsumexp(-1).mean().backward()
    opt.step()
    return model, opt


def _both(root: Path):
    """(file, folder): the same state saved as a checkpoint file and as a sharded folder."""
    model, opt = _objects()
    file = CheckpointManager(root / "file", keep=None).save(3, model, opt)
    folder = save_sharded(CheckpointManager(root / "folder"), 3, model, opt, None, None, {})
    return model, file, folder


def _flip(path: Path, offset: int = 20) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _commit(folder: Path, text: str) -> None:
    """Write a folder's manifest and its commit marker, as a sharded save does."""
    (folder / MANIFEST_NAME).write_text(text)
    (folder / COMMIT_NAME).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def _shapes(model: torch.nn.Module) -> dict:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def test_a_file_and_a_folder_have_one_manifest_format_read_by_one_parser(tmp_path, monkeypatch):
    _, file, folder = _both(tmp_path)
    written = [json.loads(manifest_path(file).read_text()),
               json.loads((folder / MANIFEST_NAME).read_text())]
    assert set(written[0]) == set(written[1])
    assert written[0]["format"] == written[1]["format"] == "training-patches-manifest/1"
    assert list(written[0]["files"]) == [file.name] and len(written[1]["files"]) > 1
    for manifest in written:
        for entry in manifest["files"].values():
            assert set(entry) == {"bytes", "digest"}
            assert set(entry["digest"]) == {"version", "algorithm", "chunk_bytes", "chunks"}
    parsed: list[dict] = []
    real = reading.parse_manifest
    monkeypatch.setattr(reading, "parse_manifest", lambda data: parsed.append(data) or real(data))
    from_file, from_folder = read_manifest(file)[0], read_folder_manifest(folder)[0]
    assert [p["files"] for p in parsed] == [w["files"] for w in written]
    assert type(from_file) is type(from_folder)
    assert (from_file.step, from_file.generation) == (from_folder.step, from_folder.generation)
    assert from_file.data["param_shapes"] == from_folder.data["param_shapes"]


def test_a_file_and_a_folder_are_refused_in_the_same_words(tmp_path):
    """The same damage, the same reason: a changed byte, a file cut short, a manifest whose
    schema is wrong (the folder's reason names which of its files)."""
    _, file, folder = _both(tmp_path)
    _flip(file)
    _flip(folder / "meta.pt")
    reason = check_file(file)
    assert reason.startswith("does not match the BLAKE3 digest in its manifest")
    assert check_folder(folder) == f"does not hold what its manifest vouches for: meta.pt {reason}"
    for path in (file, folder / "meta.pt"):
        path.write_bytes(path.read_bytes()[:-1])
    size = file.stat().st_size
    assert check_file(file) == f"has {size} bytes but its manifest says {size + 1}"
    assert check_folder(folder).startswith("does not hold what its manifest vouches for: "
                                           "meta.pt has ")
    bad = {**json.loads(manifest_path(file).read_text()), "step": "fifty"}
    manifest_path(file).write_text(json.dumps(bad))
    _commit(folder, json.dumps({**json.loads((folder / MANIFEST_NAME).read_text()),
                                "step": "fifty"}))
    why = "that is not valid: 'step' is \"fifty\", expected a whole number >= 0"
    assert check_file(file) == f"has a manifest {manifest_path(file).name} {why}"
    assert check_folder(folder) == f"has a manifest {MANIFEST_NAME} {why}"


def test_a_file_manifest_an_earlier_version_wrote_still_loads_resumes_and_prunes(tmp_path):
    """Format training-patches-checkpoint/1 with its digest record, as CheckpointManager wrote
    it before the one format: the file's name, size and digest at the top."""
    out = tmp_path / "run"
    model, opt = _objects()
    path = CheckpointManager(out, keep=None).save(3, model, opt)
    data = path.read_bytes()
    manifest_path(path).write_text(json.dumps({
        "format": "training-patches-checkpoint/1",
        "written_by": "training-patches 0.9.0 CheckpointManager",
        "file": path.name, "step": 3, "generation": 0, "bytes": len(data),
        "digest": {"version": 1, "algorithm": "blake3", "chunk_bytes": 67108864,
                   "chunks": [blake3.blake3(data).hexdigest()]},
        "nonfinite": [], "vocab_size": VOCAB, "param_shapes": _shapes(model), "amp": False,
        "world_size": 1, "writer": {"rank": 0, "host": "node1", "pid": 4242},
        "time": "2025-01-01T12:00:00+0000"}, indent=1))
    manifest, invalid = read_manifest(path)
    assert invalid is None and manifest.file == path.name and manifest.generation == 0
    assert manifest.files[path.name]["bytes"] == len(data)
    assert check_file(path) is None and CheckpointManager(out).resume("auto") == path
    target = _objects(seed=1)
    load_checkpoint(path, *target, freeze=False)
    assert all(torch.equal(a, b) for a, b in zip(target[0].state_dict().values(),
                                                 model.state_dict().values()))
    _flip(path, len(data) // 2)
    assert "does not match the BLAKE3 digest" in check_file(path)
    assert CheckpointManager(out).resume("auto") is None
    _flip(path, len(data) // 2)
    newer = CheckpointManager(out, keep=1).save(4, model, opt)  # a generation after the old
    assert read_manifest(newer)[0].generation == 1
    assert not path.exists() and not manifest_path(path).exists()


def test_a_folder_manifest_an_earlier_version_wrote_still_loads_resumes_and_prunes(tmp_path):
    """Format training-patches-dcp-checkpoint/1, each file's whole SHA-256, as a sharded save
    wrote it before the one format, with its commit marker."""
    out = tmp_path / "run"
    model, opt = _objects()
    folder = save_sharded(CheckpointManager(out), 3, model, opt, None, None, {})
    files = {p.name: {"bytes": p.stat().st_size,
                      "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(folder.iterdir())
             if p.name not in (MANIFEST_NAME, COMMIT_NAME, "writer.json")}
    _commit(folder, json.dumps({
        "format": "training-patches-dcp-checkpoint/1",
        "written_by": "training-patches 0.9.0 CheckpointManager (DCP)",
        "step": 3, "generation": 0, "world_size": 1, "vocab_size": VOCAB,
        "param_shapes": _shapes(model), "has_optimizer": True, "nonfinite": [], "amp": False,
        "files": files, "writer": {"rank": 0, "host": "node1", "pid": 4242},
        "time": "2025-01-01T12:00:00+0000"}, indent=1))
    manifest, problem = read_folder_manifest(folder)
    assert problem is None and manifest["world_size"] == 1 and set(manifest["files"]) == set(files)
    assert check_folder(folder) is None and CheckpointManager(out).resume("auto") == folder
    fresh, fresh_opt = _objects(seed=1)
    load_checkpoint(folder, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values()))
    _flip(folder / "meta.pt")
    assert check_folder(folder) == ("does not hold what its manifest vouches for: meta.pt does "
                                    "not match the SHA-256 digest in its manifest (changed or "
                                    "damaged on disk)")
    assert CheckpointManager(out).resume("auto") is None
    _flip(folder / "meta.pt")
    newer = CheckpointManager(out, keep=1).save(4, model, opt)
    assert read_manifest(newer)[0].generation == 1 and not folder.exists()


def test_a_checkpoint_with_nan_is_said_once_it_is_written(tmp_path: Path, caplog) -> None:
    """A save whose weights hold NaN: one WARNING naming the file and the tensors, said once
    the checkpoint and its manifest exist (a file, a sharded folder), never before (a write
    that then failed would have been said to be written)."""
    import logging

    model, opt = _objects()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    seen: list[tuple[str, bool]] = []

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "holds NaN or Inf" in record.getMessage():
                exists = (manifest_path(file_path).is_file() if file_path.suffix == ".pt"
                          else (file_path / MANIFEST_NAME).is_file())
                seen.append((record.getMessage(), exists))

    watch = Watch()
    logging.getLogger("training_patches").addHandler(watch)
    try:
        file_path = tmp_path / "file" / "ckpt_000000003.pt"
        saved = CheckpointManager(tmp_path / "file", keep=None).save(3, model, opt)
        assert saved == file_path
        file_path = tmp_path / "folder" / "ckpt_000000003.dcp"
        folder = save_sharded(CheckpointManager(tmp_path / "folder"), 3, model, opt, None,
                              None, {})
        assert folder == file_path
    finally:
        logging.getLogger("training_patches").removeHandler(watch)
    assert len(seen) == 2 and all(exists for _, exists in seen), seen
    assert all("written to" in text and "text_embedding.weight" in text for text, _ in seen)
