"""After training, on the driver: the weights as the run's logged model (tracking/models.py), tokenizer, data
manifest and loss curve into the run, then a registered model version of the logged model, and the run's chart
view (tracking/ui.py)."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from minimind_ray.tracking.models import log_logged_model, run_model
from minimind_ray.tracking.names import history as metric_history
from minimind_ray.tracking.runs import mlflow_client, error_code, short_message, short_http
from minimind_ray.tracking.ui import save_chart_view

log = logging.getLogger(__name__)

MODEL_VERSIONS_TAG = "mlflow.modelVersions"  # MLflow's own: a logged model's registered versions, as the UI lists them


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
    """Driver side, after training: the weights as the run's logged model, tokenizer, data manifest and loss curve
    into the run, then a registered model version of that logged model, and the run's chart view.

    Layout: the logged model ``model`` (tracking/models.py: MiniMind ``.pth``, safetensors, and ``extra`` files
    whose directory is ``model/...``, e.g. ``model/lora`` -> its ``lora/``), and in the run ``tokenizer/``,
    ``data/`` (manifest), ``plots/loss.png`` (from the run's ``train/loss`` and ``eval/loss`` histories) and the
    other ``extra`` files (the checkpoint index). Each step is tried on its own; failures are collected in
    ``errors``, never raised, so a down server never turns a finished training into a failed one. When the logged
    model cannot be made, the weights go to the run's ``model/`` directory as before it existed, so nothing is lost.

    The version's source is the logged model's artifact location (:func:`register_version`), or the run's artifact
    URI + ``/model`` for weights kept in the run. Calling it again for the same run reuses the model and the version.
    No version is registered when no model file was given.
    Returns ``{'model_version': str | None, 'model_id': str | None, 'errors': [...]}``.
    """
    errors: List[str] = []

    def attempt(what: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - see docstring
            errors.append(f"{what}: {short_message(e)}")
            log.error("MLflow run %s: %s failed: %s", run_id, what, short_message(e))
            return None

    version = model_id = None
    with short_http(timeout_s):
        client = attempt("connect", lambda: mlflow_client(uri))
        if client is None:
            return {"model_version": None, "model_id": None, "errors": errors}
        extra = dict(extra or {})
        weights = [(p, "model") for p in (pth_path, safetensors_path) if p]
        weights += [(p, d) for p, d in extra.items() if d == "model" or d.startswith("model/")]
        run_files = [(p, d) for p, d in [(manifest_path, "data"), *extra.items()] if p and (p, d) not in weights]
        if weights:
            model_id = attempt("logged model", lambda: log_logged_model(
                client, run_id, [(p, d[len("model/"):] if d.startswith("model/") else "") for p, d in weights],
                step=last_step(client, run_id)))
            if model_id is None:  # the files stay with the run: a failed model never loses the weights
                run_files = weights + run_files
        for path, dest in run_files:
            attempt(f"upload {path}", lambda p=path, d=dest: client.log_artifact(run_id, p, d))
        if tokenizer_dir:
            attempt(f"upload {tokenizer_dir}", lambda: client.log_artifacts(run_id, tokenizer_dir, "tokenizer"))

        def plot():
            history = {k: metric_history(client, run_id, k) for k in ("train/loss", "eval/loss")}
            history = {k: v for k, v in history.items() if v}
            if not history:
                log.warning("MLflow run %s has no loss history: no plots/loss.png", run_id)
                return
            with tempfile.TemporaryDirectory(prefix="mmr-plot-") as tmp:
                client.log_artifact(run_id, plot_loss_curve(history, os.path.join(tmp, "loss.png")), "plots")

        attempt("loss plot", plot)
        attempt("chart view", lambda: save_chart_view(client, run_id))
        if registered_model and (pth_path or safetensors_path):
            version = attempt("register model", lambda: register_version(client, registered_model, run_id, model_id))
    return {"model_version": version, "model_id": model_id, "errors": errors}


def last_step(client, run_id: str) -> int:
    """The run's newest step (that of its last ``train/loss``), the step its model is the output of."""
    return max((m.step for m in client.get_metric_history(run_id, "train/loss")), default=0)


def register_version(client, name: str, run_id: str, model_id: Optional[str] = None) -> str:
    """A version of registered model ``name`` for the run's model (an existing one of the same source is reused).

    The run's logged model (``model_id``, else the one the run has: pipeline/run.py registers a finished run): the
    version's source is the model's artifact location, and the model's tag ``mlflow.modelVersions`` lists the version
    (what MLflow's own server adds; set here too, because a sqlite store has no server to add it, and MLflow 3.17's
    registry keeps no ``model_id`` of its own). A run whose weights are in its own ``model/`` directory (the logged
    model could not be made, or the run predates them): that directory."""
    from mlflow.exceptions import MlflowException

    model = client.get_logged_model(model_id) if model_id else run_model(client, run_id)
    if model is not None and str(model.status) != "READY":
        model = None
    source = model.artifact_location if model else client.get_run(run_id).info.artifact_uri.rstrip("/") + "/model"
    try:
        client.create_registered_model(name, description="MiniMind-family GPT trained with minimind-ray")
    except MlflowException as e:
        if error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
    version = next((str(mv.version) for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
                    if mv.source == source), None)
    if version is None:
        version = str(client.create_model_version(name, source=source, run_id=run_id,
                                                  model_id=model.model_id if model else None).version)
    if model is not None:
        listed = json.loads(client.get_logged_model(model.model_id).tags.get(MODEL_VERSIONS_TAG) or "[]")
        if (name, version) not in {(e.get("name"), str(e.get("version"))) for e in listed}:  # the server writes ints
            client.set_logged_model_tags(model.model_id, {MODEL_VERSIONS_TAG: json.dumps(
                listed + [{"name": name, "version": version}])})
    return version
