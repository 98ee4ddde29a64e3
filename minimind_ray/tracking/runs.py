"""MLflow runs: where they live, and their lifecycle on the driver.

Ray Train V2 has no MLflow callback, and the obvious integrations (one ``mlflow.start_run``
per worker, or per worker-group start) give one run per worker or per restart. Here the
**driver** creates the run (:func:`start_run`), or reopens it when the same Ray Train run
(same name + storage path) is resumed, logs params and the config once, and ends it
(:func:`finish_run`). Rank 0 then reopens the run by id (stored in every checkpoint) through
:class:`minimind_ray.tracking.logger.RunLogger`; after training the driver logs the model files
and registers a version (:mod:`minimind_ray.tracking.artifacts`).

``docs/tracking.md`` describes the behaviour for users; these modules say why it is built so.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import logging
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional
from urllib.parse import unquote

from minimind_ray.config_checks import flatten
from minimind_ray.tracking.config import TrackingConfig
from minimind_ray.tracking.datasets import log_prepared_data
from minimind_ray.fsio import redact, redact_obj, redact_text

log = logging.getLogger(__name__)

# Tags that identify a training run: the driver finds a run to resume by these two.
TAG_RUN_NAME = "minimind.run_name"
TAG_STORAGE = "minimind.storage"
TAG_RESUMES = "minimind.resumes"
ERROR_TAG = "error"
ERROR_TAG_MAX = 5000
# MLflow 3's UI opens an experiment without this tag in its GenAI view ("Evaluation runs"); this one says the
# experiment trains models, so a run page opens on its metrics
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"

# MLflow's own limits (mlflow.utils.validation): log_batch takes at most 1000 metrics or 100
# params/tags per call, and a param value at most 6000 characters.
MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LEN = 6000

# Error codes after which resending the same request cannot succeed (bad key or value, run
# deleted, no permission): the batch is dropped and counted instead of blocking the queue.
PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "BAD_REQUEST",
                     "PERMISSION_DENIED", "UNAUTHENTICATED"}

_HTTP_ENV = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def http_env(timeout_s: float) -> Dict[str, str]:
    """Environment that bounds every MLflow HTTP request to one attempt of ``timeout_s``.

    MLflow 3.17 reads these on every request. Its defaults (7 retries with exponential
    backoff, 120 s timeout) make one call against a down server take minutes, and its retries
    resend POSTs after a read timeout, which could log a metric batch twice. We retry
    ourselves instead, checking what the server already holds before each resend.
    """
    return {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout_s)))}


@contextlib.contextmanager
def short_http(timeout_s: float) -> Iterator[None]:
    """Apply :func:`http_env` for one driver-side call, then restore the caller's values
    (the driver may be a user's process with its own MLflow settings)."""
    saved = {k: os.environ.get(k) for k in _HTTP_ENV}
    os.environ.update(http_env(timeout_s))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mlflow_client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def error_code(e: BaseException) -> str:
    return str(getattr(e, "error_code", ""))


def short_message(e: BaseException) -> str:
    """One line for a log or a summary; URIs in it lose their credentials (MLflow puts its URL in errors). MLflow's
    artifacts on s3:// without boto3 (the s3 extra; raised here, or by a server that stores them there) name the
    extra to install."""
    if getattr(e, "name", None) == "boto3" or "No module named 'boto3'" in str(e):
        return ("MLflow's artifacts on s3:// need boto3, which is not installed: pip install 'minimind-ray[s3]' "
                "(where the MLflow client, or the server that stores them, runs)")
    return redact(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")[:500]


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


def experiment_id_of(client, name: str, uri: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location_for(uri),
                                            tags={EXPERIMENT_KIND: MODEL_TRAINING})
        except MlflowException as e:  # another driver created it meanwhile
            if error_code(e) != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if exp.tags.get(EXPERIMENT_KIND) is None:  # an experiment made before this tag (or by someone else)
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
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


def start_run(cfg, run_name: str, storage_dir: str, tags: dict, prepared_dir: Optional[str] = None) -> str:
    """Create the MLflow run of a training run (``cfg``: its RunConfig), or reopen it on a driver-level resume.

    A Ray Train V2 run resumes when it is started again with the same name and storage path,
    so the same pair identifies its MLflow run (tags ``minimind.run_name``/``minimind.storage``).
    A reopened run goes back to RUNNING and keeps its params: MLflow params are immutable, so
    a resume never re-logs them (only those missing, and config/config.yaml if missing: a driver killed right
    after creating the run left it findable without them); if the config changed, the new one is stored beside
    the old as ``config/config.resume-<n>.yaml`` and the changed keys are logged as a warning.

    ``tags`` (world size, device type, ...) are (re)set either way, since a resume may run on
    another cluster. ``prepared_dir`` (the prepared data the run reads) becomes the run's dataset input
    (tracking/datasets.py), logged once: a resume that reads the same data adds nothing, and a failure to log it
    is a warning, never the run's end. Raises if the store cannot be reached (one request of
    ``cfg.tracking.timeout_s``): the caller decides whether to train untracked.
    """
    uri = resolve_tracking_uri(cfg.tracking)
    experiment = cfg.tracking.experiment or f"minimind-{cfg.train.stage}"
    all_tags = {**_versions(), **_git_tags(), **_ray_tags(), **{k: v for k, v in tags.items() if v is not None}}
    all_tags = {k: str(v) for k, v in all_tags.items()}
    # what MLflow stores never holds a credential: params, the config artifact and the storage tag are redacted
    from omegaconf import OmegaConf

    params = {k: str(v)[:_MAX_PARAM_LEN] for k, v in redact_obj(flatten(dataclasses.asdict(cfg))).items()}
    config_yaml = redact(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # as config.to_yaml writes it
    storage_dir = redact(storage_dir)
    with short_http(cfg.tracking.timeout_s):
        client = mlflow_client(uri)
        exp_id = experiment_id_of(client, experiment, uri)
        run = _find_run(client, exp_id, run_name, storage_dir)
        if run is not None:
            run_id = run.info.run_id
            resumes = int(run.data.tags.get(TAG_RESUMES, "0")) + 1
            client.update_run(run_id, status="RUNNING")
            all_tags[TAG_RESUMES] = str(resumes)
            log_what_is_missing(client, run, params, config_yaml, "config/config.yaml")
            changed = sorted(k for k, v in params.items() if run.data.params.get(k, v) != v)
            if changed:
                log.warning("MLflow run %s resumed with a changed config (params keep their first values; "
                            "the new config is config/config.resume-%d.yaml): %s", run_id, resumes,
                            ", ".join(changed))
                client.log_text(run_id, config_yaml, f"config/config.resume-{resumes}.yaml")
            log_tags(client, run_id, all_tags)
            log_prepared_data(client, run, prepared_dir)
            log.info("reopened MLflow run %s (%s) in experiment %r", run_id, run_name, experiment)
            return run_id

        all_tags.update({TAG_RUN_NAME: run_name, TAG_STORAGE: storage_dir})
        run = client.create_run(exp_id, run_name=run_name)
        run_id = run.info.run_id
        log_tags(client, run_id, all_tags)
        log_params(client, run_id, params)
        client.log_text(run_id, config_yaml, "config/config.yaml")
        log_prepared_data(client, run, prepared_dir)
        log.info("created MLflow run %s (%s) in experiment %r at %s", run_id, run_name, experiment, redact(uri))
        return run_id


def log_what_is_missing(client, run, params: Dict[str, str], text: str, text_path: str) -> None:
    """Log the params and the text artifact that a reopened ``run`` lacks.

    A driver killed between ``create_run`` and its params (a sweep trial's, in CI) left a run that its tags find
    but without them; the params it has keep their first values (MLflow's are immutable)."""
    log_params(client, run.info.run_id, {k: v for k, v in params.items() if k not in run.data.params})
    folder = text_path.rpartition("/")[0]
    if not any(f.path == text_path for f in client.list_artifacts(run.info.run_id, folder)):
        client.log_text(run.info.run_id, text, text_path)


def log_params(client, run_id: str, params: Dict[str, str]) -> None:
    """``params`` (each value cut to MLflow's longest) in MLflow's batches."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:_MAX_PARAM_LEN]) for k, v in params.items()]
    for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i:i + _MAX_PARAMS_PER_BATCH])


def log_tags(client, run_id: str, tags: Dict[str, str]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[i:i + _MAX_PARAMS_PER_BATCH])


def run_page_url(uri: Optional[str], run_id: str, ui: str = "http://127.0.0.1:5000", timeout_s: float = 5.0) -> Optional[str]:
    """The run's page in the MLflow UI, its Overview (the data it read, its logged model with the model's loss, the
    registered version, its metrics), in the 'Model training' view (MLflow 3.17's UI starts in its GenAI view
    whatever the experiment's kind; ``?workflowType=machine_learning`` opens the other). ``ui``: where ``make ui``
    serves a sqlite store; an http tracking URI is its own UI. None when the run cannot be read. The run's charts
    with the loss first are tracking/ui.py:run_charts_url."""
    if not uri:
        return None
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else ui
    try:
        with short_http(timeout_s):
            exp = mlflow_client(uri).get_run(run_id).info.experiment_id
    except Exception:  # noqa: BLE001 - a link is a convenience
        return None
    return redact(f"{base}/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning")


def set_tags(uri: str, run_id: str, tags: Dict[str, str], timeout_s: float = 10.0) -> None:
    """Tag a run from outside its rank 0 (an evaluation task); never raises, a failure is logged."""
    try:
        with short_http(timeout_s):
            log_tags(mlflow_client(uri), run_id, {k: redact(v) for k, v in tags.items()})
    except Exception as e:  # noqa: BLE001 - tracking must not fail the caller
        log.error("could not tag MLflow run %s: %s", run_id, short_message(e))


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
        with short_http(timeout_s):
            client = mlflow_client(uri)
            if error and status == "FAILED":
                client.set_tag(run_id, ERROR_TAG, _truncate_error(redact(error)))
            # MLflow prints "View run ... at: <tracking URI>/#/..." here, credentials and all: print it redacted
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                client.set_terminated(run_id, status=status)
            sys.stdout.write(redact_text(printed.getvalue()))
    except Exception as e:  # noqa: BLE001 - see docstring
        log.error("could not mark MLflow run %s %s: %s", run_id, status, short_message(e))
