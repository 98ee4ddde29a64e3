"""Rank 0's non-blocking, exactly-once, failure-isolated MLflow metric logger."""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

from minimind_ray.tracking.runs import PERMANENT_ERRORS, MAX_METRICS_PER_BATCH, mlflow_client, error_code, http_env, short_message

log = logging.getLogger(__name__)


class RunLogger:
    """Rank 0's handle on an existing MLflow run: non-blocking, exact, failure-isolated.

    * ``log_metrics`` only appends to an in-memory queue (microseconds); one daemon thread
      does all MLflow I/O, so a slow or down server costs training nothing.
    * Exactly once per (key, step): the thread first reads the newest step of every metric the
      run holds, and never sends a point at or below it. A restarted worker, which replays
      the steps after its checkpoint, therefore adds nothing twice. After a failed send (the
      request may have landed anyway) it reads again before resending.
    * Bounded: beyond ``max_pending`` queued points the oldest are dropped and counted;
      sends are retried with backoff (0.5 s doubling to 5 s) as long as the process lives.
    * ``close`` says what was and was not logged; nothing here raises into the training loop.

    The constructor sets ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`` and
    ``MLFLOW_HTTP_REQUEST_TIMEOUT=ceil(timeout_s)`` for the whole process (a training worker
    belongs to the run): one request then costs at most ``timeout_s``.
    """

    def __init__(self, uri: str, run_id: str, timeout_s: float = 10.0, *,
                 system_metrics: bool = False, max_pending: int = 100_000, wait_for_server: bool = True):
        """Start the sender thread and, with ``wait_for_server``, wait up to ``timeout_s`` for its first read of
        the run.

        Waiting lets the common case (server up) filter replays before they are queued; if
        the read fails or is slow, training goes on and the thread keeps trying, sending
        nothing until it knows what the run holds. Without the wait the same replays are
        filtered when they are sent: the counts and the run's record come out the same.
        ``system_metrics`` starts MLflow's CPU/GPU/memory/disk/network sampler (``system/*``
        metrics of this node, every 10 s).
        """
        os.environ.update(http_env(timeout_s))
        self.uri, self.run_id, self.timeout_s = uri, run_id, timeout_s
        self._system_metrics = system_metrics
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._pending: collections.deque = collections.deque()  # (key, value, timestamp ms, step)
        self._last_step: Dict[str, int] = {}  # newest step accepted per key: logged or queued
        self._server_step: Optional[Dict[str, int]] = None  # newest step the run holds; None = unknown
        self._inflight = 0
        self._logged = self._dropped = self._skipped = 0
        self._errors: List[str] = []  # the first few, for the summary
        self._error_count = 0
        self._failing = False
        self._kick = False
        self._closing = False
        self._closed = False
        self._first_read = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-run-logger", daemon=True)
        self._thread.start()
        if wait_for_server:
            self._first_read.wait(timeout_s)

    # ---- training side: cheap, never raise

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step``; keys already logged or queued at ``step`` or later
        are skipped (counted as ``metrics_skipped``)."""
        ts = int(time.time() * 1000)
        with self._cv:
            if self._closed:
                return
            for key, value in metrics.items():
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    self._note_error(f"metric {key!r} at step {step} is not a number: {value!r}", retrying=False)
                    continue
                if step <= self._last_step.get(key, -1):
                    self._skipped += 1
                    continue
                self._last_step[key] = step
                self._pending.append((key, value, ts, int(step)))
            self._trim()
            self._cv.notify_all()

    def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until everything queued is sent; cuts a retry backoff short."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._kick = True
            self._cv.notify_all()
            while self._pending or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return
                self._cv.wait(min(left, 0.5))

    def close(self, timeout_s: float = 30.0) -> dict:
        """Flush for up to ``timeout_s``, stop the thread, and summarise.

        Returns ``{'metrics_logged', 'metrics_dropped', 'metrics_skipped', 'errors', 'error_count'}``
        (``errors``: the first five messages): dropped counts every point that is not on the server
        (queue overflow, rejected by it, or still unsent now); skipped counts replayed steps the run
        already had.
        A batch still in flight at the deadline is counted as dropped although it may land.
        """
        try:
            start = time.monotonic()
            self.flush(timeout_s)
            with self._cv:
                if self._closed:
                    return self._summary()
                self._closed = self._closing = True
                self._cv.notify_all()
            self._thread.join(max(0.1, timeout_s - (time.monotonic() - start)))
            with self._cv:
                self._dropped += len(self._pending) + self._inflight
                self._pending.clear()
                self._inflight = 0
                summary = self._summary()
            if summary["metrics_dropped"]:
                log.warning("MLflow run %s: not logged: %s", self.run_id, summary)
            return summary
        except Exception as e:  # noqa: BLE001 - the summary must never cost the run
            return {"metrics_logged": self._logged, "metrics_dropped": -1, "metrics_skipped": self._skipped,
                    "errors": self._errors + [short_message(e)],
                    "error_count": self._error_count + 1}

    # ---- sender thread

    def _summary(self) -> dict:
        return {"metrics_logged": self._logged, "metrics_dropped": self._dropped,
                "metrics_skipped": self._skipped, "errors": list(self._errors), "error_count": self._error_count}

    def _trim(self) -> None:
        """Drop the oldest queued points beyond the bound (caller holds the lock)."""
        while len(self._pending) > self._max_pending:
            self._pending.popleft()
            self._dropped += 1

    def _note_error(self, msg: str, retrying: bool = True) -> None:
        """Remember the first errors for the summary (caller holds the lock).

        A down server fails every retry: only the first failure of such a streak is logged.
        """
        self._error_count += 1
        if len(self._errors) < 5:
            self._errors.append(msg)
        if not retrying:
            log.warning("MLflow run %s: %s (not logged)", self.run_id, msg)
        elif not self._failing:
            log.warning("MLflow run %s: %s (training continues; retrying in the background)", self.run_id, msg)
            self._failing = True

    def _run(self) -> None:
        client, monitor, failures = None, None, 0
        try:
            while True:
                delay = min(0.5 * 2 ** (failures - 1), 5.0) if failures else 0.0
                until = time.monotonic() + delay
                with self._cv:
                    while not self._closing:
                        work = self._server_step is None or self._pending
                        now = time.monotonic()
                        if work and (now >= until or self._kick):
                            break
                        self._cv.wait(until - now if work else None)
                    if self._closing:
                        return
                    self._kick = False
                try:
                    if client is None:
                        client = mlflow_client(self.uri)
                    if self._server_step is None:
                        self._read_server_steps(client)
                        if self._system_metrics and monitor is None:
                            self._system_metrics = False  # one try: it needs psutil, and MLflow
                            monitor = self._start_system_metrics()  # stops it at the first error
                    self._send_metrics(client)
                    failures = 0
                    if self._failing:
                        log.warning("MLflow run %s: tracking server reachable again", self.run_id)
                        self._failing = False
                except Exception as e:  # noqa: BLE001 - any failure: back off and retry
                    failures += 1
                    with self._cv:
                        self._note_error(short_message(e))
                finally:
                    self._first_read.set()
                    with self._cv:
                        self._cv.notify_all()
        finally:
            if monitor is not None:
                monitor.finish()

    def _read_server_steps(self, client) -> None:
        """Newest step per metric key in the run, from one ``get_run``.

        ``run.data`` holds each key's latest point, which MLflow defines by (step, timestamp,
        value), i.e. the largest step; MLflow's own system-metrics resume reads it the same
        way, instead of fetching whole histories.
        """
        from mlflow.exceptions import MlflowException

        try:
            metrics = client.get_run(self.run_id).data._metric_objs
            steps = {m.key: m.step for m in metrics}
        except MlflowException as e:
            if error_code(e) not in PERMANENT_ERRORS:
                raise
            # The run is gone or unreadable: every send will be rejected and counted as dropped.
            with self._cv:
                self._note_error(short_message(e), retrying=False)
            steps = {}
        with self._cv:
            self._server_step = steps
            for key, step in steps.items():
                if step > self._last_step.get(key, -1):
                    self._last_step[key] = step

    def _send_metrics(self, client) -> None:
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        while True:
            with self._cv:
                n = min(len(self._pending), MAX_METRICS_PER_BATCH)
                batch = [self._pending.popleft() for _ in range(n)]
                self._inflight = n
            if not batch:
                return
            known = self._server_step
            send = [m for m in batch if m[3] > known.get(m[0], -1)]
            try:
                if send:
                    client.log_batch(self.run_id, metrics=[Metric(*m) for m in send], synchronous=True)
            except MlflowException as e:
                if error_code(e) in PERMANENT_ERRORS:
                    with self._cv:
                        self._dropped += len(send)
                        self._skipped += len(batch) - len(send)
                        self._inflight = 0
                        self._note_error(short_message(e), retrying=False)
                    continue
                self._requeue(batch)
                raise
            except Exception:
                self._requeue(batch)
                raise
            with self._cv:
                for key, _, _, step in send:
                    known[key] = max(step, known.get(key, -1))
                self._logged += len(send)
                self._skipped += len(batch) - len(send)
                self._inflight = 0
                self._cv.notify_all()

    def _requeue(self, batch: List[Tuple]) -> None:
        """Put a failed batch back in front, and forget what the server holds: the request
        may have landed, so the next attempt reads the run again and sends only what is new."""
        with self._cv:
            self._pending.extendleft(reversed(batch))
            self._inflight = 0
            self._server_step = None
            self._trim()

    def _start_system_metrics(self):
        """MLflow's sampler, resumed after the run's newest ``system/*`` step so a restart
        does not log steps twice; None (and an error in the summary) if it cannot start.
        MLflow stops it for good at its first failed request."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(self.run_id, resume_logging=True, tracking_uri=self.uri)
            monitor.start()
            return monitor
        except Exception as e:  # noqa: BLE001 - optional: never worth a retry loop
            with self._cv:
                self._note_error(f"system metrics: {short_message(e)}", retrying=False)
            return None
