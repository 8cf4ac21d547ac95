"""Rank script (FSDP2, 2 shards, DTensor gradients): the patched clip_grad_norm_ against
torch's own on the same gradients.

    fsdp_clip.py plain OUT_DIR          torch's clip on the same DTensor gradients
    fsdp_clip.py unscale_first OUT_DIR  TRAINING_PATCHES_CLIP_UNSCALE_FIRST=1 (set by the
                                        test): scaled gradients of a SafeShardedGradScaler
                                        against torch's clip of the true (unscaled) ones
    fsdp_clip.py nonfinite OUT_DIR      a NaN in rank 1's shard: the norm is non-finite on
                                        both ranks and no gradient is touched

Writes OUT_DIR/result<rank>.pt: the norms (full values), this rank's gradient shards after
the patched clip and after torch's, and the clip's counters.
"""

import patches.auto  # noqa: F401  (first, as users write it)

import os
import sys

import torch
import torch.distributed as dist

from patches import _registry, grad_clip
from tiny_gpt import TinyGPT, batch, loss_of, end_job, shard

MAX_NORM = 0.05  # well below the gradients' norm: every gradient is clipped
what, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch_clip = _registry.original("torch.nn.utils", "clip_grad_norm_")
assert torch_clip is not torch.nn.utils.clip_grad_norm_  # the patch is on

torch.manual_seed(0)
model = shard(TinyGPT())
params = [p for p in model.parameters()]
loss = loss_of(model, batch(torch.Generator().manual_seed(rank)))
scale = 1.0
if what == "unscale_first":
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    scaler = ShardedGradScaler("cpu")
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
else:
    loss.backward()
if what == "nonfinite" and rank == 1:
    params[-1].grad.to_local().view(-1)[0] = float("nan")  # this rank's shard only


def shadows(divide_by: float) -> list[torch.Tensor]:
    """Leaves holding copies of the gradients (divided by the loss scale): torch's clip
    runs on them, the model's own gradients are left to the patched clip."""
    copies = []
    for p in params:
        q = p.detach().clone().requires_grad_(True)
        q.grad = p.grad.detach().clone() / divide_by
        copies.append(q)
    return copies


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


before = [p.grad.to_local().clone() for p in params]
reference = shadows(scale)
torch_norm = torch_clip(reference, MAX_NORM)
patched_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
result = {
    "types": sorted({type(p.grad).__name__ for p in params}),
    "scale": scale,
    "torch_norm": full(torch_norm).item(),
    "patched_norm": full(patched_norm).item(),
    "patched_norm_type": type(patched_norm).__name__,
    "before": before,
    "patched": [p.grad.to_local().clone() for p in params],
    "torch": [q.grad.to_local().clone() for q in reference],
    "clip": grad_clip.stats(),
}
torch.save(result, os.path.join(out, f"result{rank}.pt"))
end_job(globals())
