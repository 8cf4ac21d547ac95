"""Every load message true (issue 19): the LoadReport's parts and the log lines built from them.

For each part of a checkpoint (model, optimizer, scheduler, scaler, step, RNG) the report
says restored / remapped / reset / dropped / absent, and the one INFO line is that report.
A step lost because the file has no optimizer state, and the optimizer state and step a
weights-only start (XTTS's ``xtts_checkpoint``) drops, are WARNINGs. A key prefix stripped
and a dtype cast each get a line; a safetensors file is read as one, or refused as one.
Real tiny torch models, real files; nothing mocked except a missing package.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from tiny_models import TinyTextModel

from patches.checkpoint import (CheckpointError, LoadReport, load_checkpoint, warn_weights_only)

LOGGER = "training_patches"


def Tiny(vocab: int = 20, width: int = 8) -> torch.nn.Module:
    """A text embedding and head (the vocabulary) around one hidden layer."""
    return TinyTextModel(vocab, width, "tanh")


def _trained(vocab: int = 20, seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(3):
        model(torch.arange(vocab)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _fresh(vocab: int = 20):
    model = Tiny(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def _status(report: LoadReport) -> dict[str, str]:
    return {name: part.status for name, part in report.parts.items()}


def _lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_full_remap_load_reports_every_part_and_logs_that_report(tmp_path, caplog):
    model, opt, sched = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    path = tmp_path / "ckpt_x.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "step": 5,
                "rng": {"torch": torch.get_rng_state()}}, path)
    big, big_opt, big_sched = _fresh(26)  # the tokenizer grew: 20 -> 26 rows
    big_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, big, big_opt, big_sched, big_scaler, freeze=False)
    assert _status(report) == {"model": "remapped", "optimizer": "remapped",
                               "scheduler": "restored", "scaler": "restored",
                               "step": "restored", "rng": "restored"}
    assert report.step == report.saved_step == 5
    assert big_scaler.get_scale() == 1024.0  # read from the object: restored for real
    assert big_sched.last_epoch == sched.last_epoch
    # The one INFO line is the report: every part, in order, with what was done.
    line = next(m for m in _lines(caplog, logging.INFO) if m.startswith("training-patches: loaded"))
    assert line == f"training-patches: {report.summary()}"
    assert (f"loaded {path} (policy remap): model remapped (5 tensor(s), 3 of them grown by 6 "
            f"vocabulary row(s) (embedding spelling: no tokenizer was given to spell "
            f"the new tokens: all by spread, head spread; embedding rule auto: not probed (no "
            f"tokenizer was given to draw the probe's texts from) -> spelling, the rule where "
            f"the base model reads (docs/design/row_init.md))), optimizer remapped (moments of 3 "
            f"grown parameter(s) resized") in line
    assert "scheduler restored, scaler restored, step 5 restored, RNG restored" in line
    assert not _lines(caplog, logging.WARNING)


def test_step_without_optimizer_state_is_a_warning_not_a_silent_reset(tmp_path, caplog):
    model, opt, sched = _trained()
    path = tmp_path / "weights_and_step.pt"
    torch.save({"model": model.state_dict(), "step": 5}, path)
    fresh, fresh_opt, fresh_sched = _fresh()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert report.step == 0 and report.saved_step == 5 and report.policy == "reset"
    assert report.parts["step"].status == "reset"
    assert "saved 5" in report.parts["step"].detail
    assert report.parts["optimizer"].status == "reset"
    assert report.parts["optimizer"].detail == "absent in file"
    warnings = _lines(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "has no optimizer state" in warnings[0] and "(the file's step: 5)" in warnings[0]
    assert "resumes at step 0" in warnings[0] and str(path) in warnings[0]
    assert "step reset (saved 5, resuming at 0: the file has no optimizer state)" in caplog.text


def test_explicit_reset_says_what_it_did_without_a_warning(tmp_path, caplog):
    model, opt, sched = _trained()
    path = tmp_path / "full.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": 7}, path)
    fresh, fresh_opt, _ = _fresh()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, fresh, fresh_opt, policy="reset")
    assert _status(report) == {"model": "restored", "optimizer": "reset", "scheduler": "dropped",
                               "scaler": "absent", "step": "reset", "rng": "absent"}
    assert report.parts["scheduler"].detail == "no scheduler passed"
    assert "optimizer reset (policy reset; the file's state not loaded)" in caplog.text
    assert not _lines(caplog, logging.WARNING)  # asked for: said at INFO, not warned


def test_weights_only_start_reports_the_dropped_step_and_warns(tmp_path, caplog):
    model, opt, sched = _trained()
    path = tmp_path / "full.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": 5}, path)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, Tiny(), restore_rng=False, resume_step=False)
        assert warn_weights_only(report, "a test start", "Resume it another way.")
    assert report.step == 0 and report.saved_step == 5
    assert _status(report)["optimizer"] == "dropped" and _status(report)["step"] == "dropped"
    assert "optimizer dropped (no optimizer passed)" in caplog.text
    assert "step dropped (saved 5; a weights-only start counts from 0)" in caplog.text
    (warning,) = _lines(caplog, logging.WARNING)
    assert "holds optimizer state, scheduler state and step 5 that this load did not restore: " \
           "a test start" in warning
    # A file with nothing of training in it: no warning.
    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not warn_weights_only(load_checkpoint(bare, Tiny(), resume_step=False), "x", "y")
    assert not _lines(caplog, logging.WARNING)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_prefix_strip_gets_a_line_with_the_count(tmp_path, caplog, prefix):
    model, _, _ = _trained()
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in model.state_dict().items()}, path)
    fresh = Tiny()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, fresh)
    assert torch.equal(fresh.body.weight, model.body.weight)
    assert report.prefix_stripped == prefix and report.renamed_keys == 5
    assert (f"stripped the prefix {prefix!r} from 5 key(s) of the file to match the model's "
            f"names") in caplog.text
    # Without a prefix: no such line.
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert load_checkpoint(plain, Tiny()).renamed_keys == 0
    assert "stripped the prefix" not in caplog.text


def test_bf16_file_into_fp32_model_gets_a_cast_line(tmp_path, caplog):
    model, _, _ = _trained()
    path = tmp_path / "bf16.pt"
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, path)
    fresh = Tiny()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, fresh)
    assert fresh.body.weight.dtype == torch.float32
    assert torch.equal(fresh.body.weight, model.body.weight.to(torch.bfloat16).float())
    assert report.dtype_casts == {k: ("bfloat16", "float32") for k in model.state_dict()}
    assert "5 tensor(s) were cast to the model's dtypes (5 bfloat16 -> float32)" in caplog.text


def _save_safetensors(state: dict[str, torch.Tensor], path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def test_safetensors_file_loads_as_one(tmp_path, caplog):
    pytest.importorskip("safetensors")
    model, _, _ = _trained()
    path = tmp_path / "model.safetensors"
    _save_safetensors({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, path)
    fresh = Tiny(26)  # and the vocabulary grows on the way, as from a .pt
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(path, fresh, freeze=False)
    assert torch.equal(fresh.text_embedding.weight[:20],
                       model.text_embedding.weight.to(torch.bfloat16).float())
    assert report.parts["model"].status == "remapped" and report.saved_step is None
    assert f"{path} is a safetensors file: read its 5 tensor(s)" in caplog.text
    assert "bfloat16 -> float32" in caplog.text


def test_safetensors_without_the_package_is_refused_as_safetensors(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    model, _, _ = _trained()
    path = tmp_path / "model.safetensors"
    _save_safetensors(model.state_dict(), path)
    data = path.read_bytes()
    # The one thing that cannot exist here: an environment without the package.
    for name in [n for n in sys.modules if n == "safetensors" or n.startswith("safetensors.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    fresh = Tiny()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, fresh)
    text = str(caught.value)
    assert "is a safetensors file, and the safetensors package is not installed" in text
    assert "pip install safetensors" in text and str(path) in text
    assert "interrupted half-way" not in text
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert path.read_bytes() == data


def test_truncated_safetensors_is_refused_as_a_cut_safetensors_file(tmp_path):
    pytest.importorskip("safetensors")
    model, _, _ = _trained()
    path = tmp_path / "model.safetensors"
    _save_safetensors(model.state_dict(), path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CheckpointError, match="is a safetensors file cut short: its header "
                                              "declares"):
        load_checkpoint(path, Tiny())


@pytest.mark.xtts
@pytest.mark.slow
def test_xtts_checkpoint_says_what_it_dropped(tiny_xtts, tmp_path, caplog):
    """GPTTrainer's ``xtts_checkpoint`` loads weights only: a coqui Trainer checkpoint's
    optimizer state and step are named in a WARNING, and the INFO line says dropped."""
    import patches

    source = tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "src"))
    params = [p for p in source.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    sum(p.float().pow(2).sum() for p in params).backward()
    opt.step()
    path = tmp_path / "checkpoint_2.pth"
    torch.save({"model": source.state_dict(), "optimizer": opt.state_dict(), "step": 2,
                "epoch": 0}, path)
    patches.advanced.apply()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = tiny_xtts.make_model(tiny_xtts.make_config(tmp_path / "run",
                                                           xtts_checkpoint=str(path)))
    assert torch.equal(model.xtts.gpt.text_head.weight, source.xtts.gpt.text_head.weight)
    infos = [m for m in _lines(caplog, logging.INFO) if f"loaded {path}" in m]
    assert len(infos) == 1, infos
    assert "optimizer dropped (no optimizer passed)" in infos[0]
    assert "step dropped (saved 2; a weights-only start counts from 0)" in infos[0]
    assert "(step 2, policy remap)" not in caplog.text
    warnings = [m for m in _lines(caplog, logging.WARNING) if str(path) in m]
    assert len(warnings) == 1, warnings
    assert "holds optimizer state and step 2 that this load did not restore" in warnings[0]
    assert "xtts_checkpoint loads the model weights only" in warnings[0]
    assert "continue_path" in warnings[0]
    assert "stripped the prefix 'xtts.'" in caplog.text


def test_sharded_folder_without_optimizer_state_warns_and_reports_parts(tmp_path, caplog):
    """The same report from a sharded (DCP) folder, here written by one process."""
    from patches.checkpoint import CheckpointManager
    from patches.checkpoint.sharded import save_sharded

    model, _, _ = _trained()
    folder = save_sharded(CheckpointManager(tmp_path / "run"), 4, model, None, None, None, {})
    fresh, fresh_opt, fresh_sched = _fresh()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        report = load_checkpoint(folder, fresh, fresh_opt, fresh_sched)
    assert torch.equal(fresh.body.weight, model.body.weight)
    assert report.step == 0 and report.saved_step == 4
    assert _status(report) == {"model": "restored", "optimizer": "reset", "scheduler": "reset",
                               "scaler": "absent", "step": "reset", "rng": "dropped"}
    (warning,) = _lines(caplog, logging.WARNING)
    assert "has no optimizer state" in warning and "(the folder's step: 4)" in warning
    assert "step reset (saved 4, resuming at 0: the folder has no optimizer state)" in caplog.text


def test_load_options_as_an_object_or_keywords_and_unknown_names_refused(tmp_path):
    """Issue 27: ``LoadOptions`` is public; ``options=`` and keywords give the same load (a
    keyword wins over the object); a misspelled option is a TypeError naming the closest."""
    import dataclasses

    from patches.advanced import LoadOptions

    model, opt, sched = _trained()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "step": 7}, path)
    by_object = load_checkpoint(path, _fresh()[0], options=LoadOptions(resume_step=False))
    by_keyword = load_checkpoint(path, _fresh()[0], resume_step=False)
    assert by_object.step == by_keyword.step == 0 and by_object.saved_step == 7
    wins = load_checkpoint(path, _fresh()[0], options=LoadOptions(resume_step=False),
                           resume_step=True)
    assert wins.step == 7
    with pytest.raises(TypeError) as info:
        load_checkpoint(path, _fresh()[0], resume_stpe=False)
    assert "'resume_stpe' (did you mean 'resume_step'?)" in str(info.value)
    assert dataclasses.replace(LoadOptions(), seed=3).seed == 3


@pytest.mark.parametrize("option", [dict(freeze=False), dict(resume_step=False),
                                    dict(key_filter=lambda key: True), dict(truncate=True),
                                    dict(row_init="mean"), dict(collective=False)])
def test_a_sharded_folder_refuses_what_it_cannot_honour(tmp_path, option):
    """Issue 27: a DCP folder used to drop 12 of load_checkpoint's options silently
    (``resume_step`` among them). Each is now refused, one paragraph, nothing loaded."""
    from patches.checkpoint import CheckpointManager
    from patches.checkpoint.sharded import save_sharded

    model, _, _ = _trained()
    folder = save_sharded(CheckpointManager(tmp_path / "run"), 4, model, None, None, None, {})
    fresh, fresh_opt, fresh_sched = _fresh()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError) as info:
        load_checkpoint(folder, fresh, fresh_opt, fresh_sched, **option)
    (name,) = option
    message = str(info.value)
    assert f"the option(s) {name}=" in message and "Nothing was loaded" in message
    assert "sharded checkpoint folder" in message and len(message.splitlines()) == 1
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())


def test_one_answer_to_whether_a_scaler_is_enabled():
    """Issue 27: "is the scaler enabled?" was asked in 8 places with opposite defaults for a
    scaler-like object (assumed on in decide, off in apply). One function answers."""
    from patches.checkpoint.optimizer import scaler_enabled

    class OwnScaler:  # a trainer's own scaler: a state, no enabled flag
        def state_dict(self):
            return {"scale": 8.0}

    assert scaler_enabled(torch.amp.GradScaler("cpu", enabled=True))
    assert not scaler_enabled(torch.amp.GradScaler("cpu", enabled=False))
    assert scaler_enabled(OwnScaler()) and not scaler_enabled(None)
    assert not scaler_enabled(object())


def test_an_own_scaler_is_saved_and_restored_as_a_scaler(tmp_path):
    """A scaler-like object without torch's flag (a trainer's own) is saved and restored as
    a scaler, through the same answer."""
    from patches.checkpoint import CheckpointManager

    class OwnScaler:
        def __init__(self, scale):
            self.scale = scale

        def state_dict(self):
            return {"scale": self.scale}

        def load_state_dict(self, state):
            self.scale = state["scale"]

    model, opt, sched = _trained()
    path = CheckpointManager(tmp_path / "run").save(3, model, opt, sched, OwnScaler(64.0))
    target = OwnScaler(1.0)
    fresh, fresh_opt, fresh_sched = _fresh()
    report = load_checkpoint(path, fresh, fresh_opt, fresh_sched, target)
    assert target.scale == 64.0 and report.parts["scaler"].status == "restored"
