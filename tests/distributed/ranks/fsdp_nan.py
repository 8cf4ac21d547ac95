"""Rank script: a NaN loss on rank 0 and a NaN gradient on rank 1 at known steps, under DDP
or FSDP2, AdamW with weight decay; then the same run with those steps left out (reference).

    fsdp_nan.py ddp|fsdp2 OUT_DIR [foreach|forloop|fused]

Writes OUT_DIR/result<rank>.pt: the guard's stats, this rank's events, the full parameters
of the guarded run and of the reference run.
"""

import patches.auto  # noqa: F401  (first, as users write it)

import os
import sys

import torch
import torch.distributed as dist

from patches import _run, grad_clip, nan_guard
from tiny_gpt import TinyGPT, batch, end_job, full_state, loss_of, read_events, shard

STEPS = 12
NAN_LOSS = {3: 0, 8: 0}  # step -> the rank whose loss is NaN
# step -> the rank whose gradient is NaN: after the sync under FSDP2 (its own shard); under
# DDP before it (a tensor hook): after it, one rank's edit would make the ranks decide
# differently, since the guard carries no gradient flag in DDP's reduction (issue 41;
# tests/distributed/test_ddp_collectives.py stops that case, named)
NAN_GRAD = {5: 1, 10: 1}

mode, out = sys.argv[1], sys.argv[2]
variant = sys.argv[3] if len(sys.argv) > 3 else "foreach"
dist.init_process_group("gloo")
rank = dist.get_rank()
_run.set_output_dir(os.path.join(out, f"rank{rank}"))


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT()
    if mode == "fsdp2":
        shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    kwargs = {"foreach": variant == "foreach", "fused": variant == "fused" or None}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)


def train(inject: bool) -> torch.nn.Module:
    model, opt = build()
    generator = torch.Generator().manual_seed(100 + rank)
    poison = [False]
    if mode == "ddp":
        def before_the_sync(grad: torch.Tensor) -> torch.Tensor:
            if poison[0]:
                grad = grad.clone()
                grad[0, 0] = float("nan")
            return grad
        model.module.text_head.weight.register_hook(before_the_sync)
    for step in range(1, STEPS + 1):
        tokens = batch(generator)
        bad_step = step in NAN_LOSS or step in NAN_GRAD
        if bad_step and not inject:
            continue  # the reference: this step never happened
        opt.zero_grad()
        loss = loss_of(model, tokens)
        if inject and NAN_LOSS.get(step) == rank:
            loss = loss * float("nan")
        poison[0] = inject and NAN_GRAD.get(step) == rank
        loss.backward()
        if inject and NAN_GRAD.get(step) == rank and mode == "fsdp2":
            local = model.text_head.weight.grad.to_local()
            local[0, 0] = float("nan")  # this rank's own shard only
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model


guarded = full_state(train(inject=True))
stats = nan_guard.stats()
clip = grad_clip.stats()
events = read_events(os.path.join(out, f"rank{rank}"))
reference = full_state(train(inject=False))
torch.save({"stats": stats, "clip": clip, "events": events, "guarded": guarded,
            "reference": reference}, os.path.join(out, f"result{rank}.pt"))
end_job(globals())
