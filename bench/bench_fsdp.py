"""DDP vs FSDP vs FSDP with activation checkpointing, side by side in one run, on CPU (not a test).

For each model (minimind2-small, 26M, and the minimind2-0.5b preset) and each way of sharing it, two fresh processes
over gloo (as torchrun would start them; the engine's own loop, no Ray) train a few steps on the fixture's prepared
data (sequences of 32 tokens) and report:

  tokens/s         both workers' tokens over the timed steps (after one warm-up step)
  peak GiB/worker  the larger of the two ranks' peak RSS (the engine's peak_mem_gb on CPU), and the estimate
                   (engine/memory.py) for the same run
  save s / restore s   one checkpoint written (DDP: rank 0's model.pth + train_state.pt; FSDP: every rank's shards,
                   torch.distributed.checkpoint) and read back into the running state

DDP of the 0.5B preset needs ~9 GiB a worker by the estimate (16 bytes a parameter): it runs only with --ddp-big, on a
machine that has twice that to spare. One thread per worker. On a shared machine the figures move with the load (it
is printed); the ratios between rows of one run compare. So the modes run in rounds, each in the reverse order of the
last (``--repeats``), and each row keeps its best round: tokens/s, save and restore seconds; the peak, the largest.

Usage:  .venv/bin/python bench/bench_fsdp.py [--ddp-big] [--steps-small 5] [--steps-big 3] [--repeats 2]
                                            [--repeats-big 1]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import REPO, table

from minimind_ray.config import ModelConfig, from_dict
from minimind_ray.engine.memory import estimate
from minimind_ray.engine.metrics import peak_memory_gb
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.step import train_step
from minimind_ray.model.presets import preset_values
from minimind_ray.store.checkpoint import open_checkpoint

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_v1"  # the unit tests' run: its prepared data, sequences of 32
PREPARED = str(FIXTURE / "prepared")
MODES = {"ddp": dict(parallelism="ddp"), "fsdp": dict(parallelism="fsdp"),
         "fsdp+ac": dict(parallelism="fsdp", activation_checkpointing="blocks")}


def _config(preset: str, micro: int, steps: int, mode: str):
    """The fixture run's config (its machine's paths dropped), with ``preset``'s model on 2 workers."""
    cfg = from_dict(open_checkpoint(FIXTURE / "checkpoint_step4").meta().config)
    train = dataclasses.replace(cfg.train, sample_log_dir=None, max_steps=steps, micro_batch_size=micro,
                                global_batch_size=2 * micro, precision="fp32", threads_per_worker=1,
                                log_interval=10 ** 6, **MODES[mode])
    return dataclasses.replace(cfg, train=train, model=ModelConfig(**preset_values(preset)),
                               cluster=dataclasses.replace(cfg.cluster, num_workers=2))


def _ranks(rank: int, world: int, work: str, preset: str, micro: int, steps: int, mode: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank, world_size=world)
    cfg = _config(preset, micro, steps + 1, mode)
    state = TrainState.build(cfg, PREPARED, rank=rank, world=world)
    train_step(state, state.stream.next_step(), 1)  # warm-up: AdamW's state, the allocator, FSDP's buffers
    dist.barrier()
    t0, tokens = time.perf_counter(), 0
    for step in range(2, steps + 2):
        tokens += train_step(state, state.stream.next_step(), step).tokens
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = peak_memory_gb(torch.device("cpu"))
    ck = Path(work) / "ck"
    t0 = time.perf_counter()
    state.save(ck, mlflow_run_id=None, prepared_dir=PREPARED)
    dist.barrier()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state.restore(open_checkpoint(ck))
    dist.barrier()
    restore_s = time.perf_counter() - t0
    state.stream.close()
    row = {"rank": rank, "tokens": tokens, "seconds": seconds, "peak_gib": peak, "save_s": save_s,
           "restore_s": restore_s, "estimate_gib": estimate(cfg, micro, "cpu", world).total / 2 ** 30,
           "params": state.model.num_parameters()}
    (Path(work) / f"rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def bench(preset: str, micro: int, steps: int, mode: str) -> dict:
    work = tempfile.mkdtemp(prefix="bench-fsdp-")
    try:
        mp.start_processes(_ranks, args=(2, work, preset, micro, steps, mode), nprocs=2, start_method="spawn")
        rows = [json.loads((Path(work) / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"preset": preset, "mode": mode, "micro": micro, "steps": steps, "params": rows[0]["params"],
            "tokens_per_s": sum(r["tokens"] for r in rows) / max(r["seconds"] for r in rows),
            "peak_gib": max(r["peak_gib"] for r in rows), "estimate_gib": rows[0]["estimate_gib"],
            "save_s": max(r["save_s"] for r in rows), "restore_s": max(r["restore_s"] for r in rows)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ddp-big", action="store_true", help="also DDP of the 0.5B preset (~9 GiB a worker)")
    ap.add_argument("--steps-small", type=int, default=5)
    ap.add_argument("--steps-big", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the 26M model's modes")
    ap.add_argument("--repeats-big", type=int, default=1, help="rounds of the 0.5B preset's modes")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    small = [("minimind2-small", 16, args.steps_small, m) for m in MODES]
    big = [("minimind2-0.5b", 2, args.steps_big, m) for m in MODES if m != "ddp" or args.ddp_big]
    runs = [r for i in range(args.repeats) for r in (small if i % 2 == 0 else small[::-1])]
    runs += [r for i in range(args.repeats_big) for r in (big if i % 2 == 0 else big[::-1])]
    started = f"{os.getloadavg()[0]:.2f}"
    rounds = {}
    for preset, micro, steps, mode in runs:
        r = bench(preset, micro, steps, mode)
        r["load"] = f"{os.getloadavg()[0]:.2f}"
        rounds.setdefault((preset, mode), []).append(r)
        print(json.dumps(r), flush=True)
    rows, order = [], [(p, m) for p, _, _, m in small + big]
    for (preset, mode), rs in sorted(rounds.items(), key=lambda kv: order.index(kv[0])):
        best, every = max(rs, key=lambda r: r["tokens_per_s"]), ", ".join(f"{r['tokens_per_s']:.0f}" for r in rs)
        rows.append((preset, f"{best['params'] / 1e6:.1f}M", mode, f"{best['micro']} x 32",
                     f"{best['tokens_per_s']:.1f} ({every})",
                     f"{max(r['peak_gib'] for r in rs):.2f} ({best['estimate_gib']:.2f})",
                     f"{min(r['save_s'] for r in rs):.1f}", f"{min(r['restore_s'] for r in rs):.1f}"))
    if not args.ddp_big:
        est = estimate(_config("minimind2-0.5b", 2, 1, "ddp"), 2, "cpu", 2).total / 2 ** 30
        rows.append(("minimind2-0.5b", "505.3M", "ddp", "2 x 32", "not run (--ddp-big)", f"({est:.2f})", "", ""))
    print(f"load average {started} at the start, {os.getloadavg()[0]:.2f} at the end (2 cores; 1 thread per worker); "
          f"2 workers over gloo, fp32, sequences of 32 tokens\n")
    table(("model", "params", "mode", "micro-batch", "tokens/s (2 workers; every round)", "peak GiB/worker (estimate)",
           "checkpoint save s", "restore s"), rows)


if __name__ == "__main__":
    main()
