"""Headless XTTS v2 GPT fine-tuning from local files, with every training patch on.

    python headlessXttsTrain.py --base-dir base/ --train-manifest data/train.csv \\
        --eval-manifest data/eval.csv --language am --output-dir runs/am --preset t4

Reads the base model (model.pth, config.json, dvae.pth, mel_stats.pth, vocab.json)
and coqui-format manifests (``audio_file|text|speaker_name``); never downloads.
Trains with the real coqui Trainer (coqui-tts 0.28, coqui-tts-trainer 0.4) and
writes progress to ``<output-dir>/train.log``, one JSON line per start, stop, failure
and end of a run to ``<output-dir>/headless_runs.jsonl``, and the patches' reports
(``dropped_samples.jsonl``, ``nonfinite_events.jsonl``) to ``<output-dir>``.

Before anything is built, :func:`preflight` checks the settings, the command line's
numbers, the manifests (UTF-8, ``|``, the header, every audio file), the vocabulary and
its ``[lang]`` token, the language, the base files, the output folder and ``--resume``;
once the model exists, that model.pth's weights are this model's. Bad input is one
paragraph on stderr and exit code 2, with no traceback and no input file changed. An
error inside the coqui Trainer is one paragraph and exit code 1, its traceback in
train.log and its run folder kept; an internal error keeps its traceback (exit 1).

    python headlessXttsTrain.py --demo      # or: make demo

builds a tiny synthetic Amharic setup and shows every patch at work on the CPU
(see :mod:`demo.xtts_demo`).
"""

try:
    from utils import training_patches  # noqa: F401  the one line: patches on before anything else
except Exception as _exc:  # noqa: BLE001 - a bad TRAINING_PATCHES_* value: main() says it in one paragraph
    _ACTIVATION_ERROR: Exception | None = _exc
else:
    _ACTIVATION_ERROR = None

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger("training_patches")

# What each base file is for: named in the error when one is missing.
BASE_FILES = {
    "model": ("model.pth", "the base XTTS checkpoint whose GPT weights are fine-tuned"),
    "config": ("config.json", "the base model's XTTS config (model sizes, audio settings)"),
    "dvae": ("dvae.pth", "the discrete VAE that turns training audio into the GPT's audio "
                         "tokens"),
    "mel_stats": ("mel_stats.pth", "the mel-spectrogram normalisation statistics of the DVAE"),
    "vocab": ("vocab.json", "the BPE tokenizer vocabulary (with the [language] token)"),
}
PRESETS = {
    # A 16 GB T4: fp16 (no bf16 there), small batches, long accumulation (the coqui
    # recipe recommends batch * accumulation >= 252), clips up to ~11.6 s, 2 workers.
    "t4": {"precision": "fp16", "batch_size": 2, "grad_accum": 126, "max_audio_seconds": 11.6,
           "max_text_tokens": 200, "workers": 2, "lr": 5e-6},
}
LOG_NAME = "train.log"
RUNS_NAME = "headless_runs.jsonl"
DEFAULT_OUTPUT = Path("xtts_finetune")
DEMO_OUTPUT = Path("demo_output")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what applies)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


class UsageError(Exception):
    """A problem with the command line or the input files (exit code 2)."""


class TrainingStopped(Exception):
    """An error raised inside the coqui Trainer (exit code 1): said once, as one paragraph;
    its traceback goes to train.log and the run folder is kept."""

    def __init__(self, message: str, error: BaseException) -> None:
        super().__init__(message)
        self.error = error


