"""Rank script: the data position under DDP (2 ranks, DistributedSampler, gloo). In one
job: the uninterrupted run, the same run stopped at step STOP (epoch 1, batch 3) with a
checkpoint saved with ``loader=``, and its resume.

    data_position_job.py OUT_DIR

Writes OUT_DIR/seen<rank>.json: {"full": [...], "first": [...], "rest": [...], "part":
[status, detail]} (records as tests/data_position_loop.py makes them).
"""

import patches.auto  # noqa: F401  (first, as users write it)

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared loop
from data_position_loop import train  # noqa: E402

STOP = 9  # 44 samples on 2 ranks, batch 4: 6 batches a rank an epoch; step 9 = epoch 1, batch 3

dist.init_process_group("gloo")
out = Path(sys.argv[1])
full, _ = train(out / "full", distributed=True)
first, _ = train(out / "run", distributed=True, stop_after=STOP)
rest, report = train(out / "run", distributed=True, resume=True)
part = report.parts["data"]
(out / f"seen{dist.get_rank()}.json").write_text(json.dumps(
    {"full": full, "first": first, "rest": rest, "part": [part.status, part.detail]}))
dist.barrier()
dist.destroy_process_group()
from processes import exit_after_atexit  # noqa: E402  (tests/, on sys.path above)

exit_after_atexit()  # torch 2.14.1's gloo can abort the interpreter's teardown (SIGABRT)
