"""The Ray pipeline against plain PyTorch on the model users train (issue 17). One run, one table.

  (a) 1 process x 2 threads: the pipeline (Ray Train, 1 worker, cpus_per_worker=2) against the engine's
      own loop in a bare process (no Ray): same model, data, batch, seed and threads.
  (b) 2 processes x 1 thread, gloo, global batch 8: the pipeline (2 workers) against
      ``torchrun --nproc_per_node 2 bench/bench_vs_torchrun.py --engine ...`` (the engine under plain DDP, no Ray).

For each: steady-state tokens/s (steps after the warm-up), the ratio, and the global mean loss of the last
log interval, what both sides report (they must agree: the same steps, the same data order). While the pipeline
trains, the CPU time of Ray's own processes that this script started (raylet, GCS, agents, monitors, Train's actors;
not the training workers) is sampled with psutil: on a 2-core machine that share is taken from training.

The plain sides run first, with no Ray process on the machine; then Ray starts for the pipeline sides.

Usage:  .venv/bin/python bench/bench_vs_torchrun.py [--preset minimind2-small] [--steps 30] [--warmup 8]
The plain sides are this script under torchrun: ``bench/bench_vs_torchrun.py --engine --prepared DIR --out FILE
[key=value ...]`` builds on every rank the ``TrainState`` the Ray workers build and runs the engine's loop; rank 0
writes the per-step wall times and each log interval's global mean loss to FILE.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from common import REPO, cpu_by_process, cpu_spent, local_ray, rank0_times, sample_log, table

from minimind_ray.config import load_config
from minimind_ray.data.prepare import ensure_prepared
from minimind_ray.engine.loop import Hooks
from minimind_ray.engine.loop import run as run_engine
from minimind_ray.engine.state import TrainState
from minimind_ray.raytrain.driver import run
from minimind_ray.tokenizer import resolve_tokenizer

# the processes this one started that are not Ray's own (common.cpu_by_process): the rest are its daemons and actors
NOT_RAY = (("training", "RayTrainWorker"), ("plain", "torch.distributed.run"), ("plain", "bench_vs_torchrun.py"))


class StepClock(Hooks):
    """Per-step wall times (taken when each step starts) and each log interval's mean loss (the pipeline's)."""

    def __init__(self):
        self.t, self.interval_loss = {}, {}

    def before_step(self, step):
        self.t[step] = time.time()

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.interval_loss[step] = metrics["loss"]


def engine_side(args) -> None:
    """``--engine``: the plain side, this process one rank of a torchrun launch (no Ray anywhere)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    state = TrainState.build(load_config(None, args.overrides), args.prepared, rank, world)
    clock, t0 = StepClock(), time.time()
    run_engine(state, clock)
    clock.t[state.total_steps + 1] = time.time()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"t": clock.t, "interval_loss": clock.interval_loss,
                                              "wall": time.time() - t0, "world": world}))
    if world > 1:
        dist.destroy_process_group()


def overrides(args, tmp: Path, workers: int, threads: int, global_batch: int):
    return [f"model.preset={args.preset}", "data.train_path=[demo]", "data.tokenizer=builtin",
            f"data.max_seq_len={args.seq}", "data.eval_fraction=0", f"data.cache_dir={tmp}/cache",
            f"train.global_batch_size={global_batch}", f"train.micro_batch_size={args.micro}",
            f"train.max_steps={args.steps}", "train.warmup_steps=2", "train.log_interval=10",
            f"train.threads_per_worker={threads}", f"cluster.num_workers={workers}",
            f"cluster.cpus_per_worker={threads}", "checkpoint.interval=1000000", "tracking.enabled=false",
            f"checkpoint.storage_path={tmp}/runs"]


def tokens_per_s(times: dict, steps: int, warmup: int, tokens_per_step: int) -> float:
    """Steady state: steps warmup+1 .. steps, timed from their start times (the next step's start, or the end)."""
    t = {int(k): v for k, v in times.items()}
    return (steps - warmup) * tokens_per_step / (t[steps + 1] - t[warmup + 1])


