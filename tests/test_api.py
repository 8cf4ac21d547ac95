"""The public API: apply/revert/applied/is_applied/get_original/stats, options, banner."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import patches
from patches import _options, _registry, _upstream
from patches.advanced import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {name for name, spec in _registry.specs().items() if spec.default}


def test_apply_reports_sites_and_revert_restores_identity() -> None:
    before = torch.nn.utils.clip_grad_norm_
    result = patches.advanced.apply(["grad_clip", "grad_scaler"])
    assert "torch.nn.utils.clip_grad_norm_" in result["grad_clip"]
    assert "torch.GradScaler" in result["grad_scaler"]
    assert patches.advanced.is_applied("grad_clip") and not patches.advanced.is_applied("autocast")
    assert torch.nn.utils.clip_grad_norm_ is not before
    assert patches.advanced.get_original("torch.nn.utils", "clip_grad_norm_") is before
    assert patches.advanced.get_original(torch.nn.utils, "clip_grad_norm_") is before
    assert patches.revert() == ["grad_scaler", "grad_clip"]  # registry order
    assert torch.nn.utils.clip_grad_norm_ is before
    assert patches.advanced.applied() == {}


def test_default_set_and_disable(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="training_patches")
    applied = patches.advanced.apply(disable="grad_clip")
    assert set(applied) == DEFAULTS - {"grad_clip"}
    assert "[off] grad_clip" in caplog.text and "TRAINING_PATCHES_DISABLE" in caplog.text
    assert "[on ] grad_scaler" in caplog.text


def test_options_keyword_beats_environment() -> None:
    env = {"TRAINING_PATCHES_INIT_SCALE": "512", "TRAINING_PATCHES_LOG_INTERVAL": "7"}
    opts = _options.resolve({"init_scale": 64}, env)
    assert opts.init_scale == 64 and opts.log_interval == 7 and opts.growth_interval == 100


@pytest.mark.parametrize("var,value", [
    ("TRAINING_PATCHES_INIT_SCALE", "abc"),
    ("TRAINING_PATCHES_INIT_SCALE", "-4"),
    ("TRAINING_PATCHES_GROWTH_INTERVAL", "0"),
    ("TRAINING_PATCHES_LOG_INTERVAL", "1.5"),
    ("TRAINING_PATCHES_ANOMALY", "maybe"),
])
def test_bad_environment_value_is_a_clear_error(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _options.resolve({}, {var: value})
    message = str(raised.value)
    assert var in message and repr(value) in message and "Expected" in message


def test_unknown_names_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        patches.advanced.apply(init_scael=3)
    with pytest.raises(ConfigError, match="Known patches"):
        patches.advanced.apply(["autocats"])
    monkeypatch.setenv("TRAINING_PATCHES_DISABLE", "grad_clip,nope")
    with pytest.raises(ConfigError, match="nope"):
        patches.advanced.apply()
    assert patches.advanced.applied() == {}


def test_anomaly_switch_and_context_manager() -> None:
    assert not torch.is_anomaly_enabled()
    with patches.advanced.enable_anomaly_detection():
        assert torch.is_anomaly_enabled()
    assert not torch.is_anomaly_enabled()
    patches.advanced.apply(anomaly=True)
    assert patches.advanced.is_applied("anomaly") and torch.is_anomaly_enabled()
    patches.revert("anomaly")
    assert not torch.is_anomaly_enabled()


def test_stats_are_plain_numbers() -> None:
    patches.advanced.apply()
    scaler = torch.amp.GradScaler("cpu")
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale((p * 2).sum()).backward()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    scaler.step(opt)
    scaler.update()
    stats = patches.stats()
    assert stats["grad_scaler"]["steps"] == 1 and stats["grad_scaler"]["scale"] == 1024.0
    assert stats["grad_clip"]["calls"] >= 1
    for group in stats.values():
        assert all(isinstance(v, (int, float)) for v in group.values())


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINING_PATCHES_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env=full_env, timeout=300)


@pytest.mark.slow
def test_activation_line_applies_once_with_banner() -> None:
    result = _run(
        "from utils import training_patches\n"
        "from utils import training_patches as again\n"
        "import importlib, patches\n"
        "importlib.import_module('patches.auto')\n"
        "print(','.join(sorted(patches.advanced.applied())))\n")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.strip().split(",")) == DEFAULTS
    assert {"autocast", "grad_scaler", "grad_clip", "nan_guard"} <= DEFAULTS
    assert result.stderr.count("applying training patches") == 1
    assert "[off] anomaly" in result.stderr


@pytest.mark.slow
def test_activation_quiet_and_env_disable() -> None:
    result = _run("from utils import training_patches\nimport patches\n"
                  "print(','.join(sorted(patches.advanced.applied())))\n",
                  TRAINING_PATCHES_QUIET="1", TRAINING_PATCHES_DISABLE="autocast")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.strip().split(",")) == DEFAULTS - {"autocast"}
    assert "applying training patches" not in result.stderr


@pytest.mark.slow
def test_activation_with_a_bad_variable_fails_clearly() -> None:
    result = _run("from utils import training_patches", TRAINING_PATCHES_INIT_SCALE="big")
    assert result.returncode != 0
    assert "TRAINING_PATCHES_INIT_SCALE" in result.stderr and "'big'" in result.stderr


def _vendored_tts(root: "os.PathLike[str]", init: str, version_file: str | None = None) -> str:
    """A trainer's own copy of ``TTS/`` (as recipe forks ship coqui TTS 0.22), on a folder
    that goes first on sys.path; returns that folder."""
    package = os.path.join(os.fspath(root), "TTS")
    os.makedirs(package)
    with open(os.path.join(package, "__init__.py"), "w", encoding="utf-8") as handle:
        handle.write(init)
    if version_file is not None:
        with open(os.path.join(package, "VERSION"), "w", encoding="utf-8") as handle:
            handle.write(version_file + "\n")
    return os.fspath(root)


# coqui TTS 0.22's own TTS/__init__.py: the version is read from the VERSION file
TTS_022_INIT = ("import os\n"
                "with open(os.path.join(os.path.dirname(__file__), 'VERSION'), 'r', "
                "encoding='utf-8') as f:\n"
                "    version = f.read().strip()\n"
                "__version__ = version\n")


@pytest.mark.slow
@pytest.mark.skipif(_upstream.distribution_version("coqui-tts") is None,
                    reason="the point is a vendored TTS beside an installed coqui-tts")
@pytest.mark.parametrize("order", ["vendored-tts-imported-first", "patches-first"])
def test_banner_reads_the_version_of_the_tts_actually_imported(tmp_path, order: str) -> None:
    vendor = _vendored_tts(tmp_path, TTS_022_INIT, "0.22.0")
    installed = _upstream.distribution_version("coqui-tts")
    lines = [f"import sys; sys.path.insert(0, {vendor!r})"]
    lines += (["import TTS", "import patches.auto"] if order.startswith("vendored")
              else ["import patches.auto", "import TTS"])
    lines.append("print(TTS.__file__)")
    result = _run("\n".join(lines))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == os.path.join(vendor, "TTS", "__init__.py")
    banner = result.stderr
    source = ("TTS.__version__" if order.startswith("vendored")
              else f"TTS at {os.path.join(vendor, 'TTS')}, not imported yet")
    # the name column is as wide as the longest unit name
    want = re.escape(f"coqui-tts 0.22.0 [{source}] (>=0.24,<0.29)")
    assert re.search(r"\[int\] xtts_gpt +" + want, banner), banner
    assert f"coqui-tts {installed}" not in banner
    assert ("WARNING checkpoint, vocab_freeze: coqui-tts 0.22.0 is what this process runs"
            in banner)
    assert "integration xtts_gpt supports coqui-tts >=0.24,<0.29" in banner
    # strict mode refuses to run an unverified upstream
    strict = _run("\n".join(lines), TRAINING_PATCHES_STRICT="1")
    assert strict.returncode != 0 and "PatchSiteError" in strict.stderr
    assert "coqui-tts 0.22.0" in strict.stderr


@pytest.mark.skipif(_upstream.distribution_version("coqui-tts") is None,
                    reason="the point is a vendored TTS beside an installed coqui-tts")
def test_a_version_unreadable_before_import_is_checked_at_import(tmp_path) -> None:
    """A vendored TTS whose __version__ is computed: the banner says the version is not
    known yet (a WARNING), and the import itself then says which version it is."""
    vendor = _vendored_tts(tmp_path, "__version__ = '.'.join(['0', '22', '1'])\n")
    result = _run(f"import sys; sys.path.insert(0, {vendor!r})\n"
                  "import patches.auto\nimport TTS\n")
    assert result.returncode == 0, result.stderr
    assert "coqui-tts (version unknown) [TTS at" in result.stderr
    banner, _, after = result.stderr.partition("Options:")
    assert "its version could not be read before it is imported" in banner
    assert ("coqui-tts 0.22.1 is what this process runs (TTS.__version__ of the imported TTS at "
            f"{os.path.join(vendor, 'TTS')})") in after


@pytest.mark.slow
def test_banner_names_where_each_version_was_read() -> None:
    """The installed copies: metadata before the import, the module's own after it."""
    result = _run("import torch, patches.auto")
    assert result.returncode == 0, result.stderr
    for integ in _registry.integrations().values():
        version = _upstream.distribution_version(integ.distribution)
        if version is not None:
            assert (f"{integ.distribution} {version} [package metadata; {integ.module} not "
                    f"imported yet]") in result.stderr
    if _upstream.distribution_version("coqui-tts") is not None:
        imported = _run("import TTS, patches.auto")
        assert f"coqui-tts {_upstream.distribution_version('coqui-tts')} [TTS.__version__]" \
            in imported.stderr


