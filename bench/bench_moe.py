"""MoE dispatch benchmark: today's ``MoE.experts_forward`` against the per-expert loop it replaced (not a test).

For each preset, a whole model's forward + backward (training mode, aux loss on) at one batch, with
  * "before": the dispatch before issue 15 (group sizes read on the host with ``.tolist()``, one
              expert call per group, ``index_add_``; reproduced below as ``loop_experts_forward``);
  * "now":    today's ``MoE.experts_forward`` (grouped GEMMs in bf16 on CPU and sm 9/10 GPUs, else a
              loop that reads the run ends once per layer);
and prints the median time of the timed iterations (wall clock on a GPU, this process's CPU time on a
CPU), the host reads in one forward + backward, and the largest logit difference between the two.
Host reads are counted where they happen: on CUDA with ``torch.cuda.set_sync_debug_mode`` (every
synchronising call warns), on CPU by counting ``Tensor.tolist``/``Tensor.item`` calls (a CPU has no
device to wait for, but each read is where a GPU run would stall).

Usage:  .venv/bin/python bench/bench_moe.py [--presets tiny-moe minimind2-moe] [--batch 4] [--seq 256]
            [--iters 3] [--device cpu|cuda] [--precision fp32|bf16]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
from common import fresh_model

from minimind_ray.model.minimind import MoE


def loop_experts_forward(self: MoE, xf: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The dispatch this project used before issue 15, kept here as the benchmark's baseline."""
    flat_idx = idx.reshape(-1)  # (N*k,): slot s belongs to token s // k
    order = flat_idx.argsort()
    counts = torch.bincount(flat_idx, minlength=self.E).tolist()  # host sync: group sizes
    y = torch.zeros_like(xf)  # (N, h)
    idle = []
    for expert, slots in zip(self.experts, order.split(counts)):
        if slots.numel() == 0:
            idle.append(expert)
            continue
        tokens = slots // self.k
        out = expert(xf[tokens]) * weight.reshape(-1, 1)[slots]  # (n_e, h)
        y.index_add_(0, tokens, out.to(y.dtype))
    if idle and torch.is_grad_enabled():  # keep idle experts in the graph (zero gradient) for DDP
        y = y + 0 * sum(p.sum() for e in idle for p in e.parameters())
    return y


NOW = MoE.experts_forward


class HostReads:
    """Counts host reads of tensor values during a block (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device, self.count = device, 0

    @contextlib.contextmanager
    def __call__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            self.count = sum("synchroniz" in str(w.message) for w in caught)
            return
        originals = torch.Tensor.tolist, torch.Tensor.item

        def counted(fn):
            def wrapper(t, *a, **kw):
                self.count += 1
                return fn(t, *a, **kw)
            return wrapper

        torch.Tensor.tolist, torch.Tensor.item = counted(originals[0]), counted(originals[1])
        try:
            yield
        finally:
            torch.Tensor.tolist, torch.Tensor.item = originals


def measure(preset: str, dispatch, device: torch.device, precision: str, batch: int, seq: int, iters: int):
    """-> (median seconds of forward + backward, host reads in the first (warm-up) one, its logits)."""
    MoE.experts_forward = dispatch
    model = fresh_model(preset).to(device).train()
    ids = torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    # a GPU run is timed by the wall clock; a CPU run by this process's CPU time, which other
    # processes on a shared machine do not inflate (it adds up the threads' time: 2 threads ~ 2x wall)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times, reads, first = [], None, None
    for i in range(iters + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        counter = HostReads(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        with counter() if i == 0 else contextlib.nullcontext():  # count on the warm-up only
            with autocast:
                out = model(ids)
                loss = out.logits.float().logsumexp(-1).mean() + out.aux_loss
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i == 0:
            reads, first = counter.count, out.logits.detach().float()
        else:
            times.append(clock() - t0)
    MoE.experts_forward = NOW
    return statistics.median(times), reads, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-moe", "minimind2-moe"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"MoE forward + backward, batch {args.batch} x {args.seq} tokens, {args.precision}, {name}, "
          f"torch {torch.__version__}, median of {args.iters}")
    unit = "wall s" if device.type == "cuda" else "CPU s"
    print(f"{'preset':<16}{'before ' + unit:>14}{'now ' + unit:>12}{'before/now':>12}{'host reads before':>19}"
          f"{'now':>5}{'max |dlogit|':>14}")
    for preset in args.presets:
        t_loop, r_loop, y_loop = measure(preset, loop_experts_forward, device, args.precision, args.batch,
                                         args.seq, args.iters)
        t_new, r_new, y_new = measure(preset, NOW, device, args.precision, args.batch, args.seq, args.iters)
        diff = (y_loop - y_new).abs().max().item()
        print(f"{preset:<16}{t_loop:>14.3f}{t_new:>12.3f}{t_loop / t_new:>12.2f}{r_loop:>19}{r_new:>5}{diff:>14.3g}",
              flush=True)


if __name__ == "__main__":
    main()
