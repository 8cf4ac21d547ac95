"""SafeGradScaler on the CPU with fp16 autocast and overflows injected at known steps."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from sync_count import count_host_reads

from patches.advanced import LossScaleFloorError, SafeGradScaler, get_original

TorchGradScaler = torch.amp.grad_scaler.GradScaler  # the class torch defines, never patched


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def train(model: torch.nn.Module, scaler: TorchGradScaler, steps: int, inject: set[int],
          clip: float | None = None) -> tuple[list[float], list[float]]:
    """Steps 1..steps; at the steps in ``inject`` the loss is multiplied by inf."""
    torch.manual_seed(1)
    data = torch.randn(steps, 32, 8)
    target = torch.randn(steps, 32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales, losses = [], []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(data[step - 1])
        loss = torch.nn.functional.mse_loss(out.float(), target[step - 1])
        losses.append(loss.item())
        if step in inject:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, losses


def all_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_is_a_torch_grad_scaler_with_safe_defaults() -> None:
    scaler = SafeGradScaler("cpu")
    assert isinstance(scaler, TorchGradScaler)
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_interval() == 100


def test_skips_exactly_the_injected_steps_and_matches_torch_trajectory() -> None:
    inject = {3, 10, 11, 30, 47}
    safe_model, torch_model = make_model(), make_model()
    safe = SafeGradScaler("cpu", init_scale=1024, growth_interval=5)
    plain = TorchGradScaler("cpu", init_scale=1024, growth_interval=5)
    safe_scales, safe_losses = train(safe_model, safe, 60, inject)
    torch_scales, torch_losses = train(torch_model, plain, 60, inject)

    stats = safe.stats()
    assert stats["skipped"] == len(inject)
    assert stats["steps"] == 60
    assert safe_scales == torch_scales
    assert all_finite(safe_model)
    for a, b in zip(safe_model.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)
    assert safe_losses[-1] < safe_losses[0]


def test_scale_changes_are_logged_and_stats_line_every_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="training_patches")
    scaler = SafeGradScaler("cpu", init_scale=1024, growth_interval=100, log_interval=10)
    train(make_model(), scaler, 20, {3})
    text = caplog.text
    assert "scale 1024 -> 512 at step 3 (overflow, step skipped)" in text
    assert text.count("SafeGradScaler stats @ step") == 2
    assert "skipped 1 of 20 steps (5.00%)" in text


def test_warns_below_one_and_raises_at_floor_naming_the_step(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="training_patches")
    model = make_model()
    # 1024 = 2**10 halves to the floor 2**-14 in 24 overflows; the 10th skip at the floor
    # (the first one is step 25) must stop the run: step 34.
    scaler = SafeGradScaler("cpu", init_scale=1024, min_scale=2.0 ** -14, max_floor_skips=10)
    with pytest.raises(LossScaleFloorError) as raised:
        train(model, scaler, 100, set(range(1, 101)))
    message = str(raised.value)
    assert "at step 34" in message
    assert "learning rate" in message and "fp32" in message
    assert scaler.stats()["skipped"] == 34
    assert scaler.get_scale() == 2.0 ** -14
    assert all_finite(model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("fell below 1.0" in r.getMessage() for r in warnings) == 1


def test_hysteresis_backs_off_only_after_consecutive_overflows() -> None:
    scaler = SafeGradScaler("cpu", init_scale=1024, growth_interval=1000, hysteresis=2)
    scales, _ = train(make_model(), scaler, 12, {2, 5, 6, 9, 10, 11})
    # 2: first overflow, held; 5-6: two in a row -> 512; 9-10 -> 256; 11 (third) -> 128.
    assert scales[1] == 1024.0
    assert scales[4] == 1024.0 and scales[5] == 512.0
    assert scales[8] == 512.0 and scales[9] == 256.0 and scales[10] == 128.0
    assert scaler.stats()["skipped"] == 6


def test_state_dict_loads_both_ways_with_a_plain_grad_scaler() -> None:
    safe = SafeGradScaler("cpu", init_scale=1024, growth_interval=5)
    train(make_model(), safe, 12, {4})
    state = safe.state_dict()
    assert state["training_patches"]["skipped"] == 1

    plain = TorchGradScaler("cpu")
    plain.load_state_dict(state)
    assert plain.get_scale() == safe.get_scale()
    assert plain.get_growth_interval() == 5

    again = SafeGradScaler("cpu")
    again.load_state_dict(state)
    assert again.get_scale() == safe.get_scale()
    assert again.stats()["skipped"] == 1 and again.stats()["steps"] == 12

    from_plain = SafeGradScaler("cpu")
    from_plain.load_state_dict(plain.state_dict())
    assert from_plain.get_scale() == safe.get_scale()
    assert from_plain.stats()["skipped"] == 0


def test_adds_no_host_sync_beyond_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def steps(scaler: TorchGradScaler) -> int:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        with monkeypatch.context() as m:
            counter = count_host_reads(m)
            for step in range(20):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                if step == 7:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        return counter[0]

    plain = steps(TorchGradScaler("cpu", init_scale=1024, growth_interval=5))
    safe = steps(SafeGradScaler("cpu", init_scale=1024, growth_interval=5, log_interval=10**6))
    assert plain == 20  # torch's one sync per step, in _maybe_opt_step
    # None added on a normal step; an overflow step reads its loss once, for its line in
    # loss_scale.jsonl (was it a NaN batch or only an overflow?): 1 overflow here.
    assert safe == plain + 1


def test_patched_factory_defaults_and_explicit_arguments() -> None:
    import patches

    patches.advanced.apply(["grad_scaler"], init_scale=256, growth_interval=50)
    built = torch.amp.GradScaler("cpu")
    assert isinstance(built, SafeGradScaler)
    assert built.get_scale() == 256.0 and built.get_growth_interval() == 50
    explicit = torch.GradScaler("cpu", init_scale=8.0)
    assert explicit.get_scale() == 8.0
    assert get_original("torch", "GradScaler") is TorchGradScaler


def test_pickle_round_trip_keeps_counters() -> None:
    import pickle

    scaler = SafeGradScaler("cpu", init_scale=64, growth_interval=5)
    train(make_model(), scaler, 6, {2})
    copy_ = pickle.loads(pickle.dumps(scaler))
    assert copy_.get_scale() == scaler.get_scale()
    assert copy.copy(copy_.stats()) == scaler.stats()


@pytest.mark.skipif(not torch.cuda.amp.common.amp_definitely_not_available(),
                    reason="torch warns only where CUDA is not available")
def test_cuda_warning_points_at_the_users_line_and_the_type_reads_as_built() -> None:
    import inspect
    import warnings

    import patches

    patches.advanced.apply(["grad_scaler"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # the next line builds the scaler
        scaler = torch.cuda.amp.GradScaler()
    cuda = [w for w in caught if "CUDA is not available" in str(w.message)]
    assert len(cuda) == 1
    assert (cuda[0].filename, cuda[0].lineno) == (__file__, line)
    assert isinstance(scaler, SafeGradScaler)
    assert repr(type(scaler)) == \
        "<class 'patches.grad_scaler.SafeGradScaler(torch.cuda.amp.GradScaler)'>"
    assert repr(scaler) == \
        "SafeGradScaler(torch.cuda.amp.GradScaler, device='cuda', enabled=False)"
    assert repr(SafeGradScaler("cpu")).startswith("SafeGradScaler(torch.amp.GradScaler, ")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.amp.common.amp_definitely_not_available(),
                    reason="torch warns only where CUDA is not available")
def test_cuda_warning_from_a_program_given_as_text() -> None:
    """``python -c`` (and stdin, the REPL): the user's frame has no source file, its loader
    raises on a request for source; the scaler is built and the warning names ``<string>``."""
    import os
    import subprocess
    import sys

    program = ("import patches; patches.advanced.apply(['grad_scaler']); import torch\n"
               "print(type(torch.amp.GradScaler('cuda')).__name__)")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["SafeGradScaler"]
    assert "<string>:2: UserWarning" in result.stderr and "CUDA is not available" in result.stderr
