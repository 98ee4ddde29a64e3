"""GPU run of the 26M recipe through Ray Train (for a machine with GPUs and Ray; not yet run: the one GPU lent
so far had no Ray, so `tests/soak/gpu_check.py` checked the engine there; docs/training.md has its figures).

Runs the minimind2-small pretrain on the built-in corpus for a few hundred steps with NCCL and bf16
autocast, once without and once with torch.compile, one worker per GPU, and prints one table:
tokens/s (global and per GPU), MFU against metrics.PEAK_BF16_TFLOPS, all-reduce fraction and peak memory,
read back from the runs' MLflow metrics.

    .venv/bin/python bench/bench_gpu.py [--steps 300] [--micro 64]

Put the printed table in docs/training.md beside the GPU's name.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import local_ray, table
from mlflow.tracking import MlflowClient

from minimind_ray.config import load_config
from minimind_ray.raytrain.driver import run
from minimind_ray.tracking.names import metric_name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro", type=int, default=64, help="sequences per GPU per micro-step")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs GPUs"
    gpus = torch.cuda.device_count()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    local_ray(max(8, 4 * gpus), num_gpus=gpus)
    rows = []
    for compile_ in (False, True):
        name = f"gpu-compile-{compile_}"
        cfg = load_config("pipelines/configs/pretrain_26m.yaml", [
            f"name={name}", "data.train_path=[demo]", "data.tokenizer=builtin", f"data.cache_dir={tmp}/cache",
            "data.eval_fraction=0", f"checkpoint.storage_path={tmp}/runs", "checkpoint.interval=100",
            f"cluster.num_workers={gpus}", "cluster.cpus_per_worker=2", f"train.max_steps={args.steps}",
            f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro * gpus}",
            "train.epochs=1000", "train.warmup_steps=50", f"train.compile={str(compile_).lower()}",
            f"tracking.uri={uri}", "train.log_interval=20"])
        res = run(cfg)
        client = MlflowClient(uri)

        def last(key):
            hist = client.get_metric_history(res.mlflow_run_id, metric_name(key))
            # skip the first interval (compilation, warm-up)
            vals = [m.value for m in sorted(hist, key=lambda m: m.step) if m.step > 40]
            return sum(vals) / len(vals) if vals else float("nan")

        rows.append((compile_, last("tokens_per_s"), last("tokens_per_s_per_worker"), last("mfu"),
                     last("comm_fraction"), last("peak_mem_gb"), last("step_time_s")))
    print(f"\n{torch.cuda.get_device_name(0)} x {gpus}, minimind2-small (25.83M), seq 512, "
          f"{args.micro} sequences/GPU/step, bf16 autocast, NCCL, {args.steps} steps")
    table(("torch.compile", "tokens/s", "tokens/s/GPU", "MFU", "all-reduce fraction", "peak mem (GB)", "step (s)"),
          [(c, f"{tps:,.0f}", f"{tpw:,.0f}", f"{mfu:.1%}", f"{comm:.1%}", f"{mem:.1f}", f"{st:.3f}")
           for c, tps, tpw, mfu, comm, mem, st in rows])


if __name__ == "__main__":
    main()
