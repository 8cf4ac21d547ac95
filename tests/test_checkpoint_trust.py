"""Issue 11, items 1 and 2: a checkpoint folder that never loses the newest work, and
loads that verify, all or nothing.

One named regression test per case the issue lists under "Why" for the manager and the
loader (each failed on the library before the fix), plus the controls that show each
check can tell good from bad. Plain PyTorch models only; a full disk is simulated by
monkeypatching ``shutil.disk_usage``/``os.statvfs`` or by a write that raises ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import TinyTextModel
from torch import nn

from patches import checkpoint as ck
from patches.checkpoint import (CheckpointError, CheckpointManager, DiskFullError, check_file,
                                load_checkpoint, manifest_path)

torch.set_num_threads(1)

VOCAB, HIDDEN = 20, 16


class TinyGPT(TinyTextModel):
    """Five parameters: text_embedding, body (weight, bias), text_head (weight, bias)."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__(vocab, HIDDEN)


def _objects(seed: int = 0, steps: int = 2):
    """Model, AdamW, warmup scheduler and a CPU GradScaler that have all run ``steps``."""
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=gen)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return model, opt, sched, scaler


def _state_of(model, opt, sched, scaler) -> dict:
    """Everything a load could change, copied (tensors cloned) for a bit-for-bit compare."""
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value
    sched_state = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    return {"model": copy(model.state_dict()), "optimizer": copy(opt.state_dict()),
            "scheduler": copy(sched_state), "scaler": copy(scaler.state_dict()),
            "lr": [g["lr"] for g in opt.param_groups]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                b.view(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _resave(src: Path, dst: Path, change) -> Path:
    """A copy of a checkpoint's payload, changed by ``change(payload)``, without a manifest."""
    payload = torch.load(src, weights_only=True)
    change(payload)
    torch.save(payload, dst)
    return dst


def _latest(folder: Path) -> str:
    return (folder / "latest").read_text().strip()


# ----------------------------------------------------------------- a roll-back loses the new branch


def _run_to_300(out: Path) -> None:
    model, opt, sched, scaler = _objects()
    manager = CheckpointManager(out, keep=None)
    for step in (100, 200, 300):
        manager.save(step, model, opt, sched, scaler)


def test_rollback_with_keep_1_keeps_the_new_save_and_latest_names_it(tmp_path):
    out = tmp_path / "run"
    _run_to_300(out)
    manager = CheckpointManager(out, keep=1)  # a new process, resumed from step 100
    model, opt, sched, scaler = _objects(seed=1)
    load_checkpoint(manager.path_for(100), model, opt, sched, scaler, freeze=False)
    saved = manager.save(110, model, opt, sched, scaler)
    assert saved.exists() and manifest_path(saved).exists()
    assert _latest(out) == saved.name == "ckpt_000000110.pt"
    assert (out / _latest(out)).exists()
    assert manager.checkpoints() == [saved]
    assert manager.resume("auto") == saved


def test_rollback_branch_with_keep_3_survives_the_next_saves(tmp_path):
    out = tmp_path / "run"
    _run_to_300(out)
    manager = CheckpointManager(out, keep=3)
    model, opt, sched, scaler = _objects(seed=1)
    load_checkpoint(manager.path_for(100), model, opt, sched, scaler, freeze=False)
    branch = []
    for step in (110, 120, 130, 140):
        branch.append(manager.save(step, model, opt, sched, scaler))
        assert all(p.exists() for p in branch[-3:]), f"a branch save was pruned at step {step}"
        assert manager.resume("auto") == branch[-1]
        assert _latest(out) == branch[-1].name
    # The abandoned steps 200 and 300 went first: they were written before the branch.
    assert [p.name for p in manager.checkpoints()] == [p.name for p in branch[-3:]]


def test_resume_auto_returns_the_last_written_not_the_highest_step(tmp_path):
    out = tmp_path / "run"
    _run_to_300(out)
    model, *_ = _objects(seed=1)
    saved = CheckpointManager(out, keep=None).save(110, model)
    assert CheckpointManager(out).resume("auto") == saved
    generations = [json.loads(manifest_path(p).read_text())["generation"]
                   for p in CheckpointManager(out, keep=None).checkpoints()]
    assert generations == [0, 1, 2, 3]  # 100, 200, 300, then 110: the order written


def test_saving_a_step_again_replaces_it_and_it_is_the_newest(tmp_path):
    out = tmp_path / "run"
    _run_to_300(out)
    manager = CheckpointManager(out, keep=2)
    model, *_ = _objects(seed=2)
    saved = manager.save(200, model)
    assert saved.exists() and check_file(saved) is None
    assert manager.resume("auto") == saved and _latest(out) == saved.name
    assert [p.name for p in manager.checkpoints()] == ["ckpt_000000300.pt", "ckpt_000000200.pt"]


# ----------------------------------------------------------------- foreign files win


def test_foreign_file_with_a_bigger_number_never_wins_and_is_never_deleted(tmp_path):
    out = tmp_path / "run"
    model, *_ = _objects()
    manager = CheckpointManager(out, keep=1)
    good = manager.save(200, model)
    pretrained = out / "pretrained_base_v2024.pth"
    torch.save({"model": TinyGPT().state_dict()}, pretrained)
    unfinished = out / "ckpt_000000900.pt"  # named like ours, but no manifest
    torch.save({"model": model.state_dict(), "step": 900}, unfinished)
    assert check_file(pretrained) is None  # a valid torch file: only the manifest is missing
    assert manager.resume("auto") == good
    manager.save(210, model)
    manager.save(220, model)
    assert pretrained.exists() and unfinished.exists()
    assert manager.resume("auto") == manager.path_for(220)


def test_random_bytes_starting_with_0x80_fail_check_file(tmp_path):
    rng = np.random.default_rng(0)
    for index in range(20):
        junk = tmp_path / f"junk_{index}.pt"
        junk.write_bytes(b"\x80" + rng.bytes(int(rng.integers(1, 5000))))
        assert check_file(junk) is not None, junk.read_bytes()[:16]
    plain = tmp_path / "plain_pickle.pt"
    plain.write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=2))
    assert "not a file written by torch.save" in check_file(plain)
    # Control: torch's real legacy format (pickle, magic number first) passes and loads.
    legacy = tmp_path / "legacy.pt"
    model = TinyGPT()
    torch.save({"model": model.state_dict()}, legacy, _use_new_zipfile_serialization=False)
    assert check_file(legacy) is None
    fresh = TinyGPT()
    load_checkpoint(legacy, fresh, freeze=False)
    assert torch.equal(fresh.text_head.weight, model.text_head.weight)


