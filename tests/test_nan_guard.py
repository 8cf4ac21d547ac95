"""nan_guard: NaN/Inf injected into the loss, gradients and activations, in every precision."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from sync_count import count_host_reads

import patches
from patches import nan_guard
from patches.advanced import NonFiniteTrainingError, SafeGradScaler

KINDS = ["loss-nan", "loss-inf", "grad-nan", "grad-inf", "act-nan", "act-inf"]


@pytest.fixture
def guard(tmp_path) -> str:
    nan_guard.reset()
    patches.advanced.apply(["nan_guard", "grad_clip", "grad_scaler"], output_dir=str(tmp_path))
    yield str(tmp_path)
    nan_guard.reset()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4))


def all_finite(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    tensors = list(model.parameters())
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def run(precision: str, steps: int = 200, share: float = 0.12, seed: int = 0):
    """Train with faults injected at random steps; return (model, opt, losses, injected)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = SafeGradScaler("cpu", growth_interval=10) if precision == "fp16" else None
    rng = random.Random(seed)
    faulty = sorted(rng.sample(range(1, steps + 1), int(steps * share)))
    kinds = {step: KINDS[i % len(KINDS)] for i, step in enumerate(faulty)}
    poison: dict[str, float] = {}

    def act_hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        if poison:
            output = output.clone()
            output[0, 0] = poison["value"]
        return output
    model[2].register_forward_hook(act_hook)

    torch.manual_seed(1)
    x = torch.randn(64, 16)
    y = torch.sin(x[:, :4] * 2)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    losses = []
    for step in range(1, steps + 1):
        kind = kinds.get(step, "")
        value = float("nan") if kind.endswith("nan") else float("inf")
        poison.clear()
        if kind.startswith("act"):
            poison["value"] = value
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if kind.startswith("loss"):
            loss = loss * value
        if not kind:
            losses.append(loss.item())
        nan_guard.observe_loss(loss)
        (scaler.scale(loss) if scaler else loss).backward()
        if kind.startswith("grad"):
            model[2].weight.grad[1, 1] = value
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return model, opt, losses, kinds, scaler


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fault_injection_skips_exactly_the_injected_steps(guard: str, precision: str) -> None:
    model, opt, losses, injected, scaler = run(precision)
    assert len(injected) >= 20
    guard_stats = patches.stats()["nan_guard"]
    skipped = guard_stats["skipped"] + (scaler.stats()["skipped"] if scaler else 0)
    assert skipped == len(injected)
    if scaler is None:
        assert guard_stats["steps"] == 200
        # a poisoned activation makes the loss non-finite too; a poisoned gradient does not
        assert guard_stats["nonfinite_losses"] == sum(not k.startswith("grad")
                                                      for k in injected.values())
    else:
        assert guard_stats["skipped"] == 0  # the scaler protected every step itself
    assert all_finite(model, opt)
    assert sum(losses[-10:]) < sum(losses[:10])
    if scaler is None:
        with open(os.path.join(guard, "nonfinite_events.jsonl")) as handle:
            events = [json.loads(line) for line in handle]
        assert [e["step"] for e in events] == sorted(injected)


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, foreach=False),
    lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=0.1),
], ids=["adamw", "adamw-fused", "adam-loop", "sgd-momentum"])
def test_a_skipped_step_changes_nothing(guard: str, make_opt) -> None:
    model = make_model()
    opt = make_opt(model.parameters())
    x = torch.randn(8, 16)
    for _ in range(3):  # build optimizer state first
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    before = _snapshot(model, opt)
    opt.zero_grad()
    (model(x).pow(2).mean() * float("nan")).backward()
    opt.step()
    after = _snapshot(model, opt)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert patches.stats()["nan_guard"]["skipped"] == 1


def test_scheduler_follows_the_trainers_count_by_default(guard: str) -> None:
    """The default rule: a skipped step is still a step of the trainer, so the scheduler's
    count equals the loop's own step counter (a resume finds the LR its schedule expects)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.randn(2, 16)).sum()
        (loss * float("nan") if step == 1 else loss).backward()
        opt.step()
        sched.step()
    assert nan_guard.stats()["skipped"] == 1
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == 0.5 ** 4


def test_scheduler_holds_on_a_skipped_step_when_asked(guard: str) -> None:
    patches.advanced.apply(["nan_guard"], lr_step_on_skip=False)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.randn(2, 16)).sum()
        (loss * float("nan") if step == 1 else loss).backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.5, 0.25, 0.125]


def test_a_scheduler_the_guard_has_no_decision_for_steps_as_torch_does(guard: str) -> None:
    """An optimizer whose ``optimizer`` attribute is no optimizer (here its settings, a dict,
    which cannot be weakly referenced), and a scheduler whose optimizer is gone: the patched
    ``LRScheduler.step`` raises no error of its own (torch's own, where torch raises)."""
    class Configured(torch.optim.SGD):
        def __init__(self, params, **settings) -> None:
            super().__init__(params, **settings)
            self.optimizer = dict(settings)

    model = make_model()
    opt = Configured(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        sched.step()
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.25
    del sched.optimizer
    with pytest.raises(AttributeError, match="optimizer"):
        sched.step()


def test_escalation_error_names_first_bad_step_and_samples(guard: str) -> None:
    patches.advanced.apply(["nan_guard"], max_bad_steps=5, output_dir=guard)
    from patches import _run
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteTrainingError) as raised:
        for step in range(1, 50):
            _run.current().batch_ids = [f"clip_{step}.wav"]
            opt.zero_grad()
            loss = model(torch.randn(4, 16)).pow(2).mean()
            if step >= 3:
                loss = loss * float("nan")
            nan_guard.observe_loss(loss)
            loss.backward()
            opt.step()
    message = str(raised.value)
    assert "5 consecutive" in message and "at step 7" in message
    assert "first bad step of this streak was step 3" in message
    assert "clip_3.wav" in message and "learning rate" in message
    assert "last finite loss was" in message and "None" not in message.split("last finite")[1][:20]
    with open(os.path.join(guard, "nonfinite_events.jsonl")) as handle:
        events = [json.loads(line) for line in handle]
    assert [e["step"] for e in events] == [3, 4, 5, 6, 7]
    assert events[0]["kind"] == "nonfinite_loss" and events[0]["samples"] == ["clip_3.wav"]


def test_find_nonfinite_source_names_module_and_operation() -> None:
    class Bad(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x - 10)  # negative input: NaN

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Bad(), torch.nn.Linear(4, 1))
    x = torch.rand(3, 4)
    rng = torch.get_rng_state()
    found = nan_guard.find_nonfinite_source(model, lambda: model(x).sum())
    assert found["module"] == "1" and found["type"] == "Bad" and found["where"] == "output"
    assert "Backward" in found.get("operation", "")
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_replaying_is_true_only_while_a_batch_is_replayed() -> None:
    """What an integration asks before starting a collective (coqui's DDP train step):
    public, so it never reads the guard's private state."""
    model = torch.nn.Linear(4, 1)
    seen: list[bool] = []

    def rerun() -> torch.Tensor:
        seen.append(nan_guard.replaying())
        return model(torch.ones(2, 4)).sum()
    assert not nan_guard.replaying()
    nan_guard.find_nonfinite_source(model, rerun)
    assert seen == [True] and not nan_guard.replaying()


