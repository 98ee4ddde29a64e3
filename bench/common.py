"""What the benchmarks share: tables, the local Ray or cluster/local cluster they start, the CPU of the processes
they start, before/after rounds, a run's curves from MLflow, an RL demo's run and scores. A bench script starts with
``from common import ...`` (its folder, bench/, is first on sys.path): that puts this checkout's root first, so
``minimind_ray`` is the code of the checkout the script belongs to, not an editable install elsewhere."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

REPO = Path(__file__).resolve().parents[1]
if sys.path[:1] != [str(REPO)]:
    sys.path.insert(0, str(REPO))
# No minimind_ray import at the top: a before/after worker imports this module, then puts the tree it measures
# (--src) first on sys.path before it imports minimind_ray; the functions below import what they use.
# a dashboard's modules (local_ray(dashboard=True), cluster/local) start in more than Ray's 30 s on a busy machine
os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "120")
BASE_REV = "b090f53"  # the last commit before the static KV cache (issue 35): the default "before" of --before


def load() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def table(head, rows) -> None:
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def local_ray(cpus: int = 4, dashboard: bool = False, env: dict = {}, **init):  # noqa: B006 (read only)
    """A local Ray of ``cpus`` logical CPUs whose workers import this checkout (and see ``env``)."""
    import ray

    ray.init(num_cpus=cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1", **init, runtime_env={
        "env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **env}})
    return ray


def cluster_script(name: str, *args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "cluster" / "local" / name), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@contextlib.contextmanager
def local_cluster(worker_nodes: int, *start_args: str, **env_vars: str):
    """cluster/local/start.sh's cluster at a free base port: (base port, state dir, the environment of cluster/local's
    scripts and of its drivers), stopped on exit."""
    state = tempfile.mkdtemp(prefix="mmrb", dir="/tmp")  # short: Ray's socket paths live under it
    # RAY_AUTH_MODE: a driver naming the cluster's address sends its token only in token mode (start.sh)
    env = dict(os.environ, RAY_BIN=str(Path(sys.executable).parent / "ray"), RAY_health_check_period_ms="500",
               RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "token"),
               RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="4",
               RAY_health_check_initial_delay_ms="1000", **env_vars)
    env.pop("RAY_ADDRESS", None)
    try:
        for base in random.sample(range(27000, 33000, 100), 5):
            r = cluster_script("start.sh", str(worker_nodes), "--state-dir", state, "--port", str(base), *start_args,
                               env=env)
            if r.returncode == 0 or "ports already in use" not in r.stderr:
                break
        if r.returncode:
            raise RuntimeError(f"cluster/local/start.sh failed: {r.stderr[-2000:]}")
        yield base, state, env
    finally:
        cluster_script("stop.sh", "--state-dir", state, "--timeout", "10", env=env, timeout=120)
        shutil.rmtree(state, ignore_errors=True)


def cpu_by_process(roles=(), me: str = "this") -> dict:
    """{pid: (role, CPU seconds so far)} of this process (role ``me``) and of every process it started (Ray's, a
    subprocess's): a process's role is the first of ``roles`` ((role, a text of its command line)) that it matches,
    else "other ray". Processes other jobs on the machine started are not counted."""
    import psutil

    this, out = psutil.Process(), {}
    for p in [this, *this.children(recursive=True)]:
        try:
            cmd, t = " ".join(p.cmdline()), p.cpu_times()
            role = me if p.pid == this.pid else next((r for r, key in roles if key in cmd), "other ray")
            out[p.pid] = (role, t.user + t.system)
        except psutil.Error:  # it ended meanwhile
            continue
    return out


def cpu_spent(before: dict, after: dict) -> dict:
    """{role: CPU seconds} between two :func:`cpu_by_process` samples, process by process (one that started between
    them counts whole; one that ended between them is not seen)."""
    spent = {}
    for pid, (role, t) in after.items():
        spent[role] = spent.get(role, 0.0) + t - before.get(pid, (role, 0.0))[1]
    return spent


def fresh_model(preset: str):
    """A freshly initialised model of ``preset`` (seed 0): speed does not depend on what the weights learned."""
    from minimind_ray.config import ModelConfig  # lazy: not before a worker's --src (the top)
    from minimind_ray.model.minimind import build_model  # lazy: the same
    from minimind_ray.model.presets import preset_values  # lazy: the same

    return build_model(ModelConfig(**preset_values(preset)), seed=0)


def fresh_weights(preset: str, work: Path) -> str:
    """:func:`fresh_model` of ``preset`` saved as ``work/<preset>.pth`` (a model file the verbs read); its path."""
    from minimind_ray.store.pth import save_pth  # lazy: not before a worker's --src (the top)

    save_pth(fresh_model(preset), str(work / f"{preset}.pth"))
    return str(work / f"{preset}.pth")


def sample_log(d) -> list:
    """The rows of a run's sample log (train.sample_log_dir, rank<r>.jsonl: a row per rank and step)."""
    rows = []
    for f in Path(d).glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
                rows.append(json.loads(line))
    return rows


def rank0_times(rows, attempt=None) -> dict:
    """{step: when its batches reached rank 0}, of one ``attempt`` (the step a worker group restored) or all."""
    return {r["step"]: r["t"] for r in rows if r["rank"] == 0 and (attempt is None or r["attempt"] == attempt)}


def timed(fn, *args, **kwargs):
    """``fn``'s result and the wall seconds it took."""
    t0 = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - t0


def export_tree(rev: str) -> Path:
    """The files of commit ``rev`` in a fresh temporary directory (left for the OS to clean)."""
    out = Path(tempfile.mkdtemp(prefix=f"minimind-ray-{rev}-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def run_worker(script: Path, src: Path, args: list, threads: int) -> dict:
    """``script --worker --src SRC args`` in a fresh interpreter; its last stdout line is its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), "--worker", "--src", str(src), *args], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{script.name} worker on {src} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_main(args, measure) -> int:
    """The other end of :func:`run_worker`: ``measure(args)`` on the code of the tree ``args.src`` (first on sys.path
    from here on, before ``measure`` imports minimind_ray) at ``args.threads`` torch threads; its JSON result the
    last stdout line."""
    sys.path.insert(0, args.src)
    import torch

    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args)))
    return 0


def before_after(script: str, args: list, threads: int, rounds: int, rev, score, show):
    """``rounds`` rounds of ``script``'s worker on commit ``rev``'s code ("before") and on this checkout's ("after"),
    alternating (the load of a shared machine drifts): (rev, {side: {key: the best round's value by ``score``}}, the
    load averages); ``show`` formats a value for the progress lines."""
    rev = rev or BASE_REV
    trees, loads, best = {"before": export_tree(rev), "after": REPO}, [os.getloadavg()[0]], {"before": {}, "after": {}}
    for r in range(rounds):
        for side, tree in trees.items():
            got = run_worker(Path(script).resolve(), tree, args, threads)
            for k, v in got.items():
                if k not in best[side] or score(v) > score(best[side][k]):
                    best[side][k] = v
            print(f"round {r + 1} {side}: " + ", ".join(f"{k} {show(v)}" for k, v in got.items()), flush=True)
        loads.append(os.getloadavg()[0])
    return rev, best, " -> ".join(f"{x:.1f}" for x in loads)


def run_of(run_dir: str):
    """An existing run's (MLflow run id, tracking URI), from its newest checkpoint."""
    from minimind_ray.store.checkpoint import newest_complete  # lazy: not before a worker's --src (the top)

    meta = newest_complete(run_dir).meta()
    uri = meta.config["tracking"]["uri"] or os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{os.path.abspath('mlflow.db')}"
    return meta.mlflow_run_id, uri


def curve(tracking_uri: str, run_id: str, keys) -> dict:
    """{name after its group ("rl/reward" -> "reward"): {step: value}} of a run's metrics."""
    from mlflow.tracking import MlflowClient

    from minimind_ray.tracking.names import history  # lazy: not before a worker's --src (the top)

    client = MlflowClient(tracking_uri)
    return {k.split("/", 1)[1]: dict(history(client, run_id, k)) for k in keys}


def curve_table(c: dict, size: int = 1) -> None:
    """Curves as a table: a row per step, or the means of every ``size`` steps."""
    steps, rows = sorted(c[next(iter(c))]), []
    for lo in range(0, len(steps), size):
        block = steps[lo:lo + size]
        means = (sum(v.get(s, float("nan")) for s in block) / len(block) for v in c.values())
        rows.append((f"{block[0]}-{block[-1]}" if size > 1 else block[0], *(f"{m:.4g}" for m in means)))
    table(("steps" if size > 1 else "step", *c), rows)


class RLRun(NamedTuple):
    run_dir: str  # the run directory: its newest checkpoint is what the scores evaluate
    run_id: Optional[str]  # MLflow's
    tracking_uri: str
    wall: Optional[float]  # seconds, when trained here


def rl_run(cfg, given: Optional[str]) -> RLRun:
    """An RL demo's run: ``given`` (an existing run directory) as it is, else ``cfg`` trained now and timed."""
    from minimind_ray.raytrain.driver import run  # lazy: not before a worker's --src (the top)

    if given:
        return RLRun(given, *run_of(given), None)
    res, wall = timed(run, cfg)
    return RLRun(res.run_dir, res.mlflow_run_id, res.tracking_uri, wall)


def rl_report(what: str, cfg, run: RLRun, keys, size: int = 1) -> None:
    """An RL demo's run after its scores: its wall time when trained here, and its curves from MLflow (the means of
    every ``size`` steps)."""
    if run.wall is not None:
        print(f"\n{what} run: {cfg.train.max_steps} steps in {run.wall:.0f} s wall (Ray's start, prepare, training, "
              f"export); run {run.run_id}")
    if run.run_id:
        print()
        curve_table(curve(run.tracking_uri, run.run_id, keys), size)


def gen_scores(weights: str, rl, cache_dir: str, data: str, samples: int, limit=None, batch_size: int = 25) -> dict:
    """The eval verb's ``gen`` task on ``data`` at the sampling of the RL section ``rl`` (train.grpo, train.ppo)."""
    from minimind_ray.evals.config import EvalTaskConfig  # lazy: not before a worker's --src (the top)
    from minimind_ray.evals.run import evaluate_task  # lazy: the same

    task = EvalTaskConfig(task="gen", data=data, chat_template=True, samples=samples, max_new_tokens=rl.max_gen_len,
                          temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k, limit=limit,
                          batch_size=batch_size)
    return evaluate_task(weights, task, cache_dir=cache_dir)


def score_table(title: str, before: dict, after: dict, k: int) -> None:
    print(f"\n==== {title} ====\n{'subject':<16} {'n':>5}   {'greedy':>15}   {'pass@1':>15}   {f'pass@{k}':>15}")
    for s in list(before["subjects"]) + ["all"]:
        b, a = (before, after) if s == "all" else (before["subjects"][s], after["subjects"][s])
        row = "   ".join(f"{b[m]:>6.1%} -> {a[m]:>6.1%}" for m in ("greedy_acc", "pass@1", "pass@k"))
        print(f"{s:<16} {b['n']:>5}   {row}")
