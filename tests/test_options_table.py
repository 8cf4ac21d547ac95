"""Options come from the units' declarations: Options, owners, env variables, did-you-mean,
banner, doctor, `training-patches options` and the README table all follow them."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import pytest

import patches
from patches import _options, _registry
from patches.advanced import ConfigError
from patches.tools import doctor
from patches.tools.options import markdown_table, readme_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "TRAINING_PATCHES_README.md"


def test_the_readme_table_is_the_one_the_declarations_make() -> None:
    found = readme_table(README.read_text(encoding="utf-8"))
    assert found is not None, f"{README.name} has lost the markers of its options table"
    assert found == markdown_table(), (
        f"{README.name}'s options table differs from the declarations: replace the lines "
        f"between its markers with the output of `training-patches options --markdown`")


def test_every_option_belongs_to_a_known_unit_with_help() -> None:
    units = set(_registry.specs()) | set(_registry.integrations())
    for name, option in _options.OPTIONS.items():
        assert set(option.owners) <= units, name
        assert option.help and option.expected, name
        assert option.env == "TRAINING_PATCHES_" + name.upper()
        assert option.parse(option.default) == option.default or option.default in ((), None)


@pytest.fixture
def unit_with_an_option(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A patch declared here, as a new patch module would declare itself: one option with a
    cross-option check. The registry and the declarations are restored afterwards."""
    # restored in place: modules that imported these tables by name see the same objects
    saved = [(table, dict(table)) for table in (_registry._specs, _options.OPTIONS,
                                                  _options._checks)]

    def check(opts: _options.Options, where: object) -> None:
        if opts.probe_limit > 1000 and opts.init_scale < 8:
            raise ConfigError(f"training-patches: {where('probe_limit')} too high")  # type: ignore[operator]

    counts = {"probes": 0}
    _registry.register(_registry.PatchSpec(
        name="probe", describe=lambda o: f"probe limit {o.probe_limit}",
        stats=lambda: dict(counts), load_stats=counts.update,
        reset=lambda: counts.update(probes=0),
        options=(_options.Option("probe_limit", _options.positive_int, 7,
                                 "a whole number, e.g. 7", "how far the probe looks",
                                 low=1, high=10_000, bound_why="the probe holds a buffer "
                                 "of that many steps"),),
        check=check))
    yield "probe"
    patches.revert("probe")
    for table, before in saved:
        table.clear()
        table.update(before)