# -- command line -------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headlessXttsTrain.py",
        description="Fine-tune the XTTS v2 GPT on a new language from local files, headless, "
                    "with training-patches on (NaN guard, safe fp16 scaler, frozen base "
                    "vocabulary, checked checkpoints, dataset guard).",
        formatter_class=_HelpFormatter)
    base = parser.add_argument_group("base model (local files; nothing is downloaded)")
    base.add_argument("--base-dir", type=Path,
                      help="folder holding model.pth, config.json, dvae.pth, mel_stats.pth and "
                           "vocab.json; the options below override single files")
    for key, (name, what) in BASE_FILES.items():
        flag = "--" + key.replace("_", "-")
        base.add_argument(flag, type=Path, dest=f"{key}_file",
                          help=f"{name}: {what} (default: BASE_DIR/{name})")
    data = parser.add_argument_group("data")
    data.add_argument("--train-manifest", type=Path,
                      help="coqui-format manifest of the training clips: a header "
                           "'audio_file|text|speaker_name', paths relative to its folder")
    data.add_argument("--eval-manifest", type=Path,
                      help="manifest of the evaluation clips (same format); none: no evaluation")
    data.add_argument("--language", default="am",
                      help="language code of the transcripts; it must be a [code] token of "
                           "the vocabulary and known to coqui or registered (am is)")
    run = parser.add_argument_group("training")
    run.add_argument("--output-dir", type=Path, default=None,
                     help="where the run folder, checkpoints, train.log, "
                          "headless_runs.jsonl and the patches' reports (dropped_samples.jsonl, "
                          "nonfinite_events.jsonl) go (default: xtts_finetune; with --demo: "
                          "demo_output)")
    run.add_argument("--epochs", type=int, default=10, help="passes over the training data")
    run.add_argument("--batch-size", type=int, default=None,
                     help="clips per batch (default 4, or the preset's)")
    run.add_argument("--grad-accum", type=int, default=None,
                     help="batches accumulated per optimizer step (default 1, or the preset's)")
    run.add_argument("--lr", type=float, default=None,
                     help="learning rate of AdamW (default 5e-6)")
    run.add_argument("--precision", choices=["auto", "fp16", "bf16", "fp32"], default="auto",
                     help="auto: bf16 where the GPU supports it, fp16 with SafeGradScaler on "
                          "GPUs without bf16 (T4), fp32 on the CPU")
    run.add_argument("--no-fused", dest="fused", action="store_false",
                     help="use the plain AdamW instead of fused=True (the default where torch "
                          "has the fused kernel for the device: CUDA, and the CPU): with it the "
                          "NaN guard skips bad steps inside the kernel and reads nothing per step")
    run.add_argument("--text-loss-weight", type=float, default=0.01,
                     help="weight of the text cross-entropy loss (coqui's "
                          "gpt_loss_text_ce_weight)")
    run.add_argument("--mel-loss-weight", type=float, default=1.0,
                     help="weight of the mel (audio-token) cross-entropy loss "
                          "(gpt_loss_mel_ce_weight)")
    run.add_argument("--max-audio-seconds", type=float, default=None,
                     help="longest clip trained on; longer ones are dropped and listed "
                          "(default 11.6)")
    run.add_argument("--max-text-tokens", type=int, default=None,
                     help="longest transcript in tokens; longer ones are dropped and listed "
                          "(default 200)")
    run.add_argument("--workers", type=int, default=None,
                     help="data-loader worker processes (default 0, or the preset's)")
    run.add_argument("--save-step", type=int, default=1000,
                     help="write a checkpoint every this many optimizer steps")
    run.add_argument("--keep-checkpoints", type=int, default=3,
                     help="how many newest checkpoints to keep")
    run.add_argument("--resume", default=None, metavar="auto|PATH",
                     help="'auto': continue the newest run in OUTPUT_DIR that has a checkpoint "
                          "(a fresh start when there is none); or the run folder to continue "
                          "(it holds config.json and checkpoint_<step>.pth), or its newest "
                          "checkpoint_<step>.pth")
    run.add_argument("--extend-vocab", type=Path, default=None, metavar="CORPUS",
                     help="text of --language (one sentence a line, or a coqui manifest): "
                          "extend the base vocab.json with [LANGUAGE], every character and "
                          "up to 2,000 BPE pieces learned from it (as training-patches "
                          "extend-tokenizer does) into OUTPUT_DIR/vocab_LANGUAGE.json, the "
                          "base file untouched, and train with it: the model's new rows grow "
                          "from the base ones, the base rows stay frozen")
    run.add_argument("--preset", choices=sorted(PRESETS),
                     help="t4: fits a 16 GB T4 (fp16, batch 2 x 126 accumulation, clips up to "
                          "11.6 s, 2 workers, lr 5e-6); explicit options win")
    run.add_argument("--seed", type=int, default=1, help="training seed")
    run.add_argument("--print-step", type=int, default=25,
                     help="log a progress line every this many steps")
    parser.add_argument("--demo", action="store_true",
                        help="build a tiny synthetic Amharic setup in OUTPUT_DIR (a tiny base "
                             "model trained on an English vocabulary, the vocabulary extended "
                             "with Amharic) and fine-tune it on the CPU with a NaN injected, an "
                             "interruption and --resume auto, then print a summary read from "
                             "the run (no base files needed; about a minute)")
    aids = parser.add_argument_group("testing aids (see the patches at work on your own setup)")
    aids.add_argument("--inject-nan-step", type=int, default=None, metavar="N",
                      help="poison the batch of trainer step N with a NaN (a forward hook adds "
                           "NaN to the GPT's text-embedding output): the NaN guard must skip "
                           "that optimizer step and record it in nonfinite_events.jsonl")
    aids.add_argument("--interrupt-after-step", type=int, default=None, metavar="K",
                      help="send this process SIGINT once the trainer has done K steps, as a "
                           "Ctrl-C or a preemption notice would: the coqui Trainer writes a "
                           "checkpoint and exits (code 130); continue with --resume auto")
    return parser


