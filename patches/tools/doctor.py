"""``training-patches doctor``: what this machine can train with, and what is missing.

``--json FILE`` (``-``: stdout, instead of the text) writes one strict JSON object:
``{"tool", "format", "ok", "exit_code", "checks": [{"status": "ok"|"warn"|"FAIL", "what",
"detail"}]}``. Exit 1 when a check FAILs."""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import os
import sys

import torch

import patches

from .. import _registry, _upstream
from .._api import check_settings
from .._options import OPTIONS, ConfigError, owner_text
from ._output import STDOUT, OutputRefused, WriteFailed, check_output, tool_json, write_json

OK, WARN, FAIL = "ok  ", "warn", "FAIL"
PROG = "training-patches doctor"
JSON_FORMAT = 1  # raised when a key changes meaning or goes away


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _upstream_check(dist: str, why: str) -> tuple[str, str, str] | None:
    """The check of a distribution an integration patches, read as the banner reads it: the
    version of the copy this process imports (a trainer's vendored ``TTS/`` included) and
    where that was read; WARN outside the integration's supported range."""
    for integ in _registry.integrations().values():
        if integ.distribution != dist or not integ.module:
            continue
        found = _upstream.upstream_version(integ)
        if found.version is None and not found.vendored:
            return None  # not installed: the plain check says so
        problem = _registry.version_problem(integ, found)
        if problem is not None:
            return WARN, dist, problem.message
        return OK, dist, f"{found.version}, read from {found.detail}"
    return None


def doctor_checks() -> list[tuple[str, str, str]]:
    """(status, what, detail) for each thing a fine-tune needs."""
    checks: list[tuple[str, str, str]] = []
    checks.append((OK, "python", sys.version.split()[0]))
    checks.append((OK, "torch", torch.__version__))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            major, minor = torch.cuda.get_device_capability(i)
            bf16 = torch.cuda.is_bf16_supported()
            precision = "bf16" if bf16 else "fp16 with SafeGradScaler (no bf16 on this GPU)"
            checks.append((OK, f"cuda:{i}", f"{name}, compute {major}.{minor}, "
                                            f"use {precision}"))
    else:
        checks.append((WARN, "cuda", "no CUDA GPU: training runs on the CPU in fp32 (demo and "
                                     "tests only; a real fine-tune needs a GPU)"))
    for dist, why in (("wrapt", "patching"), ("numpy", "data"), ("sentencepiece", "tokenizers"),
                      ("coqui-tts", "XTTS (extra 'xtts')"),
                      ("coqui-tts-trainer", "the coqui Trainer"),
                      ("torchaudio", "audio (extra 'xtts')"), ("torchcodec", "audio decoding"),
                      ("six", "imported by coqui-tts, not declared by it")):
        upstream = _upstream_check(dist, why)
        if upstream is not None:
            checks.append(upstream)
            continue
        version = _version(dist)
        required = dist in ("wrapt", "numpy", "sentencepiece")
        status = OK if version else (FAIL if required else WARN)
        checks.append((status, dist, version or f"missing: needed for {why}"))
    ffmpeg = ctypes.util.find_library("avutil")
    checks.append((OK if ffmpeg else WARN, "ffmpeg",
                   ffmpeg or "FFmpeg shared libraries missing: audio cannot be decoded "
                             "(Debian/Ubuntu: apt-get install ffmpeg)"))
    applied = patches.advanced.applied()
    checks.append((OK, "patches", ", ".join(applied) if applied else
                   "none applied in this process (the trainer applies them with "
                   "`from utils import training_patches`)"))
    checks.append(settings_check())
    return checks


def settings_check() -> tuple[str, str, str]:
    """The ``TRAINING_PATCHES_*`` settings, validated by the very function activation uses
    (:func:`patches._api.check_settings`): FAIL with activation's own paragraph when the
    one import line would stop on them."""
    env = {k: v for k, v in os.environ.items() if k.startswith("TRAINING_PATCHES_")}
    try:
        check_settings()
    except ConfigError as exc:
        return (FAIL, "settings", f"{exc} (the one import line stops with this error)")
    owners = {option.env: owner_text(option) for option in OPTIONS.values()}
    listed = ", ".join(f"{k}={v}" + (f" ({owners[k]})" if k in owners else "")
                       for k, v in sorted(env.items()))
    return (OK, "settings", listed or "defaults (no TRAINING_PATCHES_* variable set)")


def _doctor(args: argparse.Namespace) -> int:
    try:  # before the checks: a refused --json costs nothing
        if args.json is not None:
            check_output(args.json, prog=PROG, what="--json", force=args.force,
                         example="doctor.json", own=tool_json(PROG))
    except OutputRefused as exc:
        print(str(exc), file=sys.stderr)
        return 2
    checks = doctor_checks()
    failed = any(status == FAIL for status, _, _ in checks)
    if args.json is not None:
        try:
            write_json(args.json, {
                "tool": PROG, "format": JSON_FORMAT, "ok": not failed,
                "exit_code": 1 if failed else 0,
                "checks": [{"status": status.strip(), "what": what, "detail": detail}
                           for status, what, detail in checks]}, replace=args.force, prog=PROG)
        except WriteFailed as exc:  # the system refused the write: not a usage error
            print(f"{PROG}: --json: {exc}", file=sys.stderr)
            return 1
        except (OutputRefused, OSError) as exc:
            print(str(exc) if isinstance(exc, OutputRefused) else
                  f"{PROG}: could not write --json {args.json} ({exc.strerror or exc}). "
                  f"Expected a writable place; give another path.", file=sys.stderr)
            return 2
        if args.json == STDOUT:  # the JSON object is the whole of stdout
            return 1 if failed else 0
    width = max(len(what) for _, what, _ in checks)
    for status, what, detail in checks:
        print(f"[{status}] {what:<{width}}  {detail}")
    if args.json is not None:
        print(f"json: {args.json}")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``doctor`` to the ``training-patches`` command."""
    cmd = sub.add_parser("doctor", help="check this machine for what a fine-tune needs",
                         description=__doc__.split("\n\n", 1)[1])
    cmd.add_argument("--json", metavar="FILE",
                     help="also write the checks as one strict JSON object; - puts it on "
                          "stdout instead of the text")
    cmd.add_argument("--force", action="store_true", help="replace an existing --json FILE")
    cmd.set_defaults(handler=_doctor)
