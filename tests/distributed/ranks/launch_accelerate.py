"""One rank of an ``accelerate launch`` job (run by test_launch_accelerate.py): a plain loop
through ``Accelerator.backward`` and ``accelerator.clip_grad_norm_`` on the tiny GPT, one
NaN loss on rank 1 only, then a ``save_state``/``load_state`` round trip.

    launch_accelerate.py OUT ddp|fsdp2 [--plain]

``--plain``: without ``import patches.auto`` (the feature-off run). Writes
``OUT/rank<R>.pt``: the full parameters, the guard's counters and what the rank saw.
On the CPU accelerate runs MULTI_CPU (DDP over gloo) and ignores an FSDP plugin: ``fsdp2``
is FSDP2 only where GPUs are (benchmarks/gpu/test_gpu_multi.py).
"""

from __future__ import annotations

import sys

if "--plain" not in sys.argv:
    import patches.auto  # noqa: F401  (the one line, first)

import os

import torch
from accelerate import Accelerator

from tiny_gpt import TinyGPT, batch, loss_of

NAN_AT = 3  # the step whose loss is NaN on rank 1 only
SAVE_AT = 5  # save_state after this step
STEPS = 6

out, mode = sys.argv[1], sys.argv[2]
kwargs = {}
if mode == "fsdp2":
    from accelerate.utils import FullyShardedDataParallelPlugin

    kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2)
accelerator = Accelerator(cpu=not torch.cuda.is_available(), **kwargs)
rank = accelerator.process_index
torch.manual_seed(0)
model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data


def full_params() -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for p in model.parameters()]


def step(tokens: torch.Tensor, nan: bool = False) -> None:
    loss = loss_of(model, tokens.to(accelerator.device))
    if nan:
        loss = loss * float("nan")
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


seen: dict[str, object] = {"world": accelerator.num_processes,
                           "type": str(accelerator.distributed_type),
                           "scaler": type(accelerator.scaler).__name__}
for i in range(1, STEPS + 1):
    before = full_params()
    step(batch(generator), nan=(i == NAN_AT and rank == 1))
    if i == NAN_AT:  # a skipped step leaves every parameter as it was
        seen["nan_step_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, full_params()))
    if i == SAVE_AT:
        state = os.path.join(out, "state")
        accelerator.save_state(state)
        saved = full_params()
        later = [batch(generator) for _ in range(2)]
        for tokens in later:
            step(tokens)
        continued = full_params()
        accelerator.load_state(state)
        seen["load_restores"] = all(torch.equal(a, b) for a, b in zip(saved, full_params()))
        for tokens in later:  # the same two steps again, from the restored state
            step(tokens)
        seen["replay_equal"] = all(torch.equal(a, b) for a, b in zip(continued, full_params()))

patches_module = sys.modules.get("patches")
stats = patches_module.stats().get("nan_guard", {}) if patches_module else {}
torch.save({"params": full_params(), "stats": dict(stats), **seen},
           os.path.join(out, f"rank{rank}.pt"))
accelerator.wait_for_everyone()
accelerator.end_training()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
# Everything the test reads is written. Leave without the interpreter's teardown: a rank
# that tore down its gloo group with the model still alive aborted now and then at exit
# ("terminate called without an active exception", 2 of 20 runs), after all its work.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