@dataclass
class Settings:
    """The resolved command line: files checked, preset applied, precision decided."""

    files: dict[str, Path]
    train_manifest: Path
    eval_manifest: Path | None
    language: str
    output_dir: Path
    epochs: int
    batch_size: int
    grad_accum: int
    lr: float
    precision: str
    text_loss_weight: float
    mel_loss_weight: float
    max_audio_seconds: float
    max_text_tokens: int
    workers: int
    save_step: int
    keep_checkpoints: int
    resume: str | None
    seed: int
    print_step: int
    inject_nan_step: int | None = None
    interrupt_after_step: int | None = None
    fused: bool = True
    extend_vocab: Path | None = None
    resume_folder: Path | None = None  # the run folder to continue (--resume FOLDER or FILE)
    base_keys: list[str] | None = None  # the weights' names in model.pth (read in pre-flight)


def _missing(path: Path | None, what: str, flag: str) -> str:
    where = f"{path}" if path is not None else "(not given)"
    return f"  {flag}: {where} not found: {what}"


def resolve(args: argparse.Namespace) -> Settings:
    """Check every input and apply the preset; raise :class:`UsageError` on bad input."""
    files: dict[str, Path] = {}
    problems: list[str] = []
    for key, (name, what) in BASE_FILES.items():
        path = getattr(args, f"{key}_file") or (args.base_dir / name if args.base_dir else None)
        if path is None or not Path(path).is_file():
            problems.append(_missing(path, f"{name} is {what}",
                                     "--" + key.replace("_", "-")))
        else:
            files[key] = Path(path)
    if args.train_manifest is None or not args.train_manifest.is_file():
        problems.append(_missing(args.train_manifest, "the training manifest "
                                 "(audio_file|text|speaker_name)", "--train-manifest"))
    if args.eval_manifest is not None and not args.eval_manifest.is_file():
        problems.append(_missing(args.eval_manifest, "the evaluation manifest", "--eval-manifest"))
    if problems:
        raise UsageError(
            "these input files are missing:\n" + "\n".join(problems) + "\nThis script never "
            "downloads: put the XTTS v2 base files in one folder and pass --base-dir, or name "
            "each file with its option (see --help).")
    if args.extend_vocab is not None and not args.extend_vocab.is_file():
        raise UsageError(
            f"--extend-vocab {args.extend_vocab}: not found. Expected the new language's text: "
            f"one sentence a line, or a coqui manifest (its text column).")
    preset = PRESETS.get(args.preset or "", {})

    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name)
        return value if value is not None else preset.get(name, default)

    precision = args.precision if args.precision != "auto" else preset.get("precision", "auto")
    for name in ("epochs", "batch_size", "grad_accum", "keep_checkpoints", "save_step"):
        value = pick(name, 1)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} is {value}; expected a whole number "
                             f"of at least 1.")
    for name in ("inject_nan_step", "interrupt_after_step"):
        value = getattr(args, name, None)
        if value is not None and value < (0 if name == "inject_nan_step" else 1):
            raise UsageError(f"--{name.replace('_', '-')} is {value}; expected a trainer step "
                             f"number (counted from 0; at least 1 for an interruption).")
    check_numbers(args, pick)
    return Settings(
        files=files, train_manifest=args.train_manifest, eval_manifest=args.eval_manifest,
        language=args.language, output_dir=args.output_dir or DEFAULT_OUTPUT,
        epochs=args.epochs,
        batch_size=pick("batch_size", 4), grad_accum=pick("grad_accum", 1),
        lr=pick("lr", 5e-6), precision=decide_precision(precision),
        text_loss_weight=args.text_loss_weight, mel_loss_weight=args.mel_loss_weight,
        max_audio_seconds=pick("max_audio_seconds", 11.6),
        max_text_tokens=pick("max_text_tokens", 200), workers=pick("workers", 0),
        save_step=args.save_step, keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        seed=args.seed, print_step=args.print_step,
        inject_nan_step=getattr(args, "inject_nan_step", None),
        interrupt_after_step=getattr(args, "interrupt_after_step", None),
        fused=getattr(args, "fused", True), extend_vocab=args.extend_vocab)


