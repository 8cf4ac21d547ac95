"""Rank script (FSDP2, 2 shards): base-vocab freeze drift, ShardedGradScaler defaults, and a
refused layout.

    fsdp_freeze.py freeze OUT_DIR VOCAB   (TRAINING_PATCHES_BASE_VOCAB set by the test)
    fsdp_freeze.py freeze_cols OUT_DIR fsdp2|tp  (column-sharded embedding and head weight)
    fsdp_freeze.py scaler OUT_DIR
    fsdp_freeze.py refuse OUT_DIR
"""

import patches.auto  # noqa: F401  (first, as users write it)

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import patches
from patches.vocab_freeze import VocabFreezeError
from tiny_gpt import TinyGPT, batch, loss_of, end_job, shard

what, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
result: dict = {}

if what == "freeze":
    vocab = int(sys.argv[3])
    torch.manual_seed(0)
    model = shard(TinyGPT(vocab=vocab))
    names = ("text_embedding.weight", "text_head.weight", "text_head.bias")
    params = dict(model.named_parameters())
    before = {n: params[n].full_tensor().clone() for n in names}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(10):
        opt.zero_grad()
        loss_of(model, batch(generator, vocab=vocab)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    after = {n: params[n].full_tensor() for n in names}
    result = {"before": before, "after": after}
elif what == "freeze_cols":
    # Column-sharded (Shard(1)) text embedding and head weight: FSDP2 with a placement
    # function, or tensor parallelism (ColwiseParallel embedding, RowwiseParallel head)
    from torch.distributed.tensor import Replicate, Shard
    layout = sys.argv[3]
    torch.manual_seed(0)
    model = TinyGPT()
    if layout == "fsdp2":
        def columns(param: torch.nn.Parameter) -> Shard:
            return Shard(1) if param.dim() == 2 else Shard(0)
        for module in (model.text_embedding, model.text_head):
            fully_shard(module, shard_placement_fn=columns)
        fully_shard(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, RowwiseParallel, parallelize_module)
        parallelize_module(model, init_device_mesh("cpu", (2,)), {
            "text_embedding": ColwiseParallel(output_layouts=Replicate()),
            "text_head": RowwiseParallel(input_layouts=Replicate())})
    names = ("text_embedding.weight", "text_head.weight", "text_head.bias")
    params = dict(model.named_parameters())
    result["placements"] = {n: [str(p) for p in params[n].placements] for n in names}
    before = {n: params[n].full_tensor().clone() for n in names}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(0 if layout == "tp" else rank)  # TP: one batch
    try:
        for _ in range(10):
            opt.zero_grad()
            loss_of(model, batch(generator)).backward()
            if layout == "fsdp2":  # TP leaves the block plain: no one total norm (torch's)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        result["error"] = None
    except VocabFreezeError as exc:
        result["error"] = str(exc)
    result.update(before=before, after={n: params[n].full_tensor() for n in names})
elif what == "scaler":
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    scaler = ShardedGradScaler("cpu")
    result = {"type": type(scaler).__name__, "scale": scaler.get_scale(),
              "sharded": isinstance(scaler, ShardedGradScaler)}
    torch.manual_seed(0)
    model = TinyGPT()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    try:
        for step in range(4):
            opt.zero_grad()
            loss = loss_of(model, batch(generator))
            if step == 2 and rank == 0:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        result["stats"] = scaler.stats()
    except Exception as exc:  # noqa: BLE001 - reported to the test as what cannot run on CPU
        result["step_error"] = f"{type(exc).__name__}: {exc}"
elif what == "refuse":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    mesh = init_device_mesh("cpu", (2,))
    model = TinyGPT()
    head = model.text_head
    head.weight = torch.nn.Parameter(DTensor.from_local(head.weight.detach(), mesh, [Partial()]))
    try:
        patches.advanced.freeze_base_vocab(model, 64)
        result["error"] = None
    except VocabFreezeError as exc:
        result["error"] = str(exc)
torch.save(result, os.path.join(out, f"result{rank}.pt"))
end_job(globals())