def metered(fn, *args):
    """``fn(*args)``, and the CPU that Ray's own processes (not the training workers) and this one (Ray Train's driver
    side, or nothing) used meanwhile, in cores: {"ray": ..., "driver": ...}."""
    before, t0 = cpu_by_process(NOT_RAY), time.time()
    out = fn(*args)
    spent, wall = cpu_spent(before, cpu_by_process(NOT_RAY)), max(time.time() - t0, 1e-9)
    return out, {"ray": spent.get("other ray", 0.0) / wall, "driver": spent.get("this", 0.0) / wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="minimind2-small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--decompose", action="store_true",
                    help="(a) also: the plain loop beside an idle Ray, and the engine in a plain Ray task (no Ray Train)")
    ap.add_argument("--engine", action="store_true", help="the plain side: one rank of a torchrun launch (above)")
    ap.add_argument("--prepared", help="--engine: the prepared data")
    ap.add_argument("--out", help="--engine: the file rank 0 writes")
    ap.add_argument("overrides", nargs="*", help="--engine: the run's config, key=value")
    args = ap.parse_args()
    if args.engine:
        return engine_side(args)
    assert args.steps > args.warmup + 2 and args.steps % 10 == 0, "--steps: a multiple of 10 (the log interval)"
    tmp = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    # the prepared data both sides read (Ray Data prepares it once; Ray is stopped before the plain sides)
    cfg_a = load_config(None, overrides(args, tmp, 1, 2, args.micro))
    ray = local_ray(4)
    prepared = ensure_prepared(cfg_a.data, resolve_tokenizer("builtin", cfg_a.data.cache_dir))
    ray.shutdown()

    def plain(nproc: int, threads: int, global_batch: int, name: str) -> dict:
        out = tmp / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "bench" / "bench_vs_torchrun.py"), "--engine", "--prepared", prepared, "--out", str(out),
               *overrides(args, tmp, nproc, threads, global_batch)]
        subprocess.run(cmd, check=True, env={**env, "OMP_NUM_THREADS": str(threads)}, cwd=REPO)
        return json.loads(out.read_text())

    bare_a = plain(1, 2, args.micro, "bare-a")  # torchrun with one process is a bare loop
    torchrun_b = plain(2, 1, 2 * args.micro, "torchrun-b")

    local_ray(4)

    extra = []
    if args.decompose:
        # where (a)'s gap goes: Ray's daemons beside the same plain process, then the same loop inside a
        # Ray worker process (a task with 2 CPUs) without Ray Train's controller, workers group and report
        beside, meter = metered(plain, 1, 2, args.micro, "bare-a-beside-ray")
        extra.append(("(a) plain loop, an idle Ray beside it", beside["t"], beside["interval_loss"][str(args.steps)], meter))

    def pipeline(workers: int, threads: int, global_batch: int, name: str):
        cfg = load_config(None, overrides(args, tmp, workers, threads, global_batch)
                          + [f"name={name}", f"train.sample_log_dir={tmp}/samples/{name}"])
        res, meter = metered(run, cfg)
        times = rank0_times(sample_log(tmp / "samples" / name))
        times[args.steps + 1] = times[args.steps] + statistics.median(
            times[s + 1] - times[s] for s in range(args.warmup + 1, args.steps))
        return res.metrics["loss"], times, meter

    loss_pa, times_pa, meter_a = pipeline(1, 2, args.micro, "pipeline-a")
    loss_pb, times_pb, meter_b = pipeline(2, 1, 2 * args.micro, "pipeline-b")
    if args.decompose:
        cfg_task = load_config(None, overrides(args, tmp, 1, 2, args.micro))

        @ray.remote(num_cpus=2)
        def engine_in_a_ray_task(cfg, prepared_dir):  # StepClock goes with it (cloudpickle: __main__'s by value)
            state, clock = TrainState.build(cfg, prepared_dir), StepClock()
            run_engine(state, clock)
            clock.t[state.total_steps + 1] = time.time()
            return clock.t, clock.interval_loss

        # last: the task's worker process stays behind as an idle Ray worker; its CPU is not measured
        t_task, loss_task = ray.get(engine_in_a_ray_task.remote(cfg_task, prepared))
        extra.append(("(a) the engine in a plain Ray task (no Ray Train)", t_task, loss_task[args.steps], None))

    ray.shutdown()

    tok_a, tok_b = args.micro * args.seq, 2 * args.micro * args.seq
    rows = [("(a) 1 proc x 2 threads", tokens_per_s(times_pa, args.steps, args.warmup, tok_a),
             tokens_per_s(bare_a["t"], args.steps, args.warmup, tok_a), loss_pa,
             bare_a["interval_loss"][str(args.steps)], meter_a),
            ("(b) 2 proc x 1 thread, gloo", tokens_per_s(times_pb, args.steps, args.warmup, tok_b),
             tokens_per_s(torchrun_b["t"], args.steps, args.warmup, tok_b), loss_pb,
             torchrun_b["interval_loss"][str(args.steps)], meter_b)]
    print(f"\n{args.preset}, seq {args.seq}, micro-batch {args.micro}, {args.steps} steps "
          f"({args.warmup} warm-up), fp32, {os.cpu_count()} cores")
    for name, t, loss, m in extra:  # decomposition rows: "pipeline" is the variant, "plain" the bare loop
        rows.append((name, tokens_per_s(t, args.steps, args.warmup, tok_a), rows[0][2], loss, rows[0][4], m))
    cells = []
    for name, p, b, lp, lb, m in rows:
        cells.append((name, f"{p:,.0f}", f"{b:,.0f}", f"{p / b:.3f}", f"{lp:.6f} / {lb:.6f}",
                      f"{m['ray']:.2f} cores ({m['ray'] / (os.cpu_count() or 1):.1%} of the machine)" if m else
                      "not measured", f"{m['driver']:.2f} cores" if m else "not measured"))
    table(("case", "pipeline tok/s", "plain tok/s", "pipeline / plain",
           "mean loss of the last log interval (pipeline / plain)", "Ray daemons' CPU during the run",
           "the driver's CPU"), cells)
    print(f"\nplain sides: torchrun running bench/bench_vs_torchrun.py --engine (the engine's own loop); {tmp}")


if __name__ == "__main__":
    main()
