"""The order within one optimizer step (docs/design/step.md), walked with real steps.

``patches._step._step.context().recording()`` lists the phases as the scaler, the clip and the
guard mark them; each test runs one real step (CPU, a tiny model) and asserts the exact
list, and what the shared context holds between the phases.
"""

from __future__ import annotations

import itertools
from typing import Callable

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

import patches
from patches import _step, nan_guard
from patches.advanced import SafeGradScaler




@pytest.fixture
def patched(tmp_path) -> None:
    """The scaler, the clip and the guard on; events into ``tmp_path``."""
    nan_guard.reset()
    patches.advanced.apply(["grad_scaler", "grad_clip", "nan_guard"], output_dir=str(tmp_path))
    yield
    nan_guard.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(model: torch.nn.Module, poison: float = 1.0) -> torch.Tensor:
    torch.manual_seed(1)
    return model(torch.randn(16, 8)).pow(2).mean() * poison


def _walk(step: Callable[[], object]) -> list[str]:
    with _step.context().recording() as phases:
        step()
    return phases


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(before: list[torch.Tensor], model: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, *, clip: bool = True,
                poison: float = 1.0) -> None:
    opt.zero_grad(set_to_none=True)
    _loss(model, poison).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def test_fp32_loop_with_clip(patched: None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _walk(lambda: _plain_step(model, opt)) == [
        "backward", "clip", "decide", "step", "record"]


def test_fp32_loop_without_clip(patched: None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _walk(lambda: _plain_step(model, opt, clip=False)) == [
        "backward", "decide", "step", "record"]


def test_a_nan_loss_is_decided_skipped_then_recorded(patched: None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _params(model)
    assert _walk(lambda: _plain_step(model, opt, poison=float("nan"))) == [
        "backward", "clip", "decide", "skip", "record"]
    assert _same(before, model)
    assert patches.stats()["nan_guard"]["skipped"] == 1


def _scaled_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: SafeGradScaler,
                 *, unscale: bool, poison: float = 1.0) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(model).float()
    scaler.scale(loss * poison).backward()
    if unscale:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0 if unscale else scaler.get_scale())
    scaler.step(opt)
    scaler.update()


def test_scaler_unscales_then_clip_then_decides(patched: None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = SafeGradScaler("cpu", init_scale=1024.0)
    assert _walk(lambda: _scaled_step(model, opt, scaler, unscale=True)) == [
        "backward", "unscale", "clip", "decide", "step", "record"]
    before = _params(model)
    assert _walk(lambda: _scaled_step(model, opt, scaler, unscale=True,
                                      poison=float("inf"))) == [
        "backward", "unscale", "clip", "decide", "skip", "record"]
    assert _same(before, model)


def test_scaler_not_asked_to_unscale_does_so_in_its_step_after_the_clip(patched: None) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = SafeGradScaler("cpu", init_scale=1024.0)
    assert _walk(lambda: _scaled_step(model, opt, scaler, unscale=False)) == [
        "backward", "clip", "unscale", "decide", "step", "record"]


def test_fused_optimizer_decides_on_the_device(patched: None) -> None:
    """Guard only: the flag goes to the kernel, the host marks "step" either way; under a
    scaler the kernel reads the scaler's flag: no host decision at all."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert _walk(lambda: _plain_step(model, opt)) == [
        "backward", "clip", "decide", "step", "record"]
    before = _params(model)
    assert _walk(lambda: _plain_step(model, opt, poison=float("nan"))) == [
        "backward", "clip", "decide", "step", "record"]
    assert _same(before, model)  # the kernel skipped it

    scaler = SafeGradScaler("cpu", init_scale=1024.0)

    def scaled() -> None:
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(model)).backward()
        scaler.step(opt)
        scaler.update()
    assert _walk(scaled) == ["backward", "unscale", "step", "record"]


def _closure_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                  poison: float = 1.0) -> Callable[[], object]:
    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, poison)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss
    return lambda: opt.step(closure)


def test_step_closure_backward_and_clip_come_before_the_decision(patched: None) -> None:
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1)
    assert _walk(_closure_step(model, opt)) == ["backward", "clip", "decide", "step", "record"]
    before = _params(model)
    # a NaN made inside the closure is judged: the decision comes after it
    assert _walk(_closure_step(model, opt, float("nan"))) == [
        "backward", "clip", "decide", "skip", "record"]
    assert _same(before, model)


def test_further_closure_evaluations_belong_to_the_step(patched: None) -> None:
    """LBFGS evaluates the closure again inside its step: between "step" and "record"."""
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    assert _walk(_closure_step(model, opt)) == [
        "backward", "clip", "decide", "step", "backward", "clip", "record"]


def test_the_context_holds_each_part_for_its_phases_only(patched: None) -> None:
    """The pending scaler from scale() to update(); "stepping" only inside the optimizer
    step the scaler runs; the clip's flag from the clip until the guard takes it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = SafeGradScaler("cpu", init_scale=1024.0)
    seen: list[bool] = []
    handle = opt.register_step_pre_hook(lambda *_: seen.append(_step.context().scaler_stepping))
    try:
        assert _step.context().pending_scaler() is None
        scaled = scaler.scale(_loss(model))
        assert _step.context().pending_scaler() is scaler
        scaled.backward()
        scaler.unscale_(opt)
        assert set(scaler.unscaled_param_ids()) == {id(p) for p in model.parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = [p.grad for p in model.parameters()]
        context = _step.context()
        assert context.take_clip(grads) is not None and context.take_clip(grads) is None
        scaler.step(opt)
        assert seen == [True] and not _step.context().scaler_stepping
        scaler.update()
        assert _step.context().pending_scaler() is None and not scaler.unscaled_param_ids()
    finally:
        handle.remove()


def test_the_recorder_is_off_by_default() -> None:
    assert _step.context().phases is None
    _step.context().mark("no such phase")  # off: not even checked
    with _step.context().recording() as phases:
        _step.context().mark("clip")
        with pytest.raises(ValueError, match="unknown step phase"):
            _step.context().mark("no such phase")
    assert phases == ["clip"] and _step.context().phases is None


# -- the pipeline: the same stages whatever order the patches came and went in ----------

STEP_PATCHES = ("nan_guard", "vocab_freeze", "resume_check", "grad_clip")


def _frozen_step_phases(tmp_path, order: tuple[str, ...]) -> tuple[list[str], list[str], bool]:
    """Apply ``order`` one patch at a time, revert the first and apply it again, then walk
    two steps of a fresh model whose first 6 of 10 rows BASE_VOCAB freezes: the first
    after a resume (the optimizer's state loaded), the second with a NaN loss."""
    from tiny_models import TinyTextModel

    for name in order:
        patches.advanced.apply([name], output_dir=str(tmp_path), base_vocab=6)
    patches.revert([order[0]])
    patches.advanced.apply([order[0]], output_dir=str(tmp_path), base_vocab=6)
    torch.manual_seed(0)
    model = TinyTextModel(vocab=10)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    tokens = torch.arange(10).repeat(2)

    def step(poison: float = 1.0) -> None:
        opt.zero_grad(set_to_none=True)
        (model(tokens).logsumexp(-1).mean() * poison).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    warm = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    warm.zero_grad()
    model(tokens).mean().backward()
    warm.step()  # state for the "resume": moments of these parameters
    opt.load_state_dict(warm.state_dict())
    base = model.text_embedding.weight.detach()[:6].clone()
    first = _walk(step)
    second = _walk(lambda: step(float("nan")))
    kept = torch.equal(model.text_embedding.weight.detach()[:6], base)
    return first, second, kept


# The four rotations (each patch applied first, then reverted and applied again, once) in the
# fast tier; the other 20 orders with the slow tests (each walk scans the heap for schedulers).
ROTATIONS = [STEP_PATCHES[i:] + STEP_PATCHES[:i] for i in range(len(STEP_PATCHES))]
ORDERS = [pytest.param(order, id="-".join(order),
                       marks=() if order in ROTATIONS else pytest.mark.slow)
          for order in itertools.permutations(STEP_PATCHES)]


@pytest.mark.parametrize("order", ORDERS)
def test_the_stages_run_in_one_order_whatever_order_the_patches_came_in(
        tmp_path, order: tuple[str, ...]) -> None:
    """Issue 40: the resume check, the freeze's discovery and hold, the guard's decision
    and the record run in the pipeline's order, not in the order their hooks were made."""
    nan_guard.reset()
    first, second, kept = _frozen_step_phases(tmp_path, order)
    assert first == ["backward", "clip", "resume_check", "decide", "hold", "step", "keep",
                     "record"]
    assert second == ["backward", "clip", "decide", "hold", "skip", "keep", "record"]
    assert kept  # the frozen rows bit-identical through the taken and the skipped step
    # the library's only global optimizer hooks: the pipeline's two, once each
    ours = [hook for hooks in (torch_optimizer._global_optimizer_pre_hooks,
                               torch_optimizer._global_optimizer_post_hooks)
            for hook in hooks.values() if hook.__module__.startswith("patches")]
    assert ours == [_step.before_step, _step.after_step]
    nan_guard.reset()


def test_reverting_every_step_patch_leaves_the_stages_empty(tmp_path) -> None:
    for name in STEP_PATCHES:
        patches.advanced.apply([name], output_dir=str(tmp_path))
    stages = _step.STAGES
    assert stages.decide is not None and stages.record is not None
    assert stages.check_resume is not None and stages.find_frozen is not None
    patches.revert()
    assert (stages.decide, stages.record, stages.check_resume, stages.find_frozen) == (
        None, None, None, None)
