"""Rank script: the collectives of a DDP loss-scaled (fp16-style) step, a plain GradScaler
against SafeGradScaler (issue 41), and where the scaler still needs its own all-reduce.

    ddp_scaler_collectives.py OUT_DIR count [foreach|fused]  counts; overflows on rank 0
    ddp_scaler_collectives.py OUT_DIR fallback               all-reduce kept: a parameter
                                                            outside DDP, a step of no_sync
                                                            backwards only, the user's hook
    ddp_scaler_collectives.py OUT_DIR edit [foreach|fused]   rank 1 edits its gradient after
                                                            the reduction: both ranks stop

Writes OUT_DIR/result<rank>.pt. Collectives are counted as torch's profiler sees them (every
``c10d::`` operation: DDP's bucket all-reduces, the scaler's agreement, any other). The
scaler is torch's GradScaler on the CPU ("cpu": the same unscale and skip as on a GPU).
"""

import contextlib
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import patches
from patches import _run
from sync_count import count_host_reads
from tiny_gpt import VOCAB, TinyGPT, batch, end_job, full_state, loss_of

out, mode = sys.argv[1], sys.argv[2]
variant = sys.argv[3] if len(sys.argv) > 3 else "foreach"
dist.init_process_group("gloo")
rank = dist.get_rank()
_run.set_output_dir(os.path.join(out, f"rank{rank}"))
patches.revert()
NAN = float("nan")
poison = [False]  # a NaN written into a gradient BEFORE the reduction, on this rank


def build(hook: bool = False, outside: bool = False):
    torch.manual_seed(0)
    # small buckets: several all-reduces a step
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(), bucket_cap_mb=0.005)
    model.module.block[0].weight.register_hook(
        lambda grad: grad * NAN if poison[0] else grad)
    if hook:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    extra = torch.nn.Parameter(torch.zeros(VOCAB))
    params = list(model.parameters()) + ([extra] if outside else [])
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=variant == "foreach",
                            fused=variant == "fused" or None)
    return model, opt, extra


def step(model, opt, scaler, extra=None, *, nan_loss: bool = False, before: bool = False,
         after: bool = False, outside: bool = False, micro: int = 1,
         synced: bool = True) -> None:
    """One optimizer step of ``micro`` micro-batches (all but the last under no_sync; the
    last too unless ``synced``); the faults on this rank: a NaN loss, a NaN gradient before
    the reduction, after it, or in the parameter outside DDP."""
    opt.zero_grad()
    for i in range(micro):
        last = i == micro - 1
        with model.no_sync() if not (last and synced) else contextlib.nullcontext():
            loss = loss_of(model, batch(generator))
            if extra is not None:  # a parameter of the optimizer that DDP does not hold
                loss = loss + (extra * extra).sum()
            if nan_loss:
                loss = loss * NAN
            poison[0] = before
            scaler.scale(loss).backward()
            poison[0] = False
    if after:  # after the reduction, on this rank alone
        model.module.text_head.weight.grad[0, 0] = NAN
    if outside:
        extra.grad[0] = NAN
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
    scaler.step(opt)
    scaler.update()


def collectives(run, steps: int = 1) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    return sum(1 for event in prof.events() if event.name.startswith("c10d::"))


def make_scaler():
    return torch.amp.GradScaler("cpu", init_scale=1024.0)


def counts(hook: bool = False, outside: bool = False) -> dict:
    """Collectives of 4 steps unpatched (torch's GradScaler, nothing applied) and patched
    (every default patch: SafeGradScaler), each on its own model (``hook``: the user's comm
    hook on it; ``outside``: a parameter of the optimizer outside DDP), and the host reads
    of one more step."""
    global generator
    found = {}
    for patched in (False, True):
        patches.advanced.apply(quiet=True) if patched else patches.revert()
        model, opt, extra = build(hook, outside)
        scaler = make_scaler()
        assert type(scaler).__name__ == ("SafeGradScaler" if patched else "GradScaler")
        generator = torch.Generator().manual_seed(100 + rank)
        kwargs = {"extra": extra if outside else None}
        for _ in range(2):  # DDP rebuilds its buckets after the first step; the scaler
            step(model, opt, scaler, **kwargs)  # finds the DDP module at its first
        found["patched" if patched else "unpatched"] = collectives(
            lambda: step(model, opt, scaler, **kwargs), 4)
        with pytest.MonkeyPatch.context() as monkeypatch:
            reads = count_host_reads(monkeypatch)
            step(model, opt, scaler, **kwargs)
        found["reads" if patched else "plain_reads"] = reads[0]
        found["model" if patched else "plain_model"] = model
        found["opt" if patched else "plain_opt"] = opt
        found["scaler" if patched else "plain_scaler"] = scaler
        found["extra" if patched else "plain_extra"] = extra
    return found


