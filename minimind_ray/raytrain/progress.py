"""The driver's view of a run: rank 0 pushes interval metrics to a tiny actor (one per driver process, shared by
the runs it trains, each under its own token), the driver prints them.

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


_SINK: Dict[str, Any] = {}  # this process's ProgressSink, by the Ray connection (job id) it was made in


def progress_sink(run: str):
    """This driver process's ProgressSink, opened for ``run`` (a token unique to one training run): rank 0 pushes the
    run's interval metrics to it (fire-and-forget) and the driver drains them. One actor serves every run the process
    trains (a pipeline's stages, a test session's runs): each new actor is a Ray worker process, ~2.5 CPU s to start,
    a tenth of a tiny run's cost. Made again when the Ray connection changed or the actor died."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    sink = _SINK.get(job)
    if sink is not None:
        try:
            ray.get(sink.open.remote(run), timeout=30)
            return sink
        except Exception:  # the actor died (its node was lost): a new one
            pass
    sink = ray.remote(num_cpus=0)(ProgressSink).remote()
    ray.get(sink.open.remote(run), timeout=60)
    _SINK.clear()
    _SINK[job] = sink
    return sink


class ProgressSink:
    """The actor (``progress_sink``): the interval metrics of the open runs, up to 1000 each. A push for a run that is
    not open is dropped (a late one of a run that ended: it must not show under the next run's name)."""

    def __init__(self):
        self.items: Dict[str, list] = {}
        self.stops: set = set()  # the runs whose operator asked them to stop (raytrain/interrupt.py)

    def open(self, run: str) -> None:
        self.items[run] = []

    def close(self, run: str) -> None:
        self.items.pop(run, None)
        self.stops.discard(run)

    def request_stop(self, run: str) -> None:
        if run in self.items:
            self.stops.add(run)

    def stop_requested(self, run: str) -> bool:
        """Asked by rank 0 where it asks Ray for a drain notice (raytrain/preemption.py)."""
        return run in self.stops

    def push(self, run: str, m: Dict[str, Any]) -> None:
        if run in self.items:
            self.items[run].append(m)
            del self.items[run][:-1000]

    def drain(self, run: str) -> list:
        out = self.items.get(run) or []
        if out:
            self.items[run] = []
        return out


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

    def __init__(self, sink, run: str, name: str, headline: Tuple[str, ...] = (), rl: bool = False,
                 operator_stop=None):
        super().__init__(daemon=True)
        self.sink, self.run_token, self.name, self.stop = sink, run, name, threading.Event()
        self.operator_stop, self.stop_sent = operator_stop, False  # raytrain/interrupt.py's StopRequest
        self.headline, self.rl = tuple(headline), rl
        self.tty = sys.stderr.isatty()
        self.bar = None

    def run(self):
        while not self.stop.wait(0.5):
            if self.operator_stop is not None and self.operator_stop.asked and not self.stop_sent:
                try:  # the workers read it at the next step they check (raytrain/preemption.py)
                    self.sink.request_stop.remote(self.run_token)
                    self.stop_sent = True
                except Exception:
                    pass
            self.drain()

    def drain(self):
        import ray

        try:
            items = ray.get(self.sink.drain.remote(self.run_token), timeout=10)
        except Exception:
            return
        for m in items:
            self.show(m)

    def line(self, m: Dict[str, Any]) -> str:
        """One progress line (what a job log shows)."""
        step, total = int(m["step"]), int(m.get("total_steps", 0) or 0)
        eta = eta_seconds(m)
        eta_s = "?" if math.isnan(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
        # the step's checkpoint is saved and on its way to storage; once there, the run can resume from it (a stop
        # waits for every checkpoint announced: raytrain/interrupt.py)
        ck = " [checkpoint uploading]" if m.get("checkpoint") else ""
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
        try:
            self.sink.close.remote(self.run_token)  # its late pushes, if any, are dropped
        except Exception:
            pass
        if self.bar is not None:
            self.bar.close()

