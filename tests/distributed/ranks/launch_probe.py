"""A rank that reports whether the patches reached it (run by test_launch_launchers.py).

It never imports ``patches`` itself: only a launcher's bootstrap can have applied them.
Writes ``<out>/rank<RANK>.json``: the global rank, the interpreter, what is applied. With
a process group (torchrun), all ranks of all nodes meet in one all-reduce first, so a
node that joined another job cannot pass for this one.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

# the output folder: the first argument, or --probe_out=DIR where a launcher puts its own
# arguments first (coqui's distribute adds --continue_path=... --rank=R)
out = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--probe_out=")), sys.argv[1])
rank = int(os.environ["RANK"])
world = None
if "MASTER_ADDR" in os.environ:
    dist.init_process_group("gloo")
    ones = torch.ones(1)
    dist.all_reduce(ones)
    world = int(ones.item())
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
patches = sys.modules.get("patches")
applied = patches.advanced.applied() if patches is not None else None
with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
    json.dump({"rank": rank, "world": world, "executable": sys.executable,
               "local_rank": os.environ.get("LOCAL_RANK"), "applied": applied}, handle)
