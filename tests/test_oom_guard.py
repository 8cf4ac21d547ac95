"""oom_guard through the real coqui Trainer and a tiny XTTS GPTTrainer: a CUDA out-of-memory
error (raised from a forward hook, as the allocator would) skips one batch and the run goes
on; repeated ones stop the run with sizes that fit."""

from __future__ import annotations

import json
import os

import pytest
import torch

import patches
from patches import oom_guard

pytestmark = pytest.mark.xtts


def _oom_from(model, calls_that_fail: set[int]) -> list[int]:
    calls = [0]

    def hook(module, inputs, output):
        calls[0] += 1
        if calls[0] in calls_that_fail:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return output
    model.xtts.gpt.text_embedding.register_forward_hook(hook)
    return calls


def test_one_out_of_memory_batch_is_skipped_and_the_run_goes_on(tiny_xtts, tmp_path) -> None:
    patches.advanced.apply()
    config = tiny_xtts.make_config(tmp_path / "run", epochs=1)
    model = tiny_xtts.make_model(config)
    _oom_from(model, {3})
    trainer = tiny_xtts.train(config, model)
    assert trainer.total_steps_done == 6  # 7 batches, one skipped
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert patches.stats()["oom_guard"] == {"oom_skipped": 1, "consecutive_ooms": 0}
    with open(os.path.join(trainer.output_path, "oom_events.jsonl")) as handle:
        (event,) = [json.loads(line) for line in handle]
    assert event["trainer_step"] == 2 and event["batch_size"] == config.batch_size
    assert len(event["samples"]) == 2 and all(s.endswith(".wav") for s in event["samples"])
    assert event["shapes"]["text_inputs"][0] == 2 and event["longest_audio"] > 0


def test_without_the_guard_one_out_of_memory_batch_ends_the_run(tiny_xtts, tmp_path) -> None:
    patches.advanced.apply()
    patches.revert(["oom_guard"])
    config = tiny_xtts.make_config(tmp_path / "run", epochs=1)
    model = tiny_xtts.make_model(config)
    _oom_from(model, {3})
    with pytest.raises(RuntimeError, match="failed inside the coqui Trainer"):
        tiny_xtts.train(config, model)


def test_repeated_out_of_memory_stops_with_sizes_that_fit(tiny_xtts, tmp_path,
                                                          capfd) -> None:
    patches.advanced.apply(max_oom_skips=3)
    config = tiny_xtts.make_config(tmp_path / "run", epochs=1)
    model = tiny_xtts.make_model(config)
    _oom_from(model, set(range(2, 100)))
    with pytest.raises(RuntimeError):
        tiny_xtts.train(config, model)
    err = capfd.readouterr().err
    assert "OutOfMemoryTrainingError" in err and "3 consecutive batches" in err
    assert "a batch size of 1 (the failing batches had 2)" in err
    assert "maximum audio length of 2.6 s" in err  # 0.75 x the 3.5 s clips
    assert oom_guard.stats()["oom_skipped"] == 3


def test_a_plain_loop_skips_with_the_context_manager() -> None:
    patches.advanced.apply()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        batch = {"x": torch.randn(8, 4), "utt_ids": [f"u{i}_{j}" for j in range(8)]}
        with patches.advanced.skip_on_oom(batch, opt):
            if i == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            model(batch["x"]).sum().backward()
            opt.step()
            opt.zero_grad()
    assert oom_guard.stats() == {"oom_skipped": 1, "consecutive_ooms": 0}


@pytest.mark.parametrize("cuda_in_use", [False, True], ids=["cpu", "cuda"])
def test_the_release_collects_garbage_only_where_device_memory_is_in_use(monkeypatch,
                                                                         cuda_in_use) -> None:
    """A full collection costs ~0.1 s once torch and a model are in memory: it runs, then the
    cache is emptied, only where a CUDA context holds memory to give back."""
    calls: list[str] = []
    monkeypatch.setattr(oom_guard.gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_in_use)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_in_use)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    grad = torch.nn.Parameter(torch.ones(2))
    grad.grad = torch.ones(2)
    optimizer = torch.optim.SGD([grad], lr=0.1)
    patches.advanced.apply()
    oom_guard.on_oom(torch.cuda.OutOfMemoryError("CUDA out of memory"), {}, [optimizer])
    assert grad.grad is None  # the batch's gradients are dropped either way
    assert calls == (["collect", "empty_cache"] if cuda_in_use else [])
