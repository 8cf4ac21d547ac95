"""Rank script of the checkpoint tests (torchrun, gloo, CPU). ``MODE OUT [args]``:

- ``ddp_saves OUT N``: DDP, ``CheckpointManager.save`` from every rank N times.
- ``ddp_diskfull OUT``: DDP, the writer's disk "fills" (rank 0 only); every rank reports.
- ``ddp_hang OUT K``: DDP, K complete saves (each followed by draws from every RNG), then
  rank 0 blocks inside the write of save K (the test kills the job).
- ``ddp_resume OUT``: resume every rank from the newest complete checkpoint, then draw.
- ``fsdp_kill OUT``: FSDP2, two complete saves, then rank 0 blocks before the commit
  marker of the third (the test kills the job).
- ``fsdp_next_save OUT``: FSDP2, resume from the newest complete folder, train, save.
- ``ddp_refuse OUT``: rank 1's model does not fit the checkpoint; every rank must refuse.
- ``ddp_auto_disagree OUT``: row_init auto's probe answers differently per rank; every rank
  must refuse the load.
- ``rank0_only OUT``: ``save`` on rank 0 only (the mistake): a clear error, no endless wait.
- ``fsdp_single OUT FILE``: a single-file checkpoint into an FSDP2 model (refused).
- ``fsdp_save OUT REF``: FSDP2, train and save 3 times (keep=2); rank 0 writes the full
  parameters and optimizer state to REF; draws after the last save.
- ``fsdp_resume OUT REF``: FSDP2, resume, compare full state with REF bit for bit, draw.
- ``node_local_resume OUT LAYOUT ACCESS`` (two launchers as two nodes): ``resume("auto")``
  on every rank, from ``OUT`` (LAYOUT ``shared``) or from ``OUT/node<node>`` (``per_node``:
  a disk per node at the same path); ACCESS ``ro``: no file can be created in it (a read-only mount, which root
  cannot make here: the write of the shared-folder probe raises PermissionError).
- ``node_local_fsdp_save OUT`` (two launchers as two nodes): ``OUT/node<node>``, an FSDP2
  sharded save.

Lines the test reads: ``RANK <r> <KEY> <json>``.
"""

from __future__ import annotations

import json
import warnings
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from patches import CheckpointManager, load_checkpoint
from tiny_gpt import TinyGPT, batch, loss_of, end_job, shard

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
MODE, OUT = sys.argv[1], sys.argv[2]
if MODE == "rank0_only":  # a short timeout: the mistake must surface within the test
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=4))
else:
    dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()


def say(key: str, value: object) -> None:
    # One write per line (below PIPE_BUF): the ranks share torchrun's output pipe.
    os.write(1, f"RANK {RANK} {key} {json.dumps(value)}\n".encode())


def seed_rank() -> None:
    """Every rank its own RNG streams (as data loaders and dropout need)."""
    torch.manual_seed(100 + RANK)
    np.random.seed(200 + RANK)
    random.seed(300 + RANK)


def draws() -> list[float]:
    return torch.rand(3).tolist() + np.random.rand(2).tolist() + [random.random()]


def ddp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    opt.zero_grad()
    loss_of(model, batch(gen)).backward()
    opt.step()


def fsdp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0 if MODE == "fsdp_save" else 1234)  # the resumed job starts elsewhere
    model = shard(TinyGPT())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {"model": msd, "optimizer": osd}


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): tree}


if MODE == "ddp_saves":
    model, opt = ddp_model()
    gen = torch.Generator().manual_seed(RANK)
    manager = CheckpointManager(OUT, keep=None)
    paths = []
    for step in range(int(sys.argv[3])):
        train_step(model, opt, gen)
        paths.append(str(manager.save(step, model, opt)))
    say("PID", os.getpid())
    say("PATHS", paths)