def test_a_replay_that_finds_nothing_says_why_in_the_event(guard: str) -> None:
    """The bad value came from outside the batch's forward/backward (here: the loss is
    multiplied by NaN only on the real step), so the replay names no module: the event's
    ``source`` says so and why, instead of an unexplained ``{}``."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    nan_guard.set_replay(lambda: nan_guard.find_nonfinite_source(
        model, lambda: model(x).pow(2).mean()))
    for step in range(1, 4):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if step == 2:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
    with open(os.path.join(guard, "nonfinite_events.jsonl")) as handle:
        events = [json.loads(line) for line in handle]
    assert len(events) == 1
    source = events[0]["source"]
    assert source["found"] is False and "module" not in source
    assert "did not recur" in source["reason"]
    # a replay that does find the culprit says so
    found = nan_guard.find_nonfinite_source(model, lambda: model(x).pow(2).mean() * float("nan"))
    assert found["found"] is True and found["module"] == "loss"


def test_loss_spike_guard_skips_and_counts_separately() -> None:
    nan_guard.reset()
    patches.advanced.apply(["nan_guard"], spike_k=6, spike_window=20)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 16)
    for step in range(1, 41):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if step == 30:
            loss = loss * 1000  # finite, but far outside the window
        nan_guard.observe_loss(loss)
        loss.backward()
        opt.step()
    stats = patches.stats()["nan_guard"]
    assert stats["spikes"] == 1 and stats["skipped"] == 1 and stats["nonfinite_losses"] == 0
    nan_guard.reset()


@pytest.mark.parametrize("fused,expected", [(False, 1), (True, 0)], ids=["one-sync", "fused"])
def test_host_syncs_per_step(guard: str, monkeypatch: pytest.MonkeyPatch, fused: bool,
                             expected: int) -> None:
    """Host reads added by the guard per step, over the optimizer's own (Adam reads its
    step counts with .item() when not capturable)."""
    def count(guarded: bool) -> int:
        if guarded:
            patches.advanced.apply(["nan_guard"])
        else:
            patches.revert(["nan_guard"])
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
        x = torch.randn(8, 16)
        with monkeypatch.context() as m:
            counter = count_host_reads(m)
            for _ in range(10):
                opt.zero_grad()
                loss = model(x).pow(2).mean()
                nan_guard.observe_loss(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
        return counter[0]

    assert count(guarded=True) - count(guarded=False) == expected * 10


@pytest.mark.parametrize("make_opt", [
    lambda params: torch.optim.SGD(params, lr=0.05),
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=3),
], ids=["sgd", "adamw", "lbfgs"])
def test_step_closure_is_judged_on_the_gradients_it_makes(guard: str, make_opt) -> None:
    """``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the closure
    runs forward and backward inside the step. The guard runs it first and decides on its
    gradients: the NaN of step 3 is skipped, no parameter is touched by it, and the other
    steps train (judged before the closure, step 3 would go through on step 2's gradients)."""
    model = make_model()
    opt = make_opt(model.parameters())
    x = torch.randn(8, 16)
    calls = []
    for step in range(1, 7):
        def closure(step: int = step) -> torch.Tensor:
            calls.append(step)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if step == 3:
                loss = loss * float("nan")
            loss.backward()
            return loss
        before = _snapshot(model, opt)
        opt.step(closure)
        if step == 3:
            assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    stats = patches.stats()["nan_guard"]
    assert stats["skipped"] == 1 and stats["steps"] == 6
    assert calls.count(3) == 1  # the bad closure ran once: the skipped step evaluates nothing more
    assert sorted(set(calls)) == [1, 2, 3, 4, 5, 6]
    if not isinstance(opt, torch.optim.LBFGS):
        assert calls == [1, 2, 3, 4, 5, 6]  # run once per step, as without the guard
