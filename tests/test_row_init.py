"""The rules that start new vocabulary rows (patches.row_init): each gives what it says,
measured against the old rows; the romanised rows sit at the base rows of their spelling's
pieces; every rule is a pure function of the seed; the loader records what it did."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import patches
from patches import row_init
from patches.reads_text import READS_ABOVE
from patches.languages import amharic, register_language, unregister_language
from patches.row_init import ROMANIZED_NOISE, RowSources, new_bias_values, new_row_values

from tiny_models import TinyTextModel

torch.set_num_threads(1)


def _base(rows: int = 300, dim: int = 8, seed: int = 0) -> torch.Tensor:
    """Trained-looking rows: a mean away from 0 and a different spread per channel."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.05, 2.0, dim, dtype=torch.float64)
    shift = torch.linspace(-1.0, 1.0, dim, dtype=torch.float64)
    return shift + scale * torch.randn(rows, dim, generator=g, dtype=torch.float64)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_spread_rows_have_the_old_rows_mean_and_per_channel_spread() -> None:
    base = _base()
    new = new_row_values(base, range(300, 8300), "spread", _gen())
    assert torch.allclose(new.mean(0), base.mean(0), atol=0.06)
    ratio = new.std(0) / base.std(0, unbiased=False)
    assert ((ratio > 0.95) & (ratio < 1.05)).all(), ratio
    # distinct rows: no two new tokens start alike
    assert torch.cdist(new[:200], new[:200]).add(torch.eye(200) * 1e9).min() > 0.1


def test_mean_rows_are_the_old_mean_within_a_tiny_fraction_of_the_spread() -> None:
    base = _base(rows=300, dim=8)
    new = new_row_values(base, range(300, 340), "mean", _gen())
    std = base.std(0, unbiased=False)
    assert ((new - base.mean(0)).abs() / std).max() < 1e-3


@pytest.mark.parametrize("rule, std", [("std0.02", 0.02), ("randn", 1.0)])
def test_fixed_scale_rules_ignore_the_old_rows(rule: str, std: float) -> None:
    base = _base()
    new = new_row_values(base, range(300, 20300), rule, _gen())
    assert abs(new.mean().item()) < 0.02 * std
    assert abs(new.std().item() / std - 1) < 0.02


def test_romanized_rows_start_at_the_mean_of_their_pieces_rows() -> None:
    base = _base()
    sources = RowSources({300: (5, 9, 11), 302: (40,)}, {}, {301: "።"})
    new = new_row_values(base, range(300, 303), "romanized", _gen(3), sources)
    std = base.std(0, unbiased=False)
    noise = torch.randn(3, base.shape[1], generator=_gen(3), dtype=torch.float64)
    # exactly: the pieces' mean plus 0.1 of the per-channel spread times the seed's noise
    assert torch.equal(new[0], base[[5, 9, 11]].mean(0) + ROMANIZED_NOISE * noise[0] * std)
    assert torch.equal(new[2], base[40] + ROMANIZED_NOISE * noise[2] * std)
    # the unspelled row falls back to spread: the old mean plus the full spread
    assert torch.equal(new[1], base.mean(0) + noise[1] * std)


def test_romanized_offset_rows_are_the_spelled_rows_pulled_in_and_moved_by_one_offset() -> None:
    base = _base()
    mean = base.mean(0)
    sources = RowSources({300: (5, 9, 11), 302: (40,), 303: (7,)}, {}, {301: "።"})
    plain = new_row_values(base, range(300, 304), "romanized", _gen(3), sources)
    moved = new_row_values(base, range(300, 304), "romanized_offset", _gen(3), sources)
    pulled = mean + row_init.SPELLING_SHARE * (plain - mean)
    offset = moved[0] - pulled[0]
    # one offset for every spelled row; the row that falls back is left as spread made it
    assert torch.allclose(moved[[0, 2, 3]] - pulled[[0, 2, 3]], offset.expand(3, -1),
                          atol=1e-12)
    assert torch.equal(moved[1], plain[1])
    assert row_init.SPELLING_SHARE == 0.5 and row_init.OFFSET_LENGTH == 0.6
    # 0.6 times the old rows' mean distance from their mean
    length = (base - mean).norm(dim=1).mean()
    assert torch.isclose(offset.norm(), 0.6 * length, rtol=1e-9)
    # the seed draws the direction
    again = new_row_values(base, range(300, 304), "romanized_offset", _gen(4), sources)
    other = again[0] - (mean + 0.5 * (new_row_values(base, range(300, 304), "romanized",
                                                       _gen(4), sources)[0] - mean))
    assert not torch.allclose(other, offset)


