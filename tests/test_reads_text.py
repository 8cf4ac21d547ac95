"""Whether the base model reads its text (patches.reads_text), and what the default
``row_init="auto"`` makes of it when the vocabulary grows: spelled rows where the base model
reads its text, near-zero rows (std0.02) where it does not, spelled rows where nothing could
tell (one WARNING where the probe failed). The probe is the model's own forward, run with the
checkpoint's tensors; the model itself is not changed by it.

A toy speaker registers a toy probe here (its audio head reads the mean text row through a
``reading`` weight: 0 speaks without reading); coqui's XTTS ``GPT`` registers its own
(patches.integrations.xtts_gpt). Real tiny models, real files and tokenizers.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import patches
from patches import _options, reads_text, row_init
from patches.reads_text import READS_ABOVE
from patches.advanced import ConfigError
from patches.reads_text import TextProbe

torch.set_num_threads(1)

LOGGER = "training_patches"
CODES, FRAMES, DIM = 6, 5, 8
BASE_WORDS = ["[STOP]", "[UNK]", "[SPACE]", "[en]", "selam", "tena", "the", "sea", "is", "calm",
              "a", "lamp", "and", "seal", "tea", "time"]
NEW_WORDS = ["[am]", "ሰላም", "ጤና", "ለዓለም"]
BASE, GROWN = len(BASE_WORDS), len(BASE_WORDS) + len(NEW_WORDS)


class Speaker(nn.Module):
    """A text embedding and text head (the vocabulary's rows) and an audio head: the next
    audio code's distribution at each of ``FRAMES`` frames, moved by the mean text row through
    ``reading`` (all zero: the same whatever the text). ``seen``: the training flag of each
    forward."""

    def __init__(self, vocab: int, reading: float = 10.0) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(vocab, DIM)
        self.text_head = nn.Linear(DIM, vocab)
        self.reading = nn.Linear(DIM, CODES, bias=False)
        if reading:
            nn.init.normal_(self.reading.weight, std=reading)
        else:
            nn.init.zeros_(self.reading.weight)
        self.audio_head = nn.Linear(DIM, CODES)
        self.drop = nn.Dropout(0.5)
        self.seen: list[bool] = []

    def forward(self, texts: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        text = self.drop(self.text_embedding(texts).mean(1))  # texts x DIM
        logits = self.reading(text)[:, :, None] + self.audio_head(audio).transpose(1, 2)
        return logits.softmax(1)  # texts x CODES x FRAMES


def _context(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(1, FRAMES, DIM, generator=gen)  # a random audio prefix


def _speaker_probs(owner: Speaker) -> Callable[..., torch.Tensor]:
    def probs(params: Any, texts: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(owner, dict(params),
                                          (texts, audio.expand(len(texts), -1, -1)))
    return probs


def _register(monkeypatch: pytest.MonkeyPatch, probs: Callable[..., Any] | None = None) -> None:
    """The toy probe as the only one registered (for this test only); ``probs`` in place of
    the speaker's own forward."""
    def find(owner: Any) -> TextProbe | None:
        if not isinstance(owner, Speaker):
            return None
        return TextProbe(_context, probs or _speaker_probs(owner))
    monkeypatch.setattr(reads_text, "_finders", [find])


def _tokenizer(path, words: list[str]) -> str:
    """A word-level ``tokenizers`` JSON of ``words`` (id = position)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


@pytest.fixture
def files(tmp_path) -> Callable[[float], tuple[str, str]]:
    """``files(reading)``: a base speaker's checkpoint (``BASE`` rows) with that reading
    weight, and the grown tokenizer (``GROWN`` ids, Amharic added)."""
    grown = _tokenizer(tmp_path / "vocab_am.json", BASE_WORDS + NEW_WORDS)

    def make(reading: float) -> tuple[str, str]:
        torch.manual_seed(0)
        path = tmp_path / f"base_{reading}.pt"
        torch.save({"model": Speaker(BASE, reading).state_dict()}, path)
        return str(path), grown
    return make


def _load(path: str, **kwargs: Any) -> tuple[Speaker, Any]:
    torch.manual_seed(1)
    model = Speaker(GROWN)
    report = patches.load_checkpoint(path, model, freeze=False, seed=5, **kwargs)
    return model, report


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


def _line(caplog) -> str:
    """The load line of the test's first load (the one under test: a comparison load after it
    logs its own line where the logger's level lets INFO through)."""
    lines = [r.getMessage() for r in caplog.records
             if r.name == LOGGER and r.levelno == logging.INFO and "loaded" in r.getMessage()]
    assert lines, "no load line"
    return lines[0]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


# -- what row_init auto does with the probe's answer ----------------------------------------


def test_a_base_model_that_reads_its_text_gets_spelled_rows(files, monkeypatch, caplog) -> None:
    """A base model whose audio follows its text: the default load starts the new rows from
    their spelling, exactly as ``row_init="spelling"`` would, and the load line says why."""
    _register(monkeypatch)
    path, grown = files(10.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model, report = _load(path, tokenizer=grown)
    spelled, _ = _load(path, tokenizer=grown, row_init="spelling")
    assert report.row_init["embedding"] == "spelling" and report.row_init["spelled"] >= 2
    auto = report.row_init["auto"]
    assert auto["reads"] is True and auto["text_tv"] > reads_text.READS_ABOVE
    assert auto["failed"] is False and auto["threshold"] == reads_text.READS_ABOVE
    assert _same(model, spelled)
    line = _line(caplog)
    assert "embedding rule auto: the base model reads its text (text_tv " in line
    assert re.search(r"\(text_tv 0\.\d{3} above " + re.escape(str(READS_ABOVE)) + r", in \d+\.\d s\) -> spelling, spelled "
                     r"rows, which make it read the new language \(docs/design/row_init\.md\)",
                     line), line
    assert not _warnings(caplog)


def test_a_base_model_that_does_not_read_gets_near_zero_rows(files, monkeypatch, caplog) -> None:
    """A base model that speaks the same whatever its text: the default load's new rows are
    those of ``row_init="std0.02"`` with the same seed (embedding, head and bias), nothing is
    said to be spelled, and the load line says why."""
    _register(monkeypatch)
    path, grown = files(0.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model, report = _load(path, tokenizer=grown)
    near_zero, _ = _load(path, tokenizer=grown, row_init="std0.02")
    assert _same(model, near_zero)
    assert report.row_init["embedding"] == "std0.02" and report.row_init["head"] == "spread"
    assert report.row_init["auto"]["reads"] is False
    assert report.row_init["auto"]["text_tv"] < 1e-6
    assert "spelled" not in report.row_init and "fallback" not in report.row_init
    line = _line(caplog)
    assert re.search(r"\(embedding std0\.02, head spread; embedding rule auto: the base model "
                     r"does not read its text \(text_tv 0\.000 at or below " + re.escape(str(READS_ABOVE)) + r", in \d+\.\d "
                     r"s\) -> std0\.02, near-zero rows, which keep the base language; "
                     r"TRAINING_PATCHES_ROW_INIT=spelling forces spelled rows "
                     r"\(docs/design/row_init\.md\)\)\), ", line), line
    assert "spelled by" not in line and "from their spelling" not in line


@pytest.mark.parametrize("broken", ["raises", "NaN"])
def test_a_probe_that_cannot_tell_is_one_warning_and_spelled_rows(files, monkeypatch, caplog,
                                                                  broken: str) -> None:
    """The model's forward raised, or gave no finite distribution: the load still happens,
    with spelled rows (the rule where the base model reads) and one WARNING saying why."""
    def probs(params: Any, texts: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        if broken == "raises":
            raise RuntimeError("the toy forward broke")
        return torch.full((len(texts), CODES, FRAMES), float("nan"))

    _register(monkeypatch, probs)
    path, grown = files(10.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model, report = _load(path, tokenizer=grown)
    spelled, _ = _load(path, tokenizer=grown, row_init="spelling")
    assert _same(model, spelled)
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "row_init auto could not tell whether the base model reads its text" in warned[0]
    why = ("the probe's forward raised RuntimeError: the toy forward broke" if broken == "raises"
           else "the probe's distributions were not finite")
    assert why in warned[0] and path in warned[0] and "\n" not in warned[0]
    auto = report.row_init["auto"]
    assert auto["failed"] is True and auto["reads"] is None and auto["text_tv"] is None
    assert auto["why"] == why and report.row_init["embedding"] == "spelling"
    assert (f"embedding rule auto: could not tell whether the base model reads its text "
            f"({why}) -> spelling, the rule where it reads") in _line(caplog)


def test_the_probe_changes_nothing_of_the_model(files, monkeypatch, tmp_path) -> None:
    """The probe runs the model in eval mode (no dropout in what it measures) and gives back
    each module's training flag; a load refused after the plan leaves every parameter as it
    was."""
    _register(monkeypatch)
    path, grown = files(10.0)
    model = Speaker(GROWN).train()
    model.drop.eval()  # a mix of flags, each to be given back as it was
    flags = {name: m.training for name, m in model.named_modules()}
    report = patches.load_checkpoint(path, model, freeze=False, tokenizer=grown)
    assert report.row_init["auto"]["reads"] is True
    assert model.seen == [False]  # one probe forward, in eval mode
    assert {name: m.training for name, m in model.named_modules()} == flags
    # refused: a tensor that is not the vocabulary's has another shape; nothing changes
    state = torch.load(path)["model"]
    state["audio_head.weight"] = torch.zeros(CODES + 1, DIM)
    state["audio_head.bias"] = torch.zeros(CODES + 1)
    torch.save({"model": state}, tmp_path / "wrong.pt")
    fresh = Speaker(GROWN).train()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(patches.CheckpointMismatchError, match="audio_head.weight: checkpoint"):
        patches.load_checkpoint(tmp_path / "wrong.pt", fresh, freeze=False, tokenizer=grown)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
    assert all(m.training for m in fresh.modules()) and fresh.seen == []


def test_the_probe_uses_no_global_random_state_and_the_record_keeps_its_answer(
        files, monkeypatch) -> None:
    """The probe draws from its own generator: the process's RNG is where it was (a run's
    data order does not change because the loader asked); the start record of a run keeps
    the answer (``as_record``), which ``report`` reads."""
    _register(monkeypatch)
    path, grown = files(10.0)
    after = {}
    for rule in ("spelling", "auto"):  # the same load, without and with the probe
        model = Speaker(GROWN)
        torch.manual_seed(123)
        report = patches.load_checkpoint(path, model, freeze=False, row_init=rule,
                                         tokenizer=grown)
        after[rule] = torch.get_rng_state()
    assert torch.equal(after["spelling"], after["auto"])
    assert report.row_init["auto"]["reads"] is True
    assert report.as_record()["row_init"] == report.row_init


def test_a_checkpoint_with_nan_is_refused_without_running_the_probe(files, monkeypatch,
                                                                     caplog) -> None:
    """NaN weights: the probe is not asked (its answer would be no answer, after seconds at
    XTTS v2's size), no WARNING of it; the load is refused as before, nothing changed."""
    calls: list[int] = []

    def probs(params: Any, texts: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.full((len(texts), CODES, FRAMES), 1.0 / CODES)

    _register(monkeypatch, probs)
    path, grown = files(10.0)
    state = torch.load(path)["model"]
    state["audio_head.bias"][0] = float("nan")
    torch.save({"model": state}, path)
    model = Speaker(GROWN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger=LOGGER), \
            pytest.raises(patches.CheckpointError, match="NaN or Inf"):
        patches.load_checkpoint(path, model, freeze=False, tokenizer=grown)
    assert calls == [] and _warnings(caplog) == []
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_checkpoint_missing_a_tensor_of_the_model_is_not_probed(files, monkeypatch) -> None:
    """strict=False and a checkpoint without one of the model's tensors: the probe would
    measure the model's own fresh weight beside the file's, so it is not asked; spelled rows,
    and the report says why."""
    _register(monkeypatch)
    path, grown = files(0.0)  # does not read: a probe mixing in fresh weights could say it does
    state = torch.load(path)["model"]
    del state["reading.weight"]
    torch.save({"model": state}, path)
    _, report = _load(path, tokenizer=grown, strict=False)
    auto = report.row_init["auto"]
    assert auto["reads"] is None and auto["failed"] is False
    assert auto["why"] == "the checkpoint lacks 1 of its tensors (reading.weight)"
    assert report.row_init["embedding"] == "spelling"


def test_without_a_tokenizer_nothing_is_probed_and_the_rows_are_spread(files, monkeypatch,
                                                                       caplog) -> None:
    """No tokenizer: no texts to probe with, nothing to spell; the rows are those of the
    spelled rule without a tokenizer (all by spread), as before auto, and the line says so."""
    _register(monkeypatch)
    path, _ = files(0.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model, report = _load(path)
    before_auto, _ = _load(path, row_init="spelling")
    assert _same(model, before_auto) and model.seen == []
    assert report.row_init["no_tokenizer"] is True and report.row_init["fallback"] == GROWN - BASE
    assert report.row_init["auto"]["reads"] is None and report.row_init["auto"]["failed"] is False
    assert ("embedding rule auto: not probed (no tokenizer was given to draw the probe's texts "
            "from) -> spelling, the rule where the base model reads") in _line(caplog)


# -- auto is the embedding's rule only --------------------------------------------------------


def test_head_row_init_auto_is_refused_naming_the_allowed_rules(files) -> None:
    """``auto`` chooses the embedding's rule; asked for the head it is one paragraph."""
    path, grown = files(10.0)
    allowed = ", ".join(r for r in row_init.ROW_INITS if r != "auto")
    with pytest.raises(ValueError) as raised:
        patches.load_checkpoint(path, Speaker(GROWN), freeze=False, tokenizer=grown,
                                head_row_init="auto")
    assert str(raised.value) == (
        f"training-patches: head_row_init is 'auto'. Expected one of {allowed} "
        f"(docs/benchmarks.md, 'New rows that learn', measures each; "
        f"TRAINING_PATCHES_HEAD_ROW_INIT sets the default).")


def test_the_environment_takes_auto_for_the_embedding_and_refuses_it_for_the_head(
        monkeypatch) -> None:
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "auto")
    assert _options.current().row_init == "auto"
    monkeypatch.setenv("TRAINING_PATCHES_HEAD_ROW_INIT", "auto")
    with pytest.raises(ConfigError, match=r"^training-patches: the environment variable "
                                          r"TRAINING_PATCHES_HEAD_ROW_INIT is 'auto', which is "
                                          r"not usable") as raised:
        patches.advanced.apply(["checkpoint"])
    assert "\n" not in str(raised.value)


def test_the_environment_refusal_of_head_auto_lists_only_the_rules_allowed(monkeypatch) -> None:
    monkeypatch.setenv("TRAINING_PATCHES_HEAD_ROW_INIT", "auto")
    with pytest.raises(ConfigError) as raised:
        patches.advanced.apply(["checkpoint"])
    said = str(raised.value).split("which is not usable", 1)[1]
    assert "auto" not in said, said


# -- the probe's parts --------------------------------------------------------------------------


def _ids_of(tmp_path, words: list[str]) -> tuple[list[int], int | None]:
    tokens = row_init.read_tokenizer(_tokenizer(tmp_path / "t.json", words))
    return reads_text.text_ids(tokens, len(words))


def test_text_ids_keep_text_and_space_and_lead_with_en(tmp_path) -> None:
    """The probe's texts: base tokens and [SPACE]; no [STOP], [UNK] or language tag inside,
    each text led by [en]."""
    words = ["[STOP]", "[UNK]", "[SPACE]", "[en]", "[am]", "sea", "tea", "calm"]
    assert _ids_of(tmp_path, words) == ([2, 5, 6, 7], 3)


def test_text_ids_lead_with_the_first_language_tag_without_en(tmp_path) -> None:
    words = ["[STOP]", "[UNK]", "[SPACE]", "[de]", "[am]", "sea", "tea"]
    assert _ids_of(tmp_path, words) == ([2, 5, 6], 3)


def test_text_ids_lead_with_nothing_without_a_language_tag(tmp_path) -> None:
    words = ["[STOP]", "[UNK]", "[SPACE]", "sea", "tea"]
    assert _ids_of(tmp_path, words) == ([2, 3, 4], None)


def test_text_ids_without_structural_tokens(tmp_path) -> None:
    """A vocabulary with no [STOP]: its first tag leads, its unknown token is left out."""
    assert _ids_of(tmp_path, ["sea", "[UNK]", "[de]", "tea"]) == ([0, 3], 2)


# -- coqui's XTTS GPT ---------------------------------------------------------------------------


@pytest.mark.xtts
@pytest.mark.slow  # importing coqui: seconds
def test_an_untrained_xtts_gpt_is_probed_and_does_not_read(caplog) -> None:
    """coqui's GPT is known to the probe; untrained, its audio does not follow its text
    (text_tv far below the threshold); its parameters and training flags are as they were.
    In float64 coqui's own forward cannot run on CPU (its GroupNorm32 computes in float32):
    the reading fails, said, never raised."""
    pytest.importorskip("TTS")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from TTS.tts.layers.xtts.gpt import GPT

    import patches.integrations.xtts_gpt  # noqa: F401 (registers the probe)

    rows = 40
    torch.manual_seed(0)
    gpt = GPT(start_text_token=rows - 1, stop_text_token=0, layers=2, model_dim=64, heads=2,
              max_text_tokens=64, max_mel_tokens=72, max_prompt_tokens=70,
              number_text_tokens=rows, num_audio_tokens=34, start_audio_token=32,
              stop_audio_token=33, use_perceiver_resampler=True).train()
    assert reads_text.probe_for(gpt) is not None
    before = {k: v.clone() for k, v in gpt.state_dict().items()}
    ids = list(range(2, rows - 1))
    reading = reads_text.text_tv(gpt, dict(gpt.state_dict()), ids, None)
    assert reading.failed is False and reading.reads is False, reading
    assert 0 < reading.text_tv < 0.01  # the texts reach the distributions, a little
    # two texts that are the same: nothing between them
    same = {"text_embedding.weight": torch.zeros_like(gpt.text_embedding.weight)}
    assert reads_text.text_tv(gpt, {**gpt.state_dict(), **same}, ids, None).text_tv == 0.0
    assert all(m.training for m in gpt.modules())
    assert all(torch.equal(v, gpt.state_dict()[k]) for k, v in before.items())
    gpt.double()
    reading = reads_text.text_tv(gpt, dict(gpt.state_dict()), ids, None)
    assert reading.failed is True and reading.reads is None
    assert reading.why.startswith("the probe's forward raised RuntimeError: ")
    assert all(m.training for m in gpt.modules())


def _tiny_gpt(rows: int) -> nn.Module:
    from TTS.tts.layers.xtts.gpt import GPT  # lazy: the coqui-tts extra (importorskip first)

    return GPT(start_text_token=rows - 1, stop_text_token=0, layers=2, model_dim=64, heads=2,
               max_text_tokens=64, max_mel_tokens=72, max_prompt_tokens=70,
               number_text_tokens=rows, num_audio_tokens=34, start_audio_token=32,
               stop_audio_token=33, use_perceiver_resampler=True)


@pytest.mark.xtts
@pytest.mark.slow  # importing coqui: seconds
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_xtts_gpt_is_probed_in_float32(tmp_path, dtype) -> None:
    """A half-precision XTTS GPT (a user's bf16/fp16 model) is probed on float32 copies of
    the checkpoint: its own half-precision forward fails on the CPU in coqui's GroupNorm32,
    which would make every such load a WARNING and spelled rows."""
    pytest.importorskip("TTS")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import patches.integrations.xtts_gpt  # noqa: F401 (registers the probe)

    base, grown = 40, 44  # XTTS's layout: [START] the last row
    torch.manual_seed(0)
    torch.save({"model": _tiny_gpt(base).state_dict()}, tmp_path / "base.pt")
    words = ["[STOP]", "[UNK]", "[SPACE]", "[en]"] + [f"w{i}" for i in range(base - 5)]
    vocab = _tokenizer(tmp_path / "vocab.json", words + ["[am]", "ሰላም", "ጤና", "ለዓለም", "[START]"])
    model = _tiny_gpt(grown).to(dtype)
    report = patches.load_checkpoint(tmp_path / "base.pt", model, freeze=False, tokenizer=vocab)
    auto = report.row_init["auto"]
    assert auto["failed"] is False and auto["reads"] is False, auto
    assert report.row_init["embedding"] == "std0.02"
    assert model.text_embedding.weight.dtype == dtype
