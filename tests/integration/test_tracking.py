"""minimind_ray.tracking against a real MLflow 3.17 server (and the embedded sqlite default).

What the training run relies on: one MLflow run per training run (a driver-level resume
reopens it), no step logged twice after a worker restart, a down server costing training
nothing, final artifacts + a registered version, and FAILED runs carrying their error.
Checks read the server through its REST API, not through the code under test.
No Ray: the worker side is exercised in-process. About 40 s, most of it two server starts.
"""
from __future__ import annotations

import json
import statistics
import time
import uuid
from pathlib import Path

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

    # a driver killed between creating the run and logging its params (CI saw it in a sweep trial): the resume
    # finds the run by its tags and logs the params and the config it lacks
    from mlflow import MlflowClient
    client = MlflowClient(mlflow_server.uri)
    cut_name = f"run-{_uid()}"
    cut = client.create_run(exp["experiment_id"], run_name=cut_name,
                            tags={"minimind.run_name": cut_name, "minimind.storage": storage}).info.run_id
    assert start_run(cfg, cut_name, storage, TAGS) == cut
    assert client.get_run(cut).data.params["train.lr"] == "0.0003"
    assert "config/config.yaml" in set(_artifacts(mlflow_server, cut, "config"))
    # the same for a sweep's or pipeline's parent run
    from minimind_ray.tracking.parents import start_parent
    parent = client.create_run(exp["experiment_id"], run_name=cut_name, tags={
        "minimind.run_name": cut_name, "minimind.storage": storage, "minimind.kind": "sweep"}).info.run_id
    assert start_parent(mlflow_server.uri, cfg.tracking.experiment, "sweep", cut_name, storage,
                        {"metric": "loss"}, "metric: loss\n") == parent
    assert client.get_run(parent).data.params == {"metric": "loss"}
    assert "config/sweep.yaml" in set(_artifacts(mlflow_server, parent, "config"))


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