def test_spelling_rows_are_the_romanized_rows_with_a_noise_the_seed_does_not_draw() -> None:
    """``spelling``: each spelled row at its pieces' mean plus 0.1 of the spread times a
    noise of a fixed seed (:data:`row_init.SPELLING_NOISE_SEED`); the fallback rows the same
    way: the start is the same whatever the load's seed (issue 38: no seed lottery)."""
    base = _base()
    sources = RowSources({300: (5, 9, 11), 302: (40,)}, {}, {301: "።"})
    a = new_row_values(base, range(300, 303), "spelling", _gen(3), sources)
    std = base.std(0, unbiased=False)
    fixed = torch.randn(3, base.shape[1], generator=_gen(row_init.SPELLING_NOISE_SEED),
                        dtype=torch.float64)
    assert torch.equal(a[0], base[[5, 9, 11]].mean(0) + ROMANIZED_NOISE * fixed[0] * std)
    assert torch.equal(a[2], base[40] + ROMANIZED_NOISE * fixed[2] * std)
    assert torch.equal(a[1], base.mean(0) + fixed[1] * std)
    for seed in (4, 5, 123):
        assert torch.equal(new_row_values(base, range(300, 303), "spelling", _gen(seed),
                                          sources), a)
    # the load's generator still draws what every rule draws: what follows (the head's
    # rows) is the same function of the seed under every rule
    g1, g2 = _gen(3), _gen(3)
    new_row_values(base, range(300, 303), "spelling", g1, sources)
    new_row_values(base, range(300, 303), "romanized", g2, sources)
    assert torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))


def test_the_default_rows_start_at_their_spelling_with_no_random_direction() -> None:
    """Issue 38: the default's spelled rows (``auto``'s rule where the base model reads its
    text, or is not known to) sit at their pieces' mean, off by no more than the small
    per-row noise; no offset shared by the rows (the old default moved every spelled row by
    one random vector of 0.6 x the old rows' spread), and the same rows for every seed."""
    assert row_init.DEFAULT_ROW_INIT == row_init.AUTO
    spelled_rule = row_init.AUTO_RULES[True]
    assert spelled_rule == row_init.AUTO_RULES[None] == "spelling"
    base = _base()
    rows = range(300, 340)
    sources = RowSources({r: (r - 300, r - 299) for r in rows}, {}, {})
    std = base.std(0, unbiased=False)
    got = {seed: new_row_values(base, rows, spelled_rule, _gen(seed), sources)
           for seed in (0, 1, 2)}
    spelled = torch.stack([base[list(sources.sources[r])].mean(0) for r in rows])
    for values in got.values():
        assert ((values - spelled).abs() <= 5 * ROMANIZED_NOISE * std).all()
        # no shared direction: the rows' mean offset is the noise's mean (about 0.1/sqrt(40))
        assert ((values - spelled).mean(0).abs() <= 0.1 * std).all()
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    assert row_init.DEFAULT_ROW_INIT not in row_init.DEPRECATED_RULES
    assert not set(row_init.AUTO_RULES.values()) & set(row_init.DEPRECATED_RULES)


def test_the_old_default_still_runs_with_one_deprecation_warning(caplog) -> None:
    base = _base()
    sources = RowSources({300: (5, 9, 11)}, {}, {})
    row_init._warned_deprecated.clear()
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        first = new_row_values(base, range(300, 301), "romanized_offset", _gen(3), sources)
        again = new_row_values(base, range(300, 301), "romanized_offset", _gen(3), sources)
    assert torch.equal(first, again)
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(said) == 1
    assert ("row_init 'romanized_offset' is deprecated and still runs" in said[0]
            and f"Use '{row_init.DEFAULT_ROW_INIT}'" in said[0])


def test_romanized_head_bias_is_its_pieces_bias_mean_and_fixed_rules_start_at_zero() -> None:
    bias = torch.arange(10, dtype=torch.float64)
    sources = RowSources({10: (2, 4)}, {}, {11: "x"})
    got = new_bias_values(bias, range(10, 12), "romanized", _gen(), sources)
    assert got[0].item() == 3.0
    assert abs(got[1].item() - bias.mean().item()) < 1e-6
    for rule in ("randn", "std0.02"):
        assert torch.equal(new_bias_values(bias, range(10, 12), rule, _gen()),
                           torch.zeros(2, dtype=torch.float64))


