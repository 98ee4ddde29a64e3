"""cluster/local/*.sh: a head and a worker node on this machine, a node kill, a clean stop.

One cluster for the whole check (starting Ray costs ~10 s per node on 2 cores). Its
ports are picked free, its state lives in a fresh short /tmp dir, and GCS health checks
are made fast so that a killed node is declared dead in seconds, not ~15 s.

"Leaves other Ray processes alone" is checked with decoys: copies of `sleep` named
`raylet` and `gcs_server`, which a global `ray stop` would kill.

The refusals (bad numbers, shell text in paths or in cluster.env, a state dir another
user controls) start no Ray: each must exit 2 with one line, before anything runs.
"""
from __future__ import annotations

import json
import os
import secrets
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

from .local_cluster import _free_base, _sh, start_cluster


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


@pytest.mark.timeout(600)
def test_start_kill_node_stop(cluster_env, decoys):
    state, env = cluster_env
    base = _free_base(1)
    t0 = time.monotonic()
    r = start_cluster("1", "--state-dir", state, "--port", str(base), "--head-cpus", "1",
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

    # cluster.env is valid shell for people who source it, with the values start.sh used
    r = subprocess.run(["bash", "-c", 'source "$1/cluster.env" && echo "$RAY_ADDRESS $RAY_API_SERVER_ADDRESS '
                        '$MMRAY_BASE_PORT $MMRAY_STATE"', "-", state], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == [address, dashboard, str(base), state], (r.stdout, r.stderr)

    # kill_node.sh 1: the worker node's processes are gone at once, the head's are not
    r = _sh("kill_node.sh", "1", "--state-dir", state, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    assert not [p for p in started["w1"] if _alive(p)]
    assert all(_alive(p) for p in (leaders["h"],))
    # ...and Ray notices: one node left, no trainslot
    after = _ray_query(address, WAIT_ONE)
    assert after["alive"] == ["h"] and after["trainslot"] == 0, after

    # start.sh --node 1 reads the cluster's settings back from cluster.env (as data) and
    # brings worker node 1 back with its trainslot
    t2 = time.monotonic()
    r = start_cluster("--node", "1", "--state-dir", state, env=env, timeout=90)
    assert r.returncode == 0, f"start.sh --node 1 failed:\n{r.stdout}\n{r.stderr}"
    leaders["w1 again"] = int((Path(state) / "w1.pid").read_text())
    started["w1 again"] = _session(leaders["w1 again"])
    back = [n for n in _ray_query(address, NODES) if n["alive"]]
    assert sorted(n["name"] for n in back) == ["h", "w1"], back
    assert next(n for n in back if n["name"] == "w1")["res"].get("trainslot") == 1.0, back
    t_node = time.monotonic() - t2

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
          f"{after['waited']:.1f}s, --node 1 and its check {t_node:.1f}s, stop.sh {t_stop:.1f}s")
    assert not (Path(state) / "cluster.env").exists()


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


# ---- refusals: bad input stops the scripts before anything runs ------------------------

def _refused(r: subprocess.CompletedProcess) -> str:
    """The script exited 2 with exactly one `error: ...` line; returns it."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        f"rc={r.returncode}\nstdout:{r.stdout}\nstderr:{r.stderr}"
    return lines[0]


def test_state_dir_with_shell_text_is_refused(cluster_env):
    """The issue's repro, `--state-dir '/tmp/a;touch /tmp/x'`: start.sh used to start the
    cluster and write `MMRAY_STATE=/tmp/a;touch /tmp/x` into cluster.env, which ran
    `touch` for whoever sourced it. Now it is refused before anything is created."""
    _, env = cluster_env
    tag = secrets.token_hex(3)
    marker = Path(f"/tmp/mx{tag}")
    state = f"/tmp/m{tag};touch {marker}"   # 32 chars: within start.sh's length limit
    r = _sh("start.sh", "0", "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert "--state-dir" in err and "only letters, digits" in err, err
    assert not marker.exists(), "the text after ';' ran"
    assert not Path(f"/tmp/m{tag};touch ").exists(), "start.sh created the state dir before refusing it"


@pytest.mark.parametrize("key, hostile", [
    # what start.sh wrote for the issue's --state-dir; `source cluster.env` ran the touch
    ("MMRAY_STATE", "/tmp/a;touch {marker}"),
    # bash arithmetic on this value would run the $(...)
    ("MMRAY_BASE_PORT", "PATH[$(touch {marker})]"),
])
def test_node_restart_reads_cluster_env_as_data(cluster_env, tmp_path, key, hostile):
    """`start.sh --node` used to `source` cluster.env: a planted or edited line ran as code.
    Now each line must be a known field with a value of the right shape."""
    state, env = cluster_env
    marker = tmp_path / "pwned"
    fields = {"RAY_ADDRESS": "127.0.0.1:27000", "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:27001",
              "MMRAY_STATE": state, "MMRAY_BASE_PORT": "27000", "MMRAY_NUM_WORKER_NODES": "1",
              "MMRAY_WORKER_CPUS": "1", "MMRAY_WORKER_GPUS": "0", "MMRAY_SLOT": "trainslot",
              "MMRAY_OBJECT_STORE_MB": "128"}
    fields[key] = hostile.format(marker=marker)
    lines = ["# written by cluster/local/start.sh; source it to talk to this cluster"]
    lines += [("export " if k.startswith("RAY_") else "") + f"{k}={v}" for k, v in fields.items()]
    (Path(state) / "cluster.env").write_text("\n".join(lines) + "\n")
    lineno = 1 + list(fields).index(key) + 1

    r = _sh("start.sh", "--node", "1", "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert f"cluster.env:{lineno}: {key}" in err, err
    assert not marker.exists(), "a value in cluster.env ran as code"
    assert not list(Path(state).glob("*.pid"))


@pytest.mark.parametrize("script, args", [
    ("kill_node.sh", ["1+PATH[$(touch {marker})]"]),          # the node index
    ("start.sh", ["0", "--port", "PATH[$(touch {marker})]"]),
    ("start.sh", ["0", "--timeout", "PATH[$(touch {marker})]"]),
    ("stop.sh", ["--timeout", "PATH[$(touch {marker})]"]),
])
def test_numbers_are_digits_before_any_arithmetic(cluster_env, tmp_path, script, args):
    """`[[ $IDX -ge 1 ]]` and `$((BASE + 1))` evaluate their text: `1+PATH[$(touch f)]` ran touch."""
    state, env = cluster_env
    marker = tmp_path / "pwned"
    r = _sh(script, *[a.format(marker=marker) for a in args], "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert "takes a whole number" in err, err
    assert not marker.exists(), "the argument ran as code"
    assert not list(Path(state).iterdir()), "something was started or written before the refusal"


def _other_uid() -> int:
    return 65534 if os.getuid() != 65534 else 65533   # nobody


def _chown_or_skip(path: str) -> None:
    try:
        os.chown(path, _other_uid(), _other_uid())
    except PermissionError:
        pytest.skip("making a directory another user's needs root (CI runs as root)")


@pytest.mark.parametrize("script, args", [("start.sh", ["1"]), ("stop.sh", []), ("kill_node.sh", ["1"])])
def test_state_dir_owned_by_another_user_is_refused(cluster_env, script, args):
    """Its PID files would be signalled and its cluster.env sourced: another user could plant them."""
    state, env = cluster_env
    _chown_or_skip(state)
    r = _sh(script, *args, "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert f"owned by uid {_other_uid()}" in err and state in err, err
    assert not list(Path(state).iterdir())


def test_state_root_owned_by_another_user_is_refused(cluster_env):
    """A squatted /tmp/mmray-<uid> (the default root for --name): its owner could swap our state dir."""
    _, env = cluster_env
    root = tempfile.mkdtemp(prefix="mmr", dir="/tmp")
    try:
        _chown_or_skip(root)
        r = _sh("start.sh", "1", "--name", "local", env=dict(env, MMRAY_STATE_ROOT=root), timeout=30)
        err = _refused(r)
        assert f"sits in {root}, which uid {_other_uid()} owns" in err, err
        assert not os.listdir(root), "start.sh created its state dir inside the other user's directory"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_world_writable_state_dir_is_refused(cluster_env):
    state, env = cluster_env
    os.chmod(state, 0o777)
    err = _refused(_sh("start.sh", "1", "--state-dir", state, env=env, timeout=30))
    assert "writable by every user" in err, err
    assert not list(Path(state).iterdir())