result: dict = {}
if mode == "count":
    found = counts()
    result["unpatched"], result["patched"] = found["unpatched"], found["patched"]
    result["reads"] = (found["plain_reads"], found["reads"])
    # the carried flags change no gradient: the weights of the plain run, bit for bit
    plain_state = full_state(found["plain_model"])
    result["same_weights"] = all(torch.equal(plain_state[k], value)
                                 for k, value in full_state(found["model"]).items())
    model, opt, scaler = found["model"], found["opt"], found["scaler"]
    result["scaler_class"] = type(scaler).__name__
    # A rank that overflows alone: a NaN gradient before the reduction, a NaN loss (both on
    # rank 0): the reduction spreads it, every rank skips, no collective of the scaler's.
    for name, faults in (("before", dict(before=rank == 0)),
                         ("nan_loss", dict(nan_loss=rank == 0))):
        before_state = full_state(model)
        result[name] = collectives(lambda: step(model, opt, scaler, **faults))
        result[name + "_unchanged"] = all(
            torch.equal(before_state[k], value) for k, value in full_state(model).items())
    # Accumulation as users write it: no_sync micro-batches, then a synced one that reduces
    # the whole accumulated gradient: still none of the scaler's own.
    plain_model, plain_opt, plain = found["plain_model"], found["plain_opt"], found["plain_scaler"]
    patches.revert()
    result["accum_unpatched"] = collectives(lambda: step(plain_model, plain_opt, plain, micro=3))
    patches.advanced.apply(quiet=True)
    result["accum_patched"] = collectives(lambda: step(model, opt, scaler, micro=3))
    step(model, opt, scaler)
    result["stats"] = scaler.stats()
    result["scale"] = scaler.get_scale()
    result["params"] = full_state(model)
elif mode == "fallback":
    # A parameter of the optimizer outside DDP: its gradient is this rank's own, so the
    # scaler all-reduces its flag (one collective a step), and rank 0's overflow there alone
    # is skipped by both ranks.
    found = counts(outside=True)
    result["outside"] = (found["unpatched"], found["patched"])
    model, opt, scaler, extra = found["model"], found["opt"], found["scaler"], found["extra"]
    before_state = full_state(model)
    step(model, opt, scaler, extra, outside=rank == 0)
    result["outside_unchanged"] = all(
        torch.equal(before_state[k], value) for k, value in full_state(model).items())
    result["outside_params"] = full_state(model)
    # A step whose backwards all ran under no_sync (nothing reduced): the scaler's own
    # all-reduce, and rank 0's overflow skipped by both ranks.
    model, opt, _ = build()
    scaler = make_scaler()
    for _ in range(2):
        step(model, opt, scaler)
    result["nosync_synced"] = collectives(lambda: step(model, opt, scaler))
    result["nosync_only"] = collectives(lambda: step(model, opt, scaler, before=rank == 0,
                                                     synced=False))
    result["nosync_stats"] = scaler.stats()
    # The user's own comm hook: DDP allows one, so the scaler keeps its all-reduce.
    found = counts(hook=True)
    result["userhook"] = (found["unpatched"], found["patched"])
elif mode == "edit":
    patches.advanced.apply(quiet=True)
    model, opt, _ = build()
    # log_interval 1: a fused step's agreement is read with the stats line (no read a step)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, log_interval=1)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        step(model, opt, scaler)
    step(model, opt, scaler, after=rank == 1)  # rank 1 skips, rank 0 steps
    try:
        step(model, opt, scaler)
    except FloatingPointError as exc:  # grad_scaler.RanksDivergedError
        result["raised"] = f"{type(exc).__name__}: {exc}"
patches.revert()
torch.save(result, os.path.join(out, f"result{rank}.pt"))
end_job(globals())
