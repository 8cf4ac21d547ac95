"""The NaN guard with a fused optimizer: the skip flag goes to the kernel as ``found_inf``,
the host reads nothing per step, and a skipped step is still an exact no-op.

Fused AdamW runs on the CPU in torch 2.14, so all of this runs here. Host reads are counted
with tests/sync_count.py (on a GPU each one is a device sync; benchmarks/gpu counts those).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from sync_count import count_host_reads

import patches
from patches import _run, nan_guard
from patches.advanced import NonFiniteTrainingError


@pytest.fixture
def guard(tmp_path) -> str:
    nan_guard.reset()
    patches.advanced.apply(["nan_guard", "grad_clip"], output_dir=str(tmp_path), quiet=True)
    yield str(tmp_path)
    nan_guard.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=generator) for _ in range(steps)]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], *,
           nan_at: set[int] = frozenset(), sched: object = None,
           counter: list[int] | None = None) -> list[int]:
    """A plain loop (clip, scheduler); returns the host reads made during each step."""
    per_step = []
    for step, x in enumerate(batches, start=1):
        before = counter[0] if counter is not None else 0
        _run.current().batch_ids = [f"clip_{step}.wav"]
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if step in nan_at:
            loss = loss * float("nan")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        per_step.append((counter[0] - before) if counter is not None else 0)
    return per_step


def _state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        state = opt.state[p]
        out += [state[k].clone() for k in ("step", "exp_avg", "exp_avg_sq")]
    return out


def test_fused_adamw_guard_reads_nothing_per_step(guard: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """50 steps with a scheduler and a clip: no host read in any step except one copy of
    the waiting flags every max_bad_steps (25) steps, for the consecutive-skips stop."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    batches = _batches(51)
    _train(model, opt, batches[:1], sched=sched)  # first-use work outside the count
    with monkeypatch.context() as m:
        counter = count_host_reads(m)
        per_step = _train(model, opt, batches[1:], sched=sched, counter=counter)
    reads = {step: n for step, n in enumerate(per_step, start=2) if n}
    assert reads == {25: 1, 50: 1}  # steps 2..51: one copy at guard steps 25 and 50
    assert nan_guard.stats() == {"steps": 51, "skipped": 0, "nonfinite_losses": 0,
                                 "nonfinite_grads": 0, "spikes": 0,
                                 "skipped_micro_batches": 0, "peer_skips": 0,
                                 "consecutive_skips": 0}


def test_fused_guard_reads_nothing_between_logs_when_the_stop_allows(
        guard: str, monkeypatch: pytest.MonkeyPatch) -> None:
    patches.advanced.apply(["nan_guard", "grad_clip"], max_bad_steps=1000, log_interval=1000,
                           output_dir=guard, quiet=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with monkeypatch.context() as m:
        counter = count_host_reads(m)
        per_step = _train(model, opt, _batches(40), counter=counter)
    assert sum(per_step) == 0


def test_control_the_unfused_optimizer_costs_one_read_per_step(
        guard: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same loop with AdamW(fused=False): the guard reads its flag every step."""
    def reads(guarded: bool) -> list[int]:
        if not guarded:
            patches.revert(["nan_guard", "grad_clip"])
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
        batches = _batches(11)
        _train(model, opt, batches[:1])
        with monkeypatch.context() as m:
            return _train(model, opt, batches[1:], counter=count_host_reads(m))

    guarded, unguarded = reads(True), reads(False)
    assert [g - u for g, u in zip(guarded, unguarded)] == [1] * 10


def test_fused_nan_step_is_skipped_exactly(guard: str) -> None:
    """Parameters, moments and step counts after a run with a NaN at step 5 are bit for bit
    those of the same run without step 5; the counters and the event say what happened."""
    batches = _batches(9)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    _train(model, opt, batches, nan_at={5})

    nan_guard.reset()
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    _train(reference, ref_opt, batches[:4] + batches[5:])

    got, want = _state_tensors(model, opt), _state_tensors(reference, ref_opt)
    assert len(got) == len(want) == 3 * 4 + 4
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert float(opt.state[next(iter(model.parameters()))]["step"]) == 8.0

    # The first run's counters, read lazily: reset() above started a new run, so re-run.
    nan_guard.reset()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt, batches, nan_at={5})
    stats = nan_guard.stats()
    assert (stats["steps"], stats["skipped"], stats["nonfinite_losses"]) == (9, 1, 1)
    with open(os.path.join(guard, nan_guard.EVENTS_FILE)) as handle:
        events = [json.loads(line) for line in handle]
    assert [(e["step"], e["samples"], e["read_at_step"]) for e in events] == \
        [(5, ["clip_5.wav"], 9)]  # the batch of step 5, though its flag was read at step 9


def test_fused_consecutive_skips_still_stop_the_run(guard: str) -> None:
    """max_bad_steps=5, NaN from step 3 on: the fifth skip in a row is step 7, seen when the
    flags are read at step 10; the weights are those of step 2."""
    patches.advanced.apply(["nan_guard", "grad_clip"], max_bad_steps=5, output_dir=guard,
                           quiet=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    batches = _batches(40)
    _train(model, opt, batches[:2])
    after_two = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteTrainingError) as raised:
        _train(model, opt, batches[2:], nan_at=set(range(1, 39)))
    message = str(raised.value)
    assert "5 consecutive" in message and "stops at step 7" in message
    assert "seen at optimizer step 10" in message
    assert "first bad step of this streak was step 3" in message
    assert "last finite loss was" in message and "last finite loss was None" not in message
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after_two))


def test_fused_scheduler_hold_reads_the_flag(guard: str) -> None:
    """lr_step_on_skip=0 needs the flag on the host: the scheduler still holds exactly."""
    patches.advanced.apply(["nan_guard"], lr_step_on_skip=False, output_dir=guard, quiet=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for step, x in enumerate(_batches(4)):
        opt.zero_grad()
        loss = model(x).sum()
        (loss * float("nan") if step == 1 else loss).backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.5, 0.25, 0.125]


@pytest.mark.slow
def test_fused_skip_near_the_end_is_recorded_at_exit(tmp_path) -> None:
    """A fused step's flag is read in batches (no host read per step): a skip in the last
    steps of a run, below the settle interval, is read and recorded when the process exits,
    with nothing in the script asking for it."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import patches.auto
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step in range(1, 7):
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            (loss * float("nan") if step == 5 else loss).backward()
            opt.step()
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    """))
    env = {**os.environ, "TRAINING_PATCHES_OUTPUT_DIR": str(tmp_path / "out"),
           "TRAINING_PATCHES_QUIET": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in
              (tmp_path / "out" / nan_guard.EVENTS_FILE).read_text().splitlines()]
    assert [(e["step"], e["kind"]) for e in events] == [(5, "nonfinite_loss")], events
