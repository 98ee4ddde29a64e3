"""minimind_ray.tracking against a real MLflow 3.17 server (and the embedded sqlite default).

What the training run relies on: one MLflow run per training run (a driver-level resume
reopens it), no step logged twice after a worker restart, a down server costing training
nothing, final artifacts + a registered version, and FAILED runs carrying their error.
Checks read the server through its REST API, not through the code under test.
No Ray: the worker side is exercised in-process. About 40 s, most of it two server starts.
"""
from __future__ import annotations

import statistics
import time
import uuid

import mlflow
import pytest
import requests

from minimind_ray.config import RunConfig, TrackingConfig
from minimind_ray.tracking.artifacts import log_final_artifacts
from minimind_ray.tracking.logger import RunLogger
from minimind_ray.tracking.runs import artifact_location_for, finish_run, resolve_tracking_uri, start_run

pytestmark = pytest.mark.integration

TAGS = {"world_size": 2, "device_type": "cpu"}


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    """RunLogger shortens MLflow's HTTP retries for its whole process; undo that after each
    test so other tests in the session see MLflow's defaults."""
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _cfg(uri: str, **train) -> RunConfig:
    cfg = RunConfig()
    cfg.tracking.uri = uri
    cfg.tracking.experiment = f"test-{_uid()}"
    cfg.tracking.timeout_s = 5.0
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _api(server, method: str, endpoint: str, **kw) -> dict:
    r = requests.request(method, f"{server.uri}/api/2.0/mlflow/{endpoint}", timeout=10, **kw)
    r.raise_for_status()
    return r.json()


def _history(server, run_id: str, key: str) -> list:
    return _api(server, "GET", "metrics/get-history",
                params={"run_id": run_id, "metric_key": key}).get("metrics", [])


def _artifacts(server, run_id: str, path: str = "") -> dict:
    files = _api(server, "GET", "artifacts/list", params={"run_id": run_id, "path": path}).get("files", [])
    return {f["path"]: f for f in files}