class _WritesMarker:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_errors_never_recommend_malicious_garbage_or_manifestless_files(tmp_path):
    out = tmp_path / "run"
    model, *_ = _objects()
    good = CheckpointManager(out, keep=None).save(100, model)
    evil = out / "ckpt_000000999.pt"
    torch.save({"model": model.state_dict(), "x": _WritesMarker(tmp_path / "PWNED")}, evil)
    garbage = out / "ckpt_000000998.pt"
    garbage.write_bytes(b"\x80" + os.urandom(300))
    bare = out / "model_99999.pth"
    torch.save(model.state_dict(), bare)
    damaged = out / "ckpt_000000500.pt"
    damaged.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(damaged, TinyGPT())
    message = str(info.value)
    assert f"The newest valid checkpoint beside it is {good}" in message
    for name in (evil.name, garbage.name, bare.name):
        assert name not in message
    assert not (tmp_path / "PWNED").exists()
    # With no manager checkpoint at all, nothing is recommended.
    good.unlink()
    with pytest.raises(CheckpointError, match="No other valid checkpoint was found"):
        load_checkpoint(damaged, TinyGPT())


# ----------------------------------------------------------------- loads that verify


def _flip_inside(path: Path, tensor: torch.Tensor) -> None:
    """Flip the lowest mantissa bit of one element of ``tensor``'s bytes in ``path``."""
    data = bytearray(path.read_bytes())
    offset = bytes(data).find(tensor.detach().numpy().tobytes())
    assert offset > 0
    data[offset + 4 * 7] ^= 0x01  # element 7, lowest byte (little endian): still finite
    path.write_bytes(bytes(data))


