"""Checkpoints and pointers in a bucket, without Ray: the project's own code against a real S3-protocol server over HTTP
(moto's server mode behind the tests' proxy, reached through AWS_ENDPOINT_URL: cluster/local/s3_server.py; issue 49).

* A checkpoint in the bucket whose COMPLETE.json lists a file that is missing, or shorter than listed (any rank's),
  is refused in one line naming the object; the search for a run's newest checkpoint passes over it.
* ``<storage>/<stage>-latest`` in a bucket is a pointer object (S3 has no links), read wherever a ``-latest`` path
  is accepted (the weights of eval/export/serve/generate and ``train.init_from``).
* The store down when a run starts: one line naming checkpoint.storage_path and the endpoint, within 30 s, no
  traceback, before Ray starts.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from minimind_ray.fsio import upload_dir
from minimind_ray.model.config import ModelConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store import checkpoint as ck
from minimind_ray.store.reach import StorageUnreachable, check_storage
from minimind_ray.store.weights import load_weights

REPO = Path(__file__).resolve().parents[2]


def _local_checkpoint(root: Path, step: int, world: int = 2) -> Path:
    """What a ``world``-rank group leaves for one report (store.checkpoint's writers, as TrainState.save uses them)."""
    from minimind_ray.engine.state import RNGState

    d = root / f"checkpoint_2026-12-06_00-00-{step:02d}.000000"
    model = build_model(ModelConfig(**preset_values("tiny")), seed=step)
    for r in range(world):
        ck.write_rank_files(d, r, RNGState().state_dict())
    meta = ck.CheckpointMeta(step=step, epoch=0, data_state={}, world_size=world, stage="pretrain", total_steps=8,
                             config={"model": {"preset": "tiny", **preset_values("tiny")}}, prepared_dir="/nowhere")
    ck.write_shared_files(d, model_state=model.state_dict(), train_state={"scheduler": {}}, meta=meta)
    return d


@pytest.fixture
def bucket_run(s3, tmp_path):
    """A run directory in the bucket with two complete 2-rank checkpoints (steps 4 and 8): (its URI, {step: URI})."""
    run = s3.uri("unit", uuid.uuid4().hex[:8], "run")
    out = {}
    for step in (4, 8):
        d = _local_checkpoint(tmp_path, step)
        out[step] = f"{run}/{d.name}"
        upload_dir(d, out[step])
    return run, out


def test_a_bucket_checkpoint_missing_or_short_an_object_is_refused_in_one_line(s3, bucket_run):
    run, ckpts = bucket_run
    assert ck.open_checkpoint(ckpts[8]).step == 8 and ck.newest_complete(run).location == ckpts[8]
    key = ckpts[8].split(f"{s3.uri()}/", 1)[1]
    client = s3.client()
    # another rank's file never arrived (an upload keeps no order: COMPLETE.json came first)
    client.delete_object(Bucket="mmr-test", Key=f"{key}/rng/rank_1.pt")
    with pytest.raises(ck.CheckpointError) as e:
        ck.open_checkpoint(ckpts[8])
    assert str(e.value) == f"{ckpts[8]}: rng/rank_1.pt missing or of the wrong size; checkpoint refused"
    found = ck.newest_complete(run)  # the search passes over it, names the one it takes as a URI
    assert found.step == 4 and found.location == ckpts[4]
    # a shorter object than COMPLETE.json lists (written by hand, or by a tool that does not PUT whole)
    body = s3.read(f"{key.replace('_08.', '_04.')}/model.pth")
    client.put_object(Bucket="mmr-test", Key=f"{ckpts[4].split(f'{s3.uri()}/', 1)[1]}/model.pth", Body=body[:-7])
    with pytest.raises(ck.CheckpointError) as e:
        ck.open_checkpoint(ckpts[4])
    assert str(e.value) == f"{ckpts[4]}: model.pth missing or of the wrong size; checkpoint refused"
    assert "\n" not in str(e.value) and ck.newest_complete(run) is None


def test_the_latest_pointer_in_a_bucket_is_read_wherever_a_latest_path_is(s3, bucket_run, tmp_path):
    run, ckpts = bucket_run
    parent = run.rsplit("/", 1)[0]
    assert ck.mark_latest(run, "pretrain") == f"{parent}/pretrain-latest"
    key = f"{parent.split(f'{s3.uri()}/', 1)[1]}/pretrain-latest.json"
    assert json.loads(s3.read(key)) == {"run": "run", "stage": "pretrain"}
    assert ck.follow_latest(f"{parent}/pretrain-latest") == run == ck.follow_latest(f"{parent}/pretrain-latest.json")
    assert ck.follow_latest(run) == run and ck.follow_latest(str(tmp_path / "x-latest")) == str(tmp_path / "x-latest")
    # the weights the inference verbs and train.init_from read: the run's newest checkpoint
    lw = load_weights(f"{parent}/pretrain-latest")
    want = ck.open_checkpoint(ckpts[8]).model_state()
    assert lw.checkpoint.step == 8 and all(torch.equal(lw.state_dict[k], want[k]) for k in want)
    # a pointer that names no run is refused naming the pointer
    s3.client().put_object(Bucket="mmr-test", Key=key.replace("pretrain-", "sft-"), Body=b'{"run": "../x"}')
    with pytest.raises(ck.CheckpointError, match=f"^{parent}/sft-latest.json: not a -latest pointer"):
        load_weights(f"{parent}/sft-latest")


def test_the_store_down_at_the_start_is_one_line_naming_the_field_and_the_endpoint(s3, tmp_path):
    storage = s3.uri("unit", "down", "runs")
    check_storage(storage)  # up: nothing to say
    with pytest.raises(StorageUnreachable, match=r"^checkpoint.storage_path: s3://nobucket-x/runs cannot be read .*"
                                                 r"bucket 'nobucket-x' does not exist"):
        check_storage("s3://nobucket-x/runs")
    s3.cut()
    try:
        t = time.monotonic()
        with pytest.raises(StorageUnreachable) as e:
            check_storage(storage)
        assert time.monotonic() - t < 30
        assert str(e.value).startswith(f"checkpoint.storage_path: {storage} cannot be read at {s3.endpoint} (")
        # the CLI: one line, exit 2, no traceback, Ray never started
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "minimind_ray.cli", "pretrain", "--config",
                            "pipelines/configs/tiny.yaml", f"checkpoint.storage_path={storage}",
                            f"data.cache_dir={tmp_path / 'cache'}"], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
        took = time.monotonic() - t
    finally:
        s3.restore()
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, r.stdout + r.stderr
    assert err[0].startswith(f"config error: checkpoint.storage_path: {storage} cannot be read at {s3.endpoint} (")
    assert "Traceback" not in r.stdout + r.stderr and "Ray" not in r.stdout and took < 30, (took, r.stdout)