def test_an_editable_install_is_the_distributions_own_copy(tmp_path, monkeypatch) -> None:
    """``pip install -e``: the package lives in the source folder that PEP 610's
    direct_url.json names, not under site-packages; it is not a vendored copy."""
    site, src = tmp_path / "site", tmp_path / "src"
    (src / "tp_editable_pkg").mkdir(parents=True)
    (src / "tp_editable_pkg" / "__init__.py").write_text("__version__ = VERSION = '1.0'\n")
    info = site / "tp_editable_pkg-1.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tp-editable-pkg\nVersion: 1.2\n")
    (info / "direct_url.json").write_text(
        '{"url": "%s", "dir_info": {"editable": true}}' % src.as_uri())
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.syspath_prepend(str(site))
    integ = _registry.Integration("tp_editable", "tp-editable-pkg", ">=1,<2", (),
                                  module="tp_editable_pkg")
    found = _registry.upstream_version(integ)
    assert (found.version, found.vendored) == ("1.2", False), found
    # the same package under another folder first on sys.path is a vendored copy
    other = tmp_path / "vendor" / "tp_editable_pkg"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("__version__ = '0.5'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "vendor"))
    found = _registry.upstream_version(integ)
    assert (found.version, found.vendored) == ("0.5", True), found
    assert _registry.version_problem(integ, found) is not None


# The public core (issue 40 item 3) and the 0.x top-level names, moved to patches.advanced.
CORE = {"load_checkpoint", "CheckpointManager", "stats", "status", "revert", "__version__",
        "LoadReport", "CheckpointError", "CheckpointMismatchError", "UnsafeCheckpointError",
        "DiskFullError", "CheckpointWriteError", "RunFolderInUse", "advanced"}
OLD_TOP_LEVEL = {
    "apply", "revert", "applied", "is_applied", "status", "get_original", "stats", "activate",
    "reset_runtime_state", "enable_anomaly_detection", "SafeGradScaler", "LossScaleFloorError",
    "safe_clip_grad_norm_", "ConfigError", "PatchSiteError", "__version__",
    "register_language", "load_checkpoint", "LoadOptions", "CheckpointManager", "LoadReport",
    "CheckpointError", "UnsafeCheckpointError", "CheckpointMismatchError", "DiskFullError",
    "CheckpointWriteError", "NonFiniteTrainingError", "find_nonfinite_source", "observe_loss",
    "set_output_dir", "freeze_base_vocab", "OutOfMemoryTrainingError", "skip_on_oom",
    "RunFolderInUse", "LearningMonitor", "ReadingProbe"}
MOVED = sorted(OLD_TOP_LEVEL - CORE)


def test_the_public_core_is_all_and_the_rest_is_advanced() -> None:
    assert len(patches.__all__) == len(set(patches.__all__))
    assert set(patches.__all__) == CORE
    assert len(patches.advanced.__all__) == len(set(patches.advanced.__all__))
    assert not set(patches.advanced.__all__) & CORE
    assert OLD_TOP_LEVEL <= CORE | set(patches.advanced.__all__)  # nothing lost
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in patches.__all__:
            getattr(patches, name)  # the core answers without a warning
        for name in patches.advanced.__all__:
            getattr(patches.advanced, name)


@pytest.mark.parametrize("name", MOVED)
def test_an_old_name_is_a_deprecated_alias_of_patches_advanced(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patches, "_warned_aliases", set())
    with pytest.warns(DeprecationWarning) as caught:
        found = getattr(patches, name)
    assert found is getattr(patches.advanced, name)
    assert [str(w.message) for w in caught] == [
        f"patches.{name} is patches.advanced.{name}; the old name goes in the next release"]
    assert caught[0].filename == __file__  # the warning names the line that used the old name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(patches, name) is found  # once per name per process
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        patches.no_such_name  # noqa: B018


def test_from_patches_import_an_old_name_warns_at_the_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patches, "_warned_aliases", set())
    with pytest.warns(DeprecationWarning, match=r"patches\.freeze_base_vocab is "
                                                r"patches\.advanced\.freeze_base_vocab") as caught:
        from patches import freeze_base_vocab  # the deprecated spelling
    assert freeze_base_vocab is patches.advanced.freeze_base_vocab
    # the import's line, or (--check-markers) conftest's builtins.__import__ it goes through
    assert caught[0].filename in (__file__, os.path.join(os.path.dirname(__file__), "conftest.py"))


