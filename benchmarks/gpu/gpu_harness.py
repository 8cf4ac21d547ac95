"""What the GPU validation suite measures, as plain functions (device-generic where it can be).

The suite (``benchmarks/gpu/test_gpu_suite.py``, run with ``make gpu-suite``) calls these on a
CUDA GPU with the real coqui Trainer in fp16/bf16; ``tests/test_gpu_suite_cpu.py`` calls the
same functions on the CPU (fp32, fake sync counts) so that their logic runs in CI.

- :func:`make_config`: a ``GPTTrainerConfig`` for the tiny XTTS GPT or a realistic-size one
  (30 layers, 1024 channels, random init), with ``mixed_precision`` and fused AdamW as asked;
- :class:`SyncCounter`: counts the synchronizing CUDA calls torch reports under
  ``torch.cuda.set_sync_debug_mode("warn")`` (any counter with the same shape works on the CPU);
- :func:`fit_with_faults`: ``Trainer.fit()`` with infs injected into chosen batches, returning
  which iterations stepped and what the scaler and the guard counted;
- :func:`compare_modes`: patched vs unpatched Trainers, built one at a time in alternating
  rounds, driving the Trainer's own ``train_step`` on cached batches: host syncs per step,
  median step time, peak GPU memory;
- :func:`write_results`: ``gpu_suite.json`` and ``gpu_suite.md`` (rows for docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

# The message of torch's sync debug mode (c10/cuda: warn_or_error_on_sync).
SYNC_MESSAGE = "called a synchronizing CUDA operation"

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"gpt_layers": 2, "gpt_n_model_channels": 64, "gpt_n_heads": 2},
    # XTTS v2's own GPT: 30 layers, 1024 channels, 16 heads (random init here).
    "realistic": {"gpt_layers": 30, "gpt_n_model_channels": 1024, "gpt_n_heads": 16},
}


def make_config(tiny: Any, output_path: str | Path, *, size: str = "tiny",
                precision: str = "fp16", fused: bool = True, lr: float = 1e-4,
                epochs: int = 1, grad_clip: float = 1.0) -> Any:
    """A coqui ``GPTTrainerConfig`` over the tiny XTTS files (``demo.xtts_tiny``).

    ``precision``: ``fp16`` or ``bf16`` (``mixed_precision=True``, autocast; the Trainer builds
    a GradScaler for fp16 on CUDA) or ``fp32``. ``fused``: AdamW with ``fused=True``, as
    ``headlessXttsTrain.py`` builds it.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if precision not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"precision must be fp16, bf16 or fp32, got {precision!r}")
    mixed = precision != "fp32"
    params = {"betas": [0.9, 0.96], "eps": 1e-8, "weight_decay": 1e-2}
    if fused:
        params["fused"] = True
    return tiny.make_config(
        output_path, epochs=epochs, lr=lr, grad_clip=grad_clip, optimizer_params=params,
        mixed_precision=mixed, precision=precision if mixed else "fp16", **SIZES[size])


def gpt_parameter_count(config: Any) -> int:
    """Parameters of the XTTS GPT this config describes, built on the meta device (no memory)."""
    from TTS.tts.layers.xtts.gpt import GPT

    a = config.model_args
    with torch.device("meta"):
        gpt = GPT(layers=a.gpt_layers, model_dim=a.gpt_n_model_channels, heads=a.gpt_n_heads,
                  max_text_tokens=a.gpt_max_text_tokens, max_mel_tokens=a.gpt_max_audio_tokens,
                  max_prompt_tokens=a.gpt_max_prompt_tokens, number_text_tokens=1000,
                  num_audio_tokens=a.gpt_num_audio_tokens,
                  start_audio_token=a.gpt_start_audio_token,
                  stop_audio_token=a.gpt_stop_audio_token,
                  use_perceiver_resampler=a.gpt_use_perceiver_resampler)
    return sum(p.numel() for p in gpt.parameters())


# -- counting host syncs -------------------------------------------------------------------

class SyncCounter:
    """Count synchronizing CUDA calls inside a ``with`` block.

    ``set_mode`` is ``torch.cuda.set_sync_debug_mode`` by default; the block runs with mode
    ``"warn"`` and every warning torch raises for a sync is counted (the mode goes back to 0
    even when the block raises). Other warnings are passed on, not counted.
    """

    def __init__(self, set_mode: Callable[[Any], None] | None = None) -> None:
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.count = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.set_mode("warn")
            try:
                yield self
            finally:
                self.set_mode(0)
        for warning in caught:
            if SYNC_MESSAGE in str(warning.message):
                self.count += 1
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                       warning.lineno)