def check_numbers(args: argparse.Namespace, pick: Any) -> None:
    """Numbers the coqui Trainer takes without a word but cannot train with."""
    import math

    lr = pick("lr", 5e-6)
    if not (math.isfinite(lr) and lr > 0):
        raise UsageError(
            f"--lr is {lr!r}; expected a finite learning rate above 0 (the default, 5e-6, is "
            f"the XTTS fine-tuning recipe's). A NaN or infinite rate turns every weight NaN at "
            f"the first step, and 0 trains nothing while the run looks healthy.")
    workers = pick("workers", 0)
    if workers < 0:
        raise UsageError(f"--workers is {workers}; expected 0 (load data in the training "
                         f"process) or more worker processes, e.g. 2.")
    if args.print_step < 1:
        raise UsageError(f"--print-step is {args.print_step}; expected a whole number of steps "
                         f"of at least 1 between progress lines (the default is 25).")
    for flag, value in (("--text-loss-weight", args.text_loss_weight),
                        ("--mel-loss-weight", args.mel_loss_weight)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} is {value!r}; expected a finite weight of at least 0.")
    seconds = pick("max_audio_seconds", 11.6)
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"--max-audio-seconds is {seconds!r}; expected a clip length in "
                         f"seconds above 0 (default 11.6).")
    if pick("max_text_tokens", 200) < 1:
        raise UsageError(f"--max-text-tokens is {pick('max_text_tokens', 200)}; expected a "
                         f"whole number of tokens of at least 1 (default 200).")


def decide_precision(requested: str) -> str:
    """auto: bf16 where the GPU has it, fp16 (SafeGradScaler) on other GPUs, fp32 on the CPU."""
    import torch

    if requested == "auto":
        if not torch.cuda.is_available():
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    if requested in ("fp16", "bf16") and not torch.cuda.is_available():
        raise UsageError(f"--precision {requested} needs a CUDA GPU and none is visible; use "
                         f"--precision fp32 (or auto) on the CPU.")
    if requested == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError("--precision bf16: this GPU has no bf16 (a T4 has none); use fp16, "
                         "which trains safely with training-patches' SafeGradScaler.")
    return requested


def preflight(args: argparse.Namespace) -> Settings:
    """Every check of the command line, the settings and the input files, in one place.

    Runs before anything is built or written; each problem is one :class:`UsageError`
    paragraph (exit code 2), found with the library's own validators
    (:mod:`patches.tools.xtts_preflight`). Only the match of model.pth's keys with
    the model waits for the model, and is checked before the Trainer is built (see
    :func:`train`). No input file is changed.
    """
    if _ACTIVATION_ERROR is not None:
        raise _ACTIVATION_ERROR
    from patches.tools import xtts_preflight as pf

    try:
        options = pf.check_settings()
        pf.check_coqui_installed()
        settings = resolve(args)
        pf.check_language(settings.language, options)
        pf.check_manifest(settings.train_manifest, flag="--train-manifest")
        if settings.eval_manifest is not None:
            # build_config hands coqui one dataset rooted at the training manifest's folder
            pf.check_manifest(settings.eval_manifest, flag="--eval-manifest",
                              audio_root=settings.train_manifest.parent)
        # with --extend-vocab the base vocab need not hold [lang]: the extension adds it
        pf.check_vocab(settings.files["vocab"], settings.language,
                       require_language=settings.extend_vocab is None)
        settings.base_keys = pf.check_base_checkpoint(settings.files["model"])
        pf.check_torch_file(settings.files["dvae"], BASE_FILES["dvae"][1], flag="--dvae")
        pf.check_torch_file(settings.files["mel_stats"], BASE_FILES["mel_stats"][1],
                            flag="--mel-stats")
        pf.check_output_dir(settings.output_dir)
        if settings.resume is not None:
            _, settings.resume_folder = pf.check_resume(settings.resume)
    except pf.PreflightError as exc:
        raise UsageError(str(exc)) from None
    return settings


# -- logging ------------------------------------------------------------------

_log_handler: logging.Handler | None = None


def setup_logging(output_dir: Path) -> Path:
    """``<output_dir>/train.log`` gets the patches', the Trainer's and coqui's lines, and
    ``<output_dir>`` becomes the one folder of the patches' reports."""
    global _log_handler
    import patches

    output_dir.mkdir(parents=True, exist_ok=True)
    # Set before any data is read or any step runs, through the API (the environment
    # variable is read once, at activation): dropped_samples.jsonl and
    # nonfinite_events.jsonl go to <output-dir>, beside train.log, for every run in it.
    patches.advanced.set_output_dir(output_dir)
    log_file = output_dir / LOG_NAME
    handler = logging.FileHandler(log_file, encoding="utf-8")
    _log_handler = handler
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s",
                                           "%Y-%m-%d %H:%M:%S"))
    for name in ("training_patches", "trainer", "TTS"):
        target = logging.getLogger(name)
        target.addHandler(handler)
        if target.level == logging.NOTSET or target.level > logging.INFO:
            target.setLevel(logging.INFO)
    return log_file


def log_error(message: str, error: BaseException | None = None) -> None:
    """Write an error (and ``error``'s traceback) to train.log only: stderr gets one
    paragraph. Nothing happens before train.log exists."""
    if _log_handler is None:
        return
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, (), exc_info)
    _log_handler.handle(record)


# -- the run ------------------------------------------------------------------

