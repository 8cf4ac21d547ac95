"""Issue 28: DeepSpeed (0.19, CPU, one process, gloo) with the same guarantees. Under ZeRO-1/2
and bf16 the optimizer steps fp32 master copies, so the freeze's restore of the module never
reached them and the base rows trained, silently; the deepspeed integration puts the frozen
rows back in the masters and the module after every engine step: bit-identical. ZeRO-3
cannot be frozen exactly: refused loudly (status ``not applied``; an error under STRICT).
Each case runs the real engine in its own process (tests/deepspeed_jobs/freeze_job.py)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from processes import child_path

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install -e '.[test]')")

JOB = Path(__file__).resolve().parent / "deepspeed_jobs" / "freeze_job.py"
REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(script: Path, tmp_path: Path, out: Path, *args: str, **env: str):
    """``script ARGS`` in a process of its own (BASE_VOCAB=20, no other TRAINING_PATCHES_*
    setting inherited): its completed process and what it saved at ``out``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    environ.update(PYTHONPATH=child_path(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   TRAINING_PATCHES_BASE_VOCAB="20", **env)
    proc = forkserver.run([sys.executable, str(script), *args], env=environ, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    return proc, (torch.load(out, weights_only=False) if out.exists() else None)


def _run(tmp_path: Path, stage: int, precision: str, *extra: str, **env: str):
    out = tmp_path / f"z{stage}_{precision}_{'_'.join(extra) or 'on'}.pt"
    return _job(JOB, tmp_path, out, str(stage), precision, str(_port()), str(out), *extra,
                **env)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "fp32")])
def test_the_base_rows_stay_bit_identical_through_the_fp32_masters(tmp_path, stage, precision):
    proc, both = _run(tmp_path, stage, precision, "onoff")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = both["on"]
    first, last = result["seen"][0], result["seen"][3]
    assert torch.equal(last["module"][:20], first["module"][:20])
    assert torch.equal(last["master"][:20], first["master"][:20])
    assert not torch.equal(last["module"][20:], first["module"][20:])  # the new rows train
    assert result["status"]["state"] == "applied"
    assert "put back in the fp32 master weights" in proc.stderr + proc.stdout
    # the control: the same run with the integration reverted trains the base rows
    first, last = both["off"]["seen"][0], both["off"]["seen"][3]
    assert (last["master"][:20] - first["master"][:20]).abs().max() > 1e-4


@pytest.mark.slow
@needs_deepspeed
def test_a_nan_step_under_zero1_bf16_is_skipped_exactly(tmp_path):
    """ZeRO-1 with bf16: the optimizer steps flattened fp32 master partitions. A NaN loss at
    step 2 is skipped by the guard on the inner optimizer's step, and the run ends with the
    module's every tensor equal to the run that never had that step (3 steps)."""
    proc, both = _run(tmp_path, 1, "bf16", "nanskip")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    nan, clean = both["nan"], both["skip"]
    assert nan["stats"]["skipped"] == 1 and nan["stats"]["steps"] == 4, nan["stats"]
    assert clean["stats"]["skipped"] == 0 and clean["stats"]["steps"] == 3, clean["stats"]
    assert [k for k in nan["state"] if not torch.equal(nan["state"][k], clean["state"][k])] == []
    assert all(bool(torch.isfinite(v).all()) for v in nan["state"].values())
    assert not torch.equal(nan["state"]["text_embedding.weight"][20:],
                           nan["seen"][0]["module"][20:])  # it trained


@pytest.mark.slow
@needs_deepspeed
def test_zero3_refuses_the_freeze_loudly(tmp_path):
    proc, result = _run(tmp_path, 3, "fp32")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["status"]["state"] == "degraded"
    assert any("ZeRO-3" in p and "NOTHING IS FROZEN" in p for p in result["status"]["problems"])
    proc, _ = _run(tmp_path, 3, "fp32", TRAINING_PATCHES_STRICT="1")
    assert proc.returncode != 0 and "VocabFreezeError" in proc.stderr