# the rules that make rows: ``auto`` only chooses one of them (the loader resolves it)
RULES = tuple(rule for rule in row_init.ROW_INITS if rule != row_init.AUTO)


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_a_pure_function_of_the_seed(rule: str) -> None:
    """The same seed, the same rows; another seed, other rows, except under ``spelling``,
    whose rows no seed draws."""
    base = _base()
    sources = RowSources({300: (1, 2)}, {}, {})
    a = new_row_values(base, range(300, 310), rule, _gen(7), sources)
    b = new_row_values(base, range(300, 310), rule, _gen(7), sources)
    c = new_row_values(base, range(300, 310), rule, _gen(8), sources)
    assert torch.equal(a, b)
    assert torch.equal(a, c) == (rule == "spelling")


def test_auto_makes_no_rows_itself() -> None:
    """``auto`` is resolved by the loader to the rule it chose; asked of the rows directly it
    is refused, saying so, rather than silently taken for one rule."""
    with pytest.raises(ValueError, match=r"^row_init 'auto' is resolved by the loader "
                                         r"\(plan_model\) to spelling or std0\.02 before any "
                                         r"row is made$"):
        new_row_values(_base(), range(300, 301), row_init.AUTO, _gen())


def test_an_unknown_rule_is_one_paragraph() -> None:
    with pytest.raises(ValueError,
                       match=r"row_init is 'fvt'\. Expected one of auto, spelling, romanized, "):
        new_row_values(_base(), range(300, 301), "fvt", _gen())


# -- the Amharic romaniser and the registry -----------------------------------------------


@pytest.mark.parametrize("text, spelled", [
    ("ሰላም", "selam"), ("ኢትዮጵያ", "ityopya"), ("አማርኛ", "amarnya"), ("ቋንቋ", "kwankwa"),
    ("ሠላም ለዓለም።", "selam lealem"), ("ጤና ይስጥልኝ", "tena ystlny")])
def test_amharic_romanizer_spells_for_an_english_reader(text: str, spelled: str) -> None:
    assert amharic.romanize(text) == spelled


@pytest.mark.parametrize("text", ["።", "hello", "፩፪", ""])
def test_amharic_romanizer_declines_text_without_ethiopic_syllables(text: str) -> None:
    assert amharic.romanize(text) is None


def test_every_ethiopic_letter_of_the_amharic_alphabet_is_spelled() -> None:
    letters = [chr(c) for c in range(0x1200, 0x135B)
               if chr(c).isalpha() and c not in range(0x1248, 0x1260)]
    unspelled = [ch for ch in letters if amharic.romanize(ch) is None]
    # the reserved code points of the labialised series are not letters; all others spell
    assert not unspelled, unspelled


def test_a_registered_romanizer_is_used_and_a_failing_one_is_a_fallback() -> None:
    register_language("zz", romanize=lambda text: "zed" if "\u2c00" in text else None)
    register_language("zy", romanize=lambda text: 1 / 0)
    try:
        from patches.languages import romanize

        assert romanize("\u2c00") == ("zed", "zz")
        assert romanize("ሰ") == ("se", "am")
        assert romanize("\u0561") is None  # no language spells Armenian
    finally:
        unregister_language("zz")
        unregister_language("zy")


def test_register_language_refuses_a_romanizer_that_is_not_callable() -> None:
    with pytest.raises(patches.advanced.ConfigError, match="romanize='abc', which is not callable"):
        register_language("zx", romanize="abc")


# -- spellings -> rows with a real tokenizer ------------------------------------------------