def build_config(s: Settings) -> Any:
    """A GPTTrainerConfig from the base config.json and the command line."""
    from TTS.config.shared_configs import BaseDatasetConfig
    from TTS.tts.configs.xtts_config import XttsConfig
    from TTS.tts.layers.xtts.trainer.gpt_trainer import GPTArgs, GPTTrainerConfig

    base = XttsConfig()
    try:
        base.load_json(str(s.files["config"]))
    except Exception as exc:  # noqa: BLE001 - turned into one clear message
        raise UsageError(f"--config {s.files['config']}: could not be read as an XTTS config "
                         f"({type(exc).__name__}: {exc}). Expected the config.json that came "
                         f"with the base model.pth.") from None
    fields = {name: getattr(base.model_args, name) for name in GPTArgs.__dataclass_fields__
              if hasattr(base.model_args, name)}
    args = GPTArgs(**fields)
    args.xtts_checkpoint = ""   # loaded after the model is built (the vocabulary may have grown)
    args.gpt_checkpoint = ""
    args.tokenizer_file = str(s.files["vocab"])
    args.dvae_checkpoint = str(s.files["dvae"])
    args.mel_norm_file = str(s.files["mel_stats"])
    args.max_wav_length = int(s.max_audio_seconds * base.audio.sample_rate)
    args.max_text_length = s.max_text_tokens
    args.gpt_loss_text_ce_weight = s.text_loss_weight
    args.gpt_loss_mel_ce_weight = s.mel_loss_weight
    datasets = [BaseDatasetConfig(formatter="coqui", dataset_name="train",
                                  path=str(s.train_manifest.parent),
                                  meta_file_train=s.train_manifest.name,
                                  meta_file_val=(str(s.eval_manifest.resolve())
                                                 if s.eval_manifest else ""),
                                  language=s.language)]
    languages = list(base.languages)
    if s.language not in languages:
        languages.append(s.language)  # the saved config.json must list what it learned
    mixed = s.precision in ("fp16", "bf16")
    return GPTTrainerConfig(
        output_path=str(s.output_dir), run_name="xtts_finetune", project_name="xtts_finetune",
        model_args=args, audio=base.audio, languages=languages, datasets=datasets,
        batch_size=s.batch_size, eval_batch_size=s.batch_size, epochs=s.epochs,
        num_loader_workers=s.workers, num_eval_loader_workers=s.workers,
        run_eval=s.eval_manifest is not None, test_delay_epochs=10 ** 6,
        print_step=s.print_step, plot_step=s.print_step, log_model_step=10 ** 6,
        save_step=s.save_step, save_n_checkpoints=s.keep_checkpoints, save_checkpoints=True,
        optimizer="AdamW", optimizer_wd_only_on_weights=True,
        optimizer_params={"betas": [0.9, 0.96], "eps": 1e-8, "weight_decay": 1e-2,
                          **({"fused": True} if s.fused and fused_adamw_available() else {})},
        lr=s.lr, lr_scheduler="MultiStepLR",
        lr_scheduler_params={"milestones": [50000 * 18, 150000 * 18, 300000 * 18],
                             "gamma": 0.5, "last_epoch": -1},
        mixed_precision=mixed, precision=s.precision if mixed else "fp16",
        training_seed=s.seed, dashboard_logger="tensorboard", test_sentences=[])


