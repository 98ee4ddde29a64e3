"""Run a benchmark on two versions of the project in one go: this checkout and an earlier commit.

The earlier commit is exported once (``git archive``) into a temporary directory; a benchmark's worker then runs
with that tree first on ``sys.path`` (its own copy of ``minimind_ray``), or this checkout's. Used by
bench_decode.py, bench_rollout.py and bench_eval.py --gen (their ``--before`` flag) so that "before" is the old
code itself, measured in the same run as "after", alternating, on the same machine load. As a command it runs a
whole bench script twice, the old commit's copy on its own code and this checkout's:

  .venv/bin/python bench/before_after.py bench/bench_serve.py --clients 16 [--preset minimind2-small]
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


def main(argv=None) -> int:
    """``before_after.py [--before REV] SCRIPT ARGS...``: the script of the earlier commit (its own copy, on its own
    code) and this checkout's, one after the other, each with ``--json``; both outputs, then their rows side by
    side (rows with ``mode`` and ``tok_per_s``, as bench_serve.py writes them)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--before", default=BASE_REV)
    ap.add_argument("script", help="a bench script, relative to the repository root, e.g. bench/bench_serve.py")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="before-after-"))
    loads, rows = [os.getloadavg()[0]], {}
    for side, tree in (("before", export_tree(a.before)), ("after", REPO)):
        out = tmp / f"{side}.json"
        print(f"\n======== {side}: {tree / a.script} {' '.join(a.args)}", flush=True)
        subprocess.run([sys.executable, str(tree / a.script), *a.args, "--json", str(out)], check=True,
                       env={**os.environ, "PYTHONPATH": str(tree)})
        rows[side] = {r["mode"]: r for r in json.loads(out.read_text())}
        loads.append(os.getloadavg()[0])
    print(f"\n{a.script} {' '.join(a.args)}: before = {a.before}, after = this checkout; load average (1 min) "
          + " -> ".join(f"{x:.1f}" for x in loads))
    base = {s: (r["one-by-one"]["tok_per_s"] + r.get("one-by-one, again", r["one-by-one"])["tok_per_s"]) / 2
            for s, r in rows.items()}
    print("\n| mode | before tok/s | after tok/s | before vs one-by-one | after vs one-by-one | TTFT p50 / p99 ms "
          "before | after |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows["after"].items():
        b = rows["before"].get(mode)
        if b is None:
            continue
        print(f"| {mode} | {b['tok_per_s']:.0f} | {r['tok_per_s']:.0f} | {b['tok_per_s'] / base['before']:.2f}x | "
              f"{r['tok_per_s'] / base['after']:.2f}x | {b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