def test_flipped_byte_in_the_text_embedding_is_refused_by_the_hash(tmp_path, caplog):
    model, opt, sched, scaler = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(5, model, opt, sched, scaler)
    _flip_inside(path, model.text_embedding.weight)
    target = _objects(seed=3)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="does not match the BLAKE3 digest") as info:
        load_checkpoint(path, *target, freeze=False)
    assert str(path) in str(info.value) and "verify_hash=False" in str(info.value)
    assert _same(_state_of(*target), before)
    assert CheckpointManager(tmp_path / "run").resume("auto") is None
    # The escape hatch loads it and says that it did not check.
    with caplog.at_level(logging.INFO, logger="training_patches"):
        load_checkpoint(path, target[0], freeze=False, verify_hash=False)
    assert "was not checked (verify_hash=False)" in caplog.text
    flipped = target[0].text_embedding.weight.detach().view(-1)[7]
    assert flipped != model.text_embedding.weight.detach().view(-1)[7]


def test_flipped_byte_without_a_manifest_is_refused_by_the_zip_crc(tmp_path):
    """A coqui Trainer checkpoint has no manifest: the CRC-32s torch stores catch the flip."""
    model, opt, sched, scaler = _objects()
    path = tmp_path / "checkpoint_5.pth"
    torch.save({"model": model.state_dict(), "optimizer": [opt.state_dict()], "step": 5}, path)
    _flip_inside(path, model.text_embedding.weight)
    target = _objects(seed=3)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="CRC-32"):
        load_checkpoint(path, *target, freeze=False)
    assert _same(_state_of(*target), before)
    assert "CRC-32" in check_file(path) and check_file(path, verify_hash=False) is None


def test_meta_tensor_is_refused_before_any_parameter_is_overwritten(tmp_path):
    model, *_ = _objects()
    state = model.state_dict()
    state["text_head.bias"] = torch.empty(VOCAB, device="meta")  # the last of 5 parameters
    path = tmp_path / "meta.pt"
    torch.save({"model": state, "step": 3}, path)
    target = _objects(seed=4)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="hold no data.*text_head.bias"):
        load_checkpoint(path, *target, freeze=False)
    assert _same(_state_of(*target), before)  # 0 of 5 parameters overwritten


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused_and_resume_auto_passes_over_them(tmp_path, caplog, bad):
    out = tmp_path / "run"
    model, opt, sched, scaler = _objects()
    manager = CheckpointManager(out, keep=None)
    clean = manager.save(100, model, opt, sched, scaler)
    with torch.no_grad():
        model.body.weight[2, 3] = bad
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        poisoned = manager.save(200, model, opt, sched, scaler)
    assert "holds NaN or Inf" in caplog.text
    assert json.loads(manifest_path(poisoned).read_text())["nonfinite"] == ["model.body.weight"]
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert manager.resume("auto") == clean
    assert "ckpt_000000200.pt held NaN or Inf" in caplog.text
    target = _objects(seed=5)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="NaN or Inf.*body.weight") as info:
        load_checkpoint(poisoned, *target, freeze=False)
    assert f"The newest valid checkpoint beside it is {clean}" in str(info.value)
    assert _same(_state_of(*target), before)
    # Asked for explicitly, it loads.
    load_checkpoint(poisoned, target[0], freeze=False, allow_nonfinite=True)
    assert not torch.isfinite(target[0].body.weight).all()
    assert manager.resume("auto", allow_nonfinite=True) == poisoned


def test_nonfinite_optimizer_moment_is_refused(tmp_path):
    model, opt, sched, scaler = _objects()
    good = CheckpointManager(tmp_path / "run", keep=None).save(5, model, opt, sched, scaler)

    def poison(payload):
        payload["optimizer"][0]["state"][1]["exp_avg_sq"][0, 0] = float("nan")

    bad = _resave(good, tmp_path / "bad_moment.pt", poison)
    target = _objects(seed=6)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="optimizer state holds NaN or Inf.*exp_avg_sq"):
        load_checkpoint(bad, *target, freeze=False)
    assert _same(_state_of(*target), before)
    # policy='reset' keeps the weights and starts the optimizer fresh: the way out it names.
    report = load_checkpoint(bad, *target, freeze=False, policy="reset")
    assert report.reset == ["optimizer", "scheduler", "scaler"]


