"""Worker nodes lost for real, on one cluster/local cluster (what users run: cluster/local/start.sh, on free ports,
stopping exactly what it started): a head and worker nodes 1 and 2, one trainslot each. The cluster is started once
for the module (a 3-node start and stop cost ~35 CPU seconds on 2 cores); each test begins with two worker nodes.

* A spot notice drains a node (below).
* User plug-ins reach the workers of every RL stage.
* A run sent with `ray job submit` to worker nodes that share no disk (issue 49: both started again with
  ``--no-shared-disk``; every location of the run in a bucket) loses a node mid-run (SIGKILL): elastic 2 -> 1 -> 2
  workers, every sample once.
* Last, the scripts themselves (cluster/local/*.sh): what start.sh printed and wrote, a node killed and started
  again, and a stop that ends exactly what start.sh started, decoys named like Ray's processes untouched.
* A spot notice drains a node (checkpoint on preemption, issue 23): the tiny run on 2 workers (a fixed size: it waits
  for a replacement); mid-run a stand-in of AWS's metadata service posts a spot notice for the node,
  cluster/spot/notice_watcher.py turns it into `ray drain-node --deadline-remaining-seconds`, Ray Train's
  PreemptionWatcher marks the ranks, every rank checkpoints the step it is at and holds. A replacement node joins,
  the drained node is killed at the deadline (the provider takes it), and the run restarts on 2 workers from that
  step. Steps lost: 0; every sample trained once; the final weights are bit for bit those of the uninterrupted twin
  (tiny_baseline: the same training settings).

(The node-loss job and the drain each started a cluster of their own before.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from minimind_ray.store.checkpoint import MODEL, checkpoints_in, open_checkpoint

from .helpers import CKPT_EVERY, GLOBAL_BATCH, STEPS, assert_exactly_once, build_wheel, sample_record
from .local_cluster import (RAY_BIN, REPO, _free_base, _sh, alive, cluster_state, comm, dashboard_json, ray_query,
                            session_pids, start_cluster)

pytestmark = pytest.mark.integration


class NodeCluster:
    """The module's cluster: its state dir, environment and base port, and which worker nodes are up."""

    def __init__(self, state: str, env: dict, base: int, started: str):
        self.state, self.env, self.base = state, env, base
        self.started = started  # what start.sh printed
        self.workers = [1, 2]  # worker node indices, in start order
        self.dashboard = f"http://127.0.0.1:{base + 1}"

    def start(self, node: int, private: bool = False) -> None:
        """start.sh --node: a worker node (back, or new), retried like the first start; ``private``: with a disk of
        its own (--no-shared-disk)."""
        r = start_cluster("--node", str(node), "--state-dir", self.state, *(["--no-shared-disk"] if private else []),
                          env=self.env)
        assert r.returncode == 0, r.stderr[-3000:]
        self.workers.append(node)

    def kill(self, node: int) -> None:
        """kill_node.sh: every process of the node at once, as when a machine is lost."""
        assert _sh("kill_node.sh", str(node), "--state-dir", self.state, env=self.env, timeout=60).returncode == 0
        self.workers.remove(node)


