"""Rank script: the collectives of a DDP step, unpatched and patched (issue 41), and what
the guard does when the flag it carries in the gradient reduction is not enough.

    ddp_collectives.py OUT_DIR count [foreach|fused]   counts, a NaN loss on rank 0
    ddp_collectives.py OUT_DIR userhook                the user's own comm hook: fallback
    ddp_collectives.py OUT_DIR edit                    rank 1 edits its gradient after the
                                                       reduction: both ranks stop, named

Writes OUT_DIR/result<rank>.pt. Collectives are counted as torch's profiler sees them (every
``c10d::`` operation: DDP's bucket all-reduces, the guard's agreement, any other).
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import patches
from patches import _run, nan_guard
from patches.advanced import NonFiniteTrainingError
from tiny_gpt import TinyGPT, batch, end_job, full_state, loss_of, read_events

out, mode = sys.argv[1], sys.argv[2]
variant = sys.argv[3] if len(sys.argv) > 3 else "foreach"
dist.init_process_group("gloo")
rank = dist.get_rank()
patches.revert()

torch.manual_seed(0)
# small buckets: several all-reduces a step, the first of them carries the flags
model = torch.nn.parallel.DistributedDataParallel(TinyGPT(), bucket_cap_mb=0.005)
if mode == "userhook":
    model.register_comm_hook(None, default_hooks.allreduce_hook)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                        foreach=variant == "foreach", fused=variant == "fused" or None)
generator = torch.Generator().manual_seed(100 + rank)


def step(nan_loss_rank: int | None = None, edit_rank: int | None = None) -> None:
    opt.zero_grad()
    loss = loss_of(model, batch(generator))
    if nan_loss_rank == rank:
        loss = loss * float("nan")
    loss.backward()
    if edit_rank == rank:  # after the reduction, on this rank alone
        model.module.text_head.weight.grad[0, 0] = float("nan")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def collectives(steps: int, **kwargs: int) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(**kwargs)
    return sum(1 for event in prof.events() if event.name.startswith("c10d::"))


result: dict = {}
step()
step()  # DDP rebuilds its buckets after the first step
result["unpatched"] = collectives(4)
_run.set_output_dir(os.path.join(out, f"rank{rank}"))
patches.advanced.apply(quiet=True)  # every default patch
step()  # the guard's first step under DDP: finds the DDP module, registers its hook
result["patched"] = collectives(4)
carrier = getattr(model, "_training_patches_carrier", None)
if carrier is not None:  # which bucket carried the flags, and every bucket's size
    result["carry_at"], result["sizes"] = carrier.carry_at, dict(carrier._sizes)
if mode in ("count", "userhook"):
    before = full_state(model)
    result["nan_step"] = collectives(1, nan_loss_rank=0)
    after = full_state(model)
    result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    step()
elif mode == "edit":
    step(edit_rank=1)  # rank 1 skips, rank 0 steps: the replicas differ from here
    try:
        step()
    except NonFiniteTrainingError as exc:
        result["raised"] = str(exc)
nan_guard.settle()
result["stats"] = nan_guard.stats()
if mode == "count":  # the carried flags change no gradient: the same weights, bit for bit
    weights = {}
    for patched in (False, True):
        patches.revert()
        if patched:
            patches.advanced.apply(quiet=True)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(TinyGPT(), bucket_cap_mb=0.005)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                foreach=variant == "foreach", fused=variant == "fused" or None)
        generator = torch.Generator().manual_seed(200 + rank)
        for _ in range(4):
            step()
        weights[patched] = full_state(model)
    result["same_weights"] = all(torch.equal(weights[False][k], weights[True][k])
                                 for k in weights[False])
result["events"] = read_events(os.path.join(out, f"rank{rank}"))
result["params"] = full_state(model)
patches.revert()
torch.save(result, os.path.join(out, f"result{rank}.pt"))
end_job(globals())
