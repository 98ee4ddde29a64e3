"""The torchrun side of bench/bench_vs_torchrun.py: the project's own engine (model, data stream, step)
under plain ``torchrun`` DDP, with no Ray anywhere.

    torchrun --nproc_per_node 2 bench/torchrun_engine.py --prepared DIR --out result.json [key=value ...]

Every rank builds the same ``TrainState`` the Ray workers build and runs the engine's loop; rank 0
writes the per-step wall times and the global mean loss of every step to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch.distributed as dist

from minimind_ray.config import load_config
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState


class StepClock(Hooks):
    """Per-step wall times (taken when each step starts) and the losses the interval metrics report."""

    def __init__(self):
        self.t, self.loss, self.interval_loss = {}, {}, {}

    def before_step(self, step):
        self.t[step] = time.time()

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.loss.update(per_step_loss)
        self.interval_loss[step] = metrics["loss"]  # what the pipeline reports: the interval's mean


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--prepared", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    cfg = load_config(args.config, args.overrides)
    state = TrainState.build(cfg, args.prepared, rank, world)
    clock = StepClock()
    t0 = time.time()
    run(state, clock)
    clock.t[state.total_steps + 1] = time.time()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"t": clock.t, "loss": clock.loss, "interval_loss": clock.interval_loss, "wall": time.time() - t0, "world": world}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
