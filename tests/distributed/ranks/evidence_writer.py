"""A rank of the evidence job: DDP over the tiny GPT with a NaN loss on rank 0 at optimizer
step 3 (the real NaN guard), then out-of-memory batches (the real oom_guard) and dropped
samples (the real dataset guard) written by every rank at once.

argv: OUT_DIR N_OOM N_DROPPED [REPORT_DIR]: the evidence goes to REPORT_DIR (default
OUT_DIR; one that cannot be written tests that training goes on regardless).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import patches
from patches import _run, dataset_guard, nan_guard, oom_guard
from processes import exit_after_atexit
from tiny_gpt import TinyGPT, batch, loss_of

NAN_STEP = 3


def main() -> None:
    out, n_oom, n_dropped = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    report_dir = sys.argv[4] if len(sys.argv) > 4 else out
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    patches.advanced.apply()
    _run.set_output_dir(report_dir)
    torch.manual_seed(0)
    model = DDP(TinyGPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, 7):
        loss = loss_of(model, batch(gen))
        if rank == 0 and step == NAN_STEP:
            loss = loss * math.nan
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    # every rank writes at the same time: out-of-memory batches and dropped samples
    for i in range(n_oom):
        batch_of = {"filenames": [f"r{rank}_b{i}_{j}.wav" for j in range(2)],
                    "text_inputs": torch.zeros(2, 5)}
        oom_guard.on_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"),
                         batch_of, [opt], step=i)
        oom_guard.on_success()
    for i in range(n_dropped):
        sample = {"audio_file": f"r{rank}_{i}.wav", "text": "x", "language": "en"}
        dataset_guard.record_drop(dataset_guard.report_path(),
                                  dataset_guard.sample_key("train", sample),
                                  {"split": "train", "audio_file": sample["audio_file"],
                                   "reason": "decode_failure"})
    shared = {"audio_file": "shared.wav", "text": "x", "language": "en"}  # on both ranks
    dataset_guard.record_drop(dataset_guard.report_path(),
                              dataset_guard.sample_key("train", shared),
                              {"split": "train", "audio_file": "shared.wav",
                               "reason": "decode_failure"})
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    with open(f"{out}/job.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump({"nan_guard": nan_guard.stats(), "evidence": patches.stats()["evidence"],
                   "params": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
                   "identical": all(torch.equal(gathered[0], g) for g in gathered),
                   "finite": bool(torch.isfinite(params).all())}, handle)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_after_atexit()