def _grown_vocab(tmp_path, start: bool = True) -> tuple[str, int, int]:
    """A base English BPE vocab.json (XTTS layout: ``[START]`` last, moved to the new last id;
    without ``start``, no ``[START]`` and every id kept) grown for Amharic by the library's
    own extender: (path, base rows, grown rows)."""
    tokenizers = pytest.importorskip("tokenizers")
    from patches.tools.tokenizer.bpe import extend_vocab_file

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=120, show_progress=False,
        special_tokens=["[STOP]", "[UNK]", "[SPACE]", "[en]"])
    tok.train_from_iterator(["selam lealem", "the sea is calm", "a lamp and a seal",
                             "tea time for all", "i see the sun"] * 20, trainer=trainer)
    if start:
        tok.add_special_tokens(["[START]"])
    base = tmp_path / "vocab.json"
    tok.save(str(base))
    grown = tmp_path / "vocab_am.json"
    extend_vocab_file(base, ["ሰላም ለዓለም", "ሰላም ሰላም ጤና", "ለዓለም ሰላም."], grown,
                      language="am", new_pieces=6)
    base_rows = tokenizers.Tokenizer.from_file(str(base)).get_vocab_size()
    return str(grown), base_rows, tokenizers.Tokenizer.from_file(str(grown)).get_vocab_size()


