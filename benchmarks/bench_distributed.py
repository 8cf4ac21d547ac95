"""Step-time overhead of the patches under DDP and FSDP2: 2 ranks, CPU, gloo.

The method of bench_overhead.py on every rank of a real torchrun job: the same small
transformer step (AdamW, ``clip_grad_norm_(..., 1.0)``), the model wrapped in
``DistributedDataParallel`` or sharded with FSDP2's ``fully_shard``; blocks of steps
patched and unpatched alternate (``patches.advanced.apply``/``revert`` in the running job, the order
flipped every round), and the ratio is the median over rounds of patched/unpatched block
medians, read on rank 0 (a DDP/FSDP2 step waits for both ranks, so rank 0's time is the
job's). Each setting is its own torchrun job: one that crashes or hangs is reported as
such and the others still run.

On a machine with 2 or more CUDA GPUs ``--device cuda`` runs the same jobs with NCCL, one
GPU a rank, each step timed to its end (``torch.cuda.synchronize``); the GPU suite
(benchmarks/gpu/test_gpu_multi.py) does that.

Run: .venv/bin/python benchmarks/bench_distributed.py [--rounds N] [--steps N] [--only ddp]
     [--device cuda] [--breakdown] [--width 128] [--depth 2] [--vocab 0]

``--width``/``--depth``/``--vocab``: bench_overhead.py's model at that size (``--vocab V``: a
text model of V rows, token ids as input; the freeze is not applied here: it does no
communication of its own). ``--collectives`` also counts, on rank 0, the collectives of
one patched and one unpatched step (torch's profiler: every ``c10d::`` operation).

``--breakdown`` also prints, per setting, the median time of each phase of the step
(forward, backward, clip, optimizer step) patched and unpatched, and of the NaN guard's
agreement all-reduce (timed inside the optimizer step), on rank 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (label, wrapping, fused AdamW)
SETTINGS = {
    "ddp": ("DDP, fp32 + clip, all default patches", "ddp", False),
    "ddp-fused": ("DDP, fp32 + clip, fused AdamW, all default patches", "ddp", True),
    "fsdp2": ("FSDP2 (fully_shard), fp32 + clip, all default patches", "fsdp2", False),
    "ddp-scaler": ("DDP, loss-scaled (GradScaler, unscale_, clip), all default patches", "ddp",
                   False),
}
# Settings whose step runs through a GradScaler (torch's unpatched, SafeGradScaler patched;
# on the CPU a "cpu" scaler: the same scale, unscale and skip as fp16 on a GPU).
SCALED = {"ddp-scaler"}


PHASES = ("forward", "backward", "clip", "optimizer step")


def block(model, opt, steps: int, data, device: str,
          phases: dict[str, list[float]] | None = None, bare_flag: bool = False,
          scaler=None) -> list[float]:
    """bench_overhead.py's fp32 step (AdamW, clip 1.0), each timed to its end on a GPU;
    with ``phases``, each phase's time is appended there too (CPU: no sync needed); with
    ``bare_flag``, one all-reduce (MAX) of 3 floats and its host read before the optimizer
    step, as the NaN guard's agreement does, and nothing else (what that collective alone
    costs in this step). With ``scaler``: the loss scaled, ``unscale_`` before the clip (timed
    with it), ``scaler.step`` and ``update`` as the optimizer step."""
    import torch
    import torch.distributed as dist

    from bench_overhead import loss_of

    flag = torch.zeros(3, device=device)

    x, y = data
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(x), y)
        t_fwd = time.perf_counter()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        t_bwd = time.perf_counter()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t_clip = time.perf_counter()
        if bare_flag:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bool(flag[0])
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        times.append(end - start)
        if phases is not None:
            for name, took in zip(PHASES, (t_fwd - start, t_bwd - t_fwd, t_clip - t_bwd,
                                           end - t_clip)):
                phases.setdefault(name, []).append(took)
    return times


def _timed_agreement(sink: list[float]) -> None:
    """Time the NaN guard's one agreement all-reduce (``nan_guard._agree``) into ``sink``."""
    from patches import nan_guard

    agree = nan_guard._agree

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return agree(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)
    nan_guard._agree = timed