def test_an_inf_attention_mask_buffer_still_loads(tmp_path):
    """Control for the finite rule: buffers may hold -inf on purpose (NaN they may not)."""
    class Masked(TinyGPT):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))

    source = Masked()
    path = CheckpointManager(tmp_path / "run", keep=None).save(1, source)
    assert json.loads(manifest_path(path).read_text())["nonfinite"] == []
    target = Masked()
    load_checkpoint(path, target, freeze=False)
    assert torch.equal(target.mask, source.mask)
    with torch.no_grad():
        source.mask[0, 0] = float("nan")
    nan_path = CheckpointManager(tmp_path / "run", keep=None).save(2, source)
    with pytest.raises(CheckpointError, match="NaN or Inf.*mask"):
        load_checkpoint(nan_path, Masked(), freeze=False)


def _bad_group_lr(payload):
    payload["optimizer"][0]["param_groups"][0]["lr"] = "fast"


def _bad_scheduler(payload):
    payload["scheduler"][0]["last_epoch"] = "x"


def _bad_scaler(payload):
    payload["scaler"]["scale"] = float("nan")


def _bad_rng(payload):
    payload["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)  # torch refuses it at restore


def _bad_step(payload):
    payload["step"] = "fifty"


def _bad_optimizer_shape(payload):
    payload["optimizer"][0]["state"][2]["exp_avg"] = torch.zeros(3)


def _optimizer_for_unknown_param(payload):
    payload["optimizer"][0]["state"][77] = {"step": torch.tensor(1.0)}


@pytest.mark.parametrize("change", [_bad_group_lr, _bad_scheduler, _bad_scaler, _bad_rng,
                                    _bad_step, _bad_optimizer_shape, _optimizer_for_unknown_param])
def test_a_refused_load_changes_nothing_in_model_optimizer_scheduler_scaler(tmp_path, change):
    model, opt, sched, scaler = _objects(steps=3)
    good = CheckpointManager(tmp_path / "run", keep=None).save(3, model, opt, sched, scaler)
    bad = _resave(good, tmp_path / f"{change.__name__}.pt", change)
    target = _objects(seed=7, steps=2)
    before = _state_of(*target)
    rng_before = torch.get_rng_state()
    with pytest.raises(CheckpointError):
        load_checkpoint(bad, *target, freeze=False)
    assert _same(_state_of(*target), before)
    assert torch.equal(torch.get_rng_state(), rng_before)
    # Control: the unchanged checkpoint does change all four.
    load_checkpoint(good, *target, freeze=False)
    assert not _same(_state_of(*target), before)


def test_a_model_that_refuses_late_gets_optimizer_scheduler_scaler_back(tmp_path):
    model, opt, sched, scaler = _objects(steps=3)
    good = CheckpointManager(tmp_path / "run", keep=None).save(3, model, opt, sched, scaler)
    target = _objects(seed=8, steps=2)

    def refuse(*args, **kwargs):
        raise RuntimeError("a module's own load hook said no")

    target[0].body._register_load_state_dict_pre_hook(refuse)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="torch refused part of it.*put back"):
        load_checkpoint(good, *target, freeze=False)
    after = _state_of(*target)
    for part in ("optimizer", "scheduler", "scaler", "lr"):
        assert _same(after[part], before[part]), part


def test_decide_changes_nothing_and_apply_carries_out_its_plan(tmp_path):
    """The two phases of a load: decide() reads, validates and plans with the objects left
    exactly as they were; parts.apply_state() then changes all four as the plan says."""
    from patches.checkpoint.decide import LoadOptions, decide
    from patches.checkpoint.parts import apply_state
    from patches.checkpoint.report import LoadReport

    model, opt, sched, scaler = _objects(steps=3)
    good = CheckpointManager(tmp_path / "run", keep=None).save(3, model, opt, sched, scaler)
    target = _objects(seed=9, steps=2)
    before = _state_of(*target)
    rng_before = torch.get_rng_state()
    plan = decide(Path(good), *target, LoadOptions(freeze=False))
    assert _same(_state_of(*target), before)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert (plan.effective, plan.saved_step, plan.rng is not None) == ("remap", 3, True)
    report = LoadReport(path=str(good), policy=plan.policy, step=3)
    apply_state(plan.state, report)
    after = _state_of(*target)
    for part in ("model", "optimizer", "scheduler", "scaler"):
        assert not _same(after[part], before[part]), part
    assert report.restored == ["optimizer", "scheduler", "scaler"] and report.rng_restored


