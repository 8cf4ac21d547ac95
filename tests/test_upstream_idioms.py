"""The GradScaler idioms of PyTorch's own tests (``test_grad_scaling_*`` in test_torch.py)
and of coqui-tts-trainer 0.4, each run with the default patch set applied.

Every test compares the patched run with what torch does: an fp32 loop without a scaler
(the "control" of PyTorch's ``_run_scaling_case``), or the same loop with torch's own
GradScaler and ``clip_grad_norm_``. docs/compatibility.md says how the upstream suites
themselves were run.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Iterator

import pytest
import torch

import patches
from patches.advanced import SafeGradScaler

TorchGradScaler = torch.amp.grad_scaler.GradScaler  # the class torch defines, never patched
INIT_SCALE = 128.0
SKIP_ITER = 2  # the iteration whose gradients get an inf, as in PyTorch's tests


@pytest.fixture
def patched(tmp_path: Any) -> Iterator[None]:
    """The default set, as a user's import line applies it (reports go to tmp_path)."""
    patches.advanced.reset_runtime_state()
    patches.advanced.apply(output_dir=str(tmp_path))
    yield


def models(count: int = 1) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(control, scaled) pairs of identical two-layer models."""
    torch.manual_seed(0)
    pairs = []
    for _ in range(count):
        control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        pairs.append((control, copy.deepcopy(control)))
    return pairs


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]


def scaler(enabled: bool = True) -> torch.amp.GradScaler:
    """What a trainer gets from ``torch.GradScaler(...)`` with the patches on."""
    built = torch.GradScaler("cpu", init_scale=INIT_SCALE, growth_factor=2.0,
                             growth_interval=1, enabled=enabled)
    assert isinstance(built, SafeGradScaler)
    return built


def assert_same(control: torch.nn.Module, scaled: torch.nn.Module, atol: float = 1e-7) -> None:
    for c, s in zip(control.parameters(), scaled.parameters()):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=atol)
        torch.testing.assert_close(s.grad, c.grad, rtol=1e-5, atol=atol)


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def fp32_control(model: torch.nn.Module, clip: float | None = None) -> None:
    """The reference loop: fp32, no scaler, the skipped iteration simply not stepped."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for i, batch in enumerate(batches()):
        opt.zero_grad()
        mse(model, batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if i != SKIP_ITER:
            opt.step()


def test_clip_with_scaled_max_norm_on_scaled_gradients(patched: None) -> None:
    """test_grad_scaling_clipping: clip_grad_norm_(params, max_norm * scaler.get_scale())."""
    ((control, model),) = models()
    fp32_control(control, clip=0.2)
    amp, opt = scaler(), torch.optim.SGD(model.parameters(), lr=1.0)
    for i, batch in enumerate(batches()):
        opt.zero_grad()
        amp.scale(mse(model, batch)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * amp.get_scale())
        if i == SKIP_ITER:
            model[1].weight.grad.fill_(float("inf"))
        amp.step(opt)
        amp.update()
    assert amp.get_scale() == INIT_SCALE * 2 ** 3 * 0.5  # 3 clean steps, 1 skipped
    assert_same(control, model, atol=1e-5)


def test_unscale_then_clip_with_an_inf_before_unscale(patched: None) -> None:
    """test_grad_scaling_clipping_separate_unscale: unscale_, then clip the true gradients."""
    ((control, model),) = models()
    fp32_control(control, clip=0.2)
    amp, opt = scaler(), torch.optim.SGD(model.parameters(), lr=1.0)
    for i, batch in enumerate(batches()):
        opt.zero_grad()
        amp.scale(mse(model, batch)).backward()
        if i == SKIP_ITER:
            model[1].weight.grad.fill_(float("inf"))
        amp.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2, error_if_nonfinite=False)
        amp.step(opt)
        amp.update()
    assert amp.get_scale() == INIT_SCALE * 2 ** 3 * 0.5
    assert_same(control, model)
    assert patches.stats()["grad_clip"]["nonfinite_norms"] == 1


