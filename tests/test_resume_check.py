"""resume_check: at the first optimizer step after a resume, a scheduler and an optimizer that
do not belong together are named (the seeds' fresh optimizer with the old scheduler, a
restarted scheduler, moments of other shapes); a resume whose parts fit is one INFO line."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

import patches
from patches import resume_check


def warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 10) * (0.5 + 0.5 * torch.cos(torch.tensor(step / 200 * 3.14159)).item())


def build(rows: int = 8):
    model = torch.nn.Embedding(rows, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    return model, opt, sched


def train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        model(torch.tensor([1, 2, 3])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.fixture
def saved(tmp_path):
    """The state of a run stopped at step 30, and the patch on."""
    patches.advanced.reset_runtime_state()
    patches.advanced.set_output_dir(tmp_path)
    torch.manual_seed(0)
    model, opt, sched = build()
    train(model, opt, sched, 30)
    patches.advanced.apply(["resume_check"])
    yield model, copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    patches.advanced.set_output_dir(None)
    patches.advanced.reset_runtime_state()


def resume_records(folder) -> list[dict]:
    path = folder / "learning_health.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_resume_that_loads_both_is_one_info_line(saved, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="training_patches")
    model, opt_state, sched_state = saved
    _, opt, sched = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    train(model, opt, sched, 3)
    assert warnings(caplog) == []
    assert "resume_check: resume at optimizer step 30: LR 0.000" in caplog.text
    (record,) = resume_records(tmp_path)
    assert record["event"] == "resume" and record["problems"] == []
    assert record["optimizer_steps"] == 30 and record["scheduler_steps"] == 30
    assert patches.stats()["resume_check"] == {"resumes_checked": 1, "resume_problems": 0}


def test_a_fresh_optimizer_with_the_old_scheduler_is_named(saved, tmp_path, caplog) -> None:
    """Seed 004's bug: the LR goes on decaying, the moments start from zero."""
    model, _, sched_state = saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    sched.load_state_dict(sched_state)
    train(model, opt, sched, 2)
    (warning,) = warnings(caplog)
    assert "the scheduler continues an old schedule (its step 30, LR 0.000" in warning
    assert "the optimizer is fresh: its step count is 0" in warning
    (record,) = resume_records(tmp_path)
    assert record["problems"] == ["fresh_optimizer"] and record["optimizer_steps"] == 0


def test_a_restarted_scheduler_is_named(saved, tmp_path, caplog) -> None:
    model, opt_state, _ = saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    opt.load_state_dict(opt_state)
    lr_before = opt.param_groups[0]["lr"]
    train(model, opt, sched, 2)
    (warning,) = warnings(caplog)
    assert f"the optimizer's LR {lr_before:.3g}" in warning
    assert "the scheduler restarted (its step count is 0) while the optimizer has taken 30 " \
           "steps" in warning
    assert resume_records(tmp_path)[0]["problems"] == ["lr_not_scheduler"]


def test_a_scheduler_behind_the_trainers_step_is_named(saved, tmp_path, caplog) -> None:
    """Told the trainer's step and that the scheduler steps with it: both restored, but
    from checkpoints of different steps."""
    model, opt_state, sched_state = saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    resume_check.expect_resume(120, scheduler_step=120, source="a test")
    train(model, opt, sched, 1)
    (warning,) = warnings(caplog)
    assert "the scheduler is at its step 30 while the run resumes where it should be at 120 " \
           "(trainer step 120): it restarted; its plan gives LR" in warning
    (record,) = resume_records(tmp_path)
    assert record["problems"] == ["scheduler_steps"] and record["step"] == 120
    assert record["planned_lr"] == pytest.approx([1e-3 * warmup_cosine(120)])


def test_moments_of_a_smaller_vocabulary_are_named_before_torch_fails(saved, tmp_path,
                                                                      caplog) -> None:
    _, opt_state, sched_state = saved
    grown, opt, sched = build(rows=10)
    opt.load_state_dict(opt_state)  # torch accepts moments of 8 rows for 10
    sched.load_state_dict(sched_state)
    with pytest.raises(RuntimeError):
        train(grown, opt, sched, 1)
    (warning,) = warnings(caplog)
    assert "the optimizer's state does not fit its parameters (1 tensor(s): parameter 0 of " \
           "its group (10, 4) has exp_avg (8, 4))" in warning
    assert resume_records(tmp_path)[0]["problems"] == ["moments"]


def test_a_fresh_start_is_no_resume_and_the_patch_off_checks_nothing(saved, tmp_path,
                                                                     caplog) -> None:
    model, _, sched_state = saved
    fresh_model, opt, sched = build()
    train(fresh_model, opt, sched, 3)
    assert resume_records(tmp_path) == [] and warnings(caplog) == []
    patches.revert(["resume_check"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    sched.load_state_dict(sched_state)
    train(model, opt, sched, 2)
    assert resume_records(tmp_path) == [] and warnings(caplog) == []


def test_a_later_load_state_dict_checks_again(saved, tmp_path, caplog) -> None:
    model, opt_state, sched_state = saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    train(model, opt, sched, 2)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    del sched
    opt.load_state_dict(opt_state)  # the user's own reload, mid-run, with a new scheduler
    train(model, opt, fresh_sched, 1)
    assert [r["problems"] for r in resume_records(tmp_path)] == [[], ["lr_not_scheduler"]]


def test_plain_sgd_keeps_no_step_count_and_is_no_fresh_optimizer(tmp_path,
                                                                 caplog) -> None:
    """SGD without momentum has no state, loaded or not (found by Lightning's own
    test_finetuning_with_ckpt_path, docs/compatibility.md): not a fresh optimizer."""
    patches.advanced.reset_runtime_state()
    patches.advanced.set_output_dir(tmp_path)
    model = torch.nn.Embedding(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, sched, 3)
    opt_state, sched_state = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    patches.advanced.apply(["resume_check"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    train(model, opt, sched, 1)
    assert warnings(caplog) == []
    (record,) = resume_records(tmp_path)
    assert record["problems"] == [] and record["optimizer_steps"] is None
    patches.advanced.set_output_dir(None)


def test_the_scheduler_of_an_accelerate_wrapped_optimizer_is_found(saved, tmp_path, caplog) -> None:
    """The HF Trainer's scheduler holds accelerate's AcceleratedOptimizer, whose step is the
    torch optimizer's: the check finds it through the wrapper."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    model, opt_state, _ = saved
    try:
        wrapped = Accelerator(cpu=True).prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
        sched = torch.optim.lr_scheduler.LambdaLR(wrapped, warmup_cosine)
        wrapped.load_state_dict(opt_state)  # a fresh scheduler under the loaded optimizer
        train(model, wrapped, sched, 1)
    finally:
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
    (record,) = resume_records(tmp_path)
    assert record["schedulers"] == 1 and record["problems"] == ["lr_not_scheduler"]