# ----------------------------------------------------------------- another kind of optimizer


def _kinds(opt_cls, sched_kind: str, seed: int = 0):
    """A model with an optimizer of ``opt_cls`` and a scheduler of ``sched_kind``, stepped."""
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = opt_cls(model.parameters(), lr=1e-2)
    sched = {"lambda": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
             "step": lambda: torch.optim.lr_scheduler.StepLR(opt, 3),
             "exponential": lambda: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)}[sched_kind]()
    tokens = torch.randint(0, VOCAB, (4, 5))
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _bare_file(path: Path, model, opt, sched) -> Path:
    """A checkpoint as coqui or a plain loop writes it: no record of the classes."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": 2}, path)
    return path


KIND_CASES = {  # saved (optimizer, scheduler) -> loaded into (optimizer, scheduler)
    "sgd_into_adamw": ((torch.optim.SGD, "lambda"), (torch.optim.AdamW, "lambda"), "optimizer"),
    "adamw_into_sgd": ((torch.optim.AdamW, "lambda"), (torch.optim.SGD, "lambda"), "optimizer"),
    "adam_into_adamw": ((torch.optim.Adam, "lambda"), (torch.optim.AdamW, "lambda"), "optimizer"),
    "steplr_into_lambdalr": ((torch.optim.AdamW, "step"), (torch.optim.AdamW, "lambda"),
                             "scheduler"),
    "exponential_into_steplr": ((torch.optim.AdamW, "exponential"), (torch.optim.AdamW, "step"),
                                "scheduler"),
}


@pytest.mark.parametrize("recorded", [True, False], ids=["manager_file", "bare_file"])
@pytest.mark.parametrize("case", list(KIND_CASES))
def test_a_state_of_another_class_is_refused_never_restored(tmp_path, case, recorded):
    """Issue 26 item 8: torch loads an SGD state into AdamW (or a StepLR state into a
    LambdaLR) and steps with the wrong settings; under remap it is refused, nothing
    changed, and under reset the same file loads with all three started fresh."""
    (saved_opt, saved_sched), (opt_cls, sched_kind), part = KIND_CASES[case]
    source = _kinds(saved_opt, saved_sched)
    path = (CheckpointManager(tmp_path / "run", keep=None).save(2, *source) if recorded
            else _bare_file(tmp_path / "bare.pt", *source))
    model, opt, sched = _kinds(opt_cls, sched_kind, seed=5)
    before = {"model": {k: v.clone() for k, v in model.state_dict().items()},
              "groups": [dict(g, params=None) for g in opt.param_groups],
              "state": {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}}
    with pytest.raises(ck.CheckpointMismatchError) as info:
        load_checkpoint(path, model, opt, sched, freeze=False)
    message = str(info.value)
    assert f"the {part} state in {path}" in message and "Nothing was loaded" in message
    assert "policy='reset'" in message
    assert _same({k: v for k, v in model.state_dict().items()}, before["model"])
    assert [dict(g, params=None) for g in opt.param_groups] == before["groups"]
    assert _same({k: dict(v) for k, v in opt.state.items()}, before["state"])
    report = load_checkpoint(path, model, opt, sched, freeze=False, policy="reset")
    assert report.parts["optimizer"].status == "reset"
    assert report.parts["scheduler"].status == "reset"


def test_a_state_of_the_same_class_is_still_restored(tmp_path):
    """The control of the test above: same classes, with and without the record."""
    for index, recorded in enumerate((True, False)):
        source = _kinds(torch.optim.AdamW, "step")
        path = (CheckpointManager(tmp_path / "run", keep=None).save(2, *source) if recorded
                else _bare_file(tmp_path / "bare.pt", *source))
        model, opt, sched = _kinds(torch.optim.AdamW, "step", seed=5 + index)
        report = load_checkpoint(path, model, opt, sched, freeze=False)
        assert report.parts["optimizer"].status == "restored"
        assert report.parts["scheduler"].status == "restored"
        assert sched.state_dict()["last_epoch"] == 2


# ----------------------------------------------------------------- bad disk


@pytest.mark.parametrize("how", ["disk_usage", "statvfs"])
def test_full_disk_is_one_paragraph_before_anything_is_written(tmp_path, monkeypatch, how):
    out = tmp_path / "run"
    model, opt, sched, scaler = _objects()
    manager = CheckpointManager(out, keep=None)
    first = manager.save(1, model, opt, sched, scaler)
    listing = sorted(p.name for p in out.iterdir())
    if how == "disk_usage":
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    else:
        real = os.statvfs(out)
        fake = os.statvfs_result((real.f_bsize, 4096, real.f_blocks, 1, 1, real.f_files,
                                  real.f_ffree, real.f_favail, real.f_flag, real.f_namemax))
        monkeypatch.setattr(os, "statvfs", lambda p: fake)
    with pytest.raises(DiskFullError) as info:
        manager.save(2, model, opt, sched, scaler)
    message = str(info.value)
    assert str(out) in message and "4096 bytes" in message and "needs about" in message
    assert info.value.free == 4096 and info.value.needed > first.stat().st_size
    assert "enforce fail" not in message and "\n" not in message
    assert sorted(p.name for p in out.iterdir()) == listing


class _FillsUp:
    """A file whose writes raise ENOSPC once ``budget`` bytes went to disk in total."""

    def __init__(self, handle, state: dict) -> None:
        self._handle, self._state = handle, state

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if self._state["left"] < size:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._state["left"] -= size
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)


def _disk_that_fills(monkeypatch, budget: int) -> None:
    state = {"left": budget}
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FillsUp(real(fd, *a, **k), state))


def test_disk_full_during_the_write_is_one_paragraph_not_torchs_enforce_fail(tmp_path,
                                                                               monkeypatch):
    out = tmp_path / "run"
    model, opt, sched, scaler = _objects()
    manager = CheckpointManager(out, keep=None)
    first = manager.save(1, model, opt, sched, scaler)
    listing = {p.name: p.read_bytes() for p in out.iterdir()}
    _disk_that_fills(monkeypatch, budget=5000)
    with pytest.raises(DiskFullError) as info:
        manager.save(2, model, opt, sched, scaler)
    message = str(info.value)
    assert "disk filled up while writing ckpt_000000002.pt" in message and str(out) in message
    assert "enforce fail" not in message and "partial file was removed" in message
    assert isinstance(info.value.__cause__, RuntimeError)  # what torch raised underneath
    assert {p.name: p.read_bytes() for p in out.iterdir()} == listing  # nothing left behind
    assert manager.resume("auto") == first


def test_disk_full_between_checkpoint_and_manifest_leaves_no_orphan(tmp_path, monkeypatch):
    out = tmp_path / "run"
    model, opt, sched, scaler = _objects()
    manager = CheckpointManager(out, keep=None)
    first = manager.save(1, model, opt, sched, scaler)
    size = first.stat().st_size
    _disk_that_fills(monkeypatch, budget=size + 10)  # the checkpoint fits, its manifest not
    with pytest.raises(DiskFullError):
        manager.save(2, model, opt, sched, scaler)
    assert not manager.path_for(2).exists() and not manifest_path(manager.path_for(2)).exists()
    assert not [p for p in out.iterdir() if ".tp-tmp-" in p.name]
    monkeypatch.undo()
    # Nothing blocks the next saves.
    third = manager.save(3, model, opt, sched, scaler)
    assert manager.resume("auto") == third and manager.checkpoints() == [first, third]


def test_a_killed_writers_latest_temp_file_is_swept_like_the_others(tmp_path):
    """Issue 26: the ``latest`` pointer is written through a temporary file too; a kill
    between its write and its rename left ``.latest.tp-tmp-...`` for good."""
    import subprocess

    from patches.checkpoint.atomic import host_name, temp_prefix

    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    here = host_name()
    dead_latest = out / f".latest.tp-tmp-{dead.pid}@{here}~abc123"
    dead_ckpt = out / f".ckpt_000000001.pt.tp-tmp-{dead.pid}@{here}~def456"
    live_latest = out / f".latest.tp-tmp-{os.getppid()}@{here}~ghi789"  # a writer that runs
    other_host = out / f".latest.tp-tmp-{dead.pid}@another-node~jkl012"
    for path in (dead_latest, dead_ckpt, live_latest, other_host):
        path.write_bytes(b"ckpt_000000001.pt\n")
    assert temp_prefix("latest").startswith(".latest.tp-tmp-")  # the name the writer uses
    CheckpointManager(out, keep=None).save(2, TinyGPT())
    assert not dead_latest.exists() and not dead_ckpt.exists()
    assert live_latest.exists() and other_host.exists()
    assert _latest(out) == "ckpt_000000002.pt"


def test_a_killed_writer_not_yet_reaped_has_ended_and_its_temp_file_is_swept(tmp_path):
    """A writer killed with its launcher stays a zombie until someone reaps it: it no longer
    runs, so the next save removes its temporary file (a zombie answers ``kill(pid, 0)``)."""
    import signal
    import subprocess
    import time

    from patches.checkpoint.atomic import host_name, pid_alive

    out = tmp_path / "run"
    out.mkdir()
    writer = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(writer.pid, signal.SIGKILL)
        while Path(f"/proc/{writer.pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
            time.sleep(0.01)  # killed, not reaped: a zombie
        assert not pid_alive(writer.pid) and pid_alive(os.getpid())
        torn = out / f".ckpt_000000001.pt.tp-tmp-{writer.pid}@{host_name()}~abc123"
        torn.write_bytes(b"half a checkpoint")
        CheckpointManager(out, keep=None).save(2, TinyGPT())
        assert not torn.exists()
    finally:
        writer.wait()


SAVE_UNDER_A_LIMIT = r"""
import sys
import torch
from patches.checkpoint import CheckpointError, CheckpointManager
manager = CheckpointManager(sys.argv[1], keep=None)
manager.save(1, torch.nn.Linear(4, 4))              # a few KB: under the limit
try:
    manager.save(2, torch.nn.Linear(512, 512))      # 1 MB: over it
