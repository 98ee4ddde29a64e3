"""MLflow tracking: one MLflow run per training run, logged by rank 0 only.

Ray Train V2 has no MLflow callback, and the obvious integrations (one ``mlflow.start_run``
per worker, or per worker-group start) give one run per worker or per restart. Here:

* the **driver** creates the run (:func:`start_run`), or reopens it when the same Ray Train
  run (same name + storage path) is resumed, logs params and the config once, and ends it
  (:func:`finish_run`); after training it logs the model files and registers a model version
  (:func:`log_final_artifacts`);
* **rank 0** reopens the run by id (stored in every checkpoint) through :class:`RunLogger`,
  which never creates runs, never logs a step that the run already holds (a restarted worker
  replays the steps after its checkpoint), and never blocks or kills training when the
  tracking server is slow or down: all MLflow I/O happens on one background thread that
  batches, retries with backoff and, at the end, reports what could not be logged.

``docs/tracking.md`` describes the behaviour for users; this module says why it is built so.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple
from urllib.parse import unquote

from minimind_ray.config import RunConfig, TrackingConfig, flatten, to_dict, to_yaml

log = logging.getLogger(__name__)

# Tags that identify a training run: the driver finds a run to resume by these two.
TAG_RUN_NAME = "minimind.run_name"
TAG_STORAGE = "minimind.storage"
TAG_RESUMES = "minimind.resumes"
ERROR_TAG = "error"
ERROR_TAG_MAX = 5000

# MLflow's own limits (mlflow.utils.validation): log_batch takes at most 1000 metrics or 100
# params/tags per call, and a param value at most 6000 characters.
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LEN = 6000

# Error codes after which resending the same request cannot succeed (bad key or value, run
# deleted, no permission): the batch is dropped and counted instead of blocking the queue.
_PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
                     "PERMISSION_DENIED", "UNAUTHENTICATED"}

_HTTP_ENV = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def _http_env(timeout_s: float) -> Dict[str, str]:
    """Environment that bounds every MLflow HTTP request to one attempt of ``timeout_s``.

    MLflow 3.17 reads these on every request. Its defaults (7 retries with exponential
    backoff, 120 s timeout) make one call against a down server take minutes, and its retries
    resend POSTs after a read timeout, which could log a metric batch twice. We retry
    ourselves instead, checking what the server already holds before each resend.
    """
    return {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout_s)))}


@contextlib.contextmanager
def _short_http(timeout_s: float) -> Iterator[None]:
    """Apply :func:`_http_env` for one driver-side call, then restore the caller's values
    (the driver may be a user's process with its own MLflow settings)."""
    saved = {k: os.environ.get(k) for k in _HTTP_ENV}
    os.environ.update(_http_env(timeout_s))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _error_code(e: BaseException) -> str:
    return str(getattr(e, "error_code", ""))


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


# --------------------------------------------------------------------------- where runs live


def resolve_tracking_uri(cfg: TrackingConfig) -> str:
    """``cfg.uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<abs cwd>/mlflow.db``.

    The last is MLflow 3.17's own default (``mlflow.get_tracking_uri()`` with nothing set,
    unless ``./mlruns`` already holds a file store), made absolute here because Train V2
    workers run with their cwd in Ray's session directory: a relative store would give every
    worker start a fresh, empty database under ``/tmp/ray/session_*``. Relative sqlite paths
    and bare local paths given by the user are made absolute for the same reason. The driver
    resolves once and passes the result to the workers.
    """
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        return f"sqlite:///{os.path.abspath('mlflow.db')}"
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            return f"sqlite:///{os.path.abspath(unquote(path))}"
        return uri
    if ":" not in uri and uri != "databricks":
        return Path(uri).absolute().as_uri()  # a bare path: MLflow's file store
    return uri


def artifact_location_for(uri: str) -> Optional[str]:
    """Artifact root for a new experiment: ``file://<db dir>/mlartifacts`` for a sqlite store.

    Without it an experiment created through a sqlite store gets a location relative to the
    cwd of whoever first touched it, which on a worker is Ray's session directory (deleted
    with the session). ``None`` (the store's default) for everything else: an http(s) server
    proxies artifacts to its own ``--artifacts-destination``, and a file store keeps them in
    its absolute ``mlruns`` tree.
    """
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///"):])
    if not path or path == ":memory:":
        return None
    return (Path(path).absolute().parent / "mlartifacts").as_uri()


# --------------------------------------------------------------------------- driver side


def _git_tags() -> Dict[str, str]:
    """Commit (and whether the tree was dirty) of the code being run, if it is a git checkout."""
    here = str(Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        if commit.returncode != 0:
            return {}
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return {"mlflow.source.git.commit": commit.stdout.strip(),
                "minimind.git_dirty": str(bool(dirty.stdout.strip())).lower()}
    except (OSError, subprocess.SubprocessError):
        return {}


def _ray_tags() -> Dict[str, str]:
    """Ray job ids of this driver: the core job id, and the submission id under ``ray job submit``.

    The submission id is only in the job config the job supervisor hands the entrypoint
    (``RAY_JOB_CONFIG_JSON_ENV_VAR``); Ray is not imported here if the caller has not.
    """
    tags = {}
    job_id = os.environ.get("RAY_JOB_ID")
    ray = sys.modules.get("ray")
    if not job_id and ray is not None and ray.is_initialized():
        job_id = ray.get_runtime_context().get_job_id()
    if job_id:
        tags["ray.job_id"] = job_id
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {})
        if meta.get("job_submission_id"):
            tags["ray.job_submission_id"] = meta["job_submission_id"]
    except (ValueError, AttributeError):
        pass
    return tags


def _versions() -> Dict[str, str]:
    out = {}
    for pkg in ("torch", "ray", "mlflow"):
        try:
            out[f"{pkg}.version"] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _experiment_id(client, name: str, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location_for(uri))
        except MlflowException as e:  # another driver created it meanwhile
            if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _find_run(client, experiment_id: str, run_name: str, storage_dir: str):
    """The oldest active run of this training run, or None.

    Filtering on the name in the query keeps the search small; the storage path is compared
    here, because a path may hold characters the filter grammar cannot quote.
    """
    if "'" in run_name:
        raise ValueError(f"run name {run_name!r}: a quote cannot be matched in an MLflow search")
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_NAME}` = '{run_name}'",
                              order_by=["attributes.start_time ASC"], max_results=1000)
    return next((r for r in runs if r.data.tags.get(TAG_STORAGE) == storage_dir), None)


def start_run(cfg: RunConfig, run_name: str, storage_dir: str, tags: dict) -> str:
    """Create the MLflow run of a training run, or reopen it on a driver-level resume.

    A Ray Train V2 run resumes when it is started again with the same name and storage path,
    so the same pair identifies its MLflow run (tags ``minimind.run_name``/``minimind.storage``).
    A reopened run goes back to RUNNING and keeps its params: MLflow params are immutable, so
    a resume never re-logs them; if the config changed, the new one is stored beside the old
    as ``config/config.resume-<n>.yaml`` and the changed keys are logged as a warning.

    ``tags`` (world size, device type, ...) are (re)set either way, since a resume may run on
    another cluster. Raises if the store cannot be reached (one request of
    ``cfg.tracking.timeout_s``): the caller decides whether to train untracked.
    """
    from mlflow.entities import Param

    uri = resolve_tracking_uri(cfg.tracking)
    experiment = cfg.tracking.experiment or f"minimind-{cfg.train.stage}"
    all_tags = {**_versions(), **_git_tags(), **_ray_tags(), **{k: v for k, v in tags.items() if v is not None}}
    all_tags = {k: str(v) for k, v in all_tags.items()}
    params = {k: str(v)[:_MAX_PARAM_LEN] for k, v in flatten(to_dict(cfg)).items()}
    with _short_http(cfg.tracking.timeout_s):
        client = _client(uri)
        exp_id = _experiment_id(client, experiment, uri)
        run = _find_run(client, exp_id, run_name, storage_dir)
        if run is not None:
            run_id = run.info.run_id
            resumes = int(run.data.tags.get(TAG_RESUMES, "0")) + 1
            client.update_run(run_id, status="RUNNING")
            all_tags[TAG_RESUMES] = str(resumes)
            changed = sorted(k for k, v in params.items() if run.data.params.get(k, v) != v)
            if changed:
                log.warning("MLflow run %s resumed with a changed config (params keep their first values; "
                            "the new config is config/config.resume-%d.yaml): %s", run_id, resumes,
                            ", ".join(changed))
                client.log_text(run_id, to_yaml(cfg), f"config/config.resume-{resumes}.yaml")
            _log_tags(client, run_id, all_tags)
            log.info("reopened MLflow run %s (%s) in experiment %r", run_id, run_name, experiment)
            return run_id

        all_tags.update({TAG_RUN_NAME: run_name, TAG_STORAGE: storage_dir})
        run = client.create_run(exp_id, run_name=run_name)
        run_id = run.info.run_id
        _log_tags(client, run_id, all_tags)
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=items[i:i + _MAX_PARAMS_PER_BATCH])
        client.log_text(run_id, to_yaml(cfg), "config/config.yaml")
        log.info("created MLflow run %s (%s) in experiment %r at %s", run_id, run_name, experiment, uri)
        return run_id


def _log_tags(client, run_id: str, tags: Dict[str, str]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[i:i + _MAX_PARAMS_PER_BATCH])


def _truncate_error(error: str) -> str:
    """Keep the head (what failed) and the tail (the innermost exception) of a long error."""
    if len(error) <= ERROR_TAG_MAX:
        return error
    marker = "\n...[truncated]...\n"
    head = (ERROR_TAG_MAX - len(marker)) // 2
    return error[:head] + marker + error[-(ERROR_TAG_MAX - len(marker) - head):]


def finish_run(uri: str, run_id: str, status: str, error: Optional[str] = None,
               timeout_s: float = 10.0) -> None:
    """End the run as FINISHED, FAILED or KILLED; a FAILED run gets the error as tag ``error``.

    Never raises: it is called while handling a training failure, whose exception must not
    be replaced by a tracking one. A failure here is logged.
    """
    try:
        with _short_http(timeout_s):
            client = _client(uri)
            if error and status == "FAILED":
                client.set_tag(run_id, ERROR_TAG, _truncate_error(error))
            client.set_terminated(run_id, status=status)
    except Exception as e:  # noqa: BLE001 - see docstring
        log.error("could not mark MLflow run %s %s: %s", run_id, status, _short(e))


# --------------------------------------------------------------------------- rank 0


class RunLogger:
    """Rank 0's handle on an existing MLflow run: non-blocking, exact, failure-isolated.

    * ``log_metrics``/``log_artifact`` only append to in-memory queues (microseconds); one
      daemon thread does all MLflow I/O, so a slow or down server costs training nothing.
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
                 system_metrics: bool = False, max_pending: int = 100_000):
        """Start the sender thread and wait up to ``timeout_s`` for its first read of the run.

        Waiting lets the common case (server up) filter replays before they are queued; if
        the read fails or is slow, training goes on and the thread keeps trying, sending
        nothing until it knows what the run holds. ``system_metrics`` starts MLflow's
        CPU/GPU/memory/disk/network sampler (``system/*`` metrics of this node, every 10 s).
        """
        os.environ.update(_http_env(timeout_s))
        self.uri, self.run_id, self.timeout_s = uri, run_id, timeout_s
        self._system_metrics = system_metrics
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._pending: collections.deque = collections.deque()  # (key, value, timestamp ms, step)
        self._artifacts: collections.deque = collections.deque()  # (local path, artifact path)
        self._last_step: Dict[str, int] = {}  # newest step accepted per key: logged or queued
        self._server_step: Optional[Dict[str, int]] = None  # newest step the run holds; None = unknown
        self._inflight = 0
        self._logged = self._dropped = self._skipped = 0
        self._artifacts_failed: List[str] = []
        self._errors: List[str] = []  # the first few, for the summary
        self._error_count = 0
        self._failing = False
        self._kick = False
        self._closing = False
        self._closed = False
        self._first_read = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlflow-run-logger", daemon=True)
        self._thread.start()
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

    def log_artifact(self, local_path: str, artifact_path: Optional[str] = None) -> None:
        """Queue a file or directory for upload. It is read when sent: keep it until ``close``."""
        with self._cv:
            if self._closed:
                return
            self._artifacts.append((str(local_path), artifact_path))
            self._cv.notify_all()

    def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until everything queued is sent; cuts a retry backoff short."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._kick = True
            self._cv.notify_all()
            while self._pending or self._artifacts or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return
                self._cv.wait(min(left, 0.5))

    def close(self, timeout_s: float = 30.0) -> dict:
        """Flush for up to ``timeout_s``, stop the thread, and summarise.

        Returns ``{'metrics_logged', 'metrics_dropped', 'metrics_skipped', 'artifacts_failed',
        'errors', 'error_count'}`` (``errors``: the first five messages): dropped counts every point that is not on the server (queue overflow,
        rejected by it, or still unsent now); skipped counts replayed steps the run already had.
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
                self._artifacts_failed += [p for p, _ in self._artifacts]
                self._artifacts.clear()
                summary = self._summary()
            if summary["metrics_dropped"] or summary["artifacts_failed"]:
                log.warning("MLflow run %s: not logged: %s", self.run_id, summary)
            return summary
        except Exception as e:  # noqa: BLE001 - the summary must never cost the run
            return {"metrics_logged": self._logged, "metrics_dropped": -1, "metrics_skipped": self._skipped,
                    "artifacts_failed": [], "errors": self._errors + [_short(e)],
                    "error_count": self._error_count + 1}

    # ---- sender thread

    def _summary(self) -> dict:
        return {"metrics_logged": self._logged, "metrics_dropped": self._dropped,
                "metrics_skipped": self._skipped, "artifacts_failed": list(self._artifacts_failed),
                "errors": list(self._errors), "error_count": self._error_count}

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
                        work = self._server_step is None or self._pending or self._artifacts
                        now = time.monotonic()
                        if work and (now >= until or self._kick):
                            break
                        self._cv.wait(until - now if work else None)
                    if self._closing:
                        return
                    self._kick = False
                try:
                    if client is None:
                        client = _client(self.uri)
                    if self._server_step is None:
                        self._read_server_steps(client)
                        if self._system_metrics and monitor is None:
                            self._system_metrics = False  # one try: it needs psutil, and MLflow
                            monitor = self._start_system_metrics()  # stops it at the first error
                    self._send_metrics(client)
                    self._send_artifacts(client)
                    failures = 0
                    if self._failing:
                        log.warning("MLflow run %s: tracking server reachable again", self.run_id)
                        self._failing = False
                except Exception as e:  # noqa: BLE001 - any failure: back off and retry
                    failures += 1
                    with self._cv:
                        self._note_error(_short(e))
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
            if _error_code(e) not in _PERMANENT_ERRORS:
                raise
            # The run is gone or unreadable: every send will be rejected and counted as dropped.
            with self._cv:
                self._note_error(_short(e), retrying=False)
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
                n = min(len(self._pending), _MAX_METRICS_PER_BATCH)
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
                if _error_code(e) in _PERMANENT_ERRORS:
                    with self._cv:
                        self._dropped += len(send)
                        self._skipped += len(batch) - len(send)
                        self._inflight = 0
                        self._note_error(_short(e), retrying=False)
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

    def _send_artifacts(self, client) -> None:
        while True:
            with self._cv:
                if not self._artifacts:
                    return
                local, artifact_path = self._artifacts[0]
            if not os.path.exists(local):
                with self._cv:
                    self._artifacts.popleft()
                    self._artifacts_failed.append(local)
                    self._note_error(f"artifact {local}: file no longer exists", retrying=False)
                continue
            if os.path.isdir(local):
                client.log_artifacts(self.run_id, local, artifact_path)
            else:
                client.log_artifact(self.run_id, local, artifact_path)
            with self._cv:
                self._artifacts.popleft()
                self._cv.notify_all()

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
                self._note_error(f"system metrics: {_short(e)}", retrying=False)
            return None


# --------------------------------------------------------------------------- after training


def plot_loss_curve(history: Dict[str, List[Tuple[int, float]]], out_png: str) -> str:
    """Draw each metric's (step, value) series on one log-scale plot; returns ``out_png``.

    Uses matplotlib's object API with the Agg canvas, not pyplot: no display, no global
    figure state, safe off the main thread.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for key, points in history.items():
        if points:
            steps, values = zip(*sorted(points))
            ax.plot(steps, values, label=key, marker="." if len(points) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if all(v > 0 for pts in history.values() for _, v in pts) and any(history.values()):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


def log_final_artifacts(uri: str, run_id: str, *, pth_path: Optional[str], safetensors_path: Optional[str],
                        tokenizer_dir: Optional[str], manifest_path: Optional[str],
                        registered_model: Optional[str], extra: Optional[Dict[str, str]] = None,
                        timeout_s: float = 60.0) -> dict:
    """Driver side, after training: model files, tokenizer, data manifest and loss curve into
    the run, then a registered model version pointing at the run's ``model/`` directory.

    Layout: ``model/`` (MiniMind ``.pth`` + safetensors), ``tokenizer/``, ``data/`` (manifest),
    ``plots/loss.png`` (from the run's ``loss`` and ``eval_loss`` histories). Each step is
    tried on its own; failures are collected in ``errors``, never raised, so a down server
    never turns a finished training into a failed one.

    The version's source is the run's artifact URI + ``/model``: MLflow 3.17 accepts a plain
    artifact directory (no MLmodel file) when ``run_id`` is given and the source lies inside
    that run's artifact root. Calling it again for the same run reuses the existing version.
    ``extra`` maps more local files to artifact directories (LoRA weights, the checkpoint index).
    No version is registered when no model file was given.
    Returns ``{'model_version': str | None, 'errors': [...]}``.
    """
    errors: List[str] = []

    def attempt(what: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - see docstring
            errors.append(f"{what}: {_short(e)}")
            log.error("MLflow run %s: %s failed: %s", run_id, what, _short(e))
            return None

    version = None
    with _short_http(timeout_s):
        client = attempt("connect", lambda: _client(uri))
        if client is None:
            return {"model_version": None, "errors": errors}
        files = [(pth_path, "model"), (safetensors_path, "model"), (manifest_path, "data")]
        for path, dest in files + list((extra or {}).items()):
            if path:
                attempt(f"upload {path}", lambda p=path, d=dest: client.log_artifact(run_id, p, d))
        if tokenizer_dir:
            attempt(f"upload {tokenizer_dir}", lambda: client.log_artifacts(run_id, tokenizer_dir, "tokenizer"))

        def plot():
            history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)]
                       for k in ("loss", "eval_loss")}
            history = {k: v for k, v in history.items() if v}
            if not history:
                log.warning("MLflow run %s has no loss history: no plots/loss.png", run_id)
                return
            with tempfile.TemporaryDirectory(prefix="mmr-plot-") as tmp:
                client.log_artifact(run_id, plot_loss_curve(history, os.path.join(tmp, "loss.png")), "plots")

        attempt("loss plot", plot)
        if registered_model and (pth_path or safetensors_path):
            version = attempt("register model", lambda: _register(client, registered_model, run_id))
    return {"model_version": version, "errors": errors}


def _register(client, name: str, run_id: str) -> str:
    from mlflow.exceptions import MlflowException

    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/model"
    try:
        client.create_registered_model(name, description="MiniMind-family GPT trained with minimind-ray")
    except MlflowException as e:
        if _error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if mv.source == source:
            return str(mv.version)
    return str(client.create_model_version(name, source=source, run_id=run_id).version)