# -- a Trainer run with faults ---------------------------------------------------------------

def _optimizer_step_count(optimizer: torch.optim.Optimizer) -> float:
    for state in optimizer.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def poison(model: Any, iterations: set[int], current: list[int]) -> None:
    """Make the text embedding output inf in the given Trainer iterations (counted from 0),
    as an overflowing batch would (and in the guard's replay of that batch)."""
    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output * float("inf") if current[0] in iterations else output
    model.xtts.gpt.text_embedding.register_forward_hook(hook)


def fit_with_faults(tiny: Any, config: Any, inject_at: set[int] = frozenset()) -> dict[str, Any]:
    """``Trainer.fit()`` with infs injected in ``inject_at``; what a user would check after.

    An iteration counts as skipped when the optimizer's step count did not advance (true of
    a GradScaler skip, of the NaN guard's skip and of a fused kernel's found_inf skip).
    """
    model = tiny.make_model(config)
    trainer = tiny.make_trainer(config, model)
    current = [0]
    poison(model, set(inject_at), current)
    optimizer = trainer.optimizer[0] if isinstance(trainer.optimizer, list) else trainer.optimizer
    skipped: list[int] = []
    original = trainer.train_step

    def train_step(*args: Any, **kwargs: Any) -> Any:
        before = _optimizer_step_count(optimizer)
        result = original(*args, **kwargs)
        if _optimizer_step_count(optimizer) == before:
            skipped.append(current[0])
        current[0] += 1
        return result
    trainer.train_step = train_step
    try:
        trainer.fit()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise RuntimeError(f"the coqui Trainer exited with {exc.code}") from exc
    import patches

    scaler = trainer.scaler
    return {
        "iterations": current[0],
        "skipped_iterations": skipped,
        "scaler": type(scaler).__name__ if scaler is not None else None,
        "scaler_stats": scaler.stats() if hasattr(scaler, "stats") else None,
        "guard_stats": patches.stats().get("nan_guard"),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "optimizer_fused": bool(optimizer.defaults.get("fused")),
    }


# -- patched vs unpatched ----------------------------------------------------------------------

@dataclass
class ModeResult:
    """One mode's measurements, over all its rounds."""

    step_s: list[float] = field(default_factory=list)
    syncs_per_step: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    scaler: str | None = None


def _build(tiny: Any, config: Any) -> tuple[Any, list[Any]]:
    trainer = tiny.make_trainer(config)
    loader = trainer.get_train_dataloader(trainer.train_samples, verbose=False)
    trainer.train_loader = loader
    trainer.model.train()
    return trainer, list(loader)


def _steps(trainer: Any, batches: list[Any], steps: int, sync: Callable[[], None],
           times: list[float] | None = None) -> None:
    for i in range(steps):
        batch = copy.deepcopy(batches[i % len(batches)])  # format_batch may change it
        sync()
        start = time.perf_counter()
        trainer.train_step(batch, len(batches), i % len(batches), start)
        sync()
        if times is not None:
            times.append(time.perf_counter() - start)