except CheckpointError as exc:
    print(type(exc).__name__, exc, file=sys.stderr)
    sys.exit(1)
"""


def test_a_save_over_the_file_size_limit_is_one_paragraph(tmp_path):
    """Issue 26 item 7: CheckpointManager.save under ``ulimit -f`` raised torch's
    "[enforce fail at inline_container.cc]" RuntimeError. Now one CheckpointWriteError
    paragraph naming the limit; nothing partial left, the earlier checkpoint still resumes."""
    from io_faults import run_with_file_limit, temporaries

    out = tmp_path / "run"
    script = tmp_path / "save.py"
    script.write_text(SAVE_UNDER_A_LIMIT, encoding="utf-8")
    done = run_with_file_limit([str(script), str(out)], 200_000, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    err = done.stderr.strip()
    assert err.startswith("CheckpointWriteError training-patches: could not write "
                          f"{out / 'ckpt_000000002.pt'}: the file would pass this process's "
                          "file-size limit (ulimit -f)"), err
    assert "enforce fail" not in err and len(err.splitlines()) == 1
    assert not manager_path_exists(out, 2) and temporaries(out) == []
    assert CheckpointManager(out, keep=None).resume("auto") == out / "ckpt_000000001.pt"


def manager_path_exists(out: Path, step: int) -> bool:
    path = CheckpointManager(out, keep=None).path_for(step)
    return path.exists() or manifest_path(path).exists()


def test_a_save_into_a_read_only_folder_is_one_paragraph(tmp_path):
    """Issue 26 item 7: a read-only folder (the mount; root ignores permission bits) is one
    CheckpointWriteError paragraph, not an OSError from deep inside the save."""
    from io_faults import read_only

    with read_only(tmp_path / "ro") as folder:
        with pytest.raises(ck.CheckpointWriteError) as info:
            CheckpointManager(folder, keep=None).save(1, TinyGPT())
        message = str(info.value)
        assert "the file system is read-only" in message and str(folder) in message
        assert not isinstance(info.value, DiskFullError) and list(folder.iterdir()) == []
        with pytest.raises(ck.CheckpointWriteError, match="read-only"):
            ck.atomic_torch_save({"w": torch.ones(2)}, folder / "checkpoint_5.pth")


def test_atomic_torch_save_checks_the_space_too(tmp_path, monkeypatch):
    """coqui's save_fsspec goes through atomic_torch_save: the same paragraph there."""
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 0, 100))
    target = tmp_path / "checkpoint_5.pth"
    with pytest.raises(DiskFullError, match="100 bytes"):
        ck.atomic_torch_save({"model": TinyGPT().state_dict()}, target)
    assert list(tmp_path.iterdir()) == []
    ck.atomic_torch_save({"w": torch.ones(2)}, target, check_space=False)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))


