"""Does the base model read its text? A weight-only probe the loader asks before it starts
the new rows (``row_init="auto"``, :mod:`patches.row_init`).

``text_tv``: the mean total-variation distance between the model's next-audio-code
distributions given two random texts of the base vocabulary (the same random conditioning
and audio prefix; :data:`PAIRS` pairs, every position of the prefix). A model that reads its
text changes what it would say with the text (0.09-0.36 on the benchmark's base models that
read); one that speaks without reading does not (0.005-0.043). The forward pass is the
model's own: an integration registers it (:func:`register_text_probe`; coqui's XTTS ``GPT``
in :mod:`patches.integrations.xtts_gpt`); a model none claims is not probed.
Design and measurements: docs/design/row_init.md, "Why the default".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .row_init import LANGUAGE_TAG

# Fixed with the exploratory probe (benchmarks/probe_reads_text.py, 2026-11-28 08:04 UTC)
PAIRS = 16  # pairs of random texts
TEXT_LEN = 24  # tokens of a text, its language tag included
PREFIX = 40  # random audio codes after the text; every position's next code is compared
PROBE_SEED = 38
# The text_tv above which a base model reads its text, by the exploratory probe's rule (the
# midpoint between the development bases that read and those that do not). First 0.17
# (09:11 UTC, 2026-11-28), from bases that read well (0.336-0.341) or not at all (up to
# 0.007); the held-out mid_quick bases (English read weakly: gap 0.11) then probed 0.093-0.101
# and lost reading under the std0.02 rows it chose, so they joined the development bases:
# midpoint of 0.0926 and 0.0067, 0.05 (09:31 UTC), judged on configurations added after it.
READS_ABOVE = 0.05


@dataclass(frozen=True)
class TextProbe:
    """A model's side of the probe: ``context(generator)`` draws its random conditioning and
    audio prefix (before the texts are drawn), ``probs(params, texts, context)`` returns the
    next-audio-code distributions (texts x codes x positions), the module called with
    ``params`` in place of its own tensors (``torch.func.functional_call``)."""

    context: Callable[[torch.Generator], Any]
    probs: Callable[[Mapping[str, torch.Tensor], torch.Tensor, Any], torch.Tensor]


# find(owner) -> the owner's TextProbe, or None when it is not a model the finder knows
FindProbe = Callable[[torch.nn.Module], "TextProbe | None"]
_finders: list[FindProbe] = []


def register_text_probe(find: FindProbe) -> FindProbe:
    """Add a finder: ``find(owner)`` (the module holding ``text_embedding``) -> its
    :class:`TextProbe` or None; the first that answers wins. Registering again changes
    nothing."""
    if find not in _finders:
        _finders.append(find)
    return find


def probe_for(owner: torch.nn.Module | None) -> TextProbe | None:
    """The registered :class:`TextProbe` of ``owner``, None when no finder knows it."""
    for find in _finders:
        found = find(owner) if owner is not None else None
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class TextReading:
    """The probe's answer: ``text_tv`` (None: not measured), ``reads`` (None: unknown),
    ``why`` (what was measured, or why nothing was), the seconds it took, and ``failed``: a
    model the probe knows whose forward raised or gave no finite answer."""

    text_tv: float | None
    reads: bool | None
    why: str
    seconds: float = 0.0
    failed: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"text_tv": self.text_tv, "reads": self.reads, "threshold": READS_ABOVE,
                "why": self.why, "seconds": round(self.seconds, 3), "failed": self.failed}


def text_ids(tokens: Any, trained: int) -> tuple[list[int], int | None]:
    """The ids a probe's texts are drawn from (the base vocabulary's ids below ``trained``
    but its special tokens: ``[SPACE]`` stays, the unknown token, ``[STOP]``, language tags
    and the like go) and the language tag each text starts with (``[en]``, else the first
    tag of the base vocabulary, else none)."""
    ids, tags = [], []
    for i in range(trained):
        token = tokens.token(i)
        if token is None or i == tokens.unk:
            continue
        if LANGUAGE_TAG.fullmatch(token):
            tags.append((token != "[en]", i))
        elif token == "[SPACE]" or not (len(token) > 2 and token[0] + token[-1] in ("[]", "<>")):
            ids.append(i)
    return ids, min(tags)[1] if tags else None


def text_tv(owner: torch.nn.Module, params: Mapping[str, torch.Tensor], ids: Sequence[int],
            lead: int | None, probe: TextProbe | None = None) -> TextReading:
    """Probe ``owner`` with ``params`` (its tensors by its own names, as loaded: new rows
    are never read, the texts hold base ids only); nothing of ``owner`` changes (its
    training mode is restored). A model no finder knows, too few ids, or a forward that
    raises is a reading of None, with why. ``probe``: the owner's, when already found."""
    probe = probe or probe_for(owner)
    if probe is None:
        return TextReading(None, None, f"no reading probe for a {type(owner).__name__}")
    if len(ids) < 2:
        return TextReading(None, None, f"the base vocabulary has {len(ids)} text id(s) to draw "
                                       f"random texts from")
    started = time.perf_counter()
    modes = [(module, module.training) for module in owner.modules()]
    try:
        owner.eval()
        gen = torch.Generator().manual_seed(PROBE_SEED)
        context = probe.context(gen)
        drawn = (2 * PAIRS, TEXT_LEN - (lead is not None))
        texts = torch.tensor(ids)[torch.randint(0, len(ids), drawn, generator=gen)]
        if lead is not None:
            texts = torch.cat([torch.full((2 * PAIRS, 1), lead), texts], 1)
        with torch.no_grad():
            p = probe.probs(params, texts, context).float()
        value = float(0.5 * (p[:PAIRS] - p[PAIRS:]).abs().sum(1).mean())
    except Exception as exc:  # any model's forward: said, never raised into the load
        return TextReading(None, None, f"the probe's forward raised {type(exc).__name__}: "
                                       f"{' '.join(str(exc).split())[:200]}",
                           time.perf_counter() - started,
                           failed=True)
    finally:
        for module, mode in modes:
            module.training = mode
    if value != value:  # NaN: a model whose outputs are not finite
        return TextReading(None, None, "the probe's distributions were not finite",
                           time.perf_counter() - started, failed=True)
    reads = value > READS_ABOVE
    return TextReading(value, reads, f"text_tv {value:.3f} {'above' if reads else 'at or below'} "
                                     f"{READS_ABOVE}", time.perf_counter() - started)


__all__ = ["PAIRS", "PREFIX", "PROBE_SEED", "READS_ABOVE", "TEXT_LEN", "TextProbe",
           "TextReading", "probe_for", "register_text_probe", "text_ids", "text_tv"]
