"""The benchmarks' two experiments on the library's new rows (issue 25),
``bench_new_language.adjust_new_rows``: the new embedding rows shrunk by a factor, and the
new ``[am]`` tag started as the base model's ``[START]`` or ``[en]`` rows. The figures they
produced are in docs/benchmarks.md; here, that each changes exactly the rows it names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_new_language as bench  # noqa: E402

BASE = ["[STOP]", "[UNK]", "[SPACE]", "[en]", "a", "b", "[START]"]
# extend-tokenizer's order: the tag takes [START]'s old place, [START] moves to the end
GROWN = BASE[:-1] + ["[am]", "ሀ", "ለ", "[START]"]
CFG = dict(d_model=16, heads=2, layers=1, ctx=8)


def _vocab(path: Path, tokens: list[str]) -> Path:
    Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]")).save(str(path))
    return path


def _grown(tmp_path: Path, **kw):
    torch.manual_seed(0)
    base = bench.build_model(len(BASE), CFG).state_dict()
    model = bench.build_model(len(GROWN), CFG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bench.adjust_new_rows(model, base, _vocab(tmp_path / "base.json", BASE),
                          _vocab(tmp_path / "grown.json", GROWN), **kw)
    return base, before, model.state_dict()


def test_scale_shrinks_exactly_the_new_embedding_rows(tmp_path: Path) -> None:
    _, before, after = _grown(tmp_path, scale=0.25)
    emb0, emb1 = before["text_embedding.weight"], after["text_embedding.weight"]
    new = slice(len(BASE) - 1, len(GROWN) - 1)  # [am], ሀ, ለ; [START] stays last
    assert torch.equal(emb1[new], emb0[new] * 0.25)
    assert torch.equal(emb1[: len(BASE) - 1], emb0[: len(BASE) - 1])
    assert torch.equal(emb1[-1], emb0[-1])
    for key in ("text_head.weight", "text_head.bias"):  # the head is left as made
        assert torch.equal(after[key], before[key])


@pytest.mark.parametrize("tag, source", [("start", len(BASE) - 1), ("en", 3)])
def test_tag_copies_the_named_base_rows_into_am_only(tmp_path: Path, tag: str,
                                                     source: int) -> None:
    base, before, after = _grown(tmp_path, tag=tag)
    am = GROWN.index("[am]")
    for key in ("text_embedding.weight", "text_head.weight", "text_head.bias"):
        assert torch.equal(after[key][am], base[key][source]), key
        others = [i for i in range(len(GROWN)) if i != am]
        assert torch.equal(after[key][others], before[key][others]), key


def test_an_unknown_tag_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tag 'fr'"):
        _grown(tmp_path, tag="fr")