# ----------------------------------------------------------------- bad manifest


BAD_MANIFESTS = {
    "a_list": "[1, 2, 3]",
    "step_fifty": None,  # filled in from the real manifest below
    "missing_digest": None,
    "negative_generation": None,
    "null": "null",
    "not_json": "{not json",
    "empty": "",
    "deep": "[" * 100000 + "]" * 100000,
    "bytes_as_text": None,
}


def _bad_manifest(real: dict, kind: str) -> str:
    text = BAD_MANIFESTS[kind]
    if text is not None:
        return text
    data = dict(real)
    if kind == "step_fifty":
        data["step"] = "fifty"
    elif kind == "missing_digest":
        del data["files"][next(iter(data["files"]))]["digest"]
    elif kind == "negative_generation":
        data["generation"] = -1
    else:
        entry = data["files"][next(iter(data["files"]))]
        entry["bytes"] = str(entry["bytes"])
    return json.dumps(data)


@pytest.mark.parametrize("kind", sorted(BAD_MANIFESTS))
def test_wrong_shaped_manifest_never_crashes_save_resume_or_load(tmp_path, caplog, kind):
    out = tmp_path / "run"
    model, opt, sched, scaler = _objects()
    manager = CheckpointManager(out, keep=1)
    older = manager.save(40, model, opt, sched, scaler)
    broken = CheckpointManager(out, keep=None).save(50, model, opt, sched, scaler)
    man = manifest_path(broken)
    man.write_text(_bad_manifest(json.loads(man.read_text()), kind))
    # Its checkpoint is invalid: not chosen, not loaded, and no crash anywhere.
    assert "manifest" in check_file(broken) and "not valid" in check_file(broken)
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        assert manager.resume("auto") == older
    assert "ckpt_000000050.pt has a manifest that is not valid" in caplog.text
    target = _objects(seed=9)
    before = _state_of(*target)
    with pytest.raises(CheckpointError, match="not valid"):
        load_checkpoint(broken, *target, freeze=False)
    assert _same(_state_of(*target), before)
    # Later saves work and the broken one is never deleted (it has no valid manifest).
    for step in (60, 70):
        saved = manager.save(step, model, opt, sched, scaler)
        assert saved.exists()
    assert manager.resume("auto") == manager.path_for(70)
    assert broken.exists() and man.exists() and not older.exists()


def test_manifest_schema_accepts_what_the_manager_writes_and_old_manifests(tmp_path):
    model, *_ = _objects()
    path = CheckpointManager(tmp_path / "run", keep=None).save(7, model)
    parsed = ck.read_manifest(path)[0]
    assert parsed.step == 7 and parsed.generation == 0 and parsed.nonfinite == ()
    # A manifest from before generations (0.1), as it wrote it: still valid, older than any
    # newer save.
    manifest_path(path).write_text(json.dumps({
        "format": "training-patches-checkpoint/1", "file": path.name, "step": 7,
        "bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "vocab_size": None, "param_shapes": {}, "amp": False}))
    assert check_file(path) is None and ck.read_manifest(path)[0].generation is None
    newer = CheckpointManager(tmp_path / "run", keep=None).save(3, model)
    assert CheckpointManager(tmp_path / "run").resume("auto") == newer
