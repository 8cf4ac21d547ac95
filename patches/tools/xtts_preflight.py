"""Pre-flight checks of an XTTS fine-tune's inputs, before any model or Trainer is built.

What the coqui stack does with bad input, measured with coqui-tts 0.28: an empty manifest
is an ``IndexError``, a Latin-1 one a ``UnicodeDecodeError``, commas a bare
``AssertionError``; rows whose audio is missing are dropped with one count in the log
("No training samples found" when all are); an unknown language is found only after
every sample was dropped; and a model.pth that is not an XTTS checkpoint (``dvae.pth``
passed by mistake) loads 0 of 627 keys with ``strict=False`` and trains from random
weights. Each function here checks one input and raises :class:`PreflightError`, one
paragraph naming the file, what was found, what was expected and what to do. Nothing
is written, and no input file is changed.

The checks reuse the library's own validators: the settings through
:func:`patches._api.check_settings` (what activation runs), the languages of
:mod:`patches.languages`, the language token through
:mod:`patches.integrations.xtts_language`, checkpoints
through :func:`patches.checkpoint.read_checkpoint` and the loader's key matching, and the
output folder through :func:`patches._options.output_dir_problem`. ``headlessXttsTrain.py``
calls them in its ``preflight()``; other XTTS trainers may call them too. A tool (issue 40:
moved from ``patches.integrations.xtts_preflight``, a deprecated alias for one release):
``import patches.auto`` never loads it.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _options, languages
from .._api import check_settings as validate_settings
from ..checkpoint import CheckpointError, read_checkpoint
from ..checkpoint.plan import align_keys, model_state
from ..integrations.xtts_language import (LanguageTokenMissingError, check_language_token,
                                          language_token_code)

MANIFEST_COLUMNS = ("audio_file", "text", "speaker_name")
MAX_LISTED = 10  # missing audio files or bad rows named in one error


class PreflightError(ValueError):
    """An input of a fine-tune cannot be used; the message is one paragraph."""


@dataclass
class ManifestSummary:
    """What :func:`check_manifest` found in a usable manifest."""

    path: Path
    rows: int
    speakers: list[str] = field(default_factory=list)


# -- settings and packages -------------------------------------------------------------

def check_settings() -> _options.Options:
    """The ``TRAINING_PATCHES_*`` settings, validated as activation validates them."""
    try:
        return validate_settings()
    except _options.ConfigError as exc:
        raise PreflightError(str(exc)) from None


def check_coqui_installed() -> None:
    """coqui-tts (``TTS``) and coqui-tts-trainer (``trainer``) import."""
    for module, dist in (("TTS", "coqui-tts"), ("trainer", "coqui-tts-trainer")):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise PreflightError(
                f"training-patches: {dist} cannot be imported here ({type(exc).__name__}: "
                f"{exc}). XTTS fine-tuning needs coqui-tts 0.28 and coqui-tts-trainer 0.4 in "
                f"this Python ({__import__('sys').executable}). Install them with "
                f"`pip install -e '.[xtts]'` in the training-patches checkout (or "
                f"`pip install 'coqui-tts>=0.28,<0.29'`), then check with "
                f"`training-patches doctor`.") from None


# -- language ---------------------------------------------------------------------------

def known_languages() -> list[str]:
    """Every language code the XTTS tokenizer accepts with the patches on, aliases shown."""
    codes = [f"{lang.code} ({', '.join(lang.aliases)})" if lang.aliases else lang.code
             for lang in languages.registered_languages().values()]
    return sorted(codes + sorted(languages.COQUI_LANGUAGES - set(languages.registered_languages())))


def check_language(code: str, options: _options.Options | None = None) -> str:
    """The code the tokenizer will use for ``code`` (``amh`` -> ``am``); refuse a language
    that is neither coqui's nor registered, or registered while its patch is left off."""
    language = languages.get_language(code)
    base = languages.base_code(code)
    if language is None and base in languages.COQUI_LANGUAGES:
        return base
    if language is None:
        raise PreflightError(
            f"training-patches: --language {code!r} is not a language the XTTS tokenizer knows: "
            f"it is neither one of coqui-tts's 17 nor registered with training-patches. "
            f"Expected one of: {', '.join(known_languages())} (ISO 639-1 or 639-3 codes of a "
            f"registered language both work). Fix the code, or register the language "
            f"(patches.advanced.register_language('xx', cleaner=...)) in a trainer of your "
            f"own. Checked before any sample was read.")
    options = options or _options.current()
    off = [name for name in ("languages", "xtts_language") if name in options.disable]
    if off:
        raise PreflightError(
            f"training-patches: --language {code!r} ({language.name or language.code}) is "
            f"registered with training-patches, but TRAINING_PATCHES_DISABLE leaves "
            f"{' and '.join(off)} off, so coqui-tts's tokenizer would refuse it and every sample "
            f"would be dropped. Expected the patch on for a language coqui does not know: remove "
            f"{', '.join(off)} from TRAINING_PATCHES_DISABLE.")
    return language.code