def test_a_declared_option_reaches_every_reader(unit_with_an_option: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    # Options: the default, and only declared names
    assert _options.Options().probe_limit == 7
    with pytest.raises(TypeError):
        _options.Options(probe_limt=3)
    # its variable, parsed by its own parser, and its bad value explained
    assert _options.resolve({}, {"TRAINING_PATCHES_PROBE_LIMIT": "12"}).probe_limit == 12
    with pytest.raises(ConfigError, match="TRAINING_PATCHES_PROBE_LIMIT.*Expected a whole number"):
        _options.resolve({}, {"TRAINING_PATCHES_PROBE_LIMIT": "x"})
    # its range, with why, at resolve time (a value that parses, out of range)
    with pytest.raises(ConfigError, match=r"TRAINING_PATCHES_PROBE_LIMIT is '20000', which is "
                       r"out of range \(above 10,000\)\. Expected a whole number, e\.g\. 7: "
                       r"1 to 10,000 \(the probe holds a buffer of that many steps\)"):
        _options.resolve({}, {"TRAINING_PATCHES_PROBE_LIMIT": "20000"})
    # its cross-option check runs at resolve time
    with pytest.raises(ConfigError, match="probe_limit"):
        _options.resolve({"probe_limit": 5000, "init_scale": 4}, {})
    # the did-you-mean knows it
    with pytest.raises(ConfigError, match="did you mean TRAINING_PATCHES_PROBE_LIMIT"):
        _options.resolve({}, {"TRAINING_PATCHES_PROBE_LIMT": "3"})
    with pytest.raises(ConfigError, match=r"probe_limt \(did you mean probe_limit\?\)"):
        patches.advanced.apply(probe_limt=3)
    # it belongs to its unit: applying another patch never touches it
    assert _options.fields_of("probe") == ["probe_limit"]
    # the table and the banner
    assert ("| `probe_limit` | `TRAINING_PATCHES_PROBE_LIMIT` | 7 | 1 to 10,000 | probe | how "
            "far the probe") in markdown_table()
    caplog.set_level(logging.INFO, logger="training_patches")
    monkeypatch.setenv("TRAINING_PATCHES_PROBE_LIMIT", "9")
    patches.advanced.apply(["probe"])
    assert "probe limit 9" in caplog.text and "probe_limit=9" in caplog.text
    # doctor names the unit of a variable that is set, and refuses it out of range
    status, _, detail = doctor.settings_check()
    assert status == doctor.OK and "TRAINING_PATCHES_PROBE_LIMIT=9 (probe)" in detail
    monkeypatch.setenv("TRAINING_PATCHES_PROBE_LIMIT", "10001")
    status, _, detail = doctor.settings_check()
    assert status == doctor.FAIL and "out of range (above 10,000)" in detail


def test_a_declared_counter_reaches_stats_and_checkpoints(unit_with_an_option: str) -> None:
    from patches import _api

    assert patches.stats()["probe"] == {"probes": 0}
    _api.load_runtime_state({"probe": {"probes": 4}})
    assert patches.stats()["probe"] == {"probes": 4}
    assert _api.runtime_state()["probe"] == {"probes": 4}
    patches.advanced.reset_runtime_state()
    assert patches.stats()["probe"] == {"probes": 0}


def test_reapplying_one_patch_changes_only_its_own_options(unit_with_an_option: str) -> None:
    patches.advanced.apply(["probe", "grad_scaler"], probe_limit=3, init_scale=64)
    patches.advanced.apply(["grad_scaler"], probe_limit=99, init_scale=32)
    assert _options.current().init_scale == 32
    assert _options.current().probe_limit == 3  # not grad_scaler's option
    patches.advanced.apply(["probe"], probe_limit=11)
    assert _options.current().probe_limit == 11 and _options.current().init_scale == 32


def test_an_option_declared_by_two_units_is_refused(unit_with_an_option: str) -> None:
    with pytest.raises(ValueError, match="declared twice"):
        _options.declare("other", (_options.Option("probe_limit", int, 1, "x", "y"),))


def test_options_are_immutable_and_compare_by_value() -> None:
    opts = _options.Options(init_scale=64.0)
    with pytest.raises(AttributeError):
        opts.init_scale = 3  # type: ignore[misc]
    assert opts.replace(init_scale=1024.0) == _options.Options()
    assert hash(opts.replace(init_scale=1024.0)) == hash(_options.Options())
    assert "init_scale=64.0" in repr(opts)


def test_the_options_command_marks_what_is_set(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from patches.tools.cli import main

    monkeypatch.setenv("TRAINING_PATCHES_BASE_VOCAB", "12000")
    assert main(["options"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("TRAINING_PATCHES_BASE_VOCAB"))
    assert "vocab_freeze" in line and "[set here: '12000']" in line
    assert len([ln for ln in out.splitlines() if ln.startswith("TRAINING_PATCHES_")]) == \
        len(_options.OPTIONS)
    assert main(["options", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == markdown_table()
    assert os.environ["TRAINING_PATCHES_BASE_VOCAB"] == "12000"


def test_every_variable_the_docs_name_is_declared() -> None:
    """A renamed or removed option leaves no stale TRAINING_PATCHES_* name in the docs."""
    import re

    known = _options.known_env() | {"TRAINING_PATCHES_BASEVOCAB"}  # the misspelling shown
    # for the did-you-mean
    docs = [ROOT / "README.md", README, *sorted((ROOT / "docs").rglob("*.md"))]
    stale = sorted({f"{doc.relative_to(ROOT)}: {name}" for doc in docs
                    for name in re.findall(r"TRAINING_PATCHES_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])(?!\.md)",
                                           doc.read_text(encoding="utf-8"))
                    if name not in known})
    assert not stale, stale


def test_the_readme_banner_shows_what_the_patches_describe() -> None:
    """The example banner's patch lines are the declarations' own, with default options."""
    opts = _options.Options()
    text = README.read_text(encoding="utf-8")
    shown = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=3)
        if line.startswith("  [on ] ") and len(parts) == 4 and parts[2] in _registry.specs():
            shown[parts[2]] = parts[3]
    assert set(shown) == {name for name, spec in _registry.specs().items() if spec.default}
    for name, described in shown.items():
        assert described == _registry.specs()[name].describe(opts), name
