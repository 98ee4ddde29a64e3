"""What an out-of-memory error says, in figures: Ray's memory monitor and torch's allocators.

Three messages a run can die with when memory runs out, and what this module reads from each:

- Ray's memory monitor (a raylet kills the newest task or actor when the node passes
  ``RAY_memory_usage_threshold``, 0.95 by default): ``ray.exceptions.OutOfMemoryError``, or the text of
  one inside an ``ActorDiedError``: "... running low on memory. Memory on the node (IP: ..) was 22.4GB /
  23.5GB (0.95) ... threshold of ...B (95.0% of ...B total) ... task name=RayTrainWorker..., actual memory
  used=19.8GB". Ray's "GB" are GiB (23.54 "GB" is a 25.3e9-byte node).
- torch on the host refusing an allocation: "DefaultCPUAllocator: can't allocate memory: you tried to
  allocate N bytes" (a RuntimeError).
- torch on a GPU: ``torch.OutOfMemoryError``, "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a
  total capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has
  78.08 GiB memory in use. ...".

It imports nothing (like ``fsio``), so the prepare job (``data/``), the engine and the Ray layer read the
same messages. What to do about them is :mod:`minimind_ray.engine.memory` (the estimate, the advice) and
:mod:`minimind_ray.raytrain.oom` (stopping a run).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

GIB = float(2 ** 30)
MONITOR_MARK = "running low on memory"  # in every message of Ray's memory monitor
CPU_MARK = "DefaultCPUAllocator: can't allocate memory"
CUDA_MARK = "CUDA out of memory"
INJECTED_MARK = "(train.faults"  # an out-of-memory error raised by fault injection: it fires once, a retry passes


class OutOfMemory(RuntimeError):
    """A run stopped because memory ran out; the message (one line) names the settings to change."""


@dataclass
class MemorySeen:
    """The figures of one out-of-memory error (bytes; None where the message does not say)."""

    where: str  # "host": Ray's memory monitor or a refused host allocation; "gpu": a CUDA allocation
    source: str  # "memory monitor" | "host allocator" | "CUDA allocator"
    used: Optional[float] = None  # in use on the node / GPU when it failed
    total: Optional[float] = None  # the node's / GPU's memory
    limit: Optional[float] = None  # the memory monitor's kill threshold
    process: Optional[float] = None  # the killed process's memory (monitor) / this process's (CUDA)
    requested: Optional[float] = None  # the allocation that failed
    victim: str = ""  # the task or actor the memory monitor killed
    injected: bool = False

    def describe(self) -> str:
        """One clause: what was seen against what there is."""
        g = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        if self.source == "memory monitor":
            who = f"{self.victim} ({g(self.process)})" if self.victim and self.process is not None else (
                self.victim or "a worker")
            seen = f"Ray's memory monitor killed {who}"
            if self.used is not None and self.total is not None:
                seen += f" when the node had {g(self.used)} of its {g(self.total)} in use"
            if self.limit is not None and self.total:
                seen += f" (its kill threshold: {self.limit / self.total:.0%}, RAY_memory_usage_threshold)"
            return seen
        if self.source == "host allocator":
            seen = f"the host refused an allocation of {g(self.requested)}" if self.requested else (
                "the host refused an allocation")
            return seen + (f" (the node has {g(self.total)})" if self.total else "")
        seen = f"CUDA could not allocate {g(self.requested)}" if self.requested else "CUDA ran out of memory"
        if self.process is not None and self.total is not None:
            seen += f" with {g(self.process)} of the GPU's {g(self.total)} in use by the worker"
        elif self.total is not None:
            seen += f" on a GPU of {g(self.total)}"
        return seen


_UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40, "PiB": 2 ** 50}


def _size(number: str, unit: str) -> float:
    return float(number) * _UNITS.get(unit, 1)


def _search(pattern: str, text: str):
    return re.search(pattern, text, re.S)


def read_oom(text: str) -> Optional[MemorySeen]:
    """The figures of ``text`` if it is an out-of-memory message (of any of the three kinds), else None."""
    injected = INJECTED_MARK in text
    if MONITOR_MARK in text:
        seen = MemorySeen("host", "memory monitor", injected=injected)
        m = _search(r"Memory on the node \([^)]*\) was ([\d.]+)GB (?:used )?/ ([\d.]+)GB", text)  # 2.60: "used", "limit"
        if m:
            seen.used, seen.total = float(m.group(1)) * GIB, float(m.group(2)) * GIB
        m = _search(r"threshold of (\d+)B \(([\d.]+)% of (\d+)B (?:total|limit)\)", text)  # Ray >= 2.56 (2.60: limit)
        if m:
            seen.limit, seen.total = float(m.group(1)), float(m.group(3))
        else:
            m = _search(r"memory usage threshold of ([\d.]+)", text)  # older Rays
            if m and seen.total:
                seen.limit = float(m.group(1)) * seen.total
        m = (_search(r"task name=([^,]+),[^)]*?actual memory used=([\d.]+)GB", text)
             or _search(r"name=([^,]+), pid=\d+, memory used=([\d.]+)GB", text))
        if m:
            seen.victim, seen.process = m.group(1).strip(), float(m.group(2)) * GIB
        return seen
    if CPU_MARK in text:
        m = _search(r"you tried to allocate (\d+) bytes", text)
        return MemorySeen("host", "host allocator", requested=float(m.group(1)) if m else None, injected=injected)
    if CUDA_MARK in text:
        seen = MemorySeen("gpu", "CUDA allocator", injected=injected)
        m = _search(r"Tried to allocate ([\d.]+) (\w+)", text)
        if m:
            seen.requested = _size(m.group(1), m.group(2))
        m = _search(r"total capacity of ([\d.]+) (\w+)", text)
        if m:
            seen.total = _size(m.group(1), m.group(2))
        m = _search(r"this process has ([\d.]+) (\w+) memory in use", text)
        if m:
            seen.process = _size(m.group(1), m.group(2))
        return seen
    return None
