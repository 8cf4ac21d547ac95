"""Issue 27: checkpoint state as parts with one load path. A single file and a sharded (DCP)
folder are two sources of the same parts (optimizer, scheduler, scaler, step, RNG, runtime
counters): one plan, one apply, one report (``patches/checkpoint/parts.py``). The same
training state saved both ways and loaded under every policy and every set of objects gives
the same objects and the same report, part for part. Real tiny torch models, real files, a
real one-process DCP save; nothing mocked."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from tiny_models import TinyTextModel

from patches.checkpoint import CheckpointManager, CheckpointMismatchError, load_checkpoint
from patches.checkpoint.sharded import save_sharded

LOGGER = "training_patches"
VOCAB = 20


def _objects(seed: int = 0, optimizer: type = torch.optim.AdamW):
    torch.manual_seed(seed)
    model = TinyTextModel(VOCAB, 8, "tanh")
    opt = optimizer(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    return model, opt, sched, scaler


def _train(model, opt, sched, steps: int = 3) -> None:
    for _ in range(steps):
        model(torch.arange(VOCAB)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"full" | "weights": (file, folder)} of one trained state: with the optimizer,
    scheduler and scaler, and with the weights and step only."""
    out = {}
    for kind in ("full", "weights"):
        model, opt, sched, scaler = _objects()
        _train(model, opt, sched)
        scaler.scale(torch.ones(()))  # the scale exists (lazily made) ...
        scaler.update(256.0)  # ... and differs from a fresh scaler's
        root = tmp_path_factory.mktemp(kind)
        args = (opt, sched, scaler) if kind == "full" else (None, None, None)
        torch.manual_seed(123)  # the RNG each save captures: the same in both
        file = CheckpointManager(root / "file").save(5, model, *args, epoch=1)
        torch.manual_seed(123)
        folder = save_sharded(CheckpointManager(root / "folder"), 5, model, *args, {"epoch": 1})
        out[kind] = (file, folder)
    return out


def _load(path, given: str, **options):
    model, opt, sched, scaler = _objects(seed=1)
    objects = dict(optimizer=opt if "o" in given else None,
                   scheduler=sched if "s" in given else None,
                   scaler=scaler if "g" in given else None)
    report = load_checkpoint(path, model, **objects, **options)
    after = torch.rand(3)  # what the RNG gives after the load
    return report, (model, opt, sched, scaler, after)


CASES = list(itertools.product(("full", "weights"), ("remap", "reset"), ("osg", "o", ""),
                               (None, False)))


@pytest.mark.parametrize("kind,policy,given,restore_rng", CASES)
def test_a_file_and_a_folder_load_the_same_parts_the_same_way(saved, kind, policy, given,
                                                              restore_rng, caplog):
    """The same state saved as a file and as a folder, loaded the same way: the same report
    for every part but the model (whose source differs: planned rows or DCP shards), the
    same step, epoch and extra, the same objects after, the same fallback warning."""
    file, folder = saved[kind]
    results, warnings = [], []
    for path in (file, folder):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            results.append(_load(path, given, policy=policy, restore_rng=restore_rng))
        warnings.append([r.getMessage().replace(str(path), "<path>")
                         .replace("the file's", "its").replace("the folder's", "its")
                         for r in caplog.records if r.name == LOGGER])
    (by_file, (m1, o1, s1, g1, r1)), (by_folder, (m2, o2, s2, g2, r2)) = results
    parts = {name: (p.status, p.detail.replace("file", "source").replace("folder", "source"),
                    p.in_file) for name, p in by_file.parts.items() if name != "model"}
    assert parts == {name: (p.status, p.detail.replace("folder", "source")
                            .replace("file", "source"), p.in_file)
                     for name, p in by_folder.parts.items() if name != "model"}
    assert (by_file.step, by_file.saved_step, by_file.epoch, by_file.extra, by_file.policy) == (
        by_folder.step, by_folder.saved_step, by_folder.epoch, by_folder.extra, by_folder.policy)
    assert by_file.runtime_state_restored == by_folder.runtime_state_restored
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(),
                                                 m2.state_dict().values()))
    assert o1.state_dict()["state"].keys() == o2.state_dict()["state"].keys()
    for key, state in o1.state_dict()["state"].items():
        assert all(torch.equal(v, o2.state_dict()["state"][key][n]) for n, v in state.items())
    assert s1.state_dict() == s2.state_dict() and g1.state_dict() == g2.state_dict()
    assert torch.equal(r1, r2)
    assert warnings[0] == warnings[1]
    # and what each part says is what was done: a sanity check of the report itself
    restored = {name for name, p in by_file.parts.items() if p.status == "restored"}
    if kind == "full" and policy == "remap" and "o" in given:
        assert {"optimizer", "step"} <= restored and by_file.step == 5
        assert ("scheduler" in restored) == ("s" in given) and s1.last_epoch == (
            3 if "s" in given else 0)
    else:
        assert "optimizer" not in restored


