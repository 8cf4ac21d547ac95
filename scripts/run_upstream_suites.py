#!/usr/bin/env python3
"""Run upstream test suites plain and with training-patches on, and compare them test by test.

Six suites (docs/compatibility.md has the results and how to get the sources):

- PyTorch's GradScaler tests of ``test/test_torch.py`` on the CPU: every test whose name
  has ``grad_scal``, ``gradscaler`` or ``params_invalidated`` (29 on a CPU-only machine; the
  ``-k test_grad_scaling`` subset is 19 of them);
- PyTorch's FSDP ``ShardedGradScaler`` tests, ``test/distributed/fsdp/
  test_fsdp_sharded_grad_scaler.py`` (20 tests; on a CPU-only machine only the three of
  ``TestShardGradScaler`` can run: they use CPU tensors and a one-rank dummy process
  group, but skip unless CUDA or XLA exists, so a plugin loaded in all three modes lets
  them run on the CPU (``CPU_AMP_PLUGIN``); the 17 FSDP-vs-DDP parity tests need two GPUs
  and skip);
- coqui-tts-trainer 0.4.0's own suite (``trainer/`` and ``tests/``), offline:
  a small synthetic MNIST in the IDX format stands in for the download its tests make;
- accelerate's own distributed test scripts, shipped in the installed package
  (``accelerate.test_utils.scripts``: ``test_sync``, ``test_ops``, ``test_script``, what
  ``accelerate test`` runs), each under ``torchrun`` with two CPU processes (gloo,
  ``ACCELERATE_USE_CPU``): one test per script, passed when every rank exits 0
  (``test_ops`` builds a bare ``PartialState``, which ignores ``ACCELERATE_USE_CPU``: on a
  CPU-only machine each of its ranks runs undistributed);
- the Hugging Face ``transformers.Trainer``'s own tests (``tests/trainer/`` of
  huggingface/transformers: ``test_trainer_callback.py``, ``test_trainer_checkpointing.py``,
  ``test_trainer_resume.py`` with ``trainer_test_utils.py``; ``TRANSFORMERS_TESTS``), offline:
  the few that download a tokenizer or feature extractor from the Hub, or need DeepSpeed's
  launcher, are deselected (``TRANSFORMERS_SELECTION``); the staging-Hub, slow, PEFT and
  torchvision tests skip themselves;
- Lightning's own trainer tests (``tests/tests_pytorch/`` of Lightning-AI/pytorch-lightning:
  the four ``trainer/optimization`` files, three ``checkpointing`` files,
  ``trainer/connectors/test_checkpoint_connector.py`` and the clipping, accumulation,
  checkpoint and pickling tests of ``trainer/test_trainer.py``, with its ``conftest.py`` and
  ``helpers/``; ``LIGHTNING_TESTS``, ``LIGHTNING_SELECTION``): the GPU tests skip themselves
  (``RunIf``).

Each suite runs four times in fresh processes: plain; with a pytest plugin that calls
``patches.advanced.apply()`` before any test module is imported; with a plugin that does
``import patches.auto`` (the one import line); under ``python -m patches run`` (the
``training-patches run`` launcher: every Python process it starts, each torchrun rank and
each spawned child included, applies the patches when it imports torch). The accelerate
scripts are not pytest tests: a launcher does the apply/auto activation in every rank
before it runs the script.
Outcomes are read from JUnit XML (or the ranks' exit codes) and compared per test: the
script exits 1 when a patched run differs from the plain one.

Usage (from the repository root, with the project's venv; not part of ``make test``)::

    .venv/bin/python scripts/run_upstream_suites.py \\
        --pytorch-test ../pytorch/test/test_torch.py \\
        --pytorch-fsdp-scaler ../pytorch/test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py \\
        --coqui-trainer ../coqui-ai-Trainer \\
        --transformers-tests ../transformers \\
        --lightning-tests ../pytorch-lightning \\
        --accelerate-scripts                           # from the installed accelerate

Extra test dependencies (expecttest; torchvision and accelerate for coqui's tests) are
installed with ``pip install --target`` into the scratch folder, never into the venv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_SELECTION = "grad_scal or gradscaler or params_invalidated"
# The Trainer's tests of training steps, callbacks and checkpoint save/resume, relative to a
# transformers checkout (or a folder with the same layout: tests/__init__.py, tests/trainer/).
TRANSFORMERS_TESTS = ("tests/trainer/test_trainer_callback.py",
                      "tests/trainer/test_trainer_checkpointing.py",
                      "tests/trainer/test_trainer_resume.py")
# Deselected: three load a tokenizer or feature extractor from the Hub (no network here: an
# OSError in every mode); test_auto_batch_size_with_deepspeed initialises DeepSpeed's
# communication, which needs mpi4py outside a deepspeed launcher.
TRANSFORMERS_SELECTION = ("not (test_save_collator_tokenizer_by_default"
                          " or test_trainer_saves_tokenizer or test_trainer_saves_feature_extractor"
                          " or test_auto_batch_size_with_deepspeed)")
# Lightning's tests of optimizer steps (automatic, manual, closures, schedulers, backward
# calls), gradient clipping and accumulation, and checkpoint save/resume, relative to a
# pytorch-lightning checkout. The GPU-only tests skip themselves (RunIf).
LIGHTNING_TESTS = ("tests/tests_pytorch/trainer/optimization",
                   "tests/tests_pytorch/trainer/test_trainer.py",
                   "tests/tests_pytorch/checkpointing/test_trainer_checkpoint.py",
                   "tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
                   "tests/tests_pytorch/checkpointing/test_torch_saving.py",
                   "tests/tests_pytorch/trainer/connectors/test_checkpoint_connector.py")
# Of test_trainer.py (78 kB: loggers, prediction, sanity checks, strategies, devices) only
# the gradient clipping, accumulation, checkpoint and pickling tests; the other files run
# whole.
LIGHTNING_SELECTION = ("not test_trainer.py or test_gradient_accumulation_scheduling_last_batch"
                       " or test_model_checkpoint_options or test_model_checkpoint_only_weights"
                       " or test_gradient_clipping_by_norm or test_gradient_clipping_by_value"
                       " or test_invalid_gradient_clip_value or test_invalid_gradient_clip_algo"
                       " or test_trainer_pickle")
MODES = ("plain", "apply", "auto", "run")

PLUGINS = {
    "plain": """
        import json, os, sys

        def pytest_sessionfinish(session, exitstatus):
            with open(os.environ["TP_UPSTREAM_EVIDENCE"], "w") as f:
                json.dump({"patches_imported": "patches" in sys.modules}, f)
    """,
    "apply": """
        import json, os
        import patches

        patches.advanced.apply()

        def pytest_sessionfinish(session, exitstatus):
            _evidence(session)

        def _evidence(session):
            from patches import _registry
            names = list(_registry.specs()) + list(_registry.integrations())
            # The scaler classes the test modules actually hold (what their tests built).
            bound = {}
            for item in session.items:
                module = getattr(item, "module", None)
                for attr in ("GradScaler", "ShardedGradScaler"):
                    cls = getattr(module, attr, None) if module is not None else None
                    if isinstance(cls, type):
                        bound[f"{module.__name__}.{attr}"] = f"{cls.__module__}.{cls.__qualname__}"
            with open(os.environ["TP_UPSTREAM_EVIDENCE"], "w") as f:
                json.dump({"applied": patches.advanced.applied(), "stats": patches.stats(),
                           "state": {n: patches.status(n)["state"] for n in names},
                           "scaler_classes_bound_by_tests": bound},
                          f, default=str, indent=1)
    """,
}
# The apply plugin's first lines, which modes "auto" and "run" replace.
_APPLY = "import patches\n\n        patches.advanced.apply()"
PLUGINS["auto"] = PLUGINS["apply"].replace(_APPLY, "import patches\n        import patches.auto")
# Mode "run": the session runs under `python -m patches run` (the bootstrap applies the
# patches in every process when torch is imported); the plugin only records the evidence,
# importing patches at the session's end: imported first, before torch, it would be the
# import during which the bootstrap's torch hook fires, and the bootstrap then fails.
PLUGINS["run"] = (PLUGINS["apply"].replace(_APPLY + "\n", "")
                  .replace("from patches import _registry",
                           "import patches\n            from patches import _registry"))
# The launcher command of each mode, put before the suite's own command.
WRAPPERS = {"plain": [], "apply": [], "auto": [], "run": ["-m", "patches", "run", "--"]}

# Loaded in every mode of the FSDP suite, before its test module is imported. Its three
# TestShardGradScaler tests use CPU tensors and a one-rank dummy process group, yet skip
# unless amp_definitely_not_available() finds CUDA or XLA, and build the scaler on the
# module's device_type, which is "cuda" on a CUDA build of torch even with no GPU
# (current_accelerator() does not check availability). On a machine with no usable
# accelerator the plugin makes the first answer False and sets device_type to "cpu" (what
# a CPU-only build of torch computes), so the three run on the CPU as written. torch's own
# code consults amp_definitely_not_available() only for device "cuda", never used here.
CPU_AMP_PLUGIN = """
    import torch
    import torch.cuda.amp.common

    ON_CPU = not torch.accelerator.is_available()
    if ON_CPU:
        torch.cuda.amp.common.amp_definitely_not_available = lambda: False

    def pytest_collection_modifyitems(session, config, items):
        for item in items:
            module = getattr(item, "module", None)
            if ON_CPU and getattr(module, "device_type", None) is not None:
                module.device_type = "cpu"