# Files other changes hold that still spell an old name (issue 40 item 3): their owners move
# them to patches.advanced; the lead empties this set when merging.
_OLD_SPELLING_PENDING: set[str] = set()


def test_the_project_spells_no_old_name() -> None:
    """No DeprecationWarning from the project's own code, docs and tests: each spells a moved
    name ``patches.advanced.<name>``; a line that shows the old spelling says it is deprecated
    (or quotes the warning)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py", "*.md"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = "|".join(MOVED)
    attribute = re.compile(rf"\bpatches\.({names})\b(?! is patches\.advanced\.)")
    from_import = re.compile(r"from patches import (\([^)]*\)|[^\n]*)")
    found = []
    for path in listed.splitlines():
        full = os.path.join(ROOT, path)
        if path in _OLD_SPELLING_PENDING or not os.path.isfile(full):
            continue
        with open(full, encoding="utf-8") as handle:
            text = handle.read()
        for number, line in enumerate(text.splitlines(), 1):
            if attribute.search(line) and "deprecated" not in line:
                found.append(f"{path}:{number}: {line.strip()}")
        for match in from_import.finditer(text):
            imported = set(re.findall(r"\w+", re.sub(r"#[^\n]*", "", match.group(1))))
            if imported & set(MOVED) and "deprecated" not in match.group(0):
                found.append(f"{path}: {match.group(0)}")
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_import_patches_changes_nothing_and_its_star_import_warns_nothing() -> None:
    result = _run("import warnings; warnings.filterwarnings('error', r'patches\\.')\n"
                  "import torch\n"
                  "before = torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_\n"
                  "import patches, patches.advanced\n"
                  "from patches import *\n"
                  "from patches.advanced import *\n"
                  "assert (torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_) == before\n"
                  "print(patches.advanced.applied())\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{}"
