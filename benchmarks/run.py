"""Run every benchmark in this folder (``make bench``); each prints a markdown table."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    failed = 0
    for script in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        print(f"\n## {os.path.basename(script)}\n", flush=True)
        failed += subprocess.run([sys.executable, script]).returncode != 0
    sys.exit(1 if failed else 0)
