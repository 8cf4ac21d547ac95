"""A new language on a small GPT: does the fine-tune learn it without breaking the old one?

The experiment of issue 20, small enough for a 2-core CPU:

1. **Base model.** A plain GPT with XTTS's text layout (``text_embedding``/``text_head``
   with ``[START]`` as the last row, ``[STOP]`` id 0) trained on English until its held-out
   loss plateaus. The English is the docstrings of a fixed list of Python standard-library
   modules (whatever interpreter runs this), lower-cased, split into sentences.
2. **Vocabulary grown** with ``training-patches extend-tokenizer`` (the real command, run
   as a subprocess) for Amharic: the Amharic lines written for the tests (read from
   ``tests/test_tokenizer_tools.py`` and ``tests/test_xtts_language.py``) plus generated
   Ethiopic text (below). For the resume arms it grows a second time half-way, when a
   second corpus (new words) arrives.
3. **Arms**, each with the same data order and the same seeds, every one a separate
   Python process, forked from a server that has imported torch and nothing of the library
   (multiprocessing's ``forkserver``: seconds of imports once, not once an arm; the library
   arms start with ``import patches.auto`` and ``TRAINING_PATCHES_BASE_VOCAB``; the others
   never import the library):

   - ``upstream``: new rows as XTTS's GPTTrainer makes them (``torch.randn`` rows, the
     old ``[START]`` row copied to the new end), everything trainable;
   - ``notes``: the user's notes: the same rows, a gradient-hook "freeze" of the base
     rows, AdamW with weight decay; half-way the vocabulary grows again and the run
     resumes with a fresh optimizer AND a fresh warmup scheduler (the notes' fixed resume);
   - ``notes_stale``: the notes' resume before their fix: fresh optimizer, the old
     (decayed) scheduler restored;
   - ``library``: ``patches.load_checkpoint`` (new rows at the old mean, base rows frozen
     by ``TRAINING_PATCHES_BASE_VOCAB``), the NaN guard on;
   - ``library_unfrozen``: the same without the freeze (``freeze=False``, no
     ``TRAINING_PATCHES_BASE_VOCAB``): what the freeze itself costs or buys;
   - ``library_resume``: the same, and half-way the vocabulary grows again: a
     ``CheckpointManager`` save, a model built with the grown tokenizer, and
     ``patches.load_checkpoint`` (rows kept, moments remapped, scheduler continued).

   Each arm runs once clean and once with ONE NaN loss injected at a fixed step.

Measured: new-language loss (nats per character of held-out text, so that runs with
different tokenizers compare) after K steps and the steps to a target; English loss
before and after (forgetting); drift of the base rows; the loss and LR around the resume;
what the injected NaN did.

Generated Ethiopic: 19 consonant series x 7 vowel orders (133 syllables of U+1200-U+135A),
syllables drawn with Zipf weights into a lexicon of pseudo-words (2-4 syllables), and
sentences of 4-9 words from a sparse random word-bigram chain (each word has 6 successors
with Zipf weights), ending in "።". Lexicon A (first corpus) and lexicon B (the second
corpus, new words only) come from ``random.Random(20)``: the same text on every run.

Run:  .venv/bin/python benchmarks/bench_new_language.py [--quick] [--out DIR]
Writes DIR/results.json, DIR/table.md and DIR/new_language.png (default DIR:
benchmarks/results/new_language[_quick]) and prints the table; DIR/work (tokenizers, base
model, checkpoints, each arm's log) is removed at the end unless --keep-work.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import multiprocessing
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The library arms that start new rows by a rule other than the default (embedding, head):
# each with the library's freeze, clean runs only. "library" itself uses the defaults
# (spelling embedding, spread head, since issue 38); library_mean is the default before
# issue 25, library_romanized_spread the default from then until the offset (romanized_offset,
# issue 25 to issue 38).
RULE_ARMS = {
    "library_romanized_spread": ("romanized", "spread"),
    "library_mean": ("mean", "mean"),
    "library_spread": ("spread", "spread"),
    "library_std002": ("std0.02", "std0.02"),
    "library_romanized": ("romanized", "romanized"),
    "library_romanized_mean": ("romanized", "mean"),
}
ARMS = ("upstream", "notes", "notes_stale", "hooks_std002", "plain_std002", "library",
        "library_unfrozen", "library_resume", *RULE_ARMS)
LIBRARY_ARMS = ("library", "library_unfrozen", "library_resume", *RULE_ARMS)
RESUME_ARMS = ("notes", "notes_stale", "library_resume")
# Arms run once clean and once with one NaN loss; the others clean only.
NAN_ARMS = ("upstream", "notes", "notes_stale", "library", "library_unfrozen", "library_resume")
STD002_ARMS = ("hooks_std002", "plain_std002")
ARM_TEXT = {
    "upstream": "upstream: randn rows, all trainable",
    "notes": "notes: grad hooks, fresh opt+sched at resume",
    "notes_stale": "notes before their fix: fresh opt, old sched",
    "hooks_std002": "std-0.02 rows + the notes' grad hooks",
    "plain_std002": "std-0.02 rows, nothing frozen",
    "library": "library: default rows (spelling/spread), freeze, guard",
    "library_unfrozen": "library without the freeze",
    "library_resume": "library + resume after 2nd growth",
    **{arm: f"library, {emb} rows / {head} head, freeze" for arm, (emb, head) in RULE_ARMS.items()},
}

# Sizes. quick: about 2 minutes on 2 free cores; full: about 15.
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(d_model=64, layers=2, heads=4, ctx=96, batch=16, base_max_steps=600,
                  base_eval_every=50, steps=120, eval_every=20, seeds=3, base_vocab=256,
                  new_pieces=120, new_pieces_2=240, n_sentences_a=1500, n_sentences_b=500),
    "full": dict(d_model=96, layers=3, heads=4, ctx=96, batch=24, base_max_steps=3000,
                 base_eval_every=100, steps=600, eval_every=30, seeds=3, base_vocab=384,
                 new_pieces=200, new_pieces_2=400, n_sentences_a=4000, n_sentences_b=1500),
}
FT_LR, BASE_LR, WEIGHT_DECAY, BETAS, CLIP = 1e-3, 3e-3, 1e-2, (0.9, 0.96), 1.0
EVAL_LINES = 64
TARGET_MARGIN = 0.10


# -- text ----------------------------------------------------------------------------------

STDLIB_MODULES = ("argparse", "collections", "json", "pathlib", "random", "statistics",
                  "textwrap", "string", "functools", "itertools", "logging", "csv",
                  "datetime", "decimal", "fractions", "heapq", "inspect", "shutil", "tarfile",
                  "zipfile", "subprocess", "threading", "queue", "socket", "email.message",
                  "http.client", "urllib.parse", "unittest", "difflib", "calendar", "pickle",
                  "typing", "dataclasses", "enum", "contextlib", "abc", "operator", "copy",
                  "tempfile", "glob", "fnmatch", "locale", "gettext", "codecs", "io", "os")


def english_sentences() -> list[str]:
    """Lower-cased sentences of the docstrings of :data:`STDLIB_MODULES` (and their public
    classes and functions), letters, spaces and ``,.'`` only, 24-160 characters, unique."""
    import importlib
    import inspect

    texts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            texts.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_") and inspect.isfunction(vars(obj)[meth]):
                        texts.append(inspect.getdoc(vars(obj)[meth]) or "")
    seen, out = set(), []
    for text in texts:
        for sent in re.split(r"(?<=[.!?])\s+|\n\s*\n", text):
            sent = re.sub(r"[^a-z,.' ]+", " ", sent.lower())
            sent = re.sub(r"\s+", " ", sent).strip()
            if 24 <= len(sent) <= 160 and sent not in seen and len(sent.split()) >= 4:
                seen.add(sent)
                out.append(sent)
    return out


