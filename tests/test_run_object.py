"""The run object (docs/design/run.md): what the patches keep between steps belongs to one
run that ``apply()`` starts and ``revert()`` ends; no patch module keeps it in a global."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

import patches
from patches import _options, _run, _runstate, _step

PACKAGE = Path(__file__).resolve().parents[1] / "patches"


def _nan_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step whose loss is NaN, clipped first (the clip counts it)."""
    opt.zero_grad()
    (model(torch.ones(2, 4)).sum() * float("nan")).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def test_revert_ends_the_run_and_the_next_apply_starts_from_zero(tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv("TRAINING_PATCHES_OUTPUT_DIR", raising=False)
    monkeypatch.setattr(_run, "_dir_providers", [])
    patches.advanced.apply(["nan_guard", "grad_clip"])
    first = _runstate.current()
    _run.set_output_dir(tmp_path)
    _run.set_batch({"filenames": ["a.wav"]}, 41)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    _nan_step(model, opt)
    assert torch.equal(model.weight, before)  # skipped
    assert patches.stats()["nan_guard"]["skipped"] == 1
    assert patches.stats()["grad_clip"]["calls"] == 1
    assert patches.stats()["evidence"]["written"] == 1  # the event, in tmp_path

    patches.revert()
    assert first.ended and _runstate.current() is first
    assert patches.stats()["nan_guard"]["skipped"] == 1  # readable until the next apply

    patches.advanced.apply(["nan_guard", "grad_clip"])
    run = _runstate.current()
    assert run is not first and not run.ended and run.number == first.number + 1
    assert patches.stats()["nan_guard"] == dict.fromkeys(patches.stats()["nan_guard"], 0)
    assert patches.stats()["grad_clip"]["calls"] == 0
    assert patches.stats()["evidence"]["written"] == 0
    assert _run.output_dir() is None and run.batch_ids == [] and run.trainer_step is None
    assert _step.context() is not first.part(_step.StepContext)


def test_a_partial_revert_keeps_the_run(tmp_path: Path) -> None:
    patches.advanced.apply(["nan_guard", "grad_clip"])
    run = _runstate.current()
    _run.set_output_dir(tmp_path)
    patches.revert(["grad_clip"])
    assert _runstate.current() is run and not run.ended
    assert _run.output_dir() == str(tmp_path)


def test_a_folder_set_between_runs_is_the_next_runs(tmp_path: Path) -> None:
    patches.advanced.apply(["nan_guard"])
    patches.revert()
    ended = _runstate.current()
    _run.set_output_dir(tmp_path)  # as a script does before its import line
    assert _runstate.current() is not ended
    patches.advanced.apply(["nan_guard"])
    assert _run.output_dir() == str(tmp_path)


def test_reset_runtime_state_keeps_the_options_of_patches_still_applied() -> None:
    patches.advanced.apply(["nan_guard"], max_bad_steps=7)
    first = _runstate.current()
    patches.advanced.reset_runtime_state()
    assert first.ended and _runstate.current() is not first
    assert _options.current().max_bad_steps == 7
    patches.revert()
    patches.advanced.reset_runtime_state()
    assert _runstate.current().options is None  # nothing applied: the environment's


def test_what_cannot_be_written_is_logged_with_its_records_when_the_run_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "afile").write_text("")
    patches.advanced.apply(["nan_guard"])
    _run.set_output_dir(tmp_path / "afile" / "x")  # under a file: never writable
    _run.append_jsonl(_run.EVENTS_FILE, {"step": 3, "marker": "said-at-the-end"})
    assert patches.stats()["evidence"]["waiting"] == 1
    with caplog.at_level(logging.WARNING, logger="training_patches"):
        patches.revert()
    lost = [r.getMessage() for r in caplog.records if "are lost from that file" in r.getMessage()]
    assert len(lost) == 1 and "at the end of the run" in lost[0]
    assert '"marker": "said-at-the-end"' in lost[0]
    assert patches.stats()["evidence"]["lost"] == 1


# -- no run state in module globals ----------------------------------------------------
#
# Every module-level mutable container and every ``global`` rebinding in the runtime
# (patches/, tools aside) is listed here with why it is not run state. A new one fails the
# test until it moves into a part of the run (docs/design/run.md) or says why it is not one.

