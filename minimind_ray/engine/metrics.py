"""Throughput, MFU, communication timing and memory.

MFU is measured against a peak-FLOPS table keyed by the device name that torch
reports, never against one hard-coded GPU. Devices not in the table (CPUs among
them) get ``mfu = nan`` unless ``MINIMIND_PEAK_TFLOPS`` names their peak.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peak, TFLOP/s per device (vendor datasheets, no sparsity).
PEAK_BF16_TFLOPS: Dict[str, float] = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 125.0,  # AWS g5
    "A10": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,  # fp16 tensor core; no bf16
    "T4": 65.0,  # fp16 tensor core; no bf16
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def peak_flops(device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device, or None if unknown."""
    env = os.environ.get("MINIMIND_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # longest key first so "H100 PCIe" wins over "H100"
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


class CommTimer:
    """DDP communication hook that all-reduces gradient buckets and times them.

    Each bucket's time runs from the moment DDP hands the bucket over (its gradients are
    ready) until its all-reduce completes: wall clock with gloo; CUDA events with NCCL,
    whose futures complete when the work is *queued*, so only events on the stream
    that waits for the result measure it. Buckets overlap with the rest of backward, so
    the sum is the communication busy time, an upper bound of what the step waited for.
    ``collect()`` returns the sum since the last call (with NCCL it synchronises on the
    recorded events, so call it once per log interval, not per step).
    """

    def __init__(self, process_group=None):
        self.pg = process_group
        self._lock = threading.Lock()
        self._busy_s = 0.0
        self._events = []  # (start, end) CUDA events

    def collect(self) -> float:
        with self._lock:
            events, self._events = self._events, []
            busy, self._busy_s = self._busy_s, 0.0
        for start, end in events:
            end.synchronize()
            busy += start.elapsed_time(end) / 1000.0
        return busy

    def hook(self, state, bucket):
        group = self.pg or dist.group.WORLD
        tensor = bucket.buffer().div_(dist.get_world_size(group))
        if tensor.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finish(f):
            if tensor.is_cuda:  # runs on a stream that waits for the all-reduce
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                with self._lock:
                    self._events.append((start, end))
            else:
                with self._lock:
                    self._busy_s += time.perf_counter() - t0
            return f.value()[0]

        return fut.then(finish)


class IntervalMeter:
    """What the steps between two metric reports add up to. Per-step sums stay on the device;
    :meth:`reduce` all-reduces them in one collective and reads them once (one host sync per
    interval, none per step)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.data_wait = 0.0
        self.sums: Dict[str, torch.Tensor] = {}
        self.per_step: List[tuple] = []  # (step, local loss sum, global weight, local aux)
        self.metric_weights: List[torch.Tensor] = []  # what each step's extras are means over (global)
        self.t_start = time.perf_counter()

    def add(self, out, data_wait_s: float) -> None:
        """Record one :class:`~minimind_ray.engine.step.StepOutput`."""
        self.steps += 1
        self.tokens += out.tokens
        self.data_wait += data_wait_s
        for k, v in out.extras.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.per_step.append((out.step, out.loss_sum, out.weight, out.aux))
        self.metric_weights.append(out.weight if out.metric_weight is None else out.metric_weight)

    def reduce(self, *, world: int, device, step: int, total_steps: int, steps_per_epoch: int, lr: float,
               grad_norm, flops_per_token: float, peak: Optional[float], comm_busy: float) -> Dict[str, Any]:
        """One all-reduce of everything the interval summed, then the metrics dict. ``_per_step_loss``
        holds (step, global mean loss) of every step of the interval (MLflow gets each step's loss).
        The caller resets the meter once it has reported (evaluation and logging belong to this interval)."""
        per_step = self.per_step
        k = len(per_step)
        extra_keys = sorted(self.sums)
        host = torch.tensor([self.tokens, self.data_wait, comm_busy], dtype=torch.float64)
        vec = torch.cat([torch.stack([l for _, l, _, _ in per_step]), torch.stack([a for _, _, _, a in per_step]),
                         host.to(device)] + [self.sums[x].reshape(1).to(device) for x in extra_keys])
        if world > 1:
            dist.all_reduce(vec)
        vec = vec.cpu()
        weights_per_step = torch.stack([w for _, _, w, _ in per_step]).cpu()
        elapsed = max(time.perf_counter() - self.t_start, 1e-9)  # wall time of the interval (the .cpu() synced)
        losses = [(per_step[i][0], float(vec[i] / weights_per_step[i])) for i in range(k)]
        aux = [float(vec[k + i]) / world for i in range(k)]
        tokens, data_wait, comm = (float(x) for x in vec[2 * k:2 * k + 3])
        steps = max(self.steps, 1)
        step_time = elapsed / steps
        tok_s = tokens / elapsed
        weights = float(weights_per_step.sum())
        metric_units = float(torch.stack(self.metric_weights).cpu().sum())
        m: Dict[str, Any] = {
            "step": step,
            "total_steps": total_steps,
            "epoch": (step - 1) // steps_per_epoch,
            "loss": losses[-1][1],
            "loss_interval": sum(float(vec[i]) for i in range(k)) / max(weights, 1.0),
            "aux_loss": aux[-1],
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tok_s,
            "tokens_per_s_per_worker": tok_s / world,
            "mfu": (tok_s * flops_per_token / (peak * world)) if peak else float("nan"),
            "step_time_s": step_time,
            "data_wait_s": data_wait / world / steps,
            "allreduce_s": comm / world / steps,
            "comm_fraction": (comm / world / steps) / max(step_time, 1e-9),
            "peak_mem_gb": peak_memory_gb(device),
            "world_size": world,
        }
        for i, x in enumerate(extra_keys):
            m[x] = float(vec[2 * k + 3 + i]) / max(metric_units, 1.0)
        m["_per_step_loss"] = losses
        return m


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    except Exception:
        return float("nan")
