"""What the MLflow UI opens on for a training run: its page, and its charts with the loss first.

MLflow 3.17.2's run page cannot be told how to order its chart sections (read from its bundle,
``mlflow/server/js/build``, and source, ``runs-charts.types.ts: getBaseChartAndSectionConfigs``): the "Model
metrics" tab makes one section per metric-name prefix (everything before the last ``/``), sorts them by name, and
always adds a section "Model metrics" for the names without a ``/`` after them, empty when there are none; the layout
a user then drags into place is kept in that browser's localStorage only. With the names ``tracking/names.py`` lists,
a run opens on ``eval``, ``perf``, ``rl``, ``sys`` and then ``train``, and on an empty "Model metrics".

The one chart layout MLflow reads from the tracking store is a *shared view* of the experiment's runs: an
experiment tag ``mlflow.sharedViewState.<key>`` holding the view's state as JSON (what the experiment page's
"Share" button writes), opened by ``#/experiments/<id>/runs?viewStateShareKey=<key>``. After training the driver
writes one per run (:func:`save_chart_view`, key = the run id): the run alone (its search filter), its sections
in the order of ``tracking/names.py`` (train, eval and the benchmark tasks' eval/<task>, rl, perf, sys; anything
else after them), the loss first in each, and no empty section. :func:`run_charts_url` is its address.
"""
from __future__ import annotations

import json
import uuid
from typing import Dict, List, Optional

from minimind_ray.fsio import redact
from minimind_ray.tracking.runs import mlflow_client, short_http

SHARED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow's own prefix (constants.ts: EXPERIMENT_PAGE_VIEW_STATE_SHARE_TAG_PREFIX)
GROUP_ORDER = ("train", "eval", "rl", "perf", "sys")  # tracking/names.py's groups, in the order a user reads them
SYSTEM_PREFIX, SYSTEM_SECTION, PLAIN_SECTION = "system/", "System metrics", "Model metrics"  # MLflow's own names
MAX_TAG = 20000  # MLflow 3.17: an experiment tag's value


def section_of(key: str) -> str:
    """The section MLflow's charts put a metric in: its name up to the last ``/``."""
    if key.startswith(SYSTEM_PREFIX):
        return SYSTEM_SECTION
    return key.rsplit("/", 1)[0] if "/" in key else PLAIN_SECTION


def _section_rank(section: str):
    group = section.split("/", 1)[0]
    if section in (PLAIN_SECTION, SYSTEM_SECTION):
        return (len(GROUP_ORDER) + 1, section == SYSTEM_SECTION, section)
    return (GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER), section)


def chart_view_state(run_id: str, metric_keys: List[str]) -> dict:
    """The shared view's state: the run's charts, the loss first, in sections ordered as :data:`GROUP_ORDER`."""
    by_section: Dict[str, List[str]] = {}
    for key in metric_keys:
        by_section.setdefault(section_of(key), []).append(key)
    sections, charts = [], []
    for name in sorted(by_section, key=_section_rank):
        section_id = str(uuid.uuid4())
        sections.append({"uuid": section_id, "name": name, "display": True, "isReordered": False, "deleted": False,
                         "isGenerated": True})
        for key in sorted(by_section[name], key=lambda k: (k.rsplit("/", 1)[-1] != "loss", k)):
            system = key.startswith(SYSTEM_PREFIX)
            charts.append({"uuid": str(uuid.uuid4()), "type": "LINE", "metricKey": key, "metricSectionId": section_id,
                           "isGenerated": True, "deleted": False, "runsCountToCompare": 10, "scaleType": "linear",
                           "lineSmoothness": 0, "xAxisKey": "time" if system else "step",
                           "useGlobalXaxisKey": not system, "displayName": key.rsplit("/", 1)[-1]})
    return {"searchFilter": f"attributes.run_id = '{run_id}'", "compareRunSections": sections,
            "compareRunCharts": charts, "isAccordionReordered": True}


def save_chart_view(client, run_id: str) -> str:
    """Write the run's shared chart view (an experiment tag keyed by the run id) from the metrics it has now;
    metrics logged later (a benchmark's scores) are added by the UI in their sections. Returns the key."""
    run = client.get_run(run_id)
    state = chart_view_state(run_id, sorted(run.data.metrics))
    text = json.dumps(state, separators=(",", ":"))
    if len(text) > MAX_TAG:  # hundreds of metrics: the sections alone, the UI makes their charts
        text = json.dumps({**state, "compareRunCharts": []}, separators=(",", ":"))
    client.set_experiment_tag(run.info.experiment_id, SHARED_VIEW_TAG + run_id, text)
    return run_id


def ui_base(uri: Optional[str], ui: str = "http://127.0.0.1:5000") -> Optional[str]:
    """Where the UI of tracking URI ``uri`` is: an http(s) tracking server is its own UI; a sqlite store is seen
    through ``make ui`` (``ui``)."""
    if not uri:
        return None
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else ui


def run_charts_url(uri: Optional[str], run_id: str, ui: str = "http://127.0.0.1:5000",
                   timeout_s: float = 5.0) -> Optional[str]:
    """The run's charts, the loss first (:func:`save_chart_view`), in the 'Model training' view; None when the run
    cannot be read or has no chart view."""
    base = ui_base(uri, ui)
    if base is None:
        return None
    try:
        with short_http(timeout_s):
            client = mlflow_client(uri)
            exp = client.get_run(run_id).info.experiment_id
            if SHARED_VIEW_TAG + run_id not in client.get_experiment(exp).tags:
                return None
    except Exception:  # noqa: BLE001 - a link is a convenience
        return None
    return redact(f"{base}/#/experiments/{exp}/runs?viewStateShareKey={run_id}&compareRunsMode=CHART"
                  f"&workflowType=machine_learning")
