"""The freeze keeps the optimizer off the frozen rows (issue 41): no copy back per step.

For the row-wise optimizers (SGD, Adam, AdamW, NAdam, RAdam, Adamax, RMSprop; plain,
foreach and fused) the optimizer steps a view of the trainable rows in the frozen tensor's
place, so the frozen rows, and their optimizer state, are never written; the stored copy of
the base rows is dropped. The trainable rows get bit for bit what stepping the whole tensor
(with the base rows' gradients zeroed and the rows copied back, the earlier mechanism, done
by hand here) gives them. Every other optimizer keeps the copy back. And a step the NaN
guard skips does not count toward ``until_step`` (issue 40).
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import TinyTextModel
from torch import nn

import patches
from patches import nan_guard, vocab_freeze
from patches.advanced import freeze_base_vocab

BASE, VOCAB, DIM = 40, 52, 16
Model = functools.partial(TinyTextModel, VOCAB, DIM, "tanh")

ROW_WISE = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum_l2": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                                      weight_decay=0.01, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01,
                                           fused=True),
    "adam_l2": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    "adam_amsgrad_single": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=False),
    "adam_decoupled": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1,
                                                 decoupled_weight_decay=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
    "adamw_single": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_maximize_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1,
                                                          maximize=True, amsgrad=True),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.01),
    "radam_decoupled": lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.1,
                                                   decoupled_weight_decay=True),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2, weight_decay=0.01),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True,
                                                      weight_decay=0.01),
}


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (8, 12), generator=gen),
             torch.randint(0, VOCAB, (8, 12), generator=gen)) for _ in range(steps)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    _loss(model, x, y).backward()
    opt.step()


def _vocab(model: nn.Module) -> list[torch.Tensor]:
    return [model.text_embedding.weight, model.text_head.weight, model.text_head.bias]


def _by_hand_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, kept) -> None:
    """The earlier mechanism, by hand: base rows' gradients zeroed, rows copied back."""
    opt.zero_grad(set_to_none=True)
    _loss(model, x, y).backward()
    for p in _vocab(model):
        p.grad[:BASE].zero_()
    opt.step()
    with torch.no_grad():
        for p, rows in zip(_vocab(model), kept):
            p[:BASE].copy_(rows)


def _state_rows(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[:BASE].clone() for k, v in opt.state[param].items()
            if isinstance(v, torch.Tensor) and v.shape == param.shape}


@pytest.mark.parametrize("name", sorted(ROW_WISE))
def test_row_wise_optimizers_never_touch_the_frozen_rows(name: str) -> None:
    torch.manual_seed(0)
    model, control = Model(), Model()
    control.load_state_dict(model.state_dict())
    opt, control_opt = ROW_WISE[name](model.parameters()), ROW_WISE[name](control.parameters())
    data = _batches(9)
    for x, y in data[:3]:  # momentum in the base rows, as after loading a checkpoint
        _step(model, opt, x, y)
        _step(control, control_opt, x, y)
    before = [p.detach().clone() for p in _vocab(model)]
    state_before = [_state_rows(opt, p) for p in _vocab(model)]
    handle = freeze_base_vocab(model, BASE)
    kept = [p.detach()[:BASE].clone() for p in _vocab(control)]
    restores = []
    handle._restore = lambda: restores.append(1)  # held steps never copy rows back
    for x, y in data[3:]:
        _step(model, opt, x, y)
        _by_hand_step(control, control_opt, x, y, kept)
    assert not restores
    for p, b in zip(_vocab(model), before):
        assert torch.equal(p.detach()[:BASE], b[:BASE])  # bit-identical
        assert not torch.equal(p.detach()[BASE:], b[BASE:])  # the new rows trained
    # the frozen rows' optimizer state is held too (a copy back left it decaying)
    for p, rows in zip(_vocab(model), state_before):
        for key, value in rows.items():
            assert torch.equal(opt.state[p][key][:BASE], value), key
    # the trainable rows: bit for bit what the whole tensor's step gave them
    for p, q in zip(_vocab(model), _vocab(control)):
        assert torch.equal(p.detach()[BASE:], q.detach()[BASE:])
    # and every other parameter the same too
    assert torch.equal(model.body.weight, control.body.weight)
    # nothing stored: the copy of the base rows is no longer kept
    assert all(entry.stored is None for entry in handle._entries)
    assert all(torch.equal(v, b[:BASE]) for v, b in zip(handle.frozen_values().values(), before))
    # the groups hold the model's own parameters again, the state has their full shape
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    for p in _vocab(model):
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.shape == p.shape