def test_a_folder_refuses_an_optimizer_state_of_another_class(tmp_path):
    """The classes a file records beside the optimizer and scheduler states are now in a
    folder's meta.pt too (saved through the same parts): an SGD folder state into AdamW is
    refused before anything changes (DCP would load it and AdamW would step with SGD's
    moments), as it is from a file."""
    model, opt, sched, scaler = _objects(optimizer=torch.optim.SGD)
    opt.param_groups[0]["momentum"] = 0.9
    _train(model, opt, sched)
    folder = save_sharded(CheckpointManager(tmp_path / "run"), 3, model, opt, sched, None, {})
    fresh, fresh_opt, fresh_sched, _ = _objects(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(folder, fresh, fresh_opt, fresh_sched)
    assert "torch.optim.sgd.SGD" in str(info.value) and "Nothing was loaded" in str(info.value)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
    assert not fresh_opt.state


@pytest.mark.parametrize("source", [0, 1], ids=["file", "folder"])
def test_each_part_is_one_unit_that_plans_applies_and_reports_its_state(saved, source,
                                                                        monkeypatch):
    """``parts.UNITS``: each piece of state beside the model is one unit. Taken out of the
    list, its state is neither loaded nor reported, from a file or a folder, and every other
    part still is: the scheduler unit alone owns the scheduler."""
    from patches.checkpoint import parts

    assert [p.name for p in parts.UNITS] == ["model", "optimizer", "scheduler", "scaler", "step",
                                             "rng", "runtime", "data", "ema"]
    path = saved["full"][source]
    report, (_, opt, sched, scaler, _) = _load(path, "osg")
    assert sched.last_epoch == 3 and report.parts["scheduler"].status == "restored"
    monkeypatch.setattr(parts, "UNITS", tuple(p for p in parts.UNITS if p.name != "scheduler"))
    report, (_, opt, sched, scaler, _) = _load(path, "osg")
    assert sched.last_epoch == 0 and "scheduler" not in report.parts  # as built, not said
    assert report.parts["optimizer"].status == "restored" and opt.state
    assert report.parts["scaler"].status == "restored" and scaler.get_scale() == 256.0
    assert report.parts["step"].status == "restored" and report.step == 5


@pytest.mark.parametrize("source", [0, 1], ids=["file", "folder"])
def test_the_model_is_one_unit_planned_first_and_applied_last(saved, source, monkeypatch):
    """The model is a unit of ``parts.UNITS`` too, for both sources (a file's planned rows, a
    folder's DCP shards): planned before every other part (the optimizer's moments grow as
    its rows) and applied after them (only its own refusal can leave anything changed), one
    walk for both. Its report comes from the unit: with ``ModelPart.report`` silenced, neither
    source's report has a model part, and the model is still loaded."""
    from patches.checkpoint import parts

    order: list[tuple[str, str]] = []
    for unit in parts.UNITS:
        for phase in ("plan", "apply"):
            def walk(*args, _phase=phase, _unit=unit, _real=getattr(unit, phase)):
                order.append((_phase, _unit.name))
                return _real(*args)
            monkeypatch.setattr(unit, phase, walk)
    report, (model, opt, *_rest) = _load(saved["full"][source], "osg")
    planned = [name for phase, name in order if phase == "plan"]
    applied = [name for phase, name in order if phase == "apply"]
    assert planned == [u.name for u in parts.UNITS] and planned[0] == "model"
    assert applied == planned[1:] + ["model"]
    assert report.parts["model"].status == "restored" and report.loaded == ["model"]
    model_unit = next(u for u in parts.UNITS if u.name == "model")
    monkeypatch.setattr(model_unit, "report", lambda *args: None)
    report, (model, *_rest) = _load(saved["full"][source], "osg")
    assert "model" not in report.parts and report.parts["optimizer"].status == "restored"
    saved_weights = torch.load(saved["full"][0], weights_only=True)["model"]
    assert all(torch.equal(v, saved_weights[k]) for k, v in model.state_dict().items())


def test_a_folder_whose_shards_cannot_be_read_puts_the_other_parts_back(saved, monkeypatch):
    """The model is applied last from a folder too: when DCP's load fails, the parts already
    applied (scheduler, scaler, RNG) are put back before the one error."""
    import torch.distributed.checkpoint as dcp

    def broken(*args, **kwargs):
        raise RuntimeError("a shard cannot be read")

    monkeypatch.setattr(dcp, "load", broken)
    model, opt, sched, scaler = _objects(seed=1)
    before = (sched.state_dict(), scaler.state_dict(), torch.get_rng_state())
    with pytest.raises(Exception, match="shard cannot be read") as info:
        load_checkpoint(saved["full"][1], model, opt, sched, scaler)
    assert "model's weights may be partly changed" in str(info.value)
    assert sched.state_dict() == before[0] and scaler.state_dict() == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])
