"""The chaos table (issue 16): one tiny run on a local 2-worker-node cluster meets ~10 mixed faults, beside an
uninterrupted twin; one table, and the test fails naming each check that did not hold.

The faults, in the order of the default ``--chaos-events`` (each in its own checkpoint interval):
  raise:0 exit:1 sigkill:1 hang:1 oom:0   train.faults entries: they fire by themselves, once per run
  slow:1                                  a 6 s straggler: must not fail the run
  mlflow                                  the MLflow server stopped, then started again one checkpoint later
  driver                                  the driver SIGKILLed, then the same command run again
  node                                    worker node 2 killed (cluster/local/kill_node.sh), started again
                                          once the run goes on with 1 worker (elastic 1..2 workers)
  sigkill:0                               rank 0 killed, after the node came back
The outside actions (mlflow, driver, node) happen when the sample log shows their step trained, one at a
time: an action waits until the one before it is over (the server or node back up), then acts.

For each: the seconds from the fault (its marker's ``t``, or the moment this test acted) to the
controller's ``detected-*`` record and to the first step after the restore, the step restored and the
steps lost (fault step - restored step - 1; for the actions here, the last step logged before them minus
the restored step). The checks: each fault fired and was restored from (the straggler and the MLflow outage
without a restart), every sample once (sample log), the global batch constant, one MLflow run with each step of
``loss`` once, and the final weights against the twin (bitwise when the world size never changed, else within
the 1-vs-2-worker tolerance of tests/integration/test_training.py).

Run by hand (marker ``soak``; ~15-30 min on 2 busy cores), from the repository root:
    .venv/bin/python -m pytest -m soak -s tests/soak/test_chaos.py [--chaos-events raise:0,driver,...]
                                                                    [--chaos-steps N] [--chaos-no-twin] [--keep]
Everything it starts (cluster, MLflow server, drivers) is stopped at the end, also on failure; ``--keep`` keeps
the work directory (runs, sample logs, driver logs, results.json) for inspection.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.integration.conftest import MlflowServer  # the suite's real `mlflow server`
from tests.integration.local_cluster import RAY_BIN, REPO, _free_base, _sh
from tests.integration.test_training import WEIGHT_ATOL_ACROSS_WORLD_SIZES

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3 * 3600)]
DEFAULT_EVENTS = "raise:0,exit:1,sigkill:1,hang:1,oom:0,slow:1,mlflow,driver,node,sigkill:0"
IN_RUN = ("raise", "exit", "sigkill", "hang", "oom", "slow")
SLOTS = {"mlflow": 2, "driver": 2, "node": 4}  # checkpoint intervals an outside action needs; a fault: 1


class BenchError(RuntimeError):
    """The chaos run could not go on; the message says what it was waiting for."""


@dataclass
class Options:
    events: str = DEFAULT_EVENTS
    steps: int = 0                  # training steps (0: what the events need)
    every: int = 10                 # checkpoint interval (steps)
    slow_s: float = 6.0             # seconds of the slow fault
    pad_s: float = 6.0              # seconds of each straggler that leaves time for the node to rejoin
    collective_timeout: float = 15.0  # train.collective_timeout_s (hang detection)
    resource_timeout: float = 20.0  # cluster.resource_timeout_s
    start_timeout: float = 180.0    # seconds to wait for a Ray node / the MLflow server
    start_tries: int = 4            # tries of cluster/local/start.sh (busy machines)
    run_timeout: float = 3600.0     # seconds for each run
    stall_timeout: float = 420.0    # abort when no step is trained for this long
    no_twin: bool = False           # no uninterrupted twin (no weight comparison)
    workdir: Optional[str] = None   # where runs and logs go (default: a new temporary directory)
    keep: bool = False              # keep the work directory


@dataclass
class Event:
    kind: str                      # a train.faults kind, or mlflow | driver | node
    rank: Optional[int] = None
    step: int = 0                  # the fault's step, or the step that triggers the action
    until: int = 0                 # mlflow: restart once this step is trained; node: start again at it
    t: Optional[float] = None      # when it fired / was done
    t_end: Optional[float] = None  # mlflow back up / node started again
    returning: bool = False        # mlflow / node: being started again
    done: bool = False
    notes: List[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.kind} rank {self.rank}" if self.rank is not None else {
            "mlflow": "MLflow server stopped", "driver": "driver SIGKILLed + rerun",
            "node": "worker node 2 killed"}[self.kind]


def plan(events: str, every: int, slow_s: float, pad_s: float):
    """Events -> (events with steps, train.faults entries, steps needed). Each fault sits mid-interval."""
    out, faults, slot, mid = [], [], 0, every // 2
    for name in events.split(","):
        name, _, at = name.partition("@")
        kind, _, rank = name.partition(":")
        if kind in IN_RUN:
            ev = Event(kind, int(rank or 0), int(at) if at else slot * every + mid)
            faults.append(f"{ev.step}:{kind}:{ev.rank}" + (f":{slow_s:g}" if kind == "slow" else ""))
            slot += 0 if at else 1  # kind:rank@step sits at that step, e.g. inside an outside action
        elif kind in SLOTS:
            ev = Event(kind, None, slot * every + (3 if kind == "mlflow" else mid))
            ev.until = (slot + 1) * every + (3 if kind == "mlflow" else mid)
            if kind == "node":  # stragglers on rank 0 (there at any world size) leave time for the node to rejoin
                faults += [f"{(slot + 2) * every + k}:slow:0:{pad_s:g}" for k in range(1, every)]
            slot += SLOTS[kind]
        else:
            raise ValueError(f"--chaos-events: unknown event {name!r} (kinds: {', '.join(IN_RUN + tuple(SLOTS))})")
        out.append(ev)
    return out, faults, max([(slot + 1) * every] + [e.step + 1 for e in out])


def read_samples(d: Path) -> List[dict]:
    rows = []
    for f in d.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now
    return sorted(rows, key=lambda r: r["t"])


def group_starts(rows: List[dict]) -> List[dict]:
    """First rank-0 line of every worker group (a new attempt, world, or a step that is not the next)."""
    starts, prev = [], None
    for r in (r for r in rows if r["rank"] == 0):
        if prev is None or (r["attempt"], r["world"]) != (prev["attempt"], prev["world"]) or r["step"] != prev["step"] + 1:
            starts.append(r)
        prev = r
    return starts


class Chaos:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="mmr-chaos-")).resolve()
        self.state = tempfile.mkdtemp(prefix="mmrc", dir="/tmp")  # short: Ray's socket paths live under it
        self.env = dict(os.environ, RAY_BIN=str(RAY_BIN), TOKENIZERS_PARALLELISM="false",
                        RAY_TRAIN_ENABLE_PRINT_PATCH="0", MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="false",
                        # the GCS declares a silent raylet dead after period x threshold (defaults: ~15 s)
                        RAY_health_check_initial_delay_ms="1000", RAY_health_check_period_ms="500",
                        RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="4",
                        # the head's dashboard gets 60 s, its modules 30 s each, to start: at load average
                        # 20-30 `ray start --head` failed on these twice in a row
                        RAY_DASHBOARD_STARTUP_TIMEOUT_S=os.environ.get("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "300"),
                        RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT=os.environ.get(
                            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "240"))
        self.env.pop("RAY_ADDRESS", None)
        self.events, self.faults, need = plan(args.events, args.every, args.slow_s, args.pad_s)
        self.steps = args.steps or need
        if self.steps < need:
            raise ValueError(f"--chaos-steps {self.steps}: these events need at least {need} steps")
        self.mlflow = MlflowServer(self.work / "mlflow", start_timeout_s=args.start_timeout)
        self.driver: Optional[subprocess.Popen] = None
        self.cluster_up = False
        self.base = 0
        self.seconds: Dict[str, float] = {}  # wall time of the cluster start, the twin, the chaos run
        self.helpers: List[threading.Thread] = []  # bringing the MLflow server / node 2 back

    # ---------------------------------------------------------------- processes

    def log(self, msg: str) -> None:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def start_cluster(self) -> None:
        # `ray start` gives a raylet 30 s (hard-coded, ray/_private/node.py) to register: at load average 20-30
        # that failed now and then, so start.sh is tried again (it stops what it started when a node fails)
        tries = self.args.start_tries
        for attempt in range(1, tries + 1):
            self.base = _free_base(2)
            t0 = time.monotonic()
            r = _sh("start.sh", "2", "--state-dir", self.state, "--port", str(self.base), "--head-cpus", "2",
                    "--worker-cpus", "1", "--timeout", str(int(self.args.start_timeout)), env=self.env,
                    timeout=3 * self.args.start_timeout)
            self.cluster_up = True  # stop.sh also cleans a half-started cluster
            if r.returncode == 0:
                self.seconds["cluster_start"] = time.monotonic() - t0
                self.log(f"cluster up in {time.monotonic() - t0:.0f}s at 127.0.0.1:{self.base}")
                return
            self.log(f"cluster/local/start.sh 2 failed (try {attempt} of {tries}): {r.stderr.strip()[-300:]}")
        raise BenchError(f"cluster/local/start.sh 2 failed {tries} times (exit {r.returncode}): {r.stderr[-2000:]}")

    def command(self, storage: Path, faults: List[str]) -> List[str]:
        return [sys.executable, "-m", "pipelines.pretrain", "--config", "pipelines/configs/tiny.yaml",
                f"train.max_steps={self.steps}", f"checkpoint.interval={self.args.every}",
                f"checkpoint.storage_path={storage / 'runs'}", f"data.cache_dir={self.work / 'cache'}",
                f"train.sample_log_dir={storage / 'samples'}", f"tracking.uri={self.mlflow.uri}",
                f"cluster.address=127.0.0.1:{self.base}", "cluster.num_workers=2", "cluster.min_workers=1",
                "cluster.worker_resource=trainslot", f"cluster.resource_timeout_s={self.args.resource_timeout:g}",
                "cluster.max_failures=30", f"train.collective_timeout_s={self.args.collective_timeout:g}",
                f"train.faults=[{','.join(faults)}]"]

    def spawn(self, cmd: List[str], log: Path) -> subprocess.Popen:
        """Start a driver in its own session (a SIGKILL of the group is the driver and what it started
        itself, nothing else); its output goes to ``log`` with the time of each line."""
        proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)

        def copy():
            with open(log, "ab") as f:
                f.write(f"[{time.strftime('%H:%M:%S')}] $ {' '.join(cmd[1:])}\n".encode())
                for line in proc.stdout:
                    f.write(time.strftime("[%H:%M:%S] ").encode() + line)
                    f.flush()

        threading.Thread(target=copy, daemon=True).start()
        return proc

    def wait_driver(self, log: Path, timeout: float) -> None:
        try:
            rc = self.driver.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"driver still running after {timeout:.0f}s (log: {log})") from None
        if rc:
            time.sleep(0.5)  # the log copier's last lines
            raise BenchError(f"driver exited with {rc}: {log.read_text(errors='replace')[-3000:]}")

    def kill_driver(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            os.killpg(self.driver.pid, signal.SIGKILL)
            self.driver.wait(timeout=30)

    def cleanup(self) -> None:
        self.kill_driver()
        self.join_helpers()
        if self.cluster_up:
            r = _sh("stop.sh", "--state-dir", self.state, "--timeout", "10", env=self.env, timeout=120)
            if r.returncode:
                print(f"stop.sh failed: {r.stderr[-1000:]}", file=sys.stderr)
        self.mlflow.stop()
        if self.args.keep:  # the nodes' `ray start` logs, for a post-mortem
            for f in Path(self.state).glob("*.log"):
                shutil.copy(f, self.work / f"node-{f.name}")
        shutil.rmtree(self.state, ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            print(f"kept: {self.work}")

    # ---------------------------------------------------------------- the runs

    def run_twin(self) -> Path:
        storage = self.work / "twin"
        log = self.work / "twin.log"
        t0 = time.monotonic()
        self.driver = self.spawn(self.command(storage, []), log)
        self.wait_driver(log, self.args.run_timeout)
        self.seconds["twin"] = time.monotonic() - t0
        self.log(f"twin: {self.steps} steps in {time.monotonic() - t0:.0f}s")
        return storage

    def run_chaos(self) -> Path:
        storage = self.work / "chaos"
        samples = storage / "samples"
        cmd = self.command(storage, self.faults)
        log = self.work / "chaos.log"
        self.driver = self.spawn(cmd, log)
        actions = [e for e in self.events if e.kind in SLOTS]
        deadline = time.monotonic() + self.args.run_timeout
        last_progress, last_step = time.monotonic(), -1
        while True:
            if self.driver.poll() is not None:
                if self.driver.returncode:
                    raise BenchError(f"chaos driver exited with {self.driver.returncode}: "
                                     f"{log.read_text(errors='replace')[-3000:]}")
                break
            rows = read_samples(samples)
            step = rows[-1]["step"] if rows else 0
            if step != last_step:
                last_progress, last_step = time.monotonic(), step
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"chaos run not finished after {self.args.run_timeout:.0f}s (at step {step}; "
                                 f"log: {log})")
            if now - last_progress > self.args.stall_timeout:
                raise BenchError(f"no step trained for {self.args.stall_timeout:.0f}s (last: step {step}); "
                                 f"pending: {[e.label for e in actions if not e.done]}; log: {log}")
            for ev in actions:
                self.act(ev, rows, cmd, log)
                if not ev.done:
                    break  # one outside action at a time: the next waits until this one is over
            time.sleep(0.2)
        self.join_helpers()
        return storage

    def join_helpers(self) -> None:
        for t in self.helpers:
            t.join(timeout=3 * self.args.start_timeout)

    def act(self, ev: Event, rows: List[dict], cmd: List[str], log: Path) -> None:
        """Do an outside action once the sample log shows its step trained (by the group now running)."""
        if ev.done or not rows:
            return
        newest = rows[-1]
        if ev.t is None and newest["step"] >= ev.step:
            ev.t = time.time()
            ev.notes.append(f"acted after step {newest['step']}")
            self.log(f"{ev.label} after step {newest['step']}")
            if ev.kind == "mlflow":
                self.mlflow.stop()
            elif ev.kind == "driver":
                self.kill_driver()
                self.driver = self.spawn(cmd, log)  # the same command again: resume=auto finds the run
                ev.t_end, ev.done = time.time(), True
            elif ev.kind == "node":
                r = _sh("kill_node.sh", "2", "--state-dir", self.state, env=self.env, timeout=60)
                if r.returncode:
                    raise BenchError(f"kill_node.sh 2 failed: {r.stderr[-1000:]}")
        elif ev.t is not None and not ev.returning and newest["step"] >= ev.until and newest["t"] > ev.t:
            if ev.kind == "node" and newest["world"] != 1:
                return  # start it again only once the run goes on without it
            ev.returning = True
            ev.notes.append(f"back after step {newest['step']}")
            # in a thread: starting takes 10-60 s, and the run (and the next actions) go on meanwhile
            self.helpers.append(threading.Thread(target=self.bring_back, args=(ev,), daemon=True))
            self.helpers[-1].start()

    def bring_back(self, ev: Event) -> None:
        """Start the MLflow server or worker node 2 again; ``ev.t_end``: when it is up."""
        try:
            if ev.kind == "mlflow":
                self.log("MLflow server starting again")
                self.mlflow.start()
            else:
                for attempt in range(1, self.args.start_tries + 1):  # see start_cluster
                    self.log(f"worker node 2 starting again (try {attempt})")
                    r = _sh("start.sh", "--node", "2", "--state-dir", self.state, "--timeout",
                            str(int(self.args.start_timeout)), env=self.env, timeout=2 * self.args.start_timeout)
                    if r.returncode == 0:
                        break
                else:
                    raise RuntimeError(f"start.sh --node 2 failed: {r.stderr.strip()[-300:]}")
            ev.t_end = time.time()
            self.log("MLflow server up again" if ev.kind == "mlflow" else "worker node 2 up again")
        except Exception as e:  # noqa: BLE001 - noted in the table; the run goes on without it
            ev.notes.append(str(e))
            self.log(f"{ev.label}: could not bring it back: {e}")
        finally:
            ev.done = True

    # ---------------------------------------------------------------- the report

    def report(self, chaos: Path, twin: Optional[Path]) -> dict:
        import torch

        from minimind_ray.config import load_config, run_identity
        from minimind_ray.raytrain.faults import fired
        from minimind_ray.store.checkpoint import MODEL, checkpoints_in

        name = run_identity(load_config("pipelines/configs/tiny.yaml", self.command(chaos, [])[5:]))
        run_dir = chaos / "runs" / name
        marks = fired(str(run_dir))
        detections = sorted(v["t"] for k, v in marks.items() if k.startswith("detected-"))
        rows = read_samples(chaos / "samples")
        starts = group_starts(rows)
        table = []

        used = set()

        def restart_after(t):
            g = next((g for g in starts if g["t"] > t), None)
            if g is not None:
                used.add(g["t"])
            return g

        seen_failures = set()

        def detected_after(t, until=None):
            d = next((x for x in detections if x >= t), None)
            if d is None or (until is not None and d > until):
                return None
            seen_failures.add(d)
            return d

        for i, ev in enumerate(self.events):
            row = {"event": ev.label, "step": ev.step, "detect_s": None, "recover_s": None, "restored": None,
                   "lost": None, "world": None, "notes": list(ev.notes)}
            if ev.kind in IN_RUN:
                m = marks.get(f"{ev.step}-{ev.kind}-{ev.rank}")
                if m is None:
                    row["notes"].append("did not fire (no such rank then?)")
                    table.append(row)
                    continue
                ev.t = m["t"]
            if ev.t is None:
                row["notes"].append("not reached")
                table.append(row)
                continue
            nxt = min((e.t for e in self.events[i + 1:] if e.t), default=None)
            if ev.kind in ("slow", "mlflow"):  # must not restart anything
                window_end = nxt or float("inf")
                restarts = [g for g in starts if ev.t < g["t"] < window_end]
                row["notes"].append("no restart" if not restarts else f"{len(restarts)} restart(s)!")
                if ev.kind == "mlflow" and ev.t_end:
                    during = [r for r in rows if r["rank"] == 0 and ev.t < r["t"] < ev.t_end]
                    row["notes"].append(f"down {ev.t_end - ev.t:.0f}s, {len(during)} steps trained meanwhile")
                    if ev.t_end > rows[-1]["t"]:  # the run ended with the server down: nothing could send its points
                        row["notes"].append("back only after the last step: give the run steps or events after it")
                table.append(row)
                continue
            g = restart_after(ev.t)
            if g is None:
                row["notes"].append("no restart seen")
                table.append(row)
                continue
            d = detected_after(ev.t, g["t"])
            row.update(detect_s=None if d is None else d - ev.t, recover_s=g["t"] - ev.t, restored=g["attempt"],
                       world=g["world"])
            last = ev.step - 1 if ev.kind in IN_RUN else max(
                (r["step"] for r in rows if r["rank"] == 0 and r["t"] < ev.t), default=0)
            row["lost"] = last - g["attempt"]
            if ev.kind == "driver":
                row["notes"].append("detection: the user reruns (here at once)")
            table.append(row)
            if ev.kind == "node" and ev.t_end:
                grow = next((r for r in rows if r["rank"] == 0 and r["t"] > ev.t_end and r["world"] == 2), None)
                back = {"event": "worker node 2 started again", "step": ev.until, "detect_s": None,
                        "recover_s": None, "restored": None, "lost": None, "world": None, "notes": []}
                if grow is None:
                    back["notes"].append("the group did not grow back to 2 workers before the run ended")
                else:
                    before = max((r["step"] for r in rows if r["rank"] == 0 and r["t"] < grow["t"]), default=0)
                    used.add(grow["t"])
                    back.update(recover_s=grow["t"] - ev.t_end, restored=grow["attempt"], world=2,
                                lost=before - grow["attempt"])
                    back["notes"].append("grew back: a resize restarts the group from the newest checkpoint")
                table.append(back)

        # every sample once, the global batch constant
        per_step: Dict[int, set] = {}
        for r in rows:
            per_step.setdefault(r["step"], set()).update(r["ids"])
        seen, repeats, sizes = set(), [], set()
        for s in sorted(per_step):
            sizes.add(len(per_step[s]))
            if per_step[s] & seen:
                repeats.append(s)
            seen |= per_step[s]
        exactly_once = sorted(per_step) == list(range(1, self.steps + 1)) and not repeats and len(sizes) == 1
        worlds = [r["world"] for r in rows if r["rank"] == 0]
        world_path = [w for k, w in enumerate(worlds) if k == 0 or w != worlds[k - 1]]

        # one MLflow run, each step once
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.mlflow.uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  filter_string=f"tags.`minimind.run_name` = '{name}'")
        runs = [r for r in runs if str(chaos) in r.data.tags.get("minimind.storage", "")]
        steps_logged = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")) if runs else []
        twice = sorted({s for s in steps_logged if steps_logged.count(s) > 1})
        missing = sorted(set(range(1, self.steps + 1)) - set(steps_logged))

        weights = {"compared": False}
        if twin is not None:
            w = torch.load(Path(dict(checkpoints_in(run_dir))[self.steps]) / MODEL, weights_only=True)
            tw = torch.load(Path(dict(checkpoints_in(twin / "runs" / name))[self.steps]) / MODEL, weights_only=True)
            diff = max((w[k] - tw[k]).abs().max().item() for k in tw)
            bitwise = all(torch.equal(w[k], tw[k]) for k in tw)
            same_world = set(worlds) == {2}
            weights = {"compared": True, "bitwise": bitwise, "max_abs_diff": diff, "same_world": same_world,
                       "ok": bitwise if same_world else diff <= WEIGHT_ATOL_ACROSS_WORLD_SIZES}
        return {"steps": self.steps, "every": self.args.every, "faults": self.faults, "table": table,
                "events": [dataclasses.asdict(e) for e in self.events],  # with their times, for a post-mortem
                "exactly_once": exactly_once, "repeated_steps": repeats, "global_batch_sizes": sorted(sizes),
                "world_path": world_path, "restarts": len(starts) - 1, "detections": len(detections),
                "unexplained_restarts": [{k: g[k] for k in ("t", "step", "attempt", "world")}
                                         for g in starts[1:] if g["t"] not in used],
                # e.g. a collective of a starting group timing out on an overloaded machine
                "unexplained_failures": len(set(detections) - seen_failures),
                "seconds": self.seconds,
                "mlflow_runs": len(runs), "mlflow_steps_twice": twice, "mlflow_steps_missing": missing,
                "weights": weights, "load": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}


def fmt(v, spec="{:.1f}"):
    return "-" if v is None else spec.format(v)


def print_report(r: dict) -> None:
    print(f"\nChaos run: tiny preset, {r['steps']} steps, checkpoint every {r['every']}, 2 worker nodes "
          f"(elastic 1..2 workers); {r['date']}, load average {r['load'][0]:.1f}")
    print("| # | step | fault | detected (s) | to first step after restore (s) | restored from | steps lost "
          "| world after | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, row in enumerate(r["table"], 1):
        print(f"| {i} | {row['step']} | {row['event']} | {fmt(row['detect_s'])} | {fmt(row['recover_s'])} | "
              f"{fmt(row['restored'], '{}')} | {fmt(row['lost'], '{}')} | {fmt(row['world'], '{}')} | "
              f"{'; '.join(row['notes'])} |")
    w = r["weights"]
    if w["compared"]:
        how = ("bitwise" if w["same_world"] else f"world size changed: tolerance {WEIGHT_ATOL_ACROSS_WORLD_SIZES:g}")
        print(f"| | {r['steps']} | final weights vs the uninterrupted twin ({how}) | | | | | | "
              f"{'equal' if w['bitwise'] else 'max |diff| %.3g' % w['max_abs_diff']}: "
              f"{'OK' if w['ok'] else 'FAIL'} |")
    print(f"\nworker group starts after the first: {r['restarts']}; controller failure records: {r['detections']}; "
          f"restarts no fault explains: {r['unexplained_restarts'] or 'none'}; failure records no fault explains: "
          f"{r['unexplained_failures']} (the driver log says what failed)")
    print("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in r["seconds"].items()))
    print(f"world size over the run: {' -> '.join(map(str, r['world_path']))}")
    print(f"every sample exactly once: {'yes' if r['exactly_once'] else 'NO'} (samples per step: "
          f"{r['global_batch_sizes']}; steps repeating samples: {r['repeated_steps'] or 'none'})")
    print(f"MLflow: {r['mlflow_runs']} run(s); loss steps logged twice: {r['mlflow_steps_twice'] or 'none'}; "
          f"missing: {r['mlflow_steps_missing'] or 'none'}")


def failures(r: dict) -> List[str]:
    """The checks of the report that did not hold, one line each."""
    bad = [f"{row['event']} (step {row['step']}): {note}" for row in r["table"] for note in row["notes"]
           if note.startswith(("did not fire", "not reached", "no restart seen", "the group did not grow back",
                               "back only after the last step"))
           or note.endswith("restart(s)!")]
    bad += [] if r["exactly_once"] else [f"samples not trained exactly once (repeating steps {r['repeated_steps']}, "
                                         f"samples per step {r['global_batch_sizes']})"]
    bad += [] if r["mlflow_runs"] == 1 else [f"{r['mlflow_runs']} MLflow runs, not 1"]
    bad += [f"MLflow loss of steps {r[k]} {what}" for k, what in (("mlflow_steps_twice", "logged twice"),
                                                                    ("mlflow_steps_missing", "missing")) if r[k]]
    w = r["weights"]
    bad += [] if not w["compared"] or w["ok"] else [f"final weights differ from the twin's by {w['max_abs_diff']:.3g}"]
    return bad


def test_a_run_survives_every_fault_of_the_chaos_schedule(request):
    get = request.config.getoption
    opts = Options(events=get("--chaos-events", None) or DEFAULT_EVENTS, steps=get("--chaos-steps", 0),
                   no_twin=get("--chaos-no-twin", False), keep=get("--keep", False))
    run = Chaos(opts)
    run.log(f"work dir {run.work}; {run.steps} steps; train.faults={run.faults}")
    try:
        (run.work / "mlflow").mkdir(parents=True, exist_ok=True)
        failed: List[BaseException] = []

        def start_mlflow():
            try:
                run.mlflow.start()
            except BaseException as e:  # noqa: BLE001 - raised below, in the main thread
                failed.append(e)

        server = threading.Thread(target=start_mlflow)  # ~10-60 s, while the cluster starts
        server.start()
        run.start_cluster()
        server.join()
        if failed:
            raise BenchError(f"the MLflow server did not start: {failed[0]}")
        twin = None if opts.no_twin else run.run_twin()
        t0 = time.monotonic()
        chaos = run.run_chaos()
        run.seconds["chaos"] = time.monotonic() - t0
        run.log(f"chaos run: {run.steps} steps in {time.monotonic() - t0:.0f}s")
        result = run.report(chaos, twin)
        (run.work / "results.json").write_text(json.dumps(result, indent=1, default=str))
        print_report(result)
    finally:
        run.cleanup()
    assert not failures(result), "checks that did not hold:\n" + "\n".join(failures(result))
