"""The GPU path on one GPU, without Ray: what a lent GPU without Ray is checked with.

The engine (``minimind_ray/engine``) needs only torch, so this check runs where Ray is not installed. It prints, for
the 26M ``minimind2-small``:

1. NCCL: a world-of-1 process group on the GPU and an all-reduce through it.
2. Training speed, one process: fp32 eager, bf16 autocast eager, bf16 + ``torch.compile``: tokens/s
   (steps after warm-up), MFU against ``engine/metrics.py``'s peak, peak memory.
3. bf16 vs fp32: the largest per-step loss difference over the first steps (same seed and data).
4. Exact resume on CUDA: 2k steps straight, and k steps + ``state_dict`` / ``load_state_dict`` into a
   fresh state + k steps; the largest weight difference, beside two straight runs' difference (CUDA
   kernels with atomics need not repeat bit for bit, so the run-to-run figure is the floor).
5. ``bench/bench_moe.py`` on CUDA in bf16 and fp32 (grouped GEMM dispatch and host syncs).

    python3 -m tests.soak.gpu_check --prepared DIR [--micro 64] [--steps 60]

``DIR`` is data prepared for seq 512 with the minimind2 tokenizer (``minimind-ray prepare``). The exit code is 1
when the all-reduce is wrong, or the resume is not bit-equal under ``--deterministic``; tests/soak/test_gpu.py
runs it under pytest (marker ``soak``).
"""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minimind_ray.config import load_config
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.metrics import peak_flops
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.step import train_step

REPO = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda", 0)


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class Clock(Hooks):
    def __init__(self):
        self.t, self.loss, self.metrics = {}, {}, []

    def before_step(self, step):
        sync()
        self.t[step] = time.perf_counter()

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.loss.update(per_step_loss)
        self.metrics.append((step, metrics))


def config(args, **train):
    over = [f"{k}={v}" for k, v in train.items()]
    return load_config(str(REPO / "pipelines/configs/pretrain_26m.yaml"), [
        f"data.train_path=[{args.prepared}]", "data.eval_fraction=0", f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro}",
        "cluster.num_workers=1", "train.epochs=1000", "train.warmup_steps=10", "train.log_interval=10", "checkpoint.interval=100000",
        "tracking.enabled=false", *over])


def speed(args, precision, compile_):
    torch.cuda.reset_peak_memory_stats()
    cfg = config(args, **{"train.max_steps": args.steps, "train.precision": precision,
                          "train.compile": str(compile_).lower()})
    state = TrainState.build(cfg, args.prepared, device=DEVICE)
    clock = Clock()
    t0 = time.perf_counter()
    run(state, clock)
    sync()
    clock.t[args.steps + 1] = time.perf_counter()
    warm = args.warmup + 1
    dt = clock.t[args.steps + 1] - clock.t[warm]
    tokens = (args.steps + 1 - warm) * args.micro * cfg.data.max_seq_len
    tps = tokens / dt
    flops = state.model.flops_per_token(cfg.data.max_seq_len) * tps
    peak = peak_flops(state.device)
    return {"precision": precision, "compile": compile_, "tokens_per_s": tps, "mfu": flops / peak if peak else float("nan"),
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "first_steps_s": clock.t[warm] - t0,
            "loss": clock.loss, "final_loss": clock.loss[max(clock.loss)]}


def resume_diff(args, k):
    """(straight vs straight, straight vs resumed) largest weight difference after 2k bf16 steps."""
    def straight():
        s = TrainState.build(config(args, **{"train.max_steps": 2 * k, "train.precision": "bf16"}), args.prepared,
                             device=DEVICE)
        run(s)
        return {n: p.detach().float().cpu() for n, p in s.model.state_dict().items()}

    a, b = straight(), straight()
    cfg = config(args, **{"train.max_steps": 2 * k, "train.precision": "bf16"})
    first = TrainState.build(cfg, args.prepared, device=DEVICE)
    for step in range(1, k + 1):  # k steps of the same schedule as the straight run
        train_step(first, first.stream.next_step(), step)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    first.stream.close()
    buf.seek(0)
    second = TrainState.build(cfg, args.prepared, device=DEVICE)
    second.load_state_dict(torch.load(buf, weights_only=False))
    run(second)
    c = {n: p.detach().float().cpu() for n, p in second.model.state_dict().items()}
    diff = lambda x, y: max(float((x[n] - y[n]).abs().max()) for n in x)  # noqa: E731
    return diff(a, b), diff(a, c), all(torch.equal(a[n], c[n]) for n in a)


def speed_checks(args, dev):
    """Checks 2 and 3."""
    rows = [speed(args, "fp32", False), speed(args, "bf16", False), speed(args, "bf16", True)]
    print(f"\n2. {dev}, minimind2-small, seq 512, {args.micro} sequences/step, 1 process, steps "
          f"{args.warmup + 1}..{args.steps} timed")
    print("| precision | torch.compile | tokens/s | MFU | peak mem (GiB) | steps 1..warm-up (s) | loss at last step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['compile']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
              f"{r['peak_mem_gb']:.1f} | {r['first_steps_s']:.1f} | {r['final_loss']:.4f} |")
    fp32, bf16, comp = (r["loss"] for r in rows)  # 3.
    common = sorted(set(fp32) & set(bf16) & set(comp))
    print(f"\n3. per-step loss over steps {common[0]}..{common[-1]}: |bf16 - fp32| max "
          f"{max(abs(bf16[s] - fp32[s]) for s in common):.2e}, |compiled bf16 - eager bf16| max "
          f"{max(abs(comp[s] - bf16[s]) for s in common):.2e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", required=True)
    ap.add_argument("--micro", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--parts", default="1,2,3,4,5", help="which numbered checks to run")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms for check 4 (set CUBLAS_WORKSPACE_CONFIG=:4096:8)")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "no CUDA device"
    dev = torch.cuda.get_device_name(0)
    print(f"torch {torch.__version__}, {dev}, bf16 supported: {torch.cuda.is_bf16_supported()}, "
          f"NCCL {torch.cuda.nccl.version()}", flush=True)

    parts = set(args.parts.split(","))
    import torch.distributed as dist
    init = tempfile.mktemp(prefix="nccl-init-")
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    x = torch.arange(4.0, device="cuda")
    dist.all_reduce(x)
    print(f"1. NCCL world of 1: backend {dist.get_backend()}, all_reduce -> {x.tolist()}", flush=True)
    bad = [] if x.tolist() == [0.0, 1.0, 2.0, 3.0] else [f"1. the all-reduce of a world of 1 gave {x.tolist()}"]
    dist.destroy_process_group()

    if "2" in parts:
        speed_checks(args, dev)
    if "4" in parts:
        torch.use_deterministic_algorithms(args.deterministic)
        rr, rs, equal = resume_diff(args, 10)
        print(f"\n4. 20 bf16 steps (deterministic algorithms: {args.deterministic}): straight vs straight max |dw| "
              f"{rr:.2e}; straight vs 10 + resume + 10 max |dw| {rs:.2e} (bit-equal: {equal})", flush=True)
        bad += [] if equal or not args.deterministic else ["4. the resumed run is not bit-equal under deterministic "
                                                           "algorithms"]
    if "5" in parts:
        for prec in ("bf16", "fp32"):
            print(f"\n5. bench_moe --device cuda --precision {prec}", flush=True)
            subprocess.run([sys.executable, str(REPO / "bench/bench_moe.py"), "--device", "cuda",
                            "--precision", prec, "--batch", "8", "--seq", "512", "--iters", "5"],
                           check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    print("verdict: " + ("passed" if not bad else "FAILED: " + "; ".join(bad)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