def test_final_artifacts_registry_and_failed_run(mlflow_server, tmp_path, monkeypatch):
    uri = mlflow_server.uri
    run_id = start_run(_cfg(uri), f"run-{_uid()}", str(tmp_path), TAGS)
    logger = RunLogger(uri, run_id, timeout_s=5)
    for step in range(1, 21):
        logger.log_metrics({"train/loss": 8.0 / step, "perf/tokens_per_s": 100.0}, step)  # the names the worker logs
        if step % 10 == 0:
            logger.log_metrics({"eval/loss": 9.0 / step}, step)
    assert logger.close(timeout_s=20)["metrics_logged"] == 42

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
    model_id = out["model_id"]
    assert out == {"model_version": "1", "model_id": model_id, "errors": []} and model_id.startswith("m-")
    again = log_final_artifacts(uri, run_id, **kw)  # a second call reuses the model and its version
    assert (again["model_version"], again["model_id"]) == ("1", model_id)

    # the weights are the run's logged model, stored once: not in the run's own artifacts, but what runs:/<run>/model
    # resolves to (MLflow finds a run's logged model through the process's tracking URI: `mlflow artifacts download`
    # with MLFLOW_TRACKING_URI set, as docs/tracking.md says; serve reads its location itself)
    assert {"config", "tokenizer", "data", "plots"} <= set(_artifacts(mlflow_server, run_id))
    assert "model" not in _artifacts(mlflow_server, run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    got = Path(mlflow.artifacts.download_artifacts(f"runs:/{run_id}/model", dst_path=str(tmp_path / "dl"),
                                                   tracking_uri=uri))
    assert sorted(p.name for p in got.iterdir()) == ["model.pth", "model.safetensors"]
    model = _api(mlflow_server, "GET", f"logged-models/{model_id}")["model"]
    assert (model["info"]["name"], model["info"]["source_run_id"], model["info"]["status"]) == (
        "model", run_id, "LOGGED_MODEL_READY")
    # the model's metrics: the run's last loss points, linked (the run's history keeps each point once)
    assert {(m["key"], m["step"], m["value"]) for m in model["data"]["metrics"]} == {("train/loss", 20, 0.4),
                                                                                     ("eval/loss", 20, 0.45)}
    run = _api(mlflow_server, "GET", "runs/get", params={"run_id": run_id})["run"]
    assert run["outputs"]["model_outputs"] == [{"model_id": model_id, "step": 20}]
    assert len(_history(mlflow_server, run_id, "train/loss")) == 20

    assert {"config/config.yaml"} <= set(_artifacts(mlflow_server, run_id, "config"))
    assert set(_artifacts(mlflow_server, run_id, "tokenizer")) == {"tokenizer/tokenizer.json",
                                                                   "tokenizer/tokenizer_config.json"}
    assert int(_artifacts(mlflow_server, run_id, "plots")["plots/loss.png"]["file_size"]) > 1000
    _api(mlflow_server, "GET", "registered-models/get", params={"name": model_name})
    versions = _api(mlflow_server, "GET", "model-versions/search",
                    params={"filter": f"name='{model_name}'"})["model_versions"]
    # the version is the logged model's: its files are the version's source, and the model lists the version
    assert [(v["version"], v["run_id"], v["source"]) for v in versions] == [("1", run_id, model["info"]["artifact_uri"])]
    assert model["info"]["artifact_uri"].endswith(f"/models/{model_id}/artifacts")
    tags = {t["key"]: t["value"] for t in _api(mlflow_server, "GET", f"logged-models/{model_id}")["model"]["info"]["tags"]}
    assert [(e["name"], str(e["version"])) for e in json.loads(tags["mlflow.modelVersions"])] == [(model_name, "1")]

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
    assert out == {"model_version": "1", "model_id": out["model_id"], "errors": []}
    finish_run(uri, run_id, "FINISHED")

    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "embedded"
    assert client.get_experiment(run.info.experiment_id).name == "minimind-pretrain"
    arts = tmp_path / "mlartifacts" / run_id / "artifacts"
    for f in ("config/config.yaml", "plots/loss.png"):
        assert (arts / f).is_file(), f
    # the weights: the run's logged model, beside the runs in the same mlartifacts directory; its version points there
    model = client.get_logged_model(out["model_id"])
    assert model.artifact_location == (tmp_path / "mlartifacts" / "models" / out["model_id"] / "artifacts").as_uri()
    assert (tmp_path / "mlartifacts" / "models" / out["model_id"] / "artifacts" / "model.pth").is_file()
    assert sorted(p.name for p in worker_cwd.iterdir()) == ["model.pth"]  # nothing landed here
    version = client.get_model_version("minimind-pretrain", "1")
    assert (version.run_id, version.source) == (run_id, model.artifact_location)
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": "minimind-pretrain", "version": "1"}]


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


def _manifest(records: int, tokens: int) -> dict:
    return {"version": 1, "format": "pretrain", "max_seq_len": 128, "pack": True, "tokenizer_hash": "abc",
            "vocab_size": 6400, "counts": {"records": records, "tokens": tokens, "sequences": 99},
            "skipped": {"bad_json": {"count": 2, "samples": ["a.jsonl:3"]}},
            "shards": [{"file": "part-00000.parquet", "index": 0, "rows": 99, "bytes": 10}]}


def _inputs(server, run_id: str) -> list:
    run = _api(server, "GET", "runs/get", params={"run_id": run_id})["run"]
    return run.get("inputs", {}).get("dataset_inputs", [])


def test_the_prepared_data_is_the_runs_dataset_input_once(mlflow_server, tmp_path, monkeypatch):
    """start_run(prepared_dir=...) logs the prepared data as the run's dataset input: named after the directory,
    its source the directory (redacted), its digest the manifest's, its counts in the profile and the tags. A resume
    adds nothing; a cache_dir on s3:// (a real S3-protocol server) gives an s3 source without its credentials; a
    prepared directory whose manifest cannot be read costs the run nothing."""
    import hashlib

    from moto.server import ThreadedMotoServer

    prepared = tmp_path / "cache" / "pretrain-0123abcd"
    prepared.mkdir(parents=True)
    (prepared / "manifest.json").write_text(json.dumps(_manifest(1234, 56789)))
    cfg, name = _cfg(mlflow_server.uri), f"run-{_uid()}"
    first = start_run(cfg, name, str(tmp_path / "runs"), TAGS, prepared_dir=str(prepared))
    assert start_run(cfg, name, str(tmp_path / "runs"), TAGS, prepared_dir=str(prepared)) == first  # a resume
    [item] = _inputs(mlflow_server, first)
    ds = item["dataset"]
    assert (ds["name"], ds["source_type"], json.loads(ds["source"])) == ("pretrain-0123abcd", "local",
                                                                         {"uri": str(prepared)})
    assert ds["digest"] == hashlib.sha256((prepared / "manifest.json").read_bytes()).hexdigest()[:12]
    profile = json.loads(ds["profile"])
    assert (profile["records"], profile["tokens"], profile["skipped_records"], profile["shards"]) == (1234, 56789, 2, 1)
    assert {t["key"]: t["value"] for t in item["tags"]} == {"mlflow.data.context": "train", "records": "1,234",
                                                            "tokens": "56,789"}

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    s3.start()
    try:
        host, port = s3.get_host_and_port()
        for k, v in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_ACCESS_KEY_ID": "unused", "AWS_SECRET_ACCESS_KEY": "unused"}.items():
            monkeypatch.setenv(k, v)
        requests.put(f"http://{host}:{port}/bkt", timeout=10).raise_for_status()
        requests.put(f"http://{host}:{port}/bkt/cache/pretrain-s3/manifest.json", data=json.dumps(_manifest(7, 70)),
                     timeout=10).raise_for_status()
        on_s3 = start_run(_cfg(mlflow_server.uri), f"run-{_uid()}", str(tmp_path / "runs"), TAGS,
                          prepared_dir="s3://AKIDEXAMPLE:s3cr3t@bkt/cache/pretrain-s3")
    finally:
        s3.stop()
    [item] = _inputs(mlflow_server, on_s3)
    assert (item["dataset"]["name"], item["dataset"]["source_type"], json.loads(item["dataset"]["source"])) == (
        "pretrain-s3", "s3", {"uri": "s3://***@bkt/cache/pretrain-s3"})
    assert json.loads(item["dataset"]["profile"])["tokens"] == 70 and "s3cr3t" not in json.dumps(item)

    unreadable = start_run(_cfg(mlflow_server.uri), f"run-{_uid()}", str(tmp_path / "runs"), TAGS,
                           prepared_dir=str(tmp_path / "nothing-here"))
    assert _inputs(mlflow_server, unreadable) == []


def test_artifacts_on_s3_without_boto3_name_the_extra(tmp_path, monkeypatch):
    """boto3 is the s3 extra (pyproject.toml): an experiment whose artifacts live on s3:// cannot take the final model
    without it, and the run's summary says so in one line naming the extra (MLflow's own error is an ImportError)."""
    import sys

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("bucket-artifacts", artifact_location="s3://no-such-bucket/mlflow")
    run_id = client.create_run(exp).info.run_id
    monkeypatch.setitem(sys.modules, "boto3", None)  # what import machinery reads as "not installed"
    (tmp_path / "model.pth").write_bytes(b"\0" * 64)
    out = log_final_artifacts(uri, run_id, pth_path=str(tmp_path / "model.pth"), safetensors_path=None,
                              tokenizer_dir=None, manifest_path=None, registered_model=None)
    assert out["errors"], out
    assert all(e.endswith("MLflow's artifacts on s3:// need boto3, which is not installed: pip install "
                          "'minimind-ray[s3]' (where the MLflow client, or the server that stores them, runs)")
               for e in out["errors"]), out["errors"]
