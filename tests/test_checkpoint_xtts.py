"""The 74 -> 82 token restore through the real coqui Trainer and XTTS GPTTrainer.

A tiny XTTS GPT is trained on its base vocabulary (74 tokens), then a run with the
extended vocabulary (82 tokens: 7 Amharic characters and [am]) restores it with
``restore_path``. With the patches applied (what the activation line does), all 74
trained rows survive in the embedding and the head ([START] carried to the new last
row), the new rows sit at the old mean, and training goes on without a loss jump.
Without the ``checkpoint`` patch, coqui's partial load keeps none of them (the control).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import patches
from patches.reads_text import READS_ABOVE

pytestmark = [pytest.mark.xtts, pytest.mark.slow]

torch.set_num_threads(1)


def _gpt(trainer):
    return trainer.model.xtts.gpt


@pytest.fixture
def base_run(tiny_xtts, tmp_path):
    """(checkpoint path, base text embedding, head weight, head bias, last avg loss)."""
    patches.advanced.apply()
    config = tiny_xtts.make_config(tmp_path / "base", epochs=3, save_step=5, save_n_checkpoints=2)
    trainer = tiny_xtts.train(config)
    gpt = _gpt(trainer)
    checkpoints = sorted(Path(trainer.output_path).glob("checkpoint_*.pth"))
    assert checkpoints, list(Path(trainer.output_path).iterdir())
    return (checkpoints[-1], gpt.text_embedding.weight.detach().clone(),
            gpt.text_head.weight.detach().clone(), gpt.text_head.bias.detach().clone(),
            trainer.keep_avg_train.avg_values["avg_loss"])


def _first_loss(trainer) -> float:
    """The loss of the restored model on the first training batch (no update)."""
    loader = trainer.get_train_dataloader(trainer.train_samples, verbose=False)
    batch = trainer.format_batch(next(iter(loader)))
    with torch.no_grad():
        trainer.model.eval()
        _, loss_dict = trainer.model.train_step(batch, trainer.criterion)
        trainer.model.train()
    return float(loss_dict["loss"])


def test_restore_74_to_82_keeps_every_trained_row(tiny_xtts, tiny_xtts_extended_vocab,
                                                   tiny_xtts_mixed_manifest, base_run, tmp_path,
                                                   caplog):
    ckpt, emb, head_w, head_b, base_loss = base_run
    assert emb.shape[0] == 74
    config = tiny_xtts.make_config(tmp_path / "ext", vocab=tiny_xtts_extended_vocab,
                                   manifest=tiny_xtts_mixed_manifest, epochs=1)
    with caplog.at_level("INFO", logger="training_patches"):
        trainer = tiny_xtts.make_trainer(config, restore_path=str(ckpt))
    gpt = _gpt(trainer)
    new_emb = gpt.text_embedding.weight.detach()
    assert new_emb.shape[0] == 82 and gpt.start_text_token == 81
    # 74 of 74 trained rows kept: ids 0..72 in place, [START] (73) carried to 81.
    kept = [torch.equal(new_emb[i], emb[i]) for i in range(73)] + [torch.equal(new_emb[81], emb[73])]
    assert sum(kept) == 74
    head = gpt.text_head
    assert torch.equal(head.weight.detach()[:73], head_w[:73])
    assert torch.equal(head.weight.detach()[81], head_w[73])
    assert torch.equal(head.bias.detach()[:73], head_b[:73]) and head.bias[81] == head_b[73]
    # New rows 73..80: finite, by the default rules with the config's tokenizer_file: row_init
    # auto probes the tiny base GPT, which does not read its text (text_tv about 0.003), so
    # the embedding starts near zero (std0.02, the [am] tag too: nothing is spelled); the
    # head at the base rows' spread, its bias at the old mean.
    new_rows = new_emb[73:81].clone()
    assert torch.isfinite(new_rows).all()
    line = next(r.getMessage() for r in caplog.records if f"loaded {ckpt}" in r.getMessage())
    assert re.search(r"vocabulary row\(s\) \(embedding std0\.02, head spread; embedding rule "
                     r"auto: the base model does not read its text \(text_tv 0\.0\d\d at or "
                     r"below " + re.escape(str(READS_ABOVE)) + r", in \d+\.\d s\) -> std0\.02, near-zero rows, which keep the "
                     r"base language; TRAINING_PATCHES_ROW_INIT=spelling forces spelled rows "
                     r"\(docs/design/row_init\.md\)\)\), ", line), line
    assert "spelled by" not in line and "as the start token" not in line
    assert new_rows.abs().max() < 0.02 * 6 and abs(new_rows.std().item() - 0.02) < 0.005
    assert not torch.equal(new_emb[73], emb[73])  # [am] is not started as [START]
    z = (head.weight.detach()[73:81] - head_w[:73].mean(0)) / head_w[:73].std(0, unbiased=False)
    assert z.abs().max() < 6 and z.abs().mean() > 0.3
    assert (head.bias.detach()[73:81] - head_b[:73].mean()).abs().max() < 1e-3 * head_b[:73].std()
    assert "74 -> 82 rows" in caplog.text
    # restore_path takes the weights only (as upstream): the line and a WARNING say that the
    # file's optimizer state and step were not restored (issue 19: no silent drop).
    saved = torch.load(ckpt, weights_only=False)["step"]
    assert "model remapped" in line and "optimizer dropped (no optimizer passed)" in line
    assert f"step dropped (saved {saved}; a weights-only start counts from 0)" in line
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
              and "restore_path loads the model weights only" in r.getMessage()]
    assert len(warned) == 1 and f"holds optimizer state and step {saved}" in warned[0]
    # The base rows are frozen by the loader (vocab_freeze), and the loss does not jump.
    first = _first_loss(trainer)
    assert math.isfinite(first) and first < base_loss * 1.25, (first, base_loss)
    trainer.fit()
    after = trainer.keep_avg_train.avg_values["avg_loss"]
    assert math.isfinite(after) and after < base_loss * 1.25, (after, base_loss)
    assert torch.equal(gpt.text_embedding.weight.detach()[:73], emb[:73])
    assert not torch.equal(gpt.text_embedding.weight.detach()[73:81], new_rows)


def test_control_upstream_partial_load_keeps_none(tiny_xtts, tiny_xtts_extended_vocab,
                                                  tiny_xtts_mixed_manifest, base_run, tmp_path):
    """Without the checkpoint patch coqui drops every resized tensor (the fault fixed above)."""
    ckpt, emb, *_ = base_run
    patches.revert("checkpoint")
    config = tiny_xtts.make_config(tmp_path / "ext", vocab=tiny_xtts_extended_vocab,
                                   manifest=tiny_xtts_mixed_manifest, epochs=1)
    trainer = tiny_xtts.make_trainer(config, restore_path=str(ckpt))
    new_emb = _gpt(trainer).text_embedding.weight.detach()
    assert sum(torch.equal(new_emb[i], emb[i]) for i in range(73)) == 0


def test_continue_path_after_a_torn_newest_checkpoint(tiny_xtts, base_run, tmp_path, caplog):
    """continue_path resumes from the newest complete checkpoint, optimizer included."""
    ckpt, *_ = base_run
    folder = ckpt.parent
    torn = folder / "checkpoint_999999.pth"
    torn.write_bytes(ckpt.read_bytes()[:1000])
    config = tiny_xtts.make_config(tmp_path / "unused", epochs=4)
    with caplog.at_level("WARNING", logger="training_patches"):
        trainer = tiny_xtts.make_trainer(config, continue_path=str(folder))
    assert "checkpoint_999999.pth" in caplog.text and torn.exists()
    step = torch.load(ckpt, weights_only=True)["step"]
    assert trainer.total_steps_done == step + 1
    opt = trainer.optimizer if not isinstance(trainer.optimizer, list) else trainer.optimizer[0]
    assert len(opt.state) > 0
    for group in opt.param_groups:
        for p in group["params"]:
            for value in opt.state[p].values():
                assert value.dim() == 0 or value.shape == p.shape