def test_amharic_lines() -> list[str]:
    """The Amharic sentences written for the tests, read (not imported) from their files."""
    lines = []
    for file, name in (("test_tokenizer_tools.py", "AMHARIC"),
                       ("test_xtts_language.py", "AMHARIC_TEXTS")):
        tree = ast.parse((ROOT / "tests" / file).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                lines += list(ast.literal_eval(node.value))
    return lines


# First syllable (order 1) of consonant series; orders 1-7 are it and the next 6 code points.
SERIES = (0x1200, 0x1208, 0x1210, 0x1218, 0x1228, 0x1230, 0x1240, 0x1260, 0x1270, 0x1290,
          0x12A0, 0x12A8, 0x12C8, 0x12D8, 0x12E8, 0x12F0, 0x1308, 0x1320, 0x1348)
# Series the second corpus brings; those that occur in the tests' Amharic are passed over.
SERIES_NEW = (0x1238, 0x1278, 0x1298, 0x12E0, 0x1300, 0x1328, 0x1350, 0x12B8)


def _zipf(n: int, s: float = 1.1) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def generated_ethiopic(n_a: int, n_b: int, avoid: str, seed: int = 20
                       ) -> tuple[list[str], list[str], list[str]]:
    """Sentences of lexicon A, sentences of lexicon B, and the characters only B has.

    A: 350 pseudo-words of 2-4 syllables of :data:`SERIES` (Zipf-weighted syllables),
    sentences from a sparse bigram chain. B: 150 new words, each with at least one syllable
    of 4 series of :data:`SERIES_NEW` absent from ``avoid`` (28 characters A never has),
    sentences mixing B words and (30%) A words."""
    rng = random.Random(seed)
    syllables = [chr(base + order) for base in SERIES for order in range(7)]
    rng.shuffle(syllables)
    weights = _zipf(len(syllables))
    series_new = [b for b in SERIES_NEW if not any(chr(b + o) in avoid for o in range(7))][:4]
    new_chars = [chr(base + order) for base in series_new for order in range(7)]

    def word(new: bool) -> str:
        parts = rng.choices(syllables, weights, k=rng.choice((2, 2, 3, 3, 3, 4)))
        if new:
            parts[rng.randrange(len(parts))] = rng.choice(new_chars)
        return "".join(parts)

    lex_a: list[str] = []
    while len(lex_a) < 350:
        w = word(False)
        if w not in lex_a:
            lex_a.append(w)
    lex_b: list[str] = []
    while len(lex_b) < 150:
        w = word(True)
        if w not in lex_b:
            lex_b.append(w)

    def chain(words: list[str], others: list[str], p_other: float, n: int) -> list[str]:
        succ = {w: rng.sample(words, 6) for w in words}
        start_w = _zipf(len(words), 0.9)
        out = []
        for _ in range(n):
            w = rng.choices(words, start_w)[0]
            sent = [w]
            for _ in range(rng.randint(3, 8)):
                if others and rng.random() < p_other:
                    sent.append(rng.choice(others))
                    continue
                w = rng.choices(succ[w], _zipf(6))[0]
                sent.append(w)
            out.append(" ".join(sent) + "።")
        return out

    return chain(lex_a, [], 0.0, n_a), chain(lex_b, lex_a, 0.3, n_b), new_chars


# -- the model (imported by the workers too: torch only) ---------------------------------------


def build_model(rows: int, cfg: dict[str, Any]):
    import torch
    from torch import nn

    class TinyGPT(nn.Module):
        """A plain causal GPT with XTTS's text layout: ``text_embedding``, ``text_head``
        (with bias) and ``start_text_token`` = the last row."""

        def __init__(self) -> None:
            super().__init__()
            d = cfg["d_model"]
            self.start_text_token = rows - 1
            self.text_embedding = nn.Embedding(rows, d)
            self.text_pos_embedding = nn.Embedding(cfg["ctx"], d)
            layer = nn.TransformerEncoderLayer(d, cfg["heads"], 4 * d, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.layers = nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)
            self.final_norm = nn.LayerNorm(d)
            self.text_head = nn.Linear(d, rows)
            for module in self.modules():  # GPT-2's init, as XTTS's GPT
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            n = ids.shape[1]
            x = self.text_embedding(ids) + self.text_pos_embedding(
                torch.arange(n, device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(n)
            return self.text_head(self.final_norm(self.layers(x, mask=mask, is_causal=True)))

    return TinyGPT()


def make_optimizer(model, lr: float):
    """AdamW as XTTS's GPTTrainer builds it (``optimizer_wd_only_on_weights``): decay on the
    Linear weights (``text_head`` among them), none on embeddings, biases and norms."""
    import torch
    from torch import nn

    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            skip = isinstance(module, (nn.Embedding, nn.LayerNorm)) or name.endswith("bias")
            (no_decay if skip else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=BETAS)


def make_scheduler(opt, total: int, warmup: int):
    """Linear warmup then cosine to 0 (``get_cosine_schedule_with_warmup``)."""
    import torch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def batch_tensor(seqs: list[list[int]], start: int, ctx: int):
    """[START] + ids + [STOP] (id 0), padded with -100 targets."""
    import torch

    rows = [[start] + s[: ctx - 2] + [0] for s in seqs]
    n = max(map(len, rows))
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    tgt = torch.full((len(rows), n - 1), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        tgt[i, : len(r) - 1] = torch.tensor(r[1:])
    return ids[:, :-1], tgt


def lm_loss(model, seqs: list[list[int]], ctx: int):
    import torch.nn.functional as F

    ids, tgt = batch_tensor(seqs, model.start_text_token, ctx)
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                           ignore_index=-100)


def nats(model, lines: list[list[Any]], ctx: int) -> tuple[float, int]:
    """Summed next-token NLL of held-out ``[ids, characters]`` lines, and their characters
    (+1 each for [STOP]): per character, comparable across tokenizers, unlike per token."""
    import torch
    import torch.nn.functional as F

    total, chars = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(lines), 32):
            chunk = lines[i: i + 32]
            ids, tgt = batch_tensor([ids for ids, _ in chunk], model.start_text_token, ctx)
            logits = model(ids)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            chars += sum(n + 1 for _, n in chunk)
    return total, chars


def nats_per_char(model, lines: list[list[Any]], ctx: int) -> float:
    total, chars = nats(model, lines, ctx)
    return total / chars


# -- main process: data, tokenizers, base model ------------------------------------------------


def _extend(src: Path, corpus: list[str], out: Path, pieces: int, base_text: Path) -> str:
    """The real ``training-patches extend-tokenizer`` command; returns what it printed."""
    corpus_file = out.with_suffix(".corpus.txt")
    corpus_file.write_text("\n".join(corpus) + "\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "patches", "extend-tokenizer", str(src), "--corpus",
           str(corpus_file), "--language", "am", "--output", str(out), "--force",
           "--new-pieces", str(pieces), "--base-text", str(base_text)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"extend-tokenizer failed ({' '.join(cmd)}):\n{done.stderr}")
    return done.stdout


def _train_base_vocab(texts: list[str], out: Path, size: int) -> None:
    # demo.xtts_tiny.train_bpe_vocab's layout, without its coqui cleaner import: the text
    # is already clean. [STOP]=0, [UNK]=1, [SPACE], [en], BPE, [START] last.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=size - 1, show_progress=False,
                                  special_tokens=["[STOP]", "[UNK]", "[SPACE]", "[en]"])
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(["[START]"])
    tok.save(str(out))


def _rows(vocab: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(vocab)).get_vocab_size()


def _encode(vocab: Path, lines: list[str], lang: str) -> list[list[int]]:
    from tokenizers import Tokenizer

    from patches.tools.tokenizer.bpe import xtts_text

    tok = Tokenizer.from_file(str(vocab))
    return [e.ids for e in tok.encode_batch([xtts_text(t, lang) for t in lines])]


def prepare(cfg: dict[str, Any], work: Path, log: list[str]) -> dict[str, Any]:
    """Corpora, tokenizers (base, grown once, grown twice), every line encoded."""
    from patches.languages import get_language

    english = english_sentences()
    random.Random(0).shuffle(english)
    en_eval, en_train = english[:EVAL_LINES], english[EVAL_LINES:]
    clean = get_language("am").cleaner
    tests_am = test_amharic_lines()
    gen_a, gen_b, new_chars = generated_ethiopic(cfg["n_sentences_a"], cfg["n_sentences_b"],
                                                 avoid="".join(map(clean, tests_am)))
    half = EVAL_LINES // 2
    corpus_a = gen_a[half:] + tests_am * 5  # the test lines are few: each 5 times
    a_train = [clean(t) for t in corpus_a]
    b_train = [clean(t) for t in gen_b[half:]]
    a_eval, b_eval = [clean(t) for t in gen_a[:half]], [clean(t) for t in gen_b[:half]]
    base_vocab, v1, v2 = work / "vocab_en.json", work / "vocab_am1.json", work / "vocab_am2.json"
    _train_base_vocab(en_train, base_vocab, cfg["base_vocab"])
    en_file = work / "en_base_text.txt"
    en_file.write_text("\n".join(en_eval + en_train[:200]) + "\n", encoding="utf-8")
    log.append(_extend(base_vocab, corpus_a, v1, cfg["new_pieces"], en_file))
    log.append(_extend(v1, corpus_a + gen_b[half:], v2, cfg["new_pieces_2"], en_file))
    fits = cfg["ctx"] - 2  # [START] and [STOP] around the text

    def fitting(lines: list[str], vocab: Path, lang: str) -> list[str]:
        return [t for t, ids in zip(lines, _encode(vocab, lines, lang)) if len(ids) <= fits]

    en_train, en_eval = fitting(en_train, base_vocab, "en"), fitting(en_eval, base_vocab, "en")
    a_train, a_eval = fitting(a_train, v1, "am"), fitting(a_eval, v1, "am")
    b_train, b_eval = fitting(b_train, v2, "am"), fitting(b_eval, v2, "am")
    data: dict[str, Any] = {"rows": {"base": _rows(base_vocab), "v1": _rows(v1), "v2": _rows(v2)},
                            "vocab_files": {"base": str(base_vocab), "v1": str(v1), "v2": str(v2)}}
    data["en_train"] = _encode(base_vocab, en_train, "en")
    en_eval_ids = _encode(base_vocab, en_eval, "en")
    if _encode(v2, en_eval, "en") != en_eval_ids:  # extend-tokenizer promises this
        raise SystemExit("the grown tokenizer encodes English differently from the base one")
    data["en_eval"] = [[ids, len(t)] for ids, t in zip(en_eval_ids, en_eval)]
    for name, vocab in (("v1", v1), ("v2", v2)):
        data[f"a_train_{name}"] = _encode(vocab, a_train, "am")
        data[f"a_eval_{name}"] = [[ids, len(t)] for ids, t in
                                  zip(_encode(vocab, a_eval, "am"), a_eval)]
    data["b_train_v2"] = _encode(v2, b_train, "am")
    data["b_eval_v2"] = [[ids, len(t)] for ids, t in zip(_encode(v2, b_eval, "am"), b_eval)]
    unk = 1
    data["corpus"] = {
        "english_train": len(en_train), "english_eval": len(en_eval),
        "amharic_test_lines": len(tests_am), "a_train": len(a_train), "a_eval": len(a_eval),
        "b_train": len(b_train), "b_eval": len(b_eval), "b_new_characters": "".join(new_chars),
        # A encodes the same before and after the second growth (its pieces hold only
        # characters A lacks): the loss on A is comparable across the resume
        "a_same_tokens_v1_v2": data["a_train_v1"] == data["a_train_v2"]
        and data["a_eval_v1"] == data["a_eval_v2"],
        "unk_tokens": sum(ids.count(unk) for key in ("a_train_v1", "b_train_v2") for ids in
                          data[key]) + sum(x[0].count(unk) for key in ("a_eval_v1", "b_eval_v2")
                                           for x in data[key]),
        "tokens_per_char_a": _tpc(data["a_eval_v1"]), "tokens_per_char_b": _tpc(data["b_eval_v2"])}
    return data


def _tpc(lines: list[list[Any]]) -> float:
    return sum(len(ids) for ids, _ in lines) / sum(n for _, n in lines)


def train_base(cfg: dict[str, Any], data: dict[str, Any], path: Path) -> dict[str, Any]:
    """English until the held-out loss improves by less than 1% over three evaluations."""
    import torch

    torch.manual_seed(0)
    rng = random.Random(0)
    model = build_model(data["rows"]["base"], cfg)
    opt = make_optimizer(model, BASE_LR)
    total = cfg["base_max_steps"]
    sched = make_scheduler(opt, total, total // 20)
    history, step = [], 0
    t0 = time.perf_counter()
    for step in range(1, total + 1):
        batch = rng.sample(data["en_train"], cfg["batch"])
        loss = lm_loss(model, batch, cfg["ctx"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        if step % cfg["base_eval_every"] == 0:
            history.append((step, nats_per_char(model, data["en_eval"], cfg["ctx"])))
            if len(history) >= 4 and history[-4][1] - history[-1][1] < 0.01 * history[-4][1]:
                break
    torch.save({"model": model.state_dict(), "step": step}, path)
    return {"steps": step, "plateaued": step < total, "history": history,
            "en_loss": history[-1][1], "seconds": time.perf_counter() - t0}


# -- a worker process: one arm, every seed ------------------------------------------------------


def _plain_resize(old: dict[str, Any], rows: int, gen, std: float = 1.0) -> dict[str, Any]:
    """What XTTS's GPTTrainer does to a smaller ``gpt_checkpoint``: ``torch.randn`` rows
    appended (times ``std``: 0.02 is GPT-2's and IndexTTS's init), the old last ([START])
    row copied to the new end (the copy at its old place stays: it becomes the first new
    token's row), zero biases."""
    import torch

    state = dict(old)
    n_old = old["text_embedding.weight"].shape[0]
    added = rows - n_old
    for key in ("text_embedding.weight", "text_head.weight"):
        w = old[key]
        grown = torch.cat([w, std * torch.randn(added, w.shape[1], generator=gen)], dim=0)
        grown[-1] = w[-1]
        state[key] = grown
    b = old["text_head.bias"]
    grown = torch.cat([b, torch.zeros(added)])
    grown[-1] = b[-1]
    state["text_head.bias"] = grown
    return state


# -- two experiments on the library's new rows (issue 25) -------------------------------------

TAG_SOURCES = ("start", "en")


def adjust_new_rows(model, base_state: dict[str, Any], base_vocab: Path, grown_vocab: Path,
                    scale: float | None = None, tag: str | None = None) -> None:
    """Experiments on the rows the library just made, applied after ``load_checkpoint``:

    - ``scale``: every new text-embedding row times ``scale`` (shrunk toward zero; the
      head is left as made);
    - ``tag``: the new language tag's rows (``[am]``: embedding, head, bias) copied from the
      base model's ``[START]`` (``"start"``, what GPTTrainer's resize gives the token that
      takes [START]'s old place) or its ``[en]`` (``"en"``).
    """
    import torch
    from tokenizers import Tokenizer

    from patches.vocab_rows import new_rows

    rows, base_rows = _rows(grown_vocab), _rows(base_vocab)
    params = dict(model.named_parameters())
    with torch.no_grad():
        if scale is not None:
            new = new_rows(rows, base_rows, start_row_last=True)
            params["text_embedding.weight"][new.start:new.stop] *= scale
        if tag is not None:
            if tag not in TAG_SOURCES:
                raise ValueError(f"tag {tag!r}: expected one of {TAG_SOURCES}")
            am = Tokenizer.from_file(str(grown_vocab)).token_to_id("[am]")
            src = (base_rows - 1 if tag == "start"
                   else Tokenizer.from_file(str(base_vocab)).token_to_id("[en]"))
            for key in ("text_embedding.weight", "text_head.weight", "text_head.bias"):
                params[key][am] = base_state[key][src]


def _base_row_index(rows: int, base_rows: int):
    """Rows of the base vocabulary in a grown tensor: 0..base-2 and the last ([START])."""
    import torch

    return torch.cat([torch.arange(base_rows - 1), torch.tensor([rows - 1])])


def _hook_freeze(model, base_rows: int) -> None:
    """The notes' "freeze": gradient hooks zeroing the base rows' gradient (given the right
    rows of this layout; the notes' literal ``grad[:12000] = 0`` would freeze the first
    new token's row and train [START])."""
    idx = _base_row_index(model.text_embedding.weight.shape[0], base_rows)

    def hook(grad):
        grad = grad.clone()
        grad[idx] = 0
        return grad

    for p in (model.text_embedding.weight, model.text_head.weight, model.text_head.bias):
        p.register_hook(hook)


def run_arm(arm: str, seed: int, cfg: dict[str, Any], data: dict[str, Any], workdir: Path,
            nan_at: int | None) -> dict[str, Any]:
    """One fine-tune of ``arm``: K steps, corpus A then A and B; the resume arms start with
    the tokenizer grown once and resume half-way with the one grown twice, the others use
    the one grown twice from the start. One NaN loss at ``nan_at`` when given."""
    import torch

    steps, half = cfg["steps"], cfg["steps"] // 2
    resume_at = half if arm in RESUME_ARMS else None
    warmup = max(1, steps // 10)
    base_path = workdir.parent / "base.pt"
    base = torch.load(base_path, weights_only=True)["model"]
    base_rows = data["rows"]["base"]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)  # the data order: the same in every arm
    schedule = [("a" if s < half else rng.choice("ab"), rng.randrange(1 << 30))
                for s in range(steps)]
    vocab = "v1" if resume_at is not None else "v2"
    library = arm in LIBRARY_ARMS

    def build(rows: int, path: Path | None, state: dict[str, Any] | None):
        model = build_model(rows, cfg)
        opt = make_optimizer(model, FT_LR)
        sched = make_scheduler(opt, steps, warmup)
        report = None
        if library:
            import patches

            report = patches.load_checkpoint(path, model, opt, sched, seed=seed,
                                             freeze=arm != "library_unfrozen",
                                             tokenizer=data["vocab_files"][vocab])
            if Path(path) == base_path and (cfg.get("new_row_scale") is not None
                                            or cfg.get("tag_row")):
                adjust_new_rows(model, torch.load(path, weights_only=True)["model"],
                                data["vocab_files"]["base"], data["vocab_files"][vocab],
                                cfg.get("new_row_scale"), cfg.get("tag_row"))
        else:
            model.load_state_dict(state)
            if arm not in ("upstream", "plain_std002"):
                _hook_freeze(model, base_rows)
        return model, opt, sched, report

    rows = data["rows"][vocab]
    if library:
        model, opt, sched, report = build(rows, base_path, None)
        load_note = report.summary()
    else:
        std = 0.02 if arm in STD002_ARMS else 1.0
        model, opt, sched, _ = build(rows, None, _plain_resize(base, rows, gen, std))
        load_note = f"GPTTrainer-style resize: randn rows x {std:g}"

    def evaluate(step: int) -> tuple[int, float, float, float, float]:
        """(step, A, B, English, A and B together); B is NaN while the tokenizer lacks it."""
        model.eval()
        try:
            a, a_chars = nats(model, data[f"a_eval_{vocab}"], cfg["ctx"])
            en, en_chars = nats(model, data["en_eval"], cfg["ctx"])
            if vocab == "v2":
                b, b_chars = nats(model, data["b_eval_v2"], cfg["ctx"])
                both = (a + b) / (a_chars + b_chars)
            else:
                b, b_chars, both = float("nan"), 1, float("nan")
            return (step, a / a_chars, b / b_chars, en / en_chars, both)
        finally:
            model.train()

    curve = [evaluate(0)]
    lrs, train_loss = [], []
    resume: dict[str, Any] = {}
    t0 = time.perf_counter()
    stopped_at = None
    for step in range(steps):
        if step == resume_at:
            resume["eval_before"] = (curve[-1] if curve[-1][0] == step else evaluate(step))[1]
            resume["lr_before"] = opt.param_groups[0]["lr"]
            vocab, rows = "v2", data["rows"]["v2"]
            if library:
                from patches import CheckpointManager

                mgr = CheckpointManager(workdir / f"ckpt_{arm}_{seed}_{nan_at}", keep=1)
                path = mgr.save(step, model, opt, sched)
                model, opt, sched, report = build(rows, path, None)
                resume["load"] = report.summary()
                resume["step_after_load"] = report.step
            else:
                path = workdir / f"ckpt_{arm}_{seed}.pt"
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step}, path)
                saved = torch.load(path, weights_only=True)
                # The notes' model.load_state_dict(checkpoint["model"], strict=False) raises
                # on the grown rows; what loads is the GPTTrainer resize (randn new rows).
                model, opt, sched, _ = build(rows, None, _plain_resize(saved["model"], rows, gen))
                if arm == "notes_stale":  # the bug: a fresh AdamW under the old schedule
                    sched.load_state_dict(saved["scheduler"])
                    for group, lr in zip(opt.param_groups, sched.get_last_lr()):
                        group["lr"] = lr
                resume["load"] = ("fresh AdamW, fresh warmup scheduler from step 0"
                                  if arm == "notes" else "fresh AdamW, old scheduler restored")
            curve.append(evaluate(step))
            resume["eval_after_load"] = curve[-1][1]
            resume["lr_after"] = opt.param_groups[0]["lr"]
        part, pick = schedule[step]
        pool = data[f"{part}_train_{vocab}"]
        prng = random.Random(pick)
        batch = [pool[prng.randrange(len(pool))] for _ in range(cfg["batch"])]
        loss = lm_loss(model, batch, cfg["ctx"])
        if step == nan_at:
            loss = loss * float("nan")  # one bad batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        train_loss.append(loss.item())
        done = step + 1
        if (done % cfg["eval_every"] == 0 or done == steps or (
                resume_at is not None and done - resume_at in (1, 5, 10))):
            curve.append(evaluate(done))
        if nan_at is not None and not library and step >= nan_at + 5:
            stopped_at = done  # nothing changes any more: every weight update is NaN
            if curve[-1][0] != done:
                curve.append(evaluate(done))
            break
    seconds = time.perf_counter() - t0
    state = model.state_dict()
    idx = _base_row_index(rows, base_rows)
    bidx = _base_row_index(base_rows, base_rows)
    drift = max((state[k][idx] - base[k][bidx]).abs().max().item()
                for k in ("text_embedding.weight", "text_head.weight", "text_head.bias"))
    nonfinite = sum(not torch.isfinite(v).all().item() for v in state.values()
                    if v.is_floating_point())
    out = {"arm": arm, "seed": seed, "nan_at": nan_at, "curve": curve, "lr": lrs,
           "train_loss": train_loss, "resume": resume, "base_row_drift": drift,
           "nonfinite_tensors": nonfinite, "tensors": len(state), "seconds": seconds,
           "load": load_note, "stopped_at": stopped_at, "final_rows": rows}
    if library:
        import patches

        out["guard"] = {k: patches.stats().get("nan_guard", {}).get(k)
                        for k in ("steps", "skipped")}
    return out


def run_worker(arm: str, arm_dir: str, env: dict[str, str]) -> None:
    """One arm, in a process forked by the forkserver: its environment, folder and log, then
    its runs (each seed, clean and, for the NaN arms, with the NaN), into ``result.json``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(arm_dir)
    log = os.open(os.path.join(arm_dir, "log.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if arm in LIBRARY_ARMS:
        import patches.auto  # noqa: F401 - what the library asks of a user: the first line

        import patches
        patches.advanced.reset_runtime_state()
    import torch

    torch.set_num_threads(1)
    workdir = Path(arm_dir)
    cfg = json.loads((workdir.parent / "config.json").read_text())
    data = torch.load(workdir.parent / "data.pt", weights_only=False)
    results = []
    for seed in range(cfg["seeds"]):
        for nan_at in (None, cfg["nan_at"]) if arm in NAN_ARMS else (None,):
            if arm in LIBRARY_ARMS:
                patches.advanced.reset_runtime_state()
            results.append(run_arm(arm, seed, cfg, data, workdir, nan_at))
    (workdir / "result.json").write_text(json.dumps(results))


# -- summary ---------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < len(values):
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"),
                "n": len(values), "nonfinite": len(values) - len(finite)}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite),
            "n": len(values)}


def _fmt(s: dict[str, float], digits: int = 3) -> str:
    if s.get("nonfinite"):
        return f"NaN ({s['nonfinite']}/{s['n']} seeds)"
    med = f"{s['median']:.{digits}f}"
    return med if s["n"] == 1 else f"{med} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _fmt_g(s: dict[str, float]) -> str:
    if s.get("nonfinite"):
        return "NaN"
    if s["n"] == 1:
        return f"{s['median']:.2g}"
    return f"{s['median']:.2g} [{s['min']:.2g}-{s['max']:.2g}]"


A, B, EN, AB = 1, 2, 3, 4  # columns of a curve point: (step, A, B, English, A+B)


def _at(run: dict[str, Any], step: int, col: int, which: int = -1) -> float:
    """The value at ``step``; a resume step is listed twice (before the save, after the
    load): ``which`` picks one, by default the last."""
    return [v[col] for v in run["curve"] if v[0] == step][which]


def summarize(cfg: dict[str, Any], base: dict[str, Any], runs: list[dict[str, Any]]
              ) -> dict[str, Any]:
    half = cfg["steps"] // 2
    later = min(half + 10, cfg["steps"])  # "10 steps after the resume"
    present = [arm for arm in ARMS if any(r["arm"] == arm for r in runs)]
    clean = {arm: [r for r in runs if r["arm"] == arm and r["nan_at"] is None] for arm in present}
    nan = {arm: [r for r in runs if r["arm"] == arm and r["nan_at"] is not None]
           for arm in present}
    finals_a = {arm: [r["curve"][-1][A] for r in rs] for arm, rs in clean.items()}
    best = min(statistics.median(v) for v in finals_a.values() if all(map(math.isfinite, v)))
    target = best * (1 + TARGET_MARGIN)
    arms: dict[str, Any] = {}
    for arm in present:
        reached = [next((v[0] for v in r["curve"] if v[0] > 0 and v[A] <= target), None)
                   for r in clean[arm]]
        entry = {
            "new_loss_final": _spread([r["curve"][-1][AB] for r in clean[arm]]),
            "a_loss_final": _spread(finals_a[arm]),
            "b_loss_final": _spread([r["curve"][-1][B] for r in clean[arm]]),
            "a_loss_start": _spread([r["curve"][0][A] for r in clean[arm]]),
            "a_loss_half": _spread([_at(r, half, A, 0) for r in clean[arm]]),
            "steps_to_target": {"per_seed": reached,
                                "median": (statistics.median(reached)
                                           if all(h is not None for h in reached) else None)},
            "en_loss_start": _spread([r["curve"][0][EN] for r in clean[arm]]),
            "en_loss_final": _spread([r["curve"][-1][EN] for r in clean[arm]]),
            "base_row_drift": _spread([r["base_row_drift"] for r in clean[arm]]),
            "seconds": sum(r["seconds"] for r in clean[arm] + nan[arm]),
            "load": clean[arm][0]["load"],
        }
        res = [r["resume"] for r in clean[arm] if r["resume"]]
        if res:
            entry["resume"] = {
                "eval_before": _spread([x["eval_before"] for x in res]),
                "eval_after_load": _spread([x["eval_after_load"] for x in res]),
                "jump": _spread([x["eval_after_load"] - x["eval_before"] for x in res]),
                "after_10_steps": _spread([_at(r, later, A) for r in clean[arm]]),
                "lr_before": res[0]["lr_before"], "lr_after": res[0]["lr_after"],
                "lr_10_after": clean[arm][0]["lr"][later - 1],
                "load": res[0]["load"],
            }
        nan_out = []
        for r, c in zip(nan[arm], clean[arm]):
            item = {"seed": r["seed"], "nonfinite_tensors": r["nonfinite_tensors"],
                    "tensors": r["tensors"], "stopped_at": r["stopped_at"],
                    "final_new_loss": r["curve"][-1][AB], "guard": r.get("guard")}
            if r["stopped_at"] is None:
                item["cost_vs_clean"] = r["curve"][-1][AB] - c["curve"][-1][AB]
            nan_out.append(item)
        entry["nan"] = nan_out
        arms[arm] = entry
    return {"target": target, "best_final_a": best, "arms": arms}


def _experiment_text(cfg: dict[str, Any]) -> str:
    """The experiments on the library arms' new rows, as the table's header says them."""
    said = []
    if cfg.get("new_row_scale") is not None:
        said.append(f"new embedding rows x {cfg['new_row_scale']:g}")
    if cfg.get("tag_row"):
        said.append(f"[am] starts as the base's [{cfg['tag_row'].replace('start', 'START')}]")
    return f" Experiment on the library arms: {'; '.join(said)}." if said else ""


def table(cfg: dict[str, Any], base: dict[str, Any], summary: dict[str, Any],
          data: dict[str, Any]) -> str:
    k, n, rows = cfg["steps"], cfg["seeds"], data["rows"]
    lines = [
        f"New language on a tiny GPT ({cfg['layers']} layers, d_model {cfg['d_model']}), "
        f"{k} fine-tune steps (batch {cfg['batch']}), {n} seed(s): median [min-max]. Vocabulary "
        f"{rows['base']} -> {rows['v2']} rows at once (upstream, library) or {rows['base']} -> "
        f"{rows['v1']} -> {rows['v2']} with a resume at step {k // 2} (the others). Losses: "
        f"nats per character of held-out text; A = first corpus, B = second corpus (trained "
        f"from step {k // 2}). English before fine-tuning {base['en_loss']:.3f} (base model "
        f"{base['steps']} steps, {'plateaued' if base['plateaued'] else 'step cap reached'}). "
        f"Target: A <= {summary['target']:.3f} (best arm's final median + {TARGET_MARGIN:.0%})."
        + _experiment_text(cfg),
        "",
        f"| arm | A+B at {k} | A at {k // 2} | A at {k} | B at {k} | steps to target | "
        f"English at 0 -> {k} | base-row drift | one NaN at step {cfg['nan_at']} |",
        "|---|---|---|---|---|---|---|---|---|"]
    for arm, e in summary["arms"].items():
        hits = e["steps_to_target"]["per_seed"]
        steps = ("not reached" if all(h is None for h in hits) else
                 "/".join("-" if h is None else str(h) for h in hits))
        items = e["nan"]
        if not items:
            nan_txt = "-"
        elif all(x["stopped_at"] for x in items):
            nan_txt = (f"run dead: {statistics.median(x['nonfinite_tensors'] for x in items):.0f}"
                       f"/{items[0]['tensors']} tensors NaN")
        else:
            costs = [x["cost_vs_clean"] for x in items]
            skipped = "/".join(str(x["guard"]["skipped"]) for x in items)
            nan_txt = f"{skipped} step skipped; A+B {_fmt(_spread(costs), 4)} vs clean"
        lines.append(
            f"| {ARM_TEXT[arm]} | {_fmt(e['new_loss_final'])} | {_fmt(e['a_loss_half'])} | "
            f"{_fmt(e['a_loss_final'])} | {_fmt(e['b_loss_final'])} | {steps} | "
            f"{_fmt(e['en_loss_start'], 2)} -> {_fmt(e['en_loss_final'])} | "
            f"{_fmt_g(e['base_row_drift'])} | {nan_txt} |")
    lines += ["", f"The resume at step {k // 2}, after the second growth ({rows['v1']} -> "
              f"{rows['v2']} rows); loss on A (same tokens before and after):", "",
              "| arm | A before the save | A right after the load | jump | A 10 steps later | "
              "LR before -> after -> 10 steps later |", "|---|---|---|---|---|---|"]
    for arm in (a for a in RESUME_ARMS if a in summary["arms"]):
        r = summary["arms"][arm]["resume"]
        lines.append(f"| {ARM_TEXT[arm]} | {_fmt(r['eval_before'])} | "
                     f"{_fmt(r['eval_after_load'])} | {_fmt(r['jump'])} | "
                     f"{_fmt(r['after_10_steps'])} | {r['lr_before']:.2e} -> "
                     f"{r['lr_after']:.2e} -> {r['lr_10_after']:.2e} |")
    return "\n".join(lines)


def plot(cfg: dict[str, Any], runs: list[dict[str, Any]], summary: dict[str, Any],
         base: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab20")
    colors = {arm: cmap(i) for i, arm in enumerate(ARMS)}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), dpi=72)
    for arm in summary["arms"]:
        rs = [r for r in runs if r["arm"] == arm and r["nan_at"] is None]
        steps = sorted({v[0] for r in rs for v in r["curve"]})
        for col, ax in ((A, axes[0]), (B, axes[1]), (EN, axes[2])):
            xs, med, lo, hi = [], [], [], []
            for s in steps:
                vals = [_at(r, s, col) for r in rs if any(v[0] == s for v in r["curve"])]
                if len(vals) == len(rs) and all(map(math.isfinite, vals)):
                    xs.append(s)
                    med.append(statistics.median(vals))
                    lo.append(min(vals))
                    hi.append(max(vals))
            ax.plot(xs, med, color=colors[arm], label=ARM_TEXT[arm], lw=1.4)
            ax.fill_between(xs, lo, hi, color=colors[arm], alpha=0.15)
        axes[3].plot(range(len(rs[0]["lr"])), rs[0]["lr"], color=colors[arm], lw=1.2)
    axes[0].axhline(summary["target"], color="grey", ls=":", lw=1)
    axes[0].set(title="new language, corpus A (nats/char)", xlabel="step", yscale="log")
    axes[1].set(title="corpus B (from the 2nd growth)", xlabel="step", yscale="log")
    axes[2].axhline(base["en_loss"], color="grey", ls=":", lw=1)
    axes[2].set(title="English: forgetting", xlabel="step")
    axes[3].set(title="learning rate (seed 0)", xlabel="step")
    for ax in axes:
        ax.axvline(cfg["steps"] // 2, color="grey", lw=0.6, ls="--")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render(path: Path) -> None:
    """table.md and new_language.png again from a results.json (no training)."""
    result = json.loads(path.read_text(encoding="utf-8"))
    cfg, base, runs = result["config"], result["base"], result["runs"]
    summary = summarize(cfg, base, runs)
    text = table(cfg, base, summary, {"rows": result["rows"]})
    (path.parent / "table.md").write_text(text + "\n", encoding="utf-8")
    plot(cfg, runs, summary, base, path.parent / "new_language.png")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 2-minute version")
    ap.add_argument("--out", help="output folder (default benchmarks/results/new_language[_quick])")
    ap.add_argument("--steps", type=int, help="fine-tune steps per arm (overrides the preset)")
    ap.add_argument("--base-steps", type=int, help="at most this many base-model steps")
    ap.add_argument("--seeds", type=int, help="seeds per arm (overrides the preset)")
    ap.add_argument("--jobs", type=int, default=2, help="arms run at once (default 2)")
    ap.add_argument("--keep-work", action="store_true",
                    help="keep OUT/work (tokenizers, base model, checkpoints, arm logs)")
    ap.add_argument("--render", metavar="RESULTS_JSON",
                    help="only remake table.md and the plot beside a results.json")
    ap.add_argument("--arms", help="only these arms (comma-separated names: " + ", ".join(ARMS)
                    + ")")
    ap.add_argument("--new-row-scale", type=float, help="experiment: the library arms' new "
                    "text-embedding rows times this after the load (toward zero)")
    ap.add_argument("--tag-row", choices=TAG_SOURCES, help="experiment: the library arms' new "
                    "language tag [am] starts as the base model's [START] or [en] rows")
    args = ap.parse_args()
    if args.render:
        return render(Path(args.render))

    import torch

    torch.set_num_threads(1)
    preset = "quick" if args.quick else "full"
    cfg = dict(PRESETS[preset])
    for key, value in (("steps", args.steps), ("base_max_steps", args.base_steps),
                       ("seeds", args.seeds)):
        if value is not None:
            cfg[key] = value
    cfg["eval_every"] = min(cfg["eval_every"], max(1, cfg["steps"] // 4))
    cfg["base_eval_every"] = min(cfg["base_eval_every"], max(1, cfg["base_max_steps"] // 4))
    cfg["nan_at"] = max(1, cfg["steps"] // 4)
    cfg["new_row_scale"], cfg["tag_row"] = args.new_row_scale, args.tag_row
    arms = ARMS
    if args.arms:
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        unknown = sorted(set(arms) - set(ARMS))
        if unknown:
            ap.error(f"--arms: unknown arm(s) {', '.join(unknown)}; expected names from "
                     f"{', '.join(ARMS)}")
    out = Path(args.out).resolve() if args.out else ROOT / "benchmarks" / "results" / (
        "new_language" + ("_quick" if args.quick else ""))
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log: list[str] = []
    data = prepare(cfg, work, log)
    print(f"tokenizers: {data['rows']['base']} -> {data['rows']['v1']} -> "
          f"{data['rows']['v2']} rows; corpus {data['corpus']}", flush=True)
    base = train_base(cfg, data, work / "base.pt")
    print(f"base model: {base['steps']} steps, English {base['en_loss']:.3f} nats/char, "
          f"{base['seconds']:.0f} s", flush=True)
    (work / "config.json").write_text(json.dumps(cfg))
    torch.save(data, work / "data.pt")

    def one(arm: str) -> list[dict[str, Any]]:
        arm_dir = work / arm
        arm_dir.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        if arm in LIBRARY_ARMS:
            env.update(TRAINING_PATCHES_QUIET="1", TRAINING_PATCHES_OUTPUT_DIR=str(arm_dir))
            if arm != "library_unfrozen":
                env["TRAINING_PATCHES_BASE_VOCAB"] = str(data["rows"]["base"])
            if arm in RULE_ARMS:
                env["TRAINING_PATCHES_ROW_INIT"], env["TRAINING_PATCHES_HEAD_ROW_INIT"] = \
                    RULE_ARMS[arm]
        started = time.perf_counter()
        process = arms_context.Process(target=run_worker, args=(arm, str(arm_dir), env))
        process.start()
        process.join()
        rc = process.exitcode
        if rc != 0:
            raise SystemExit(f"arm {arm} failed (exit {rc}); see {arm_dir / 'log.txt'}")
        print(f"arm {arm}: {time.perf_counter() - started:.0f} s", flush=True)
        return json.loads((arm_dir / "result.json").read_text())

    arms_context = multiprocessing.get_context("forkserver")
    # torch._dynamo: the first optimizer step imports it (0.9 s an arm otherwise)
    arms_context.set_forkserver_preload(["torch", "torch._dynamo"])
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = [r for rs in pool.map(one, arms) for r in rs]
    summary = summarize(cfg, base, runs)
    text = table(cfg, base, summary, data)
    print("\n" + text)
    (out / "table.md").write_text(text + "\n", encoding="utf-8")
    result = {"preset": preset, "config": cfg, "base": base, "summary": summary,
              "corpus": data["corpus"], "rows": data["rows"], "tokenizer_log": log,
              "runs": runs, "seconds": time.perf_counter() - t0,
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpus": os.cpu_count(), "platform": platform.platform()}}
    (out / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    plot(cfg, runs, summary, base, out / "new_language.png")
    if not args.keep_work:
        shutil.rmtree(work)
    print(f"\nwrote {out / 'table.md'}, {out / 'results.json'}, {out / 'new_language.png'} "
          f"({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