def test_romanized_sources_are_the_base_pieces_of_each_tokens_spelling(tmp_path) -> None:
    grown, base_rows, rows = _grown_vocab(tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(grown)
    new = range(base_rows - 1, rows - 1)  # [START] stays last
    found = row_init.romanized_sources(grown, new, trained=lambda i: i < base_rows - 1)
    assert set(found.sources) | set(found.unspelled) == set(new)
    sela = tok.token_to_id("ሰላም")
    assert sela in found.sources, found.unspelled
    assert list(found.sources[sela]) == tok.encode("selam").ids
    assert all(i < base_rows - 1 for ids in found.sources.values() for i in ids)
    # [am] is a special token: nothing to spell, it falls back
    assert found.unspelled[tok.token_to_id("[am]")] == "[am]"


def _tiny(rows: int, start_last: bool = False) -> TinyTextModel:
    """The tiny text model; with ``start_last`` in XTTS's layout ([START] the last row)."""
    model = TinyTextModel(vocab=rows, dim=8)
    if start_last:
        model.start_text_token = rows - 1
    return model


def _tiny_checkpoint(tmp_path, rows: int, start_last: bool = False) -> str:
    torch.manual_seed(0)
    path = tmp_path / "base.pt"
    torch.save({"model": _tiny(rows, start_last).state_dict()}, path)
    return str(path)


def test_the_loader_starts_new_rows_by_the_asked_rules_and_reports_them(tmp_path) -> None:
    grown, base_rows, rows = _grown_vocab(tmp_path)
    path = _tiny_checkpoint(tmp_path, base_rows, start_last=True)
    saved = torch.load(path)["model"]
    model = _tiny(rows, start_last=True)
    report = patches.load_checkpoint(path, model, freeze=False, row_init="romanized",
                                     head_row_init="std0.02", tokenizer=grown)
    info = report.row_init
    assert info["embedding"] == "romanized" and info["head"] == "std0.02"
    assert info["spelled"] + info["fallback"] == rows - base_rows
    assert info["spelled"] >= 3
    assert "[am]" in info["fallback_tokens"]
    assert "vocabulary row(s) (embedding romanized (" in report.summary()
    assert "head std0.02" in report.summary()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(grown)
    new = slice(base_rows - 1, rows - 1)  # XTTS layout: [START] moved to the new last row
    emb = model.text_embedding.weight.detach().double()
    old = saved["text_embedding.weight"].double()[: base_rows - 1]
    std = old.std(0, unbiased=False)
    sela = tok.token_to_id("ሰላም")
    pieces = tok.encode("selam").ids
    assert ((emb[sela] - old[pieces].mean(0)).abs() <= 5 * ROMANIZED_NOISE * std).all()
    head = model.text_head.weight.detach()[new]
    assert abs(head.std().item() - 0.02) < 0.01
    assert torch.equal(model.text_head.bias.detach()[new], torch.zeros(rows - base_rows))


@pytest.mark.parametrize("rule", ["spelling", "romanized_offset", "romanized"])
def test_the_new_language_tag_starts_as_the_start_token_under_romanized_offset(
        tmp_path, rule: str) -> None:
    """``[am]`` (embedding row, head row and bias) starts as the base's ``[START]`` under
    ``spelling`` and ``romanized_offset``, and the report says so; under ``romanized`` it
    falls back."""
    grown, base_rows, rows = _grown_vocab(tmp_path)
    path = _tiny_checkpoint(tmp_path, base_rows, start_last=True)
    saved = torch.load(path)["model"]
    model = _tiny(rows, start_last=True)
    report = patches.load_checkpoint(path, model, freeze=False, row_init=rule,
                                     tokenizer=grown)
    from tokenizers import Tokenizer

    am = Tokenizer.from_file(grown).token_to_id("[am]")
    got = {k: v.detach() for k, v in model.state_dict().items()}
    keys = ("text_embedding.weight", "text_head.weight", "text_head.bias")
    as_start = [torch.equal(got[k][am], saved[k][base_rows - 1]) for k in keys]
    # the start token itself is still the last row
    assert all(torch.equal(got[k][rows - 1], saved[k][base_rows - 1]) for k in keys)
    if rule in ("spelling", "romanized_offset"):
        assert as_start == [True, True, True]
        assert report.row_init["tags_from_start"] == ["[am]"]
        assert "[am]" not in report.row_init["fallback_tokens"]
        assert "1 language tag(s) as the start token ('[am]')" in report.summary()
    else:
        assert as_start == [False, False, False]
        assert "tags_from_start" not in report.row_init
        assert "[am]" in report.row_init["fallback_tokens"]


def test_the_default_load_starts_the_same_embedding_whatever_the_seed_and_says_its_rule(
        tmp_path) -> None:
    """Issue 38: loaded with the defaults and the grown tokenizer, the new embedding rows are
    the same for every seed (the old default's offset drew a direction per seed: its
    Amharic loss at step 0 spread over 4.54-4.87), and the load line names the rule."""
    grown, base_rows, rows = _grown_vocab(tmp_path)
    path = _tiny_checkpoint(tmp_path, base_rows, start_last=True)
    got, reports = [], []
    for seed in (0, 1, 2):
        model = _tiny(rows, start_last=True)
        reports.append(patches.load_checkpoint(path, model, freeze=False, seed=seed,
                                               tokenizer=grown))
        got.append(model.text_embedding.weight.detach().clone())
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    assert reports[0].row_init["embedding"] == "spelling"
    assert "vocabulary row(s) (embedding spelling (" in reports[0].summary()
    assert "1 language tag(s) as the start token ('[am]')" in reports[0].summary()
    # and why this rule ran: auto, which found no reading probe for this model
    assert ("; embedding rule auto: not probed (no reading probe for a TinyTextModel) -> "
            "spelling, the rule where the base model reads (docs/design/row_init.md))), "
            "optimizer absent") in reports[0].summary()
    assert reports[0].row_init["auto"] == {
        "text_tv": None, "reads": None, "threshold": READS_ABOVE, "failed": False, "seconds": 0.0,
        "why": "no reading probe for a TinyTextModel"}


def test_romanized_rows_follow_a_layout_whose_token_0_is_not_row_0(tmp_path,
                                                                    monkeypatch) -> None:
    """A layout with a filler row before token 0 (F5-TTS: token i at row i + 1): each new
    row starts from the rows of ITS token's pieces, each piece one row down too (read by
    token id, the spelling would land one row off)."""
    from patches import vocab_rows

    # no start token kept last in this layout: the tokenizer keeps every base id too
    grown, base_tokens, tokens = _grown_vocab(tmp_path, start=False)
    filler = vocab_rows.RowLayout("filler row 0", leading_rows=1)
    monkeypatch.setattr(vocab_rows, "_layouts", [lambda owner, rows: filler
                                                 if getattr(owner, "filler", False) else None])

    def tiny(rows: int) -> TinyTextModel:
        model = TinyTextModel(vocab=rows, dim=8)
        model.filler = True
        return model

    torch.manual_seed(0)
    path = tmp_path / "base.pt"
    torch.save({"model": tiny(base_tokens + 1).state_dict()}, path)
    old = torch.load(path)["model"]["text_embedding.weight"].double()
    model = tiny(tokens + 1)
    report = patches.load_checkpoint(path, model, freeze=False, row_init="romanized",
                                     tokenizer=grown)
    assert report.row_init["spelled"] >= 3
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(grown)
    emb = model.text_embedding.weight.detach().double()
    std = old[1:].std(0, unbiased=False)
    sela = tok.token_to_id("ሰላም")
    rows = [i + 1 for i in tok.encode("selam").ids]  # the pieces' rows: one down
    assert ((emb[sela + 1] - old[rows].mean(0)).abs() <= 5 * ROMANIZED_NOISE * std).all()
    assert torch.equal(emb[:base_tokens + 1].float(), old.float())  # trained rows kept


def test_romanized_without_a_tokenizer_falls_back_and_says_so(tmp_path) -> None:
    path = _tiny_checkpoint(tmp_path, 20)
    model = TinyTextModel(vocab=24, dim=8)
    report = patches.load_checkpoint(path, model, freeze=False, row_init="romanized",
                                     head_row_init="mean")
    assert report.row_init["no_tokenizer"] is True and report.row_init["fallback"] == 4
    assert "no tokenizer was given" in report.summary()


@pytest.mark.parametrize("rule", ["spelling", None], ids=["spelling", "default auto"])
def test_an_unreadable_tokenizer_is_refused_naming_the_rule_in_use(tmp_path, rule) -> None:
    path = _tiny_checkpoint(tmp_path, 20)
    model = TinyTextModel(vocab=24, dim=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    asked = {"row_init": rule} if rule else {}
    with pytest.raises(patches.CheckpointError,
                       match=rf"from their spelling \(row_init '{rule or 'auto'}'\): the "
                             r"tokenizer given could not be read .*nope\.json, which is not a "
                             r"file.*Nothing was loaded"):
        patches.load_checkpoint(path, model, freeze=False, tokenizer=str(tmp_path / "nope.json"),
                                **asked)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_environment_sets_the_rules_and_a_bad_value_is_refused(tmp_path, monkeypatch) -> None:
    path = _tiny_checkpoint(tmp_path, 20)
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "std0.02")
    monkeypatch.setenv("TRAINING_PATCHES_HEAD_ROW_INIT", "randn")
    patches.advanced.apply(["checkpoint"])
    model = TinyTextModel(vocab=24, dim=8)
    report = patches.load_checkpoint(path, model, freeze=False)
    assert report.row_init == {"embedding": "std0.02", "head": "randn"}
    # a keyword wins over the environment
    report = patches.load_checkpoint(path, TinyTextModel(vocab=24, dim=8), freeze=False,
                                     row_init="spread")
    assert report.row_init == {"embedding": "spread", "head": "randn"}
    patches.revert()
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "fvt")
    with pytest.raises(patches.advanced.ConfigError, match=r"TRAINING_PATCHES_ROW_INIT.*'fvt'"):
        patches.advanced.apply(["checkpoint"])