def test_the_engines_own_overflow_skip_is_recorded(tmp_path):
    """DeepSpeed's fp16 loss scaler skips a step by itself (``skipped_steps`` grows); fp16
    does not run on the CPU, so the engine here is a stand-in with the attributes the
    integration reads (the one thing mocked: a GPU's fp16 path)."""
    from patches import _run, nan_guard
    from patches.integrations.deepspeed import make_step

    nan_guard.reset()
    _run.set_output_dir(tmp_path)  # (another test's trainer folder may still be registered)

    class Engine:
        module = torch.nn.Linear(2, 2)
        skipped_steps, global_steps = 0, 7
        optimizer = type("Scaler", (), {"cur_scale": 512.0})()

        def zero_optimization_stage(self) -> int:
            return 0

        def bfloat16_enabled(self) -> bool:
            return False

        def fp16_enabled(self) -> bool:
            return True

        def step(self) -> None:  # the overflowing step: skipped, counted by the engine
            self.skipped_steps += 1

    engine = Engine()
    try:
        make_step(Engine.step)(engine)
    finally:
        _run.set_output_dir(None)
    events = (tmp_path / "nonfinite_events.jsonl").read_text().splitlines()
    assert len(events) == 1 and '"trainer_skip"' in events[0] and '"DeepSpeed"' in events[0]
    assert '"trainer_step": 7' in events[0]  # the engine's count when the step began
    assert nan_guard.stats()["skipped"] == 1


GROWN_JOB = Path(__file__).resolve().parent / "deepspeed_jobs" / "grown_job.py"


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("applied", [True, False], ids=["patched", "integration_off"])
def test_a_resume_into_a_grown_vocabulary_is_refused_with_the_path_that_works(tmp_path,
                                                                             applied):
    """ZeRO-1 bf16, the vocabulary grown 20 -> 24 after a DeepSpeed checkpoint:
    ``engine.load_checkpoint`` is refused in one paragraph naming what to do (upstream:
    torch's size mismatch, mid-load), and that path works: the consolidated weights loaded
    by the library before ``deepspeed.initialize`` keep every trained row, frozen
    (BASE_VOCAB=20) through 2 more steps, while the new rows train."""
    out = tmp_path / "grown.pt"
    proc, result = _job(GROWN_JOB, tmp_path, out, str(_port()), str(tmp_path / "ckpt"), str(out),
                        *([] if applied else ["off"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if not applied:
        assert "size mismatch for text_embedding.weight" in result["refusal"]
        return
    assert result["refusal"].startswith("CheckpointMismatchError: training-patches: the "
                                        "DeepSpeed checkpoint being loaded")
    assert "text_embedding.weight: checkpoint [20, 8], model [24, 8]" in result["refusal"]
    assert "patches.load_checkpoint(path, model) BEFORE deepspeed.initialize" in \
        result["refusal"]
    # the folder and tag named, and the file of the folder zero_to_fp32.py writes
    ckpt = tmp_path / "ckpt"
    assert f"being loaded ({ckpt}, the tag its 'latest' file names)" in result["refusal"]
    assert f"get_fp32_state_dict_from_zero_checkpoint('{ckpt}')" in result["refusal"]
    assert (f"`python {ckpt}/zero_to_fp32.py {ckpt} OUT` writes the same weights as "
            f"OUT/pytorch_model.bin: pass that file, not the folder OUT") in result["refusal"]
    assert "24" in result["script"], result["script"]  # that file loads, grown
    # the fp32 masters, whose bf16 copy the module was
    assert torch.equal(result["consolidated"].bfloat16().float(), result["saved"])
    assert torch.equal(result["start"][:20], result["consolidated"])  # every trained row
    after = result["after"]
    assert torch.equal(after[:20], result["consolidated"].bfloat16().float())  # kept, frozen
    assert not torch.equal(after[20:], result["start"][20:].bfloat16().float())  # new rows train
    assert "grown" in result["load"] or "24" in result["load"], result["load"]