elif MODE == "ddp_diskfull":
    import errno

    model, opt = ddp_model()
    if RANK == 0:  # only the writer's disk fills (a network filesystem says so at fsync)
        def full_disk(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.fsync = full_disk
    try:
        CheckpointManager(OUT, keep=2).save(1, model, opt)
        say("SAVED", True)
        code = 0
    except Exception as exc:  # noqa: BLE001 - the test reads it
        say("ERROR", f"{type(exc).__name__}: {exc}")
        code = 3
    end_job(globals(), code)

elif MODE == "ddp_hang":
    say("PID", os.getpid())
    model, opt = ddp_model()
    seed_rank()
    gen = torch.Generator().manual_seed(RANK)
    manager = CheckpointManager(OUT, keep=2)
    hang_at = int(sys.argv[3])
    for step in range(hang_at + 1):
        train_step(model, opt, gen)
        if step == hang_at and RANK == 0:
            real_save = torch.save

            def blocking_save(obj, f, *args, **kwargs):
                if type(f).__name__ != "_Sink":  # pickling for a collective, not the file
                    return real_save(obj, f, *args, **kwargs)
                f.write(b"PK\x03\x04" + b"\0" * 4096)  # part of the file is on disk
                f.flush()
                say("HANGING", step)
                time.sleep(600)

            torch.save = blocking_save
        path = manager.save(step, model, opt)
        say("SAVED", [step, str(path)])
        say("DRAWS_AFTER", [step, draws()])

elif MODE == "ddp_resume":
    model, opt = ddp_model()
    seed_rank()  # fresh seeds: only a restored state gives the saved streams back
    torch.manual_seed(999)
    manager = CheckpointManager(OUT, keep=2)
    path = manager.resume("auto")
    report = load_checkpoint(path, model, opt)
    say("RESUMED", [str(path), report.step, report.rng_restored])
    say("DRAWS", draws())
    # The next save sweeps the killed writer's temporary file (same host, dead pid).
    manager.save(report.step + 1, model, opt)
    say("LEFT", sorted(os.listdir(OUT)))

elif MODE == "fsdp_save":
    model, opt = fsdp_model()
    seed_rank()
    gen = torch.Generator().manual_seed(RANK)
    manager = CheckpointManager(OUT, keep=2)
    for step in (1, 2, 3):
        train_step(model, opt, gen)
        path = manager.save(step, model, opt, epoch=0, pos=step * 10)
        say("SAVED", [step, str(path)])
    full = full_state(model, opt)
    if RANK == 0:
        torch.save(full, sys.argv[3])
    say("DRAWS_AFTER", draws())

elif MODE == "fsdp_resume":
    model, opt = fsdp_model()
    seed_rank()
    torch.manual_seed(999)
    manager = CheckpointManager(OUT, keep=2)
    path = manager.resume("auto")
    report = load_checkpoint(path, model, opt)
    say("RESUMED", [str(path), report.step, report.extra, report.rng_restored,
                     {name: str(part) for name, part in report.parts.items()}])
    say("DRAWS", draws())
    full = flat(full_state(model, opt))  # gathered on rank 0 only (cpu_offload)
    if RANK == 0:
        ref = flat(torch.load(sys.argv[3], weights_only=True))
        same = sorted(full) == sorted(ref) and all(
            torch.equal(full[k], ref[k]) if isinstance(ref[k], torch.Tensor) else full[k] == ref[k]
            for k in ref)
        say("EQUAL", [same, len(ref)])
    # Training goes on from the resumed state on the new number of ranks.
    train_step(model, opt, torch.Generator().manual_seed(RANK))
    say("STEPPED", manager.save(report.step + 1, model, opt).name)

elif MODE == "fsdp_kill":
    # Two complete sharded saves, then rank 0 stops inside the third after every shard and
    # the manifest are on disk, before the commit marker (the test SIGKILLs the job).
    from patches.checkpoint import sharded

    say("PID", os.getpid())
    model, opt = fsdp_model()
    gen = torch.Generator().manual_seed(RANK)
    manager = CheckpointManager(OUT, keep=2)
    for step in (1, 2, 3):
        train_step(model, opt, gen)
        if step == 3 and RANK == 0:
            real_text = sharded.atomic_text

            def blocking_text(path, text):
                if os.path.basename(path) != sharded.COMMIT_NAME:
                    return real_text(path, text)
                say("HANGING", step)
                time.sleep(600)

            sharded.atomic_text = blocking_text
        say("SAVED", [step, str(manager.save(step, model, opt))])

elif MODE == "fsdp_next_save":
    # The next job: resume from the newest complete folder, train, save (which sweeps).
    model, opt = fsdp_model()
    manager = CheckpointManager(OUT, keep=2)
    path = manager.resume("auto")
    report = load_checkpoint(path, model, opt)
    say("RESUMED", [str(path), report.step])
    train_step(model, opt, torch.Generator().manual_seed(RANK))
    # Another step than the killed save's: its folder can only go by the sweep.
    say("SAVED", str(manager.save(report.step + 5, model, opt)))
    say("LEFT", sorted(os.listdir(OUT)))

elif MODE == "ddp_refuse":
    # Rank 1's model has fewer vocabulary rows than the checkpoint: refused there only.
    torch.manual_seed(7)
    model = TinyGPT() if RANK == 0 else TinyGPT(vocab=70)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        load_checkpoint(CheckpointManager(OUT).resume("auto"), model)
        say("LOADED", True)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        say("ERROR", f"{type(exc).__name__}: {exc}")
    say("UNCHANGED", all(torch.equal(v, before[k]) for k, v in model.state_dict().items()))

elif MODE == "ddp_auto_disagree":
    # row_init auto probes on each rank: a probe that answers "reads" on rank 0 and "does not
    # read" on rank 1 (as a CPU difference near the threshold, or a probe failing on one rank,
    # could) must stop the load on every rank, not give the replicas different rows.
    from tokenizers import Tokenizer, models

    from patches import reads_text
    from tiny_gpt import BASE

    rows = TinyGPT().text_embedding.num_embeddings
    words = ["[STOP]", "[UNK]", "[SPACE]", "[en]"] + [f"w{i}" for i in range(rows - 4)]
    vocab = os.path.join(OUT, "vocab.json")
    if RANK == 0:
        os.makedirs(OUT, exist_ok=True)
        torch.manual_seed(0)
        torch.save({"model": TinyGPT(vocab=BASE).state_dict()}, os.path.join(OUT, "base.pt"))
        Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
                  ).save(vocab)
    dist.barrier()

    def probs(params, texts, context):
        emb = params["text_embedding.weight"][texts].mean(1)  # texts x DIM
        logits = emb[:, :4, None] * (50.0 if RANK == 0 else 0.0) + context
        return logits.softmax(1)

    reads_text.register_text_probe(lambda owner: reads_text.TextProbe(
        lambda gen: torch.randn(1, 4, 3, generator=gen), probs)
        if isinstance(owner, TinyGPT) else None)
    model = TinyGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        load_checkpoint(os.path.join(OUT, "base.pt"), model, freeze=False, tokenizer=vocab)
        say("LOADED", True)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        say("ERROR", f"{type(exc).__name__}: {exc}")
    say("UNCHANGED", all(torch.equal(v, before[k]) for k, v in model.state_dict().items()))