def test_the_same_seed_grows_the_same_rows_under_every_rule(tmp_path) -> None:
    """Every rule for both rows; ``auto`` (the embedding's only) with the default head."""
    path = _tiny_checkpoint(tmp_path, 20)
    pairs = [(rule, rule) for rule in RULES] + [(row_init.AUTO, row_init.DEFAULT_HEAD_ROW_INIT)]
    for rule, head in pairs:
        a, b = TinyTextModel(vocab=26, dim=8), TinyTextModel(vocab=26, dim=8)
        patches.load_checkpoint(path, a, freeze=False, seed=3, row_init=rule, head_row_init=head)
        patches.load_checkpoint(path, b, freeze=False, seed=3, row_init=rule, head_row_init=head)
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                     b.state_dict().values())), rule


# -- the tokenizer is checked against the model it spells for --------------------------------


def _spm_model(path) -> str:
    """A small SentencePiece model of English text (another model's tokenizer)."""
    spm = pytest.importorskip("sentencepiece")
    import io

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["the sea is calm", "a lamp and a seal", "tea time for all",
                                "i see the sun", "selam lealem"] * 20),
        model_writer=out, vocab_size=40, model_type="bpe", hard_vocab_limit=False,
        minloglevel=2, num_threads=1)
    path.write_bytes(out.getvalue())
    return str(path)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["sentencepiece", "base vocab.json", "[START] at a new id"])
