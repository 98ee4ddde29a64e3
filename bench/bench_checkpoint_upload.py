"""What a checkpoint costs the training loop, by where it goes and how (issue 49; docs/reliability.md): not a test.

The 26M ``minimind2-small`` (about 100 MB of fp32 weights and 200 MB of AdamW state per checkpoint), one Ray Train
worker on a local Ray, a checkpoint every --every steps. Side by side in one process, on the same warm Ray:

- local disk: ``checkpoint.storage_path`` a local folder (sync);
- S3, sync and async upload (``checkpoint.upload``), against moto's S3 server over HTTP on 127.0.0.1 (the tests'
  cluster/local/s3_server.py: moto behind a proxy, reached through AWS_ENDPOINT_URL);
- the same through the proxy capped at --mbps MB/s, a stand-in for a bucket across a network.

Each run logs, per checkpoint, the seconds the loop was blocked by it (MLflow metric ``perf/checkpoint_blocked_s``,
rank 0: writing the files and ``ray.train.report``; the last checkpoint is not logged: the run's logger closes
before it). The table gives the median of each, the median step time (``perf/step_time_s``: an async upload shares
the CPU with training) and each run's wall time.

    .venv/bin/python bench/bench_checkpoint_upload.py --steps 10 --every 2 --mbps 50
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import REPO, curve, load, table, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2, help="optimizer steps between checkpoints")
    ap.add_argument("--mbps", type=float, default=50.0, help="the throttled proxy's bandwidth, MB/s")
    ap.add_argument("--preset", default="minimind2-small")
    ap.add_argument("--only", nargs="*", help="labels to run (default: all)")
    args = ap.parse_args()

    from cluster.local import s3_server  # lazy: the AWS variables must be set before Ray is imported

    store = s3_server.reserve()  # the AWS variables, set before Ray starts: its workers have them
    store.start()
    import ray  # lazy: after the AWS variables (above)

    from minimind_ray.config import load_config  # lazy: after the AWS variables (above)
    from minimind_ray.raytrain.driver import run  # lazy: after the AWS variables (above)

    tmp = Path(tempfile.mkdtemp(prefix="mmr-bench-upload-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    configs = [("local disk", str(tmp / "runs"), "sync", None),
               ("S3 sync", store.uri("bench", "runs"), "sync", None),
               ("S3 async", store.uri("bench", "runs"), "async", None),
               (f"S3 sync, {args.mbps:g} MB/s", store.uri("bench", "runs"), "sync", args.mbps),
               (f"S3 async, {args.mbps:g} MB/s", store.uri("bench", "runs"), "async", args.mbps)]
    if args.only:
        configs = [c for c in configs if c[0] in args.only]
    rows = []
    for i, (label, storage, mode, mbps) in enumerate(configs):
        store.rate = mbps * 1e6 if mbps else None
        cfg = load_config("pipelines/configs/tiny.yaml", [
            f"name=upload-{i}", f"model.preset={args.preset}", f"train.max_steps={args.steps}",
            f"checkpoint.interval={args.every}", "checkpoint.num_to_keep=1", f"checkpoint.upload={mode}",
            f"checkpoint.storage_path={storage}", f"data.cache_dir={tmp}/cache", f"tracking.uri={uri}",
            "cluster.num_workers=1", "cluster.cpus_per_worker=2", "data.max_seq_len=128",
            "train.global_batch_size=4", "train.micro_batch_size=4", "train.log_interval=1", "resume=never"])
        res, wall = timed(run, cfg)
        c = curve(uri, res.mlflow_run_id, ("perf/checkpoint_blocked_s", "perf/step_time_s"))
        blocked, steps = list(c["checkpoint_blocked_s"].values()), list(c["step_time_s"].values())
        rows.append((label, statistics.median(blocked), len(blocked), statistics.median(steps), wall))
        print(f"{label}: blocked {[round(b, 2) for b in blocked]} s, run {wall:.0f} s", flush=True)
        if storage.startswith("s3://"):  # the next run's bucket starts empty
            import pyarrow.fs as pafs

            fs, path = pafs.FileSystem.from_uri(storage)
            fs.delete_dir_contents(path, missing_dir_ok=True)
    store.rate = None
    base = rows[0][1] if rows and rows[0][0] == "local disk" else None
    print(f"\n{args.preset}, 1 worker, a checkpoint every {args.every} steps, {args.steps} steps; "
          f"{load()}\n")
    table(("where, how", "blocked per checkpoint (median s)", "x local disk", "checkpoints timed", "median step s",
           "run s"), [(label, f"{b:.2f}", f"{b / base:.2f}" if base else "-", n, f"{step:.2f}", f"{wall:.0f}")
                      for label, b, n, step, wall in rows])
    ray.shutdown()
    store.stop()


if __name__ == "__main__":
    main()