elif MODE == "rank0_only":
    # The common mistake: `if rank == 0: manager.save(...)` without collective=False.
    model = TinyGPT()
    if RANK == 0:
        try:
            CheckpointManager(OUT).save(1, model)
            say("SAVED", True)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            say("ERROR", f"{type(exc).__name__}: {exc}")
        CheckpointManager(OUT, collective=False).save(2, model)  # the one-process way works
        say("SAVED_LOCAL", sorted(os.listdir(OUT)))
    else:
        time.sleep(10)  # busy elsewhere (e.g. training); never joins the save
    sys.exit(0)

elif MODE == "fsdp_diskfull":
    import errno

    model, opt = fsdp_model()
    train_step(model, opt, torch.Generator().manual_seed(RANK))
    if RANK == 0:  # only rank 0's disk fills (a network filesystem says so at fsync)
        def full_disk(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.fsync = full_disk
    try:
        CheckpointManager(OUT).save(1, model, opt)
        say("SAVED", True)
        code = 0
    except Exception as exc:  # noqa: BLE001 - the test reads it
        say("ERROR", f"{type(exc).__name__}: {str(exc)[:300]}")
        code = 3
    end_job(globals(), code)

elif MODE in ("node_local_resume", "node_local_fsdp_save"):
    folder = os.path.join(OUT, f"node{os.environ['GROUP_RANK']}")  # torchrun's node rank
    try:
        if MODE == "node_local_resume":
            if sys.argv[3] == "shared":
                folder = OUT
            if sys.argv[4] == "ro":
                import pathlib

                real_write = pathlib.Path.write_text

                def read_only(self, *args, **kwargs):
                    if self.name.startswith(".training_patches_shared"):
                        raise PermissionError(13, "Read-only file system", str(self))
                    return real_write(self, *args, **kwargs)

                pathlib.Path.write_text = read_only
            say("RESUMED", str(CheckpointManager(folder).resume("auto")))
        else:
            model, opt = fsdp_model()
            say("SAVED", str(CheckpointManager(folder).save(1, model, opt)))
        code = 0
    except Exception as exc:  # noqa: BLE001 - the test reads it
        say("ERROR", f"{type(exc).__name__}: {exc}")
        code = 3
    end_job(globals(), code)

elif MODE == "fsdp_single":
    model, opt = fsdp_model()
    try:
        load_checkpoint(sys.argv[3], model, opt)
        say("LOADED", True)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        say("ERROR", f"{type(exc).__name__}: {exc}")

end_job(globals())
