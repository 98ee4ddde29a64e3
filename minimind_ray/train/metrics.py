"""Throughput, MFU, communication timing and memory.

MFU is measured against a peak-FLOPS table keyed by the device name that torch
reports, never against one hard-coded GPU. Devices not in the table (CPUs among
them) get ``mfu = nan`` unless ``MINIMIND_PEAK_TFLOPS`` names their peak.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Dict, Optional

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


class Meter:
    """Sums of per-step quantities between two metric reports (device tensors stay on the device)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps = 0
        self.tokens = 0
        self.data_wait = 0.0
        self.comm_busy = 0.0
        self.sums: Dict[str, torch.Tensor] = {}
        self.t_start = time.perf_counter()

    def add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums[key] + value if key in self.sums else value


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    except Exception:
        return float("nan")
