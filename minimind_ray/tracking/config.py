"""The tracking room's configuration (``tracking:``): which MLflow server, experiment and registered model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minimind_ray.config_checks import config_field as _f


@dataclass
class TrackingConfig:
    """MLflow tracking."""

    enabled: bool = _f(True, "log to MLflow")
    uri: Optional[str] = _f(None, "tracking URI; None = MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db")
    experiment: Optional[str] = _f(None, "experiment name; None = 'minimind-<stage>'")
    registered_model: Optional[str] = _f(None, "register the final model under this name; None = 'minimind-<stage>'")
    system_metrics: bool = _f(False, "MLflow system metrics (CPU/GPU/memory) sampling on rank 0")
    timeout_s: float = _f(10.0, "per-request timeout; a slow or down server never stalls training", gt=0)