def test_a_tokenizer_that_is_not_the_models_is_refused_naming_what_does_not_fit(
        tmp_path, case: str) -> None:
    """The spelled default read any tokenizer: another model's SentencePiece file spelled the
    new rows from unrelated ids, the vocab.json before the extension listed its own [START] as
    a new token. Its size and its structural tokens are checked against the model's rows:
    one paragraph, nothing loaded."""
    grown, base_rows, rows = _grown_vocab(tmp_path)
    start_last = case != "[START] at a new id"  # the model's layout keeps nothing last
    path = _tiny_checkpoint(tmp_path, base_rows, start_last=start_last)
    model = _tiny(rows, start_last=start_last)
    tokenizer = {"sentencepiece": lambda: _spm_model(tmp_path / "bpe.model"),
                 "base vocab.json": lambda: str(tmp_path / "vocab.json"),
                 "[START] at a new id": lambda: grown}[case]()
    before = _state(model)
    with pytest.raises(patches.CheckpointMismatchError) as raised:
        patches.load_checkpoint(path, model, freeze=False, tokenizer=tokenizer)
    message = str(raised.value)
    assert f"the tokenizer {tokenizer} does not fit the model (text_embedding.weight: " \
           f"{rows} rows" in message
    if case == "sentencepiece":
        import sentencepiece

        size = sentencepiece.SentencePieceProcessor(model_file=tokenizer).get_piece_size()
        assert size != rows and f"it has {size} ids and the model's text rows hold {rows} " \
                                f"tokens ({base_rows} trained in the checkpoint" in message
    elif case == "base vocab.json":
        assert f"it has {base_rows} ids" in message and "no token beyond the checkpoint's" in message
    else:
        assert f"its own '[START]' (id {rows - 1}) would be new" in message
    assert "Nothing was loaded" in message and "\n" not in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("content", ['{"model": {"gpt_layers": 30}, "languages": ["en"]}',
                                     "not a tokenizer at all", ""])
def test_a_file_that_is_no_tokenizer_is_the_one_checkpoint_error_paragraph(
        tmp_path, content: str) -> None:
    """``tokenizer=`` naming coqui's config.json let the tokenizers library's bare Exception
    escape load_checkpoint: any read error is the loader's one paragraph."""
    path = _tiny_checkpoint(tmp_path, 20)
    model = TinyTextModel(vocab=24, dim=8)
    config = tmp_path / "config.json"
    config.write_text(content, encoding="utf-8")
    before = _state(model)
    with pytest.raises(patches.CheckpointError) as raised:
        patches.load_checkpoint(path, model, freeze=False, tokenizer=str(config))
    message = str(raised.value)
    assert f"the tokenizer given could not be read ({config} holds " in message
    assert "Nothing was loaded" in message and "\n" not in message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _loaded(tmp_path, tokenizer, sizes: tuple[str, int, int]
            ) -> tuple[TinyTextModel, patches.LoadReport]:
    """The tiny model (XTTS layout) grown to ``_grown_vocab``'s ``sizes``, loaded from the
    base checkpoint with ``tokenizer``."""
    _, base_rows, rows = sizes
    path = _tiny_checkpoint(tmp_path, base_rows, start_last=True)
    model = _tiny(rows, start_last=True)
    report = patches.load_checkpoint(path, model, freeze=False, tokenizer=tokenizer)
    return model, report


def test_a_vocab_json_is_read_by_its_content_whatever_its_name(tmp_path) -> None:
    """A valid vocab.json without the ``.json`` suffix was called unreadable."""
    sizes = _grown_vocab(tmp_path)
    renamed = tmp_path / "tokenizer"
    renamed.write_bytes((tmp_path / "vocab_am.json").read_bytes())
    expected, report = _loaded(tmp_path, sizes[0], sizes)
    got, renamed_report = _loaded(tmp_path, str(renamed), sizes)
    assert renamed_report.row_init == report.row_init and report.row_init["spelled"] >= 3
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in expected.state_dict().items())


def test_a_hugging_face_tokenizer_object_spells_as_its_file(tmp_path) -> None:
    """An HF tokenizer object was refused; it is read through its own ids (its backend)."""
    transformers = pytest.importorskip("transformers")
    sizes = _grown_vocab(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=sizes[0], unk_token="[UNK]")
    expected, report = _loaded(tmp_path, sizes[0], sizes)
    got, hf_report = _loaded(tmp_path, hf, sizes)
    assert hf_report.row_init == report.row_init and report.row_init["spelled"] >= 3
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in expected.state_dict().items())


# -- which romaniser spells ------------------------------------------------------------------


def tigrinya(text: str) -> str | None:
    """A user's romaniser for Tigrinya (Ethiopic script, as Amharic): every token 'tea'."""
    return "tea" if any("\u1200" <= ch <= "\u137f" for ch in text) else None


def broken(text: str) -> str | None:
    raise ValueError("no table yet")


