"""One DeepSpeed process on the CPU (gloo), ZeRO-1 bf16: a resume into a vocabulary grown from
20 to 24 tokens after a DeepSpeed checkpoint.

    grown_job.py PORT WORKDIR OUT [off]

Trains 2 steps at 20 tokens and saves (``engine.save_checkpoint``); builds the model at 24
tokens and calls ``engine.load_checkpoint`` on it (the refusal is recorded); then takes the
path the refusal names: the consolidated fp32 weights (``zero_to_fp32``) loaded with
``patches.load_checkpoint`` before ``deepspeed.initialize``, and 2 more steps.
``off``: the deepspeed integration reverted (the control: it stops after the load). Writes
OUT (torch.save)."""

import patches.auto  # noqa: F401  (first, as users write it)

import copy
import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils.zero_to_fp32 import (  # noqa: E402
    convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint)

import patches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import TinyTextModel  # noqa: E402

work, out = Path(sys.argv[2]), Path(sys.argv[3])
if len(sys.argv) > 4 and sys.argv[4] == "off":
    patches.revert(["deepspeed"])
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # see freeze_job
deepspeed.init_distributed(dist_backend="gloo")
CONFIG = {"train_batch_size": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
          "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}


def engine_of(model):
    # a copy each time: initialize pops "torch_adam" from the config it is given, and a
    # second engine built from the same dict compiled DeepSpeed's FusedAdam (30 s)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=copy.deepcopy(CONFIG))
    return engine


def train(engine, steps: int, tokens: int) -> None:
    for _ in range(steps):
        loss = engine(torch.arange(tokens)).float().logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()


torch.manual_seed(0)
first = engine_of(TinyTextModel(20, 8, "tanh"))
train(first, 2, 20)
first.save_checkpoint(str(work), tag="step2")
saved = first.module.text_embedding.weight.detach().float().clone()

torch.manual_seed(1)
grown = engine_of(TinyTextModel(24, 8, "tanh"))
try:
    grown.load_checkpoint(str(work))
    refusal = None
except Exception as exc:  # noqa: BLE001 - recorded: what the user would read
    refusal = f"{type(exc).__name__}: {exc}"

if len(sys.argv) > 4 and sys.argv[4] == "off":  # the control shows upstream's error only
    torch.save({"refusal": refusal}, out)
    sys.exit(0)

# the path the refusal names: consolidated weights into the grown model, then initialize
state = get_fp32_state_dict_from_zero_checkpoint(str(work), tag="step2")
torch.save({"model": state}, work / "consolidated.pt")
model = TinyTextModel(24, 8, "tanh")
report = patches.load_checkpoint(work / "consolidated.pt", model)
# the script's way (zero_to_fp32.py LOAD_DIR OUT): a folder; the refusal names its file
convert_zero_checkpoint_to_fp32_state_dict(str(work), str(work / "fp32"), tag="step2")
script = patches.load_checkpoint(work / "fp32" / "pytorch_model.bin",
                                 TinyTextModel(24, 8, "tanh")).summary()
start = model.text_embedding.weight.detach().float().clone()
engine = engine_of(model)
train(engine, 2, 24)
torch.save({"refusal": refusal, "saved": saved, "consolidated": state["text_embedding.weight"],
            "start": start, "after": engine.module.text_embedding.weight.detach().float().clone(),
            "load": report.summary(), "script": script}, out)
