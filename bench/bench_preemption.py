"""Checkpoint on preemption, measured (docs/reliability.md, "Preemption"): not a test.

Part ``cost``: what asking Ray for a drain notice costs a training step. The same tiny run (2 workers, local Ray)
with ``checkpoint.preemption_check_interval`` = 1 (an ask after every step), the default (every train.log_interval)
and 0 (never), alternated --repeats times; the table gives the median step time of each, the mean ask's latency
(``ray.train.get_preemption_info``, a barrier of the ranks through Ray Train's synchronization actor; MLflow metric
perf/preemption_ask_ms) and the per-step cost it implies at each cadence.

Part ``drain``: a cluster/local cluster (head + 2 worker nodes, one trainslot each), the tiny run elastic 1..2
workers, Ray's default watcher poll (5 s) unless --poll-s; when step --at is trained, worker node 2 is drained with
a deadline of --deadline-s (``ray drain-node``, as cluster/spot/notice_watcher.py would) and killed at the deadline
(as the provider would). It reports: drain -> the ranks see the notice -> the notice's checkpoint saved -> the node
gone -> the first step after the restart (on the node left), the steps lost, and the final weights against the same
run without a drain.

    .venv/bin/python bench/bench_preemption.py --part cost --steps 60 --repeats 3
    .venv/bin/python bench/bench_preemption.py --part drain --deadline-s 30
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, cluster_script, curve, load, local_cluster, local_ray, sample_log, table

from minimind_ray.config import load_config
from minimind_ray.raytrain.driver import run
from minimind_ray.store.checkpoint import MODEL, checkpoints_in


def cost(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mmr-bench-preempt-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    ray = local_ray(4, dashboard=True, log_to_driver=False)
    cadences = {"every step": 1, f"every log interval ({args.log_interval})": None, "never": 0}
    rows = {k: [] for k in cadences}
    asks = {k: [] for k in cadences}
    for rep in range(args.repeats):
        for label, every in cadences.items():
            cfg = load_config("pipelines/configs/tiny.yaml", [
                f"name=cost-{rep}-{every}", f"train.max_steps={args.steps}", f"train.log_interval={args.log_interval}",
                f"checkpoint.interval={args.steps}", f"checkpoint.storage_path={tmp}/runs",
                f"data.cache_dir={tmp}/cache", f"tracking.uri={uri}",
                f"checkpoint.preemption_check_interval={'null' if every is None else every}"])
            c = curve(uri, run(cfg).mlflow_run_id, ("perf/step_time_s", "perf/preemption_ask_ms"))
            times = list(c["step_time_s"].values())
            rows[label].append(statistics.median(times[1:] or times))  # the first interval holds the warm-up
            asks[label] += c["preemption_ask_ms"].values()
    ray.shutdown()
    off = statistics.median(rows["never"])
    ask_ms = statistics.median(asks["every step"]) if asks["every step"] else float("nan")
    print(f"\nPreemption check, tiny preset, 2 workers, {args.steps} steps x {args.repeats} alternated runs; {load()}")
    cells = []
    for label, every in cadences.items():
        step = statistics.median(rows[label])
        n = 1 if every == 1 else (args.log_interval if every is None else 0)
        mean_ask = statistics.median(asks[label]) if asks[label] else 0.0
        per = f"{mean_ask / n:.2f} ms = {mean_ask / n / (off * 1000):.2%} of a step" if n else "0"
        cells.append((label, f"{step * 1000:.1f}", f"{step / off:.3f}x", f"{mean_ask:.2f}", per))
    table(("cadence", "median step time (ms)", "vs never", "mean ask (ms)", "per-step cost at this cadence"), cells)
    print(f"(one ask: {ask_ms:.2f} ms median over the every-step runs)")


def drain(args) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="mmr-bench-drain-"))
    poll = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(args.poll_s)} if args.poll_s else {}
    t = time.monotonic()
    with local_cluster(2, "--head-cpus", "2", "--worker-cpus", "1", **poll) as (base, state, env):
        print(f"cluster start: {time.monotonic() - t:.0f}s")
        drain_on(args, tmp, base, state, env)


def drain_on(args, tmp: Path, base: int, state: str, env: dict) -> None:
    def driver(name, *extra):
        samples = tmp / "samples" / name
        cmd = [sys.executable, "-m", "pipelines.pretrain", "--config", "pipelines/configs/tiny.yaml", f"name={name}",
               f"train.max_steps={args.steps}", "checkpoint.interval=10", "train.log_interval=2",
               f"checkpoint.storage_path={tmp}/runs", f"data.cache_dir={tmp}/cache", "tracking.enabled=false",
               f"train.sample_log_dir={samples}", f"cluster.address=127.0.0.1:{base}", "cluster.num_workers=2",
               "cluster.min_workers=1", "cluster.worker_resource=trainslot", "cluster.resource_timeout_s=5", *extra]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT), samples

    twin, _ = driver("twin")
    assert twin.wait(timeout=900) == 0, (tmp / "twin.log").read_text()[-3000:]
    p, samples = driver("drained", *([f"train.faults=[{args.at + 1}:slow:0:{args.stall_s}]"] if args.stall_s else []))
    while not any(x["step"] >= args.at for x in sample_log(samples)):
        assert p.poll() is None, (tmp / "drained.log").read_text()[-3000:]
        time.sleep(0.05)
    # Ray's CLI, not the dashboard's URL: since 2.60 a local cluster's API wants its token, which the CLI sends
    nodes = json.loads(subprocess.run([env["RAY_BIN"], "list", "nodes", "--address", f"http://127.0.0.1:{base + 1}",
                                       "--format", "json", "--limit", "100"], env=env, check=True, text=True,
                                      capture_output=True).stdout)
    node = next(n["node_id"] for n in nodes if n.get("node_name") == "w2" and n.get("state") == "ALIVE")
    t_drain = time.time()
    subprocess.run([env["RAY_BIN"], "drain-node", "--address", f"127.0.0.1:{base}", "--node-id", node,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "bench",
                    "--deadline-remaining-seconds", str(args.deadline_s)], env=env, check=True)
    t_accepted = time.time()
    time.sleep(max(0.0, t_drain + args.deadline_s - time.time()))
    cluster_script("kill_node.sh", "2", "--state-dir", state, env=env, timeout=60)  # the provider takes the node back
    t_killed = time.time()
    assert p.wait(timeout=900) == 0, (tmp / "drained.log").read_text()[-3000:]
    (marker,) = (tmp / "runs" / "drained" / ".preemption").glob("step-*.json")
    notice = json.loads(marker.read_text())
    after = [x for x in sample_log(samples) if x["attempt"] == notice["step"]]
    first_after = min(x["t"] for x in after) if after and "t" in after[0] else None
    trained_before = max(x["step"] for x in sample_log(samples) if x["attempt"] == 0)
    w = torch.load(Path(dict(checkpoints_in(tmp / "runs" / "drained"))[args.steps]) / MODEL, weights_only=True)
    w0 = torch.load(Path(dict(checkpoints_in(tmp / "runs" / "twin"))[args.steps]) / MODEL, weights_only=True)
    diff = max((w[k] - w0[k]).abs().max().item() for k in w)
    print(f"\nDrain of worker node 2 at step {args.at}, deadline {args.deadline_s}s, watcher poll "
          f"{args.poll_s or 5}s; tiny preset, elastic 1..2 workers, {args.steps} steps; {load()}")
    table(("event", "seconds after the drain"), [
        ("`ray drain-node` returned (accepted)", f"{t_accepted - t_drain:.1f}"),
        (f"the ranks saw the notice (step {notice['step']})", f"{notice['noticed_at'] - t_drain:.1f}"),
        ("the notice's checkpoint saved and reported", f"{notice['checkpointed_at'] - t_drain:.1f}"),
        ("node 2 killed (the deadline)", f"{t_killed - t_drain:.1f}"),
        *([("the first step after the restart (1 worker)", f"{first_after - t_drain:.1f}")] if first_after else [])])
    print(f"steps lost: {trained_before - notice['step']} (trained up to {trained_before}, restored "
          f"{notice['step']}); final weights vs the undrained twin: max|diff| {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("cost", "drain", "both"), default="both")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--at", type=int, default=15, help="drain: the step after which node 2 is drained")
    ap.add_argument("--stall-s", type=float, default=0.0, help="drain: rank 0 stalls this long after --at "
                                                                "(0: none; the run must outlast the notice)")
    ap.add_argument("--deadline-s", type=int, default=30)
    ap.add_argument("--poll-s", type=float, default=0.0, help="drain: RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (0: Ray's 5)")
    args = ap.parse_args()
    os.chdir(REPO)
    if args.part in ("cost", "both"):
        cost(args)
    if args.part in ("drain", "both"):
        drain(args)


if __name__ == "__main__":
    main()
