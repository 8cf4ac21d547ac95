"""One rank of the DDP NaN-guard test (spawned by tests/test_nan_guard_ddp.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def worker(rank: int, world: int, port: int, out_dir: str, inject: list[int],
           scaler: bool = False) -> None:
    """30 steps of a DDP model, a NaN written into rank 0's gradient at the ``inject`` steps,
    before the all-reduce (a tensor hook); ``scaler``: through a (patched)
    ``torch.amp.GradScaler("cpu")``. The guard and the scaler both agree through DDP's
    reduction (issue 41), so a gradient one rank alone edits after it is stopped, not agreed
    (tests/distributed/test_ddp_collectives.py, test_ddp_scaler_collectives.py)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import patches
        from patches import nan_guard

        nan_guard.reset()
        patches.advanced.apply(["nan_guard", "grad_scaler"] if scaler else ["nan_guard"], output_dir=os.path.join(out_dir, f"rank{rank}"), quiet=True)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        amp = torch.amp.GradScaler("cpu", init_scale=256.0) if scaler else None
        torch.manual_seed(100 + rank)  # each rank its own data
        poison = [False]

        def before_the_reduction(grad: torch.Tensor) -> torch.Tensor:
            if poison[0]:
                grad = grad.clone()
                grad[0, 0] = float("nan")
            return grad
        model.module[0].weight.register_hook(before_the_reduction)
        for step in range(1, 31):
            opt.zero_grad()
            x = torch.randn(16, 8)
            loss = model(x).pow(2).mean()
            poison[0] = rank == 0 and step in inject  # on one rank only
            (amp.scale(loss) if amp else loss).backward()  # gradients are all-reduced here
            if amp:
                amp.step(opt)
                amp.update()
            else:
                opt.step()
        from patches import _ddp

        _ddp._drain_at_exit()  # what the exit does: every reduction's callback freed
        torch.save({"params": [p.detach() for p in model.parameters()],
                    "callbacks_live": _ddp._live, "drain_registered": _ddp._drain_registered,
                    "stats": patches.stats()["nan_guard"],
                    "scaler": ({**amp.stats(), "scale": amp.get_scale(),
                                "class": type(amp).__name__} if amp else None)},
                   os.path.join(out_dir, f"result{rank}.pt"))
    finally:
        dist.destroy_process_group()
    from processes import exit_after_atexit

    exit_after_atexit()  # done and written: no interpreter teardown (gloo's abort at exit)
