"""The final model as an MLflow 3 logged model: what the run page's "Logged models" shows, and what a registered
version points at.

A training run's weights (MiniMind ``.pth``, safetensors, a LoRA file) are the artifacts of one logged model named
``model`` whose source run is the training run, kept in the model's own artifact location
(``<experiment artifacts>/models/<model id>/artifacts``). MLflow 3.17 resolves ``runs:/<run id>/model`` to it (a run's
logged model of that name: mlflow/store/artifact/runs_artifact_repo.py), so ``serve runs:/<run>/model``, ``serve
models:/<name>/<version>`` and ``mlflow artifacts download`` find the same files as when they were the run's
``model/`` directory, and nothing is stored twice. The run lists the model as its output (at the last step), and the
run's last ``train/loss`` and held-out ``eval/*`` points are linked to it (a metric's ``model_id``; MLflow keeps the
point once in the run's history and adds it to the model's metrics), with the run's dataset input, so the model's
row and its own page show its loss on its data.

A run that resumes after its model was finished (``log_final_artifacts`` called again) reuses it.
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterable, List, Optional, Tuple

MODEL_NAME = "model"  # the run's artifact path it stands for: runs:/<run id>/model
MODEL_TYPE = "minimind"
# the model's metrics: what a user compares models by, first; benchmark scores (eval/<task>/...) stay on the run
LINKED_METRICS = ("train/loss", "eval/loss", "eval/ppl", "eval/bpb")


def run_model(client, run_id: str, experiment_id: Optional[str] = None):
    """The logged model ``model`` of this run (the newest, READY before PENDING), or None."""
    experiment_id = experiment_id or client.get_run(run_id).info.experiment_id
    found = [m for m in client.search_logged_models([experiment_id], filter_string=(
        f"name = '{MODEL_NAME}' AND source_run_id = '{run_id}'"), max_results=50) if m.source_run_id == run_id]
    found.sort(key=lambda m: (str(m.status) == "READY", m.creation_timestamp or 0), reverse=True)
    return found[0] if found else None


def log_logged_model(client, run_id: str, files: Iterable[Tuple[str, str]], *, step: int = 0,
                     tags: Optional[dict] = None) -> str:
    """Upload ``files`` (``(local path, directory in the model: '' for its top)``) as the run's logged model, mark
    it READY, record it as the run's output at ``step`` and link the run's last loss points to it; returns its id.
    Raises on the first failure (the caller keeps the files in the run instead): a model whose upload failed stays
    PENDING, and the next call uploads into it again."""
    from mlflow.entities import LoggedModelOutput

    run = client.get_run(run_id)
    exp_id = run.info.experiment_id
    model = run_model(client, run_id, exp_id)
    if model is None:
        model = client.create_logged_model(exp_id, name=MODEL_NAME, source_run_id=run_id, model_type=MODEL_TYPE,
                                           tags={k: str(v) for k, v in (tags or {}).items()})
    if str(model.status) != "READY":
        with tempfile.TemporaryDirectory(prefix="mmr-model-") as staging:
            for path, subdir in files:  # links, not copies: log_model_artifacts reads what they point at
                os.makedirs(os.path.join(staging, subdir), exist_ok=True)
                os.symlink(os.path.abspath(path), os.path.join(staging, subdir, os.path.basename(path)))
            client.log_model_artifacts(model.model_id, staging)
        client.finalize_logged_model(model.model_id, "READY")
    if not any(o.model_id == model.model_id for o in (run.outputs.model_outputs if run.outputs else [])):
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    link_metrics(client, run, model.model_id)
    return model.model_id


def link_metrics(client, run, model_id: str) -> List[str]:
    """The run's last point of each of :data:`LINKED_METRICS` it has, logged again with ``model_id`` and the run's
    dataset input (the same key, step, time and value: the run's history keeps one point). Returns the keys linked."""
    from mlflow.entities import Metric

    datasets = run.inputs.dataset_inputs if run.inputs else []
    data = datasets[0].dataset if datasets else None
    points = []
    for key in LINKED_METRICS:
        history = client.get_metric_history(run.info.run_id, key)
        if history:
            last = max(history, key=lambda m: (m.step, m.timestamp))
            points.append(Metric(key, last.value, last.timestamp, last.step, model_id=model_id,
                                 dataset_name=data.name if data else None, dataset_digest=data.digest if data else None))
    if points:
        client.log_batch(run.info.run_id, metrics=points)
    return [m.key for m in points]
