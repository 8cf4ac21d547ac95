"""Shared fixtures: the tiny XTTS setup (real coqui-tts, local files only).

Building it takes about 2 s (BPE vocab, DVAE state dict, 13 synthetic wavs), so it
is session-scoped; tests must treat its files as read-only and train into their
own ``tmp_path`` (``tiny.make_config(tmp_path / "run")``).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _small_xtts() -> None:
    """XTTS's never-trained modules at small widths in this process, as in every process
    a test starts (``processes.child_path``; tests/small_xtts/sitecustomize.py says why)."""
    import importlib.util

    from processes import SMALL_XTTS

    spec = importlib.util.spec_from_file_location("small_xtts", SMALL_XTTS / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_small_xtts()

# Seven Amharic characters plus the [am] language token: 74 base tokens -> 82.
AMHARIC_NEW_TOKENS: tuple[str, ...] = ("ሰ", "ላ", "ም", "ዓ", "ለ", "እ", "ን")


@pytest.fixture(scope="session")
def tiny_xtts(tmp_path_factory: pytest.TempPathFactory):
    """A :class:`demo.xtts_tiny.TinyXtts` (English, 74 tokens, 13 clips)."""
    pytest.importorskip("TTS")
    from demo.xtts_tiny import build_tiny_xtts

    return build_tiny_xtts(tmp_path_factory.mktemp("tiny_xtts"), seed=0)


@pytest.fixture(scope="session")
def tiny_xtts_extended_vocab(tiny_xtts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An extended vocab.json for :func:`tiny_xtts`: 74 base tokens + 8 new = 82 ids.

    Base ids 0..72 unchanged, new tokens at 73..80, [START] moved from 73 to 81
    (the layout XTTS's GPTTrainer resize assumes).
    """
    out = tmp_path_factory.mktemp("tiny_xtts_ext") / "vocab_extended.json"
    return tiny_xtts.extend_vocab(AMHARIC_NEW_TOKENS, out, language="am", tokens=True)


@pytest.fixture(scope="session")
def tiny_xtts_mixed_manifest(tiny_xtts, tiny_xtts_extended_vocab) -> Path:
    """A manifest whose English transcripts also use the new tokens (ids 74..80), so that
    the new embedding rows get gradients; language stays "en" (coqui knows it)."""
    words = ("ሰላም", "እን", "ለም", "ዓለም")
    texts = [f"{text} {words[i % len(words)]}" for i, text in enumerate(tiny_xtts.texts)]
    return tiny_xtts.write_manifest(texts, "metadata_mixed.csv")


def write_amharic_base(root: Path):
    """A tiny Amharic XTTS setup for headlessXttsTrain.py: ``root/data`` (6 Amharic clips,
    metadata.csv, a vocab.json with [am]) and ``root/base`` (model.pth and config.json of a
    fresh tiny GPTTrainer, dvae.pth, mel_stats.pth, vocab.json). Returns (tiny, base)."""
    import shutil

    import torch

    import patches
    from demo.xtts_tiny import build_tiny_xtts
    from patches.languages.amharic import normalize
    from test_xtts_language import AMHARIC_TEXTS

    tiny = build_tiny_xtts(root / "data", language="am", texts=AMHARIC_TEXTS, n_samples=6,
                           vocab_size=200,
                           vocab_extra_texts=[normalize(t) for t in AMHARIC_TEXTS])
    base = root / "base"
    base.mkdir()
    was = patches.advanced.is_applied("xtts_language")
    patches.advanced.apply(["xtts_language"])  # coqui's tokenizer must know "am" to build the model
    try:
        config = tiny.make_config(root / "scratch")
        model = tiny.make_model(config)
        torch.save({"model": model.xtts.state_dict()}, base / "model.pth")
        config.save_json(str(base / "config.json"))
    finally:
        if not was:
            patches.revert(["xtts_language"])
    for name in ("vocab.json", "dvae.pth", "mel_stats.pth"):
        shutil.copy(tiny.root / name, base / name)
    return tiny, base


