"""Every patch lands, or stays out, whatever the order of import, apply and revert.

Each case runs in a fresh interpreter (tests/order_probe.py), as dd-trace-py does:
import-then-apply, apply-then-import, apply-apply-import (no double wrap),
import-apply-revert-apply, revert-before-import, import-apply-revert, apply-import-apply,
import-apply-apply and import-apply-revert-revert.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(__file__), "order_probe.py")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from patches import _registry  # noqa: E402

# A fresh interpreter (torch imported) per case, patches x orders of them: the slow tier.
pytestmark = pytest.mark.slow

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
def test_order(patch: str, order: str) -> None:
    steps, expect = ORDERS[order]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRAINING_PATCHES_DISABLE", None)
    result = subprocess.run([sys.executable, PROBE, patch, *steps, expect],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, (
        f"{patch} / {order}:\n{result.stdout}\n{result.stderr[-3000:]}")
