"""Peak resident memory of loading a checkpoint, against the checkpoint's size.

Target (issue 5): ``load_checkpoint`` peaks at no more than 1.3x the file's size above
the process's resident memory before the load (model and optimizer already built).

Each measurement runs in a fresh subprocess: import torch and patches, build the model
and the (empty) optimizer, reset the kernel's high-water mark (``/proc/self/clear_refs``
``5``), take ``VmRSS``, load, and read ``VmHWM``; ``ru_maxrss`` is reported beside it.
Compared: ``patches.load_checkpoint`` (``torch.load(mmap=True, weights_only=True)``, the
manifest's digest verified and every tensor checked for NaN/Inf before anything is
touched), the same with those checks off (``verify_hash=False, allow_nonfinite=True``),
and the usual ``torch.load(weights_only=True)`` + ``load_state_dict`` of both states.
Each line also gives the load's wall time (the checks read the file once more).

Run: ``.venv/bin/python benchmarks/bench_checkpoint_memory.py [--vocab 24000] [--hidden 1024]``

Time at a real size (issue 41), ``--time-rounds N``: one process builds the model (``--depth``
transformer-shaped blocks of ``--width`` channels: qkv, out, MLP up and down, 12 x width^2
weights each, between a ``--vocab`` x width embedding and head) and an AdamW with its
moments, then runs N interleaved rounds (the order flipped each round) of ``torch.save(path)``
against ``CheckpointManager.save``, and of ``torch.load`` + ``load_state_dict`` against
``load_checkpoint`` (hash verified, the default) and ``load_checkpoint(verify_hash=False)``;
medians, and each round's ratio to torch's. ``CheckpointManager.save`` fsyncs its file and
torch.save does not: ``torch.save`` + ``os.fsync`` is timed too. Every save writes a new file
and then removes the one before it, as ``CheckpointManager(keep=1)`` does. Beside the wall clock, the
CPU seconds of the calling thread (its critical path when another core is free: the hash and
the finite scans run in threads of their own) and of the whole process, which a machine busy
with other work stretches less than the wall clock. The manifest's digest is BLAKE3 chunks
(the default); the save and load with SHA-256 chunks (what a copy without the ``blake3``
package records) and the load of a manifest with the whole file's SHA-256 (written before the
chunked digest) are timed too, the load through a hard link to the same file with its own
manifest.

    .venv/bin/python benchmarks/bench_checkpoint_memory.py --width 1024 --depth 12 --time-rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _build(vocab: int, hidden: int, layers: int, depth: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Module()
    model.text_embedding = nn.Embedding(vocab, hidden)
    model.body = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    model.blocks = nn.ModuleList(  # the GPT's shapes: qkv, out, MLP up and down
        nn.ModuleDict({"qkv": nn.Linear(hidden, 3 * hidden), "out": nn.Linear(hidden, hidden),
                       "up": nn.Linear(hidden, 4 * hidden), "down": nn.Linear(4 * hidden, hidden)})
        for _ in range(depth))
    model.text_head = nn.Linear(hidden, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def write(path: Path, vocab: int, hidden: int, layers: int, depth: int = 0) -> int:
    import torch

    from patches.checkpoint import CheckpointManager

    model, optimizer = _build(vocab, hidden, layers, depth)
    for p in model.parameters():  # one real step so the Adam moments exist
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    saved = CheckpointManager(path, keep=None).save(1, model, optimizer)
    return saved.stat().st_size


def measure(path: str, vocab: int, hidden: int, layers: int, how: str, depth: int = 0) -> dict:
    import torch

    torch.set_num_threads(1)
    from patches.checkpoint import load_checkpoint

    model, optimizer = _build(vocab, hidden, layers, depth)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if how == "load_checkpoint":
        load_checkpoint(path, model, optimizer, freeze=False)
    elif how == "load_checkpoint-unchecked":
        load_checkpoint(path, model, optimizer, freeze=False, verify_hash=False,
                        allow_nonfinite=True)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"][0])
        del state
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"how": how, "rss_before": before, "peak": peak, "peak_delta": peak - before,
            "ru_maxrss_delta": ru_after - max(ru_before, before),
            "rss_after_delta": _status("VmRSS") - before, "seconds": seconds}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if len(values) % 2 else \
        sum(sorted(values)[len(values) // 2 - 1:len(values) // 2 + 1]) / 2


def time_rounds(folder: Path, vocab: int, hidden: int, layers: int, depth: int,
                rounds: int) -> None:
    """Interleaved save and load rounds in this process (see the module docstring)."""
    import gc

    import torch

    from patches.checkpoint import CheckpointManager, load_checkpoint

    torch.set_num_threads(1)
    model, optimizer = _build(vocab, hidden, layers, depth)
    for p in model.parameters():  # one real step so the Adam moments exist
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    manager = CheckpointManager(folder / "managed", keep=1)
    step = [0]

    def torch_save() -> Path:
        # A new file per save, the previous one removed after (a trainer's checkpoint_<step>
        # files, kept 1, as the manager does): torch.save over the same file instead made the
        # next new file's write cost 3x the CPU here (the truncated file's pages and blocks
        # freed meanwhile), which an interleaved round then charged to whatever came next.
        step[0] += 1
        plain = folder / f"plain_{step[0]}.pt"
        torch.save({"model": model.state_dict(), "optimizer": [optimizer.state_dict()]}, plain)
        for old in folder.glob("plain_*.pt"):
            if old != plain:
                old.unlink()
        return plain

    def torch_save_fsync() -> None:
        fd = os.open(torch_save(), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def manager_save() -> None:
        step[0] += 1
        manager.save(step[0], model, optimizer)

    saves = {"torch.save": torch_save, "torch.save+fsync": torch_save_fsync,
             "CheckpointManager.save": manager_save}
    try:
        from patches.checkpoint import digest
        chunked = hasattr(digest, "ChunkedDigest")
    except ImportError:  # a tree from before the digest module
        chunked = False
    if chunked:
        sha_manager = CheckpointManager(folder / "managed_sha256", keep=1)

        def manager_save_sha256() -> None:
            step[0] += 1
            blake3, digest._blake3 = digest._blake3, None  # as a copy without blake3
            try:
                sha_manager.save(step[0], model, optimizer)
            finally:
                digest._blake3 = blake3

        saves["CheckpointManager.save (SHA-256 chunks)"] = manager_save_sha256
    times: dict[str, list[float]] = {name: [] for name in saves}
    main_cpu: dict[str, list[float]] = {name: [] for name in saves}
    all_cpu: dict[str, list[float]] = {name: [] for name in saves}

    def timed(name: str, call) -> None:
        gc.collect()
        try:  # each load as in a fresh process: no hash remembered from an earlier one
            from patches.checkpoint import digest
            digest._verified.clear()
        except ImportError:  # a tree from before the remembered hashes
            pass
        start, main0, all0 = time.perf_counter(), time.thread_time(), time.process_time()
        call()
        times[name].append(time.perf_counter() - start)
        main_cpu[name].append(time.thread_time() - main0)
        all_cpu[name].append(time.process_time() - all0)

    for r in range(rounds):
        for name in (list(saves) if r % 2 == 0 else list(reversed(saves))):
            timed(name, saves[name])
    path = manager.checkpoints()[-1]
    size = path.stat().st_size

    def torch_load() -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"][0])

    loads = {"torch.load+load_state_dict": torch_load,
             "load_checkpoint": lambda: load_checkpoint(path, model, optimizer, freeze=False),
             "load_checkpoint(verify_hash=False)": lambda: load_checkpoint(
                 path, model, optimizer, freeze=False, verify_hash=False),
             "resume('auto') + load_checkpoint": lambda: load_checkpoint(
                 manager.resume("auto"), model, optimizer, freeze=False)}
    algorithm = "SHA-256 of the whole file"
    if chunked:
        from patches.checkpoint import manifest_path

        from patches.checkpoint.reading import FORMAT

        manifest = json.loads(manifest_path(path).read_text())
        entry = manifest["files"][path.name]
        algorithm = f"{entry['digest']['algorithm']} chunks"
        for name, record in (("SHA-256 chunks", "sha256"), ("old manifest: SHA-256", None)):
            link = folder / name.replace(" ", "_").replace(":", "") / path.name
            link.parent.mkdir()
            os.link(path, link)  # the same inode: the same page cache
            if record is None:  # as versions before the one format wrote it
                other = {k: v for k, v in manifest.items() if k != "files"}
                other.update(format=FORMAT, file=path.name, bytes=entry["bytes"],
                             sha256=digest.sha256_file(link))
            else:
                other = {**manifest, "files": {path.name: {
                    **entry, "digest": digest.file_record(link, record)}}}
            manifest_path(link).write_text(json.dumps(other))
            loads[f"load_checkpoint ({name})"] = (
                lambda link=link: load_checkpoint(link, model, optimizer, freeze=False))
    for table in (times, main_cpu, all_cpu):
        table.update({name: [] for name in loads})
    for r in range(rounds):
        for name in (list(loads) if r % 2 == 0 else list(reversed(loads))):
            timed(name, loads[name])
    params = sum(p.numel() for p in model.parameters())
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, {platform.platform()}, "
          f"python {platform.python_version()}, torch {torch.__version__}, 1 torch thread; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"model: vocab {vocab}, width {hidden}, {depth} blocks + {layers} linear layers, "
          f"{params / 1e6:.0f} M params + AdamW; file {size / 1e9:.2f} GB; {rounds} rounds; "
          f"digest: {algorithm}")
    print("| what | wall s, median (each round) | wall ratio | calling thread CPU s | ratio "
          "| process CPU s | ratio |")
    print("|---|---|---|---|---|---|---|")

    def ratio(table: dict[str, list[float]], name: str) -> float:
        base = table["torch.save" if name in saves else "torch.load+load_state_dict"]
        return _median([v / b for v, b in zip(table[name], base)])

    for name, values in times.items():
        print(f"| {name} | {_median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)}) "
              f"| {ratio(times, name):.2f} | {_median(main_cpu[name]):.2f} "
              f"| {ratio(main_cpu, name):.2f} | {_median(all_cpu[name]):.2f} "
              f"| {ratio(all_cpu, name):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=24000)
    parser.add_argument("--hidden", "--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=None,
                        help="plain width x width linear layers (default 8, 0 with --depth)")
    parser.add_argument("--depth", type=int, default=0,
                        help="transformer-shaped blocks (12 x width^2 weights each)")
    parser.add_argument("--time-rounds", type=int, default=0,
                        help="time saves and loads in N interleaved rounds in one process")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "HOW"))
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 0 if args.depth else 8
    if args.time_rounds:
        with tempfile.TemporaryDirectory() as tmp:
            time_rounds(Path(tmp), args.vocab, args.hidden, args.layers, args.depth,
                        args.time_rounds)
        return
    if args.child:
        print(json.dumps(measure(args.child[0], args.vocab, args.hidden, args.layers,
                                 args.child[1], args.depth)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        size = write(Path(tmp), args.vocab, args.hidden, args.layers, args.depth)
        path = str(next(Path(tmp).glob("ckpt_*.pt")))
        print(f"machine: {platform.machine()} {os.cpu_count()} cpus, {platform.platform()}, "
              f"python {platform.python_version()}")
        print(f"checkpoint: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
              f"AdamW state: {size / 2**20:.1f} MiB")
        for how in ("load_checkpoint", "load_checkpoint-unchecked", "torch.load+load_state_dict"):
            out = subprocess.run(
                [sys.executable, "-W", "ignore", __file__, "--vocab", str(args.vocab),
                 "--hidden", str(args.hidden), "--layers", str(args.layers),
                 "--depth", str(args.depth), "--child", path, how],
                cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), TRAINING_PATCHES_QUIET="1"),
                check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"{how:28s} peak +{result['peak_delta'] / 2**20:7.1f} MiB = "
                  f"{result['peak_delta'] / size:.2f}x file  (ru_maxrss +"
                  f"{result['ru_maxrss_delta'] / 2**20:.1f} MiB, after +"
                  f"{result['rss_after_delta'] / 2**20:.1f} MiB), {result['seconds']:.2f} s")


if __name__ == "__main__":
    main()