DISTRIBUTED = Path(__file__).resolve().parent / "distributed"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto``) each worker starts with SIGINT
    ignored, so that Ctrl-C reaches only the controller. A child process inherits an ignored
    signal, and the patches rightly leave an ignored signal alone (that is ``nohup``): the
    tests that stop a child with SIGINT (the demo's ``--interrupt-after-step``) need it back
    at its default in the worker."""
    import os
    import signal

    if os.environ.get("PYTEST_XDIST_WORKER") and \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # make test: the fork server imports meanwhile
        import forkserver

        forkserver.server_for(dict(os.environ), start=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The many-process tier: every test in tests/distributed is marked ``distributed``
    (``-m distributed`` runs only them) and skips where torch has no gloo. (No conftest of
    its own there: a second ``conftest`` module would shadow this one's helpers.) The
    files with slow, coqui or many-process tests run first."""
    import torch

    gloo = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    for item in items:
        if DISTRIBUTED in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.distributed)
            if not gloo:
                item.add_marker(pytest.mark.skip(reason="torch.distributed with gloo is not available"))
    # The files that start processes first, each file's tests kept together (a module's
    # fixtures are built once): on ``make test``'s workers the run then ends on tests of a
    # few milliseconds, not on a minute-long one while the other worker waits.
    heavy = {item.path for item in items
             if any(item.get_closest_marker(m) for m in ("slow", "xtts", "distributed"))}
    items.sort(key=lambda item: item.path not in heavy)


# -- the markers are right: ``--check-markers`` (used by ``make test-fast``) -------------
#
# The fast tier is ``-m "not slow and not xtts and not distributed"``: it must pass without
# coqui. With --check-markers, a test not marked ``xtts`` runs with coqui hidden (``import
# TTS...``/``import trainer...`` raise ModuleNotFoundError): one that needs it fails, or is
# skipped by importorskip and that skip is turned into a failure; a code path that falls back
# without coqui passes. A test file that imports coqui when it is collected, or a test that
# takes a tiny_xtts fixture, fails too. Time is reported, never failed (issue 41): a test not
# marked ``slow`` whose call took more than SLOW_S seconds is listed at the end of the run
# with its wall-clock and CPU time (this process plus the subprocesses it waited for), to be
# marked ``slow`` or made faster. A slower or busier machine than the one a test was written
# on stretches both clocks, so no number of seconds can fail a test without failing it there.

COQUI = ("TTS", "trainer")
SLOW_S = 2.0
HIDDEN = "--check-markers hides coqui from tests not marked xtts"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--check-markers", action="store_true", default=False,
        help=f"run tests not marked xtts with coqui (TTS, trainer) hidden and fail those that "
             f"need it; list (never fail) tests not marked slow whose call takes over "
             f"{SLOW_S:g} s")


def _is_coqui(name: str) -> bool:
    return name.partition(".")[0] in COQUI


class _CoquiImports:
    """While entered, every ``import TTS...``/``import trainer...`` statement is recorded in
    ``tried`` and, with ``hide``, raises ModuleNotFoundError (``builtins.__import__`` sees an
    import even when the module is already loaded, so what a file collected earlier imported
    does not leak through). ``appeared``: coqui modules new in ``sys.modules`` on exit (an
    ``importlib.import_module``, which goes around ``__import__``)."""

    def __init__(self, hide: bool = False) -> None:
        self.hide = hide
        self.tried: set[str] = set()
        self.appeared: set[str] = set()

    def __enter__(self) -> "_CoquiImports":
        import builtins
        import sys

        self._before = {name for name in sys.modules if _is_coqui(name)}
        self._original = original = builtins.__import__

        def watching(name, globals=None, locals=None, fromlist=(), level=0):
            if level == 0 and _is_coqui(name):
                self.tried.add(name)
                if self.hide:
                    raise ModuleNotFoundError(f"No module named {name!r} ({HIDDEN}: mark the "
                                              f"test @pytest.mark.xtts if it needs coqui)",
                                              name=name)
            return original(name, globals, locals, fromlist, level)

        builtins.__import__ = watching
        return self

    def __exit__(self, *exc: object) -> None:
        import builtins
        import sys

        builtins.__import__ = self._original
        self.appeared = {name for name in sys.modules if _is_coqui(name)} - self._before


_MODULE_COQUI_KEY = pytest.StashKey[set]()
_ITEM_COQUI_KEY = pytest.StashKey[set]()
_ITEM_TIME_KEY = pytest.StashKey[tuple]()
_WAITS_KEY = pytest.StashKey[list]()


def _checking(config: pytest.Config) -> bool:
    return bool(config.getoption("--check-markers", default=False))