def test_driver_resume_reopens_the_same_run(mlflow_server, tmp_path):
    cfg = _cfg(mlflow_server.uri)
    name, storage = f"run-{_uid()}", str(tmp_path / "runs")
    first = start_run(cfg, name, storage, TAGS)
    finish_run(mlflow_server.uri, first, "KILLED")  # the driver was stopped

    cfg.train.lr = 3e-4  # resumed with a changed config: params keep their first values
    again = start_run(cfg, name, storage, TAGS)
    other = start_run(cfg, name, str(tmp_path / "elsewhere"), TAGS)  # same name, other storage: another run
    assert again == first and other != first

    exp = _api(mlflow_server, "GET", "experiments/get-by-name",
               params={"experiment_name": cfg.tracking.experiment})["experiment"]
    runs = _api(mlflow_server, "POST", "runs/search",
                json={"experiment_ids": [exp["experiment_id"]], "max_results": 100})["runs"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"]["tags"]} for r in runs}
    assert sorted(tags) == sorted([first, other])
    run = next(r for r in runs if r["info"]["run_id"] == first)
    assert run["info"]["status"] == "RUNNING" and run["info"]["run_name"] == name
    assert tags[first]["minimind.storage"] == storage and tags[first]["minimind.resumes"] == "1"
    assert tags[first]["world_size"] == "2" and tags[first]["ray.version"] and tags[first]["torch.version"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["train.lr"] == "0.0001" and params["tracking.experiment"] == cfg.tracking.experiment
    assert {"config/config.yaml", "config/config.resume-1.yaml"} <= set(_artifacts(mlflow_server, first, "config"))


def test_worker_restart_logs_each_step_once(mlflow_server, tmp_path):
    run_id = start_run(_cfg(mlflow_server.uri), f"run-{_uid()}", str(tmp_path), TAGS)
    first = RunLogger(mlflow_server.uri, run_id, timeout_s=5)
    for step in range(1, 11):
        first.log_metrics({"loss": 10.0 - step * 0.5, "lr": 1e-4}, step)
    first.log_metrics({"loss": 0.0}, 10)  # the same step again within one worker: ignored
    s1 = first.close(timeout_s=20)
    assert (s1["metrics_logged"], s1["metrics_dropped"], s1["metrics_skipped"]) == (20, 0, 1), s1

    # the worker group restarted from the checkpoint at step 4 and replays steps 5..12; its logger, like a training
    # worker's, does not wait for its first read of the run (the replays are then filtered as they are sent)
    second = RunLogger(mlflow_server.uri, run_id, timeout_s=5, wait_for_server=False)
    for step in range(5, 13):
        second.log_metrics({"loss": 100.0 + step}, step)
    s2 = second.close(timeout_s=20)
    assert (s2["metrics_logged"], s2["metrics_dropped"], s2["metrics_skipped"]) == (2, 0, 6), s2

    loss = _history(mlflow_server, run_id, "loss")
    assert sorted(m["step"] for m in loss) == list(range(1, 13))
    by_step = {m["step"]: m["value"] for m in loss}
    assert by_step[10] == 5.0 and by_step[11] == 111.0  # the first value of a step stays
    assert len(_history(mlflow_server, run_id, "lr")) == 10


def test_final_artifacts_registry_and_failed_run(mlflow_server, tmp_path):
    uri = mlflow_server.uri
    run_id = start_run(_cfg(uri), f"run-{_uid()}", str(tmp_path), TAGS)
    logger = RunLogger(uri, run_id, timeout_s=5)
    for step in range(1, 21):
        logger.log_metrics({"loss": 8.0 / step}, step)
        if step % 10 == 0:
            logger.log_metrics({"eval_loss": 9.0 / step}, step)
    assert logger.close(timeout_s=20)["metrics_logged"] == 22

    (tmp_path / "model.pth").write_bytes(b"\0" * 1024)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    (tmp_path / "manifest.json").write_text('{"files": []}')
    model_name = f"minimind-test-{_uid()}"
    kw = dict(pth_path=str(tmp_path / "model.pth"), safetensors_path=str(tmp_path / "model.safetensors"),
              tokenizer_dir=str(tok), manifest_path=str(tmp_path / "manifest.json"), registered_model=model_name)
    out = log_final_artifacts(uri, run_id, **kw)
    assert out == {"model_version": "1", "errors": []}
    assert log_final_artifacts(uri, run_id, **kw)["model_version"] == "1"  # a second call reuses it

    assert {"config", "model", "tokenizer", "data", "plots"} <= set(_artifacts(mlflow_server, run_id))
    assert set(_artifacts(mlflow_server, run_id, "model")) == {"model/model.pth", "model/model.safetensors"}
    assert set(_artifacts(mlflow_server, run_id, "tokenizer")) == {"tokenizer/tokenizer.json",
                                                                   "tokenizer/tokenizer_config.json"}
    assert int(_artifacts(mlflow_server, run_id, "plots")["plots/loss.png"]["file_size"]) > 1000
    _api(mlflow_server, "GET", "registered-models/get", params={"name": model_name})
    versions = _api(mlflow_server, "GET", "model-versions/search",
                    params={"filter": f"name='{model_name}'"})["model_versions"]
    assert [(v["version"], v["run_id"]) for v in versions] == [("1", run_id)]
    assert versions[0]["source"].endswith(f"/{run_id}/artifacts/model")

    error = "Traceback (most recent call last):\n" + "x" * 6000 + "\nValueError: boom at step 7"
    finish_run(uri, run_id, "FAILED", error=error)
    run = _api(mlflow_server, "GET", "runs/get", params={"run_id": run_id})["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert run["info"]["status"] == "FAILED"
    assert len(tags["error"]) == 5000 and tags["error"].startswith("Traceback") and tags["error"].endswith("boom at step 7")


def test_embedded_default_store(tmp_path, monkeypatch):
    """No server, no env var: MLflow 3.17's own default store (sqlite in the cwd), made
    absolute so a worker with another cwd (Ray's session dir) writes to the same place."""
    monkeypatch.chdir(tmp_path)
    uri = resolve_tracking_uri(TrackingConfig())
    assert uri == f"sqlite:///{tmp_path}/mlflow.db" == mlflow.get_tracking_uri()
    assert artifact_location_for(uri) == f"file://{tmp_path}/mlartifacts"
    cfg = RunConfig()
    run_id = start_run(cfg, "embedded", str(tmp_path / "runs"), TAGS)

    worker_cwd = tmp_path / "session" / "worker"
    worker_cwd.mkdir(parents=True)
    monkeypatch.chdir(worker_cwd)
    logger = RunLogger(uri, run_id, timeout_s=5)
    for step in range(1, 6):
        logger.log_metrics({"loss": 1.0 / step}, step)
    summary = logger.close(timeout_s=20)
    assert summary["metrics_logged"] == 5 and summary["errors"] == [], summary
    (worker_cwd / "model.pth").write_bytes(b"\0" * 64)
    out = log_final_artifacts(uri, run_id, pth_path=str(worker_cwd / "model.pth"), safetensors_path=None,
                              tokenizer_dir=None, manifest_path=None, registered_model="minimind-pretrain")
    assert out == {"model_version": "1", "errors": []}
    finish_run(uri, run_id, "FINISHED")

    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "embedded"
    assert client.get_experiment(run.info.experiment_id).name == "minimind-pretrain"
    arts = tmp_path / "mlartifacts" / run_id / "artifacts"
    for f in ("config/config.yaml", "model/model.pth", "plots/loss.png"):
        assert (arts / f).is_file(), f
    assert sorted(p.name for p in worker_cwd.iterdir()) == ["model.pth"]  # nothing landed here
    assert client.get_model_version("minimind-pretrain", "1").run_id == run_id


def test_server_down_costs_training_nothing(mlflow_server, tmp_path):
    uri = mlflow_server.uri
    run_id = start_run(_cfg(uri), f"run-{_uid()}", str(tmp_path), TAGS)
    survivor = RunLogger(uri, run_id, timeout_s=2)
    for step in range(1, 4):
        survivor.log_metrics({"loss": float(step)}, step)
    survivor.flush(timeout_s=10)

    mlflow_server.stop()
    try:
        durations = []
        for step in range(4, 204):
            t = time.perf_counter()
            survivor.log_metrics({"loss": float(step)}, step)
            durations.append(time.perf_counter() - t)
        # a call is microseconds; the max only allows for this process being descheduled on a busy box
        assert statistics.median(durations) < 0.001 and max(durations) < 0.1, (statistics.median(durations),
                                                                               max(durations))

        # a worker that starts while the server is down: it starts, logs, and reports the loss
        t = time.perf_counter()
        orphan = RunLogger(uri, run_id, timeout_s=2)
        assert time.perf_counter() - t < 3
        for step in range(1, 101):
            orphan.log_metrics({"other": float(step)}, step)
        t = time.perf_counter()
        summary = orphan.close(timeout_s=1)
        assert time.perf_counter() - t < 3
        assert summary["metrics_logged"] == 0 and summary["metrics_dropped"] == 100, summary
        assert summary["errors"] and summary["error_count"] >= 1

        # the driver side reports instead of raising
        t = time.perf_counter()
        finish_run(uri, run_id, "FAILED", error="boom")
        out = log_final_artifacts(uri, run_id, pth_path=None, safetensors_path=None, tokenizer_dir=None,
                                  manifest_path=None, registered_model="never", timeout_s=2)
        assert out["model_version"] is None and out["errors"]
        assert time.perf_counter() - t < 10
    finally:
        mlflow_server.start()

    # the server is back: what was buffered lands, each step once
    summary = survivor.close(timeout_s=30)
    assert (summary["metrics_logged"], summary["metrics_dropped"]) == (203, 0), summary
    assert sorted(m["step"] for m in _history(mlflow_server, run_id, "loss")) == list(range(1, 204))