_REGISTRY = "process wiring: what is registered or applied, and where"
_WEAK = "kept weakly with the user's object it describes (a model, optimizer, trainer, DDP module)"
_CACHE = "a cache of what does not change within the process"
_ONCE = "a deprecation said once per process, as Python's own warnings are"
ALLOWED: dict[str, str] = {
    **{f"patches._registry.{name}": _REGISTRY for name in (
        "_specs", "_integrations", "_integrations_off", "_active", "_sites", "_version_problems",
        "_replacements", "_requires_problems", "_watched")},
    "patches._registry._checked_versions": _CACHE,
    "patches._imports._waiting": _REGISTRY, "patches._imports._watching_classes": _REGISTRY,
    "patches._options._checks": _REGISTRY,
    "patches.reads_text._finders": _REGISTRY + " (the models' reading probes, registered at import)",
    "patches._options._from_environment": _CACHE + " (keyed by the environment's variables)",
    "patches._options._first_use": _REGISTRY,
    "patches._api._activated": "the import line ran in this process",
    "patches._run._dir_providers": _REGISTRY,
    "patches._run._run_id": "one per process: a forked DataLoader worker keeps its parent's",
    "patches._runstate._current": "the run object itself", "patches._runstate._on_end": _REGISTRY,
    "patches._step._listeners": _REGISTRY, "patches._step._hooks": _REGISTRY,
    "patches._step._steps": _WEAK + ": row views a raising step left outlive a run",
    "patches._ddp._carriers": _WEAK, "patches._ddp._loss_flags": _REGISTRY,
    "patches._ddp._live": "callbacks handed to torch futures and not yet run (process)",
    "patches._ddp._drain_registered": _REGISTRY,
    "patches._runlock._held": "the folder locks this process holds (open files)",
    "patches._runlock._sides": "the side folders this process made (files on disk)",
    "patches.anomaly._active": "the patch's own switch, as applied",
    "patches.checkpoint._collective._GROUP": "the process group of a distributed save",
    "patches.checkpoint.digest._verified": _CACHE + " (keyed by file identity and mtime)",
    "patches.checkpoint.digest._blake3": _CACHE,
    "patches.checkpoint.digest.bytes_hashed": "a process-wide measurement benchmarks read",
    "patches.grad_scaler._sharded_classes": _CACHE,
    "patches.resume_check._load_hooks": _WEAK,
    "patches.vocab_freeze._by_param": _WEAK, "patches.vocab_freeze._live": _WEAK,
    "patches.vocab_freeze._hooked": _WEAK, "patches.vocab_freeze._seen_optimizers": _WEAK,
    "patches.vocab_freeze._stages_set": _REGISTRY,
    "patches.vocab_freeze._not_applied": "the patch's status (why it could not land)",
    **{f"patches.vocab_rows.{name}": _REGISTRY for name in (
        "_layouts", "_owner_paths", "_owner_models", "_finders")},
    "patches.languages._languages": _REGISTRY, "patches.languages._romanizers": _REGISTRY,
    "patches._warned_aliases": _ONCE, "patches.row_init._warned_deprecated": _ONCE,
    "patches.integrations.coqui_checkpoint._saving": "the Trainers inside a save call (a stack)",
    **{f"patches.integrations.coqui_interrupt.{name}": _WEAK for name in (
        "_interruptions", "_started_at", "_saved_at", "_after_step", "_between_steps")},
    "patches.integrations.coqui_learning._monitors": _WEAK,
    "patches.integrations.coqui_trainer._ddp_of": _WEAK,
    "patches.integrations.deepspeed.sites._checked": _WEAK,
    "patches.integrations.deepspeed.sites._loading": _WEAK,
    "patches.integrations.f5_tts.sites._watched": _WEAK,
    "patches.integrations.lightning.sites._runs": _WEAK,
    "patches.integrations.xtts_gpt._base_loads": _WEAK,
}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque"}
_SYNC = {"Lock", "RLock", "Condition", "Event", "Semaphore"}  # guards, not state


def _mutable(value: ast.expr | None) -> bool:
    """A container, or an instance of a class (a ``_State()``, a ``WeakSet()``, a
    ``DeviceCounters(...)``): what a module could keep state in."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _MUTABLE_CALLS or (name.lstrip("_")[:1].isupper() and name not in _SYNC)
    return False


def module_state(source: str, module: str) -> set[str]:
    """``module.name`` of each module-level mutable container (not an UPPER-case constant
    table, not ``__all__``) and of each name a function rebinds with ``global``."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if targets and _mutable(node.value):  # type: ignore[union-attr]
            found |= {f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name)
                      and not t.id.lstrip("_").isupper() and t.id != "__all__"}
    found |= {f"{module}.{name}" for node in ast.walk(tree) if isinstance(node, ast.Global)
              for name in node.names}
    return found


def _runtime_state() -> set[str]:
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "tools" in parts:
            continue
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found |= module_state(path.read_text(encoding="utf-8"), module)
    return found


def test_no_patch_module_keeps_run_state_in_a_module_global() -> None:
    found = _runtime_state()
    unexplained = sorted(found - set(ALLOWED))
    assert not unexplained, (
        f"module globals that look like run state: {unexplained}. Keep what a run remembers "
        f"in a part of the run (``_run.current().part(YourState)``, docs/design/run.md), or, "
        f"if it is process wiring, a cache or kept with the user's object, list it in "
        f"tests/test_run_object.py ALLOWED with why.")
    assert not sorted(set(ALLOWED) - found), "ALLOWED lists names that are gone: remove them"


def test_the_module_state_rule_can_fail() -> None:
    source = ("_counts = {}\nLIMITS = {'a': 1}\n_seen: set[int] = set()\n_flag = False\n"
              "_state = _State()\n_lock = threading.Lock()\n"
              "def f():\n    global _flag\n    _flag = True\n")
    assert module_state(source, "m") == {"m._counts", "m._seen", "m._flag", "m._state"}