@pytest.fixture(scope="module")
def node_cluster(tiny_baseline):
    """Started after tiny_baseline, which the drain test compares with: the baseline then trains on the session's Ray
    with no second Ray on the machine (whose presence only makes Ray Train's placement-group cleaner complain)."""
    # Ray Train's drain watcher polls every 5 s by default (the drain test's notice is short); the dashboard's modules
    # get 120 s to start (30 by default, which a machine at load 15-40 misses)
    with cluster_state(RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.5",
                       RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT="120") as (state, env):
        base = _free_base(3)  # room for a third worker node: the drain's replacement
        r = start_cluster("2", "--state-dir", state, "--port", str(base), "--head-cpus", "2", "--worker-cpus", "1",
                          env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        yield NodeCluster(state, env, base, r.stdout)


@pytest.fixture
def two_worker_nodes(node_cluster):
    """The module's cluster with two worker nodes up (an earlier test may have left it with one)."""
    while len(node_cluster.workers) < 2:
        node_cluster.start(max([0, *node_cluster.workers]) + 1)
    return node_cluster


def common_args(tmp: Path, name: str):
    return ["--config", "pipelines/configs/tiny.yaml", f"name={name}", f"checkpoint.storage_path={tmp}/runs",
            f"data.cache_dir={tmp}/cache", f"tracking.uri=sqlite:///{tmp}/mlflow.db",
            f"train.sample_log_dir={tmp}/samples/{name}"]


def _wait_for(what: str, cond, driver: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Poll ``cond`` until true; fail naming ``what`` (with the driver's last output) when the driver ends first."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert driver.poll() is None, f"the driver ended before {what}: {log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s: {log.read_text()[-4000:]}"
        time.sleep(0.2)


def _lines(samples: Path, rank: int = 0):
    """A rank's sample-log lines so far, in the order written (a line being written is left out)."""
    f, out = samples / f"rank{rank}.jsonl", []
    for line in f.read_text().splitlines() if f.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


DEADLINE_S = 18  # the notice's length here (AWS gives ~120 s, GCE ~30 s): the ranks hold until it passes


class SpotNotice(BaseHTTPRequestHandler):
    """AWS IMDSv2 for one instance: no notice until ``at`` is set, then instance-action with that time."""
    at = None

    def log_message(self, *a):
        pass

    def do_PUT(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"token")

    def do_GET(self):
        if SpotNotice.at is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps({"action": "terminate", "time": SpotNotice.at}).encode())


def _node_id(dashboard: str, name: str) -> str:
    nodes = dashboard_json(f"{dashboard}/api/v0/nodes?limit=100")["data"]["result"]["result"]
    (node,) = [n for n in nodes if n.get("node_name") == name and n.get("state") == "ALIVE"]
    return node["node_id"]


@pytest.mark.timeout(900)
def test_a_drained_node_costs_no_step(two_worker_nodes, tiny_baseline, tmp_path):
    """A spot notice for a worker node: the ranks checkpoint the step they are at and hold; a replacement node joins,
    the drained node is taken at the deadline, and the run goes on from that step on 2 workers, 0 steps lost, bit for
    bit its uninterrupted twin."""
    cluster = two_worker_nodes
    env, base = cluster.env, cluster.base
    drained, replacement = cluster.workers[-1], max(cluster.workers) + 1
    name, samples = "drained", tmp_path / "samples" / "drained"
    run_dir = tmp_path / "runs" / name
    server = ThreadingHTTPServer(("127.0.0.1", 0), SpotNotice)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    SpotNotice.at = None
    log = tmp_path / "driver.log"
    # tiny_baseline's training settings (helpers.run_tiny); rank 0 stalls 9 s before step 6, once per run, so the
    # notice lands mid-run; it is checked every log interval (2 steps)
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipelines.pretrain", "--config", "pipelines/configs/tiny.yaml", f"name={name}",
         f"train.max_steps={STEPS}", f"checkpoint.interval={CKPT_EVERY}", "train.log_interval=2",
         f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=4", "train.collective_timeout_s=60",
         f"checkpoint.storage_path={tmp_path}/runs", f"data.cache_dir={tiny_baseline[0]['cache']}",
         f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"train.sample_log_dir={samples}",
         f"cluster.address=127.0.0.1:{base}", "cluster.num_workers=2", "cluster.worker_resource=trainslot",
         "cluster.resource_timeout_s=120", "train.faults=[6:slow:0:9]"],
        cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    watcher = None
    try:
        deadline = time.monotonic() + 400
        while not (samples / "rank0.jsonl").exists():  # the workers are up: their node ids are known
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        node = _node_id(cluster.dashboard, f"w{drained}")
        # the watcher polls the stand-in from now on (started early: its own start is not the notice's latency)
        watcher = subprocess.Popen(
            [sys.executable, str(REPO / "cluster/spot/notice_watcher.py"), "--provider", "aws", "--metadata-url",
             f"http://127.0.0.1:{server.server_address[1]}", "--interval-s", "0.2", "--node-id", node,
             "--address", f"127.0.0.1:{base}", "--ray", str(RAY_BIN)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while not any(x["step"] >= 5 for x in _lines(samples)):
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        drained_at = time.time()  # the provider posts its notice
        SpotNotice.at = datetime.fromtimestamp(drained_at + DEADLINE_S, tz=timezone.utc).isoformat().replace(
            "+00:00", "Z")
        out, _ = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, out
        while not list((run_dir / ".preemption").glob("step-*.json")):  # the ranks checkpointed and hold
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        cluster.start(replacement)
        time.sleep(max(0.0, drained_at + DEADLINE_S - time.time()))
        cluster.kill(drained)  # taken back by the provider
        assert driver.wait(timeout=600) == 0, log.read_text()[-5000:]
    finally:
        server.shutdown()
        for p in (driver, watcher):
            if p is not None and p.poll() is None:
                p.kill()
    (marker,) = (run_dir / ".preemption").glob("step-*.json")
    notice = json.loads(marker.read_text())
    at = notice["step"]
    per_step, attempts = sample_record({"base": tmp_path}, name)
    first = [x for x in _lines(samples) if x["attempt"] == 0]
    # steps lost: 0. The first worker group trained up to the notice's step and no further; the next restored it
    assert max(x["step"] for x in first) == at and attempts == {0, at}, (at, attempts)
    assert at in (6, 8, 10), at
    assert_exactly_once(per_step, steps=STEPS)
    worlds = {x["attempt"]: x["world"] for x in _lines(samples)}
    assert worlds == {0: 2, at: 2}, worlds  # the same size again, on node 1 and the replacement
    ckpts = dict(checkpoints_in(run_dir))
    w = torch.load(Path(ckpts[STEPS]) / MODEL, weights_only=True)
    assert all(torch.equal(w[k], tiny_baseline[2][k]) for k in w), "the preempted run differs from its twin"
    text = log.read_text()
    assert f"drain notice at step {at}" in text and f"restored step {at}" in text
    print(f"\npreemption: drain sent -> checkpoint of step {at} saved {notice['checkpointed_at'] - drained_at:.1f}s; "
          f"notice seen by the ranks {notice['noticed_at'] - drained_at:.1f}s after the drain; "
          f"{notice['asks']} asks cost {notice['ask_seconds'] * 1000 / max(notice['asks'], 1):.1f} ms each; "
          f"steps lost 0; final weights equal the twin's")


USER_REWARDS = '''"""A user's reward terms, outside the repository: each call notes where this module was imported from."""
import json
import os

MARKS = {marks!r}


def _note(kind):
    import minimind_ray
    with open(os.path.join(MARKS, f"{{kind}}-{{os.getpid()}}.json"), "w") as f:
        json.dump({{"file": __file__, "minimind_ray": minimind_ray.__file__}}, f)


def ppo_bonus(prompts, completions, answers, **kwargs):
    _note("ppo")
    return [0.0] * len(completions)


def agent_bonus(trajectories, **kwargs):
    _note("agent")
    return [0.0] * len(trajectories)
'''

USER_TOOLS = '''"""A user's tool, outside the repository: the agent's tool worker loads it at the start; that import notes
where from (the driver's own import, when it checks the config, does not count)."""
import json
import os
import sys

if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", "") == "minimind_ray.rl.tool_worker":
    with open(os.path.join({marks!r}, f"tool-{{os.getpid()}}.json"), "w") as f:
        json.dump({{"file": __file__}}, f)


def add(a, b):
    return a + b
'''


@pytest.mark.timeout(900)
def test_user_plugins_reach_the_workers_of_every_rl_stage(two_worker_nodes, tmp_path):
    """Issue 33: a PPO run and an agent run, sent with `ray job submit` (the repo as the working dir), whose reward
    terms and tool are the user's own modules in a folder outside the repository. Only the driver can see that folder
    (its own PYTHONPATH, in the job's entry point); the job's working_dir does not hold it, and Ray passes no driver
    path to the workers when there is a working_dir. The workers import the modules only because the run ships them
    (the stage's record names them: stages/<stage>.py plugins; raytrain/runtime_env.py ships them as py_modules): each
    term ran on a training worker, and the tool was loaded by the agent's tool worker, from Ray's copy of the module.
    Before, only GRPO's reward terms were shipped, and these runs failed on every worker ("No module named ...").

    The PPO job is also the package's way onto a stock cluster (issue 55, cluster/README.md "The package"): no working
    dir, the project's wheel in the job's ``pip`` runtime env, and the wheel's console script as the entry point. Its
    workers run the project from Ray's virtualenv of that job, not from this checkout."""
    from minimind_ray.config import load_config
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.pth import save_pth

    cluster = two_worker_nodes
    plugins, marks = tmp_path / "user-plugins", tmp_path / "marks"
    plugins.mkdir()
    marks.mkdir()
    (plugins / "my_rewards.py").write_text(USER_REWARDS.format(marks=str(marks)))
    (plugins / "my_tools.py").write_text(USER_TOOLS.format(marks=str(marks)))
    base = tmp_path / "base.pth"
    save_pth(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=5), str(base),
             dtype=torch.float32)
    tiny = ["model.preset=tiny", "data.train_path=[demo]", f"train.init_from={base}", "train.max_steps=2",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.log_interval=1", "checkpoint.interval=2",
            "cluster.num_workers=1", "train.warmup_steps=1", "tracking.enabled=false",
            f"checkpoint.storage_path={tmp_path}/runs", f"data.cache_dir={tmp_path}/cache"]
    runs = {
        "ppo": ["data.format=prompt", "data.max_seq_len=48", "train.ppo.max_gen_len=4",
                "train.ppo.rewards=[{name: 'my_rewards:ppo_bonus'}]"],
        "agent": ["data.format=agent_rl", "data.max_seq_len=320", "train.agent.num_generations=2",
                  "train.agent.max_gen_len=8", "train.agent.max_total_len=360", "train.agent.max_turns=1",
                  "train.agent.rewards=[{name: 'my_rewards:agent_bonus'}]",
                  "train.agent.tools=[{name: add, function: 'my_tools:add', schema: {type: function, function: "
                  "{name: add, parameters: {type: object, properties: {a: {type: number}, b: {type: number}}}}}}]"],
    }
    mirror = {"env_vars": {"MINIMIND_RAY_TOKENIZER_MIRROR": os.environ["MINIMIND_RAY_TOKENIZER_MIRROR"]}}
    # a version label of its own: this checkout's editable install (0.1.0), which Ray's virtualenv copies from the
    # node's environment, would otherwise satisfy the wheel's requirement and stay
    wheel = build_wheel(tmp_path / "wheel", local_version="job")
    # its driver starts in a folder of its own: Ray puts a driver's current directory on its workers' sys.path
    # (ray/_private/worker.py, without a working dir), and this cluster's nodes were started in this checkout, whose
    # minimind_ray would come first there; a stock cluster's nodes do not run inside a checkout
    how = {  # stage: (how the job is sent, the entry point after `env [-C dir] PYTHONPATH=...`)
        "ppo": (["--runtime-env-json", json.dumps({**mirror, "pip": [str(wheel)]})], ["minimind-ray", "ppo"]),
        "agent": (["--working-dir", str(REPO), "--runtime-env-json", json.dumps(mirror)],
                  ["python", "-m", "pipelines.agent"])}
    jobs = {}  # both jobs at once, as two users would send them (one training worker each: the cluster holds both)
    for stage, extra in runs.items():
        log = tmp_path / f"{stage}.log"
        submit, entry = how[stage]
        chdir = ["-C", str(tmp_path)] if stage == "ppo" else []
        with open(log, "w") as out:
            jobs[stage] = (log, subprocess.Popen(
                [str(RAY_BIN), "job", "submit", "--address", cluster.dashboard, *submit, "--",
                 "env", *chdir, f"PYTHONPATH={plugins}", *entry, f"name=plugins-{stage}", *tiny, *extra],
                cwd=tmp_path, env=cluster.env, stdout=out, stderr=subprocess.STDOUT))
    try:
        for stage, (log, job) in jobs.items():  # the job client follows the job's log to its end: its exit is the job's
            assert job.wait(timeout=600) == 0 and "succeeded" in log.read_text().lower(), log.read_text()[-5000:]
    finally:
        for _, job in jobs.values():
            if job.poll() is None:
                job.kill()
    notes = {p.name.split("-")[0]: json.loads(p.read_text()) for p in marks.glob("*.json")}
    assert set(notes) == {"ppo", "agent", "tool"}, sorted(p.name for p in marks.glob("*.json"))
    assert not any(n["file"].startswith(str(plugins)) for n in notes.values()), notes  # Ray's copy, not the folder
    # the wheel's job: the project from the job's virtualenv (Ray's runtime_resources), the other from the working dir
    assert "/runtime_resources/pip/" in notes["ppo"]["minimind_ray"], notes["ppo"]
    assert not notes["agent"]["minimind_ray"].startswith(str(REPO / "minimind_ray")), notes["agent"]


@pytest.mark.timeout(900)
def test_a_job_on_nodes_that_share_no_disk_continues_after_losing_a_worker_node(two_worker_nodes, mlflow_server, s3,
                                                                               tmp_path):
    """`ray job submit` (the repo as the job's working dir) runs the tiny pretrain on the cluster, with one training
    worker per node (trainslot), elastic 1..2 workers, on worker nodes that share no disk (issue 49): both are started
    again with ``start.sh --node K --no-shared-disk``: each in a mount namespace of its own (cluster/local/
    private_disk.sh) with fresh /tmp, /var/tmp, /dev/shm and ~/.cache and the code and venv read-only. The head is
    the driver's machine: the job's driver, its working folder and everything the test writes are in this machine's
    /tmp, which no worker node can see. So every location of the run is in the bucket (data.cache_dir: the demo
    corpus, the builtin tokenizer, the prepared data; checkpoint.storage_path; the sample log), MLflow is a server.
    A worker node is killed mid-run: the run restarts from its last checkpoint on the node that is left. The node is
    started again (without a shared disk): Ray Train's elastic policy sees its trainslot come back and restarts the
    group with 2 workers from the newest checkpoint (docs/training.md, "Elastic scale-up"). The world goes 2 -> 1 -> 2
    workers, every sample is trained once and every step trains one global batch of 16 samples, whatever the world
    size; the job succeeds, its MLflow run FINISHED and tagged with the job's id."""
    from mlflow.tracking import MlflowClient

    cluster = two_worker_nodes
    for node in list(cluster.workers):  # the module's worker nodes again, each with a disk of its own
        cluster.kill(node)
        cluster.start(node, private=True)
    env, base, lost = cluster.env, cluster.base, cluster.workers[-1]
    # a file this machine (the driver's) wrote is on neither worker node: a task on each (one trainslot apiece) looks
    mine = tmp_path / "driver-only.txt"
    mine.write_text("written by the driver's machine")
    # (on each worker node by its id, once both have registered: `ray start` returns before that, and two tasks
    # that only ask for a trainslot may both run on one node, one after the other)
    seen = ray_query(f"127.0.0.1:{base}", "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy\n"
                     "t0 = time.time()\n"
                     "while True:\n"
                     "    nodes = [n['NodeID'] for n in ray.nodes() if n['Alive'] and n['Resources'].get('trainslot')]\n"
                     "    if len(nodes) >= 2 or time.time() - t0 > 60: break\n"
                     "    time.sleep(0.25)\n"
                     "@ray.remote(num_cpus=0)\n"
                     "def look(p):\n    import os\n    return [os.path.exists(p), ray.get_runtime_context().get_node_id()]\n"
                     f"print(json.dumps([__import__('os').path.exists({str(mine)!r}), ray.get([look.options("
                     f"scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote({str(mine)!r}) "
                     f"for n in nodes])]))\n")
    assert seen[0] is True and [s[0] for s in seen[1]] == [False, False] and len({s[1] for s in seen[1]}) == 2, seen
    mine.unlink()
    steps, name = 25, "node-loss"  # 15 steps after the scale-up: enough to see 2 workers train again
    top = f"nodes-{uuid.uuid4().hex[:8]}"
    runs, samples, log = s3.uri(top, "runs"), f"{top}/samples/{name}/", tmp_path / "driver.log"
    # Rank 0 stalls up to 300 s at step 14, which the run reaches on 1 worker: room for the node to come
    # back and for the group to grow. A resize ends the stall early: the new group restores from the
    # step-10 checkpoint and the fault, fired once per run, does not fire again.
    # the job client follows the job's log to its end: its exit is the job's
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [str(RAY_BIN), "job", "submit", "--address", f"http://127.0.0.1:{base + 1}", "--working-dir", str(REPO),
             "--", "python", "-m", "pipelines.pretrain", "--config", "pipelines/configs/tiny.yaml", f"name={name}",
             f"checkpoint.storage_path={runs}", f"data.cache_dir={s3.uri(top, 'cache')}",
             f"tracking.uri={mlflow_server.uri}", f"train.sample_log_dir={s3.uri(samples)}",
             "cluster.num_workers=2", "cluster.min_workers=1", "cluster.worker_resource=trainslot",
             "cluster.resource_timeout_s=20", f"train.max_steps={steps}", "checkpoint.interval=5",
             "train.faults=[14:slow:0:300]"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("step 8 on 2 workers", lambda: any(r["step"] >= 8 for r in _bucket_lines(s3, samples)), driver, log)
        cluster.kill(lost)
        _wait_for("step on 1 worker", lambda: any(r["world"] == 1 for r in _bucket_lines(s3, samples)), driver, log)
        cluster.start(lost, private=True)
        assert driver.wait(timeout=600) == 0 and "succeeded" in log.read_text().lower(), log.read_text()[-5000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    run_dir = f"{runs}/{name}"
    assert max(open_checkpoint(f"{run_dir}/{p.rsplit('/', 1)[1]}").step for _, p in checkpoints_in(run_dir)) == steps
    client = MlflowClient(mlflow_server.uri)
    found = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"attributes.run_name = '{name}'")
    assert len(found) == 1 and found[0].info.status == "FINISHED"
    assert "ray.job_submission_id" in found[0].data.tags
    # cluster.resource_timeout_s reached the submitted job's controller: a restart that still asked for 2 workers
    # (the coordinator had not yet seen the node die) gave up after 20 s, not Ray Train's default 60
    waits = re.findall(r"could not be placed within cluster\.resource_timeout_s \(([\d.]+) s\)", log.read_text())
    assert waits and all(float(w) == 20 for w in waits), waits
    lines = _bucket_lines(s3, samples, every_rank=True)
    per_step = defaultdict(set)
    for r in lines:
        per_step[r["step"]].update(r["ids"])
    assert_exactly_once(per_step, steps=steps)
    worlds = [r["world"] for r in sorted((r for r in lines if r["rank"] == 0), key=lambda r: r["t"])]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [2, 1, 2], worlds
    # every step a worker group completed trained 16 samples, split over its ranks (8 + 8, or 16 on one)
    by = defaultdict(list)
    for r in lines:
        by[r["attempt"], r["world"], r["step"]].append(len(r["ids"]))
    complete = {k: v for k, v in by.items() if len(v) == k[1]}
    assert {k[1] for k in complete} == {1, 2} and all(sum(v) == 16 for v in complete.values()), complete
    # nothing of the run on this machine's disk but what the test itself wrote: every location was the bucket
    assert sorted(p.name for p in tmp_path.iterdir()) == ["driver.log"]


def _bucket_lines(s3, prefix: str, every_rank: bool = False) -> list:
    """The sample log in the bucket (one object per rank and step: raytrain/faults.py:SampleLog), rank 0's unless
    ``every_rank``, in the order written."""
    keys = sorted((k for k in s3.keys(prefix) if k.endswith(".json")),  # not the folders' marker objects
                  key=lambda k: int(k.rsplit("/", 1)[1].split("-", 1)[0]))
    for k in keys:
        if k not in _READ:  # objects are written once: each is read once
            _READ[k] = json.loads(s3.read(k))
    return [_READ[k] for k in keys if every_rank or f"{prefix}rank0/" in k]


_READ: dict = {}


@pytest.fixture
def decoys(tmp_path):
    """Processes named like Ray's that are not ours: stop.sh must not touch them (a global `ray stop` would)."""
    procs = []
    for name in ("raylet", "gcs_server"):
        exe = tmp_path / name
        shutil.copy("/bin/sleep", exe)
        procs.append(subprocess.Popen([str(exe), "300"]))
    yield procs
    for p in procs:
        p.kill()
        p.wait()


NODES = ("nodes = [{'name': n['NodeName'], 'alive': n['Alive'], 'res': n['Resources']} for n in ray.nodes()]\n"
         "print(json.dumps(nodes))\n")


def _wait_gone(name: str, back: bool = False) -> str:
    """A driver's code: wait up to 60 s until node ``name`` is no longer alive (``back``: alive again; `ray start`
    says the runtime started before the new raylet has registered with the GCS); the live nodes and the wait."""
    return ("t0 = time.time()\n"
            "while True:\n"
            "    alive = sorted(n['NodeName'] for n in ray.nodes() if n['Alive'])\n"
            f"    if ({name!r} in alive) == {back!r} or time.time() - t0 > 60: break\n"
            "    time.sleep(0.25)\n"
            "print(json.dumps({'alive': alive, 'waited': time.time() - t0,\n"
            "                  'trainslot': ray.cluster_resources().get('trainslot', 0)}))\n")


def test_the_scripts_start_kill_restart_and_stop_exactly_what_they_started(two_worker_nodes, decoys):
    """cluster/local/*.sh on the module's cluster, last in the module (it stops the cluster): start.sh printed the
    addresses and wrote cluster.env (valid shell); the job server answers on loopback; each worker node has its
    trainslot and the head none; kill_node.sh ends one node's processes at once and Ray notices; start.sh --node
    brings it back from cluster.env; stop.sh ends every process start.sh started, and no other."""
    cluster = two_worker_nodes
    state, env, base = cluster.state, cluster.env, cluster.base
    address, dashboard = f"127.0.0.1:{base}", cluster.dashboard
    assert f"Ray address:    {address}" in cluster.started and dashboard in cluster.started, cluster.started
    assert dashboard_json(f"{dashboard}/api/version", timeout=10)["ray_version"]
    r = subprocess.run(["bash", "-c", 'source "$1/cluster.env" && echo "$RAY_ADDRESS $RAY_API_SERVER_ADDRESS '
                        '$MMRAY_BASE_PORT $MMRAY_STATE"', "-", state], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == [address, dashboard, str(base), state], (r.stdout, r.stderr)

    names = ["h"] + [f"w{n}" for n in cluster.workers]
    nodes = {n["name"]: n for n in ray_query(address, NODES) if n["alive"]}
    assert set(nodes) == set(names), nodes
    assert all(nodes[w]["res"].get("trainslot") == 1.0 for w in names[1:]) and "trainslot" not in nodes["h"]["res"]
    leaders = {n: int((Path(state) / f"{n}.pid").read_text()) for n in names}
    started = {n: session_pids(pid) for n, pid in leaders.items()}
    assert {"gcs_server", "raylet"} <= {comm(p) for p in started["h"]}, started
    assert all("raylet" in {comm(p) for p in started[w]} for w in names[1:]), started

    lost = cluster.workers[-1]
    cluster.kill(lost)  # kill_node.sh: that node's processes are gone at once, the others' are not
    assert not [p for p in started[f"w{lost}"] if alive(p)]
    assert all(alive(leaders[n]) for n in names if n != f"w{lost}")
    after = ray_query(address, _wait_gone(f"w{lost}"))
    assert f"w{lost}" not in after["alive"] and after["trainslot"] == len(names) - 2, after

    cluster.start(lost)  # start.sh --node reads the cluster's settings back from cluster.env, as data
    leaders["again"] = int((Path(state) / f"w{lost}.pid").read_text())
    started["again"] = session_pids(leaders["again"])
    back = {n["name"]: n for n in ray_query(address, _wait_gone(f"w{lost}", back=True) + NODES) if n["alive"]}
    assert set(back) == set(names) and back[f"w{lost}"]["res"].get("trainslot") == 1.0, back

    r = _sh("stop.sh", "--state-dir", state, env=env, timeout=90)
    assert r.returncode == 0, f"stop.sh failed:\n{r.stdout}\n{r.stderr}"
    left = [p for pids in started.values() for p in pids if alive(p)]
    left += [p for pid in leaders.values() for p in session_pids(pid)]
    assert not left, f"still running after stop.sh: {[(p, comm(p)) for p in left]}"
    assert all(d.poll() is None for d in decoys), "stop.sh killed processes it did not start"
    assert not list(Path(state).glob("*.pid")) and not (Path(state) / "cluster.env").exists()
    cluster.workers.clear()  # nothing is left to stop