def test_a_users_romanizer_wins_over_the_builtin_table_and_the_load_line_names_it(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """``register_language('ti', romanize=f)`` (the guide's example): Tigrinya shares the
    Ethiopic script, so the built-in Amharic table spelled every token and ``f`` was never
    called. The user's romaniser is asked first, and the load line names who spelled."""
    sizes = grown, _, _ = _grown_vocab(tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(grown)
    _, amharic_report = _loaded(tmp_path, grown, sizes)
    spelled = amharic_report.row_init["spelled"]
    assert amharic_report.new_rows.sources.spelled_by == {
        "the library's Amharic table ('am')": spelled}
    assert f"; spelled by the library's Amharic table ('am'): {spelled}" in \
        amharic_report.summary()
    register_language("ti", romanize=tigrinya)
    try:
        with caplog.at_level(logging.INFO, logger="training_patches"):
            _, report = _loaded(tmp_path, grown, sizes)
    finally:
        unregister_language("ti")
    sources = report.new_rows.sources
    assert sources.spelled_by == {"register_language('ti', romanize=tigrinya)": spelled}
    assert sources.sources[tok.token_to_id("ሰላም")] == tuple(tok.encode("tea").ids)
    assert f"; spelled by register_language('ti', romanize=tigrinya): {spelled}" in caplog.text


def test_a_romanizer_that_fails_on_most_tokens_is_a_warning_with_the_count(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A romaniser that raised on every call gave 0 spelled rows without a WARNING."""
    sizes = _grown_vocab(tmp_path)
    register_language("ti", romanize=broken)
    try:
        with caplog.at_level(logging.WARNING, logger="training_patches"):
            _, report = _loaded(tmp_path, sizes[0], sizes)
    finally:
        unregister_language("ti")
    failed, asked, first = report.new_rows.sources.failures[
        "register_language('ti', romanize=broken)"]
    assert failed == asked >= report.row_init["spelled"] >= 3  # Amharic's table spelled them
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warnings if "romanize=broken) failed on" in w] == [
        f"training-patches: register_language('ti', romanize=broken) failed on {failed} of the "
        f"{asked} new token(s) it was asked to spell (the first: {first}); those tokens went to "
        f"the next romaniser or started by spread. Expected the token in Latin letters, or None "
        f"for text it cannot spell: fix the function."]
    assert first.startswith("ValueError: no table yet on ")


def test_a_romanizer_alone_for_a_known_language_keeps_its_cleaner(monkeypatch) -> None:
    """Adding a romaniser to a language already known (Amharic here; coqui's own in
    test_xtts_language.py) needed replace=True, which swapped its cleaner for the plain one."""
    from patches import languages

    for table in (languages._languages, languages._romanizers):  # Amharic's, put back after
        monkeypatch.setitem(table, "am", table["am"])
    cleaned = languages.get_language("am").cleaner("በ2016 ዓ.ም።")
    with pytest.raises(patches.advanced.ConfigError,
                       match=r"already has a romaniser \(the library's "
                             r"Amharic table \('am'\)\).*replace=True"):
        register_language("am", romanize=tigrinya)
    register_language("am", romanize=tigrinya, replace=True)
    language = languages.get_language("am")
    assert language.cleaner("በ2016 ዓ.ም።") == cleaned and language.aliases == ("amh",)
    assert language.char_limit == amharic.CHAR_LIMIT
    assert languages.romanize("ሰ") == ("tea", "am")


def test_a_tokenizer_an_integration_found_that_does_not_fit_starts_spread_rows_and_says_so(
        tmp_path, caplog) -> None:
    """The trainer integrations pass the tokenizer they find (the HF Trainer's
    processing_class, ...). One that does not fit the model is no reason to refuse a resume
    upstream would make: a WARNING naming where it came from, the new rows by 'spread'."""
    import logging

    from patches.checkpoint.grown import TrainerResume, load_grown

    caplog.set_level(logging.INFO, logger="training_patches")
    grown, base_rows, rows = _grown_vocab(tmp_path)
    path = _tiny_checkpoint(tmp_path, base_rows, start_last=True)
    model = _tiny(rows, start_last=True)
    saved = set(torch.load(path, weights_only=True)["model"])
    resume = TrainerResume("the test trainer", tokenizer=str(tmp_path / "vocab.json"),
                           tokenizer_source="its processing_class")
    load_grown(path, model, saved, resume=resume)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith(
        "training-patches: the test trainer found its processing_class to spell the new "
        "tokens with, and it cannot be used: training-patches: cannot start the new rows")
    assert "the new rows started by 'spread' instead" in said[0]
    assert "no tokenizer found (its processing_class, which does not fit the model)" in caplog.text