def test_two_optimizers_one_scaler_one_unscaled_early(patched: None) -> None:
    """test_grad_scaling_multiple: two models, two losses, two optimizers, one scaler."""
    (control0, model0), (control1, model1) = models(2)

    def run(m0: torch.nn.Module, m1: torch.nn.Module, amp: torch.amp.GradScaler | None) -> None:
        opt0 = torch.optim.SGD(m0.parameters(), lr=1.0)
        opt1 = torch.optim.SGD(m1.parameters(), lr=1.0)
        for i, (x, y) in enumerate(batches()):
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = m0(x), m1(x)
            loss0 = torch.nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y)
            loss1 = torch.nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y)
            if amp is None:
                loss0.backward(retain_graph=True)
                loss1.backward()
                opt0.step()
                if i != SKIP_ITER:
                    opt1.step()
                continue
            amp.scale(loss0).backward(retain_graph=True)
            amp.scale(loss1).backward()
            if i == SKIP_ITER:
                m1[1].weight.grad.fill_(float("inf"))
            amp.unscale_(opt0)
            amp.step(opt0)
            amp.step(opt1)
            amp.update()

    run(control0, control1, None)
    amp = scaler()
    run(model0, model1, amp)
    assert amp.get_scale() == INIT_SCALE * 2 ** 3 * 0.5
    for control, model in ((control0, model0), (control1, model1)):
        for c, s in zip(control.parameters(), model.parameters()):
            torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_across_iterations_with_one_scaler(patched: None) -> None:
    """test_grad_scaling_accumulation: two scaled backwards per optimizer step."""
    ((control, model),) = models()
    amp = scaler()
    for m, use in ((control, None), (model, amp)):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        for i, batch in enumerate(batches()):
            loss = mse(m, batch) / 2
            (loss if use is None else use.scale(loss)).backward()
            if (i + 1) % 2 == 0:
                if use is None:
                    opt.step()
                else:
                    use.step(opt)
                    use.update()
                opt.zero_grad()
    assert amp.get_scale() == INIT_SCALE * 2 ** 2
    for c, s in zip(control.parameters(), model.parameters()):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


def test_gradient_penalty_through_a_scaled_autograd_grad(patched: None) -> None:
    """test_grad_scaling_penalty: autograd.grad of a scaled loss, unscaled by hand."""
    ((control, model),) = models()
    amp = scaler()
    for m, use in ((control, None), (model, amp)):
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        for i, batch in enumerate(batches()):
            opt.zero_grad()
            loss = mse(m, batch)
            if use is None:
                grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
            else:
                grads = torch.autograd.grad(use.scale(loss), list(m.parameters()),
                                            create_graph=True)
                grads = [g * (1.0 / use.get_scale()) for g in grads]
            loss = loss + torch.sqrt(sum(g.pow(2).sum() for g in grads))
            if use is None:
                loss.backward()
                if i != SKIP_ITER:
                    opt.step()
                continue
            use.scale(loss).backward()
            if i == SKIP_ITER:
                m[1].weight.grad.fill_(float("inf"))
            use.step(opt)
            use.update()
    assert amp.get_scale() == INIT_SCALE * 2 ** 3 * 0.5
    for c, s in zip(control.parameters(), model.parameters()):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


def test_disabled_scaler_leaves_the_loop_as_it_was(patched: None) -> None:
    """_run_scaling_case(enabled=False): the same control flow, no scaling at all."""
    ((control, model),) = models()
    fp32_control(control, clip=0.2)
    amp, opt = scaler(enabled=False), torch.optim.SGD(model.parameters(), lr=1.0)
    for i, batch in enumerate(batches()):
        opt.zero_grad()
        loss = mse(model, batch)
        assert amp.scale(loss) is loss
        loss.backward()
        amp.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2 * amp.get_scale())
        if i != SKIP_ITER:
            amp.step(opt)
        amp.update()
    assert amp.get_scale() == 1.0 and amp.state_dict() == {}
    for c, s in zip(control.parameters(), model.parameters()):
        assert torch.equal(c, s)
    assert patches.stats()["grad_clip"]["scaled_clips"] == 0