def _hidden(item: pytest.Item) -> bool:
    """Whether ``item`` runs with coqui hidden: --check-markers and no xtts marker."""
    return _checking(item.config) and item.get_closest_marker("xtts") is None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """Under --check-markers: which test files import coqui when they are imported (not
    hidden here: a file marked xtts may, and its tests are deselected after collection)."""
    if not (_checking(collector.config) and isinstance(collector, pytest.Module)):
        return (yield)
    with _CoquiImports() as watch:
        report = yield
    collector.stash[_MODULE_COQUI_KEY] = watch.tried | watch.appeared
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if not _hidden(item):
        return (yield)
    with _CoquiImports(hide=True) as watch:
        try:
            return (yield)
        finally:
            item.stash[_ITEM_COQUI_KEY] = watch.appeared


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if not _checking(item.config):
        return (yield)
    import os
    import time

    def cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    wall0, cpu0 = time.perf_counter(), cpu()
    with _CoquiImports(hide=_hidden(item)) as watch:
        try:
            return (yield)
        finally:
            item.stash[_ITEM_COQUI_KEY] = item.stash.get(_ITEM_COQUI_KEY, set()) | watch.appeared
            item.stash[_ITEM_TIME_KEY] = (time.perf_counter() - wall0, cpu() - cpu0)


def _marker_faults(item: pytest.Item) -> list[str]:
    """What --check-markers finds wrong with a passed ``item``'s markers (empty: nothing)."""
    faults = []
    if item.get_closest_marker("xtts") is None:
        module = item.getparent(pytest.Module)
        coqui = sorted(item.stash.get(_ITEM_COQUI_KEY, set())
                       | (module.stash.get(_MODULE_COQUI_KEY, set()) if module else set()))
        fixtures = sorted(name for name in getattr(item, "fixturenames", ())
                          if name.startswith("tiny_xtts"))
        if coqui or fixtures:
            found = ", ".join([f"imports {name}" for name in coqui[:3]]
                              + [f"uses fixture {name}" for name in fixtures])
            faults.append(f"it needs coqui ({found}) but is not marked xtts: add "
                          f"@pytest.mark.xtts (or pytestmark = pytest.mark.xtts in its file)")
    return faults


def _slow_note(item: pytest.Item) -> str | None:
    """The line the end of the run lists for ``item`` when it is not marked ``slow`` and its
    call took over :data:`SLOW_S` s by either clock (None: nothing to say). A report, never
    a failure: the seconds depend on the machine and on what else it runs."""
    if item.get_closest_marker("slow") is not None or _ITEM_TIME_KEY not in item.stash:
        return None
    wall, cpu = item.stash[_ITEM_TIME_KEY]
    if max(wall, cpu) <= SLOW_S:
        return None
    why = ("mark it slow or make it faster" if min(wall, cpu) > SLOW_S
           else "by one clock only: waiting, or a machine busy with other work")
    return f"{item.nodeid}: {wall:.1f} s wall clock, {cpu:.1f} s CPU ({why})"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if not _checking(item.config):
        return report
    if report.skipped and HIDDEN in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = (f"--check-markers: {item.nodeid} skips without coqui (an "
                           f"importorskip) but is not marked xtts: add @pytest.mark.xtts")
    elif report.when == "call" and report.passed:
        note = _slow_note(item)
        if note is not None:
            item.config.stash.setdefault(_WAITS_KEY, []).append(note)
        faults = _marker_faults(item)
        if faults:
            report.outcome = "failed"
            report.longrepr = (f"--check-markers: {item.nodeid} passed, but "
                               + "; and ".join(faults))
    return report


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Under --check-markers: unmarked tests whose call took over SLOW_S s are listed (a
    report: never failed)."""
    waits = config.stash.get(_WAITS_KEY, []) if _checking(config) else []
    if waits:
        terminalreporter.write_sep("-", f"--check-markers: not marked slow, over {SLOW_S:g} s "
                                        f"(reported, not failed)")
        for line in waits:
            terminalreporter.write_line(line)


@pytest.fixture
def trainer_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """For a trainer's own run (the HF Trainer's, F5-TTS's): no output folder and no
    BASE_VOCAB set, the working directory in tmp_path (./training_patches would land
    there), and no trainer folder read from a coqui Trainer an earlier test built (its log
    handler outlives it, and the coqui integration's folder provider would read it)."""
    from patches import _run

    monkeypatch.delenv("TRAINING_PATCHES_OUTPUT_DIR", raising=False)
    monkeypatch.delenv("TRAINING_PATCHES_BASE_VOCAB", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_run, "_dir_providers", [])