def fused_adamw_available() -> bool:
    """Whether torch has a fused AdamW kernel for the device the Trainer will use."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


def find_resume(output_dir: Path) -> Path | None:
    """The newest run folder in ``output_dir`` holding a coqui checkpoint, or None."""
    runs = []
    for run in output_dir.glob("xtts_finetune-*"):
        ckpts = list(run.glob("checkpoint_*.pth")) + list(run.glob("best_model*.pth"))
        if ckpts:
            runs.append((max(c.stat().st_mtime for c in ckpts), run))
    return max(runs)[1] if runs else None


def load_base_weights(model: Any, files: dict[str, Path]) -> Any:
    """Load model.pth into the GPTTrainer, growing the vocabulary when it grew.

    Returns the loader's :class:`patches.checkpoint.LoadReport` (None with coqui's loader).
    """
    try:
        from patches.checkpoint import load_checkpoint
    except ImportError:
        load_checkpoint = None
    if load_checkpoint is not None:
        vocab = files.get("vocab")
        report = load_checkpoint(files["model"], model.xtts, policy="reset", strict=False,
                                 freeze=True, tokenizer=str(vocab) if vocab else None)
        kept = ", ".join(f"{k} {n}" for k, n in report.kept_rows.items())
        logger.info("training-patches: base weights loaded from %s%s", files["model"],
                    f" (vocabulary grew; trained rows kept: {kept})" if kept else "")
        return report
    logger.info("training-patches: patches.checkpoint is not available; loading the base "
                "weights with coqui's loader (the vocabulary must not have grown)")
    model.load_checkpoint(model.config, str(files["model"]), strict=False)
    return None


def base_vocab_rows(model_file: Path) -> int | None:
    """Rows of the text embedding in the base model.pth (read memory-mapped), or None."""
    try:
        from patches.checkpoint import read_checkpoint
    except ImportError:
        return None
    ckpt = read_checkpoint(model_file)
    state = ckpt.get("model", ckpt)
    for key, value in state.items():
        if key.endswith("text_embedding.weight"):
            return int(value.shape[0])
    return None


def freeze_on_resume(model: Any, files: dict[str, Path]) -> dict[str, Any] | None:
    """Freeze the base vocabulary rows of a resumed run whose vocabulary grew.

    A fresh start freezes them when the base weights load; a resume builds a new model
    and loads the run's checkpoint instead, so the freeze is set up here, before the
    Trainer restores the checkpoint (the freeze then keeps the restored base rows).
    """
    base = base_vocab_rows(files["model"])
    rows = int(model.xtts.gpt.text_embedding.weight.shape[0])
    if base is None or base >= rows:
        return None
    from patches.vocab_freeze import freeze_base_vocab

    handle = freeze_base_vocab(model, base)
    return {"base_vocab_size": base, "vocab_size": rows,
            "frozen_rows": [[r.start, r.stop - 1] for r in handle.rows]}


def _record(output_dir: Path, event: str, **fields: Any) -> None:
    """One JSON line in ``<output_dir>/headless_runs.jsonl`` (what the demo summary reads)."""
    from patches import _run

    # One file per rank under a launcher of several (the report merges them), strict JSON,
    # with the working directory (the report resolves the run's relative paths, --output-dir
    # runs/am, as the run did); best effort, as every record of the patches: a full disk
    # never ends the run here.
    _run.record_in(output_dir, RUNS_NAME, event, **fields)


def _load_report_record(report: Any) -> dict[str, Any] | None:
    return None if report is None else report.as_record()


def extended_vocab(s: Settings) -> Path:
    """``--extend-vocab``: the base vocab.json extended for ``s.language`` in the output
    folder (reused on a resume); see :func:`patches.tools.tokenizer.bpe.extend_for_run`."""
    from patches.tools.tokenizer import TokenizerToolError
    from patches.tools.tokenizer.bpe import extend_for_run

    try:
        path, _, _ = extend_for_run(s.files["vocab"], s.extend_vocab, s.output_dir, s.language)
    except TokenizerToolError as exc:
        raise UsageError(f"--extend-vocab {s.extend_vocab}: {exc}") from None
    return path


def inject_nan_hook(model: Any, trainer: Any, step: int) -> Any:
    """Testing aid: add NaN to the GPT's text-embedding output in trainer step ``step``."""
    import torch

    told: list[bool] = []

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        if module.training and trainer.total_steps_done == step:
            if not told:  # the NaN guard's replay of the batch runs this hook again
                told.append(True)
                logger.warning("training-patches: --inject-nan-step %d: the text embedding's "
                               "output of this batch is made NaN (testing aid)", step)
            return output + torch.tensor(float("nan"), dtype=output.dtype,
                                         device=output.device)
        return output

    return model.xtts.gpt.text_embedding.register_forward_hook(hook)


