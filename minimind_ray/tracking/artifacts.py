"""After training, on the driver: model files, tokenizer, data manifest and loss curve into
the run, then a registered model version."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from minimind_ray.tracking.names import history as metric_history
from minimind_ray.tracking.runs import mlflow_client, error_code, short_message, short_http

log = logging.getLogger(__name__)


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
            errors.append(f"{what}: {short_message(e)}")
            log.error("MLflow run %s: %s failed: %s", run_id, what, short_message(e))
            return None

    version = None
    with short_http(timeout_s):
        client = attempt("connect", lambda: mlflow_client(uri))
        if client is None:
            return {"model_version": None, "errors": errors}
        files = [(pth_path, "model"), (safetensors_path, "model"), (manifest_path, "data")]
        for path, dest in files + list((extra or {}).items()):
            if path:
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
        if registered_model and (pth_path or safetensors_path):
            version = attempt("register model", lambda: register_version(client, registered_model, run_id))
    return {"model_version": version, "errors": errors}


def register_version(client, name: str, run_id: str) -> str:
    from mlflow.exceptions import MlflowException

    source = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/model"
    try:
        client.create_registered_model(name, description="MiniMind-family GPT trained with minimind-ray")
    except MlflowException as e:
        if error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if mv.source == source:
            return str(mv.version)
    return str(client.create_model_version(name, source=source, run_id=run_id).version)