# -- manifests ----------------------------------------------------------------------------

def _control_share(text: str) -> float:
    bad = sum(1 for ch in text if (ord(ch) < 32 and ch not in "\t\r\n") or 0x7F <= ord(ch) < 0xA0)
    return bad / max(1, len(text))


def _decode(path: Path, data: bytes, flag: str) -> str:
    """The manifest's text; UTF-16, a BOM, Latin-1 and binary files are refused."""
    what = f"{flag} {path}"
    fix = ("Save it as UTF-8 without a byte-order mark (in most editors: Save As, encoding "
           "UTF-8; or `iconv -f <encoding> -t UTF-8 old.csv > new.csv`).")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or (
            len(data) >= 4 and data.count(b"\x00") >= len(data) // 3
            and (data[1::2].count(0) > len(data) // 3 or data[0::2].count(0) > len(data) // 3)):
        raise PreflightError(
            f"training-patches: {what} is encoded as UTF-16 (found a byte-order mark or a zero "
            f"byte between letters). Expected UTF-8 text, as coqui's 'coqui' formatter reads it. "
            f"{fix}")
    if b"\x00" in data:
        zero = data.index(b"\x00")
        raise PreflightError(
            f"training-patches: {what} is a binary file ({len(data)} bytes, zero bytes at offset "
            f"{zero}), not a text manifest. Expected UTF-8 text with the header "
            f"'{'|'.join(MANIFEST_COLUMNS)}' and one clip per line. Check that the option names "
            f"the manifest (.csv/.txt), not an audio or model file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        latin = data.decode("latin-1")
        if _control_share(latin) > 0.05:
            raise PreflightError(
                f"training-patches: {what} is a binary file ({len(data)} bytes that are not "
                f"text), not a manifest. Expected UTF-8 text with the header "
                f"'{'|'.join(MANIFEST_COLUMNS)}' and one clip per line. Check that the option "
                f"names the manifest, not an audio or model file.") from None
        line = data[:exc.start].count(b"\n") + 1
        shown = data[exc.start:exc.start + 1].decode("cp1252", errors="replace")
        raise PreflightError(
            f"training-patches: {what} is not UTF-8: byte 0x{data[exc.start]:02X} on line {line} "
            f"is no UTF-8 character; it reads as {shown!r} in Latin-1/Windows-1252, the usual "
            f"encoding of spreadsheet exports. Expected UTF-8 (coqui reads manifests as "
            f"UTF-8 and stops with UnicodeDecodeError). {fix}") from None
    if text.startswith("\ufeff"):
        raise PreflightError(
            f"training-patches: {what} starts with a UTF-8 byte-order mark, which coqui reads "
            f"as part of the first column's name ('\\ufeffaudio_file'), so the header is not "
            f"found. Expected UTF-8 without a byte-order mark. {fix}")
    return text


def check_manifest(path: str | Path, *, audio_root: str | Path | None = None,
                   flag: str = "--train-manifest", max_listed: int = MAX_LISTED
                   ) -> ManifestSummary:
    """A coqui-format manifest: UTF-8, the header ``audio_file|text|speaker_name``, three
    ``|``-separated fields per row, at least one row, and every audio file present
    (``audio_root``, default the manifest's folder, is what the paths are relative to)."""
    path = Path(path)
    root = Path(audio_root) if audio_root is not None else path.parent
    header_text = "|".join(MANIFEST_COLUMNS)
    data = path.read_bytes()
    if not data.strip():
        raise PreflightError(
            f"training-patches: {flag} {path} is empty ({len(data)} bytes). Expected a header "
            f"line '{header_text}' and one line per clip, e.g. 'wavs/0001.wav|Hello.|spk1'. "
            f"Write the rows, or point {flag} at the right file.")
    text = _decode(path, data, flag)
    lines = text.splitlines()
    first = next(line for line in lines if line.strip())
    fields = [f.strip() for f in first.split("|")]
    if "|" not in first:
        sep = next((name for ch, name in ((",", "commas"), ("\t", "tabs"), (";", "semicolons"))
                    if ch in first), None)
        found = f"its first line {first[:80]!r} is separated by {sep}" if sep else (
            f"its first line {first[:80]!r} has no '|'")
        raise PreflightError(
            f"training-patches: {flag} {path}: {found}. Expected coqui's format: fields "
            f"separated by '|', the header '{header_text}', then 'audio_file|text|speaker' per "
            f"clip (transcripts often hold commas, so '|' is the separator). Rewrite the file "
            f"with '|' between the three fields.")
    if fields != list(MANIFEST_COLUMNS):
        if len(fields) == len(MANIFEST_COLUMNS) and fields[0] not in MANIFEST_COLUMNS:
            hint = ("It looks like a data row: add the header line first")
        elif len(fields) > len(MANIFEST_COLUMNS):
            hint = (f"It has {len(fields)} columns; keep only these three (an emotion or "
                    f"duration column is not used by XTTS training)")
        else:
            hint = "Use these three column names, in this order"
        raise PreflightError(
            f"training-patches: {flag} {path}: the header is {first[:120]!r}. Expected exactly "
            f"'{header_text}' ({len(MANIFEST_COLUMNS)} columns separated by '|'). {hint}.")
    reader = csv.DictReader(io.StringIO(text), delimiter="|")  # as coqui's formatter reads it
    bad: list[str] = []
    missing: list[str] = []
    rows = 0
    speakers: set[str] = set()
    for row in reader:
        rows += 1
        line = reader.line_num
        extra = row.get(None)  # type: ignore[call-overload]
        if extra is not None or any(row.get(c) is None for c in MANIFEST_COLUMNS):
            count = len(MANIFEST_COLUMNS) + len(extra or []) - sum(
                row.get(c) is None for c in MANIFEST_COLUMNS)
            bad.append(f"line {line}: {count} fields")
            continue
        if not row["audio_file"].strip():
            bad.append(f"line {line}: empty audio_file")
            continue
        speakers.add(row["speaker_name"])
        audio = root / row["audio_file"]
        if not audio.is_file():
            missing.append(str(audio))
    if rows == 0:
        raise PreflightError(
            f"training-patches: {flag} {path} has the header but no rows. Expected one line per "
            f"clip after the header ('wavs/0001.wav|Hello.|spk1'). Add the clips, or point "
            f"{flag} at the full manifest.")
    if bad:
        raise PreflightError(
            f"training-patches: {flag} {path}: {len(bad)} of {rows} rows do not have the "
            f"{len(MANIFEST_COLUMNS)} fields of the header '{header_text}' "
            f"({'; '.join(bad[:max_listed])}{'; ...' if len(bad) > max_listed else ''}). A "
            f"4th field usually means a '|' inside a transcript or an extra column. Expected "
            f"exactly three '|'-separated fields per row: remove the extra '|' or column.")
    if missing:
        raise PreflightError(
            f"training-patches: {flag} {path}: {len(missing)} of {rows} audio files are missing "
            f"(looked for relative to {root}): {', '.join(missing[:max_listed])}"
            f"{', ...' if len(missing) > max_listed else ''}. Expected every audio_file to name "
            f"an existing clip, as a path relative to {root}. coqui would drop those rows "
            f"with only a count in its log. Fix the paths or the folder, or remove the rows.")
    return ManifestSummary(path, rows, sorted(speakers))


# -- vocabulary ---------------------------------------------------------------------------

def check_vocab(path: str | Path, language: str, *, flag: str = "--vocab",
                require_language: bool = True) -> int:
    """vocab.json is a ``tokenizers`` tokenizer file holding ``[lang]`` as one special token
    for ``language`` (or, for a registered language, one of its codes); returns its size.
    ``require_language=False``: the file only has to parse (``--extend-vocab`` adds the
    token)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
        parsed = json.loads(text)
    except UnicodeDecodeError as exc:
        raise PreflightError(
            f"training-patches: {flag} {path} is not UTF-8 text (byte 0x{data[exc.start]:02X} "
            f"at offset {exc.start}), so not a tokenizer vocabulary. Expected the vocab.json that "
            f"came with the XTTS base model, or one extended from it.") from None
    except json.JSONDecodeError as exc:
        raise PreflightError(
            f"training-patches: {flag} {path} is not JSON ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}; {len(data)} bytes). Expected the tokenizer file (vocab.json) "
            f"of the XTTS base model, written by the `tokenizers` library. Copy it again from the "
            f"base model, or point {flag} at the right file.") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), dict):
        found = (f"a JSON {type(parsed).__name__}" if not isinstance(parsed, dict)
                 else f"JSON with the keys {sorted(parsed)[:8]}")
        raise PreflightError(
            f"training-patches: {flag} {path} is {found}, not a tokenizer file. Expected the "
            f"`tokenizers` format (keys 'model', 'added_tokens', ...) of the XTTS vocab.json. "
            f"Point {flag} at the base model's vocab.json, not at config.json or another file.")
    try:
        from tokenizers import Tokenizer  # lazy: tokenizers is optional (the xtts extra)

        backend = Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - any parse failure is this one message
        raise PreflightError(
            f"training-patches: {flag} {path} is JSON but the `tokenizers` library cannot read "
            f"it as a tokenizer ({str(exc)[:200]}). Expected the vocab.json of the XTTS base "
            f"model or one extended from it with the tokenizers library.") from None
    if not require_language:
        return int(backend.get_vocab_size(with_added_tokens=True))
    shim = types.SimpleNamespace(tokenizer=backend)  # what the checks read of coqui's tokenizer
    registered = languages.get_language(language)
    try:
        if registered is not None:
            language_token_code(shim, language, registered, path)
        else:
            check_language_token(shim, languages.base_code(language), path)
    except LanguageTokenMissingError as exc:
        raise PreflightError(str(exc)) from None
    return int(backend.get_vocab_size(with_added_tokens=True))


# -- base files -------------------------------------------------------------------------

def check_base_checkpoint(path: str | Path, *, flag: str = "--model") -> list[str]:
    """The base model.pth reads as a weights-only checkpoint holding a state dict (verified
    as :func:`patches.checkpoint.read_checkpoint` verifies); returns its weights' names."""
    path = Path(path)
    try:
        return list(model_state(read_checkpoint(path), path))
    except CheckpointError as exc:
        raise PreflightError(f"training-patches: {flag} {path}: "
                             f"{str(exc).removeprefix('training-patches: ')}") from None


def check_torch_file(path: str | Path, what: str, *, flag: str) -> None:
    """dvae.pth / mel_stats.pth read with ``torch.load(weights_only=True)``."""
    path = Path(path)
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except Exception as exc:  # noqa: BLE001 - one paragraph, whatever torch says
        text = str(exc)
        if "Weights only load failed" in text:
            found = ("it is not a torch file of weights (random bytes, another format, or a "
                     "pickle that would run code)")
        else:
            found = f"{type(exc).__name__}: {(text.splitlines() or [''])[0][:160]}"
        raise PreflightError(
            f"training-patches: {flag} {path} cannot be read by torch.load ({found}). "
            f"Expected {what}, as it came with the XTTS base model. Copy it again, or point "
            f"{flag} at the right file.") from None


def check_model_keys(path: str | Path, model: Any, *, keys: list[str] | None = None,
                     flag: str = "--model", min_share: float = 0.5) -> int:
    """Refuse a base checkpoint when most of ``model``'s weights are not in it (the wrong
    file: ``strict=False`` would load almost nothing and train from random weights);
    returns how many match. ``keys``: the checkpoint's names, if already read."""
    path = Path(path)
    names = keys if keys is not None else check_base_checkpoint(path, flag=flag)
    wanted = list(model.state_dict())
    matched = align_keys(names, wanted)
    if len(matched) < min_share * len(wanted):
        missing = [k for k in wanted if k not in matched]
        raise PreflightError(
            f"training-patches: {flag} {path} is not a checkpoint of this XTTS model: only "
            f"{len(matched)} of the model's {len(wanted)} weights are in it (its {len(names)} "
            f"keys begin {', '.join(names[:3]) or '(none)'}; the model's include "
            f"{', '.join(missing[:3])}). Loading it would train from random weights. Expected "
            f"the XTTS v2 model.pth (keys 'gpt.*', 'hifigan_decoder.*'). Check that --model (or "
            f"BASE_DIR/model.pth) is that model.pth, not dvae.pth or another file.")
    return len(matched)


# -- output and resume ----------------------------------------------------------------------

def check_output_dir(path: str | Path, *, flag: str = "--output-dir") -> None:
    """The output folder exists or can be created, and files can be written in it."""
    problem = _options.output_dir_problem(path)
    if problem:
        raise PreflightError(
            f"training-patches: {flag} {path} {problem}. Expected a folder (it is created when "
            f"missing) where the run folder, checkpoints, train.log and the reports can be "
            f"written. Choose another path, or fix its permissions.")


def find_run_checkpoints(folder: Path) -> list[Path]:
    """coqui's checkpoints in a run folder (``checkpoint_N.pth``, ``best_model*.pth``)."""
    return sorted(list(folder.glob("checkpoint_*.pth")) + list(folder.glob("best_model*.pth")))


def check_resume(value: str, *, flag: str = "--resume") -> tuple[str, Path | None]:
    """``auto``, a coqui run folder holding a checkpoint, or a checkpoint file in one.

    Returns ``("auto", None)`` or ``("folder", run_folder)``. A checkpoint file is accepted
    when it is the one coqui continues from (the newest ``checkpoint_N.pth`` of its folder).
    """
    if value == "auto":
        return "auto", None
    path = Path(value)
    expected = ("Expected 'auto', a run folder written by an earlier run (it holds config.json "
                "and checkpoint_<step>.pth), or one checkpoint_<step>.pth in such a folder.")
    if not path.exists():
        raise PreflightError(f"training-patches: {flag} {path}: no such file or folder. "
                             f"{expected}")
    folder = path if path.is_dir() else path.parent
    ckpts = find_run_checkpoints(folder)
    if path.is_dir() and not ckpts:
        raise PreflightError(
            f"training-patches: {flag} {path} holds no checkpoint (no checkpoint_*.pth or "
            f"best_model*.pth; {len(list(path.iterdir()))} entries). {expected} Start without "
            f"{flag} (or with {flag} auto), or name the folder that has the checkpoints.")
    if not (folder / "config.json").is_file():
        raise PreflightError(
            f"training-patches: {flag} {path}: {folder} has no config.json, so it is not a "
            f"coqui run folder (coqui continues a run from the config.json beside its "
            f"checkpoints). {expected}")
    if path.is_file():
        if not path.name.startswith("checkpoint_") or path.suffix != ".pth":
            raise PreflightError(
                f"training-patches: {flag} {path} is not a coqui checkpoint_<step>.pth. "
                f"{expected}")
        newest = max((p for p in ckpts if p.name.startswith("checkpoint_")),
                     key=lambda p: _step_of(p), default=None)
        if newest is not None and newest.resolve() != path.resolve():
            raise PreflightError(
                f"training-patches: {flag} {path}: the coqui Trainer continues a run from its "
                f"newest checkpoint, which in {folder} is {newest.name}, not {path.name}; "
                f"continuing in place from an older one would mix two branches of training in "
                f"one folder. Expected the newest checkpoint or the folder. To go back to "
                f"{path.name}, make a new folder, copy {folder / 'config.json'} and {path} "
                f"into it, and pass {flag} with that folder.")
    return "folder", folder


def _step_of(path: Path) -> int:
    digits = path.stem.rsplit("_", 1)[-1]
    return int(digits) if digits.isdigit() else -1


__all__ = ["PreflightError", "ManifestSummary", "MANIFEST_COLUMNS", "check_settings",
           "check_coqui_installed", "check_language", "known_languages", "check_manifest",
           "check_vocab", "check_base_checkpoint", "check_torch_file", "check_model_keys",
           "check_output_dir", "check_resume", "find_run_checkpoints"]