def train(s: Settings) -> dict[str, Any]:
    """Build the config, the model and the coqui Trainer; fit; return a summary."""
    import signal

    import torch
    from trainer import Trainer, TrainerArgs
    from TTS.tts.datasets import load_tts_samples
    from TTS.tts.layers.xtts.trainer.gpt_trainer import GPTTrainer

    import patches
    from patches.integrations import xtts_dataset

    torch.manual_seed(s.seed)
    if s.extend_vocab is not None:
        s.files["vocab"] = extended_vocab(s)
    config = build_config(s)
    continue_path = ""
    if s.resume:
        found = find_resume(s.output_dir) if s.resume == "auto" else s.resume_folder
        if found is None:
            logger.info("training-patches: --resume auto found no checkpoint in %s; starting "
                        "fresh", s.output_dir)
        else:
            continue_path = str(found)
            logger.info("training-patches: resuming the run in %s", found)
    train_samples, eval_samples = load_tts_samples(
        config, eval_split=s.eval_manifest is not None)
    model = GPTTrainer.init_from_config(config)
    if s.base_keys is not None:  # pre-flight's last check: model.pth is this model's
        from patches.tools.xtts_preflight import PreflightError, check_model_keys

        try:
            check_model_keys(s.files["model"], model.xtts, keys=s.base_keys)
        except PreflightError as exc:
            raise UsageError(str(exc)) from None
    report = None
    resume_freeze = None
    if not continue_path:
        report = load_base_weights(model, s.files)
    else:
        resume_freeze = freeze_on_resume(model, s.files)

    def on_interrupt(trainer: Any) -> None:
        # Ctrl-C, SIGTERM or SIGHUP: the coqui integration has finished the step, written
        # checkpoint_<step>.pth when a step finished since the last one and said so in one
        # line; the process exits with 128 + the signal's number next (130, 143, 129).
        from patches.integrations.coqui_interrupt import interrupted_by

        checkpoint = Path(trainer.output_path) / f"checkpoint_{trainer.total_steps_done}.pth"
        newest = find_resume(s.output_dir)
        logger.debug("training-patches: continue with the same command and --resume auto")
        _record(s.output_dir, "interrupted", run_folder=str(trainer.output_path),
                step=int(trainer.total_steps_done), signal=interrupted_by(trainer) or "SIGINT",
                checkpoint=str(checkpoint) if checkpoint.is_file() else None,
                resume_from=str(newest) if newest is not None else None,
                patch_stats=patches.stats())

    callbacks: dict[str, Any] = {"on_keyboard_interrupt": on_interrupt}
    if s.interrupt_after_step is not None:
        def interrupt(trainer: Any) -> None:
            if trainer.total_steps_done == s.interrupt_after_step:
                logger.warning("training-patches: --interrupt-after-step %d: sending SIGINT to "
                               "this process (testing aid)", s.interrupt_after_step)
                os.kill(os.getpid(), signal.SIGINT)
        callbacks["on_train_step_end"] = interrupt
    trainer = Trainer(TrainerArgs(continue_path=continue_path, grad_accum_steps=s.grad_accum),
                      config, str(s.output_dir), model=model, train_samples=train_samples,
                      eval_samples=eval_samples or None, parse_command_line_args=False,
                      callbacks=callbacks)
    if s.inject_nan_step is not None:
        inject_nan_hook(model, trainer, s.inject_nan_step)
    start_step = int(trainer.total_steps_done)
    # what the Trainer will run: continuing, coqui reads the run folder's config.json
    # instead of the one built from this command line
    epochs, batch_size = int(trainer.config.epochs), int(trainer.config.batch_size)
    lr = float(trainer.config.lr)
    ignored = [f"--{name.replace('_', '-')} {asked} (the run uses {used})"
               for name, asked, used in (("epochs", s.epochs, epochs),
                                         ("batch_size", s.batch_size, batch_size),
                                         ("lr", s.lr, lr)) if asked != used]
    if continue_path and ignored:
        logger.warning("training-patches: continuing %s with its own config.json, as coqui does: "
                       "%s not applied. To change them, start a new run from its weights "
                       "(--base-dir) instead of --resume.", trainer.output_path, ", ".join(ignored))
    _record(s.output_dir, "start", run_folder=str(trainer.output_path),
            resumed_from=trainer.args.restore_path if continue_path else None,
            start_step=start_step, epochs=epochs, language=s.language,
            vocab=str(s.files["vocab"]), train_samples=len(train_samples),
            base_weights=_load_report_record(report), resume_freeze=resume_freeze,
            inject_nan_step=s.inject_nan_step, interrupt_after_step=s.interrupt_after_step)
    started = time.monotonic()
    logger.info("training-patches: training %d epochs, %d training samples, precision %s, "
                "batch %d x %d accumulation, lr %g, run folder %s", epochs, len(train_samples),
                s.precision, batch_size, s.grad_accum, lr, trainer.output_path)
    fit_trainer(trainer, s)
    final = Path(trainer.output_path) / f"checkpoint_{trainer.total_steps_done}.pth"
    if trainer.total_steps_done > start_step and not final.exists():
        # coqui keeps the last weights only when they are the best so far or fall on a
        # save step: write them, so that the end of a run is never lost.
        trainer.save_checkpoint()
    dropped = xtts_dataset.log_summary()
    stats = patches.stats()
    result = {
        "steps": int(trainer.total_steps_done), "start_step": start_step,
        "seconds": round(time.monotonic() - started, 1), "run_folder": str(trainer.output_path),
        "checkpoints": sorted(p.name for p in Path(trainer.output_path).glob("*.pth")),
        "dropped_samples": dropped["total"], "patch_stats": stats,
    }
    logger.info("training-patches: finished: %s", result)
    _record(s.output_dir, "finished", **result)
    from patches.tools.report import log_report
    log_report(s.output_dir)  # <output-dir>/training_report.png: `training-patches report`
    return result