def _collectives(model, opt, data, device: str, scaler=None) -> int:
    """Collectives of one step (torch's profiler: every ``c10d::`` operation)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        block(model, opt, 1, data, device, scaler=scaler)
    return sum(1 for event in prof.events() if event.name.startswith("c10d::"))


def rank_main(setting: str, rounds: int, steps: int, device: str, breakdown: bool,
              width: int = 128, depth: int = 2, vocab: int = 0,
              collectives: bool = False) -> None:
    """One rank of the job (started by torchrun with ``--rank-job``)."""
    sys.path[:0] = [ROOT, HERE]
    import torch
    import torch.distributed as dist

    import patches
    from bench_overhead import make_data, make_model

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    _, wrapping, fused = SETTINGS[setting]
    model = make_model(width, depth, vocab).to(device)
    if wrapping == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.body if vocab else model[0]).layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    generator = torch.Generator().manual_seed(rank)
    data = tuple(t.to(device) for t in make_data(width, vocab, generator))
    patches.revert()
    scalers: dict[str, object] = dict.fromkeys(("patched", "unpatched"))
    if setting in SCALED:
        from patches.grad_scaler import SafeGradScaler

        scalers = {"patched": SafeGradScaler(device, init_scale=1024.0),
                   "unpatched": torch.amp.GradScaler(device, init_scale=1024.0)}
    phases: dict[str, dict[str, list[float]]] = {"patched": {}, "unpatched": {}}
    agreement: list[float] = []
    bare_ratios: list[float] = []
    if breakdown:
        _timed_agreement(agreement)
    counted = {}
    try:
        block(model, opt, 3, data, device, scaler=scalers["unpatched"])  # warm-up, unpatched
        if collectives:
            counted["unpatched"] = _collectives(model, opt, data, device, scalers["unpatched"])
        patches.advanced.apply(quiet=True)
        # warm-up, patched (a crash shows here)
        block(model, opt, 3, data, device, scaler=scalers["patched"])
        if collectives:
            counted["patched"] = _collectives(model, opt, data, device, scalers["patched"])
        timed: dict[str, list[float]] = {"patched": [], "unpatched": []}
        ratios = []
        for r in range(rounds):
            order = ["patched", "unpatched"] if r % 2 == 0 else ["unpatched", "patched"]
            medians = {}
            for mode in order:
                patches.advanced.apply(quiet=True) if mode == "patched" else patches.revert()
                times = block(model, opt, steps, data, device,
                              phases[mode] if breakdown else None, scaler=scalers[mode])
                timed[mode] += times
                medians[mode] = statistics.median(times)
            ratios.append(medians["patched"] / medians["unpatched"])
            if breakdown:  # the unpatched step plus one bare all-reduce of the flag
                patches.revert()
                times = block(model, opt, steps, data, device, None, bare_flag=True,
                              scaler=scalers["unpatched"])
                bare_ratios.append(statistics.median(times) / medians["unpatched"])
    except Exception as exc:  # every rank meets the same failure at the same step
        if rank == 0:
            print(f"RESULT crashed {_describe(exc)}", flush=True)
        raise
    finally:
        patches.revert()
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in timed.items()}
        print(f"RESULT {med['unpatched']:.2f} {med['patched']:.2f} "
              f"{statistics.median(ratios):.3f}", flush=True)
        if counted:
            print(f"PHASE collectives a step: unpatched {counted['unpatched']}, patched "
                  f"{counted['patched']}", flush=True)
        if breakdown:
            for name in PHASES:
                u, p = (statistics.median(phases[m][name]) * 1e3
                        for m in ("unpatched", "patched"))
                print(f"PHASE {name}: unpatched {u:.2f} ms, patched {p:.2f} ms", flush=True)
            if agreement:
                print(f"PHASE of which the guard's agreement (its all-reduce; under DDP "
                      f"the flags the reduction carried): "
                      f"{statistics.median(agreement) * 1e3:.2f} ms median "
                      f"({len(agreement)} calls)", flush=True)
            print(f"PHASE unpatched + one bare 3-float all-reduce before the step, over "
                  f"unpatched: {statistics.median(bare_ratios):.3f} (median of rounds)",
                  flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


def _describe(exc: BaseException) -> str:
    """The exception and the innermost frame of this library it went through."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}patches{os.sep}" in f.filename]
    where = (f" in patches/{frames[-1].filename.rsplit(os.sep + 'patches' + os.sep, 1)[1]}:"
             f"{frames[-1].lineno} ({frames[-1].name})" if frames else "")
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}{where}{': ' + text if text else ''}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_setting(setting: str, rounds: int, steps: int, timeout: float,
                device: str = "cpu", breakdown: bool = False, size: tuple[str, ...] = (),
                collectives: bool = False) -> str:
    """One torchrun job; its table row (or what went wrong)."""
    label = SETTINGS[setting][0]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
               "--max-restarts=0", os.path.abspath(__file__), "--rank-job", setting,
               "--rounds", str(rounds), "--steps", str(steps), "--device", device]
    command += (["--breakdown"] if breakdown else []) + list(size)
    command += ["--collectives"] if collectives else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    env.update(OMP_NUM_THREADS="1", TRAINING_PATCHES_QUIET="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"| {label} | - | - | hung: killed after {timeout:.0f} s |"
    results = [line.split(None, 1)[1] for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and results:
        unpatched, patched, ratio = results[-1].split()
        notes = "".join(f"\n  {line[6:]}" for line in out.splitlines()
                        if line.startswith("PHASE "))
        return f"| {label} | {unpatched} | {patched} | {ratio} |{notes}"
    why = results[-1] if results else (out.strip().splitlines() or ["no output"])[-1]
    return f"| {label} | - | - | patched run FAILED: {why} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default="", help="run only the settings whose key "
                        f"contains this text ({', '.join(SETTINGS)})")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, one GPU a rank (needs 2 GPUs)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print each phase's median time (forward, backward, clip, "
                        "optimizer step) and the NaN guard's agreement all-reduce, rank 0")
    parser.add_argument("--width", type=int, default=128, help="channels of the model")
    parser.add_argument("--depth", type=int, default=2, help="transformer layers")
    parser.add_argument("--vocab", type=int, default=0,
                        help="a text model of this many rows (0: the plain model)")
    parser.add_argument("--collectives", action="store_true",
                        help="also count the collectives of one step, patched and unpatched")
    parser.add_argument("--rank-job", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        rank_main(args.rank_job, args.rounds, args.steps, args.device, args.breakdown,
                  args.width, args.depth, args.vocab, args.collectives)
        return
    size = ("--width", str(args.width), "--depth", str(args.depth), "--vocab", str(args.vocab))
    import torch

    where = ("gloo, 1 thread a rank" if args.device == "cpu" else
             f"NCCL, {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__},"
          f" 2 ranks (torchrun, {where}), {args.rounds} rounds x {args.steps} steps, width "
          f"{args.width}, depth {args.depth}" + (f", {args.vocab} text rows" if args.vocab
                                                  else ""))
    print(f"| step ({args.device.upper()}, small transformer, 2 ranks) | unpatched ms | patched ms "
          "| ratio (median of rounds) |")
    print("|---|---|---|---|", flush=True)
    failed = False
    for key in SETTINGS:
        if args.only in key:
            start = time.perf_counter()
            row = run_setting(key, args.rounds, args.steps, args.timeout, args.device,
                              args.breakdown, size, args.collectives)
            failed |= "FAILED" in row or "hung" in row
            print(row, f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
