"""A local multi-node Ray cluster for tests: free ports, a short state dir, cluster/local/*.sh."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.skip_budget import missing

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "cluster" / "local"
RAY_BIN = Path(sys.executable).parent / "ray"


def _ports_free(ports) -> bool:
    for p in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", p))
        except OSError:
            return False
        finally:
            s.close()
    return True


def _port_range() -> tuple:
    """The base ports this test process may use: pytest-xdist's workers (gw0, gw1, ...) each take their own
    slice of 20000-26000, so two clusters started at once never reach for the same ports (a block spans up
    to base + 900)."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    span = 6000 // count // 100 * 100
    lo = 20000 + index * span
    return lo, lo + span - 1000


def _free_base(worker_nodes: int = 1) -> int:
    """A base port whose whole block (start.sh's layout) is free; below the ephemeral range."""
    lo, hi = _port_range()
    for _ in range(50):
        base = random.randrange(lo, hi, 100)
        block = list(range(base, base + 3)) + [base + 10 + 10 * k + j for k in range(worker_nodes + 1) for j in range(6)]
        block += list(range(base + 500, base + 600 + 100 * worker_nodes))
        if _ports_free(block):
            return base
    missing(f"no free port block for a local cluster in {lo}-{hi} (50 tries; another cluster or service holds them)")


def alive(pid: int) -> bool:
    """Running (zombies, killed but not yet reaped by init, count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def session_pids(sid: int) -> list:
    """The live processes of session ``sid`` (start.sh starts each node in a session of its own)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat=,comm="], capture_output=True, text=True).stdout
    return [int(f[0]) for f in (line.split() for line in out.splitlines())
            if len(f) >= 3 and int(f[1]) == sid and not f[2].startswith("Z")]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def dashboard_json(url: str, timeout: float = 30):
    """GET a Ray dashboard URL as JSON, with the cluster's token: since Ray 2.60 a local cluster starts with token
    authentication (its token in RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), and the
    dashboard's API answers 401 without it."""
    import urllib.request  # lazy: only the tests that read the dashboard

    token = os.environ.get("RAY_AUTH_TOKEN", "")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if not token and path.is_file():
        token = path.read_text().strip()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ray_query(address: str, code: str, timeout: float = 90) -> dict:
    """Run ``code`` in a fresh driver connected to ``address``; it must print one JSON line last."""
    prog = ("import json, time, ray\n"
            f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n" + code)
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                       cwd=tempfile.gettempdir(),  # start.sh's nodes run in token mode: send the token (cluster.env)
                       env=dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "token")))
    assert r.returncode == 0, f"driver failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sh(script: str, *args: str, env: dict, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LOCAL / script), *args], capture_output=True, text=True, env=env, timeout=timeout)


def start_cluster(*args: str, env: dict, tries: int = 3, timeout: float = 600) -> subprocess.CompletedProcess:
    """cluster/local/start.sh, tried again when a node does not come up: on a machine at load average 20-60 (the
    suite's two processes beside a sweep), `ray start` fails now and then ("The current node timed out during
    startup": its raylet has 30 s to register, which no setting changes). start.sh stops what it started
    before it exits, so a retry starts clean. The last try's result, for the caller to assert on."""
    for _ in range(tries):
        r = _sh("start.sh", *args, env=env, timeout=timeout)
        if r.returncode == 0:
            break
    return r


@contextlib.contextmanager
def cluster_state(**extra_env: str):
    """(a fresh short state dir, the environment for start.sh and what runs on the cluster); on exit, whatever
    happened, stop what start.sh started there and drop the state."""
    state = tempfile.mkdtemp(prefix="mmr", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_BIN=str(RAY_BIN),
               # the drivers name the cluster's address: they send its token only in token mode (start.sh)
               RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "token"),
               # GCS declares a silent raylet dead after period x threshold (defaults: ~15 s)
               RAY_health_check_initial_delay_ms="1000", RAY_health_check_period_ms="500",
               RAY_health_check_timeout_ms="1000", RAY_health_check_failure_threshold="4", **extra_env)
    env.pop("RAY_ADDRESS", None)
    try:
        yield state, env
    finally:
        if any(Path(state).glob("*.pid")):
            _sh("stop.sh", "--state-dir", state, "--timeout", "10", env=env, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def cluster_env():
    with cluster_state() as state_env:
        yield state_env
