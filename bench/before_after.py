"""Run a benchmark on two versions of the project in one go: this checkout and an earlier commit.

The earlier commit is exported once (``git archive``) into a temporary directory; a benchmark's worker then runs
with that tree first on ``sys.path`` (its own copy of ``minimind_ray``), or this checkout's. Used by
bench_decode.py (and its ``--before`` flag) so that "before" is the old code itself, measured in the same run
as "after", alternating, on the same machine load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_REV = "b090f53"  # the last commit before the static KV cache (issue 35)


def export_tree(rev: str) -> Path:
    """The files of ``rev`` in a fresh temporary directory (left for the OS to clean)."""
    out = Path(tempfile.mkdtemp(prefix=f"minimind-ray-{rev}-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def run_worker(script: Path, src: Path, args: list, threads: int) -> dict:
    """``script --worker --src SRC args`` in a fresh interpreter; its last stdout line is its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), "--worker", "--src", str(src), *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{script.name} worker on {src} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
