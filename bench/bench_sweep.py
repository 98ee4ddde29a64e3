"""A sweep's wall time against the same trials one after another (docs/sweeps.md): not a test.

Three ways to train the trials of pipelines/configs/sweep_tiny.yaml (4 learning rates, tiny preset, 1 worker each),
in one local Ray of --cpus logical CPUs (with the dashboard), side by side in one run:

  one after another   each trial as a plain `minimind-ray pretrain` run (raytrain/driver.py:run), to its end
  sweep, fifo         `minimind-ray sweep` with scheduler fifo: every trial to its end, as many at once as fit
  sweep, asha         the shipped sweep: ASHA stops the weak trials from step --grace

    .venv/bin/python bench/bench_sweep.py --cpus 4 --steps 24
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from common import REPO, load, local_ray, table

from minimind_ray.config import load_config
from minimind_ray.raytrain.driver import run
from minimind_ray.raytrain.sweep import run_sweep
from minimind_ray.raytrain.sweep_config import load_sweep, trial_overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", type=int, default=4, help="logical CPUs of the local Ray (trials at once: cpus // 1.25)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--grace", type=int, default=4)
    args = ap.parse_args()
    os.chdir(REPO)
    tmp = Path(tempfile.mkdtemp(prefix="mmr-bench-sweep-"))
    common = [f"checkpoint.storage_path={tmp}/runs", f"data.cache_dir={tmp}/cache", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
              f"train.max_steps={args.steps}"]
    ray = local_ray(args.cpus, dashboard=True, log_to_driver=False)
    sweep = load_sweep("pipelines/configs/sweep_tiny.yaml", common)
    lrs = sweep.space["train.lr"]["grid"]
    rows = []
    # warm: the data and the built-in tokenizer, once, outside every timing
    run(load_config(sweep.recipe, [*sweep.overrides, "name=warm", "train.max_steps=1"]))

    t = time.monotonic()
    for i, lr in enumerate(lrs):
        run(load_config(sweep.recipe, [*sweep.overrides, f"name=seq-{i}", *trial_overrides({"train.lr": lr})]))
    rows.append(("one after another (plain runs, each to its end)", time.monotonic() - t, len(lrs) * args.steps, 1))

    for kind in ("fifo", "asha"):
        s = load_sweep("pipelines/configs/sweep_tiny.yaml", [*common, f"name=bench-{kind}", f"scheduler.kind={kind}",
                                                              f"scheduler.grace_period={args.grace}"])
        t = time.monotonic()
        out = run_sweep(s, "")
        steps = sum(int(r["step"] or 0) for r in out.trials)
        rows.append((f"sweep, {kind} ({out.concurrency} at once)", time.monotonic() - t, steps, out.concurrency))
    ray.shutdown()
    base = rows[0][1]
    print(f"\n4 trials of sweep_tiny.yaml ({args.steps} steps, tiny preset, 1 CPU worker each), local Ray of "
          f"{args.cpus} logical CPUs; {load()}")
    table(("how", "wall (s)", "vs one after another", "trial steps trained"),
          [(name, f"{wall:.0f}", f"{base / wall:.2f}x faster", steps) for name, wall, steps, _ in rows])


if __name__ == "__main__":
    main()