def fit_trainer(trainer: Any, s: Settings) -> None:
    """``trainer.fit()``, with an error raised inside it said once and its run folder kept.

    coqui's ``fit`` prints the traceback, removes a run folder holding no checkpoint and
    exits 1 on any error. Its training loop (``_fit``) is wrapped on this one Trainer so
    the error comes back here instead; Ctrl-C, SIGTERM and SIGHUP end ``fit`` with
    ``SystemExit(130/143/129)`` once a checkpoint is written (the coqui integration), and
    that passes through.
    """
    failure: list[BaseException] = []
    inner = getattr(trainer, "_fit", None)
    if callable(inner):
        def fit_keeping_the_error() -> None:
            try:
                inner()
            except Exception as exc:  # noqa: BLE001 - reported once, by TrainingStopped
                failure.append(exc)
        trainer._fit = fit_keeping_the_error
    try:
        trainer.fit()
    except SystemExit as exc:  # a coqui without _fit: its fit turns any error into exit 1
        if exc.code in (0, None) or (isinstance(exc.code, int) and exc.code > 128):
            raise  # a normal end, or a signal's (130, 143, 129)
        failure.append(exc.__context__ if exc.__context__ is not None else exc)
    if not failure:
        return
    error = failure[0]
    run_folder = Path(trainer.output_path)
    checkpoints = sorted(p.name for p in run_folder.glob("*.pth")) if run_folder.is_dir() else []
    text = str(error).strip()
    # The library's own errors (a NaN streak, a dataset mostly unusable, a scale floor, ...)
    # are paragraphs that say what to do; anything else is shown with its type.
    own = type(error).__module__.split(".")[0] == "patches"
    what = text if own else f"{type(error).__name__}: {text or '(no message)'}"
    message = (
        f"training stopped inside the coqui Trainer at step {trainer.total_steps_done}: "
        f"{what.removeprefix('training-patches: ')} The run folder {run_folder} is kept "
        f"({', '.join(checkpoints) if checkpoints else 'no checkpoint yet'}); the traceback is "
        f"in {s.output_dir / LOG_NAME}."
        + ("" if own else " This error did not come from a check of your input: if the "
                          "traceback points into coqui or training-patches, report it with "
                          "train.log."))
    _record(s.output_dir, "failed", run_folder=str(run_folder),
            step=int(trainer.total_steps_done), error=f"{type(error).__name__}: {text}")
    raise TrainingStopped(message, error)


def demo(args: argparse.Namespace) -> int:
    """``--demo``: the whole story on a tiny synthetic Amharic setup (see xtts_demo)."""
    from demo.xtts_demo import DemoError, run_demo

    given = [flag for flag in ("base_dir", *(f"{k}_file" for k in BASE_FILES), "train_manifest",
                               "eval_manifest", "resume", "extend_vocab", "preset")
             if getattr(args, flag, None) is not None]
    if given:
        raise UsageError("--demo builds its own base model and data; leave out "
                         + ", ".join("--" + g.replace("_file", "").replace("_", "-")
                                     for g in given) + " (only --output-dir applies).")
    try:
        _, ok = run_demo(args.output_dir or DEMO_OUTPUT, Path(__file__).resolve())
    except DemoError as exc:
        raise UsageError(str(exc)) from None
    return 0 if ok else 1


def _folder_in_use(error: BaseException) -> bool:
    """Another run holds the run folder this one would continue (one paragraph, exit 2)."""
    try:
        from patches import RunFolderInUse
    except ImportError:
        return False
    return isinstance(error, RunFolderInUse)


def _user_error(error: BaseException) -> bool:
    """A failed activation the user can fix: a bad setting, the library or torch missing,
    or (strict mode) a patch site that cannot land."""
    if isinstance(error, (ImportError, ValueError)):
        return True
    try:
        from patches.advanced import PatchSiteError
    except ImportError:
        return False
    return isinstance(error, PatchSiteError)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 trained, 2 bad input (one paragraph, nothing built), 1 an error during
    training (one paragraph; its traceback in train.log), 130/143/129 interrupted by
    Ctrl-C/SIGTERM/SIGHUP (a checkpoint written when a step finished since the last one)."""
    global _log_handler
    _log_handler = None  # a train.log of this run only
    parser = build_parser()
    args = parser.parse_args(argv)

    def say(text: str) -> None:
        print(f"{parser.prog}: error: {text.strip().removeprefix('training-patches: ')}",
              file=sys.stderr)

    try:
        if args.demo:
            return demo(args)
        settings = preflight(args)
        log_file = setup_logging(settings.output_dir)
        logger.info("training-patches: headless XTTS fine-tune; progress in %s", log_file)
        train(settings)
    except UsageError as exc:
        log_error(f"training-patches: refused: {exc}")
        say(str(exc))
        return 2
    except TrainingStopped as exc:
        log_error(str(exc), exc.error)
        say(str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - an internal error: traceback kept, also in the log
        if exc is _ACTIVATION_ERROR and _user_error(exc):
            say(str(exc))
            return 2
        if _folder_in_use(exc):  # --resume of a run another process is training
            log_error(f"training-patches: refused: {exc}")
            say(str(exc))
            return 2
        log_error(f"internal error: {type(exc).__name__}: {exc}", exc)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
