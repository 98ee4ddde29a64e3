"""The driver's view of a run: rank 0 pushes interval metrics to a tiny actor, the driver prints them.

Progress does not go through ``ray.train.report``: that call is a barrier across workers polled
by the controller (up to RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default), so the worker reports
to Ray Train only when it has a checkpoint to hand over.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any, Dict, Tuple

from minimind_ray.fsio import redact


def make_progress_sink():
    """A tiny actor that rank 0 pushes metrics to (fire-and-forget) and the driver drains."""
    import ray

    @ray.remote(num_cpus=0)
    class ProgressSink:
        def __init__(self):
            self.items = []

        def push(self, m):
            self.items.append(m)
            del self.items[:-1000]

        def drain(self):
            out, self.items = self.items, []
            return out

    return ProgressSink.remote()


def eta_seconds(m: Dict[str, Any]) -> float:
    """Seconds left, from the workers' own step time (``step_time_s``, measured on the worker over the
    interval): the driver receives progress in bursts, so its arrival times say nothing about the rate."""
    step, total = int(m["step"]), int(m.get("total_steps", 0) or 0)
    step_time = m.get("step_time_s")
    if not step_time or not math.isfinite(step_time) or total <= 0:
        return float("nan")
    return max(total - step, 0) * float(step_time)


# how the console writes a headline metric (the stage record's ``headline``), where its MLflow name is long
SHORT = {"reward_exact_answer": "exact", "reward_margin": "margin", "reward_accuracy": "acc"}


class ProgressPrinter(threading.Thread):
    """Driver-side view of training: a tqdm bar on a terminal, plain lines in a job log."""

    def __init__(self, sink, name: str, headline: Tuple[str, ...] = (), rl: bool = False):
        super().__init__(daemon=True)
        self.sink, self.name, self.stop = sink, name, threading.Event()
        self.headline, self.rl = tuple(headline), rl
        self.tty = sys.stderr.isatty()
        self.bar = None

    def run(self):
        while not self.stop.wait(0.5):
            self.drain()

    def drain(self):
        import ray

        try:
            items = ray.get(self.sink.drain.remote(), timeout=10)
        except Exception:
            return
        for m in items:
            self.show(m)

    def line(self, m: Dict[str, Any]) -> str:
        """One progress line (what a job log shows)."""
        step, total = int(m["step"]), int(m.get("total_steps", 0) or 0)
        eta = eta_seconds(m)
        eta_s = "?" if math.isnan(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
        ck = " [checkpoint]" if m.get("checkpoint") else ""
        return f"[{self.name}] step {step}/{total} {self.describe(m, self.headline, self.rl)} ETA {eta_s}{ck}"

    @staticmethod
    def describe(m: Dict[str, Any], headline: Tuple[str, ...] = (), rl: bool = False) -> str:
        """The interval's figures: the loss (not for an RL stage, whose loss is near zero by construction), then the
        stage's headline metrics from its record (DPO's reward margin and accuracy, distillation's KL, the RL stages'
        reward...), the throughput and the held-out loss when there is one."""
        parts = [f"ep {m.get('epoch', 0)}"]
        if not rl:
            parts.append(f"loss {m.get('loss', float('nan')):.4f}")
        parts += [f"{SHORT.get(k, k)} {m[k]:.4f}" for k in headline if k in m]
        parts.append(f"tok/s {m.get('tokens_per_s', 0):,.0f}")
        if "eval_loss" in m:
            parts.append(f"eval {m['eval_loss']:.4f}")
        return " ".join(parts)

    def show(self, m: Dict[str, Any]):
        if "_error" in m:
            print(redact(f"[{self.name}] worker failure: {m['_error']} (restarting from the latest checkpoint if "
                         f"cluster.max_failures allows)"), flush=True)
            return
        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=int(m.get("total_steps", 0) or 0), desc=self.name, unit="step")
            self.bar.n = int(m["step"])
            self.bar.set_postfix_str(self.describe(m))
            self.bar.refresh()
        else:
            print(self.line(m), flush=True)

    def close(self):
        self.stop.set()
        self.join(timeout=5)
        self.drain()
        if self.bar is not None:
            self.bar.close()

