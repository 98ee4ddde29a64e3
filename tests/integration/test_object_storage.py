"""A run whose every location is a bucket (issue 49), against a real S3-protocol server over HTTP: moto's server mode
behind the tests' proxy (cluster/local/s3_server.py), reached the AWS way (AWS_ENDPOINT_URL, the AWS keys, and
MLFLOW_S3_ENDPOINT_URL for the MLflow server, all set in this process before the session's Ray started: its nodes
have them, as a cluster's nodes would; nothing is handed to the workers through a runtime_env).

One run covers most of what takes a location:
- ``data.train_path=s3://.../data/*.jsonl`` (a glob, which a file beside it does not match), prepared by the Ray Data
  job reading the bucket; ``data.cache_dir=s3://...``: the builtin tokenizer, the demo corpus it is trained on, the
  prepared Parquet and manifest are written there; ``checkpoint.storage_path=s3://...``: Ray Train's checkpoints,
  COMPLETE.json (every rank's files with sizes), the fault markers, the export;
- the store cut off as the step-8 checkpoint's upload begins, for longer than the upload's retries (the proxy resets
  every connection; moto keeps its buckets in memory, so it is never restarted); with ``cluster.max_failures=0`` the
  run ends like any failed start: one exception, the MLflow run FAILED;
- the same command again (``resume=auto``) finds the run in the bucket, resumes it from step 4 (never from the cut
  step-8 checkpoint) into the same MLflow run, and ends on the uninterrupted run's weights bit for bit
  (tiny_baseline: the same data, tokenizer and training settings, on local disk);
- ``runs/pretrain-latest.json``: the pointer object that stands for the ``-latest`` link; ``eval``, ``export`` and
  ``generate`` of ``s3://.../runs/pretrain-latest``, and the Serve replicas' loader on it;
- the MLflow server with ``--artifacts-destination s3://...``: the model, the loss plot and the checkpoint index land
  in the bucket, and the server's artifact listing (the UI's view) lists them;
- the secret key (a known value) is in none of: MLflow's params and tags, the console, any object the run left in
  the bucket, the failed run's exception.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from minimind_ray.data.demo import write_demo_corpus
from minimind_ray.raytrain.worker import staging_root
from minimind_ray.store.checkpoint import CheckpointError, newest_complete, open_checkpoint
from cluster.local.s3_server import SECRET_KEY

from .conftest import MlflowServer
from .helpers import STEPS, assert_exactly_once, new_shared, run_tiny, sample_record

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def cli(*args, timeout=240):
    p = subprocess.run([sys.executable, "-m", "minimind_ray.cli", *args], cwd=REPO, text=True, capture_output=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert SECRET_KEY not in p.stdout + p.stderr
    return p.stdout


def rest(uri, path):
    with urllib.request.urlopen(f"{uri}{path}", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.timeout(900)
def test_a_run_whose_every_location_is_a_bucket(ray_session, tiny_baseline, s3, tmp_path_factory, capfd):
    from mlflow.tracking import MlflowClient

    from minimind_ray.serve.model_io import load_served_model

    top = f"it-{uuid.uuid4().hex[:8]}"  # this test's prefix in the session's bucket
    local = tmp_path_factory.mktemp("s3run")
    demo = write_demo_corpus(str(local / "demo"))
    client = s3.client()
    client.put_object(Bucket="mmr-test", Key=f"{top}/data/pretrain.jsonl", Body=Path(demo["pretrain"]).read_bytes())
    client.put_object(Bucket="mmr-test", Key=f"{top}/data/notes.txt", Body=b"not training data")  # outside the glob
    server = MlflowServer(local / "mlflow", artifacts=s3.uri(top, "mlflow"))
    (local / "mlflow").mkdir()
    server.start()
    try:
        shared = {**new_shared(tmp_path_factory, "s3shared"), "cache": s3.uri(top, "cache"), "mlflow": server.uri}
        name, runs = "bucket-run", s3.uri(top, "runs")
        args = [f"data.train_path=[{s3.uri(top, 'data', '*.jsonl')}]", f"checkpoint.storage_path={runs}",
                "cluster.max_failures=0"]
        # the store goes away as the second checkpoint's (step 8's) weights start to upload, for 12 s: longer than
        # the upload's retries (pyarrow's: 3 tries), shorter than the time to the next command
        s3.cut_at(b"model.pth", nth=2, seconds=12)
        with pytest.raises(Exception) as failed:
            run_tiny(shared, name, *args)
        assert s3.cuts and "model.pth" in s3.cuts[-1][1], s3.cuts
        first = capfd.readouterr()
        run_dir = f"{runs}/{name}"
        cut = [p for p in s3.keys(f"{top}/runs/{name}/") if "/checkpoint_" in p]
        ckpt_dirs = sorted({p.split("/checkpoint_")[1].split("/")[0] for p in cut if "/checkpoint_20" in p})
        # step 4's, and what reached the bucket of step 8's before the cut; under load a later one's too: Ray marks
        # the worker failed when the upload thread fails, and the training thread goes on until the controller stops it
        assert len(ckpt_dirs) >= 2, cut
        for cut_dir in ckpt_dirs[1:]:
            with pytest.raises(CheckpointError):  # whatever order its files took, it is not whole
                open_checkpoint(f"{run_dir}/checkpoint_{cut_dir}")
        assert newest_complete(run_dir).step == 4  # what a restart would take
        while time.time() < s3.cuts[-1][0] + 12.5:  # the store comes back
            time.sleep(0.2)

        res = run_tiny(shared, name, *args)  # the same command again
        second = capfd.readouterr()
        assert f"[minimind-ray] resuming run {name} from step 4 of {STEPS} ({run_dir}/checkpoint_" in second.out
        _, attempts = sample_record(shared, name)
        assert attempts == {0, 4}  # the second fit's workers restored step 4, never the cut step 8
        per_step, _ = sample_record(shared, name)
        assert_exactly_once(per_step)
        assert res.checkpoint_dir.startswith(f"{run_dir}/checkpoint_")
        w = open_checkpoint(res.checkpoint_dir).model_state()
        w_ref = tiny_baseline[2]
        assert all(torch.equal(w[k], w_ref[k]) for k in w_ref), "the resumed bucket run differs from the baseline"
        # checkpoint.upload=async (the default): every staging folder went once uploaded, the cut one's with the failed
        # group (removed when the next group of the run started on this node)
        assert not staging_root(run_dir).exists()
        rec = json.loads(s3.read(res.checkpoint_dir.split("mmr-test/", 1)[1] + "/COMPLETE.json"))
        assert {"rng/rank_0.pt", "rng/rank_1.pt", "model.pth", "train_state.pt", "meta.json"} <= set(rec["files"])

        # one MLflow run, resumed into: FAILED by the cut, FINISHED by the second command, every step's loss once
        mlflow = MlflowClient(server.uri)
        found = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()],
                                   filter_string=f"attributes.run_name = '{name}'")
        assert len(found) == 1 and found[0].info.run_id == res.mlflow_run_id and found[0].info.status == "FINISHED"
        hist = mlflow.get_metric_history(res.mlflow_run_id, "train/loss")
        assert sorted({m.step for m in hist}) == list(range(1, STEPS + 1))
        # the artifacts in the bucket, listed by the server as the UI lists them
        listing = lambda p="": {f["path"] for f in rest(  # noqa: E731
            server.uri, f"/api/2.0/mlflow/artifacts/list?run_id={res.mlflow_run_id}&path={p}").get("files", [])}
        assert {"plots", "checkpoints"} <= listing()
        assert "plots/loss.png" in listing("plots") and "checkpoints/checkpoints.json" in listing("checkpoints")
        # the weights are the run's logged model (tracking/models.py), its files in the model's own artifact location
        outputs = rest(server.uri, f"/api/2.0/mlflow/runs/get?run_id={res.mlflow_run_id}")["run"]["outputs"]
        model_id = outputs["model_outputs"][0]["model_id"]
        model_files = rest(server.uri, f"/api/2.0/mlflow/logged-models/{model_id}/artifacts/directories")["files"]
        assert any(f["path"].endswith(".pth") for f in model_files), model_files
        in_bucket = s3.keys(f"{top}/mlflow/")
        assert any(k.endswith("/artifacts/plots/loss.png") for k in in_bucket), in_bucket
        assert any(k.endswith("/artifacts/checkpoints/checkpoints.json") for k in in_bucket)
        assert any(k.endswith(".pth") and f"/models/{model_id}/artifacts/" in k for k in in_bucket), in_bucket

        # every other location in the bucket: the tokenizer, the demo corpus it was trained on, the prepared data
        keys = s3.keys(f"{top}/")
        assert {f"{top}/cache/tokenizer-builtin/tokenizer.json", f"{top}/cache/demo/demo.json"} <= set(keys)
        manifests = [k for k in keys if k.startswith(f"{top}/cache/pretrain-") and k.endswith("/manifest.json")]
        assert len(manifests) == 1, keys
        prepared = s3.uri(manifests[0].rsplit("/", 1)[0])
        assert not (REPO / "s3:").exists()  # before issue 49, os.path.abspath of the cache made ./s3:/... here

        # -latest: a pointer object, read wherever a -latest path is accepted
        assert json.loads(s3.read(f"{top}/runs/pretrain-latest.json"))["run"] == name
        latest = f"{runs}/pretrain-latest"
        assert res.latest == latest
        out = cli("generate", "--weights", latest, "--prompt", "The capital of France", "--raw", "--temperature", "0",
                  "--max-new-tokens", "8")
        assert out.strip()
        ev = json.loads(cli("eval", "--weights", latest, "--data", prepared, "--micro-batch-size", "4",
                            "--batches", "2"))
        assert ev["eval_units"] > 0 and ev["eval_loss"] > 0
        exported = local / "export"
        cli("export", latest, "--out", str(exported))
        pth = next(exported.glob("pretrain_*.pth"))
        sd = torch.load(pth, weights_only=True)
        assert all(torch.equal(sd[k].float(), w[k].half().float()) for k in sd)
        served = load_served_model(latest)  # what each Serve replica runs
        assert served.name == "pretrain-latest" and served.tokenizer.vocab_size > 0

        # the secret key: nowhere
        run = mlflow.get_run(res.mlflow_run_id)
        assert SECRET_KEY not in json.dumps({"params": run.data.params, "tags": run.data.tags})
        said = first.out + first.err + second.out + second.err
        assert SECRET_KEY not in said and SECRET_KEY not in str(failed.value) + repr(failed.value)
        leaked = [k for k in s3.keys(f"{top}/") if SECRET_KEY.encode() in s3.read(k)]
        assert not leaked, leaked
    finally:
        server.stop()
