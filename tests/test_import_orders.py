"""Every patch lands, or stays out, whatever the order of import, apply and revert.

Each case runs in a fresh process (tests/order_probe.py, forked by its server from a state in
which only torch, patches and libraries without a patch site are imported), as dd-trace-py does:
import-then-apply, apply-then-import, apply-apply-import (no double wrap),
import-apply-revert-apply, revert-before-import, import-apply-revert, apply-import-apply,
import-apply-apply and import-apply-revert-revert.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(__file__), "order_probe.py")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from patches import _registry  # noqa: E402

# A fresh process (torch imported) per case, patches x orders of them: the slow tier.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe_server():
    """One fork server per test process (xdist worker): each case is a child forked from it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRAINING_PATCHES_DISABLE", None)
    server = subprocess.Popen([sys.executable, PROBE, "--serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    ready = json.loads(server.stdout.readline() or '{"error": "the server died"}')
    if not ready.get("ready"):
        server.kill()
        pytest.fail(f"order probe server: {ready.get('error')}")
    yield server
    server.stdin.close()
    server.wait(timeout=60)

PATCHES = list(_registry.specs())  # every patch the library has
ORDERS = {
    "import-then-apply": (["import", "apply"], "patched"),
    "apply-then-import": (["apply", "import"], "patched"),
    "apply-apply-import": (["apply", "apply", "import"], "patched"),
    "import-apply-revert-apply": (["import", "apply", "revert", "apply"], "patched"),
    "revert-before-import": (["apply", "revert", "import"], "original"),
    "import-apply-revert": (["import", "apply", "revert"], "original"),
    "apply-import-apply": (["apply", "import", "apply"], "patched"),
    "import-apply-apply": (["import", "apply", "apply"], "patched"),
    "import-apply-revert-revert": (["import", "apply", "revert", "revert"], "original"),
}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("patch", PATCHES)
def test_order(patch: str, order: str, probe_server, tmp_path) -> None:
    steps, expect = ORDERS[order]
    out = tmp_path / "probe.out"
    probe_server.stdin.write(json.dumps({"argv": [patch, *steps, expect], "out": str(out),
                                         "cwd": str(tmp_path)}) + "\n")
    probe_server.stdin.flush()
    answer = json.loads(probe_server.stdout.readline() or '{"rc": "the server died"}')
    text = out.read_text() if out.is_file() else ""
    assert answer["rc"] == 0 and text.rstrip().endswith("ok"), (
        f"{patch} / {order} (rc {answer['rc']}):\n{text[-3000:]}")


# -- under ``training-patches run``: the program's own first import ---------------------------
# The bootstrap applies the patches when torch is imported; these programs import torch
# from inside another module's import, while that module is still half-built.

LAUNCHER = [sys.executable, "-m", "patches", "run", "--"]
# Printed on the last line by each program: what the patches say of themselves there.
REPORT = ("import json, torch, patches; print(json.dumps({'status': {n: patches.status(n)"
          "['state'] for n in ('grad_scaler', 'grad_clip', 'nan_guard', 'autocast')}, "
          "'safe_scaler': torch.amp.GradScaler is patches.advanced.SafeGradScaler}))")


def _launched(program: str, launcher: bool = True) -> tuple[dict, str]:
    """Run ``python -c program`` (through the launcher): (its last line as JSON, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("TRAINING_PATCHES_DISABLE", "TRAINING_PATCHES_STRICT"):
        env.pop(name, None)
    result = subprocess.run([*(LAUNCHER if launcher else []), sys.executable, "-c", program],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize("first", ["import patches", "import patches.auto",
                                   "from patches.advanced import applied"])
def test_launcher_when_the_first_import_is_patches(first: str) -> None:
    """``patches/__init__`` imports torch, so the bootstrap's torch hook fires while
    ``patches`` is half-imported: activation waits for the end of that import, and no line
    says the process trains unprotected."""
    found, stderr = _launched(f"{first}\n{REPORT}")
    assert "could NOT be applied" not in stderr and "unprotected" not in stderr, stderr
    assert found == {"status": dict.fromkeys(("grad_scaler", "grad_clip", "nan_guard",
                                              "autocast"), "applied"),
                     "safe_scaler": True}, stderr[-3000:]


ACCELERATE_PROBE = (
    "import json, patches, accelerate.accelerator as acc\n"
    "scaler = acc.get_fsdp2_grad_scaler(device='cpu')\n"
    "print(json.dumps({'status': patches.status('accelerate'), "
    "'safe': isinstance(scaler, patches.advanced.SafeGradScaler)}))")


@pytest.mark.parametrize("first, launcher", [
    ("import accelerate", True),
    ("from accelerate import Accelerator", True),
    # the one-line way, after accelerate: accelerate is whole by then (a guard, not a repro)
    ("from accelerate import Accelerator\nimport patches.auto", False),
], ids=["launcher-import-accelerate", "launcher-from-accelerate", "line-after-accelerate"])
def test_accelerate_imported_before_torch_keeps_its_integration(first: str,
                                                                 launcher: bool) -> None:
    """``accelerate.accelerator`` imports torch before it binds ``get_fsdp2_grad_scaler``:
    the site lands when that module's import ends, not on the half-built module (which
    would warn, falsely, that the name does not exist in this accelerate)."""
    pytest.importorskip("accelerate")
    found, stderr = _launched(f"{first}\n{ACCELERATE_PROBE}", launcher=launcher)
    assert "does not exist in this version" not in stderr, stderr[-3000:]
    assert found["status"]["state"] == "applied", found
    assert found["status"]["landed"] == ["accelerate.accelerator.get_fsdp2_grad_scaler"]
    assert found["safe"] is True
