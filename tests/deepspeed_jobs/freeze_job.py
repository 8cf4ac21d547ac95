"""One DeepSpeed process on the CPU (gloo): a tiny text model whose vocabulary grew from 20 to
24 tokens, TRAINING_PATCHES_BASE_VOCAB=20, 4 steps of the engine.

    freeze_job.py STAGE fp32|bf16 PORT OUT [off|nan|skip|nanskip|onoff]

``off``: the deepspeed integration reverted (the control). ``nan``: the loss of step 2 is
NaN. ``skip``: step 2 is left out (3 steps: the run a skipped NaN step must equal).
``nanskip``: both, one after the other in this process (OUT holds ``nan`` and ``skip``);
``onoff``: the run, then the control (``on`` and ``off``). Writes
OUT (torch.save): the module's and the fp32 masters' text embedding after step 1 and after
the last step, the module's final state dict, patches.status("vocab_freeze") and the
guard's counters."""

import patches.auto  # noqa: F401  (first, as users write it)

import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[3])

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import patches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import TinyTextModel  # noqa: E402

stage, precision, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "on"
if mode == "off":
    patches.revert(["deepspeed"])
# DeepSpeed's shared-memory all-reduce for CPU ranks is a C++ op it compiles on first use
# (about 30 s on a fresh machine, and a compiler needed); one process never all-reduces
# through it, and nothing here depends on it.
# (deepspeed.comm.torch is shadowed by the torch library on the package: read sys.modules)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")


def run(mode: str) -> dict:
    """One engine's 4 steps (3 with ``skip``) from the same start; what OUT holds."""
    torch.manual_seed(0)
    model = TinyTextModel(24, 8, "tanh")
    config = {"train_batch_size": 2,
              "optimizer": {"type": "AdamW",
                            "params": {"lr": 1e-2, "torch_adam": True, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    seen = {}
    steps = [s for s in range(4) if not (mode == "skip" and s == 1)]
    for step in steps:
        loss = engine(torch.arange(24)).float().logsumexp(-1).mean()
        if mode == "nan" and step == 1:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        if step in (0, steps[-1]):
            weight = engine.module.text_embedding.weight
            master = (safe_get_full_fp32_param(weight) if stage > 0 or precision != "fp32"
                      else None)
            seen[len(seen) and 3] = {"module": weight.detach().float().clone(),
                                     "master": None if master is None else master.detach().clone()}
    return {"seen": seen, "status": patches.status("vocab_freeze"),
            "state": {k: v.float().clone() for k, v in engine.module.state_dict().items()},
            "stats": dict(patches.stats()["nan_guard"])}


if mode == "nanskip":  # the NaN run, then the run without that step, one process
    result = {"nan": run("nan")}
    patches.advanced.reset_runtime_state()
    result["skip"] = run("skip")
elif mode == "onoff":  # the run, then the control with the integration reverted
    result = {"on": run("on")}
    patches.revert(["deepspeed"])
    result["off"] = run("off")
else:
    result = run(mode)
torch.save(result, out)
