"""Property tests (hypothesis) for the checkpoint manager and loader (issue 11, item 6).

The property: whatever is on disk (a manifest of any JSON shape or any bytes, a
checkpoint truncated, with bytes flipped or moved), ``check_file``, ``resume``,
``load_checkpoint`` and ``save`` either give a correct result or raise the library's own
:class:`~patches.checkpoint.CheckpointError`; never another exception type, and never a
half change: a refused load leaves model, optimizer, scheduler and scaler bit for bit as
they were.

The default run is bounded (a few dozen examples per test, a few seconds in all). For a
longer search::

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest -q -p no:cacheprovider \\
        tests/test_checkpoint_properties.py

(``long``: 2000 examples per test.) No example database is written to the tree.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import TinyTextModel
from torch import nn

from patches.checkpoint import (CheckpointError, CheckpointManager, check_file, load_checkpoint,
                                manifest_path, read_manifest)

torch.set_num_threads(1)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
EXAMPLES = {"long": 2000}.get(PROFILE, 40)
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
VOCAB, HIDDEN = 12, 8
NAME = "ckpt_000000005.pt"


TinyGPT = functools.partial(TinyTextModel, VOCAB, HIDDEN)


def _objects(seed: int):
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    tokens = torch.arange(VOCAB).reshape(2, -1)
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return model, opt, sched, scaler


@functools.lru_cache(maxsize=1)
def _good() -> tuple[bytes, str]:
    """The bytes of a real checkpoint written by the manager, and its manifest's text."""
    with tempfile.TemporaryDirectory() as tmp:
        path = CheckpointManager(tmp, keep=None).save(5, *_objects(0))
        return path.read_bytes(), manifest_path(path).read_text()


def _snapshot(model, opt, sched, scaler) -> list:
    out = [torch.get_rng_state()]
    for tree in (model.state_dict(), opt.state_dict(), sched.state_dict(), scaler.state_dict()):
        out.append(_flat(tree))
    out.append([dict(g) for g in opt.param_groups])
    return out


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {f"{prefix}{k}": _flat(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_flat(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return (tree.dtype, tuple(tree.shape), tree.detach().clone().view(-1).view(torch.uint8)
                if tree.numel() else tree.detach().clone())
    return tree


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _load_all_or_nothing(path: Path) -> bool:
    """Load ``path`` into trained objects: True when it loaded (and the model then holds
    exactly the file's weights), False when it was refused with a CheckpointError (and
    nothing changed). Any other exception fails the test."""
    target = _objects(1)
    before = _snapshot(*target)
    try:
        load_checkpoint(path, *target, freeze=False)
    except CheckpointError:
        assert _equal(_snapshot(*target), before), "a refused load changed something"
        return False
    on_disk = torch.load(path, map_location="cpu", weights_only=True)
    for key, value in target[0].state_dict().items():
        assert torch.equal(value, on_disk["model"][key]), key
    return True


# ----------------------------------------------------------------- manifests of any shape

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                  max_size=4),
    max_leaves=12)
REAL_KEYS = ("format", "step", "generation", "world_size", "files", "nonfinite", "vocab_size",
             "param_shapes", "has_optimizer", "amp", "time", "written_by",
             # the file's entry, and what an earlier version's manifest had at the top
             "files.bytes", "files.digest", "files.sha256", "file", "bytes", "sha256")


@st.composite
def manifests(draw) -> bytes:
    """Any JSON, any bytes, or the real manifest with some fields replaced or removed."""
    kind = draw(st.sampled_from(["json", "bytes", "mutated"]))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    data = json.loads(_good()[1])
    entry = data["files"][NAME]
    for key in draw(st.lists(st.sampled_from(REAL_KEYS), min_size=1, max_size=3, unique=True)):
        target, key = (entry, key[6:]) if key.startswith("files.") else (data, key)
        if draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = draw(JSON)
    return json.dumps(data).encode()


@SETTINGS
@given(manifest=manifests())
def test_any_manifest_gives_a_valid_choice_or_a_checkpoint_error(manifest: bytes) -> None:
    data, _ = _good()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / NAME
        path.write_bytes(data)
        manifest_path(path).write_bytes(manifest)
        parsed, invalid = read_manifest(path)
        problem = check_file(path)
        if parsed is None:
            assert problem is not None and invalid is not None
        manager = CheckpointManager(folder, keep=1)
        chosen = manager.resume("auto")
        assert chosen is None or (chosen == path and problem is None)
        loaded = _load_all_or_nothing(path)
        assert loaded == (problem is None)
        # Saving goes on whatever the folder holds, and the new save is the newest.
        saved = manager.save(6, TinyGPT())
        assert saved.exists() and check_file(saved) is None
        assert manager.resume("auto") == saved
        assert path.exists() or parsed is not None  # an unverified file is never deleted


# ----------------------------------------------------------------- damaged checkpoint bytes


@st.composite
def damage(draw) -> tuple[str, bytes]:
    data = bytearray(_good()[0])
    kind = draw(st.sampled_from(["truncate", "flip", "shuffle", "overwrite"]))
    if kind == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    elif kind == "shuffle":
        size = draw(st.integers(1, 512))
        start = draw(st.integers(0, len(data) - size))
        chunk = data[start:start + size]
        del data[start:start + size]
        at = draw(st.integers(0, len(data)))
        data[at:at] = chunk
    else:
        start = draw(st.integers(0, len(data) - 1))
        data[start:start + 64] = draw(st.binary(min_size=1, max_size=64))
    return kind, bytes(data)


@SETTINGS
@given(damaged=damage(), keep_manifest=st.booleans())
def test_damaged_bytes_are_refused_or_load_exactly_what_the_file_holds(
        damaged: tuple[str, bytes], keep_manifest: bool) -> None:
    _, data = damaged
    good, manifest = _good()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / NAME
        path.write_bytes(data)
        if keep_manifest:
            manifest_path(path).write_text(manifest)
        loaded = _load_all_or_nothing(path)
        if keep_manifest:
            # The manifest vouches for exact bytes: anything else is refused.
            assert loaded == (data == good)
            expected = path if data == good else None
            assert CheckpointManager(tmp).resume("auto") == expected
        else:
            assert CheckpointManager(tmp).resume("auto") is None  # never without a manifest
