"""Training-core benchmark: one run, one side-by-side table (not a test).

  (a) tokens/s of the full pipeline (Ray Train, 1 worker, prepared-data stream, MLflow off)
      against the engine's own step in a bare loop: same model, data, micro-batch, accumulation, optimizer,
      thread count, no Ray.
  (b) an injected crash (2 workers): seconds from the last step before the crash to the first
      step after the restore, and the steps lost (goal: <= 30 s locally, <= one checkpoint interval).
  (c) checkpoint overhead at interval 100: the extra time of the steps that checkpointed, over the
      training time (goal <= 2%).

Usage:  .venv/bin/python bench/bench_train.py [--steps 300] [--preset demo]
Timings come from the per-step timestamps of the sample log (train.sample_log_dir).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import local_ray, rank0_times, sample_log, table

from minimind_ray.config import load_config
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.step import train_step
from minimind_ray.raytrain.driver import run
from minimind_ray.store.checkpoint import open_checkpoint


def bare_loop(cfg, prepared_dir: str, steps: int, warmup: int) -> float:
    """tokens/s of the engine's own step (minimind_ray.engine.train_step) in a plain single-process
    loop: the same model, data stream, micro-batch, accumulation, optimizer and thread count, no Ray."""
    state = TrainState.build(cfg, prepared_dir)
    t0, tokens = None, 0
    for s in range(1, steps + 1):
        if s == warmup + 1:
            t0, tokens = time.perf_counter(), 0
        out = train_step(state, state.stream.next_step(), s)
        tokens += out.tokens
    float(out.loss_sum)  # wait for the device
    state.stream.close()
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="demo")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-train-"))
    local_ray(4, env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"})
    common = [f"model.preset={args.preset}", "data.train_path=[demo]", "data.max_seq_len=128",
              "data.tokenizer=builtin", "train.global_batch_size=32", "train.micro_batch_size=16",
              "train.threads_per_worker=1",
              "train.log_interval=10", f"data.cache_dir={tmp}/cache", f"checkpoint.storage_path={tmp}/runs",
              "tracking.enabled=false", "data.eval_fraction=0", "train.warmup_steps=10", "train.epochs=100"]

    # (a) + (c): one uninterrupted 1-worker run with checkpoints every 100 steps
    cfg_a = load_config(None, common + ["name=a", "cluster.num_workers=1", f"train.max_steps={args.steps}",
                                        "checkpoint.interval=100", f"train.sample_log_dir={tmp}/samples/a"])
    res_a = run(cfg_a)
    t = rank0_times(sample_log(tmp / "samples" / "a"))
    warm = 20
    gaps = {s: t[s + 1] - t[s] for s in range(warm, args.steps)}
    ckpt_steps = [s for s in gaps if s % 100 == 0]
    plain = [g for s, g in gaps.items() if s % 10 != 0]          # steps with no report at all
    logged = [g for s, g in gaps.items() if s % 10 == 0 and s % 100 != 0]  # steps that logged metrics
    tokens_per_step = 32 * 128
    pipeline_tps = tokens_per_step * len(gaps) / sum(gaps.values())
    bare_tps = bare_loop(cfg_a, open_checkpoint(res_a.checkpoint_dir).meta().prepared_dir,
                         steps=min(args.steps, 120), warmup=warm)
    ckpt_extra = sum(gaps[s] - statistics.median(logged) for s in ckpt_steps)
    ckpt_overhead = ckpt_extra / sum(gaps.values())

    # (b): 2 workers, crash at step 150 with checkpoints every 100
    crash_at = 150
    cfg_b = load_config(None, common + ["name=b", "cluster.num_workers=2", f"train.max_steps={crash_at + 30}",
                                        "checkpoint.interval=100", f"train.fail_at_step={crash_at}",
                                        f"train.sample_log_dir={tmp}/samples/b"])
    run(cfg_b)
    rows = sample_log(tmp / "samples" / "b")
    restored = max(r["attempt"] for r in rows)
    before = rank0_times(rows, attempt=0)
    after = rank0_times(rows, attempt=restored)
    recovery_s = after[restored + 1] - before[crash_at - 1]
    steps_lost = (crash_at - 1) - restored

    print()
    table(("measure", "value", "goal"), [
        ("(a) full pipeline, 1 worker, tokens/s", f"{pipeline_tps:,.0f}", ""),
        ("(a) bare PyTorch loop, tokens/s", f"{bare_tps:,.0f}", ""),
        ("(a) pipeline / bare", f"{pipeline_tps / bare_tps:.3f}", ">= 0.97"),
        ("(a) median step, no report / with a metrics log (s)",
         f"{statistics.median(plain):.4f} / {statistics.median(logged):.4f}", ""),
        ("(b) crash -> first step after restore (s)", f"{recovery_s:.1f}", "<= 30"),
        ("(b) steps lost (checkpoint interval 100)", steps_lost, "<= 100"),
        ("(c) checkpoint time per checkpoint (s)", f"{ckpt_extra / max(len(ckpt_steps), 1):.3f}", ""),
        ("(c) checkpoint overhead at interval 100", f"{ckpt_overhead:.2%}", "<= 2%")])
    print(f"\nmodel preset {args.preset}, seq 128, global batch 32 (micro 16), 1 thread per worker, "
          f"{args.steps} steps; torch {torch.__version__}; {tmp}")


if __name__ == "__main__":
    main()
