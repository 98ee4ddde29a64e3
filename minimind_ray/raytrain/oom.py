"""Out of memory in a training run, said plainly.

Three places, one rule: an out-of-memory error ends the run at once, in one line that names the settings
to change, the memory seen against what there is, and a micro-batch that fits by the estimate
(:mod:`minimind_ray.engine.memory`).

- Before the worker group starts, :func:`warn_if_short` prints the estimate of one worker's peak beside
  what one worker has (node memory / workers on it, or the GPU's), and a warning with the advice when the
  estimate is the larger.
- In the Train controller, the failure callback (``raytrain/faults.py``) calls :func:`stop_on_out_of_memory`
  with the workers' errors. Ray Train would restart the worker group ``cluster.max_failures`` times, and
  every restart would run the same micro-batch out of memory again; raising a ``ControllerError`` from
  the callback ends the run instead (Ray Train retries worker-group errors, never controller errors). The
  ``oom`` of fault injection says "(train.faults" and is retried like any injected fault: it fires once.
- In the driver, :func:`explain` turns what ``fit()`` raised into :class:`OutOfMemory`, which the CLI
  prints as one line with exit code 2 (``--debug`` shows the traceback).

Which errors: Ray's memory monitor killing a worker or the controller (``ray.exceptions.OutOfMemoryError``,
or an ``ActorDiedError`` carrying its message), the host refusing an allocation (torch's
``DefaultCPUAllocator``), and CUDA running out (``torch.OutOfMemoryError``); see ``memory_errors.py``.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

from minimind_ray.config import RunConfig  # the Ray layer is above the config: it runs what a RunConfig says
from minimind_ray.engine.memory import GiB, advice, estimate
from minimind_ray.failures import within
from minimind_ray.memory_errors import MemorySeen, OutOfMemory, read_oom


class OutOfMemoryStop(RuntimeError):
    """Raised (inside a ``ControllerError``) by the Train controller when a worker ran out of memory."""

    def __init__(self, rank: int, text: str):
        super().__init__(rank, text)
        self.rank, self.text = rank, text

    def __str__(self) -> str:
        return f"rank {self.rank} ran out of memory: {self.text}"


def find_oom(error: BaseException) -> Optional[Tuple[MemorySeen, str]]:
    """(figures, message) of the first out-of-memory error in ``error``, or None."""
    import torch

    for e in within(error):
        text = e.text if isinstance(e, OutOfMemoryStop) else str(e)
        seen = read_oom(text)
        if seen is None and isinstance(e, torch.OutOfMemoryError):
            seen = MemorySeen("gpu", "CUDA allocator", injected="(train.faults" in text)
        if seen is None and type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("ray."):
            seen = MemorySeen("host", "memory monitor")
        if seen is not None:
            return seen, text
    return None


def stop_on_out_of_memory(worker_exceptions: Dict[int, BaseException]) -> None:
    """In the controller: end the run (no restart) if a worker's error is a real out-of-memory error."""
    for rank, error in sorted(worker_exceptions.items()):
        found = find_oom(error)
        if found is not None and not found[0].injected:
            from ray.train import ControllerError

            quiet_out_of_memory_tracebacks()  # the worker group's shutdown logs the same error again
            raise ControllerError(OutOfMemoryStop(rank, found[1][-20000:]))