def test_state_dict_round_trip_with_torch_scalers(patched: None) -> None:
    """test_grad_scaling_state_dict, plus a checkpoint read with weights_only=True and a
    plain torch GradScaler on either side."""
    for lazy_init_scale in (True, False):
        s0 = torch.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5,
                              growth_interval=2)
        s1 = torch.GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8,
                              growth_interval=1)
        s1._init_growth_tracker = 7
        if lazy_init_scale:
            s1.scale(torch.full((1,), 4.0))
        s1.load_state_dict(s0.state_dict())
        assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(),
                s1.get_growth_interval(), s1._init_growth_tracker) == (3.0, 4.0, 0.5, 2, 0)

    ((_, model),) = models()
    amp, opt = scaler(), torch.optim.SGD(model.parameters(), lr=0.1)
    for i, batch in enumerate(batches()):
        opt.zero_grad()
        amp.scale(mse(model, batch)).backward()
        if i == SKIP_ITER:
            model[1].weight.grad.fill_(float("inf"))
        amp.step(opt)
        amp.update()
    buffer = io.BytesIO()
    torch.save({"scaler": amp.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["scaler"]  # coqui's checkpoints load so

    plain = TorchGradScaler("cpu")
    plain.load_state_dict(state)  # our extra key is ignored by torch's scaler
    assert plain.get_scale() == amp.get_scale() == INIT_SCALE * 2 ** 3 * 0.5
    again = scaler()
    again.load_state_dict(state)
    assert again.stats()["steps"] == 4 and again.stats()["skipped"] == 1
    from_plain = scaler()
    from_plain.load_state_dict(plain.state_dict())
    assert from_plain.get_scale() == amp.get_scale()


def test_pickled_scaler_carries_on_like_the_unpickled_one(patched: None) -> None:
    """test_grad_scaling_autocast(try_pickle=True) and test_pickle_gradscaler."""
    results = []
    for try_pickle in (False, True):
        ((_, model),) = models()
        amp, opt = scaler(), torch.optim.SGD(model.parameters(), lr=1.0)
        for i, batch in enumerate(batches()):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model, batch)
            amp.scale(loss).backward()
            if i == SKIP_ITER:
                with torch.no_grad():
                    model[1].weight.grad.fill_(float("inf"))
            amp.step(opt)
            amp.update()
            if try_pickle:
                amp = pickle.loads(pickle.dumps(amp))
                assert isinstance(amp, SafeGradScaler)
        results.append((amp.get_scale(), [p.detach().clone() for p in model.parameters()]))
    (scale_a, params_a), (scale_b, params_b) = results
    assert scale_a == scale_b == INIT_SCALE * 2 ** 3 * 0.5
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


class _SgdThatReports(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        return "stepped"


def test_step_returns_the_optimizers_value_and_refuses_a_closure(patched: None) -> None:
    """GradScaler.step: the optimizer's return value; None when skipped; no closures."""
    ((_, model),) = models()
    amp, opt = scaler(), _SgdThatReports(model.parameters(), lr=0.1)
    returned = []
    for i, batch in enumerate(batches()):
        opt.zero_grad()
        amp.scale(mse(model, batch)).backward()
        if i == SKIP_ITER:
            model[1].weight.grad.fill_(float("inf"))
        returned.append(amp.step(opt))
        amp.update()
    assert returned == ["stepped", "stepped", None, "stepped"]

    amp.scale(mse(model, batches()[0])).backward()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        amp.step(opt, closure=lambda: None)


def test_fused_optimizer_overflow_leaves_parameters_and_moments_untouched(patched: None) -> None:
    """test_grad_scaling_autocast with fused AdamW: the found_inf protocol skips in-kernel."""
    ((_, model),) = models()
    reference = copy.deepcopy(model)
    amp = scaler()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_amp = TorchGradScaler("cpu", init_scale=INIT_SCALE, growth_factor=2.0, growth_interval=1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for i, batch in enumerate(batches()):
        for m, a, o in ((model, amp, opt), (reference, ref_amp, ref_opt)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(m, batch)
            a.scale(loss).backward()
            if i == SKIP_ITER:
                with torch.no_grad():
                    m[1].weight.grad.fill_(float("inf"))
            a.step(o)
            a.update()
    assert amp.get_scale() == ref_amp.get_scale() == INIT_SCALE * 2 ** 3 * 0.5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key])
    assert int(opt.state[next(model.parameters())]["step"]) == 3  # the skipped step not counted


def test_coqui_reads_a_skipped_step_from_a_lower_scale(patched: None) -> None:
    """coqui Trainer.optimize: ``scale_prev <= scaler.get_scale()`` decides whether the LR
    scheduler steps; unscale_ then clip_grad_norm_(master_params, grad_clip)."""
    ((_, model),) = models()
    amp, opt = scaler(), torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler_steps = []
    for i, batch in enumerate(batches()):
        amp.scale(mse(model, batch)).backward()
        if i == SKIP_ITER:
            model[1].weight.grad.fill_(float("inf"))
        amp.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        scale_prev = amp.get_scale()
        amp.step(opt)
        amp.update()
        scheduler_steps.append(scale_prev <= amp.get_scale())
        assert bool(torch.isfinite(grad_norm)) == (i != SKIP_ITER)
        opt.zero_grad(set_to_none=True)
    assert scheduler_steps == [True, True, False, True]


def test_gradients_broken_after_unscale_reach_the_parameters(patched: None) -> None:
    """test_params_invalidated_with_grads_invalidated_between_unscale_and_step: torch does
    not protect gradients changed after unscale_; the next NaN loss still backpropagates.
    As there, one loop per optimizer setting, one after the other in the same process."""
    for kwargs in ({}, {"momentum": 0.9}):
        ((_, model),) = models()
        amp, opt = scaler(), torch.optim.SGD(model.parameters(), lr=1.0, **kwargs)
        for batch in batches():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model, batch)
            amp.scale(loss).backward()
            amp.unscale_(opt)
            for j, p in enumerate(model.parameters()):
                assert p.grad is not None, "the NaN loss's backward was dropped"
                p.grad.copy_(torch.tensor(float("inf") if j % 2 else float("nan")))
            amp.step(opt)
            amp.update()
        assert all(bool(p.isnan().any() or p.isinf().any()) for p in model.parameters())