"""


def ensure_extras(python: str, scratch: Path, packages: list[str]) -> Path:
    """Install what the upstream tests need into scratch/extra (not into the venv)."""
    extra = scratch / "extra"
    env = dict(os.environ, PYTHONPATH=str(extra))
    missing = [p for p in packages
               if subprocess.run([python, "-c", f"import {p.split('==')[0]}"], env=env,
                                 capture_output=True).returncode != 0]
    if missing:
        torch_version = subprocess.run(
            [python, "-c", "import torch; print(torch.__version__.split('+')[0])"],
            capture_output=True, text=True, check=True).stdout.strip()
        print(f"installing {', '.join(missing)} into {extra} (torch {torch_version})")
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(extra), *missing], check=True)
    return extra


def write_synthetic_mnist(root: Path, seed: int = 0) -> None:
    """MNIST/raw/*-ubyte files torchvision's MNIST(download=True) accepts as present.

    512 training and 256 test images; each class is a faint block at its own place on
    noise, so a small MLP learns it over a few epochs (coqui's tests assert that the loss
    falls from one fit() to the next)."""
    import numpy as np

    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, count in (("train", 512), ("t10k", 256)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 200, (count, 28, 28)).astype(np.int32)
        for i, k in enumerate(labels):
            row, col = 2 + (k // 5) * 12, 1 + (k % 5) * 5
            images[i, row:row + 10, col:col + 5] += 30
        images = np.clip(images, 0, 255).astype(np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, count) + labels.tobytes())


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case]
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        result[test] = outcome
    return result


def run_suite(python: str, name: str, args: list[str], cwd: Path, scratch: Path,
              pythonpath: list[Path], shared_plugins: dict[str, str] | None = None,
              env: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Run one suite in each mode; ``shared_plugins`` (module name -> source) load in all,
    ``env`` is added to every mode's environment."""
    plugins = scratch / "plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    shared = []
    for plugin, source in (shared_plugins or {}).items():
        (plugins / f"{plugin}.py").write_text(textwrap.dedent(source).lstrip())
        shared += ["-p", plugin]
    results = {}
    for mode in MODES:
        (plugins / f"tp_{mode}.py").write_text(textwrap.dedent(PLUGINS[mode]).lstrip())
        junit = scratch / f"{name}-{mode}.xml"
        evidence = scratch / f"{name}-{mode}-evidence.json"
        # pytest's tmp_path folders (checkpoints) in the scratch folder, deleted after the run,
        # not kept in /tmp/pytest-of-<user> where the last three runs' would fill the disk.
        basetemp = scratch / f"bt-{name}-{mode}"
        mode_env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
                        PYTHONPATH=os.pathsep.join(str(p) for p in [plugins, *pythonpath, REPO]),
                        TP_UPSTREAM_EVIDENCE=str(evidence),
                        TRAINING_PATCHES_OUTPUT_DIR=str(scratch / f"{name}-{mode}-reports"),
                        **(env or {}))
        wrapper = [python, *WRAPPERS[mode]] if WRAPPERS[mode] else []
        command = [*wrapper, python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shared,
                   "-p", f"tp_{mode}", f"--junitxml={junit}", f"--basetemp={basetemp}", *args]
        print(f"\n== {name} [{mode}]: {' '.join(command)}", flush=True)
        proc = subprocess.run(command, cwd=cwd, env=mode_env, capture_output=True, text=True)
        shutil.rmtree(basetemp, ignore_errors=True)
        (scratch / f"{name}-{mode}.log").write_text(proc.stdout + proc.stderr)
        print("\n".join(proc.stdout.strip().splitlines()[-1:]))
        if not junit.exists():
            sys.exit(f"{name} [{mode}] produced no results; see {scratch / f'{name}-{mode}.log'}")
        results[mode] = outcomes(junit)
    return results


ACCELERATE_SCRIPTS = ("test_sync", "test_ops", "test_script")

# Run in every rank by torchrun: activates the patches as the pytest plugins do, runs the
# accelerate script as __main__, and records what was applied (one file per rank).
LAUNCHER = """
    import json, os, runpy, sys

    MODE = {mode!r}
    if MODE == "apply":
        import patches
        patches.advanced.apply()
    elif MODE == "auto":
        import patches
        import patches.auto

    target = sys.argv[1]
    sys.argv = [target, *sys.argv[2:]]
    try:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        evidence = os.environ["TP_UPSTREAM_EVIDENCE"].replace(
            ".json", "-rank" + os.environ.get("RANK", "0") + ".json")
        record = {{"patches_imported": "patches" in sys.modules}}
        if "patches" in sys.modules:  # "run": the bootstrap applied them at torch's import
            import patches
            record.update(applied=patches.advanced.applied(), stats=patches.stats())
        with open(evidence, "w") as f:
            json.dump(record, f, default=str, indent=1)
"""


def run_accelerate_scripts(python: str, scratch: Path, timeout: float, nproc: int = 2,
                           ) -> dict[str, dict[str, str]]:
    """Each accelerate test script under torchrun on ``nproc`` CPU processes, per mode.

    A launch still running after ``timeout`` seconds (ranks waiting on a collective that a
    peer never joins) is killed and counted as an error."""
    plugins = scratch / "plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    work = scratch / "accelerate-work"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, str]] = {}
    for mode in MODES:
        launcher = plugins / f"tp_launch_{mode}.py"
        launcher.write_text(textwrap.dedent(LAUNCHER.format(mode=mode)).lstrip())
        results[mode] = {}
        for script in ACCELERATE_SCRIPTS:
            name = f"accelerate-{script}"
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true",
                       PYTHONPATH=os.pathsep.join([str(plugins), str(REPO)]),
                       TP_UPSTREAM_EVIDENCE=str(scratch / f"{name}-{mode}-evidence.json"),
                       TRAINING_PATCHES_OUTPUT_DIR=str(scratch / f"{name}-{mode}-reports"))
            wrapper = [python, *WRAPPERS[mode]] if WRAPPERS[mode] else []
            command = [*wrapper, python, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={nproc}", str(launcher),
                       f"accelerate.test_utils.scripts.{script}"]
            print(f"\n== accelerate [{mode}]: {' '.join(command)}", flush=True)
            proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                output, _ = proc.communicate()
                outcome = "error"
                print(f"{script} on {nproc} processes: error (still running after "
                      f"{timeout:g} s, killed)")
            else:
                outcome = "passed" if proc.returncode == 0 else "failed"
                print(f"{script} on {nproc} processes: {outcome} (exit {proc.returncode})")
            (scratch / f"{name}-{mode}.log").write_text(output)
            results[mode][f"accelerate.test_utils.scripts::{script}[{nproc}proc]"] = outcome
    return results


def _kill_tree(pid: int) -> None:
    """Kill a process and all its descendants: torchrun starts each rank in a session of
    its own, so killing torchrun's process group would leave the hung ranks (holding the
    output pipe open) behind."""
    import psutil  # a dependency of coqui-tts-trainer, in the project's venv

    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:  # collected before any dies
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def summarize(name: str, results: dict[str, dict[str, str]]) -> bool:
    plain = results["plain"]
    same = True
    print(f"\n{name}: {'mode':<6} passed failed error skipped")
    for mode in MODES:
        counts = {k: list(results[mode].values()).count(k)
                  for k in ("passed", "failed", "error", "skipped")}
        print(f"{name}: {mode:<6} {counts['passed']:>6} {counts['failed']:>6} "
              f"{counts['error']:>5} {counts['skipped']:>7}")
        if mode == "plain":
            continue
        for test in sorted(set(plain) | set(results[mode])):
            if plain.get(test) != results[mode].get(test):
                same = False
                print(f"  DIFFERS [{mode}] {test}: plain {plain.get(test)}, "
                      f"patched {results[mode].get(test)}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pytorch-test", type=Path,
                        help="pytorch's test/test_torch.py (or a file of its GradScaler tests)")
    parser.add_argument("--pytorch-fsdp-scaler", type=Path,
                        help="pytorch's test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py")
    parser.add_argument("--coqui-trainer", type=Path,
                        help="a checkout of idiap/coqui-ai-Trainer at tag v0.4.0")
    parser.add_argument("--accelerate-scripts", action="store_true",
                        help="run the installed accelerate's test scripts on 2 CPU processes")
    parser.add_argument("--transformers-tests", type=Path,
                        help="a huggingface/transformers checkout (its tests/trainer/ is run)")
    parser.add_argument("--lightning-tests", type=Path,
                        help="a Lightning-AI/pytorch-lightning checkout (its tests/tests_pytorch/)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds one accelerate launch may run before it counts as an error")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/training-patches-upstream"),
                        help="where results, logs and test-only packages go")
    parser.add_argument("--python", default=sys.executable, help="the venv's python")
    opts = parser.parse_args()
    if not (opts.pytorch_test or opts.pytorch_fsdp_scaler or opts.coqui_trainer
            or opts.accelerate_scripts or opts.transformers_tests or opts.lightning_tests):
        parser.error("give one or more of --pytorch-test, --pytorch-fsdp-scaler, "
                     "--coqui-trainer, --accelerate-scripts, --transformers-tests, "
                     "--lightning-tests")
    opts.scratch.mkdir(parents=True, exist_ok=True)
    same = True

    if opts.pytorch_test:
        test = opts.pytorch_test.resolve()
        extra = ensure_extras(opts.python, opts.scratch, ["expecttest"])
        selection = f"({TORCH_SELECTION}) and cpu"
        results = run_suite(opts.python, "pytorch", [str(test), "-k", selection],
                            test.parent, opts.scratch, [extra])
        same &= summarize("pytorch", results)
        subset = {mode: {t: o for t, o in r.items()
                         if t.rsplit("::", 1)[-1].startswith("test_grad_scaling")}
                  for mode, r in results.items()}
        same &= summarize("pytorch -k test_grad_scaling", subset)

    if opts.pytorch_fsdp_scaler:
        test = opts.pytorch_fsdp_scaler.resolve()
        extra = ensure_extras(opts.python, opts.scratch, ["expecttest"])
        results = run_suite(opts.python, "pytorch-fsdp", [str(test)], test.parent,
                            opts.scratch, [extra], shared_plugins={"tp_cpu_amp": CPU_AMP_PLUGIN})
        same &= summarize("pytorch-fsdp", results)

    if opts.coqui_trainer:
        source = opts.coqui_trainer.resolve()
        torch_version = subprocess.run(
            [opts.python, "-c", "import torch; print(torch.__version__.split('+')[0])"],
            capture_output=True, text=True, check=True).stdout.strip()
        minor = int(torch_version.split(".")[1])
        extra = ensure_extras(opts.python, opts.scratch,
                              [f"torchvision==0.{minor + 15}.*", "accelerate"])
        data = opts.scratch / "coqui-data"
        write_synthetic_mnist(data)
        results = run_suite(opts.python, "coqui-trainer",
                            ["--rootdir", str(source), str(source / "trainer"),
                             str(source / "tests")],
                            data, opts.scratch, [extra])
        same &= summarize("coqui-trainer", results)

    if opts.accelerate_scripts:
        same &= summarize("accelerate", run_accelerate_scripts(opts.python, opts.scratch,
                                                                opts.timeout))

    if opts.transformers_tests:
        source = opts.transformers_tests.resolve()
        # Run from the checkout, where tests/ is a package (the test modules import
        # .trainer_test_utils); offline, so that a Hub lookup fails at once instead of retrying.
        results = run_suite(opts.python, "transformers",
                            ["--rootdir", str(source), *TRANSFORMERS_TESTS,
                             "-k", TRANSFORMERS_SELECTION],
                            source, opts.scratch, [source], env={"HF_HUB_OFFLINE": "1"})
        same &= summarize("transformers", results)

    if opts.lightning_tests:
        source = opts.lightning_tests.resolve()
        # The tests import tests_pytorch.helpers (tests/ on the path). They run in a scratch
        # folder: the few that give the Trainer no default_root_dir write lightning_logs/
        # there, and the suite's conftest fails a test that leaves files in tests/.
        work = opts.scratch / "lightning-work"
        work.mkdir(parents=True, exist_ok=True)
        results = run_suite(opts.python, "lightning",
                            ["--rootdir", str(source / "tests"),
                             *(str(source / test) for test in LIGHTNING_TESTS),
                             "-k", LIGHTNING_SELECTION],
                            work, opts.scratch, [source / "tests"])
        same &= summarize("lightning", results)

    print(f"\nlogs, JUnit XML and evidence (patches applied, their stats) in {opts.scratch}")
    print("SAME results plain and patched" if same else "RESULTS DIFFER (see above)")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