class _OneLineOnOutOfMemory(logging.Filter):
    """Ray Train logs a failed training function with its whole traceback ("Error in training function: ...")
    and, in the controller, the failures of the worker group's shutdown that follow. For an out-of-memory error,
    which the driver says in one line, the console keeps one line of each; Ray Train's log files keep it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        import torch

        exc = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        seen = read_oom(text + ("\n" + str(exc) if exc is not None else ""))
        if seen is None and isinstance(exc, torch.OutOfMemoryError):
            seen = MemorySeen("gpu", "CUDA allocator")
        if seen is None or seen.injected:
            return True
        head = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        last = next((ln.strip() for ln in reversed(text.strip().splitlines()) if ln.strip()), head)
        why = f"{type(exc).__name__}: out of memory" if exc is not None else last
        record.msg, record.args, record.exc_info, record.exc_text = (
            f"{head.rstrip(':')} ({why[:300]}; the driver says what to change)", (), None, None)
        return True


def quiet_out_of_memory_tracebacks() -> None:
    """In a worker or the Train controller: Ray Train's console log of an out-of-memory error in one line
    (a filter on the console handler of the ``ray.train`` logger, which Ray Train sets up; idempotent)."""
    for h in logging.getLogger("ray.train").handlers:
        if isinstance(h, logging.StreamHandler) and not any(isinstance(f, _OneLineOnOutOfMemory) for f in h.filters):
            h.addFilter(_OneLineOnOutOfMemory())


# --------------------------------------------------------------------------- what one worker has


def _workers_per_node(cfg: RunConfig, node_cpus: float) -> int:
    return max(1, min(cfg.cluster.num_workers, int(node_cpus // cfg.cluster.cpus_per_worker) or 1))


def host_memory_per_worker(cfg: RunConfig) -> Optional[Tuple[float, str]]:
    """(bytes, how it was found) one worker can use on the smallest node: the memory Ray saw free on it
    when it started (its ``memory`` + ``object_store_memory`` resources) over the workers it can hold."""
    import ray

    best = None
    for n in ray.nodes():
        r = n.get("Resources") or {}
        if not n.get("Alive") or r.get("CPU", 0) < cfg.cluster.cpus_per_worker:
            continue
        mem = r.get("memory", 0.0) + r.get("object_store_memory", 0.0)
        k = _workers_per_node(cfg, r["CPU"])
        if mem and (best is None or mem / k < best[0]):
            best = (mem / k, f"{mem / GiB:.1f} GiB free on the node when Ray started, over {k} worker(s)")
    return best


def gpu_memory_per_worker(timeout_s: float = 20.0) -> Optional[Tuple[float, str]]:
    """(bytes, how) of one GPU of the cluster, asked of a one-GPU task; None when that does not answer."""
    import ray

    @ray.remote(num_gpus=1, num_cpus=0, max_calls=1)  # its process exits after: no idle CUDA context left behind
    def gpu_total() -> Tuple[float, str]:
        import torch

        p = torch.cuda.get_device_properties(0)
        return float(p.total_memory), p.name

    try:
        total, name = ray.get(gpu_total.remote(), timeout=timeout_s)
    except Exception:
        return None
    return total, f"a {name} has {total / GiB:.1f} GiB"


def warn_if_short(cfg: RunConfig, use_gpu: bool) -> None:
    """Print the estimate of one worker's peak beside what a worker has; warn (with the advice) if short."""
    device = "cuda" if use_gpu else "cpu"
    est = estimate(cfg, device_type=device)
    have = gpu_memory_per_worker() if use_gpu else host_memory_per_worker(cfg)
    shape = f"{est.sequences} x {est.seq_len} tokens, {cfg.model.preset}, {est.precision}, {est.strategy}"
    if have is None:
        print(f"[minimind-ray] memory: one worker needs about {est.total / GiB:.1f} GiB by the estimate ({shape})",
              flush=True)
        return
    if est.total <= have[0]:
        print(f"[minimind-ray] memory: one worker needs about {est.total / GiB:.1f} GiB by the estimate ({shape}); "
              f"it has {have[0] / GiB:.1f} GiB ({have[1]})", flush=True)
        return
    print(f"[minimind-ray] WARNING: memory: one worker needs about {est.describe()} by the estimate ({shape}), "
          f"more than the {have[0] / GiB:.1f} GiB it has ({have[1]}); it will likely run out of memory: "
          f"{advice(cfg, cfg.cluster.num_workers, have[0], device)}", flush=True)


# --------------------------------------------------------------------------- after fit()


def _budget(cfg: RunConfig, seen: MemorySeen, device: str) -> Tuple[float, bool]:
    """(bytes one worker could have used, whether the failing process was a training worker)."""
    est_now = estimate(cfg, device_type=device).total
    if seen.where == "gpu":
        return (0.95 * seen.total if seen.total else est_now / 2), True
    if seen.source == "memory monitor":
        limit = seen.limit or (0.95 * seen.total if seen.total else None)
        training = "RayTrainWorker" in seen.victim or not seen.victim
        if training and seen.process:  # the node hit its limit with the worker at this size
            excess = max(0.0, (seen.used or 0.0) - (limit or seen.used or 0.0))
            return max(seen.process - excess, 0.1 * seen.process), True
        if limit:
            k = cfg.cluster.num_workers
            return limit / max(1, k), training
        return est_now / 2, training
    have = host_memory_per_worker(cfg)
    return (have[0] if have else est_now / 2), True


def explain(cfg: RunConfig, error: BaseException) -> Optional[OutOfMemory]:
    """The one-line :class:`OutOfMemory` for what ``fit()`` raised, or None if it is no out-of-memory error."""
    found = find_oom(error)
    if found is None or found[0].injected:
        return None
    seen = found[0]
    rank = next((e.rank for e in within(error) if isinstance(e, OutOfMemoryStop)), None)
    device = "cuda" if seen.where == "gpu" else "cpu"
    est = estimate(cfg, device_type=device)
    budget, training = _budget(cfg, seen, device)
    where = "on the GPU" if seen.where == "gpu" else "on the host"
    who = f", rank {rank}" if rank is not None else ""
    shape = (f"a micro-batch of {est.sequences} x {est.seq_len} tokens ({cfg.model.preset}, {est.precision}) "
             f"needs about {est.total / GiB:.1f} GiB by the estimate")
    fix = advice(cfg, cfg.cluster.num_workers, budget, device)
    if not training:  # Ray killed a process of its own: the node was full before the workers filled it
        fix = f"free memory on the node, or {fix}"
    return OutOfMemory(
        f"out of memory {where}{who}: {seen.describe()}; {shape}; {fix}. Not retried (the same micro-batch "
        f"would run out again); the same command with the new setting continues this run from its last checkpoint")

