"""Parent runs: one MLflow run for a sweep or a pipeline, whose children are the training runs it started.

A child is an ordinary training run (tracking/runs.py:start_run) with the tag ``mlflow.parentRunId``, which the
MLflow UI nests under its parent (both must be in one experiment). A parent is found again the way a training
run is, by its name and storage path (tags ``minimind.run_name``, ``minimind.storage``) plus its kind, so running
the same sweep or pipeline command again reopens the same parent. Like start_run, :func:`start_parent` raises when
the store cannot be reached (the caller decides to go on untracked); the other calls log and go on.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

from minimind_ray.fsio import redact, redact_obj
from minimind_ray.tracking import artifacts
from minimind_ray.tracking.runs import (TAG_RESUMES, TAG_RUN_NAME, TAG_STORAGE, experiment_id_of, finish_run, log_tags,
                                        log_params, log_what_is_missing, mlflow_client, short_http, short_message)

log = logging.getLogger(__name__)

TAG_PARENT = "mlflow.parentRunId"  # MLflow's own: the UI nests a run under this one
TAG_KIND = "minimind.kind"  # sweep | pipeline
TAG_CHILD_OF = "minimind.parent.kind"  # on a child: what kind of parent started it


def start_parent(uri: str, experiment: str, kind: str, name: str, storage: str, params: Dict[str, str],
                 config_text: str, timeout_s: float = 10.0, tags: Optional[Dict[str, str]] = None) -> str:
    """Create the parent run of sweep/pipeline ``name`` in ``experiment``, or reopen it (status RUNNING again,
    ``minimind.resumes`` + 1). Params are logged once (MLflow keeps the first values); ``config_text`` is the
    sweep's or pipeline's YAML, kept as ``config/<kind>.yaml``. The same call opens a run of another ``kind`` that
    is no training run (a pipeline's prepare or eval stage: ``tags`` make it a child)."""

    storage = redact(storage)
    with short_http(timeout_s):
        client = mlflow_client(uri)
        exp_id = experiment_id_of(client, experiment, uri)
        found = client.search_runs([exp_id], filter_string=f"tags.`{TAG_RUN_NAME}` = '{name}' and "
                                                           f"tags.`{TAG_KIND}` = '{kind}'",
                                   order_by=["attributes.start_time ASC"], max_results=100)
        run = next((r for r in found if r.data.tags.get(TAG_STORAGE) == storage), None)
        params = {k: str(v) for k, v in redact_obj(params).items()}
        if run is not None:
            run_id = run.info.run_id
            client.update_run(run_id, status="RUNNING")
            log_tags(client, run_id, {TAG_RESUMES: str(int(run.data.tags.get(TAG_RESUMES, "0")) + 1), **(tags or {})})
            log_what_is_missing(client, run, params, redact(config_text), f"config/{kind}.yaml")
            return run_id
        run_id = client.create_run(exp_id, run_name=name).info.run_id
        log_tags(client, run_id, {TAG_RUN_NAME: name, TAG_STORAGE: storage, TAG_KIND: kind, **(tags or {})})
        log_params(client, run_id, params)
        client.log_text(run_id, redact(config_text), f"config/{kind}.yaml")
        return run_id


def child_tags(parent_id: Optional[str], kind: str, **more: Optional[str]) -> Dict[str, str]:
    """The tags a child run is started with (raytrain/driver.py:run(tags=...))."""
    if not parent_id:
        return {}
    return {TAG_PARENT: parent_id, TAG_CHILD_OF: kind, **{k: str(v) for k, v in more.items() if v is not None}}


def record(uri: str, run_id: str, *, tags: Optional[Dict[str, str]] = None, metrics: Optional[Dict[str, float]] = None,
           texts: Optional[Dict[str, str]] = None, files: Optional[Dict[str, str]] = None, timeout_s: float = 10.0,
           step: int = 0) -> List[str]:
    """Tags, metrics, text artifacts (``{artifact path: text}``) and files (``{local path: artifact dir}``) on a
    run; never raises. Returns what failed, one line each."""
    from mlflow.entities import Metric
    import time

    errors = []
    with short_http(timeout_s):
        try:
            client = mlflow_client(uri)
        except Exception as e:  # noqa: BLE001 - tracking must not fail the caller
            return [f"connect: {short_message(e)}"]
        jobs = []
        if tags:
            jobs.append(("tags", lambda: log_tags(client, run_id, {k: redact(str(v)) for k, v in tags.items()})))
        if metrics:
            now = int(time.time() * 1000)
            jobs.append(("metrics", lambda: client.log_batch(run_id, metrics=[
                Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None])))
        for path, text in (texts or {}).items():
            jobs.append((path, lambda p=path, t=text: client.log_text(run_id, redact(t), p)))
        for path, dest in (files or {}).items():
            jobs.append((path, lambda p=path, d=dest: client.log_artifact(run_id, p, d)))
        for what, job in jobs:
            try:
                job()
            except Exception as e:  # noqa: BLE001 - see docstring
                errors.append(f"{what}: {short_message(e)}")
                log.error("MLflow run %s: %s failed: %s", run_id, what, short_message(e))
    return errors


def children(uri: str, parent_id: str, timeout_s: float = 10.0) -> list:
    """Every run whose ``mlflow.parentRunId`` is ``parent_id``, in any experiment, oldest first."""
    with short_http(timeout_s):
        client = mlflow_client(uri)
        exps = [e.experiment_id for e in client.search_experiments()]
        return client.search_runs(exps, filter_string=f"tags.`{TAG_PARENT}` = '{parent_id}'",
                                  order_by=["attributes.start_time ASC"], max_results=1000)


def end_run(uri: str, run_id: str, status: str, tags: Optional[Dict[str, str]] = None, timeout_s: float = 10.0) -> None:
    """Tag and end a run (FINISHED, FAILED, KILLED); never raises."""
    if tags:
        record(uri, run_id, tags=tags, timeout_s=timeout_s)
    finish_run(uri, run_id, status, timeout_s=timeout_s)


def register_version(uri: str, name: str, run_id: str, tags: Dict[str, str], timeout_s: float = 30.0) -> str:
    """A registry version of the run's ``model/`` artifacts under ``name`` (the one of that run if it exists), tagged
    with where it came from (the run's own lineage tags, and ``tags``). Raises if the store refuses."""
    with short_http(timeout_s):
        client = mlflow_client(uri)
        version = artifacts.register_version(client, name, run_id)
        run_tags = client.get_run(run_id).data.tags
        lineage = {k: v for k, v in run_tags.items() if k.startswith("minimind.data.") or k.startswith("minimind.init")}
        for k, v in {**lineage, "minimind.source.run_id": run_id, **tags}.items():
            client.set_model_version_tag(name, version, k, redact(str(v)))
        return version
