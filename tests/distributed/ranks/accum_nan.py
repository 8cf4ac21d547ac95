"""Rank script: gradient accumulation (4 micro-batches a step) with a NaN loss in single
micro-batches of one rank, under DDP (with ``no_sync`` for the non-final micro-batches, as
users write it, or syncing every micro-batch) or FSDP2 (``set_requires_gradient_sync``);
then the same run with those micro-batches contributing exactly nothing (reference).

    accum_nan.py ddp_nosync|ddp_sync|fsdp2 OUT_DIR

Writes OUT_DIR/result<rank>.pt: the guard's stats, this rank's events and the full
parameters of the guarded run and of the reference run.
"""

import patches.auto  # noqa: F401  (first, as users write it)

import contextlib
import os
import sys

import torch
import torch.distributed as dist

from patches import _run, nan_guard
from tiny_gpt import TinyGPT, batch, end_job, full_state, loss_of, read_events, shard

STEPS, ACCUM = 9, 4
# (optimizer step, micro-batch, rank) whose loss is NaN: a no_sync micro-batch, the final
# (synced) one, the first one of a step, one on each rank in the same step, and at step
# ALL_BAD every micro-batch of every rank (the step then leaves every parameter as it was)
ALL_BAD = 8
BAD = {(3, 1, 1), (5, 3, 1), (6, 0, 0), (7, 2, 0), (7, 3, 1)} | {
    (ALL_BAD, micro, r) for micro in range(ACCUM) for r in range(2)}

mode, out = sys.argv[1], sys.argv[2]
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
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def sync(model: torch.nn.Module, final: bool) -> contextlib.AbstractContextManager:
    if mode == "ddp_nosync" and not final:
        return model.no_sync()
    if mode == "fsdp2":
        model.set_requires_gradient_sync(final)
    return contextlib.nullcontext()


def train(inject: bool) -> torch.nn.Module:
    model, opt = build()
    generator = torch.Generator().manual_seed(100 + rank)
    current: list[torch.Tensor] = []
    if mode != "fsdp2":
        # As the coqui integration does: the guard may re-run a bad batch on this rank
        # alone through the bare module (no DDP forward) to name where the NaN started;
        # here the re-run is finite (a NaN that does not come back), so its backward
        # reaches every parameter, where DDP's gradient hooks are.
        bare = model.module
        nan_guard.set_replay(lambda: nan_guard.find_nonfinite_source(
            bare, lambda: loss_of(bare, current[0])))
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        for micro in range(ACCUM):
            with sync(model, final=micro == ACCUM - 1):
                current[:] = [batch(generator)]
                loss = loss_of(model, current[0]) / ACCUM
                if (step, micro, rank) in BAD:
                    # the reference: the same backward (the same communication), adding 0
                    loss = loss * (float("nan") if inject else 0.0)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if inject or step != ALL_BAD:  # the reference: no optimizer step at all there
            opt.step()
    return model


guarded = full_state(train(inject=True))
stats = nan_guard.stats()
events = read_events(os.path.join(out, f"rank{rank}"))
nan_guard.reset()
reference = full_state(train(inject=False))
torch.save({"stats": stats, "events": events, "guarded": guarded, "reference": reference},
           os.path.join(out, f"result{rank}.pt"))
end_job(globals())