def test_credentials_in_a_uri_are_never_said(s3):
    """Keys belong in the AWS variables or files; a URI that carries them works but is said redacted (fsio.redact),
    in the storage check's line and in a checkpoint's refusal."""
    from cluster.local.s3_server import ACCESS_KEY, SECRET_KEY

    with_keys = f"s3://{ACCESS_KEY}:{SECRET_KEY}@nobucket-y/runs"
    with pytest.raises(StorageUnreachable) as e:
        check_storage(with_keys)
    assert SECRET_KEY not in str(e.value) and ACCESS_KEY not in str(e.value)
    assert str(e.value).startswith("checkpoint.storage_path: s3://***@nobucket-y/runs cannot be read"), str(e.value)
    # unescaped, the secret's '/' makes the URI unparsable: pyarrow's error repeats the URI, which fsio redacts
    with pytest.raises(ValueError) as e:
        ck.open_checkpoint(f"s3://{ACCESS_KEY}:{SECRET_KEY}@mmr-test/unit/none/checkpoint_x")
    assert SECRET_KEY not in str(e.value) and "s3://***@mmr-test/unit/none/checkpoint_x" in str(e.value)
    escaped = SECRET_KEY.replace("/", "%2F").replace("+", "%2B")
    with pytest.raises(ck.CheckpointError) as e:
        ck.open_checkpoint(f"s3://{ACCESS_KEY}:{escaped}@mmr-test/unit/none/checkpoint_x")
    assert escaped not in str(e.value) and SECRET_KEY not in str(e.value) and str(e.value).startswith("s3://***@mmr-test/unit/none/checkpoint_x: ")


def test_what_a_failed_bucket_run_writes_goes_to_the_bucket_never_the_working_folder(s3, tmp_path, monkeypatch):
    """CI, stop 52: a bucket run whose restarts were spent wrote its error.log to ``./s3:/<bucket>/...`` (a local
    writer given the URI, whose Path collapsed ``s3://``). Text, JSON and torch files written through fsio's atomic
    writers land in the bucket; the local writer refuses a URI, collapsed or not, instead of writing a folder ``s3:``."""
    from minimind_ray.fsio import atomic_write, torch_save_atomic, write_json_atomic
    from minimind_ray.raytrain.failed import write_error_log

    monkeypatch.chdir(tmp_path)
    run = s3.uri("unit", uuid.uuid4().hex[:8], "run")
    key = run.split("mmr-test/", 1)[1]
    assert write_error_log(run, "one line", "Traceback ...") == f"{run}/error.log"
    assert s3.read(f"{key}/error.log").decode().split(" ", 2)[2] == "one line\n\nTraceback ...\n"
    write_json_atomic(f"{run}/eval/step-4.json", {"step": 4})
    torch_save_atomic({"w": torch.ones(2)}, f"{run}/x.pt")
    assert json.loads(s3.read(f"{key}/eval/step-4.json")) == {"step": 4}
    objects = [k for k in s3.keys(key) if not k.endswith("/")]  # (pyarrow keeps a folder as an empty "<dir>/" key)
    assert sorted(k.rsplit("/", 1)[1] for k in objects) == ["error.log", "step-4.json", "x.pt"]  # no temp left
    for uri in (f"{run}/y.txt", Path(f"{run}/y.txt")):
        with pytest.raises(ValueError, match="a URI"):
            atomic_write(uri, lambda tmp: Path(tmp).write_text("y"))
    assert list(tmp_path.iterdir()) == []