def compare_modes(tiny: Any, make: Callable[[str], Any], *, rounds: int = 2, steps: int = 10,
                  warmup: int = 3, device: str = "cuda",
                  counter: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Patched vs unpatched: a fresh Trainer per mode and round (``make(mode)`` gives its
    config), the order flipped every round, only one Trainer alive at a time.

    ``counter()`` returns an object with ``counting()`` (a context manager) and ``count``:
    :class:`SyncCounter` on CUDA; on the CPU a host-read counter stands in. Returns per mode
    the median step time, the syncs per step, the peak memory; and the patched/unpatched
    ratios (the step-time ratio is the median over rounds of the per-round ratios).
    """
    import patches

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    counter = counter or SyncCounter
    results = {"patched": ModeResult(), "unpatched": ModeResult()}
    round_ratios = []
    try:
        for r in range(rounds):
            order = ("unpatched", "patched") if r % 2 == 0 else ("patched", "unpatched")
            medians = {}
            for mode in order:
                patches.revert()
                if mode == "patched":
                    patches.advanced.apply(quiet=True)
                    patches.advanced.reset_runtime_state()
                trainer, batches = _build(tiny, make(mode))
                result = results[mode]
                result.scaler = type(trainer.scaler).__name__ if trainer.scaler else None
                _steps(trainer, batches, warmup, sync)
                counting = counter()
                with counting.counting():
                    _steps(trainer, batches, steps, lambda: None)
                result.syncs_per_step.append(counting.count / steps)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                times: list[float] = []
                _steps(trainer, batches, steps, sync, times)
                if cuda:
                    result.peak_bytes.append(torch.cuda.max_memory_allocated())
                result.step_s += times
                medians[mode] = statistics.median(times)
                del trainer, batches
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            round_ratios.append(medians["patched"] / medians["unpatched"])
    finally:
        patches.revert()
    out: dict[str, Any] = {}
    for mode, result in results.items():
        out[mode] = {
            "step_ms": statistics.median(result.step_s) * 1e3,
            "syncs_per_step": statistics.median(result.syncs_per_step),
            "peak_mib": (max(result.peak_bytes) / 2 ** 20) if result.peak_bytes else None,
            "scaler": result.scaler,
        }
    out["step_time_ratio"] = statistics.median(round_ratios)
    out["extra_syncs_per_step"] = (out["patched"]["syncs_per_step"]
                                   - out["unpatched"]["syncs_per_step"])
    if out["patched"]["peak_mib"] and out["unpatched"]["peak_mib"]:
        out["peak_memory_ratio"] = out["patched"]["peak_mib"] / out["unpatched"]["peak_mib"]
    else:
        out["peak_memory_ratio"] = None
    out.update(rounds=rounds, steps=steps)
    return out


# -- results ------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": platform.machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    cuda=torch.version.cuda,
                    bf16=torch.cuda.is_bf16_supported(including_emulation=False))
    else:
        info["gpu"] = None
    return info


def _cell(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def to_markdown(results: dict[str, Any]) -> str:
    """The suite's results as markdown, ready to paste into docs/benchmarks.md."""
    m = results["machine"]
    lines = [f"GPU suite on {m.get('gpu') or 'no GPU'} (CUDA {m.get('cuda')}, torch "
             f"{m['torch']}, Python {m['python']}); command: `make gpu-suite`", ""]
    compares = results.get("compare", {})
    if compares:
        lines += ["| run | scaler (patched) | syncs/step unpatched | syncs/step patched | "
                  "step ms unpatched | step ms patched | ratio | peak MiB unpatched | "
                  "peak MiB patched |", "|---|---|---|---|---|---|---|---|---|"]
        for name, c in sorted(compares.items()):
            u, p = c["unpatched"], c["patched"]
            lines.append(
                f"| {name} | {p['scaler'] or 'none'} | {_cell(u['syncs_per_step'], 'g')} | "
                f"{_cell(p['syncs_per_step'], 'g')} | {_cell(u['step_ms'], '.2f')} | "
                f"{_cell(p['step_ms'], '.2f')} | {_cell(c['step_time_ratio'], '.3f')} | "
                f"{_cell(u['peak_mib'], '.0f')} | {_cell(p['peak_mib'], '.0f')} |")
        lines.append("")
    runs = results.get("runs", {})
    if runs:
        lines += ["| fit | scaler | iterations | skipped (optimizer step count held) | "
                  "scaler skipped | guard skipped | weights finite |",
                  "|---|---|---|---|---|---|---|"]
        for name, run in sorted(runs.items()):
            scaler_skipped = (run["scaler_stats"] or {}).get("skipped")
            guard_skipped = (run["guard_stats"] or {}).get("skipped")
            lines.append(f"| {name} | {run['scaler'] or 'none'} | {run['iterations']} | "
                         f"{len(run['skipped_iterations'])} | {_cell(scaler_skipped, 'g')} | "
                         f"{_cell(guard_skipped, 'g')} | {run['finite']} |")
        lines.append("")
    multi = results.get("multi", {})
    if multi:  # test_gpu_multi.py: checks and step-ratio rows, 2 GPUs, NCCL
        lines += ["multi-GPU (2 ranks, NCCL):", ""]
        lines += [row if str(row).startswith("|") else f"- {name}: {row}"
                  for name, row in sorted(multi.items())]
        lines.append("")
    return "\n".join(lines)


def write_results(results: dict[str, Any], folder: str | Path) -> tuple[Path, Path]:
    """Write ``gpu_suite.json`` and ``gpu_suite.md`` into ``folder``; returns both paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine(), **results}
    json_path, md_path = folder / "gpu_suite.json", folder / "gpu_suite.md"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n",
                         encoding="utf-8")
    md_path.write_text(to_markdown(data) + "\n", encoding="utf-8")
    return json_path, md_path
