"""XTTS ``gpt_checkpoint`` with a grown vocabulary: coqui pads with randn, we keep and freeze."""

from __future__ import annotations

import pytest
import torch

import patches
from patches.vocab_freeze import freeze_of

pytestmark = pytest.mark.xtts


@pytest.fixture(scope="module")
def base_gpt(tiny_xtts, tmp_path_factory) -> str:
    """A GPT state dict of the 74-token tiny model, trained briefly."""
    run = tmp_path_factory.mktemp("base_gpt")
    config = tiny_xtts.make_config(run / "run", epochs=1)
    model = tiny_xtts.make_model(config)
    tiny_xtts.train(config, model)
    path = run / "gpt.pth"
    torch.save(model.xtts.gpt.state_dict(), path)
    return str(path)


def build(tiny_xtts, vocab, gpt_path, tmp_path):
    config = tiny_xtts.make_config(tmp_path / "run", vocab=vocab, gpt_checkpoint=gpt_path)
    return tiny_xtts.make_model(config)


def test_grown_vocab_keeps_base_rows_and_freezes_them(tiny_xtts, tiny_xtts_extended_vocab,
                                                      base_gpt, tmp_path, caplog,
                                                      monkeypatch) -> None:
    """The spelled rule through GPTTrainer's own tokenizer_file (asked for: the default auto
    gives this tiny base, which does not read its text, near-zero rows; that outcome:
    tests/test_checkpoint_xtts.py)."""
    monkeypatch.setenv("TRAINING_PATCHES_ROW_INIT", "spelling")
    patches.advanced.apply()
    base = torch.load(base_gpt)
    with caplog.at_level("INFO", logger="training_patches"):
        model = build(tiny_xtts, tiny_xtts_extended_vocab, base_gpt, tmp_path)
    emb = model.xtts.gpt.text_embedding.weight.detach()
    old = base["text_embedding.weight"]
    assert emb.shape[0] == 82 and old.shape[0] == 74
    assert torch.equal(emb[:73], old[:73])  # every base token row kept
    assert torch.equal(emb[81], old[73])  # [START] moved to the new last row
    new = emb[73:81]
    assert torch.isfinite(new).all()
    # the spelled rule: GPTTrainer's tokenizer_file spells each new Amharic token, and its
    # row starts at the mean of its spelling's pieces' rows, off by a small noise that no
    # seed draws (not randn, not one shared mean row, no offset shared by the rows);
    # the [am] tag starts as [START]; the load line counts them
    from tokenizers import Tokenizer

    from patches.row_init import romanized_sources

    tok = Tokenizer.from_file(str(tiny_xtts_extended_vocab))
    found = romanized_sources(tok, range(73, 81), trained=lambda i: i < 73)
    assert found.sources, found.unspelled
    base_rows = old[:73].double()
    std = base_rows.std(0, unbiased=False)
    offsets = torch.stack([new[row - 73].double() - base_rows[list(pieces)].mean(0)
                           for row, pieces in found.sources.items()])
    assert (offsets.abs() <= 0.5 * std).all()  # 0.1 x std x the noise only
    assert torch.equal(emb[tok.token_to_id("[am]")], old[73])
    assert (f"embedding spelling ({len(found.sources)} from their spelling, 1 language "
            f"tag(s) as the start token ('[am]'))") in caplog.text
    assert "embedding rule auto" not in caplog.text  # the rule asked for, no probe
    assert len({tuple(r.tolist()) for r in new}) == 8
    head = model.xtts.gpt.text_head
    assert torch.equal(head.weight.detach()[:73], base["text_head.weight"][:73])
    assert freeze_of(model.xtts.gpt.text_embedding.weight) is not None


def test_upstream_pads_new_rows_with_randn(tiny_xtts, tiny_xtts_extended_vocab, base_gpt,
                                           tmp_path) -> None:
    """Without the patch, coqui's own padding: independent randn rows (std 1, about 50 times
    a trained XTTS embedding's scale), far from anything the model learned."""
    base = torch.load(base_gpt)
    model = build(tiny_xtts, tiny_xtts_extended_vocab, base_gpt, tmp_path)
    new = model.xtts.gpt.text_embedding.weight.detach()[73:81]
    assert (new - base["text_embedding.weight"][:73].mean(0)).norm(dim=1).min() > 1.0
    assert freeze_of(model.xtts.gpt.text_embedding.weight) is None


def test_report_checks_the_frozen_rows_of_any_coqui_run_that_loaded_its_base(
        tiny_xtts, tiny_xtts_extended_vocab, base_gpt, tmp_path, capsys) -> None:
    """Not only headlessXttsTrain.py: a coqui Trainer whose GPTTrainer grew and froze its
    base (here through gpt_checkpoint) records the base file and the frozen rows where the
    run starts (trainer_runs.jsonl), and ``report`` checks the run's newest checkpoint
    against them: kept bit for bit, then moved when a frozen row of the file is changed."""
    import json
    from pathlib import Path

    from patches import _run
    from patches.tools import cli

    patches.advanced.apply(base_vocab=74)
    config = tiny_xtts.make_config(tmp_path / "out", vocab=tiny_xtts_extended_vocab,
                                   gpt_checkpoint=base_gpt, epochs=1, save_step=3)
    trainer = tiny_xtts.train(config)
    folder = Path(trainer.output_path)
    start = json.loads((folder / "trainer_runs.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start"
    assert start["base_weights"]["path"] == str(Path(base_gpt).resolve())
    assert start["base_weights"]["frozen_rows"] == [[0, 72], [81, 81]]
    patches.advanced.reset_runtime_state()
    cli.main(["report", str(folder), "--no-picture"])  # learning not checked: run_eval is off
    text = capsys.readouterr().out
    assert ("frozen rows: 74 rows [[0, 72], [81, 81]] of text_embedding.weight, "
            "text_head.weight, text_head.bias: max |") in text, text
    assert "- base| = 0\n" in text and "frozen base rows moved" not in text

    newest = max(folder.glob("*.pth"), key=lambda p: p.stat().st_mtime)
    state = torch.load(newest, weights_only=False)
    state["model"]["xtts.gpt.text_embedding.weight"][5] += 0.5
    torch.save(state, newest)
    assert cli.main(["report", str(folder), "--no-picture"]) == 1
    assert "frozen base rows moved by up to 0.5" in capsys.readouterr().out
