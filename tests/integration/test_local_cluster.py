"""cluster/local/*.sh: a head and a worker node on this machine, a node kill, a clean stop.

One cluster for the whole check (starting Ray costs ~10 s per node on 2 cores). Its
ports are picked free, its state lives in a fresh short /tmp dir, and GCS health checks
are made fast so that a killed node is declared dead in seconds, not ~15 s.

"Leaves other Ray processes alone" is checked with decoys: copies of `sleep` named
`raylet` and `gcs_server`, which a global `ray stop` would kill.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

from .local_cluster import _free_base, _sh


def _alive(pid: int) -> bool:
    """Running (zombies, killed but not yet reaped by init, count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _session(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat=,comm="], capture_output=True, text=True).stdout
    return [int(f[0]) for f in (line.split() for line in out.splitlines())
            if len(f) >= 3 and int(f[1]) == sid and not f[2].startswith("Z")]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ray_query(address: str, code: str, timeout: float = 90) -> dict:
    """Run `code` in a fresh driver connected to `address`; it must print one JSON line last."""
    prog = ("import json, time, ray\n"
            f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False)\n" + code)
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0, f"driver failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


NODES = ("nodes = [{'name': n['NodeName'], 'alive': n['Alive'], 'res': n['Resources']} for n in ray.nodes()]\n"
         "print(json.dumps(nodes))\n")
WAIT_ONE = ("t0 = time.time()\n"
            "while True:\n"
            "    alive = [n['NodeName'] for n in ray.nodes() if n['Alive']]\n"
            "    if alive == ['h'] or time.time() - t0 > 60: break\n"
            "    time.sleep(0.25)\n"
            "print(json.dumps({'alive': alive, 'waited': time.time() - t0,\n"
            "                  'trainslot': ray.cluster_resources().get('trainslot', 0)}))\n")


@pytest.fixture
def decoys(tmp_path):
    """Processes named like Ray's that are not ours: stop.sh must not touch them."""
    procs = []
    for name in ("raylet", "gcs_server"):
        exe = tmp_path / name
        shutil.copy("/bin/sleep", exe)
        procs.append(subprocess.Popen([str(exe), "300"]))
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.timeout(240)
def test_start_kill_node_stop(cluster_env, decoys):
    state, env = cluster_env
    base = _free_base(1)
    t0 = time.monotonic()
    r = _sh("start.sh", "1", "--state-dir", state, "--port", str(base), "--head-cpus", "1",
            "--worker-cpus", "1", "--object-store-mb", "128", env=env)
    t_start = time.monotonic() - t0
    assert r.returncode == 0, f"start.sh failed:\n{r.stdout}\n{r.stderr}"
    start_log = r.stderr.strip()
    address = f"127.0.0.1:{base}"
    dashboard = f"http://127.0.0.1:{base + 1}"
    assert f"Ray address:    {address}" in r.stdout and dashboard in r.stdout, r.stdout

    # the job server answers on the printed dashboard URL, bound to loopback only
    with urllib.request.urlopen(f"{dashboard}/api/version", timeout=10) as resp:
        assert json.load(resp)["ray_version"]

    # two live nodes; the worker node has the one trainslot, the head none
    nodes = {n["name"]: n for n in _ray_query(address, NODES)}
    assert set(nodes) == {"h", "w1"} and all(n["alive"] for n in nodes.values()), nodes
    assert nodes["w1"]["res"].get("trainslot") == 1.0 and "trainslot" not in nodes["h"]["res"], nodes

    # what start.sh started: each node's session (gcs_server and raylet among them)
    leaders = {n: int((Path(state) / f"{n}.pid").read_text()) for n in ("h", "w1")}
    started = {n: _session(pid) for n, pid in leaders.items()}
    assert {"gcs_server", "raylet"} <= {_comm(p) for p in started["h"]}, started
    assert "raylet" in {_comm(p) for p in started["w1"]}, started

    # kill_node.sh 1: the worker node's processes are gone at once, the head's are not
    r = _sh("kill_node.sh", "1", "--state-dir", state, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    assert not [p for p in started["w1"] if _alive(p)]
    assert all(_alive(p) for p in (leaders["h"],))
    # ...and Ray notices: one node left, no trainslot
    after = _ray_query(address, WAIT_ONE)
    assert after["alive"] == ["h"] and after["trainslot"] == 0, after

    # stop.sh: every process it started is gone, the decoys are untouched
    t1 = time.monotonic()
    r = _sh("stop.sh", "--state-dir", state, env=env, timeout=90)
    t_stop = time.monotonic() - t1
    assert r.returncode == 0, f"stop.sh failed:\n{r.stdout}\n{r.stderr}"
    left = [p for pids in started.values() for p in pids if _alive(p)]
    left += [p for pid in leaders.values() for p in _session(pid)]
    assert not left, f"still running after stop.sh: {[(p, _comm(p)) for p in left]}"
    assert all(d.poll() is None for d in decoys), "stop.sh killed processes it did not start"
    assert not list(Path(state).glob("*.pid"))
    print(f"\nstart.sh {t_start:.1f}s ({start_log.splitlines()[-2:]}), node declared dead after "
          f"{after['waited']:.1f}s, stop.sh {t_stop:.1f}s")


def test_start_refuses_busy_ports_and_long_state_dir(cluster_env):
    """Fails before starting anything when a port is taken or the socket paths would be too long."""
    state, env = cluster_env
    base = _free_base(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base))
        s.listen()
        r = _sh("start.sh", "1", "--state-dir", state, "--port", str(base), env=env, timeout=30)
    assert r.returncode != 0 and "in use" in r.stderr, r.stderr
    assert not list(Path(state).glob("*.pid"))
    r = _sh("start.sh", "1", "--state-dir", "/tmp/" + "x" * 40, env=env, timeout=30)
    assert r.returncode != 0 and "too long" in r.stderr, r.stderr