def test_first_step_state_is_made_whole() -> None:
    """A fresh optimizer: its first step makes the view's state; it becomes the tensor's,
    zero in the frozen rows, and a saved and loaded optimizer goes on exactly."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = model.text_head.weight.detach()[:BASE].clone()
    freeze_base_vocab(model, BASE)
    data = _batches(4)
    _step(model, opt, *data[0])
    state = opt.state[model.text_head.weight]
    assert state["exp_avg"].shape == model.text_head.weight.shape
    assert state["exp_avg"][:BASE].abs().max().item() == 0.0
    assert state["exp_avg"][BASE:].abs().max().item() > 0.0
    saved = opt.state_dict()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    fresh.load_state_dict(saved)
    for x, y in data[1:]:
        _step(model, fresh, x, y)
    assert torch.equal(model.text_head.weight.detach()[:BASE], before)


def test_a_step_that_raises_leaves_the_groups_whole() -> None:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = model.text_head.weight.detach()[:BASE].clone()
    freeze_base_vocab(model, BASE)

    def boom(optimizer, args, kwargs):
        raise RuntimeError("boom")
    _step(model, opt, *_batches(1)[0])
    handle = opt.register_step_pre_hook(boom)  # after the freeze's: the views are in the groups
    with pytest.raises(RuntimeError, match="boom"):
        _step(model, opt, *_batches(1, seed=2)[0])
    handle.remove()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))
    assert saved["state"][3]["exp_avg"].shape == model.text_head.weight.shape
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    _step(model, opt, *_batches(1, seed=3)[0])
    assert torch.equal(model.text_head.weight.detach()[:BASE], before)


class _MyAdamW(torch.optim.AdamW):
    """A subclass may step otherwise: it keeps the copy back."""


def _closure_steps(model, opt, batches) -> None:
    """One ``opt.step(closure)`` per batch, the closure computing the loss (as Lightning's
    automatic optimization does)."""
    for x, y in batches:
        def closure(x=x, y=y):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, x, y)
            loss.backward()
            return loss
        opt.step(closure)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01, initial_accumulator_value=0.1),
    lambda p: _MyAdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=3),
], ids=["adagrad", "subclass", "lbfgs"])
def test_other_optimizers_keep_the_copy_back(make) -> None:
    torch.manual_seed(0)
    model = Model()
    opt = make(model.parameters())
    before = [p.detach().clone() for p in _vocab(model)]
    handle = freeze_base_vocab(model, BASE)
    _closure_steps(model, opt, _batches(4))
    assert handle.steps == 4
    for p, b in zip(_vocab(model), before):
        assert torch.equal(p.detach()[:BASE], b[:BASE])
        assert not torch.equal(p.detach()[BASE:], b[BASE:])
    assert all(entry.stored is not None for entry in handle._entries)


def test_the_copy_comes_back_for_a_later_optimizer_that_is_not_row_wise() -> None:
    torch.manual_seed(0)
    model = Model()
    before = model.text_head.weight.detach()[:BASE].clone()
    handle = freeze_base_vocab(model, BASE)
    _step(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
          *_batches(1)[0])
    assert all(entry.stored is None for entry in handle._entries)
    other = torch.optim.Adagrad(model.parameters(), lr=0.5)
    for x, y in _batches(3, seed=5):
        _step(model, other, x, y)
    assert torch.equal(model.text_head.weight.detach()[:BASE], before)


def test_a_closure_the_guard_ran_is_held_one_it_did_not_is_copied_back(
        tmp_path) -> None:
    """step(closure) (Lightning's automatic optimization): the guard runs the closure before
    it decides, so the gradients are final when the freeze takes its views; without the
    guard the closure runs inside the step, after them, and the freeze copies back."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in _vocab(model)]
    handle = freeze_base_vocab(model, BASE)
    restores = []
    restore = handle._restore
    handle._restore = lambda: (restores.append(1), restore())

    def run(steps: int, seed: int) -> None:
        _closure_steps(model, opt, _batches(steps, seed=seed))
    run(3, seed=1)
    assert len(restores) == 3  # no guard: copied back
    nan_guard.reset()
    patches.advanced.apply(["nan_guard"], output_dir=str(tmp_path), quiet=True)
    run(3, seed=2)
    assert len(restores) == 3  # the guard ran the closures: held
    nan_guard.reset()
    assert handle.steps == 6
    for p, b in zip(_vocab(model), before):
        assert torch.equal(p.detach()[:BASE], b[:BASE])
        assert not torch.equal(p.detach()[BASE:], b[BASE:])


# -- until_step counts steps taken (issue 40) ------------------------------------------


@pytest.fixture
def guard(tmp_path):
    nan_guard.reset()
    patches.advanced.apply(["nan_guard"], output_dir=str(tmp_path), quiet=True)
    yield
    nan_guard.reset()


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused_adamw"])
def test_until_step_counts_only_steps_taken(fused: bool, guard) -> None:
    """until_step=2 with a NaN first step: the skipped step is no update, so the freeze
    holds through two real updates and releases after the second."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    before = model.text_head.weight.detach()[:BASE].clone()
    handle = freeze_base_vocab(model, BASE, until_step=2)
    data = _batches(4)
    opt.zero_grad(set_to_none=True)
    (_loss(model, *data[0]) * float("nan")).backward()
    opt.step()  # skipped by the guard
    assert not handle.released
    _step(model, opt, *data[1])  # the first real update
    assert not handle.released and handle.steps == 1
    assert torch.equal(model.text_head.weight.detach()[:BASE], before)
    _step(model, opt, *data[2])  # the second
    assert handle.released and handle.steps == 2
    assert torch.equal(model.text_head.weight.detach()[:BASE], before)
    _step(model, opt, *data[3])  # released: the base rows train
    assert not torch.equal(model.text_head.weight.detach()[:BASE], before)
    assert nan_guard.stats()["skipped"] == 1


def test_a_fused_step_the_scaler_skips_does_not_count() -> None:
    """A fused optimizer under a GradScaler: the kernel skips on the device flag the scaler
    hands it; that step is no update either."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    handle = freeze_base_vocab(model, BASE)
    for i, (x, y) in enumerate(_batches(3)):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, x, y) * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert handle.steps == 2
